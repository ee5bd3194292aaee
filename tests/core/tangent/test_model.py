"""TangentModel == f(w) + jvp(f, w, Delta-w) of the original HF model (float64), linearity, caching."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.func import functional_call, jvp

from core.errors import ConfigError, DataError
from core.tangent.model import TangentModel, reinit_block_
from tests.core.tangent.tiny import tiny_config

DT = torch.float64


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def tiny_backbone(kind: str = "dinov2", seed: int = 0, **kw: object) -> nn.Module:
    cfg_cls, model_cls = {
        "dinov2": (transformers.Dinov2Config, transformers.Dinov2Model),
        "vit": (transformers.ViTConfig, transformers.ViTModel),
    }[kind]
    cfg = tiny_config(cfg_cls, **kw)
    torch.manual_seed(seed)
    extra = {"add_pooling_layer": False} if kind == "vit" else {}
    m = model_cls(cfg, **extra).to(DT).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # move weights off their special init (LN 1/0, layer-scale 1)
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=DT))
    return m


class Reference(nn.Module):
    """The plain non-linear model f(x; w): HF backbone -> CLS of the final LN -> linear head."""

    def __init__(self, backbone: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.head(self.backbone(pixel_values).last_hidden_state[:, 0])


def make(kind: str = "dinov2", k: int = 1, **kw: object) -> tuple[TangentModel, Reference]:
    bb = tiny_backbone(kind)
    head = nn.Linear(32, 5).to(DT)
    with torch.no_grad():
        head.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
        head.bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(8))
    ref_bb = copy.deepcopy(bb)
    ref_bb.set_attn_implementation("eager")  # forward-mode AD has no CPU SDPA kernel
    tm = TangentModel(bb, num_classes=5, k=k, head=head, **kw)
    return tm, Reference(ref_bb, copy.deepcopy(head))


def random_delta(tm: TangentModel, scale: float, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(t.shape, generator=gen, dtype=DT) for n, t in tm.get_delta().items()}


def reference_linearised(ref: Reference, tm: TangentModel, delta: dict[str, Tensor], x: Tensor) -> Tensor:
    """f(w) + jvp(f, w, Delta-w) with torch.func on the original model (names via source_names)."""
    src = {f"backbone.{s}" if not s.startswith("head.") else s: delta[n] for n, s in tm.source_names.items()}
    params = dict(ref.named_parameters())
    prim = {n: params[n].detach() for n in src}
    tang = {n: src[n] for n in prim}
    y, j = jvp(lambda p: functional_call(ref, p, (x,)), (prim,), (tang,))
    return y + j


@pytest.fixture
def x() -> Tensor:
    return torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(3), dtype=DT)


@pytest.mark.parametrize("kind,k", [("dinov2", 1), ("dinov2", 2), ("vit", 1), ("vit", 2)])
def test_matches_func_jvp_of_hf_model(kind: str, k: int, x: Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    # HF ViT's eager attention takes the softmax in float32 (a ~1e-8 error in float64); use the
    # Dinov2 eager kernel (same math, softmax in the input dtype) for an exact float64 reference.
    monkeypatch.setattr(
        transformers.models.vit.modeling_vit,
        "eager_attention_forward",
        transformers.models.dinov2.modeling_dinov2.eager_attention_forward,
    )
    tm, ref = make(kind, k)
    assert len(tm.frozen_blocks) == 3 - k and len(tm.blocks) == k
    delta = random_delta(tm, 0.05, seed=k)
    tm.set_delta(delta)
    out = tm(x)
    assert out.shape == (3, 5)
    assert rel_err(out, reference_linearised(ref, tm, delta, x)) <= 1e-10
    # the JVP part alone
    tm.predict_jvp_only = True
    assert rel_err(tm(x), out - ref(x)) <= 1e-8


def test_zero_delta_reproduces_original(x: Tensor) -> None:
    for k in (1, 2, 3):
        tm, ref = make("dinov2", k)
        assert rel_err(tm(x), ref(x)) <= 1e-12


def test_exact_linearity_in_delta(x: Tensor) -> None:
    tm, _ = make("dinov2", 2, linearize_cls_token=True)
    f0 = tm(x)
    d1, d2 = random_delta(tm, 0.1, 1), random_delta(tm, 0.1, 2)
    a, b = 0.7, -1.3

    def out(d: dict[str, Tensor]) -> Tensor:
        tm.set_delta(d)
        return tm(x).detach()

    combo = out({n: a * d1[n] + b * d2[n] for n in d1})
    lhs, rhs = combo - f0, a * (out(d1) - f0) + b * (out(d2) - f0)
    assert float((lhs - rhs).abs().max()) <= 1e-10


def test_cached_forward_equals_full_forward(x: Tensor) -> None:
    tm, _ = make("dinov2", 1)
    tm.set_delta(random_delta(tm, 0.1, 4))
    cache = tm.cache_frozen(x, batch_size=2)
    assert cache.shape == (3, 17, 32)
    assert torch.allclose(tm.forward_from_cache(cache), tm(x), rtol=0, atol=1e-12)
    as_list = tm.cache_frozen([(xi, 0) for xi in x], batch_size=2)
    assert torch.allclose(as_list, cache, rtol=0, atol=1e-12)
    with pytest.raises(DataError):
        tm.cache_frozen([])


def test_gradients_reach_only_deltas(x: Tensor) -> None:
    tm, _ = make("dinov2", 1)
    tm(x).sum().backward()
    params = tm.tangent_parameters()
    assert params and all(p.grad is not None for p in params)
    others = [p for p in tm.parameters() if all(p is not q for q in params)]
    assert all(not p.requires_grad and p.grad is None for p in others)


def test_get_set_delta_roundtrip_and_errors() -> None:
    tm, _ = make("dinov2", 1)
    d = random_delta(tm, 1.0, 5)
    tm.set_delta(d)
    flat = torch.cat([t.flatten() for t in tm.get_delta().values()])
    tm.set_delta(torch.zeros_like(flat))
    assert all(float(t.abs().max()) == 0 for t in tm.get_delta().values())
    tm.set_delta(flat)
    assert all(torch.equal(tm.get_delta()[n], d[n]) for n in d)
    with pytest.raises(ConfigError, match="flat delta"):
        tm.set_delta(flat[:-1])
    with pytest.raises(ConfigError, match="missing"):
        tm.set_delta({})
    with pytest.raises(ConfigError, match="shape"):
        tm.set_delta({n: t.flatten() for n, t in d.items()})


def test_reinit_last_block_linearises_around_reinitialised_weights(x: Tensor) -> None:
    tm, ref = make("dinov2", 2, reinit_last_block=True, seed=11)
    reinit_block_(ref.backbone.encoder.layer[-1], seed=11)
    assert rel_err(tm(x), ref(x)) <= 1e-12
    delta = random_delta(tm, 0.05, 6)
    tm.set_delta(delta)
    assert rel_err(tm(x), reference_linearised(ref, tm, delta, x)) <= 1e-10


def test_linearized_cls_token_with_all_blocks_is_cls_token_delta(x: Tensor) -> None:
    """For k = L the CLS-position shift is exactly a delta on ``embeddings.cls_token``."""
    tm, ref = make("dinov2", 3, linearize_cls_token=True)
    delta = random_delta(tm, 0.05, 7)
    tm.set_delta(delta)
    names = dict(tm.source_names, d_cls="embeddings.cls_token")
    d_ref = dict(delta, d_cls=delta["d_cls"].view(1, 1, -1))  # (D,) -> (1, 1, D)
    shim = type("Shim", (), {"source_names": names})()
    assert rel_err(tm(x), reference_linearised(ref, shim, d_ref, x)) <= 1e-10


def test_default_head_is_random_and_deterministic(x: Tensor) -> None:
    a = TangentModel(tiny_backbone(), num_classes=4, seed=1)
    b = TangentModel(tiny_backbone(), num_classes=4, seed=1)
    assert float(a.head.weight.abs().max()) > 0 and torch.equal(a.head.weight, b.head.weight)
    assert torch.equal(a(x), b(x))


def test_unsupported_modules_raise_config_error() -> None:
    with pytest.raises(ConfigError, match=r"Linear.*Dinov2Model.*ViTModel"):
        TangentModel(nn.Linear(2, 2), num_classes=2)
    with pytest.raises(ConfigError, match="Dinov2SwiGLUFFN"):
        TangentModel(tiny_backbone(use_swiglu_ffn=True), num_classes=2)
    with pytest.raises(ConfigError, match="k must be"):
        TangentModel(tiny_backbone(), num_classes=2, k=4)
    with pytest.raises(ConfigError, match="head weight"):
        TangentModel(tiny_backbone(), num_classes=2, head=nn.Linear(32, 3).to(DT))
