"""TAFT training on cached features, shard composition, unlearning and the non-linear baselines."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import transformers
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.baselines import (
    composed_accuracy,
    forget_by_retraining,
    forget_by_subtraction,
    model_soup,
    sisa_logits,
    train_fc,
    train_nonlinear,
    train_nonlinear_shards,
    train_shards,
)
from core.tangent.compose import compose, ensemble_logits, remove_component
from core.tangent.loss import global_norm
from core.tangent.model import TangentModel
from core.tangent.shards import ShardIndex
from core.tangent.train import (
    TangentTrainConfig,
    evaluate,
    objective,
    per_sample_grads,
    train_dp,
    train_tangent,
)
from tests.core.tangent.tiny import tiny_config

C = 2


def tiny_backbone(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    cfg = tiny_config(attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.Dinov2Model(cfg).to(dtype).eval()


def tiny_images(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Separable: class 0 has a bright top half, class 1 a bright bottom half (plus noise)."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % C
    x = 0.1 * torch.randn(n, 1, 28, 28, generator=gen, dtype=dtype)
    x[y == 0, :, :14, :] += 3.0
    x[y == 1, :, 14:, :] += 3.0
    return x, y


class Setup:
    def __init__(self, dtype: torch.dtype = torch.float64, n: int = 48) -> None:
        self.dtype = dtype
        self.backbone = tiny_backbone(dtype)
        self.x, self.y = tiny_images(n, dtype)
        self.cached = self.make().cache_frozen(self.x)

    def make(self) -> TangentModel:
        return TangentModel(self.backbone, C, k=1, seed=0)


@pytest.fixture(scope="module")
def s64() -> Setup:
    return Setup(torch.float64)


CFG = TangentTrainConfig(epochs=4, batch_size=16, lr=3e-2, kappa=5.0, ridge=1e-4, seed=0)


def test_taft_reduces_loss_and_beats_chance(s64: Setup) -> None:
    model = s64.make()
    acc0 = evaluate(model, s64.cached, s64.y)
    seen = []
    t0 = time.perf_counter()
    stats = train_tangent(model, s64.cached, s64.y, CFG, on_epoch=seen.append)
    dt = time.perf_counter() - t0
    assert len(seen) == CFG.epochs and stats.steps == CFG.epochs * 3
    assert stats.losses[-1] < 0.5 * stats.losses[0]
    acc = evaluate(model, s64.cached, s64.y)
    assert acc >= 0.9 and acc >= acc0
    print(f"TAFT tiny: {stats.steps} steps in {dt:.2f}s, acc {acc0:.2f} -> {acc:.2f}")


def test_ce_sgd_and_lr_schedule(s64: Setup) -> None:
    cfg = TangentTrainConfig(
        epochs=4, batch_size=16, lr=0.01, loss="ce", optimizer="sgd", lr_milestones=(2, 3), lr_decay=0.1
    )
    stats = train_tangent(s64.make(), s64.cached, s64.y, cfg)
    assert [e.lr for e in stats.epochs] == pytest.approx([0.01, 0.01, 0.001, 0.0001])
    assert stats.losses[-1] < stats.losses[0]


def test_ball_constraint_holds(s64: Setup) -> None:
    cfg = TangentTrainConfig(epochs=2, batch_size=16, lr=0.05, ball_radius=0.1)
    model = s64.make()
    norms = []
    stats = train_tangent(model, s64.cached, s64.y, cfg, on_epoch=lambda e: norms.append(e.delta_norm))
    assert max(norms) <= 0.1 * (1 + 1e-9)
    assert float(global_norm(model.tangent_parameters())) <= 0.1 * (1 + 1e-9)
    assert float(global_norm(model.tangent_parameters())) > 0.05  # the constraint is active
    assert stats.steps == 6


def test_ridge_shrinks_delta(s64: Setup) -> None:
    norms = {}
    for ridge in (0.0, 1.0):
        m = s64.make()
        cfg = TangentTrainConfig(epochs=2, batch_size=16, lr=1e-2, kappa=5.0, ridge=ridge)
        train_tangent(m, s64.cached, s64.y, cfg)
        norms[ridge] = float(global_norm(m.tangent_parameters()))
    assert norms[1.0] < 0.5 * norms[0.0]


def test_training_is_deterministic(s64: Setup) -> None:
    cfg = TangentTrainConfig(epochs=1, batch_size=16)
    a, b = s64.make(), s64.make()
    train_tangent(a, s64.cached, s64.y, cfg)
    train_tangent(b, s64.cached, s64.y, cfg)
    for n, t in a.get_delta().items():
        assert torch.equal(t, b.get_delta()[n])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_composition_equals_ensemble(dtype: torch.dtype, tol: float) -> None:
    s = Setup(dtype, n=24)
    index = ShardIndex.from_split(24, 3, seed=1)
    cfg = TangentTrainConfig(epochs=1, batch_size=4, lr=1e-2, kappa=5.0)
    deltas = train_shards(s.make, s.cached, s.y, index, cfg)
    assert len(deltas) == 3
    model = s.make()
    logits = []
    for d in deltas:
        model.set_delta(d)
        logits.append(model.forward_from_cache(s.cached).detach())
    model.set_delta(compose(deltas))
    composed = model.forward_from_cache(s.cached).detach()
    ens = ensemble_logits(logits)
    scale = max(1.0, float(ens.abs().max()))
    assert float((composed - ens).abs().max()) <= tol * scale
    acc = composed_accuracy(model, deltas, s.cached, s.y)
    assert acc == evaluate_delta(model, compose(deltas), s)
    # composed_accuracy restores the model's delta
    assert torch.equal(model.forward_from_cache(s.cached).detach(), composed)


def evaluate_delta(model: TangentModel, delta: dict, s: Setup) -> float:
    model.set_delta(delta)
    return evaluate(model, s.cached, s.y)


def test_forget_by_subtraction(s64: Setup) -> None:
    index = ShardIndex.from_split(48, 4, seed=2)
    cfg = TangentTrainConfig(epochs=1, batch_size=8, lr=1e-2, kappa=5.0)
    deltas: list = train_shards(s64.make, s64.cached, s64.y, index, cfg)
    composed = compose(deltas)
    sample = int(index.shards[2][0])
    new, k = forget_by_subtraction(composed, deltas, index, sample)
    assert k == 2
    expected = compose([d for j, d in enumerate(deltas) if j != k])
    for n in expected:
        assert float((new[n] - expected[n]).abs().max()) <= 1e-6
    # a second forget in another shard uses N - 1 components
    deltas[k] = None
    other = int(index.shards[0][0])
    new2, k2 = forget_by_subtraction(new, deltas, index, other)
    expected2 = compose([deltas[1], deltas[3]])
    assert k2 == 0
    for n in expected2:
        assert float((new2[n] - expected2[n]).abs().max()) <= 1e-6
    with pytest.raises(DataError, match="already removed"):
        forget_by_subtraction(new2, deltas, index, int(index.shards[2][1]))


def test_forget_by_retraining_is_independent_of_sample(s64: Setup) -> None:
    index = ShardIndex.from_split(48, 3, seed=3)
    cfg = TangentTrainConfig(epochs=1, batch_size=8, lr=1e-2, kappa=5.0)
    sample = int(index.shards[1][3])
    d1, k, rest = forget_by_retraining(s64.make, s64.cached, s64.y, index, sample, cfg)
    assert k == 1 and sample not in rest.tolist() and rest.numel() == index.shards[1].numel() - 1
    cached2, y2 = s64.cached.clone(), s64.y.clone()
    cached2[sample] = torch.randn_like(cached2[sample]) * 10
    y2[sample] = 1 - y2[sample]
    d2, _, _ = forget_by_retraining(s64.make, cached2, y2, index, sample, cfg)
    for n in d1:
        assert torch.equal(d1[n], d2[n])
    # and it differs from the shard trained with the sample
    full = train_shards(s64.make, s64.cached, s64.y, index, cfg)[1]
    assert any(not torch.equal(full[n], d1[n]) for n in d1)


def test_bad_inputs(s64: Setup) -> None:
    cfg = TangentTrainConfig(epochs=1, batch_size=4)
    with pytest.raises(ConfigError, match="larger than the dataset"):
        ShardIndex.from_split(48, 49, seed=0)
    with pytest.raises(DataError, match="shard 1 is empty"):
        ShardIndex((torch.tensor([0, 1]), torch.tensor([], dtype=torch.long)))
    index = ShardIndex.from_split(48, 4, seed=0)
    with pytest.raises(DataError, match="sample 999 not in the training set"):
        forget_by_retraining(s64.make, s64.cached, s64.y, index, 999, cfg)
    with pytest.raises(DataError, match="sample 999"):
        forget_by_subtraction({}, [{}] * 4, index, 999)
    single = ShardIndex((torch.tensor([5]), torch.tensor([0, 1, 2])))
    with pytest.raises(DataError, match="empty after forgetting"):
        forget_by_retraining(s64.make, s64.cached, s64.y, single, 5, cfg)
    with pytest.raises(DataError, match="empty"):
        train_tangent(s64.make(), s64.cached[:0], s64.y[:0], cfg)
    with pytest.raises(DataError, match="labels"):
        train_tangent(s64.make(), s64.cached, s64.y[:3], cfg)
    with pytest.raises(DataError, match="holds sample"):
        train_shards(s64.make, s64.cached[:10], s64.y[:10], index, cfg)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"epochs": 0}, "epochs=0"),
        ({"batch_size": 1.5}, "batch_size=1.5"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"loss": "mse"}, "loss='mse'"),
        ({"optimizer": "lbfgs"}, "optimizer='lbfgs'"),
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"kappa": float("nan")}, "kappa=nan"),
        ({"ridge": -0.1}, "ridge=-0.1"),
        ({"ball_radius": 0.0}, "ball_radius=0.0"),
        ({"lr_milestones": (5, 3)}, "lr_milestones"),
        ({"lr_milestones": (30,)}, "lr_milestones"),
        ({"lr_decay": 0.0}, "lr_decay=0.0"),
        ({"seed": "a"}, "seed='a'"),
    ],
)
def test_config_validation(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        TangentTrainConfig(**kw)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = TangentTrainConfig()
    with pytest.raises(AttributeError):
        cfg.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        TangentTrainConfig(1)  # type: ignore[misc]


def test_nonlinear_baselines_sisa_and_soup(s64: Setup) -> None:
    head = nn.Linear(32, C).to(torch.float64)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
        head.bias.zero_()
    before = copy.deepcopy(s64.backbone.state_dict())
    cfg = TangentTrainConfig(epochs=4, batch_size=16, lr=1e-2, loss="ce")
    t0 = time.perf_counter()
    nl, stats = train_nonlinear(s64.backbone, head, s64.cached, s64.y, cfg, k=1)
    dt = time.perf_counter() - t0
    assert stats.losses[-1] < stats.losses[0]
    assert evaluate(nl, s64.cached, s64.y) >= 0.9
    for n, t in s64.backbone.state_dict().items():  # the backbone is not modified
        assert torch.equal(t, before[n])
    print(f"NLFT-1 tiny: {stats.steps} steps in {dt:.2f}s")

    # FC on CLS features of the full backbone
    with torch.no_grad():
        feats = s64.backbone(s64.x).last_hidden_state[:, 0]
    fc, fstats = train_fc(head, feats, s64.y, cfg)
    assert fstats.losses[-1] < fstats.losses[0]
    assert evaluate(fc, feats, s64.y) >= 0.9
    with pytest.raises(DataError, match=r"\(n, D\)"):
        train_fc(head, s64.cached, s64.y, cfg)

    index = ShardIndex.from_split(48, 3, seed=0)
    scfg = TangentTrainConfig(epochs=1, batch_size=8, lr=1e-2, loss="ce")
    models = train_nonlinear_shards(s64.backbone, head, s64.cached, s64.y, index, scfg, k=1)
    assert len(models) == 3
    ens = sisa_logits(models, s64.cached)
    with torch.no_grad():
        manual = sum(m(s64.cached) for m in models) / 3
    assert torch.allclose(ens, manual, atol=1e-12)
    soup = model_soup(models)
    for n, p in soup.named_parameters():
        avg = sum(dict(m.named_parameters())[n] for m in models) / 3
        assert torch.allclose(p, avg, atol=1e-12)
    with pytest.raises(ConfigError):
        model_soup([])
    with pytest.raises(ConfigError):
        sisa_logits([], s64.cached)


def test_remove_component_matches_model_outputs(s64: Setup) -> None:
    """Subtraction-unlearned model's logits equal the composition of the remaining shards' logits."""
    index = ShardIndex.from_split(48, 3, seed=5)
    cfg = TangentTrainConfig(epochs=1, batch_size=8, lr=1e-2, kappa=5.0)
    deltas = train_shards(s64.make, s64.cached, s64.y, index, cfg)
    model = s64.make()
    model.set_delta(remove_component(compose(deltas), deltas[0], 3))
    a = model.forward_from_cache(s64.cached).detach()
    model.set_delta(compose(deltas[1:]))
    b = model.forward_from_cache(s64.cached).detach()
    assert float((a - b).abs().max()) <= 1e-6


# ------------------------------------------------------------------------------------ DP (Sec. 3.4)
@pytest.mark.parametrize("loss,alpha", [("ce", 1.0), ("rsl", 2.0)])
def test_per_sample_grads_match_loop(s64: Setup, loss: str, alpha: float) -> None:
    model = TangentModel(s64.backbone, C, k=1, seed=0, linearize_cls_token=True)
    cfg = TangentTrainConfig(loss=loss, alpha=alpha, kappa=5.0)
    h, y = s64.cached[:4], s64.y[:4]
    g, norms = per_sample_grads(model, h, y, cfg)
    for i in range(4):
        model.zero_grad()
        objective(model.forward_from_cache(h[i : i + 1]), y[i : i + 1], cfg).backward()
        sq = 0.0
        for n, p in model.named_parameters():
            if n in model.source_names:
                assert torch.allclose(g[n][i], p.grad, atol=1e-10, rtol=1e-8), n
                sq += float(p.grad.pow(2).sum())
        assert float(norms[i]) == pytest.approx(sq**0.5, rel=1e-8)
    with pytest.raises(DataError, match="labels"):
        per_sample_grads(model, h, torch.tensor([0, 1, 2, 0]), cfg)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dp_training_spends_budget_and_learns_at_low_noise(s64: Setup) -> None:
    cfg = TangentTrainConfig(epochs=4, batch_size=16, lr=3e-2, kappa=5.0)
    model = s64.make()
    t0 = time.perf_counter()
    stats, ledger = train_dp(model, s64.cached, s64.y, cfg, target_epsilon=1e5, clip_norm=100.0)
    dt = time.perf_counter() - t0
    assert ledger.steps == stats.steps == 12 and len(stats.epochs) == 4
    assert ledger.sample_rate == pytest.approx(16 / 48) and ledger.epsilon <= 1e5
    assert ledger.delta == pytest.approx(1 / 480)
    assert stats.losses[-1] < stats.losses[0]
    assert evaluate(model, s64.cached, s64.y) >= 0.8
    print(f"DP-TAFT tiny: {stats.steps} steps in {dt:.2f}s")
    # a strict budget: calibrated sigma, epsilon spent within the target
    m2 = s64.make()
    small = TangentTrainConfig(epochs=1, batch_size=16, loss="ce", ridge=0.1, ball_radius=0.05)
    _, led = train_dp(m2, s64.cached, s64.y, small, target_epsilon=1.0, clip_norm=1.0, delta=1e-3)
    assert 0.98 <= led.epsilon <= 1.0 and led.noise_multiplier > 1.0 and led.delta == 1e-3
    assert float(global_norm(m2.tangent_parameters())) <= 0.05 * (1 + 1e-9)
    # deterministic given the seed (sampling and noise from cfg.seed)
    m3 = s64.make()
    train_dp(m3, s64.cached, s64.y, small, target_epsilon=1.0, clip_norm=1.0, delta=1e-3)
    for n, t in m2.get_delta().items():
        assert torch.equal(t, m3.get_delta()[n])
    with pytest.raises(ConfigError, match="clip_norm"):
        train_dp(s64.make(), s64.cached, s64.y, small, target_epsilon=1.0, clip_norm=-1.0)
    with pytest.raises(ConfigError, match="batch_size"):
        big = TangentTrainConfig(epochs=1, batch_size=100)
        train_dp(s64.make(), s64.cached, s64.y, big, target_epsilon=1.0, clip_norm=1.0)
