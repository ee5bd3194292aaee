"""The membership audit's pieces against slow references: user subsets, per-user statistics (one user at a
time), and the audit on planted members; a target without recorded membership or with mismatched data is
refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.attacks.audit import AuditTarget, audit, seqrec_user_stats, subset_users
from core.attacks.membership import certifiable_epsilon_max, split_halves
from core.data.sequential import SequentialDataset
from core.errors import ConfigError, DataError
from core.models.loss import sequence_loss
from core.models.seqrec import SeqRecConfig, build_seqrec
from tests.core.data.random_sequences import random_sequences


def _data(n_users: int = 12, n_items: int = 20, seed: int = 0) -> SequentialDataset:
    return random_sequences(n_users, n_items, min_len=3, max_len=8, seed=seed)


def test_subset_users_keeps_each_sequence_and_the_item_space() -> None:
    data = _data()
    sub = subset_users(data, [7, 2, 9])
    assert sub.n_users == 3 and len(sub.raw_item_ids) == len(data.raw_item_ids)
    for i, u in enumerate([7, 2, 9]):
        assert np.array_equal(sub.sequence(i), data.sequence(u))
    with pytest.raises(DataError, match="0..11"):
        subset_users(data, [3, 12])
    with pytest.raises(DataError, match="non-empty"):
        subset_users(data, [])


def test_user_statistics_match_a_per_user_loop() -> None:
    data = _data()
    torch.manual_seed(0)
    model = build_seqrec(SeqRecConfig(num_items=20, max_len=8, d_model=16, n_heads=2, n_layers=1, dropout=0.0))
    fast = seqrec_user_stats(model, data, max_len=8, batch_size=5)
    slow = []
    with torch.no_grad():
        for u in range(data.n_users):  # one user at a time: -mean CE over the training positions
            inputs, targets = data.train_examples(8, [u])
            logits = model(inputs)[0]
            valid = targets[0] != 0
            ce = (
                torch.nn.functional.cross_entropy(logits[valid], targets[0][valid], reduction="sum")
                if valid.any()
                else 0
            )
            slow.append(-float(ce) / max(int(valid.sum()), 1))
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        whole = -sequence_loss(model(data.train_examples(8)[0]), data.train_examples(8)[1], position_reduction="mean")
    assert np.allclose(fast, whole.numpy(), atol=1e-5)


def _planted(n: int, k: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(stats, members, shadow stats, shadow membership) of ``n`` examples whose statistic rises by 1.5 when the
    example trained the model, around a per-example difficulty: LiRA, which learns the difficulty from ``k``
    shadows, must beat the loss threshold."""
    rng = np.random.default_rng(0)
    difficulty = rng.normal(0, 2, n)
    members = split_halves(n, 2, seed=1)[0]
    shadow_in = split_halves(n, k, seed=2)
    shadows = difficulty + 1.5 * shadow_in + rng.normal(0, 0.5, (k, n))
    stats = difficulty + 1.5 * members + rng.normal(0, 0.5, n)
    return stats, members, shadows, shadow_in


def test_audit_finds_planted_members_and_bounds_epsilon() -> None:
    n = 2000
    stats, members, shadows, shadow_in = _planted(n)
    out = audit(
        AuditTarget("planted", stats, members, accountant_epsilon=None),
        attacks=("loss", "lira_online"),
        shadow_stats=shadows,
        shadow_in=shadow_in,
        delta=1e-3,
    )
    assert out["lira_online"]["auc"] > 0.9 > out["loss"]["auc"] > 0.55
    lo, hi = out["lira_online"]["empirical_epsilon_ci"]
    assert 0 < lo <= out["lira_online"]["empirical_epsilon"] <= hi
    assert len(out["lira_online"]["roc"]["fpr"]) <= 200
    n_in = int(members.sum())  # the audit's power: a perfect attack's bound at these sizes, the same for each attack
    power = certifiable_epsilon_max(n_in, n - n_in, delta=1e-3, alpha=0.05)
    assert out["loss"]["certifiable_epsilon_max"] == out["lira_online"]["certifiable_epsilon_max"] == power
    assert lo < power


def test_the_family_bound_holds_for_the_strongest_of_the_attacks() -> None:
    """The epsilon claim reads the strongest attack's bound: each attack's family bound is its bound at confidence
    1 - alpha / k for k attacks (Bonferroni), on the same split and threshold, so it is at most the single bound
    and equal to it for one attack (checked against the estimator called by hand)."""
    from core.attacks.membership import empirical_epsilon_lower_bound, get_attack

    stats, members, shadows, shadow_in = _planted(600)
    kw = {"shadow_stats": shadows, "shadow_in": shadow_in, "delta": 1e-3}
    three = ("loss", "lira_online", "lira_offline")
    out = audit(AuditTarget("planted", stats, members), attacks=three, **kw)
    for name, r in out.items():
        scores = get_attack(name)(-stats if name == "loss" else stats, shadow_stats=shadows, shadow_in=shadow_in)
        by_hand = empirical_epsilon_lower_bound(
            scores[members], scores[~members], delta=1e-3, alpha=0.05 / 3, max_thresholds=2000, split=True, seed=0
        )
        assert r["alpha_family"] == pytest.approx(0.05 / 3)
        assert r["empirical_epsilon_lo_family"] == pytest.approx(by_hand["epsilon_lo"])
        assert r["empirical_epsilon_lo_family"] <= r["empirical_epsilon_ci"][0]
        assert r["certifiable_epsilon_max_family"] <= r["certifiable_epsilon_max"]
    one = audit(AuditTarget("planted", stats, members), attacks=("lira_online",), **kw)["lira_online"]
    assert one["empirical_epsilon_lo_family"] == one["empirical_epsilon_ci"][0]
    assert one["certifiable_epsilon_max_family"] == one["certifiable_epsilon_max"]


def test_the_attack_is_chosen_on_one_half_and_judged_on_the_other() -> None:
    """The planted case again: LiRA is the strongest and is chosen on the selection half; its held-out AUC is the
    AUC of its scores on the other half alone (recomputed here from the mask), and the halves split members and
    non-members evenly."""
    from core.attacks.audit import SELECTION_SEED, selection_half
    from core.attacks.membership import get_attack, roc

    stats, members, shadows, shadow_in = _planted(400)
    kw = {"shadow_stats": shadows, "shadow_in": shadow_in, "delta": 1e-3}
    out = audit(AuditTarget("planted", stats, members), attacks=("loss", "lira_online"), **kw)
    assert [a for a, r in out.items() if r["selected"]] == ["lira_online"]
    choose = selection_half(members, seed=SELECTION_SEED)
    assert choose is not None and (choose & members).sum() == members.sum() // 2
    assert (choose & ~members).sum() == (~members).sum() // 2
    scores = get_attack("lira_online")(stats, shadow_stats=shadows, shadow_in=shadow_in)
    held = ~choose
    assert out["lira_online"]["auc_heldout"] == pytest.approx(
        roc(scores[held & members], scores[held & ~members])["auc"]
    )
    lo, hi = out["lira_online"]["auc_heldout_ci"]
    assert lo <= out["lira_online"]["auc_heldout"] <= hi
    # the order of the attacks does not change the choice; a useless attack listed first is not chosen
    swapped = audit(AuditTarget("planted", stats, members), attacks=("lira_online", "loss"), **kw)
    assert swapped["lira_online"]["selected"] and not swapped["loss"]["selected"]
    # too few examples to halve: nothing is held out, and the first attack stands
    few = audit(AuditTarget("few", stats[:6], np.array([1, 1, 1, 0, 0, 0], bool)), attacks=("loss",), delta=1e-3)
    assert few["loss"]["selected"] and np.isnan(few["loss"]["auc_heldout"])


def test_audit_refuses_unrecorded_membership_and_mismatched_data() -> None:
    stats = np.zeros(10)
    with pytest.raises(ConfigError, match="membership was not recorded"):
        audit(AuditTarget("t", stats, None), attacks=("loss",), delta=1e-3)
    with pytest.raises(DataError, match="one value per example"):
        audit(AuditTarget("t", stats, np.ones(9, bool)), attacks=("loss",), delta=1e-3)
    with pytest.raises(DataError, match="same examples"):
        audit(
            AuditTarget("t", stats, np.arange(10) % 2 == 0),
            attacks=("lira_offline",),
            shadow_stats=np.zeros((4, 8)),
            shadow_in=np.zeros((4, 8), bool),
            delta=1e-3,
        )
    with pytest.raises(ConfigError, match="shadow"):
        audit(AuditTarget("t", stats, np.arange(10) % 2 == 0), attacks=("lira_online",), delta=1e-3)


def test_a_family_smaller_than_the_attacks_is_refused_and_a_larger_one_widens_the_bound() -> None:
    stats, members, shadows, shadow_in = _planted(600)
    kw = {"shadow_stats": shadows, "shadow_in": shadow_in, "delta": 1e-3}
    with pytest.raises(ConfigError, match="family=1 counts fewer bounds than the 2 attacks"):
        audit(AuditTarget("planted", stats, members), attacks=("loss", "lira_online"), family=1, **kw)
    three = audit(AuditTarget("planted", stats, members), attacks=("lira_online",), **kw)["lira_online"]
    wide = audit(AuditTarget("planted", stats, members), attacks=("lira_online",), family=18, **kw)["lira_online"]
    assert wide["alpha_family"] == pytest.approx(0.05 / 18)
    assert wide["empirical_epsilon_lo_family"] < three["empirical_epsilon_lo_family"]
    assert wide["certifiable_epsilon_max_family"] < three["certifiable_epsilon_max_family"]
