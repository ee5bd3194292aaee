"""Table 3 DP fine-tuning regimes: parameter selection, per-example gradients, DP-SGD invariants."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from torch import nn

from core.errors import ConfigError
from core.tangent.baselines import NonlinearSuffix
from core.tangent.experiments import dp_regime_cell
from core.tangent.model import TangentModel
from core.tangent.regimes import (
    REGIMES,
    build_regime_model,
    regime_parameter_names,
    regular_names,
)
from core.tangent.train import (
    TangentTrainConfig,
    clipped_grad_sum,
    evaluate,
    objective,
    per_sample_grads,
    train_dp,
)
from tests.core.tangent.tiny import tiny_config

C = 3


class Setup:
    """Tiny random Dinov2 (default SDPA attention, as loaded models have), k=1, cached prefix."""

    def __init__(self, dtype: torch.dtype = torch.float64, n: int = 30, arch: str = "dinov2") -> None:
        torch.manual_seed(0)
        if arch == "dinov2":
            self.backbone = transformers.Dinov2Model(tiny_config()).to(dtype).eval()
        else:
            self.backbone = transformers.ViTModel(tiny_config(transformers.ViTConfig)).to(dtype).eval()
        gen = torch.Generator().manual_seed(1)
        self.head = nn.Linear(32, C).to(dtype)
        with torch.no_grad():
            self.head.weight.copy_(0.3 * torch.randn(C, 32, generator=gen, dtype=dtype))
            self.head.bias.copy_(0.1 * torch.randn(C, generator=gen, dtype=dtype))
        self.y = torch.arange(n) % C
        x = 0.5 * torch.randn(n, 1, 28, 28, generator=gen, dtype=dtype)
        for c in range(C):
            x[self.y == c, :, 9 * c : 9 * c + 9, :] += 2.0
        self.cached = TangentModel(self.backbone, C, 1).cache_frozen(x)  # (n, 17, 32)

    def model(self, tangent: bool) -> TangentModel | NonlinearSuffix:
        return build_regime_model(self.backbone, self.head, tangent=tangent, k=1)


@pytest.fixture(scope="module")
def s() -> Setup:
    return Setup()


def _bias(name: str) -> bool:
    return name.endswith("bias")


# ------------------------------------------------------------------------------ parameter selection
@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_regimes_select_corresponding_parameters(arch: str) -> None:
    st = Setup(n=3, arch=arch)
    tan = TangentModel(st.backbone, C, 1, head=st.head, linearize_cls_token=True)
    reg = NonlinearSuffix(st.backbone, st.head, 1)
    to_reg = regular_names(tan)
    assert "d_cls" not in to_reg and set(to_reg.values()) == {n for n, _ in reg.named_parameters()}
    sets = {}
    for regime in REGIMES:
        a, b = regime_parameter_names(tan, regime), regime_parameter_names(reg, regime)
        assert a and b and len(a) == len(b) == len(set(a))
        assert {to_reg[n] for n in a} == set(b), regime
        # the same HF tensors: equal shapes, and the tangent delta perturbs the regular weight
        reg_params = dict(reg.named_parameters())
        for n in a:
            assert tuple(dict(tan.named_parameters())[n].shape) == tuple(reg_params[to_reg[n]].shape)
        assert {"head.weight", "head.bias"} <= set(b)  # every regime trains a classifier
        sets[regime] = set(b)
    everything = {n for n, _ in reg.named_parameters()}
    assert sets["full"] == everything
    assert sets["fc"] == {"head.weight", "head.bias"}
    assert sets["bitfit"] == {n for n in everything if _bias(n)} | {"head.weight"}
    ln = {n for n in everything if isinstance(reg.get_submodule(n.rpartition(".")[0]), nn.LayerNorm)}
    assert len(ln) == 6 and sets["layernorm"] == ln | {"head.weight", "head.bias"}  # ln1, ln2, final
    assert not any("lambda1" in n for n in sets["bitfit"] | sets["layernorm"])


def test_unknown_regime_and_model_raise(s: Setup) -> None:
    with pytest.raises(ConfigError, match=r"regime='lora'.*full, bitfit, layernorm, fc"):
        regime_parameter_names(s.model(True), "lora")
    with pytest.raises(ConfigError, match="TangentModel or a NonlinearSuffix"):
        regime_parameter_names(nn.Linear(2, 2), "fc")
    with pytest.raises(ConfigError, match="regime='LayerNorm'"):
        dp_regime_cell(
            s.backbone, s.head, s.cached, s.y, s.cached, s.y, regime="LayerNorm", tangent=True,
            cfg=TangentTrainConfig(), target_epsilon=1.0, clip_norm=1.0,
        )  # fmt: skip


# ------------------------------------------------------------------------------ per-example gradients
@pytest.mark.parametrize("tangent", [True, False])
@pytest.mark.parametrize("regime", ["full", "bitfit"])
def test_per_sample_grads_match_autograd_loop(s: Setup, tangent: bool, regime: str) -> None:
    model = s.model(tangent)
    if tangent:  # move off w so that second-order terms of the tangent path matter
        with torch.no_grad():
            for p in model.tangent_parameters():
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    names = regime_parameter_names(model, regime)
    cfg = TangentTrainConfig(loss="ce")
    h, y = s.cached[:5], s.y[:5]
    g, norms = per_sample_grads(model, h, y, cfg, names=names)
    assert list(g) == names
    params = dict(model.named_parameters())
    for i in range(5):  # slow reference: one backward per example
        model.zero_grad(set_to_none=True)
        objective(model.forward_from_cache(h[i : i + 1]), y[i : i + 1], cfg).backward()
        sq = 0.0
        for n in names:
            ref = params[n].grad
            assert float((g[n][i] - ref).detach().abs().max()) <= 1e-6, n  # float64
            sq += float(ref.pow(2).sum())
        assert float(norms[i]) == pytest.approx(math.sqrt(sq), rel=1e-6)


@pytest.mark.parametrize("tangent", [True, False])
def test_clipping_bounds_each_contribution(s: Setup, tangent: bool) -> None:
    model = s.model(tangent)
    names = regime_parameter_names(model, "layernorm")
    cfg = TangentTrainConfig(loss="ce")
    h, y = s.cached[:7], s.y[:7]
    _, norms = per_sample_grads(model, h, y, cfg, names=names)
    clip = float(norms.median())  # half of the examples are clipped
    parts = [clipped_grad_sum(model, names, h[i : i + 1], y[i : i + 1], cfg, clip) for i in range(7)]
    part_norms = torch.stack([torch.stack([t.pow(2).sum() for t in p.values()]).sum().sqrt() for p in parts])
    assert bool((part_norms <= clip * (1 + 1e-9)).all())
    assert int((part_norms >= clip * (1 - 1e-5)).sum()) >= 3  # the large ones land on the sphere
    total = clipped_grad_sum(model, names, h, y, cfg, clip, chunk=3)  # chunking sums the same terms
    for n in names:
        assert torch.allclose(total[n], sum(p[n] for p in parts), atol=1e-12)


# ------------------------------------------------------------------------------ DP-SGD training
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("tangent", [True, False])
def test_frozen_parameters_bit_identical(s: Setup, tangent: bool) -> None:
    backbone_before = copy.deepcopy(s.backbone.state_dict())
    cfg = TangentTrainConfig(epochs=1, batch_size=10, lr=1e-2, loss="ce", ridge=1e-3, ball_radius=5.0)
    model = s.model(tangent)
    trained = regime_parameter_names(model, "bitfit")
    stats, led = train_dp(model, s.cached, s.y, cfg, names=trained, target_epsilon=4.0, clip_norm=1.0)
    init = s.model(tangent)
    assert led.steps == stats.steps == 3
    # the Table 3 cell is this same training (same seed: same noise and batches), evaluated
    cell = dp_regime_cell(
        s.backbone, s.head, s.cached, s.y, s.cached, s.y, regime="bitfit", tangent=tangent, cfg=cfg,
        target_epsilon=4.0, clip_norm=1.0,
    )  # fmt: skip
    assert cell.trainable == sum(p.numel() for n, p in init.named_parameters() if n in trained)
    assert cell.ledger == led and cell.stats.steps == 3
    assert cell.test_accuracy == pytest.approx(evaluate(model, s.cached, s.y))
    # the budget is spent, never exceeded
    assert 3.98 <= led.epsilon <= 4.0 and led.target_epsilon == 4.0 and led.noise_multiplier > 0.5
    assert led.delta == pytest.approx(1 / 300) and led.clip_norm == 1.0 and led.sample_rate == pytest.approx(1 / 3)
    assert 0.0 <= evaluate(model, s.cached, s.y) <= 1.0
    before = dict(init.named_parameters())
    for n, p in model.named_parameters():
        if n in trained:
            assert not torch.equal(p, before[n]), n
        else:
            assert torch.equal(p, before[n]), n
    for n, b in model.named_buffers():  # the tangent model's pretrained w
        assert torch.equal(b, dict(init.named_buffers())[n]), n
    for n, t in s.backbone.state_dict().items():
        assert torch.equal(t, backbone_before[n]), n


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("tangent", [True, False])
def test_first_step_equals_non_private_step_at_tiny_noise(s: Setup, tangent: bool) -> None:
    n, lr, clip = s.cached.shape[0], 0.5, 200.0
    cfg = TangentTrainConfig(epochs=1, batch_size=n, lr=lr, loss="ce", optimizer="sgd")  # q = 1: all n
    model = s.model(tangent)
    names = regime_parameter_names(model, "full")
    _, norms = per_sample_grads(model, s.cached, s.y, cfg, names=names)
    assert float(norms.max()) < clip  # clipping inactive
    ref = s.model(tangent)  # reference: one plain full-batch SGD step on the mean loss
    ref_params = dict(ref.named_parameters())
    objective(ref.forward_from_cache(s.cached), s.y, cfg).backward()
    _, ledger = train_dp(model, s.cached, s.y, cfg, names=names, target_epsilon=1e9, clip_norm=clip, delta=1e-3)
    noise_sd = ledger.noise_multiplier * clip / n  # per coordinate, of the averaged gradient
    assert ledger.noise_multiplier < 1e-4 and ledger.steps == 1 and ledger.sample_rate == 1.0
    for name, p in model.named_parameters():
        expected = ref_params[name] - lr * ref_params[name].grad if name in names else ref_params[name]
        assert float((p - expected).detach().abs().max()) <= lr * 6 * noise_sd + 1e-12, name


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_dp_defaults_to_every_delta_of_a_tangent_model(s: Setup) -> None:
    cfg = TangentTrainConfig(epochs=2, batch_size=10, lr=1e-2, loss="ce", ridge=0.1, ball_radius=0.05)
    a, b = s.model(True), s.model(True)
    _, la = train_dp(a, s.cached, s.y, cfg, target_epsilon=3.0, clip_norm=1.0)
    names = [n for n, _ in b.named_parameters() if n in b.source_names]
    _, lb = train_dp(b, s.cached, s.y, cfg, names=names, target_epsilon=3.0, clip_norm=1.0)
    assert la == lb
    for n, t in a.get_delta().items():
        assert torch.equal(t, b.get_delta()[n]), n


@pytest.mark.parametrize("eps", [0.0, -1.0, math.inf, math.nan])
def test_bad_epsilon_raises(s: Setup, eps: float) -> None:
    with pytest.raises(ConfigError, match="target_epsilon"):
        dp_regime_cell(
            s.backbone, s.head, s.cached, s.y, s.cached, s.y, regime="fc", tangent=False,
            cfg=TangentTrainConfig(epochs=1, batch_size=10), target_epsilon=eps, clip_norm=1.0,
        )  # fmt: skip


def test_empty_or_unknown_trainable_set_raises(s: Setup) -> None:
    model = s.model(False)
    cfg = TangentTrainConfig(epochs=1, batch_size=10)
    with pytest.raises(ConfigError, match="empty set of trainable parameter names"):
        train_dp(model, s.cached, s.y, cfg, names=[], target_epsilon=1.0, clip_norm=1.0)
    with pytest.raises(ConfigError, match="unknown parameter names"):
        train_dp(model, s.cached, s.y, cfg, names=["head.d_weight"], target_epsilon=1.0, clip_norm=1.0)
    with pytest.raises(ConfigError, match="clip_norm"):
        train_dp(model, s.cached, s.y, cfg, names=["head.bias"], target_epsilon=1.0, clip_norm=0.0)
    with pytest.raises(ConfigError, match="forward_from_cache"):
        train_dp(nn.Linear(2, 2), s.cached, s.y, cfg, names=["bias"], target_epsilon=1.0, clip_norm=1.0)
    with pytest.raises(ConfigError, match="needs names= for a NonlinearSuffix"):  # no default set but deltas
        train_dp(model, s.cached, s.y, cfg, target_epsilon=1.0, clip_norm=1.0)


# ------------------------------------------------------------------------------ the same start for both columns
def test_centred_reg_starts_at_zero_with_the_uncentred_gradients(s: Setup) -> None:
    """``reg_start="zero"`` subtracts the suffix's output at its initial weights: zero logits before training,
    the same trainable parameters as the uncentred suffix, and the initial weights kept as buffers that training
    never touches."""
    centred = build_regime_model(s.backbone, s.head, tangent=False, k=1)  # the default: "zero"
    raw = build_regime_model(s.backbone, s.head, tangent=False, k=1, reg_start="head")
    assert float(centred.forward_from_cache(s.cached).detach().abs().max()) == 0.0
    assert float(raw.forward_from_cache(s.cached).detach().abs().max()) > 0.1  # the random head's output
    assert [n for n, _ in centred.named_parameters()] == [n for n, _ in raw.named_parameters()]
    names = regime_parameter_names(centred, "full")
    assert names == regime_parameter_names(raw, "full")
    initial = {n: b.clone() for n, b in centred.named_buffers() if n.startswith("initial.")}
    assert initial and all(not n.startswith("initial.") for n, _ in centred.named_parameters())
    train_dp(centred, s.cached, s.y, TangentTrainConfig(epochs=1, batch_size=10, lr=1e-2, loss="ce"),
             names=names, target_epsilon=4.0, clip_norm=1.0)  # fmt: skip
    for n, b in centred.named_buffers():
        if n.startswith("initial."):
            assert torch.equal(b, initial[n]), n
    with pytest.raises(ConfigError, match="reg_start='random'"):
        build_regime_model(s.backbone, s.head, tangent=False, reg_start="random")


def test_centred_gradient_is_the_uncentred_gradient_at_the_same_logits(s: Setup) -> None:
    """Centring only shifts the logits by a constant: at weights moved off ``w_0`` the centred suffix's
    per-example gradient equals the uncentred suffix's gradient of the loss of the shifted logits (slow reference:
    autograd through ``f(w) - f(w_0)`` written out by hand)."""
    centred = build_regime_model(s.backbone, s.head, tangent=False, k=1)
    raw = build_regime_model(s.backbone, s.head, tangent=False, k=1, reg_start="head")
    with torch.no_grad():
        offset = raw.forward_from_cache(s.cached[:5]).clone()
        gen = torch.Generator().manual_seed(5)
        for p_c, p_r in zip(centred.parameters(), raw.parameters(), strict=True):
            step = 0.05 * torch.randn(p_c.shape, generator=gen, dtype=p_c.dtype)
            p_c.add_(step)
            p_r.add_(step)
    cfg = TangentTrainConfig(loss="ce")
    names = regime_parameter_names(centred, "full")
    g, _ = per_sample_grads(centred, s.cached[:5], s.y[:5], cfg, names=names)
    params = dict(raw.named_parameters())
    for i in range(5):
        raw.zero_grad(set_to_none=True)
        logits = raw.forward_from_cache(s.cached[i : i + 1]) - offset[i : i + 1]
        objective(logits, s.y[i : i + 1], cfg).backward()
        for n in names:
            assert float((g[n][i] - params[n].grad).abs().max()) <= 1e-9, n


@pytest.mark.parametrize("reg_start", ["zero", "head"])
def test_fc_columns_tie_from_the_same_start(s: Setup, reg_start: str) -> None:
    """The control for Table 3: in the ``fc`` regime "Ours" (head deltas, JVP only) and "Reg" (the head) are the
    same linear model of the same features. From the same start (``reg_start="zero"``) DP-SGD with the same seed
    (same batches, same noise) trains them to the same logits, so any gap between the columns there is the set-up;
    from the random head's output (``"head"``) they end apart by that offset."""
    cfg = TangentTrainConfig(epochs=3, batch_size=10, lr=5e-2, loss="ce")
    out = {}
    for tangent in (True, False):
        model = build_regime_model(s.backbone, s.head, tangent=tangent, k=1, reg_start=reg_start)
        names = regime_parameter_names(model, "fc")
        _, ledger = train_dp(model, s.cached, s.y, cfg, names=names, target_epsilon=4.0, clip_norm=1.0)
        out[tangent] = (model.forward_from_cache(s.cached).detach(), ledger)
    (ours, led_ours), (reg, led_reg) = out[True], out[False]
    assert led_ours == led_reg  # the same noise multiplier, steps and sample rate
    gap = float((ours - reg).abs().max())
    if reg_start == "zero":
        assert gap <= 1e-8
        cells = [
            dp_regime_cell(
                s.backbone,
                s.head,
                s.cached,
                s.y,
                s.cached,
                s.y,
                regime="fc",
                tangent=t,
                cfg=cfg,
                target_epsilon=4.0,
                clip_norm=1.0,
            )
            for t in (True, False)
        ]
        assert cells[0].test_accuracy == cells[1].test_accuracy
    else:
        offset = float(build_regime_model(s.backbone, s.head, tangent=False, reg_start="head")
                       .forward_from_cache(s.cached).abs().max())  # fmt: skip
        assert gap > 0.1 * offset > 0.0
