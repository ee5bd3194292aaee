"""Each tangent layer against ``torch.func.jvp`` of the plain layer (float64, rel. error <= 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn
from torch.func import functional_call, jvp

from core.errors import ConfigError, DataError
from core.tangent.layers import (
    TangentAttention,
    TangentEmbeddings,
    TangentGELU,
    TangentLayerNorm,
    TangentLayerScale,
    TangentLinear,
    TangentPatchEmbedding,
    gelu_derivative,
    tangent_add,
)
from core.tangent.model import linearize_block
from tests.core.tangent.tiny import tiny_config

DT = torch.float64
TOL = 1e-5


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def randomize_deltas(mod: nn.Module, gen: torch.Generator, scale: float = 0.1) -> dict[str, Tensor]:
    """Fill every ``d_*`` parameter with noise; return them by name."""
    out = {}
    with torch.no_grad():
        for n, p in mod.named_parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            out[n] = p.detach().clone()
    return out


def check(y: Tensor, j: Tensor, y_ref: Tensor, j_ref: Tensor) -> None:
    assert rel_err(y, y_ref) <= TOL
    assert rel_err(j, j_ref) <= TOL


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_linear_matches_func_jvp(gen: torch.Generator) -> None:
    w, b = torch.randn(5, 4, generator=gen, dtype=DT), torch.randn(5, generator=gen, dtype=DT)
    x, jx = torch.randn(2, 3, 4, generator=gen, dtype=DT), torch.randn(2, 3, 4, generator=gen, dtype=DT)
    lay = TangentLinear(w, b)
    d = randomize_deltas(lay, gen)
    y, j = lay(x, jx)
    y_ref, j_ref = jvp(F.linear, (x, w, b), (jx, d["d_weight"], d["d_bias"]))
    check(y, j, y_ref, j_ref)
    # fused [W; dW] path == unfused slow formula (eq. 11)
    slow = jx @ w.T + x @ d["d_weight"].T + d["d_bias"]
    assert rel_err(j, slow) <= 1e-12
    # zero input tangent
    _y0, j0 = lay(x, None)
    _, j0_ref = jvp(F.linear, (x, w, b), (torch.zeros_like(x), d["d_weight"], d["d_bias"]))
    assert rel_err(j0, j0_ref) <= TOL


def test_linear_without_bias(gen: torch.Generator) -> None:
    w = torch.randn(3, 4, generator=gen, dtype=DT)
    lay = TangentLinear(w, None)
    d = randomize_deltas(lay, gen)
    x, jx = torch.randn(6, 4, generator=gen, dtype=DT), torch.randn(6, 4, generator=gen, dtype=DT)
    y, j = lay(x, jx)
    y_ref, j_ref = jvp(lambda x, w: F.linear(x, w), (x, w), (jx, d["d_weight"]))
    check(y, j, y_ref, j_ref)


def test_deltas_are_zero_parameters_and_weights_frozen_buffers(gen: torch.Generator) -> None:
    lay = TangentLayerNorm(torch.ones(4, dtype=DT), torch.zeros(4, dtype=DT), 1e-6)
    assert {n for n, _ in lay.named_parameters()} == {"d_weight", "d_bias"}
    assert all(float(p.abs().max()) == 0.0 for p in lay.parameters())
    assert {n for n, _ in lay.named_buffers()} == {"weight", "bias"}
    assert lay.source_names == {"d_weight": "weight", "d_bias": "bias"}


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_layernorm_matches_func_jvp(gen: torch.Generator, eps: float) -> None:
    g, b = 1 + torch.randn(6, generator=gen, dtype=DT), torch.randn(6, generator=gen, dtype=DT)
    x, jx = 3 * torch.randn(2, 5, 6, generator=gen, dtype=DT), torch.randn(2, 5, 6, generator=gen, dtype=DT)
    lay = TangentLayerNorm(g, b, eps)
    d = randomize_deltas(lay, gen)

    def ln(x: Tensor, g: Tensor, b: Tensor) -> Tensor:
        return F.layer_norm(x, (6,), g, b, eps)

    y, j = lay(x, jx)
    y_ref, j_ref = jvp(ln, (x, g, b), (jx, d["d_weight"], d["d_bias"]))
    check(y, j, y_ref, j_ref)
    _, j0 = lay(x, None)
    _, j0_ref = jvp(ln, (x, g, b), (torch.zeros_like(x), d["d_weight"], d["d_bias"]))
    assert rel_err(j0, j0_ref) <= TOL


def test_gelu_matches_func_jvp(gen: torch.Generator) -> None:
    x, jx = 3 * torch.randn(4, 7, generator=gen, dtype=DT), torch.randn(4, 7, generator=gen, dtype=DT)
    x[0, 0] = 0.0
    y, j = TangentGELU()(x, jx)
    y_ref, j_ref = jvp(F.gelu, (x,), (jx,))
    check(y, j, y_ref, j_ref)
    assert float(gelu_derivative(torch.zeros((), dtype=DT))) == 0.5
    _, j0 = TangentGELU()(x, None)
    assert float(j0.abs().max()) == 0.0


def test_layer_scale_matches_func_jvp(gen: torch.Generator) -> None:
    lam = torch.randn(6, generator=gen, dtype=DT)
    lay = TangentLayerScale(lam)
    d = randomize_deltas(lay, gen)
    x, jx = torch.randn(2, 3, 6, generator=gen, dtype=DT), torch.randn(2, 3, 6, generator=gen, dtype=DT)
    y, j = lay(x, jx)
    y_ref, j_ref = jvp(lambda x, l: x * l, (x, lam), (jx, d["d_lambda1"]))
    check(y, j, y_ref, j_ref)


def test_tangent_add() -> None:
    a, b = (torch.ones(2), 2 * torch.ones(2)), (3 * torch.ones(2), 4 * torch.ones(2))
    y, j = tangent_add(a, b)
    assert torch.equal(y, 4 * torch.ones(2)) and torch.equal(j, 6 * torch.ones(2))


def jitter_(mod: nn.Module, gen: torch.Generator, scale: float = 0.1) -> nn.Module:
    """Move every weight off its special init (LN=1/0, layer-scale=1) so each JVP term matters."""
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return mod


def test_attention_matches_hf_attention_jvp(gen: torch.Generator) -> None:
    """Multi-head attention (eq. 6-8) vs ``torch.func.jvp`` through HF ``Dinov2Attention``."""
    hf = jitter_(transformers.models.dinov2.modeling_dinov2.Dinov2Attention(tiny_config()).to(DT).eval(), gen, 0.3)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    lay = TangentAttention(*(TangentLinear.from_module(getattr(hf, n)) for n in names), num_heads=2)
    d = randomize_deltas(lay, gen)
    x, jx = torch.randn(2, 5, 32, generator=gen, dtype=DT), torch.randn(2, 5, 32, generator=gen, dtype=DT)
    prim = {f"{n}.{s}": getattr(getattr(hf, n), s).detach() for n in names for s in ("weight", "bias")}
    tang = {f"{n}.{s}": d[f"{n[0]}.d_{s}"] for n in names for s in ("weight", "bias")}

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(hf, p, (x,))[0]

    y, j = lay(x, jx)
    y_ref, j_ref = jvp(f, (prim, x), (tang, jx))
    check(y, j, y_ref, j_ref)


def test_patch_embedding_and_embeddings_match_func_jvp(gen: torch.Generator) -> None:
    cfg = tiny_config(num_channels=2)
    hf = jitter_(transformers.models.dinov2.modeling_dinov2.Dinov2Embeddings(cfg).to(DT).eval(), gen)
    conv = hf.patch_embeddings.projection
    pix = torch.randn(3, 2, 28, 28, generator=gen, dtype=DT)

    pe = TangentPatchEmbedding(conv)
    d = randomize_deltas(pe, gen)
    y, j = pe(pix)

    def conv_tokens(w: Tensor, b: Tensor) -> Tensor:
        return F.conv2d(pix, w, b, stride=7).flatten(2).transpose(1, 2)  # (B, D, 4, 4) -> (B, 16, D)

    y_ref, j_ref = jvp(
        conv_tokens,
        (conv.weight.detach(), conv.bias.detach()),
        (d["linear.d_weight"].view_as(conv.weight), d["linear.d_bias"]),
    )
    check(y, j, y_ref, j_ref)

    emb = TangentEmbeddings(TangentPatchEmbedding(conv), hf.cls_token, hf.position_embeddings)
    d = randomize_deltas(emb, gen)
    prim = {n: p.detach() for n, p in hf.named_parameters() if n != "mask_token"}
    tang = {
        "cls_token": d["d_cls_token"],
        "position_embeddings": d["d_position_embeddings"],
        "patch_embeddings.projection.weight": d["patch.linear.d_weight"].view_as(conv.weight),
        "patch_embeddings.projection.bias": d["patch.linear.d_bias"],
    }
    y, j = emb(pix)
    y_ref, j_ref = jvp(lambda p: functional_call(hf, p, (pix,)), (prim,), (tang,))
    check(y, j, y_ref, j_ref)
    with pytest.raises(DataError, match="patches"):
        emb(torch.randn(1, 2, 35, 35, dtype=DT))


def test_patch_embedding_rejects_overlapping_conv() -> None:
    with pytest.raises(ConfigError, match="stride"):
        TangentPatchEmbedding(nn.Conv2d(1, 4, kernel_size=4, stride=2))


@pytest.mark.parametrize("kind", ["dinov2", "vit"])
def test_block_matches_hf_block_jvp(gen: torch.Generator, kind: str) -> None:
    """A whole linearised block (LN, attention, layer-scale, GELU MLP, residuals) vs HF's block."""
    if kind == "dinov2":
        hf = transformers.models.dinov2.modeling_dinov2.Dinov2Layer(tiny_config())
    else:
        hf = transformers.models.vit.modeling_vit.ViTLayer(tiny_config(transformers.ViTConfig))
    hf = jitter_(hf.to(DT).eval(), gen)
    tb, mapping = linearize_block(hf)
    d = randomize_deltas(tb, gen)
    assert set(mapping) == set(d) and set(mapping.values()) == {n for n, _ in hf.named_parameters()}
    prim = {n: p.detach() for n, p in hf.named_parameters()}
    by_src = {mapping[n]: t for n, t in d.items()}
    tang = {n: by_src[n] for n in prim}  # same key order as the primals
    x, jx = torch.randn(2, 17, 32, generator=gen, dtype=DT), torch.randn(2, 17, 32, generator=gen, dtype=DT)
    y, j = tb(x, jx)
    y_ref, j_ref = jvp(lambda p, x: functional_call(hf, p, (x,)), (prim, x), (tang, jx))
    check(y, j, y_ref, j_ref)
    _, j0 = tb(x, None)
    _, j0_ref = jvp(lambda p: functional_call(hf, p, (x,)), (prim,), (tang,))
    assert rel_err(j0, j0_ref) <= TOL


def test_block_rejects_unsupported_modules() -> None:
    with pytest.raises(ConfigError, match="Dinov2SwiGLUFFN"):
        linearize_block(transformers.models.dinov2.modeling_dinov2.Dinov2Layer(tiny_config(use_swiglu_ffn=True)))
    with pytest.raises(ConfigError, match="NewGELUActivation"):
        linearize_block(transformers.models.dinov2.modeling_dinov2.Dinov2Layer(tiny_config(hidden_act="gelu_new")))
    with pytest.raises(ConfigError, match="Linear.*Dinov2Layer"):
        linearize_block(nn.Linear(2, 2))
