"""An encrypted generation's cost as a function of sequence length, fitted from measured runs and projected
to lengths too long to measure (MERGE Table 1 at length 128, Fig. 4 up to 512).

A greedy generation of ``G`` new tokens after a ``P``-token prompt is, per party and for each of seconds,
bytes and rounds,

    ``total(P, G) = prefix(P) + step_0(P) + sum_{i=1..G-1} f(P + i) + decode(G)``

with ``prefix`` the sharing of the prompt before the first step, ``step_0`` the step that reads the prompt,
step ``i >= 1`` the step whose sequence is ``n = P + i`` tokens long and ``decode`` what follows the last
step (the final LM head and argmax where a method decodes at the end, the reveal). ``core.mpc.gpt2`` records
these phases (``GenerationResult.phases``, ``step_*``). The step cost is at most quadratic in ``n`` for every
method: a method that recomputes the sequence pays linear layers and the embedding lookup on ``n`` positions
and attention on ``n^2`` scores, a cached or merged one attends one position to ``n``; the softmax's maximum
over ``n`` keys is a tree of comparisons, ``log2 n`` rounds deep. So

    ``f(n) = c0 + c1 n + c2 n^2 + c3 log2(n)`` with ``c >= 0`` (non-negative least squares over every step
    i >= 1 of the runs),
    ``decode(G) = d0 + d1 G`` with ``d >= 0`` (least squares over runs of different ``G``; one ``G`` only:
    ``d0 = 0``, ``d1 = decode / G``, labelled ``proportional``).

Bytes and rounds are deterministic, so their fit is close to exact where the model holds (the tree's odd
levels make it not quite so): ``max_rel_residual`` is the check. Seconds are noisy, and a polynomial fitted to
them from short sequences says little about the n^2 term at length 512. :func:`fit_seconds` therefore prices a
step by what it does, ``s = a bytes + b rounds + c`` (``a, b, c >= 0``, fitted on the measured steps): the work
of an encrypted op is proportional to the ring elements it opens and the round trips it waits for, so the
projected seconds follow the bytes and rounds fits. Beyond the measured lengths every figure is a projection,
to be labelled as one.

A fit's residual on the runs it was fitted to says nothing about how it extrapolates. :func:`split_longest` and
:func:`predict_held_out` check that: fit on every measured run but the longest, predict the longest (its steps
i >= 1 and decoding from the fit, after its own measured head) and compare with what was measured.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.errors import ConfigError

__all__ = [
    "HeldOut",
    "LengthFit",
    "MeasuredGeneration",
    "RateFit",
    "fit_length",
    "fit_seconds",
    "nnls_small",
    "predict_held_out",
    "project",
    "rel_err",
    "split_longest",
    "tail",
]


@dataclass(frozen=True)
class MeasuredGeneration:
    """One measured generation's cost in one unit (seconds, bytes or rounds), split into its phases."""

    prefix_len: int
    gen_len: int
    prefix: float  # before step 0
    steps: tuple[float, ...]  # step i = 0 .. gen_len - 1
    decode: float  # after the last step

    def __post_init__(self) -> None:
        if self.prefix_len < 1 or self.gen_len < 1:
            raise ConfigError(f"prefix_len and gen_len must be >= 1, got {self.prefix_len} and {self.gen_len}")
        if len(self.steps) != self.gen_len:
            raise ConfigError(f"{len(self.steps)} step costs for gen_len={self.gen_len}; give one per step")
        values = (self.prefix, self.decode, *self.steps)
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in values):
            raise ConfigError(f"costs must be finite numbers >= 0, got prefix={self.prefix}, decode={self.decode}, "
                              f"steps={list(self.steps)}")  # fmt: skip

    @property
    def total(self) -> float:
        return self.prefix + sum(self.steps) + self.decode

    @property
    def head(self) -> float:
        """What does not scale with the generated length: the prefix phase and step 0."""
        return self.prefix + self.steps[0]


@dataclass(frozen=True)
class LengthFit:
    """``f(n) = step[0] + step[1] n + step[2] n^2 + step[3] log2(n)`` and ``decode(G) = decode[0] + decode[1] G``."""

    step: tuple[float, float, float, float]
    decode: tuple[float, float]
    decode_model: str  # "linear" (runs of two or more G) or "proportional" (one G)
    max_rel_residual: float  # of f on the steps it was fitted to
    n_range: tuple[int, int]  # the sequence lengths the step fit saw

    def step_cost(self, n: float) -> float:
        return self.step[0] + self.step[1] * n + self.step[2] * n * n + self.step[3] * math.log2(n)

    def as_dict(self) -> dict[str, object]:
        return {
            "step": list(self.step),
            "decode": list(self.decode),
            "decode_model": self.decode_model,
            "max_rel_residual": self.max_rel_residual,
            "n_range": list(self.n_range),
        }


def nnls_small(a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Non-negative least squares ``argmin_{x >= 0} |a x - y|`` for a few columns, exactly: the optimum is the
    unconstrained least-squares solution on its own support, so every support is tried (2^k - 1 of them) and
    the best feasible one kept. ``a`` (m, k) with k <= 6, ``y`` (m,); float64."""
    k = a.shape[1]
    if k > 6:
        raise ConfigError(f"nnls_small enumerates supports; {k} columns is too many (at most 6)")
    best, best_res = torch.zeros(k, dtype=torch.float64), float(torch.linalg.vector_norm(y))
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            sol = torch.linalg.lstsq(a[:, cols], y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
            if bool((sol < 0).any()):
                continue
            x = torch.zeros(k, dtype=torch.float64)
            x[cols] = sol
            res = float(torch.linalg.vector_norm(a @ x - y))
            if res < best_res - 1e-12 * max(1.0, best_res):
                best, best_res = x, res
    return best


def fit_length(runs: Sequence[MeasuredGeneration]) -> LengthFit:
    """Fit ``f`` on every step i >= 1 of ``runs`` and ``decode`` on their decode phases (module docstring).
    Needs steps i >= 1 at four or more distinct lengths."""
    points = [(r.prefix_len + i, c) for r in runs for i, c in enumerate(r.steps) if i >= 1]
    if len({n for n, _ in points}) < 4:
        raise ConfigError(
            "the step fit needs steps i >= 1 at 4 or more distinct lengths, got lengths "
            f"{sorted({n for n, _ in points})}; generate more tokens (gen_len >= 5) or add a run at another "
            "prefix length"
        )
    n = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    scale = float(n.max())  # columns 1, n/s, (n/s)^2, log2(n) keep the system well conditioned
    a = torch.stack([torch.ones_like(n), n / scale, (n / scale) ** 2, torch.log2(n)], dim=1)
    c = nnls_small(a, y)
    step = (float(c[0]), float(c[1]) / scale, float(c[2]) / scale**2, float(c[3]))
    fitted = a @ c
    rel = (fitted - y).abs() / y.abs().clamp_min(1e-300)
    max_rel = float(rel.max()) if bool((y > 0).all()) else float((fitted - y).abs().max())
    by_g: dict[int, list[float]] = {}
    for r in runs:
        by_g.setdefault(r.gen_len, []).append(r.decode)
    if len(by_g) >= 2:
        g = torch.tensor([float(k) for k, v in by_g.items() for _ in v], dtype=torch.float64)
        d = torch.tensor([x for v in by_g.values() for x in v], dtype=torch.float64)
        dc = nnls_small(torch.stack([torch.ones_like(g), g], dim=1), d)
        decode, model = (float(dc[0]), float(dc[1])), "linear"
    else:
        ((g0, ds),) = by_g.items()
        decode, model = (0.0, sum(ds) / len(ds) / g0), "proportional"
    return LengthFit(step, decode, model, max_rel, (int(n.min()), int(n.max())))


@dataclass(frozen=True)
class RateFit:
    """Seconds of a step from its bytes and rounds: ``per_byte bytes(n) + per_round rounds(n) + per_step``, with
    ``bytes`` and ``rounds`` the length fits; ``decode(G)`` fitted on the seconds directly."""

    per_byte: float
    per_round: float
    per_step: float
    bytes_fit: LengthFit
    rounds_fit: LengthFit
    decode: tuple[float, float]
    decode_model: str
    max_rel_residual: float  # of the rate model on the measured steps' seconds

    def step_cost(self, n: float) -> float:
        work = self.per_byte * self.bytes_fit.step_cost(n) + self.per_round * self.rounds_fit.step_cost(n)
        return work + self.per_step

    def as_dict(self) -> dict[str, object]:
        return {
            "per_byte": self.per_byte,
            "per_round": self.per_round,
            "per_step": self.per_step,
            "decode": list(self.decode),
            "decode_model": self.decode_model,
            "max_rel_residual": self.max_rel_residual,
        }


def fit_seconds(
    seconds: Sequence[MeasuredGeneration], bytes_: Sequence[MeasuredGeneration], rounds: Sequence[MeasuredGeneration]
) -> RateFit:
    """:class:`RateFit` of the same runs measured in seconds, bytes and rounds (same order, same shapes): the
    rates by non-negative least squares over every step i >= 1, ``decode`` as in :func:`fit_length`."""
    shapes = [[(g.prefix_len, g.gen_len) for g in gens] for gens in (seconds, bytes_, rounds)]
    if not shapes[0] == shapes[1] == shapes[2]:
        raise ConfigError(f"seconds, bytes and rounds must describe the same runs, got {shapes}")
    rows = [
        (s, b, r)
        for gs, gb, gr in zip(seconds, bytes_, rounds, strict=True)
        for i, (s, b, r) in enumerate(zip(gs.steps, gb.steps, gr.steps, strict=True))
        if i >= 1
    ]
    y = torch.tensor([row[0] for row in rows], dtype=torch.float64)
    cols = torch.tensor([[row[1], row[2], 1.0] for row in rows], dtype=torch.float64)
    scale = cols.abs().amax(dim=0).clamp_min(1.0)  # bytes are ~1e9, rounds ~1e3: scale the columns
    coef = nnls_small(cols / scale, y) / scale
    fitted = cols @ coef
    max_rel = float(((fitted - y).abs() / y.abs().clamp_min(1e-300)).max()) if bool((y > 0).all()) else 0.0
    direct = fit_length(seconds)
    return RateFit(
        float(coef[0]), float(coef[1]), float(coef[2]), fit_length(bytes_), fit_length(rounds),
        direct.decode, direct.decode_model, max_rel,
    )  # fmt: skip


def tail(fit: LengthFit | RateFit, prefix_len: int, gen_len: int) -> float:
    """What ``fit`` says follows the head of a generation of ``gen_len`` new tokens after a ``prefix_len``-token
    prompt: the steps i = 1 .. G - 1 and the decoding, ``sum_{i=1..G-1} f(P + i) + decode(G)``."""
    if prefix_len < 1 or gen_len < 1:
        raise ConfigError(f"prefix_len and gen_len must be >= 1, got {prefix_len} and {gen_len}")
    steps = sum(fit.step_cost(prefix_len + i) for i in range(1, gen_len))
    return steps + fit.decode[0] + fit.decode[1] * gen_len


def project(fit: LengthFit | RateFit, head: float, prefix_len: int, total_len: int) -> float:
    """Projected cost of generating up to ``total_len`` tokens in all after a ``prefix_len``-token prompt whose
    measured ``head`` (prefix phase + step 0) is given: ``head + sum_{i=1..G-1} f(P + i) + decode(G)``,
    ``G = total_len - prefix_len``."""
    gen = total_len - prefix_len
    if gen < 1:
        raise ConfigError(f"total_len={total_len} must exceed prefix_len={prefix_len} (at least one new token)")
    return head + tail(fit, prefix_len, gen)


def rel_err(predicted: float, measured: float) -> float:
    """``|predicted - measured| / |measured|`` (the absolute difference where ``measured`` is 0)."""
    return abs(predicted - measured) / max(abs(measured), 1e-300)


def split_longest(
    runs: Sequence[MeasuredGeneration],
) -> tuple[tuple[MeasuredGeneration, ...], MeasuredGeneration]:
    """The hold-out split of measured ``runs``: every run but the longest (in total length ``prefix_len +
    gen_len``), to fit on, and the longest, to predict. Needs 2 or more runs of distinct total lengths."""
    totals = [r.prefix_len + r.gen_len for r in runs]
    if len(runs) < 2 or len(set(totals)) != len(totals):
        raise ConfigError(
            f"a hold-out check needs 2 or more runs of distinct total lengths, got total lengths {totals}; "
            "measure another run at a different length"
        )
    longest = totals.index(max(totals))
    return tuple(r for j, r in enumerate(runs) if j != longest), runs[longest]


@dataclass(frozen=True)
class HeldOut:
    """A fit's prediction of a measured run it was not fitted on. ``total``: the run's measured head (prefix phase
    + step 0, which a projection also takes from a measured run) plus the fit's steps i >= 1 and decoding;
    ``tail``: those steps and the decoding alone, the part the fit extrapolates."""

    predicted: float
    measured: float
    tail_predicted: float
    tail_measured: float

    @property
    def rel_err(self) -> float:
        return rel_err(self.predicted, self.measured)

    @property
    def tail_rel_err(self) -> float:
        return rel_err(self.tail_predicted, self.tail_measured)

    def as_dict(self) -> dict[str, float]:
        return {
            "predicted": self.predicted,
            "measured": self.measured,
            "rel_err": self.rel_err,
            "tail_predicted": self.tail_predicted,
            "tail_measured": self.tail_measured,
            "tail_rel_err": self.tail_rel_err,
        }


def predict_held_out(fit: LengthFit | RateFit, run: MeasuredGeneration, measured_total: float | None = None) -> HeldOut:
    """``fit``'s prediction of the measured ``run`` (one it was not fitted on: :func:`split_longest`).
    ``measured_total``: the run's total where it is not the sum of its phases (the slower party's total against
    each phase's slower party); the head kept is then that total less the measured steps i >= 1 and decoding."""
    predicted_tail = tail(fit, run.prefix_len, run.gen_len)
    measured_tail = sum(run.steps[1:]) + run.decode
    total = run.total if measured_total is None else float(measured_total)
    return HeldOut(total - measured_tail + predicted_tail, total, predicted_tail, measured_tail)
