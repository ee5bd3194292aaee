"""The one-run audit (Steinke, Nasr & Jagielski 2023): its p-value against exact binomial sums (fractions), its bound
against a slow bisection and the paper's worked values, its validity and consistency on simulated eps-DP randomized
response, what a perfect attack certifies, its monotonicity and bad input, and its place in ``audit``."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from core.attacks.audit import AuditTarget, audit, one_run_counts
from core.attacks.membership import get_attack
from core.attacks.one_run import (
    one_run_certifiable_epsilon_max,
    one_run_epsilon_from_counts,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)
from core.errors import ConfigError, DataError
from tests.core.attacks.test_audit import _planted


def exact_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The theorem's right-hand side by direct summation in fractions: f(v) + 2 m delta max_{i=1..m} (f(v - i) -
    f(v)) / i, f(u) = P[Binomial(r, q) >= u] (1 for u <= 0), q = 1 / (1 + e^-eps) (the float, exactly)."""
    q = 1 / (1 + Fraction(math.exp(-eps)))
    pmf = [math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]

    def f(u: int) -> Fraction:
        return sum(pmf[max(u, 0) :], Fraction(0))

    tail = f(v)
    gap = max((f(v - i) - tail) / i for i in range(1, m + 1))
    return float(min(tail + 2 * m * Fraction(delta) * gap, Fraction(1)))


def slow_epsilon(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """The largest eps whose exact p-value is below alpha, by plain bisection on [0, 30]."""
    if exact_p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 30.0
    for _ in range(45):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exact_p_value(m, r, v, mid, delta) < alpha else (lo, mid)
    return lo


def randomized_response(n: int, eps: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(scores, members) of an eps-DP "attack": each example IN with probability 1/2, its score its membership
    reported truthfully with probability e^eps / (1 + e^eps) (independently), plus a tie-breaking jitter."""
    members = rng.random(n) < 0.5
    truthful = rng.random(n) < 1 / (1 + math.exp(-eps))
    return (members == truthful) + rng.uniform(-0.1, 0.1, n), members


# ---------------------------------------------------------------------------------------------- p-value and bound


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (10, 10, 9, 1.0, 0.0),
        (12, 8, 7, 0.5, 1e-3),
        (30, 20, 15, 0.8, 1e-2),
        (25, 25, 25, 2.0, 0.0),
        (40, 25, 3, 0.3, 0.05),
        (30, 12, 12, 3.0, 1e-4),
        (7, 1, 1, 0.1, 0.2),
        (50, 30, 0, 1.0, 1e-3),
    ],
)
def test_p_value_matches_exact_binomial_sums(m, r, v, eps, delta):
    assert one_run_p_value(m, r, v, epsilon=eps, delta=delta) == pytest.approx(
        exact_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-300
    )


@pytest.mark.parametrize(
    ("m", "r", "v", "delta", "alpha"),
    [(20, 20, 18, 0.0, 0.05), (20, 20, 18, 1e-3, 0.05), (30, 16, 15, 1e-2, 0.1), (25, 25, 25, 1e-4, 0.01)]
    + [(40, 22, 14, 0.0, 0.2), (40, 22, 12, 1e-3, 0.05)],
)
def test_bound_matches_a_slow_bisection_on_the_exact_p_value(m, r, v, delta, alpha):
    fast = one_run_epsilon_from_counts(m, r, v, delta=delta, alpha=alpha)
    assert fast == pytest.approx(slow_epsilon(m, r, v, delta, alpha), abs=1e-7)
    if fast > 0:  # the reported eps is itself rejected
        assert one_run_p_value(m, r, v, epsilon=fast, delta=delta) < alpha


def test_bound_reproduces_the_papers_worked_values():
    # Steinke et al.'s App. D example and their Sec. 7 (Fig. 11) figure, 0.673 and 2.675 as printed there (as
    # quoted by public reproductions of their code)
    assert one_run_epsilon_from_counts(1000, 100, 75, delta=1e-4, alpha=0.05) == pytest.approx(0.673, abs=1e-3)
    assert one_run_epsilon_from_counts(100_000, 1510, 1439, delta=1e-5, alpha=0.05) == pytest.approx(2.675, abs=2e-3)


def test_pure_dp_bound_is_the_logit_of_the_clopper_pearson_lower_limit():
    # v = r: P[Bin(r, q) >= r] = q^r = alpha at q = alpha^(1/r)
    q = 0.05 ** (1 / 40)
    assert one_run_epsilon_from_counts(40, 40, 40, delta=0.0) == pytest.approx(math.log(q / (1 - q)), rel=1e-10)
    assert one_run_certifiable_epsilon_max(17, 23, delta=0.0, split=False) == pytest.approx(math.log(q / (1 - q)))
    assert one_run_certifiable_epsilon_max(39, 41, delta=0.0) == pytest.approx(math.log(q / (1 - q)))  # 80 - 40
    assert one_run_epsilon_from_counts(100, 80, 40, delta=0.0) == 0.0  # no better than a coin
    assert one_run_epsilon_from_counts(100, 0, 0, delta=1e-5) == 0.0


# ---------------------------------------------------------------------------------------------- randomized response


@pytest.mark.parametrize(("eps", "delta"), [(1.0, 0.0), (2.0, 0.0), (2.0, 1e-3)])
def test_randomized_response_bound_holds_with_confidence(eps, delta):
    """eps-DP randomized response, every one of 300 examples guessed, 2000 repetitions: the bound at alpha = 0.05
    exceeds the true eps in at most alpha of them (up to 3 Monte Carlo standard deviations), yet is far from vacuous."""
    rng = np.random.default_rng(11)
    right = rng.binomial(300, 1 / (1 + math.exp(-eps)), size=2000)
    bounds = np.array([one_run_epsilon_from_counts(300, 300, int(v), delta=delta, alpha=0.05) for v in right])
    assert (bounds > eps).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
    assert np.median(bounds) > 0.75 * eps


def test_randomized_response_bound_approaches_eps_with_more_guesses():
    rng = np.random.default_rng(3)
    q = 1 / (1 + math.exp(-2.0))
    bounds = [one_run_epsilon_from_counts(r, r, round(q * r), delta=1e-6, alpha=0.05) for r in (100, 1000, 20_000)]
    assert bounds == sorted(bounds) and bounds[-1] > 1.9
    v = int(rng.binomial(20_000, q))  # one draw of 20,000 guesses at eps = 2
    assert 1.5 < one_run_epsilon_from_counts(20_000, 20_000, v, delta=1e-6, alpha=0.05) < 2.0


def test_randomized_response_attack_through_the_scores():
    """The whole estimator on eps-DP randomized-response scores (split=True, counts chosen on one half): valid over
    300 trainings of 400 examples, and above 1.5 at eps = 2 with 20,000 evaluated examples."""
    rng = np.random.default_rng(7)
    over = []
    for seed in range(300):
        scores, members = randomized_response(400, 1.0, rng)
        out = one_run_epsilon_lower_bound(
            scores[members], scores[~members], delta=1e-4, alpha=0.05, split=True, seed=seed
        )
        assert out["m"] == 200 and out["n_members"] + out["n_nonmembers"] == 200
        over.append(out["epsilon_lo"] > 1.0)
    assert np.mean(over) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300)
    scores, members = randomized_response(40_000, 2.0, rng)
    big = one_run_epsilon_lower_bound(scores[members], scores[~members], delta=1e-6, split=True, max_counts=2000)
    assert big["m"] == 20_000 and 1.5 < big["epsilon_lo"] < 2.0


# ---------------------------------------------------------------------------------------------- power


@pytest.mark.parametrize(("delta", "alpha"), [(0.0, 0.05), (2e-4, 0.05), (2e-4, 0.05 / 18), (1e-2, 0.1)])
def test_a_perfect_attack_certifies_exactly_the_maximum(delta, alpha):
    rng = np.random.default_rng(0)
    members, nonmembers = rng.uniform(2, 3, 237), rng.uniform(0, 1, 190)
    for split in (True, False):
        out = one_run_epsilon_lower_bound(members, nonmembers, delta=delta, alpha=alpha, split=split, seed=4)
        assert out["n_guesses"] == out["n_correct"] == out["m"] == (214 if split else 427)
        assert out["epsilon_lo"] == one_run_certifiable_epsilon_max(237, 190, delta=delta, alpha=alpha, split=split)
    imperfect = np.r_[members[:-20], rng.uniform(0, 1, 20)]  # some members among the non-members
    worse = one_run_epsilon_lower_bound(imperfect, nonmembers, delta=delta, alpha=alpha, split=True)
    assert worse["epsilon_lo"] < one_run_certifiable_epsilon_max(237, 190, delta=delta, alpha=alpha)


def test_certifiable_maximum_at_the_audits_sizes():
    # 471 members and 471 non-members, split: 471 evaluated, every one guessed right
    assert one_run_certifiable_epsilon_max(471, 471, delta=2e-4, alpha=0.05 / 18) == pytest.approx(2.0566, abs=1e-4)
    assert one_run_certifiable_epsilon_max(471, 471, delta=2e-4, alpha=0.05) == pytest.approx(4.7899, abs=1e-4)
    assert one_run_certifiable_epsilon_max(471, 471, delta=0.0, alpha=0.05) == pytest.approx(5.0545, abs=1e-4)
    # ml-100k's 943 users halved by the split (472 evaluated) at delta = 1 / 4710
    assert one_run_certifiable_epsilon_max(471, 472, delta=1 / 4710, alpha=0.05) == pytest.approx(4.78, abs=0.01)


@pytest.mark.parametrize(("m", "delta", "alpha"), [(12, 1e-2, 0.05), (30, 2e-4, 0.05 / 18), (30, 0.0, 0.1)])
def test_certifiable_maximum_is_the_best_any_counts_reach(m, delta, alpha):
    power = one_run_certifiable_epsilon_max(m, m, delta=delta, alpha=alpha, split=False)  # 2m examples bounded
    best = max(
        one_run_epsilon_from_counts(2 * m, r, v, delta=delta, alpha=alpha)
        for r in range(1, 2 * m + 1)
        for v in range(r + 1)
    )
    assert power == best


# ---------------------------------------------------------------------------------------------- monotonicity


def test_bound_grows_with_right_guesses_and_alpha_and_falls_with_delta():
    by_v = [one_run_epsilon_from_counts(500, 200, v, delta=1e-4) for v in range(100, 201, 10)]
    assert by_v == sorted(by_v) and by_v[0] == 0.0 and by_v[-1] > 4.0
    by_alpha = [one_run_epsilon_from_counts(500, 200, 170, delta=1e-6, alpha=a) for a in (1e-4, 1e-3, 0.01, 0.1, 0.5)]
    assert by_alpha == sorted(by_alpha) and len(set(by_alpha)) == 5
    by_delta = [one_run_epsilon_from_counts(500, 200, 170, delta=d) for d in (0.0, 1e-6, 1e-4, 1e-3, 1e-2)]
    assert by_delta == sorted(by_delta, reverse=True) and len(set(by_delta)) == 5
    p = [one_run_p_value(500, 200, 170, epsilon=e, delta=1e-4) for e in np.linspace(0, 3, 31)]
    assert p == sorted(p)


def test_fixed_counts_guess_the_top_in_and_the_bottom_out():
    members, nonmembers = np.array([5.0, 4.0, 1.5, 0.2]), np.array([3.0, 1.0, 0.5, 0.1])
    out = one_run_epsilon_lower_bound(members, nonmembers, delta=0.0, k_plus=3, k_minus=2)
    # top 3: 5, 4 (IN, right), 3 (OUT, wrong); bottom 2: 0.1 (OUT, right), 0.2 (IN, wrong)
    assert (out["n_guesses"], out["n_correct"], out["m"]) == (5, 3, 8)
    assert out["epsilon_lo"] == one_run_epsilon_from_counts(8, 5, 3, delta=0.0)
    # equal scores are ranked at random, not by group: a constant attack gets about half right
    flat = one_run_epsilon_lower_bound(np.zeros(500), np.zeros(500), delta=0.0, k_plus=500, k_minus=0)
    assert abs(flat["n_correct"] - 250) < 50 and flat["epsilon_lo"] == 0.0


def test_bad_input_is_refused():
    ok = np.arange(6.0)
    for alpha in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="alpha"):
            one_run_epsilon_lower_bound(ok, ok, delta=1e-3, alpha=alpha)
        with pytest.raises(ConfigError, match="alpha"):
            one_run_epsilon_from_counts(10, 5, 4, delta=1e-3, alpha=alpha)
    for delta in (1.0, -1e-3, 2.0):
        with pytest.raises(ConfigError, match="delta"):
            one_run_epsilon_lower_bound(ok, ok, delta=delta)
        with pytest.raises(ConfigError, match="delta"):
            one_run_certifiable_epsilon_max(5, 5, delta=delta)
    with pytest.raises(DataError, match="empty"):
        one_run_epsilon_lower_bound(np.array([]), ok, delta=1e-3)
    with pytest.raises(DataError, match="empty"):
        one_run_epsilon_lower_bound(ok, [], delta=1e-3, split=True)
    with pytest.raises(DataError, match="NaN"):
        one_run_epsilon_lower_bound(np.array([1.0, np.nan]), ok, delta=1e-3)
    with pytest.raises(DataError, match="n_nonmembers"):
        one_run_certifiable_epsilon_max(5, 0, delta=1e-3)
    with pytest.raises(ConfigError, match="k_plus"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, k_plus=3)
    with pytest.raises(ConfigError, match="1..12"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, k_plus=10, k_minus=3)
    with pytest.raises(ConfigError, match="split=False"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, k_plus=1, k_minus=1, split=True)
    with pytest.raises(ConfigError, match="split=True"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, selection=(ok > 2, ok > 2))
    with pytest.raises(DataError, match="do not fit"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, split=True, selection=(ok > 2, ok[:3] > 2))
    with pytest.raises(DataError, match="half empty"):
        one_run_epsilon_lower_bound(ok, ok, delta=1e-3, split=True, selection=(ok > -1, ok > -1))
    with pytest.raises(ConfigError, match=r"v <= r"):
        one_run_p_value(10, 5, 6, epsilon=1.0, delta=0.0)
    with pytest.raises(ConfigError, match="epsilon"):
        one_run_p_value(10, 5, 4, epsilon=-1.0, delta=0.0)


# ---------------------------------------------------------------------------------------------- in the audit


def test_audit_reports_the_one_run_bound_at_counts_the_shadows_fix():
    stats, members, shadows, shadow_in = _planted(800)
    kw = {"shadow_stats": shadows, "shadow_in": shadow_in, "delta": 1e-3}
    out = audit(AuditTarget("planted", stats, members), attacks=("loss", "lira_online"), family=18, **kw)
    for name, r in out.items():
        scores = get_attack(name)(-stats if name == "loss" else stats, shadow_stats=shadows, shadow_in=shadow_in)
        for suffix, alpha in (("", 0.05), ("_family", 0.05 / 18)):
            k_plus, k_minus = one_run_counts(shadows, shadow_in, 800, delta=1e-3, alpha=alpha)
            assert (r[f"one_run_k_plus{suffix}"], r[f"one_run_k_minus{suffix}"]) == (k_plus, k_minus)
            by_hand = one_run_epsilon_lower_bound(
                scores[members], scores[~members], delta=1e-3, alpha=alpha, k_plus=k_plus, k_minus=k_minus
            )
            assert r[f"one_run_epsilon_lo{suffix}"] == by_hand["epsilon_lo"]
            r_all = k_plus + k_minus
            perfect = one_run_epsilon_from_counts(800, r_all, r_all, delta=1e-3, alpha=alpha)
            assert r[f"one_run_certifiable_epsilon_max{suffix}"] == perfect
        assert r["one_run_epsilon_lo_family"] <= r["one_run_epsilon_lo"] <= r["one_run_certifiable_epsilon_max"]
        assert r["one_run_certifiable_epsilon_max_family"] < r["one_run_certifiable_epsilon_max"]
    assert out["lira_online"]["one_run_epsilon_lo"] > out["loss"]["one_run_epsilon_lo"] > 0


def test_the_guess_counts_do_not_read_the_targets_membership():
    """The one-run theorem needs the number of guesses fixed with respect to the target's membership: the counts
    come from the shadows alone, so any other membership of the target gets the same counts."""
    stats, members, shadows, shadow_in = _planted(800)
    kw = {"shadow_stats": shadows, "shadow_in": shadow_in, "delta": 1e-3}
    first = audit(AuditTarget("planted", stats, members), attacks=("loss",), **kw)["loss"]
    other = np.random.default_rng(5).random(800) < 0.5
    second = audit(AuditTarget("planted", stats, other), attacks=("loss",), **kw)["loss"]
    assert (first["one_run_k_plus"], first["one_run_k_minus"]) == (second["one_run_k_plus"], second["one_run_k_minus"])
    assert 0 < first["one_run_k_plus"] + first["one_run_k_minus"] <= 800
    assert one_run_counts(None, None, 801, delta=1e-3, alpha=0.05) == (400, 401)  # no shadows: every example
