"""Membership-inference audit of a trained model: attack scores for its members and non-members, ROC, TPR at
low FPR, and an empirical lower bound on epsilon next to the accountant's (``core.attacks.membership``).

The audit needs the target's training-set membership (:class:`AuditTarget.members`): without it there is no
ground truth and :func:`audit` refuses. Shadow (reference) models are trained by the *same* training code on
random halves of the same population (``membership.split_halves``); the member unit is whatever the privacy
guarantee protects: a user's whole sequence for user-level DP on sequential recommendation.

Per-example statistic (higher = more member-like): for sequential recommenders, the mean next-item
log-likelihood of the user's training positions (:func:`seqrec_user_stats`), the sequence analogue of LiRA's
logit-scaled confidence; its distribution over models is close to Gaussian, which LiRA assumes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.attacks import membership as M
from core.attacks import one_run as R
from core.data.sequential import SequentialDataset
from core.errors import ConfigError, DataError
from core.models.loss import sequence_loss


@dataclass(frozen=True)
class AuditTarget:
    """A target model's statistic per example (n,) and its training-set membership (n,) bool (None when it
    was not recorded: such a target cannot be audited). ``accountant_epsilon``/``delta``: the DP guarantee
    claimed for it (None for a non-private model; the audit then uses ``delta`` for its bound only)."""

    name: str
    stats: np.ndarray
    members: np.ndarray | None
    accountant_epsilon: float | None = None
    delta: float | None = None


def subset_users(data: SequentialDataset, users: Sequence[int] | np.ndarray) -> SequentialDataset:
    """The dataset restricted to ``users`` (indices, kept in the given order), same item id space."""
    users = np.asarray(users, dtype=np.int64)
    if users.ndim != 1 or users.size == 0:
        raise DataError("subset_users needs a non-empty 1-D array of user indices")
    if users.min() < 0 or users.max() >= data.n_users:
        raise DataError(f"user indices must lie in 0..{data.n_users - 1}, got {users.min()}..{users.max()}")
    lens = data.seq_lens[users]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    take = np.concatenate([np.arange(data.offsets[u], data.offsets[u + 1]) for u in users])
    return SequentialDataset(
        items=data.items[take],
        timestamps=data.timestamps[take],
        offsets=offsets,
        raw_user_ids=np.asarray(data.raw_user_ids)[users],
        raw_item_ids=data.raw_item_ids,
        source=f"{data.source} (subset of {users.size} users)",
        k=data.k,
    )


@torch.no_grad()
def seqrec_user_stats(
    model: torch.nn.Module,
    data: SequentialDataset,
    *,
    max_len: int,
    train_targets: str = "last_window",
    batch_size: int = 256,
) -> np.ndarray:
    """(U,) mean next-item log-likelihood of every user's training positions under ``model`` (eval mode),
    -sum_t CE(logits_t, s_{t+1}) / T over the SASRec training pairs the model was trained on:
    ``SequentialDataset.train_windows`` (every pair) for ``train_targets="every"``, ``train_examples`` (the last
    ``max_len``) for ``"last_window"``."""
    model.eval()
    counts = data.train_window_counts(max_len) if train_targets == "every" else np.ones(data.n_users, np.int64)
    out = np.empty(data.n_users)
    order = np.argsort(-counts, kind="stable")  # similar window counts together, about batch_size windows a batch
    start = 0
    while start < data.n_users:
        per_batch = max(1, batch_size // int(counts[order[start]]))
        users = order[start : start + per_batch]
        if train_targets == "every":
            inputs, targets = data.train_windows(max_len, users)
        else:
            inputs, targets = data.train_examples(max_len, users)
        out[users] = -sequence_loss(model(inputs), targets, position_reduction="mean").double().numpy()
        start += per_batch
    return out


def audit(
    target: AuditTarget,
    *,
    attacks: Sequence[str],
    shadow_stats: np.ndarray | None = None,
    shadow_in: np.ndarray | None = None,
    delta: float,
    alpha: float = 0.05,
    max_thresholds: int | None = 2000,
    family: int | None = None,
) -> dict[str, dict]:
    """Every attack of ``attacks`` (names of ``membership.ATTACKS``) against ``target``: ROC AUC with its 95%
    interval over the examples (``auc_ci``, DeLong), TPR at 0.1%
    and 1% FPR, the ROC curve, and the empirical epsilon at ``delta`` from (TPR, FPR) at one threshold with
    its Clopper-Pearson interval at confidence 1 - alpha: the threshold is chosen on one random half of the
    examples and the rates are counted on the other (``empirical_epsilon_lower_bound(split=True)``), so
    ``empirical_epsilon_ci[0]`` is a valid lower bound on the true epsilon with probability 1 - alpha and can
    only exceed the accountant's epsilon if the accounting (or the training) is wrong. ``empirical_epsilon``
    is the point estimate from add-half rates at that threshold (finite even where no non-member passes it).
    ``certifiable_epsilon_max`` is the largest lower bound this estimator could report at these sample sizes,
    ``delta`` and ``alpha`` (a perfect attack, ``membership.certifiable_epsilon_max``): where it does not exceed
    the accountant's epsilon the audit cannot catch a broken guarantee, whatever the attack.
    ``empirical_epsilon_lo_family`` and ``certifiable_epsilon_max_family`` are the same at confidence
    1 - alpha / family (``alpha_family``, Bonferroni; ``family`` None: ``len(attacks)``): a claim that takes the
    strongest of ``family`` such bounds (every attack of every audited run it judges) holds with probability
    1 - alpha, which the strongest of their single bounds does not. Each confidence picks its own threshold on the
    selection half (the bound's width enters the choice); the evaluation half is untouched by either choice, so
    both bounds are valid. One attack is
    ``selected``: the strongest by AUC on a fixed random half of the examples (``auc_selection``); every attack's
    AUC on the other half is ``auc_heldout`` (DeLong interval ``auc_heldout_ci``), which judges the selected one.

    ``empirical_epsilon_ci`` counts every example as an independent trial of the Clopper-Pearson rates, an
    analysis established for many training runs (Jagielski et al. 2020), not for the members of ONE run. The
    one-run audit of Steinke, Nasr & Jagielski 2023 is valid for one run whose members were drawn independently
    with probability 1/2 (as ``tasks.audit`` draws them) and whose number of guesses is fixed independently of that
    membership: ``one_run_epsilon_lo`` is ``one_run.one_run_epsilon_lower_bound`` on every example at ``delta``
    and confidence 1 - alpha, the attack guessing its k+ highest-scoring examples IN and its k- lowest OUT and
    abstaining on the rest, with (k+, k-) chosen on the shadow models alone (:func:`one_run_counts`: their
    membership is known and drawn independently of the target's, so the counts do not depend on it; without
    shadows every example is guessed, half each way). ``one_run_epsilon_lo_family`` is the same at 1 - alpha /
    family (its own counts), and ``one_run_certifiable_epsilon_max`` / ``one_run_certifiable_epsilon_max_family``
    what a perfect attack reports with those counts (every guess right), the power of that audit;
    ``one_run_k_plus`` / ``one_run_k_minus`` (and ``..._family``) record the counts.

    Raises:
        ConfigError: the target's membership was not recorded; an unknown attack; LiRA without shadows.
        DataError: shadow statistics that do not match the target's examples.
    """
    if target.members is None:
        raise ConfigError(
            f"target {target.name!r}: its training-set membership was not recorded, so an audit has no "
            "ground truth; train the target through the audit (which records the member mask) or "
            "pass members="
        )
    members = np.asarray(target.members, dtype=bool)
    stats = np.asarray(target.stats, dtype=np.float64)
    if members.shape != stats.shape or stats.ndim != 1:
        raise DataError(
            f"target {target.name!r}: {stats.shape} statistics but {members.shape} membership flags; "
            "both must be one value per example"
        )
    if members.all() or not members.any():
        raise DataError(
            f"target {target.name!r}: needs both members and non-members, got {int(members.sum())} "
            f"members of {members.size}"
        )
    if shadow_stats is not None and np.asarray(shadow_stats).shape[-1] != stats.size:
        raise DataError(
            f"shadow statistics cover {np.asarray(shadow_stats).shape[-1]} examples but the target has "
            f"{stats.size}; compute both on the same examples, in the same order"
        )
    n_members, n_nonmembers = int(members.sum()), int((~members).sum())
    power = M.certifiable_epsilon_max(n_members, n_nonmembers, delta=delta, alpha=alpha, split=True)
    # the claim "no attack proves more than the accountant" reads the strongest of several bounds (every attack of
    # every audited run): each at alpha / family (Bonferroni), so that all of them hold together with probability
    # 1 - alpha
    if family is not None and family < len(attacks):
        raise ConfigError(
            f"family={family} counts fewer bounds than the {len(attacks)} attacks run; pass at least that"
        )
    alpha_family = alpha / (family or max(len(attacks), 1))
    power_family = M.certifiable_epsilon_max(n_members, n_nonmembers, delta=delta, alpha=alpha_family, split=True)
    n = members.size
    counts = {  # per confidence: the counts are chosen for the bound they will be read at
        a: one_run_counts(shadow_stats, shadow_in, n, delta=delta, alpha=a, max_counts=max_thresholds)
        for a in dict.fromkeys((alpha, alpha_family))
    }
    one_run_power = {
        a: R.one_run_epsilon_from_counts(n, sum(k), sum(k), delta=delta, alpha=a) for a, k in counts.items()
    }
    choose = selection_half(members, seed=SELECTION_SEED)
    out: dict[str, dict] = {}
    for name in attacks:
        fn = M.get_attack(name)
        target_stat = -stats if name == "loss" else stats  # the loss attack takes losses
        scores = fn(target_stat, shadow_stats=shadow_stats, shadow_in=shadow_in)
        curve = M.roc(scores[members], scores[~members])
        bounds = {  # the same split (seed 0) at each confidence; each picks its threshold on the selection half
            a: M.empirical_epsilon_lower_bound(
                scores[members],
                scores[~members],
                delta=delta,
                alpha=a,
                max_thresholds=max_thresholds,
                split=True,
                seed=0,
            )
            for a in dict.fromkeys((alpha, alpha_family))
        }
        eps, family = bounds[alpha], bounds[alpha_family]
        one_run = {  # every example, at counts fixed by the shadows
            a: R.one_run_epsilon_lower_bound(
                scores[members], scores[~members], delta=delta, alpha=a, k_plus=k[0], k_minus=k[1]
            )["epsilon_lo"]
            for a, k in counts.items()
        }
        out[name] = {
            "auc": float(curve["auc"]),
            "auc_ci": list(M.auc_interval(scores[members], scores[~members])),
            "tpr_at_0.1pct_fpr": float(curve["tpr_at_0.1pct_fpr"]),
            "tpr_at_1pct_fpr": float(curve["tpr_at_1pct_fpr"]),
            "empirical_epsilon": _point_epsilon(eps, delta),
            "empirical_epsilon_ci": [float(eps["epsilon_lo"]), float(eps["epsilon_hi"])],
            "certifiable_epsilon_max": power,
            "empirical_epsilon_lo_family": float(family["epsilon_lo"]),
            "certifiable_epsilon_max_family": power_family,
            "alpha_family": alpha_family,
            "one_run_epsilon_lo": one_run[alpha],
            "one_run_epsilon_lo_family": one_run[alpha_family],
            "one_run_certifiable_epsilon_max": one_run_power[alpha],
            "one_run_certifiable_epsilon_max_family": one_run_power[alpha_family],
            "one_run_k_plus": counts[alpha][0],
            "one_run_k_minus": counts[alpha][1],
            "one_run_k_plus_family": counts[alpha_family][0],
            "one_run_k_minus_family": counts[alpha_family][1],
            "threshold_tpr": float(eps["tpr"]),
            "threshold_fpr": float(eps["fpr"]),
            "accountant_epsilon": target.accountant_epsilon,
            "delta": delta,
            "alpha": alpha,
            "n_members": n_members,
            "n_nonmembers": n_nonmembers,
            "roc": {"fpr": _thin(curve["fpr"]), "tpr": _thin(curve["tpr"])},
            **_held_out(scores, members, choose),
        }
    # the strongest on the selection half, the first of equals in ``attacks`` order (the first where none could be)
    chosen = max(attacks, key=lambda a: -math.inf if math.isnan(out[a]["auc_selection"]) else out[a]["auc_selection"])
    for name in attacks:
        out[name]["selected"] = name == chosen
    return out


def _held_out(scores: np.ndarray, members: np.ndarray, choose: np.ndarray | None) -> dict[str, object]:
    if choose is None:  # too few examples to halve: nothing to choose on, nothing held out
        return {"auc_selection": math.nan, "auc_heldout": math.nan, "auc_heldout_ci": [math.nan, math.nan]}
    held = ~choose
    return {
        "auc_selection": float(M.roc(scores[choose & members], scores[choose & ~members])["auc"]),
        "auc_heldout": float(M.roc(scores[held & members], scores[held & ~members])["auc"]),
        "auc_heldout_ci": list(M.auc_interval(scores[held & members], scores[held & ~members])),
    }


SELECTION_SEED = 20261128  # fixed: the selection half must not depend on any result


def selection_half(members: np.ndarray, *, seed: int) -> np.ndarray | None:
    """A mask of half the examples (half the members and half the non-members, at random with ``seed``) on which
    the audit chooses its attack, the strongest by AUC there; the other half judges the chosen attack alone
    (``auc_heldout``), so a claim reads one attack chosen before its own data was seen, not the best of several
    after the fact (which inflates every side it is applied to). None where either side has fewer than 4
    examples (each half needs two for an AUC interval)."""
    members = np.asarray(members, dtype=bool)
    if min(int(members.sum()), int((~members).sum())) < 4:
        return None
    rng = np.random.default_rng(seed)
    mask = np.zeros(members.size, dtype=bool)
    for group in (np.flatnonzero(members), np.flatnonzero(~members)):
        mask[rng.permutation(group)[: group.size // 2]] = True
    return mask


def one_run_counts(
    shadow_stats: np.ndarray | None,
    shadow_in: np.ndarray | None,
    n: int,
    *,
    delta: float,
    alpha: float,
    max_counts: int | None = 2000,
) -> tuple[int, int]:
    """(k+, k-): how many of a target's ``n`` examples the one-run audit guesses IN (its highest scores) and OUT
    (its lowest), chosen without the target: on each shadow model (``shadow_stats`` (k, n), higher = more likely
    a member, with its membership ``shadow_in``) the loss attack's best counts by the one-run bound at ``delta`` and
    ``alpha`` (``one_run.one_run_epsilon_lower_bound`` choosing on that shadow's own examples), the median share
    of its examples over the shadows, scaled to ``n``. The shadows' memberships are drawn independently of the
    target's, so the counts are fixed with respect to it, as the one-run theorem needs. Without shadows: every
    example, ``n // 2`` each way."""
    if shadow_stats is None or shadow_in is None or len(shadow_stats) == 0:
        return n // 2, n - n // 2
    stats, inside = np.asarray(shadow_stats, dtype=np.float64), np.asarray(shadow_in, dtype=bool)
    if stats.shape != inside.shape or stats.shape[1] != n:
        raise DataError(f"shadow statistics {stats.shape} and memberships {inside.shape} must both be (k, {n})")
    shares = []
    for s, m in zip(stats, inside, strict=True):
        if m.all() or not m.any():
            continue
        best = R.one_run_epsilon_lower_bound(s[m], s[~m], delta=delta, alpha=alpha, max_counts=max_counts)
        shares.append((best["k_plus"] / n, best["k_minus"] / n))
    if not shares:
        return n // 2, n - n // 2
    k_plus, k_minus = (round(float(np.median([sh[i] for sh in shares])) * n) for i in (0, 1))
    if k_plus + k_minus == 0:
        return n // 2, n - n // 2
    return k_plus, min(k_minus, n - k_plus)


def _point_epsilon(eps: dict, delta: float) -> float:
    """The point estimate of epsilon at the audit's threshold from add-half rates (tp + 1/2) / (n + 1): finite
    where the raw rates give inf (no non-member above the threshold), identical in the limit of many examples."""
    tp, fp = eps["tpr"] * eps["n_members"], eps["fpr"] * eps["n_nonmembers"]
    return M.empirical_epsilon((tp + 0.5) / (eps["n_members"] + 1), (fp + 0.5) / (eps["n_nonmembers"] + 1), delta)


def _thin(values: np.ndarray, n: int = 200) -> list[float]:
    """At most ``n`` points of a curve (evenly by index, endpoints kept), for the artifact."""
    values = np.asarray(values, dtype=np.float64)
    if values.size <= n:
        return values.tolist()
    return values[np.unique(np.linspace(0, values.size - 1, n).round().astype(int))].tolist()


def audit_groups(
    groups: dict[str, tuple[np.ndarray, np.ndarray]],
    *,
    delta: float,
    alpha: float = 0.05,
    max_thresholds: int | None = 2000,
) -> dict[str, dict]:
    """The loss-threshold audit of several (member statistics, non-member statistics) pairs of one model, e.g.
    the forgotten samples of an unlearned model against fresh non-members (they should be indistinguishable:
    AUC near 0.5 and an empirical epsilon interval containing 0)."""
    out = {}
    for setting, (inside, outside) in groups.items():
        inside, outside = np.asarray(inside, dtype=np.float64), np.asarray(outside, dtype=np.float64)
        stats = np.concatenate([inside, outside])
        members = np.concatenate([np.ones(inside.size, bool), np.zeros(outside.size, bool)])
        out[setting] = audit(
            AuditTarget(setting, stats, members),
            attacks=("loss",),
            delta=delta,
            alpha=alpha,
            max_thresholds=max_thresholds,
        )["loss"]
    return out
