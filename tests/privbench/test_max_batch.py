"""The max-batch search (``privbench.bench.max_batch``) against the obvious one: asking every size in turn."""

from __future__ import annotations

import random

import pytest

from privbench.bench.max_batch import largest_fitting


def _brute(threshold: int, limit: int) -> int:
    """The largest size in 0..limit that fits when exactly the sizes up to ``threshold`` fit."""
    return max((b for b in range(1, limit + 1) if b <= threshold), default=0)


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.25])
def test_the_search_finds_what_asking_every_size_finds(tolerance: float) -> None:
    rng = random.Random(0)
    for _ in range(400):
        limit = rng.randint(1, 5000)
        threshold = rng.choice([0, limit, limit + 7, rng.randint(0, limit)])
        start = rng.randint(1, 2 * limit)
        asked: list[int] = []

        def fits(b: int, asked: list[int] = asked, threshold: int = threshold) -> bool:
            asked.append(b)
            return b <= threshold

        found = largest_fitting(fits, start=start, limit=limit, tolerance=tolerance)
        best = _brute(threshold, limit)
        case = (limit, threshold, start)
        assert len(asked) == len(set(asked)) and all(1 <= b <= limit for b in asked), case  # each size once
        assert found <= best and (found == 0) == (best == 0), case
        if tolerance == 0 or found in (0, limit):
            assert found == best, case
        else:  # within the tolerance: a size at most max(1, tol * found) above it was seen not to fit
            step = max(1, int(found * tolerance))
            assert any(b > threshold and found < b <= found + step for b in asked), case
        assert len(asked) <= 2 * (limit.bit_length() + 1) + 2, case  # logarithmic in the limit, not linear


def test_nothing_fits_and_everything_fits() -> None:
    assert largest_fitting(lambda b: False, start=64, limit=1024, tolerance=0.05) == 0
    assert largest_fitting(lambda b: True, start=64, limit=1000, tolerance=0.05) == 1000
