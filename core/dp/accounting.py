"""Privacy accounting for DP-SGD with Poisson subsampling (paper Sec. 3, eq. 3.1).

DP-SGD releases, at every step, the sum of clipped per-example gradients plus Gaussian noise
``N(0, (sigma * C)^2 I)`` over a Poisson-subsampled batch (each example included independently with
probability ``q``). Its privacy loss after ``T`` steps is that of ``T`` compositions of the
Poisson-subsampled Gaussian mechanism with noise multiplier ``sigma``, which Opacus's accountants
bound:

* :attr:`Accountant.RDP` -- Renyi DP (Mironov 2017; Mironov, Talwar, Zhang 2019) with the
  improved RDP -> (epsilon, delta) conversion of Balle et al. 2020. Fast, slightly loose.
* :attr:`Accountant.PRV` -- numerical composition of privacy-loss random variables (Gopi, Lee,
  Wutschitz 2021). Tighter; we report its *upper* bound, as Opacus does. ~0.1-1 s per call.

Everything here is a thin, validated layer over Opacus 1.6 so that the numbers agree with Opacus
exactly; the tests pin them against Opacus itself and against published values.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from opacus.accountants import IAccountant, PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from core.dp.noise import check_clip_norm, check_noise_multiplier
from core.errors import ConfigError, PrivacyError

__all__ = [
    "Accountant",
    "PrivacyAccountant",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "default_delta",
    "require_accountant",
]

#: Default precision of :func:`calibrate_noise_multiplier`: the calibrated sigma spends an epsilon in
#: ``[target_epsilon - 0.01, target_epsilon]`` (Opacus's own default).
DEFAULT_EPSILON_TOLERANCE = 0.01

#: RDP orders searched by the RDP accountant: Opacus's defaults extended up to 1024.
RDP_ORDERS: list[float] = [*RDPAccountant.DEFAULT_ALPHAS, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024]


class Accountant(str, Enum):
    """Registry of the privacy accountants (values are Opacus mechanism names)."""

    RDP = "rdp"
    PRV = "prv"

    @classmethod
    def _missing_(cls, value: object) -> Accountant:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        known = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"unknown accountant {value!r}; known accountants: {known}")

    def create(self) -> IAccountant:
        """A fresh (empty) Opacus accountant of this kind.

        The RDP accountant searches orders up to 1024 (Opacus stops at 63): with few steps or a large
        epsilon the optimal order lies beyond 63 and Opacus's default bound is loose. The minimum over
        more orders is never larger, so the bound stays valid and only gets tighter.
        """
        if self is Accountant.RDP:
            accountant = RDPAccountant()
            accountant.DEFAULT_ALPHAS = RDP_ORDERS
            return accountant
        return PRVAccountant()


# --------------------------------------------------------------------------------------------------
# validation (privacy-critical arguments are always checked, never asserted)
# --------------------------------------------------------------------------------------------------


def _check_epsilon(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {name}={value!r}; pass a positive budget")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, numbers.Real) and 0 < delta < 1):
        raise ConfigError(f"delta must be in (0, 1), got delta={delta!r}; use default_delta(n) for a delta below 1/n")


def _check_sample_rate(sample_rate: float) -> None:
    if not (isinstance(sample_rate, numbers.Real) and 0 < sample_rate <= 1):
        raise ConfigError(
            f"sample_rate must be in (0, 1], got sample_rate={sample_rate!r}; "
            "use sample_rate_for(batch_size, n) = batch_size / n"
        )


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ConfigError(f"steps must be an integer >= 1, got steps={steps!r}")


# --------------------------------------------------------------------------------------------------
# one-shot accounting
# --------------------------------------------------------------------------------------------------


def default_delta(n: int) -> float:
    """The delta used when none is configured: ``1 / (10 n)`` for a dataset of ``n`` records.

    The paper keeps ``delta < 1/N`` (Sec. 3; for MovieLens-1M the records are the N = 6040 users,
    E.1). A delta of order ``1/N`` would allow releasing one whole record outright, so we take a
    constant factor 10 below it: valid for every ``n >= 1`` (``delta = 0.1`` at ``n = 1``) and
    simple to state in a report. Pass an explicit delta to follow another convention (e.g. 1e-5).
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"n (number of private records) must be an integer >= 1, got n={n!r}")
    return 1.0 / (10 * n)


def compute_epsilon(
    *,
    noise_multiplier: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
) -> float:
    """Epsilon spent by ``steps`` Poisson-subsampled Gaussian steps (eq. 3.1), via Opacus.

    Returns ``math.inf`` for ``noise_multiplier == 0`` (no noise: no privacy).
    """
    check_noise_multiplier(noise_multiplier)
    _check_delta(delta)
    _check_sample_rate(sample_rate)
    _check_steps(steps)
    kind = Accountant(accountant)
    if noise_multiplier == 0:
        return math.inf
    opacus_accountant = kind.create()
    opacus_accountant.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    return float(opacus_accountant.get_epsilon(delta=delta))


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: Accountant | str = Accountant.RDP,
    epsilon_tolerance: float = DEFAULT_EPSILON_TOLERANCE,
) -> float:
    """Smallest sigma (up to a bisection tolerance) whose epsilon does not exceed ``target_epsilon``.

    Wraps Opacus's ``get_noise_multiplier``: the returned sigma satisfies
    ``target_epsilon - epsilon_tolerance <= compute_epsilon(sigma, ...) <= target_epsilon``.
    This is how the paper fixes the number of iterations and derives the per-step noise from the
    budget (Sec. 6, "privacy accounting").
    """
    _check_epsilon("target_epsilon", target_epsilon)
    _check_epsilon("epsilon_tolerance", epsilon_tolerance)
    _check_delta(delta)
    _check_sample_rate(sample_rate)
    _check_steps(steps)
    kind = Accountant(accountant)
    try:
        return float(
            get_noise_multiplier(
                target_epsilon=float(target_epsilon),
                target_delta=float(delta),
                sample_rate=float(sample_rate),
                steps=int(steps),
                accountant=kind.value,
                epsilon_tolerance=float(epsilon_tolerance),
                **({"alphas": RDP_ORDERS} if kind is Accountant.RDP else {}),
            )
        )
    except ValueError as err:  # Opacus: "The privacy budget is too low." (sigma > 1e6)
        raise ConfigError(
            f"target_epsilon={target_epsilon!r} is unreachable with delta={delta!r}, "
            f"sample_rate={sample_rate!r}, steps={steps!r} (sigma would exceed 1e6); "
            "raise the budget, or reduce steps or the sample rate"
        ) from err


# --------------------------------------------------------------------------------------------------
# the record of a run, and the stateful accountant the trainer steps
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrivacyLedger:
    """What a private training run spent, and with which mechanism parameters."""

    epsilon: float
    delta: float
    noise_multiplier: float
    sample_rate: float
    steps: int
    accountant: str
    clip_norm: float
    target_epsilon: float | None = None

    def __post_init__(self) -> None:
        _check_delta(self.delta)
        check_noise_multiplier(self.noise_multiplier)
        _check_sample_rate(self.sample_rate)
        check_clip_norm(self.clip_norm)
        if isinstance(self.steps, bool) or not isinstance(self.steps, numbers.Integral) or self.steps < 0:
            raise ConfigError(f"steps must be an integer >= 0, got steps={self.steps!r}")
        if not (isinstance(self.epsilon, numbers.Real) and self.epsilon >= 0):
            raise ConfigError(f"epsilon must be >= 0 (math.inf allowed), got epsilon={self.epsilon!r}")
        if self.target_epsilon is not None:
            _check_epsilon("target_epsilon", self.target_epsilon)
        # normalise to plain Python scalars so to_dict() is JSON-serialisable
        for name in ("epsilon", "delta", "noise_multiplier", "sample_rate", "clip_norm"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "steps", int(self.steps))
        if self.target_epsilon is not None:
            object.__setattr__(self, "target_epsilon", float(self.target_epsilon))
        object.__setattr__(self, "accountant", Accountant(self.accountant).value)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict (``math.inf`` epsilon stays a float)."""
        return asdict(self)


class PrivacyAccountant:
    """Records each DP-SGD step and reports the epsilon spent so far.

    The trainer owns one and calls :meth:`step` once per *noisy* update -- including updates on an
    empty Poisson batch, which still release noise (see ``core.dp.sampling``). A trainer asked to
    train privately without one must refuse: see :func:`require_accountant`.

    Example::

        acct = PrivacyAccountant(accountant="rdp", delta=default_delta(n))
        for batch in poisson_batches(n, sample_rate=q, steps=T, generator=g):
            ...  # clip, sum, privatize_grads_(...), optimizer.step()
            acct.step(noise_multiplier=sigma, sample_rate=q)
        acct.check_budget(target_epsilon=8.0)
    """

    def __init__(self, *, accountant: Accountant | str = Accountant.RDP, delta: float) -> None:
        _check_delta(delta)
        self.kind = Accountant(accountant)
        self.delta = float(delta)
        self._opacus = self.kind.create()

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one noisy update with this noise multiplier and Poisson sampling rate."""
        check_noise_multiplier(noise_multiplier)
        _check_sample_rate(sample_rate)
        self._opacus.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    @property
    def steps(self) -> int:
        """Number of steps recorded."""
        return sum(n for _, _, n in self._opacus.history)

    @property
    def history(self) -> tuple[tuple[float, float, int], ...]:
        """Run-length encoded ``(noise_multiplier, sample_rate, steps)`` history."""
        return tuple(self._opacus.history)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the accountant's delta); 0 before any step."""
        delta = self.delta if delta is None else delta
        _check_delta(delta)
        if not self._opacus.history:
            return 0.0
        if any(sigma == 0 for sigma, _, _ in self._opacus.history):
            return math.inf
        return float(self._opacus.get_epsilon(delta=delta))

    def check_budget(self, *, target_epsilon: float) -> float:
        """Return the spent epsilon, raising :class:`PrivacyError` if it exceeds ``target_epsilon``."""
        _check_epsilon("target_epsilon", target_epsilon)
        spent = self.epsilon()
        if spent > target_epsilon:
            raise PrivacyError(
                f"privacy budget exceeded: spent epsilon={spent:.4f} > target_epsilon={target_epsilon!r} "
                f"at delta={self.delta!r} after {self.steps} steps; stop training or recalibrate sigma"
            )
        return spent

    def ledger(self, *, clip_norm: float, target_epsilon: float | None = None) -> PrivacyLedger:
        """The run's :class:`PrivacyLedger` (requires a constant sigma and sample rate)."""
        settings = {(sigma, q) for sigma, q, _ in self._opacus.history}
        if not settings:
            raise ConfigError("ledger needs at least one recorded step, got steps=0; call .step() first")
        if len(settings) > 1:
            raise ConfigError(
                f"ledger needs a constant noise_multiplier and sample_rate, got history={self.history!r}; "
                "record heterogeneous runs from .history instead"
            )
        ((sigma, q),) = settings
        return PrivacyLedger(
            epsilon=self.epsilon(),
            delta=self.delta,
            noise_multiplier=sigma,
            sample_rate=q,
            steps=self.steps,
            accountant=self.kind.value,
            clip_norm=clip_norm,
            target_epsilon=target_epsilon,
        )

    def __repr__(self) -> str:
        return f"PrivacyAccountant(accountant={self.kind.value!r}, delta={self.delta!r}, steps={self.steps})"


def require_accountant(accountant: PrivacyAccountant | None) -> PrivacyAccountant:
    """Return ``accountant``, or raise :class:`PrivacyError` if private training has none."""
    if accountant is None:
        raise PrivacyError(
            "refusing to train privately without a privacy accountant: got accountant=None; "
            "pass PrivacyAccountant(accountant='rdp', delta=...) or disable DP explicitly"
        )
    if not isinstance(accountant, PrivacyAccountant):
        raise PrivacyError(
            f"accountant must be a PrivacyAccountant, got {type(accountant).__name__}; "
            "wrap Opacus accountants in core.dp.accounting.PrivacyAccountant"
        )
    return accountant
