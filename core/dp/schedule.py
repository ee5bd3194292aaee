"""DP-SGD's schedule and mechanism for one training run (DPFormer Sec. 6): the Poisson sampling rate and the number
of steps the epochs make (:func:`run_schedule`), the learning rate's linear warm-up and decay
(:func:`lr_multiplier`), delta (:func:`resolve_delta`), the noise multiplier calibrated before training so that the
steps spend the target epsilon (:func:`calibrated_sigma`), and the epsilon spent so far, cheap enough to report at
every evaluation (:class:`EpsilonTracker`). :mod:`core.dp.trainer` trains by it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from opacus.accountants.analysis import rdp as rdp_analysis

from core.data.sequential import SequentialDataset
from core.dp.accounting import Accountant, PrivacyAccountant, calibrate_noise_multiplier, default_delta
from core.dp.methods import DPTrainConfig
from core.dp.sampling import sample_rate_for
from core.errors import ConfigError


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int) -> float:
    """Learning-rate factor at 0-based step ``step`` (Sec. 6): ``(step + 1) / W`` for the ``W`` warm-up
    steps, then ``(T - step) / (T - W)``, a linear decay reaching 0 just after the last step ``T - 1``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / (total_steps - warmup_steps))


@dataclass(frozen=True)
class RunSchedule:
    """Schedule and mechanism of a run (sigma = 0 and no delta when non-private): ``n`` users, the Poisson
    sampling rate, steps per epoch and in all, warm-up steps, delta and the calibrated noise multiplier."""

    n: int
    sample_rate: float
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    delta: float | None
    sigma: float

    @property
    def expected_batch(self) -> float:
        return self.sample_rate * self.n


def run_schedule(data: SequentialDataset, cfg: DPTrainConfig) -> RunSchedule:
    """The steps ``cfg`` trains ``data`` for and, when private, its delta and the noise multiplier that spends the
    target epsilon over them (a ConfigError for a batch larger than the users or a delta of 1/N or more)."""
    n = data.n_users
    q = sample_rate_for(cfg.batch_size, n)  # ConfigError if batch_size > N
    per_epoch = max(1, round(1 / q)) if cfg.private else math.ceil(n / cfg.batch_size)
    total = cfg.epochs * per_epoch if cfg.max_steps is None else min(cfg.epochs * per_epoch, cfg.max_steps)
    warmup = min(round(cfg.warmup_frac * total), total - 1)
    if not cfg.private:
        return RunSchedule(n, q, per_epoch, total, warmup, None, 0.0)
    delta = resolve_delta(cfg.delta, n)
    sigma = calibrated_sigma(float(cfg.epsilon), delta, q, total, cfg.accountant)
    return RunSchedule(n, q, per_epoch, total, warmup, delta, sigma)


@lru_cache(maxsize=128)
def calibrated_sigma(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str) -> float:
    """Memoised :func:`calibrate_noise_multiplier` (seconds per call; a benchmark grid repeats it)."""
    return calibrate_noise_multiplier(
        target_epsilon=epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )


class EpsilonTracker:
    """Epsilon spent so far, cheap enough to report at every evaluation.

    For RDP the per-step RDP curve is computed once: RDP composes additively and Opacus's
    ``RDPAccountant`` itself evaluates ``compute_rdp(steps=t) = t * (per-step RDP)``, so the result is
    identical to ``accountant.epsilon()`` (which re-derives the per-step curve, ~0.3 s, on every
    call). Other accountants are asked directly.
    """

    def __init__(self, accountant: PrivacyAccountant, *, noise_multiplier: float, sample_rate: float) -> None:
        self.accountant = accountant
        self._alphas = list(accountant.kind.create().DEFAULT_ALPHAS)  # the orders the accountant searches
        self._rdp_per_step = None
        if accountant.kind is Accountant.RDP and noise_multiplier > 0:
            self._rdp_per_step = np.asarray(
                rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=self._alphas)
            )

    def epsilon(self) -> float:
        steps = self.accountant.steps
        if self._rdp_per_step is None or steps == 0:
            return self.accountant.epsilon()
        eps, _ = rdp_analysis.get_privacy_spent(
            orders=self._alphas, rdp=self._rdp_per_step * steps, delta=self.accountant.delta
        )
        return float(eps)


def resolve_delta(delta: float | None, n: int) -> float:
    """``delta``, or ``default_delta(n)`` when None; a delta of ``1/n`` or more is refused."""
    if delta is None:
        return default_delta(n)
    if delta >= 1 / n:
        raise ConfigError(
            f"delta={delta!r} >= 1/N = {1 / n:.4g} for N={n} users: such a delta allows releasing a whole "
            f"user's record; use delta < {1 / n:.4g}, or None for default_delta(N) = {default_delta(n):.4g}"
        )
    return delta
