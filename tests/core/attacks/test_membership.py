"""Membership inference: LiRA and the loss attack on a planted toy problem, ROC metrics against slow pairwise
references, Clopper-Pearson against closed forms, and the empirical epsilon audit against the exact privacy
profile of the Gaussian mechanism (mu-GDP, Dong, Roth & Su 2019)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

from core.attacks.membership import (
    ATTACKS,
    auc_interval,
    certifiable_epsilon_max,
    clopper_pearson,
    empirical_epsilon,
    empirical_epsilon_lower_bound,
    evaluation_sizes,
    get_attack,
    lira_offline,
    lira_online,
    logit_confidence,
    logit_confidence_from_logits,
    loss_threshold_scores,
    roc,
    split_halves,
    two_sample_test,
)
from core.errors import ConfigError, DataError


def gdp_epsilon(mu: float, delta: float) -> float:
    """eps(delta) of mu-GDP: solve Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta."""
    profile = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta
    return brentq(profile, 0.0, 50.0)


def slow_auc(members: np.ndarray, nonmembers: np.ndarray) -> float:
    wins = 0.0
    for a in members:
        for b in nonmembers:
            wins += 1.0 if a > b else 0.5 if a == b else 0.0
    return wins / (len(members) * len(nonmembers))


def slow_tpr_at(members: np.ndarray, nonmembers: np.ndarray, target: float) -> float:
    best = 0.0
    for t in np.unique(np.r_[members, nonmembers]):
        if (nonmembers >= t).mean() <= target:
            best = max(best, (members >= t).mean())
    return best


# ---------------------------------------------------------------------------------------------- statistics


def test_loss_scores_negate_and_accept_tensors():
    np.testing.assert_array_equal(loss_threshold_scores(torch.tensor([0.5, 2.0])), [-0.5, -2.0])


def test_logit_confidence_matches_softmax_and_is_stable():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, (50, 10))
    y = rng.integers(0, 10, 50)
    p = torch.softmax(torch.tensor(z), dim=1).numpy()[np.arange(50), y]
    np.testing.assert_allclose(logit_confidence_from_logits(z, y), np.log(p / (1 - p)), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(logit_confidence(p), np.log(p / (1 - p)), rtol=1e-9)
    big = logit_confidence_from_logits(np.array([[60.0, 0.0, 0.0]]), np.array([0]))  # p_y = 1 in float64
    np.testing.assert_allclose(big, [60.0 - math.log(2.0)])
    assert np.isfinite(logit_confidence(np.array([0.0, 1.0]))).all()


def test_split_halves_balanced_and_seeded():
    masks = split_halves(100, 16, seed=3)
    assert masks.shape == (16, 100) and masks.dtype == bool
    assert (masks.sum(axis=0) == 8).all()
    assert 30 < masks.sum(axis=1).min() and masks.sum(axis=1).max() < 70  # each model holds about n/2
    np.testing.assert_array_equal(masks, split_halves(100, 16, seed=3))
    assert set(split_halves(200, 5, seed=0).sum(axis=0).tolist()) == {2, 3}


# ---------------------------------------------------------------------------------------------- LiRA


def planted(seed: int = 1, n: int = 400, k: int = 16):
    """Per-example difficulty d_i ~ N(0, 2^2); a model's statistic is d_i + 1.5 [i trained on] + N(0, 0.5^2)."""
    rng = np.random.default_rng(seed)
    d = rng.normal(0, 2, n)
    shadow_in = split_halves(n, k, seed=seed + 1)
    stat = lambda member: d + 1.5 * member + rng.normal(0, 0.5, n)
    shadow_stats = np.stack([stat(m) for m in shadow_in])  # (k, n)
    target_in = rng.random(n) < 0.5
    return stat(target_in), shadow_stats, shadow_in, target_in


@pytest.mark.parametrize("seed", [1, 2])
def test_lira_beats_loss_on_planted_members(seed):
    target, shadow_stats, shadow_in, is_member = planted(seed)
    scores = {name: ATTACKS[name](target if name != "loss" else -target, shadow_stats, shadow_in) for name in ATTACKS}
    res = {name: roc(s[is_member], s[~is_member]) for name, s in scores.items()}
    assert 0.6 < res["loss"]["auc"] < 0.8  # the per-example offsets hide the membership signal
    assert res["lira_online"]["auc"] > 0.9 and res["lira_online"]["auc"] > res["loss"]["auc"] + 0.15
    assert res["lira_online"]["tpr_at_1pct_fpr"] > 0.3 > res["loss"]["tpr_at_1pct_fpr"]
    assert res["lira_offline"]["auc"] > 0.8
    per_example = lira_online(target, shadow_stats, shadow_in, fix_variance=False)
    assert roc(per_example[is_member], per_example[~is_member])["auc"] > 0.9


def test_lira_online_matches_gaussian_loglik_ratio():
    target, shadow_stats, shadow_in, _ = planted(n=30, k=8)
    got = lira_online(target, shadow_stats, shadow_in, fix_variance=False)
    i = 7
    s_in, s_out = shadow_stats[shadow_in[:, i], i], shadow_stats[~shadow_in[:, i], i]
    want = norm.logpdf(target[i], s_in.mean(), s_in.std(ddof=1)) - norm.logpdf(
        target[i], s_out.mean(), s_out.std(ddof=1)
    )
    assert got[i] == pytest.approx(want, rel=1e-9)
    off = lira_offline(target, shadow_stats, shadow_in, fix_variance=False)
    assert off[i] == pytest.approx((target[i] - s_out.mean()) / s_out.std(ddof=1), rel=1e-9)


def test_online_lira_too_few_shadows_raises_with_fix():
    rng = np.random.default_rng(0)
    n = 40
    stats = rng.normal(size=(2, n))
    shadow_in = np.ones((2, n), dtype=bool)
    shadow_in[0, :17] = False  # example 17 onwards: in both shadows, never out
    shadow_in[1, :] = ~shadow_in[0, :]
    shadow_in[1, 17] = True
    with pytest.raises(ConfigError, match=r"example 17 is out of 0 of 2 shadows.*train more shadow models"):
        lira_online(stats[0], stats, shadow_in)
    with pytest.raises(ConfigError, match="global variance"):  # 1 in + 1 out everywhere: no variance estimate
        lira_online(stats[0], stats, split_halves(n, 2, seed=0))
    with pytest.raises(ConfigError, match=r"example 0 is in 1 of 2 shadows.*offline variant"):
        lira_online(stats[0], stats, split_halves(n, 2, seed=0), fix_variance=False)


@pytest.mark.parametrize("name", ["lira_online", "lira_offline"])
def test_lira_requires_shadows(name):
    with pytest.raises(ConfigError, match="needs shadow_stats"):
        get_attack(name)(np.zeros(5))
    with pytest.raises(ConfigError, match="known"):
        get_attack("lira_magic")


def test_lira_shape_and_nan_errors():
    target, shadow_stats, shadow_in, _ = planted(n=20, k=4)
    with pytest.raises(DataError, match="shapes disagree"):
        lira_online(target[:-1], shadow_stats, shadow_in)
    with pytest.raises(DataError, match="bool"):
        lira_offline(target, shadow_stats, shadow_in.astype(int))
    bad = shadow_stats.copy()
    bad[1, 3] = np.nan
    with pytest.raises(DataError, match="NaN"):
        lira_online(target, bad, shadow_in)


# ---------------------------------------------------------------------------------------------- ROC


@pytest.mark.parametrize("seed", range(3))
def test_roc_auc_and_low_fpr_tpr_match_slow_reference(seed):
    rng = np.random.default_rng(seed)
    members = rng.integers(0, 12, 150).astype(float)  # many ties
    nonmembers = rng.integers(-3, 9, 220).astype(float)
    res = roc(members, nonmembers)
    assert res["auc"] == pytest.approx(slow_auc(members, nonmembers), abs=1e-12)
    assert res["tpr_at_1pct_fpr"] == pytest.approx(slow_tpr_at(members, nonmembers, 0.01))
    assert res["tpr_at_0.1pct_fpr"] == pytest.approx(slow_tpr_at(members, nonmembers, 0.001))
    assert res["fpr"].shape == res["tpr"].shape == res["thresholds"].shape


def slow_delong_interval(members: np.ndarray, nonmembers: np.ndarray, z: float = 1.959963984540054):
    """DeLong's interval from the explicit kernel matrix psi(x, y) = 1 if x > y, 1/2 if equal, 0 otherwise."""
    psi = (members[:, None] > nonmembers[None, :]) + 0.5 * (members[:, None] == nonmembers[None, :])
    v10, v01 = psi.mean(axis=1), psi.mean(axis=0)
    se = math.sqrt(np.var(v10, ddof=1) / members.size + np.var(v01, ddof=1) / nonmembers.size)
    return max(0.0, psi.mean() - z * se), min(1.0, psi.mean() + z * se)


@pytest.mark.parametrize("seed", range(3))
def test_auc_interval_matches_the_kernel_matrix_with_ties(seed):
    rng = np.random.default_rng(seed)
    members = rng.integers(0, 12, 150).astype(float)  # many ties
    nonmembers = rng.integers(-3, 9, 220).astype(float)
    assert auc_interval(members, nonmembers) == pytest.approx(slow_delong_interval(members, nonmembers), abs=1e-12)
    low, high = auc_interval(members, nonmembers)
    assert low < roc(members, nonmembers)["auc"] < high


def test_auc_interval_covers_the_true_auc_about_95_percent_of_the_time():
    # members ~ N(0.5, 1), non-members ~ N(0, 1): true AUC = Phi(0.5 / sqrt(2)); 400 fresh draws of 200 + 200
    rng = np.random.default_rng(0)
    truth = norm.cdf(0.5 / math.sqrt(2))
    covered = [
        low <= truth <= high
        for low, high in (auc_interval(rng.normal(0.5, 1, 200), rng.normal(0, 1, 200)) for _ in range(400))
    ]
    assert 0.92 <= np.mean(covered) <= 0.98  # binomial sd of the rate at 400 draws is 1.1 points


def test_auc_interval_refuses_too_few_examples_and_bad_confidence():
    with pytest.raises(DataError, match=r">= 2 members and >= 2 non-members, got 1 and 3"):
        auc_interval([1.0], [0.0, 1.0, 2.0])
    with pytest.raises(ConfigError, match=r"confidence must lie in \(0, 1\), got confidence=95"):
        auc_interval([1.0, 2.0], [0.0, 1.0], confidence=95)


def test_roc_low_fpr_with_few_nonmembers_is_tpr_at_zero_fpr():
    res = roc(np.array([5.0, 4.0, 3.0, 0.0]), np.array([3.5, 1.0]))
    assert res["tpr_at_1pct_fpr"] == res["tpr_at_0.1pct_fpr"] == 0.5


# ---------------------------------------------------------------------------------------------- epsilon audit


def test_clopper_pearson_known_values():
    assert clopper_pearson(0, 10, 0.05) == pytest.approx((0.0, 1 - 0.025 ** (1 / 10)), abs=1e-12)
    assert clopper_pearson(0, 10, 0.05)[1] == pytest.approx(0.3085, abs=1e-4)
    assert clopper_pearson(5, 10, 0.05) == pytest.approx((0.1871, 0.8129), abs=1e-4)
    assert clopper_pearson(10, 10, 0.05) == pytest.approx((0.025 ** (1 / 10), 1.0), abs=1e-12)
    with pytest.raises(ConfigError, match="k=11"):
        clopper_pearson(11, 10, 0.05)
    with pytest.raises(ConfigError, match="alpha"):
        clopper_pearson(1, 10, 1.5)


def test_empirical_epsilon_closed_forms():
    assert empirical_epsilon(0.5, 0.05, 1e-5) == pytest.approx(math.log((0.5 - 1e-5) / 0.05))
    assert empirical_epsilon(0.96, 0.5, 0.01) == pytest.approx(math.log(0.49 / 0.04))  # the reversed test
    assert empirical_epsilon(0.3, 0.3, 1e-5) == 0.0
    assert empirical_epsilon(0.5, 0.0, 1e-5) == math.inf
    assert empirical_epsilon(1e-6, 0.0, 1e-5) == 0.0  # TPR below delta: no constraint from that side
    with pytest.raises(ConfigError, match="delta"):
        empirical_epsilon(0.5, 0.1, 0.0)


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_epsilon_audit_of_gaussian_mechanism(mu):
    delta = 1e-2
    true_eps = gdp_epsilon(mu, delta)  # mu=1: 2.318, mu=2: 5.998
    rng = np.random.default_rng(int(mu))
    members, nonmembers = rng.normal(mu, 1, 200_000), rng.normal(0, 1, 200_000)
    full = empirical_epsilon_lower_bound(members, nonmembers, delta=delta, max_thresholds=2000)
    assert full["epsilon_point"] == pytest.approx(true_eps, rel=0.1)
    assert full["epsilon_lo"] <= full["epsilon_point"] <= full["epsilon_hi"]
    valid = empirical_epsilon_lower_bound(members, nonmembers, delta=delta, max_thresholds=2000, split=True)
    assert 0.6 * true_eps < valid["epsilon_lo"] <= true_eps
    assert valid["n_members"] == valid["n_nonmembers"] == 100_000 and valid["split"]


def test_epsilon_audit_identical_distributions_is_near_zero():
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=20_000), rng.normal(size=20_000)
    assert empirical_epsilon_lower_bound(a, b, delta=1e-2, split=True)["epsilon_lo"] <= 0.1


def test_epsilon_audit_bad_input():
    ok = np.arange(5.0)
    with pytest.raises(DataError, match="empty"):
        empirical_epsilon_lower_bound(np.array([]), ok, delta=1e-3)
    with pytest.raises(DataError, match="NaN"):
        empirical_epsilon_lower_bound(np.array([1.0, np.nan]), ok, delta=1e-3)
    for delta in (0.0, 1.0, -1e-3):
        with pytest.raises(ConfigError, match="delta"):
            empirical_epsilon_lower_bound(ok, ok, delta=delta)
    with pytest.raises(ConfigError, match="alpha"):
        empirical_epsilon_lower_bound(ok, ok, delta=1e-3, alpha=0.0)
    with pytest.raises(DataError, match="empty"):
        roc(ok, [])


def _slow_best_epsilon_lo(m: int, n: int, delta: float, alpha: float) -> float:
    """The largest eps_lo over every count a threshold test can have on m members and n non-members, one
    Clopper-Pearson interval and one empirical_epsilon at a time."""
    best = 0.0
    for tp in range(m + 1):
        tpr_lo = clopper_pearson(tp, m, alpha)[0]
        for fp in range(n + 1):
            best = max(best, empirical_epsilon(tpr_lo, clopper_pearson(fp, n, alpha)[1], delta))
    return best


@pytest.mark.parametrize(
    ("n_members", "n_nonmembers", "delta", "alpha"),
    [(14, 18, 1e-5, 0.05), (81, 61, 1e-3, 0.05), (40, 40, 0.05, 0.1), (9, 120, 1e-4, 0.01)],
)
def test_certifiable_epsilon_max_is_the_best_that_any_counts_reach(n_members, n_nonmembers, delta, alpha):
    m, n = evaluation_sizes(n_members, n_nonmembers, split=True)
    assert (m, n) == (n_members - n_members // 2, n_nonmembers - n_nonmembers // 2)
    power = certifiable_epsilon_max(n_members, n_nonmembers, delta=delta, alpha=alpha)
    assert power == pytest.approx(_slow_best_epsilon_lo(m, n, delta, alpha), rel=1e-9)
    unsplit = certifiable_epsilon_max(n_members, n_nonmembers, delta=delta, alpha=alpha, split=False)
    assert unsplit == pytest.approx(_slow_best_epsilon_lo(n_members, n_nonmembers, delta, alpha), rel=1e-9)
    assert unsplit > power  # twice the evaluated examples certify more


@pytest.mark.parametrize("seed", [0, 1])
def test_certifiable_epsilon_max_is_what_a_perfect_attack_reports(seed):
    rng = np.random.default_rng(seed)
    n_members, n_nonmembers, delta = 237, 190, 1e-4
    members = rng.uniform(2, 3, n_members)  # every member scores above every non-member
    nonmembers = rng.uniform(0, 1, n_nonmembers)
    for split in (True, False):
        audit = empirical_epsilon_lower_bound(members, nonmembers, delta=delta, split=split, seed=seed)
        assert audit["tpr"] == 1.0 and audit["fpr"] == 0.0
        assert audit["epsilon_lo"] == pytest.approx(
            certifiable_epsilon_max(n_members, n_nonmembers, delta=delta, split=split), rel=1e-12
        )
    imperfect = np.r_[members[:-5], rng.uniform(0, 1, 5)]  # a few members below the threshold
    assert empirical_epsilon_lower_bound(imperfect, nonmembers, delta=delta, split=True)["epsilon_lo"] < (
        certifiable_epsilon_max(n_members, n_nonmembers, delta=delta)
    )


def test_certifiable_epsilon_max_closed_form_and_growth():
    # 10 of 10 members and 0 of 10 non-members at alpha 0.05: TPR_lo = 0.025^(1/10), FPR_hi = 1 - 0.025^(1/10)
    q = 0.025 ** (1 / 10)
    assert certifiable_epsilon_max(10, 10, delta=1e-5, split=False) == pytest.approx(math.log((q - 1e-5) / (1 - q)))
    assert certifiable_epsilon_max(19, 20, delta=1e-5) == pytest.approx(math.log((q - 1e-5) / (1 - q)))  # 10 + 10
    # a half of ml-100k's 943 users as members, the other half as non-members, halved again by the split
    assert certifiable_epsilon_max(471, 472, delta=1 / 4710) == pytest.approx(4.15, abs=0.01)
    for n in (1_000, 100_000):  # about log(n / log(2 / alpha)) evaluated per side
        assert certifiable_epsilon_max(2 * n, 2 * n, delta=1e-9) == pytest.approx(math.log(n / math.log(40)), abs=0.01)
    powers = [certifiable_epsilon_max(n, n, delta=1e-6) for n in (4, 10, 100, 1000)]
    assert powers == sorted(powers) and powers[0] < 1.0 < powers[-1]


def test_certifiable_epsilon_max_bad_input():
    with pytest.raises(DataError, match="n_members"):
        certifiable_epsilon_max(1, 10, delta=1e-3)  # one member cannot be split into two halves
    with pytest.raises(DataError, match="n_nonmembers"):
        certifiable_epsilon_max(10, 0, delta=1e-3, split=False)
    with pytest.raises(ConfigError, match="delta"):
        certifiable_epsilon_max(10, 10, delta=0.0)
    with pytest.raises(ConfigError, match="alpha"):
        certifiable_epsilon_max(10, 10, delta=1e-3, alpha=1.0)


def test_two_sample_test_detects_shift_only():
    rng = np.random.default_rng(0)
    same = two_sample_test(rng.normal(size=2000), rng.normal(size=2000))
    assert same["ks_pvalue"] > 0.01 and same["mw_pvalue"] > 0.01 and abs(same["auc"] - 0.5) < 0.05
    a, b = rng.normal(0.5, 1, 2000), rng.normal(size=2000)
    shifted = two_sample_test(a, b)
    assert shifted["ks_pvalue"] < 1e-6 and shifted["mw_pvalue"] < 1e-6
    assert shifted["auc"] == pytest.approx(roc(a, b)["auc"], abs=1e-12)
