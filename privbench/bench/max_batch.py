"""The largest batch that fits, found with few trials: each trial of a batch size costs a fresh process and a
training step, so the search doubles from a start until a size does not fit (or halves until one does), then
bisects to within a relative tolerance. It assumes that a batch that fits means every smaller one fits."""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting(fits: Callable[[int], bool], *, start: int, limit: int, tolerance: float) -> int:
    """A batch size ``b`` in ``0..limit`` with ``fits(b)`` (0: not even 1 fits) such that some size above ``b`` by at
    most ``max(1, int(b * tolerance))`` does not fit, or ``b == limit``; with ``tolerance`` 0 the largest that fits.
    ``fits`` is asked in order (doubling or halving from ``min(start, limit)``, then bisection) and never twice
    for one size."""
    lo, hi = 0, None
    batch = max(1, min(start, limit))
    if fits(batch):
        lo = batch
        while hi is None and lo < limit:
            batch = min(lo * 2, limit)
            if fits(batch):
                lo = batch
            else:
                hi = batch
        if hi is None:
            return lo  # fits at the limit
    else:
        hi = batch
        while lo == 0 and hi > 1:
            batch = hi // 2
            if fits(batch):
                lo = batch
            else:
                hi = batch
        if lo == 0:
            return 0
    while hi - lo > max(1, int(lo * tolerance)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
