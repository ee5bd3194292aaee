"""Divergence guard: the rule itself, healthy (noisy DP) curves never trip it, and every training loop in core/
stops a diverging run (lr=1e12) with a DivergedError naming the step and the learning rate instead of finishing."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from core.divergence import DivergenceGuard
from core.dp import trainer
from core.dp.trainer import TrainingDivergedError, method_config, train_seqrec
from core.errors import ConfigError, DivergedError, PrivacyError, PrivbenchError
from tests.core.dp.test_trainer import TINY, cyclic_dataset

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the:UserWarning")  # Opacus RDP, extreme eps


# ------------------------------------------------------------------------------------------------ the rule
def test_decreasing_finite_loss_passes_and_is_returned_as_float() -> None:
    guard = DivergenceGuard()
    losses = [math.log(100) * 0.97**t for t in range(200)]
    assert [guard.check(torch.tensor(v), step=t + 1) for t, v in enumerate(losses)] == pytest.approx(losses)
    assert guard.initial == pytest.approx(math.log(100))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_raises_naming_the_step(bad: float) -> None:
    guard = DivergenceGuard(hint="lower the learning rate (lr=0.1)")
    guard.check(2.3, step=1)
    with pytest.raises(DivergedError, match=rf"loss is {bad} at step 7 \(epoch 2\); lower the learning rate"):
        guard.check(torch.tensor(bad), step=7, epoch=2)
    with pytest.raises(DivergedError, match="loss is nan at step 1;"):  # the very first step too
        DivergenceGuard().check(math.nan, step=1)


def test_exploding_loss_raises_with_the_value_the_limit_and_the_hint() -> None:
    guard = DivergenceGuard(hint="lower the learning rate (lr=1e+12)")
    guard.check(5.2, step=1)
    guard.check(51.0, step=2)  # below the limit 10 * 5.2
    with pytest.raises(
        DivergedError,
        match=r"training diverged at step 3 \(epoch 1\): loss=1\.1e\+25 > 52 \(initial loss 5\.2\); "
        r"lower the learning rate \(lr=1e\+12\)",
    ):
        guard.check(1.1e25, step=3, epoch=1)


@pytest.mark.parametrize(
    ("initial", "limit"),
    [(5.0, 50.0), (100.0, 1000.0), (0.01, 10.01), (0.0, 10.0), (-2.0, 20.0)],  # factor, else margin, wins
)
def test_limit_is_factor_times_initial_or_initial_plus_margin(initial: float, limit: float) -> None:
    guard = DivergenceGuard()
    assert guard.limit == math.inf
    guard.check(initial, step=1)
    assert guard.limit == pytest.approx(limit)
    guard.check(limit, step=2)  # at the limit: still accepted
    with pytest.raises(DivergedError):
        guard.check(limit * 1.001 + 1e-9, step=3)


def test_custom_error_class_and_bad_arguments() -> None:
    class MyDiverged(DivergedError):
        pass

    with pytest.raises(MyDiverged):
        DivergenceGuard(error=MyDiverged).check(math.nan, step=1)
    for kwargs, match in [
        ({"factor": 1.0}, "factor"),
        ({"factor": math.inf}, "factor"),
        ({"margin": -1.0}, "margin"),
        ({"error": ValueError}, "DivergedError subclass"),
    ]:
        with pytest.raises(ConfigError, match=match):
            DivergenceGuard(**kwargs)
    assert issubclass(DivergedError, PrivbenchError) and issubclass(DivergedError, ValueError)


def test_noisy_but_healthy_dp_curve_never_raises() -> None:
    """A DP-SGD-like curve: slow decrease from log(V), heavy multiplicative noise, 4x spikes, and a late rise
    (noise dominating the signal) to 3x the start -- all accepted."""
    rng = np.random.default_rng(0)
    steps = 5000
    base = math.log(3700) * (1 - 0.4 * np.arange(steps) / steps)
    noisy = base * rng.lognormal(0.0, 0.3, steps)
    noisy[rng.choice(steps, 25, replace=False)] *= 4.0
    noisy[-500:] = np.linspace(noisy[-500], 3 * base[0], 500)
    guard = DivergenceGuard()
    for t, value in enumerate(noisy, start=1):
        guard.check(float(value), step=t)


# -------------------------------------------------------------------------------------------- DP trainer
@pytest.fixture(scope="module")
def data():
    return cyclic_dataset()


def _per_step_losses(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record every training step's per-token loss seen by the trainer."""
    seen: list[float] = []
    real = trainer.sequence_loss

    def spy(logits, targets, **kwargs):
        loss = real(logits, targets, **kwargs)
        if torch.is_grad_enabled():
            seen.append(float(loss.detach().sum()) / max(int((targets != 0).sum()), 1))
        return loss

    monkeypatch.setattr(trainer, "sequence_loss", spy)
    return seen


# every private run here has the same plan (epsilon 8, 12 steps): its noise is calibrated once (lru_cache)
PLAN = TINY | {"epochs": 3}


@pytest.mark.parametrize(("method", "epsilon"), [("dpformer", 8.0), ("gru", None)])
def test_healthy_dp_training_stays_far_below_the_limit(data, monkeypatch, method: str, epsilon) -> None:
    seen = _per_step_losses(monkeypatch)
    clipping = {"clipping": "nonprivate"} if epsilon is None else {}
    cfg = method_config(method, **PLAN, epsilon=epsilon, **clipping)
    train_seqrec(data, cfg)
    assert len(seen) >= 10 and max(seen) < 2 * seen[0]  # the limit is 10x


@pytest.mark.parametrize(
    ("method", "clipping", "kind"),
    [("gru", "phantom", "explodes"), ("gru", "nonprivate", "explodes"), ("transformer", "phantom", "nan")],
)
def test_dp_trainer_stops_a_diverging_learning_rate(data, method: str, clipping: str, kind: str) -> None:
    epsilon = None if clipping == "nonprivate" else 8.0
    cfg = method_config(method, **PLAN | {"lr": 1e12}, clipping=clipping, epsilon=epsilon)
    explodes = r"training diverged at step 2 \(epoch 1\): loss=\S+ > \S+ \(initial loss \S+\)"
    message = explodes if kind == "explodes" else r"training diverged: loss is nan at step 2 \(epoch 1\)"
    with pytest.raises(TrainingDivergedError, match=message + r"; lower the learning rate \(lr=1e\+12\)") as info:
        train_seqrec(data, cfg)
    assert ("clip norm (clip_norm=1)" in str(info.value)) == (epsilon is not None)
    assert isinstance(info.value, DivergedError) and isinstance(info.value, PrivacyError)


# ------------------------------------------------------------------------------------- the other loops
class _Linear(nn.Module):
    """A linear head on mean-pooled cached features ``(n, N, D) -> (n, C)``."""

    def __init__(self, d: int = 8, classes: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(d, classes)

    def forward_from_cache(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h.mean(1))


def _features(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _tangent_fit(lr: float) -> None:
    from core.tangent.train import TangentTrainConfig, fit

    model, (h, y) = _Linear(), _features()
    fit(
        model.forward_from_cache,
        list(model.parameters()),
        h,
        y,
        TangentTrainConfig(epochs=2, batch_size=16, lr=lr, loss="ce", optimizer="sgd"),
    )


def _tangent_train_dp(lr: float) -> None:
    from core.tangent.train import TangentTrainConfig, train_dp

    model, (h, y) = _Linear(), _features()
    train_dp(
        model,
        h,
        y,
        TangentTrainConfig(epochs=2, batch_size=16, lr=lr),
        names=["fc.weight", "fc.bias"],
        target_epsilon=8.0,
        clip_norm=1.0,
    )


def _lm(lr: float) -> None:
    from core.attacks.lm import build_causal_lm, train_lm

    torch.manual_seed(0)
    model = build_causal_lm(40, n_layer=1, n_embd=16, n_head=2, n_positions=16, hidden=32, byte_dim=8)
    ids = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(0))
    train_lm(model, ids, torch.ones_like(ids, dtype=torch.bool), steps=6, batch_size=4, lr=lr)


def _translation(lr: float) -> None:
    from core.attacks.translation import Seq2SeqLM, train_translation

    torch.manual_seed(0)
    model = Seq2SeqLM(24, pad_id=0, dropout=0.0, d_model=16, nhead=2, num_layers=1, ff=32, max_len=16)
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(3, 24, (5,), generator=g).tolist() for _ in range(16)]
    train_translation(model, src, [s[::-1] for s in src], steps=6, batch_size=4, lr=lr, bos_id=1, eos_id=2, pad_id=0)


def _tiny_gpt2():
    from core.models.gpt2 import tiny_gpt2

    torch.manual_seed(0)
    return tiny_gpt2(50, n_layer=1, n_embd=16, n_head=2, n_positions=16, dropout=0.0, eos_token_id=0).eval()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 50, (4, 10), generator=g) for _ in range(2)]


def _distill(lr: float) -> None:
    from core.mpc.approx import ApproxGPT2, distill

    teacher = _tiny_gpt2()
    distill(teacher, ApproxGPT2(teacher, "mpcformer_2quad"), _batches(), steps=6, lr=lr, layerwise_fraction=0.5)


def _finetune(lr: float) -> None:
    from core.mpc.finetune import finetune_lm

    finetune_lm(_tiny_gpt2(), [(b, torch.ones_like(b, dtype=torch.bool)) for b in _batches()], steps=6, lr=lr)


def _merge_er(lr: float) -> None:
    from core.mpc.merge import train_er

    train_er(_tiny_gpt2(), _batches(), steps=6, lr=lr)


def _merge_mm(lr: float) -> None:
    from core.mpc.merge import build_merge_model, train_mm

    teacher, batches = _tiny_gpt2(), _batches()
    train_mm(build_merge_model(teacher, batches, 12), teacher, batches, steps=6, lr=lr)


LOOPS: dict[str, Callable[[float], None]] = {
    "tangent.fit": _tangent_fit,
    "tangent.train_dp": _tangent_train_dp,
    "attacks.train_lm": _lm,
    "attacks.train_translation": _translation,
    "mpc.finetune_lm": _finetune,
    "mpc.distill": _distill,
    "mpc.train_er": _merge_er,
    "mpc.train_mm": _merge_mm,
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_every_training_loop_stops_a_diverging_learning_rate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import core.tangent.train

    # a fixed noise multiplier instead of the (seconds-long) calibration; the budget is still checked
    monkeypatch.setattr(core.tangent.train, "calibrate_noise_multiplier", lambda **kw: 3.0)
    LOOPS[name](1e-3)  # a healthy learning rate trains
    with pytest.raises(
        DivergedError, match=r"training diverged.* at step \d+.*lower the .*learning rate \(lr=1e\+12\)"
    ):
        LOOPS[name](1e12)
