"""The order-statistic (sign-test) interval of a median: exact coverage against scipy's binomial, the chosen rank
against a search over every rank, the coverage by simulation, and known data."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from core.errors import ConfigError
from core.order_stats import median_coverage, median_interval, sign_test_rank


@pytest.mark.parametrize("n", range(1, 41))
def test_the_rank_is_the_largest_whose_binomial_coverage_reaches_95_percent(n: int) -> None:
    coverages = {k: 1 - 2 * stats.binom.cdf(k - 1, n, 0.5) for k in range(1, (n + 1) // 2 + 1)}
    for k, expected in coverages.items():
        assert median_coverage(n, k) == pytest.approx(expected, abs=1e-12)
    enough = [k for k, c in coverages.items() if c >= 0.95]
    assert sign_test_rank(n) == (max(enough) if enough else None)


def test_known_ranks_and_data() -> None:
    # a 95% interval needs 6 samples; the textbook ranks for n = 9 and n = 20 are (2, 8) and (6, 15)
    assert [sign_test_rank(n) for n in (5, 6, 8, 9, 20)] == [None, 1, 1, 2, 6]
    six = median_interval([1.3, 0.9, 1.1, 1.0, 1.2, 1.5])
    assert (six.median, six.lo, six.hi, six.n, six.rank) == (pytest.approx(1.15), 0.9, 1.5, 6, 1)
    assert six.coverage == 1 - 2 / 64
    nine = median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5])
    assert (nine.median, nine.lo, nine.hi, nine.coverage) == (5.0, 2.0, 8.0, 1 - 2 * 10 / 512)
    five = median_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # too few rounds: no interval, said so
    assert (five.median, five.lo, five.hi, five.rank, five.coverage) == (3.0, None, None, None, None)
    assert median_interval([1.0] * 6).lo == median_interval([1.0] * 6).hi == 1.0  # ties: degenerate, still valid
    wide = median_interval(range(20), confidence=0.99)
    assert (wide.lo, wide.hi) == (3.0, 16.0)  # rank 4: 1 - 2 P(Bin(20, 1/2) <= 3) = 0.9974


@pytest.mark.parametrize("n", [6, 9, 15])
def test_coverage_by_simulation_matches_the_exact_coverage(n: int) -> None:
    # a skewed distribution (log-normal, median 1): the interval is distribution free
    rng = np.random.default_rng(20250)
    trials = 4000
    hits = 0
    for sample in rng.lognormal(mean=0.0, sigma=1.0, size=(trials, n)):
        interval = median_interval(sample)
        hits += interval.lo <= 1.0 <= interval.hi
    exact = median_interval(range(n)).coverage
    assert exact >= 0.95
    se = (exact * (1 - exact) / trials) ** 0.5
    assert abs(hits / trials - exact) < 4 * se, (hits / trials, exact)


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ConfigError, match="at least one value"):
        median_interval([])
    with pytest.raises(ConfigError, match="finite values, got nan"):
        median_interval([1.0, float("nan")])
    with pytest.raises(ConfigError, match=r"confidence must be a number in \(0, 1\).*got 95"):
        median_interval([1.0] * 6, confidence=95)
    with pytest.raises(ConfigError, match="n must be a positive int"):
        sign_test_rank(0)
    with pytest.raises(ConfigError, match=r"rank must be an int in \[1, 3\] for n = 6, got 4"):
        median_coverage(6, 4)
