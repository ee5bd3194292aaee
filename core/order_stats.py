"""A distribution-free confidence interval for a median from order statistics (the sign-test interval).

For ``n`` independent samples of a continuous distribution with median ``m``, sorted ``x_(1) <= ... <= x_(n)``,
the number of samples below ``m`` is Binomial(n, 1/2), so for ``k <= n / 2``

    P(x_(k) <= m <= x_(n+1-k)) = 1 - 2 P(Bin(n, 1/2) <= k - 1)

whatever the distribution. :func:`median_interval` takes the largest ``k`` whose coverage is at least the asked
confidence (the narrowest such interval of this form); with ties the coverage is at least that. A 95% interval
needs ``n >= 6`` samples: with 5, even ``[x_(1), x_(5)]`` covers the median with probability 1 - 2/32 = 0.9375 only,
and the interval is then absent (``lo``/``hi`` None). Used for the per-round ratios of the benchmarks, whose
rounds are independent repeats under whatever load the machine had.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from core.errors import ConfigError

CONFIDENCE = 0.95


@dataclass(frozen=True)
class MedianInterval:
    """The sample median of ``n`` values and the order-statistic interval ``[lo, hi]`` of the median.

    ``coverage`` is the interval's exact coverage ``1 - 2 P(Bin(n, 1/2) <= rank - 1)`` (at least the asked
    confidence); ``rank`` is ``k`` (``lo = x_(k)``, ``hi = x_(n+1-k)``). Where ``n`` is too small for the asked
    confidence, ``lo``, ``hi``, ``rank`` and ``coverage`` are None."""

    median: float
    n: int
    lo: float | None
    hi: float | None
    rank: int | None
    coverage: float | None


def _check_confidence(confidence: float) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) or not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be a number in (0, 1), e.g. 0.95, got {confidence!r}")
    return float(confidence)


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be a positive int (the number of samples), got {n!r}")
    return n


def median_coverage(n: int, rank: int) -> float:
    """``1 - 2 P(Bin(n, 1/2) <= rank - 1)``: the probability that ``[x_(rank), x_(n+1-rank)]`` of ``n`` samples of
    a continuous distribution holds its median (``1 <= rank <= (n + 1) / 2``)."""
    n = _check_n(n)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= (n + 1) // 2:
        raise ConfigError(f"rank must be an int in [1, {(n + 1) // 2}] for n = {n}, got {rank!r}")
    below = sum(math.comb(n, i) for i in range(rank))  # exact integers: P(Bin <= rank - 1) * 2^n
    return 1.0 - 2.0 * below / 2**n


def sign_test_rank(n: int, confidence: float = CONFIDENCE) -> int | None:
    """The largest ``k`` with ``median_coverage(n, k) >= confidence``, None where even ``k = 1`` falls short."""
    n, confidence = _check_n(n), _check_confidence(confidence)
    best = None
    for rank in range(1, (n + 1) // 2 + 1):
        if median_coverage(n, rank) < confidence:
            break
        best = rank
    return best


def median_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> MedianInterval:
    """The median of ``values`` with its distribution-free ``confidence`` interval (module docstring)."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ConfigError("median_interval needs at least one value, got none")
    bad = [v for v in data if not math.isfinite(v)]
    if bad:
        raise ConfigError(f"median_interval needs finite values, got {bad[0]!r}; drop the missing samples first")
    n = len(data)
    rank = sign_test_rank(n, confidence)
    if rank is None:
        return MedianInterval(statistics.median(data), n, None, None, None, None)
    return MedianInterval(statistics.median(data), n, data[rank - 1], data[n - rank], rank, median_coverage(n, rank))
