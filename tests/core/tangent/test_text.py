"""Tangent GPT-2 layers and TangentTextModel against torch.func.jvp of the HF modules (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.func import functional_call, jvp
from transformers.activations import ACT2FN
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Block
from transformers.pytorch_utils import Conv1D

from core.errors import ConfigError, DataError
from core.tangent.compose import compose, remove_component
from core.tangent.text import (
    TangentConv1D,
    TangentTanhGELU,
    TangentTextModel,
    attention_allowed,
    gelu_tanh_derivative,
    linearize_gpt2_block,
    tangent_masked_softmax,
)

DT = torch.float64
TOL = 1e-5
D, C, VOCAB = 16, 4, 50


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rand(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def tiny_gpt2_config(**kw: object) -> transformers.GPT2Config:
    base = {"vocab_size": VOCAB, "n_positions": 32, "n_embd": D, "n_layer": 3, "n_head": 2, "n_inner": 32}
    base.update(kw)
    cfg = transformers.GPT2Config(**base)
    cfg._attn_implementation = "eager"  # forward-mode AD has no CPU SDPA kernel
    return cfg


def perturb_(m: nn.Module, seed: int) -> nn.Module:
    """Move weights off their init (LN 1/0, std 0.02) so every term of the JVP matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return m.eval()


def tiny_gpt2(seed: int = 0, **kw: object) -> transformers.GPT2Model:
    torch.manual_seed(seed)
    return perturb_(transformers.GPT2Model(tiny_gpt2_config(**kw)).to(DT), seed + 1)


def random_tangent_deltas(mod: nn.Module, seed: int, scale: float = 0.1) -> dict[str, Tensor]:
    """Fill every ``d_*`` parameter with noise; return them by name."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for n, p in mod.named_parameters():
            p.copy_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            out[n] = p.detach().clone()
    return out


def hf_jvp(
    module: nn.Module, names: dict[str, str], deltas: dict[str, Tensor], args: tuple, jx: Tensor | None
):
    """(y, jvp) of ``module(*args)`` w.r.t. (params named by ``names`` values, ``args[0]``)."""
    params = dict(module.named_parameters())
    prim = {names[n]: params[names[n]].detach() for n in deltas}
    tang = {names[n]: deltas[n] for n in deltas}
    x, rest = args[0], args[1:]
    jx = torch.zeros_like(x) if jx is None else jx

    def f(p: dict[str, Tensor], x: Tensor) -> Tensor:
        out = functional_call(module, p, (x, *rest))
        return out[0] if isinstance(out, tuple) else out

    return jvp(f, (prim, x), (tang, jx))


def additive(allowed: Tensor) -> Tensor:
    return torch.zeros(allowed.shape, dtype=DT).masked_fill(~allowed, torch.finfo(DT).min)


RIGHT_PAD = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
LEFT_PAD = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


# ---------------------------------------------------------------------------------------- layers
def test_conv1d_matches_func_jvp_and_keeps_hf_layout() -> None:
    conv = perturb_(Conv1D(5, 4).to(DT), 0)
    lay = TangentConv1D.from_module(conv)
    d = random_tangent_deltas(lay, 1)
    assert d["d_weight"].shape == conv.weight.shape == (4, 5)  # HF (in, out)
    x, jx = rand(2, 3, 4, seed=2), rand(2, 3, 4, seed=3)
    for tx in (jx, None):
        y, j = lay(x, tx)
        y_ref, j_ref = hf_jvp(conv, lay.source_names, d, (x,), tx)
        assert rel_err(y, y_ref) <= TOL and rel_err(j, j_ref) <= TOL
    # unfused eq. 11 with the transposed (Conv1D) weight
    assert rel_err(lay(x, jx)[1], jx @ conv.weight + x @ d["d_weight"] + d["d_bias"]) <= 1e-12


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_fast"])
def test_tanh_gelu_matches_func_jvp(act: str) -> None:
    hf = ACT2FN[act]
    _blk, _ = linearize_gpt2_block(GPT2Block(tiny_gpt2_config(activation_function=act), layer_idx=0).to(DT))
    lay = _blk.mlp.act
    assert isinstance(lay, TangentTanhGELU)
    x = torch.cat([rand(200, seed=4, scale=3.0), torch.tensor([0.0, -8.0, 8.0], dtype=DT)])
    jx = rand(203, seed=5)
    y, j = lay(x, jx)
    y_ref, j_ref = jvp(hf, (x,), (jx,))
    assert rel_err(y, y_ref) <= 1e-12 and rel_err(j, j_ref) <= TOL
    y0, j0 = lay(x, None)
    assert torch.equal(y0, y) and float(j0.abs().max()) == 0
    assert float(gelu_tanh_derivative(torch.zeros(1, dtype=DT))) == 0.5


def test_masked_softmax_jvp_is_exact_and_zero_on_masked_keys() -> None:
    allowed = attention_allowed(LEFT_PAD, 6)  # (2, 1, 6, 6); row 1 has padding queries with no key
    s, js = rand(2, 2, 6, 6, seed=6, scale=3.0), rand(2, 2, 6, 6, seed=7)
    a, ja = tangent_masked_softmax(s, js, allowed)
    allowed = allowed.expand_as(s)
    assert float(a[~allowed].abs().max()) == 0 and float(ja[~allowed].abs().max()) == 0

    def ref(s: Tensor) -> Tensor:
        return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)

    a_ref, ja_ref = jvp(ref, (s,), (js,))
    rows = allowed.any(-1)  # queries with at least one key
    assert rel_err(a[rows], a_ref[rows]) <= 1e-12 and rel_err(ja[rows], ja_ref[rows]) <= 1e-12
    assert float(a[~rows].abs().max()) == 0 and float(ja[~rows].abs().max()) == 0  # no NaN rows
    assert torch.allclose(a.sum(-1)[rows], torch.ones((), dtype=DT), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "flags",
    [{}, {"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True}],
    ids=["default", "unscaled", "inverse_layer_idx"],
)
@pytest.mark.parametrize("mask", [None, RIGHT_PAD], ids=["causal", "right_pad"])
def test_attention_matches_func_jvp_of_gpt2_attention(flags: dict, mask: Tensor | None) -> None:
    block = perturb_(GPT2Block(tiny_gpt2_config(**flags), layer_idx=2).to(DT), 8)
    hf: GPT2Attention = block.attn
    tb, mapping = linearize_gpt2_block(block)
    lay = tb.attn
    assert lay.scale == pytest.approx(hf.scaling)
    d = random_tangent_deltas(lay, 9)
    names = {n: mapping[f"attn.{n}"].removeprefix("attn.") for n in d}
    x, jx = rand(2, 6, D, seed=10), rand(2, 6, D, seed=11)
    allowed = attention_allowed(mask, 6)
    y, j = lay(x, jx, allowed)
    y_ref, j_ref = hf_jvp(hf, names, d, (x, None, additive(allowed)), jx)
    assert rel_err(y, y_ref) <= TOL and rel_err(j, j_ref) <= TOL


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu"])
def test_block_matches_func_jvp_of_gpt2_block(act: str) -> None:
    block = perturb_(GPT2Block(tiny_gpt2_config(activation_function=act), layer_idx=0).to(DT), 12)
    tb, mapping = linearize_gpt2_block(block)
    assert set(mapping.values()) == {n for n, _ in block.named_parameters()}
    d = random_tangent_deltas(tb, 13)
    x, jx = rand(2, 6, D, seed=14), rand(2, 6, D, seed=15)
    allowed = attention_allowed(RIGHT_PAD, 6)
    for tx in (jx, None):
        y, j = tb(x, tx, allowed)
        y_ref, j_ref = hf_jvp(block, mapping, d, (x, None, additive(allowed)), tx)
        assert rel_err(y, y_ref) <= TOL and rel_err(j, j_ref) <= TOL


# ---------------------------------------------------------------------------------------- model
class Reference(nn.Module):
    """The plain model f(x; w): GPT2Model -> hidden state of the last real token -> linear head."""

    def __init__(self, transformer: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.transformer, self.head = transformer, head

    def forward(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.transformer(ids, attention_mask=mask).last_hidden_state  # (B, N, D)
        last = (
            torch.full((ids.shape[0],), ids.shape[1] - 1) if mask is None else mask.sum(-1) - 1
        )  # right pad
        return self.head(h[torch.arange(ids.shape[0]), last])


def make(k: int = 1, **kw: object) -> tuple[TangentTextModel, Reference]:
    gpt = tiny_gpt2()
    head = nn.Linear(D, C).to(DT)
    with torch.no_grad():
        head.weight.copy_(rand(C, D, seed=20, scale=0.5))
        head.bias.copy_(rand(C, seed=21, scale=0.5))
    ref = Reference(copy.deepcopy(gpt), copy.deepcopy(head))
    return TangentTextModel(gpt, num_classes=C, k=k, head=head, **kw), ref


def random_delta(tm: TangentTextModel, scale: float, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(t.shape, generator=gen, dtype=DT) for n, t in tm.get_delta().items()}


def reference_linearised(
    ref: Reference, tm: TangentTextModel, delta: dict[str, Tensor], *args: Tensor
) -> Tensor:
    """f(w) + jvp(f, w, Delta-w) of the HF model (names via source_names; Conv1D deltas in HF layout)."""
    names = {n: s if s.startswith("head.") else f"transformer.{s}" for n, s in tm.source_names.items()}
    params = dict(ref.named_parameters())
    prim = {names[n]: params[names[n]].detach() for n in delta}
    tang = {names[n]: delta[n] for n in delta}
    y, j = jvp(lambda p: functional_call(ref, p, args), (prim,), (tang,))
    return y + j


@pytest.fixture
def ids() -> Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(30))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("mask", [None, RIGHT_PAD], ids=["unpadded", "right_pad"])
def test_model_matches_func_jvp_of_hf_gpt2(k: int, mask: Tensor | None, ids: Tensor) -> None:
    tm, ref = make(k)
    assert len(tm.frozen_blocks) == 3 - k and len(tm.blocks) == k
    delta = random_delta(tm, 0.05, seed=k)
    tm.set_delta(delta)
    out = tm(ids, mask)
    assert out.shape == (2, C)
    expected = reference_linearised(ref, tm, delta, ids, mask)
    assert rel_err(out, expected) <= TOL
    tm.predict_jvp_only = True
    assert rel_err(tm(ids, mask), expected - ref(ids, mask)) <= TOL


def test_zero_delta_reproduces_original(ids: Tensor) -> None:
    for k in (1, 2, 3):
        tm, ref = make(k)
        assert rel_err(tm(ids), ref(ids)) <= 1e-12
        assert rel_err(tm(ids, RIGHT_PAD), ref(ids, RIGHT_PAD)) <= 1e-12


def test_sdpa_frozen_prefix_matches_eager() -> None:
    """The frozen HF blocks get a 4-D additive mask, which the SDPA kernel honours like eager."""
    eager, _ = make(1)
    gpt = tiny_gpt2()
    gpt.set_attn_implementation("sdpa")
    sdpa = TangentTextModel(gpt, num_classes=C, k=1, head=nn.Linear(D, C).to(DT))
    sdpa.head.load_state_dict(eager.head.state_dict())
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(31))
    for mask in (None, LEFT_PAD, RIGHT_PAD):
        assert rel_err(sdpa(ids, mask), eager(ids, mask)) <= 1e-12


def test_exact_linearity_in_delta(ids: Tensor) -> None:
    tm, _ = make(2)
    f0 = tm(ids, LEFT_PAD).detach()
    d1, d2 = random_delta(tm, 0.1, 1), random_delta(tm, 0.1, 2)
    a, b = 0.7, -1.3

    def out(d: dict[str, Tensor]) -> Tensor:
        tm.set_delta(d)
        return tm(ids, LEFT_PAD).detach()

    lhs = out({n: a * d1[n] + b * d2[n] for n in d1}) - f0
    rhs = a * (out(d1) - f0) + b * (out(d2) - f0)
    assert float((lhs - rhs).abs().max()) <= 1e-10


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("k", [1, 3])
def test_left_and_right_padding_equal_unpadded(pooling: str, k: int) -> None:
    """Padding keys are masked and positions count real tokens: any padding gives the unpadded logits."""
    tm, _ = make(k, pooling=pooling)
    tm.set_delta(random_delta(tm, 0.1, 40))
    gen = torch.Generator().manual_seed(41)
    seq = torch.randint(0, VOCAB, (1, 4), generator=gen)
    pads = torch.randint(0, VOCAB, (1, 3), generator=gen)  # arbitrary ids under the padding
    ones, zeros = torch.ones(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    base = tm(seq)
    right = tm(torch.cat([seq, pads], 1), torch.cat([ones, zeros], 1))
    left = tm(torch.cat([pads, seq], 1), torch.cat([zeros, ones], 1))
    assert torch.isfinite(left).all()
    assert rel_err(right, base) <= 1e-12 and rel_err(left, base) <= 1e-12


def test_cached_forward_equals_full_forward(ids: Tensor) -> None:
    tm, _ = make(1)
    tm.set_delta(random_delta(tm, 0.1, 4))
    ids3, mask3 = torch.cat([ids, ids[:1]]), torch.cat([LEFT_PAD, RIGHT_PAD[1:]])
    cache = tm.cache_frozen(ids3, mask3, batch_size=2)
    assert cache.shape == (3, 6, D)
    assert torch.allclose(tm.forward_from_cache(cache, mask3), tm(ids3, mask3), rtol=0, atol=1e-12)
    with pytest.raises(DataError):
        tm.cache_frozen(ids3[:0])


def test_composition_identity_and_removal(ids: Tensor) -> None:
    tm, _ = make(2)
    deltas = [random_delta(tm, 0.1, s) for s in (5, 6, 7)]
    logits = []
    for d in deltas:
        tm.set_delta(d)
        logits.append(tm(ids, RIGHT_PAD).detach())
    composed = compose(deltas)
    tm.set_delta(composed)
    assert rel_err(tm(ids, RIGHT_PAD), torch.stack(logits).mean(0)) <= 1e-12
    tm.set_delta(remove_component(composed, deltas[2], 3))
    assert rel_err(tm(ids, RIGHT_PAD), torch.stack(logits[:2]).mean(0)) <= 1e-12


def test_delta_api_and_hf_layout(ids: Tensor) -> None:
    tm, ref = make(2)
    hf_params = dict(ref.transformer.named_parameters())
    hf_params.update({f"head.{n}": p for n, p in ref.head.named_parameters()})
    d = random_delta(tm, 0.1, 8)
    tm.set_delta(d)
    hd = tm.hf_delta()
    assert set(hd) == set(tm.source_names.values())
    assert all(hd[n].shape == hf_params[n].shape for n in hd)  # Conv1D deltas are (in, out)
    assert hd["h.2.attn.c_attn.weight"].shape == (D, 3 * D)
    tm.set_delta({n: torch.zeros_like(t) for n, t in d.items()})
    tm.load_hf_delta(hd)
    assert all(torch.equal(tm.get_delta()[n], d[n]) for n in d)
    with pytest.raises(ConfigError, match="unknown HF delta"):
        tm.load_hf_delta({"nope": torch.zeros(1)})
    flat = torch.cat([t.flatten() for t in tm.get_delta().values()])
    assert sum(p.numel() for p in tm.tangent_parameters()) == flat.numel()
    tm(ids).sum().backward()
    params = tm.tangent_parameters()
    assert all(p.grad is not None for p in params)
    others = [p for p in tm.parameters() if all(p is not q for q in params)]
    assert all(not p.requires_grad and p.grad is None for p in others)


def test_unsupported_configs_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"Linear.*GPT2Model"):
        TangentTextModel(nn.Linear(2, 2), num_classes=2)
    with pytest.raises(ConfigError, match=r"ReLU.*gelu_new"):
        TangentTextModel(tiny_gpt2(activation_function="relu"), num_classes=2)
    with pytest.raises(ConfigError, match="reorder_and_upcast_attn"):
        TangentTextModel(tiny_gpt2(reorder_and_upcast_attn=True), num_classes=2)
    with pytest.raises(ConfigError, match="cross-attention"):
        TangentTextModel(tiny_gpt2(add_cross_attention=True), num_classes=2)
    with pytest.raises(ConfigError, match="cannot linearise module GPT2MLP"):
        linearize_gpt2_block(tiny_gpt2().h[0].mlp)
    for k in (0, 4, True):
        with pytest.raises(ConfigError, match="k must be"):
            TangentTextModel(tiny_gpt2(), num_classes=2, k=k)
    with pytest.raises(ConfigError, match="pooling"):
        TangentTextModel(tiny_gpt2(), num_classes=2, pooling="first")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="head must be"):
        TangentTextModel(tiny_gpt2(), num_classes=2, head=nn.Linear(D, 3).to(DT))


def test_bad_attention_masks_raise_data_error(ids: Tensor) -> None:
    tm, _ = make(1)
    with pytest.raises(DataError, match="shape"):
        tm(ids, RIGHT_PAD[:, :5])
    with pytest.raises(DataError, match="only 1"):
        tm(ids, RIGHT_PAD * 2)
    with pytest.raises(DataError, match="at least one"):
        tm(ids, torch.zeros_like(ids))


def test_default_head_is_random_and_deterministic(ids: Tensor) -> None:
    a = TangentTextModel(tiny_gpt2(), num_classes=3, seed=1)
    b = TangentTextModel(tiny_gpt2(), num_classes=3, seed=1)
    assert float(a.head.weight.abs().max()) > 0 and torch.equal(a.head.weight, b.head.weight)
    assert torch.equal(a(ids), b(ids))
