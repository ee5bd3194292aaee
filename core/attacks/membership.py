"""Membership-inference audits: the loss-threshold attack, LiRA, ROC metrics and empirical epsilon lower bounds.

Attacks (every score is "higher = more likely a member"):

* ``loss``: Yeom et al. 2018, score = -loss.
* ``lira_online`` / ``lira_offline``: the Likelihood Ratio Attack of Carlini et al. 2022 ("Membership Inference
  Attacks From First Principles", Sec. IV). ``k`` shadow models are trained on random halves of the data
  (``split_halves``); for each example the per-model statistic phi (logit-scaled confidence,
  ``logit_confidence``; for sequence models any per-example statistic the caller computes) is fitted by a
  Gaussian over the shadow models that trained on it (IN) and those that did not (OUT).

  - online (their Eq. 4 / Alg. 1): score = log N(phi_t | mu_in, s_in^2) - log N(phi_t | mu_out, s_out^2);
  - offline (Sec. IV-C): one-sided test against the OUT Gaussian only, 1 - Pr[Z > phi_t], Z ~ N(mu_out,
    s_out^2). We return the standardised statistic (phi_t - mu_out) / s_out, which is Phi^-1 of that
    quantity, hence a strictly monotone transform of it: same ROC, no underflow in the tail.

  ``fix_variance=True`` (the paper's choice with few shadows) uses one global s_in and one global s_out: the
  pooled within-example standard deviation sqrt(sum_i sum_j (phi_ij - mu_i)^2 / sum_i (k_i - 1)). (The
  reference code uses ``np.std`` of all IN values, which also counts the spread of mu_i across examples; the
  pooled estimate is the Gaussian MLE the paper describes.) Means are per-example sample means.

Metrics: ``roc`` (ROC AUC, TPR at 0.1% and 1% FPR), ``auc_interval`` (DeLong's interval of the AUC over the
examples), ``clopper_pearson``, ``empirical_epsilon`` and
``empirical_epsilon_lower_bound`` (the (eps, delta)-DP audit of Jagielski et al. 2020 / Nasr et al. 2021: any
threshold test on an (eps, delta)-DP mechanism has TPR <= e^eps FPR + delta and 1 - FPR <= e^eps (1 - TPR) +
delta), ``certifiable_epsilon_max`` (the largest lower bound that audit can report at its sample sizes: the
power of the audit; for ONE trained model whose examples were each included by a fair coin, the audit of Steinke,
Nasr & Jagielski 2023 is :mod:`core.attacks.one_run`), and ``two_sample_test`` (are unlearned samples distributed like
non-members?).

Shapes: ``n`` examples, ``k`` shadow models; ``shadow_stats`` and ``shadow_in`` are ``(k, n)``.
Anchor (Carlini et al. Table/Fig. 1): LiRA with 16 shadows, non-private CIFAR-10: AUC 0.668, TPR 1.7% at 0.1% FPR.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats
from sklearn.metrics import roc_auc_score, roc_curve

from core.errors import ConfigError, DataError
from core.registry import lookup

AttackName = Literal["loss", "lira_online", "lira_offline"]
ArrayLike = np.ndarray | torch.Tensor | list | tuple


# ---------------------------------------------------------------------------------------------- validation


def _as_array(x: Any, name: str, *, ndim: int, dtype: type = np.float64) -> np.ndarray:
    """``x`` as a numpy array of ``ndim`` dimensions, non-empty and (for floats) free of NaN."""
    if x is None:
        raise ConfigError(f"{name} is required, got None")
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != ndim:
        raise DataError(f"{name} must be {ndim}-D, got shape {arr.shape}; pass one value per example")
    if arr.size == 0:
        raise DataError(f"{name} is empty (shape {arr.shape}); pass at least one example")
    if dtype is bool:
        if arr.dtype != bool:
            raise DataError(f"{name} must be a boolean mask, got dtype {arr.dtype}; pass a bool array")
        return arr
    arr = arr.astype(np.float64)
    if np.isnan(arr).any():
        bad = np.flatnonzero(np.isnan(arr.ravel()))[:5].tolist()
        raise DataError(f"{name} contains NaN (flat indices {bad}...); drop or fix those examples")
    return arr


def _check_prob(value: float, name: str) -> float:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and 0.0 < float(value) < 1.0):
        raise ConfigError(f"{name} must be in (0, 1), got {name}={value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------- statistics


def loss_threshold_scores(losses: ArrayLike) -> np.ndarray:
    """Yeom et al. 2018: score = -loss, shape ``(n,)`` (a low loss marks a member)."""
    return -_as_array(losses, "losses", ndim=1)


def logit_confidence(p_true: ArrayLike, *, eps: float = 1e-12) -> np.ndarray:
    """LiRA's statistic phi(p) = log(p / (1 - p)) of the true-class probability, p clipped to [eps, 1 - eps].
    Prefer ``logit_confidence_from_logits`` when logits are at hand: it is exact for p near 1."""
    p = _as_array(p_true, "p_true", ndim=1)
    if ((p < 0) | (p > 1)).any():
        raise DataError(f"p_true must lie in [0, 1], got min={p.min()} max={p.max()}; pass probabilities")
    p = np.clip(p, eps, 1.0 - eps)
    return np.log(p) - np.log1p(-p)


def logit_confidence_from_logits(logits: ArrayLike, labels: ArrayLike) -> np.ndarray:
    """phi = z_y - logsumexp_{j != y} z_j for logits ``(n, C)`` and labels ``(n,)``; equals log(p_y / (1 - p_y))
    with p = softmax(z), without the cancellation of 1 - p_y."""
    z = _as_array(logits, "logits", ndim=2)
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.shape != (z.shape[0],) or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"labels must be integers of shape ({z.shape[0]},), got {y.dtype} {y.shape}")
    if z.shape[1] < 2 or (y < 0).any() or (y >= z.shape[1]).any():
        raise DataError(f"labels must be in [0, {z.shape[1]}) with >= 2 classes, got range [{y.min()}, {y.max()}]")
    rows = np.arange(z.shape[0])
    z_y = z[rows, y]
    others = z.copy()
    others[rows, y] = -np.inf
    m = others.max(axis=1)
    lse = m + np.log(np.exp(others - m[:, None]).sum(axis=1))
    return z_y - lse


# ---------------------------------------------------------------------------------------------- shadows


def split_halves(n: int, k: int, *, seed: int) -> np.ndarray:
    """Membership masks ``(k, n)`` for ``k`` shadow models each trained on a random half of ``n`` examples.

    Carlini et al.'s balanced trick: every example is IN for exactly k/2 shadows (a random choice of k/2 of the
    k models, independently per example), so online LiRA has k/2 IN and k/2 OUT fits everywhere; each model
    then holds about (not exactly) n/2 examples. For odd ``k`` each example is IN for floor(k/2) or ceil(k/2)
    models, each with probability 1/2.
    """
    if not (isinstance(n, int) and n >= 1):
        raise ConfigError(f"split_halves needs n >= 1 examples, got {n=}")
    if not (isinstance(k, int) and k >= 1):
        raise ConfigError(f"split_halves needs k >= 1 shadow models, got {k=}")
    rng = np.random.default_rng(seed)
    n_in = np.full(n, k // 2) + (rng.random(n) < 0.5) * (k % 2)  # (n,) IN count per example
    ranks = rng.random((k, n)).argsort(axis=0).argsort(axis=0)  # (k, n) random permutation of 0..k-1 per example
    return ranks < n_in[None, :]


def _shadow_arrays(target_stat: Any, shadow_stats: Any, shadow_in: Any, variant: str):
    if shadow_stats is None or shadow_in is None:
        raise ConfigError(
            f"{variant} LiRA needs shadow_stats (k, n) and shadow_in (k, n); got "
            f"shadow_stats={'None' if shadow_stats is None else 'set'}, "
            f"shadow_in={'None' if shadow_in is None else 'set'}; train shadow models on "
            "split_halves(n, k, seed=...) or use the 'loss' attack"
        )
    t = _as_array(target_stat, "target_stat", ndim=1)
    s = _as_array(shadow_stats, "shadow_stats", ndim=2)
    m = _as_array(shadow_in, "shadow_in", ndim=2, dtype=bool)
    if s.shape != m.shape or s.shape[1] != t.shape[0]:
        raise DataError(
            f"shapes disagree: target_stat {t.shape}, shadow_stats {s.shape}, shadow_in {m.shape}; "
            "expected (n,), (k, n), (k, n)"
        )
    if not np.isfinite(s).all() or not np.isfinite(t).all():
        raise DataError(
            "target_stat and shadow_stats must be finite; clip confidences (logit_confidence) "
            "or compute them from logits (logit_confidence_from_logits)"
        )
    return t, s, m


def _check_counts(counts: np.ndarray, need: int, side: str, k: int, variant: str) -> None:
    bad = np.flatnonzero(counts < need)
    if bad.size:
        i = int(bad[0])
        preposition = "in" if side == "in" else "out of"
        raise ConfigError(
            f"{variant} LiRA needs each example {preposition} >= {need} shadow model(s); example {i} is "
            f"{preposition} {int(counts[i])} of {k} shadows ({bad.size} examples short); train more shadow "
            "models (>= 4 on split_halves, paper: 16+)"
            + (" or use the offline variant" if variant == "online" and side == "in" else "")
        )


def _gaussian_fit(stats_: np.ndarray, mask: np.ndarray, fix_variance: bool, side: str) -> tuple:
    """Per-example mean ``(n,)`` and std (scalar if ``fix_variance`` else ``(n,)``) of the masked entries."""
    count = mask.sum(axis=0)  # (n,)
    mu = np.where(mask, stats_, 0.0).sum(axis=0) / count
    sq = np.where(mask, (stats_ - mu[None, :]) ** 2, 0.0).sum(axis=0)  # (n,) within-example sum of squares
    if fix_variance:
        dof = int((count - 1).sum())
        if dof <= 0:
            raise ConfigError(
                f"fixed-variance LiRA needs some example with >= 2 {side.upper()} shadow models to "
                f"estimate the global variance; every example has at most {int(count.max())}; "
                "train more shadow models (>= 4 on split_halves)"
            )
        sigma = math.sqrt(sq.sum() / dof)
    else:
        sigma = np.sqrt(sq / (count - 1))
    return mu, np.maximum(sigma, 1e-12)


def lira_online(
    target_stat: ArrayLike,
    shadow_stats: ArrayLike,
    shadow_in: ArrayLike,
    *,
    fix_variance: bool = True,
    min_in: int = 1,
    min_out: int = 1,
) -> np.ndarray:
    """Online LiRA scores ``(n,)``: log N(phi_t | mu_in, s_in) - log N(phi_t | mu_out, s_out) per example.

    Needs every example IN for >= ``min_in`` and OUT for >= ``min_out`` shadows (>= 2 each without
    ``fix_variance``, to fit a per-example variance).
    """
    t, s, m = _shadow_arrays(target_stat, shadow_stats, shadow_in, "online")
    floor = 1 if fix_variance else 2
    _check_counts(m.sum(axis=0), max(min_in, floor), "in", s.shape[0], "online")
    _check_counts((~m).sum(axis=0), max(min_out, floor), "out", s.shape[0], "online")
    mu_in, s_in = _gaussian_fit(s, m, fix_variance, "in")
    mu_out, s_out = _gaussian_fit(s, ~m, fix_variance, "out")
    return np.log(s_out) - np.log(s_in) - 0.5 * ((t - mu_in) / s_in) ** 2 + 0.5 * ((t - mu_out) / s_out) ** 2


def lira_offline(
    target_stat: ArrayLike,
    shadow_stats: ArrayLike,
    shadow_in: ArrayLike,
    *,
    fix_variance: bool = True,
    min_out: int = 1,
) -> np.ndarray:
    """Offline LiRA scores ``(n,)``: (phi_t - mu_out) / s_out, i.e. Phi^-1(1 - Pr[Z > phi_t]) for
    Z ~ N(mu_out, s_out^2) (monotone in the paper's one-sided p-value; see the module docstring).
    Only OUT shadows are used; IN entries of ``shadow_in`` are ignored."""
    t, s, m = _shadow_arrays(target_stat, shadow_stats, shadow_in, "offline")
    _check_counts((~m).sum(axis=0), max(min_out, 1 if fix_variance else 2), "out", s.shape[0], "offline")
    mu_out, s_out = _gaussian_fit(s, ~m, fix_variance, "out")
    return (t - mu_out) / s_out


# ---------------------------------------------------------------------------------------------- registry


def _loss_attack(target_stat: ArrayLike, shadow_stats: Any = None, shadow_in: Any = None, **kw: Any) -> np.ndarray:
    """``target_stat`` is the per-example loss here; shadows are ignored."""
    if kw:
        raise ConfigError(f"the loss attack takes no options, got {sorted(kw)}")
    return loss_threshold_scores(target_stat)


def _lira_online_attack(target_stat, shadow_stats=None, shadow_in=None, **kw) -> np.ndarray:
    return lira_online(target_stat, shadow_stats, shadow_in, **kw)


def _lira_offline_attack(target_stat, shadow_stats=None, shadow_in=None, **kw) -> np.ndarray:
    return lira_offline(target_stat, shadow_stats, shadow_in, **kw)


ATTACKS: dict[str, Callable[..., np.ndarray]] = {
    "loss": _loss_attack,
    "lira_online": _lira_online_attack,
    "lira_offline": _lira_offline_attack,
}


def get_attack(name: AttackName) -> Callable[..., np.ndarray]:
    """The attack ``name`` from ``ATTACKS``: ``attack(target_stat, shadow_stats=None, shadow_in=None, **kw)``."""
    return lookup("membership attack", ATTACKS, name)


# ---------------------------------------------------------------------------------------------- metrics


def _member_split(scores_members: Any, scores_nonmembers: Any) -> tuple[np.ndarray, np.ndarray]:
    return (
        _as_array(scores_members, "scores_members", ndim=1),
        _as_array(scores_nonmembers, "scores_nonmembers", ndim=1),
    )


def _tpr_at(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    return float(tpr[fpr <= target].max())


def roc(scores_members: ArrayLike, scores_nonmembers: ArrayLike) -> dict[str, Any]:
    """ROC of the test "member iff score >= threshold" (sklearn ``roc_curve``, label 1 = member, every threshold
    kept). ``tpr_at_X_fpr`` is the TPR at the largest threshold whose FPR <= X; with fewer than 1/X
    non-members that is the TPR at FPR = 0. ``auc`` counts ties as 1/2 (Mann-Whitney)."""
    sm, sn = _member_split(scores_members, scores_nonmembers)
    y = np.r_[np.ones(sm.size), np.zeros(sn.size)]
    s = np.r_[sm, sn]
    fpr, tpr, thr = roc_curve(y, s, drop_intermediate=False)
    return {
        "fpr": fpr,
        "tpr": tpr,
        "thresholds": thr,
        "auc": float(roc_auc_score(y, s)),
        "tpr_at_0.1pct_fpr": _tpr_at(fpr, tpr, 1e-3),
        "tpr_at_1pct_fpr": _tpr_at(fpr, tpr, 1e-2),
    }


def auc_interval(
    scores_members: ArrayLike, scores_nonmembers: ArrayLike, *, confidence: float = 0.95
) -> tuple[float, float]:
    """Two-sided ``confidence`` interval of the ROC AUC over the examples: DeLong et al. 1988's variance of the
    Mann-Whitney AUC (ties count 1/2), ``var = s10 / m + s01 / n`` from the structural components (each
    member's fraction of non-members it outscores, each non-member's fraction of members outscoring it; Sun & Xu
    2014's midrank form), with a normal approximation, clipped to [0, 1]. Needs at least two members and two
    non-members."""
    sm, sn = _member_split(scores_members, scores_nonmembers)
    if sm.size < 2 or sn.size < 2:
        raise DataError(f"an AUC interval needs >= 2 members and >= 2 non-members, got {sm.size} and {sn.size}")
    if not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must lie in (0, 1), got confidence={confidence!r}")
    m, n = sm.size, sn.size
    combined = stats.rankdata(np.r_[sm, sn])  # midranks: ties share the mean rank
    v10 = (combined[:m] - stats.rankdata(sm)) / n  # members: the fraction of non-members below (ties 1/2)
    v01 = 1.0 - (combined[m:] - stats.rankdata(sn)) / m  # non-members: the fraction of members above
    auc = float(v10.mean())
    se = math.sqrt(v10.var(ddof=1) / m + v01.var(ddof=1) / n)
    half = float(stats.norm.ppf(0.5 + confidence / 2)) * se
    return max(0.0, auc - half), min(1.0, auc + half)


def _cp_arrays(k: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    lo = np.where(k == 0, 0.0, stats.beta.ppf(alpha / 2, np.maximum(k, 1), n - k + 1))
    hi = np.where(k == n, 1.0, stats.beta.ppf(1 - alpha / 2, k + 1, np.maximum(n - k, 1)))
    return lo, hi


def clopper_pearson(k: int, n: int, alpha: float) -> tuple[float, float]:
    """Exact two-sided (1 - alpha) binomial CI for k successes in n trials: (Beta(alpha/2; k, n-k+1),
    Beta(1-alpha/2; k+1, n-k)), with lo = 0 at k = 0 and hi = 1 at k = n. Each side holds with 1 - alpha/2."""
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ConfigError(f"clopper_pearson needs n >= 1 trials, got {n=}")
    if not (isinstance(k, (int, np.integer)) and 0 <= k <= n):
        raise ConfigError(f"clopper_pearson needs 0 <= k <= n, got {k=}, {n=}")
    alpha = _check_prob(alpha, "alpha")
    lo, hi = _cp_arrays(np.asarray(k), int(n), alpha)
    return float(lo), float(hi)


def _eps_arrays(tpr: np.ndarray, fpr: np.ndarray, delta: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.where(tpr > delta, np.log(np.maximum(tpr - delta, 1e-300)) - np.log(fpr), 0.0)
        e2 = np.where(1 - fpr > delta, np.log(np.maximum(1 - fpr - delta, 1e-300)) - np.log(1 - tpr), 0.0)
    return np.maximum(0.0, np.maximum(e1, e2))


def empirical_epsilon(tpr: float, fpr: float, delta: float) -> float:
    """The smallest eps consistent with a threshold test of rates (TPR, FPR) under (eps, delta)-DP:
    max(log((TPR - delta) / FPR), log((1 - FPR - delta) / (1 - TPR)), 0). A term whose numerator is <= 0 is
    dropped (no constraint); FPR = 0 with TPR > delta (or TPR = 1 with FPR < 1 - delta) gives inf."""
    for v, name in ((tpr, "tpr"), (fpr, "fpr")):
        if not (isinstance(v, (int, float, np.integer, np.floating)) and 0.0 <= float(v) <= 1.0):
            raise ConfigError(f"{name} must be in [0, 1], got {name}={v!r}")
    delta = _check_prob(delta, "delta")
    return float(_eps_arrays(np.float64(tpr), np.float64(fpr), delta))


def _counts_above(sorted_scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    return sorted_scores.size - np.searchsorted(sorted_scores, thresholds, side="left")


def _eps_at(sm: np.ndarray, sn: np.ndarray, thr: np.ndarray, delta: float, alpha: float) -> dict[str, np.ndarray]:
    """Rates, CIs and eps for "member iff score >= t" at each threshold in ``thr`` (sorted scores in)."""
    km, kn = _counts_above(sm, thr), _counts_above(sn, thr)
    tpr, fpr = km / sm.size, kn / sn.size
    tpr_lo, tpr_hi = _cp_arrays(km, sm.size, alpha)
    fpr_lo, fpr_hi = _cp_arrays(kn, sn.size, alpha)
    return {
        "tpr": tpr,
        "fpr": fpr,
        "eps_lo": _eps_arrays(tpr_lo, fpr_hi, delta),
        "eps_point": _eps_arrays(tpr, fpr, delta),
        "eps_hi": _eps_arrays(tpr_hi, fpr_lo, delta),
    }


def _candidate_thresholds(sm: np.ndarray, sn: np.ndarray, max_thresholds: int | None) -> np.ndarray:
    thr = np.unique(np.r_[sm, sn])
    if max_thresholds is not None and thr.size > max_thresholds:
        thr = thr[np.unique(np.linspace(0, thr.size - 1, max_thresholds).round().astype(int))]
    return thr


def _best(res: dict[str, np.ndarray]) -> int:
    return int(np.lexsort((res["eps_point"], res["eps_lo"]))[-1])  # max eps_lo, ties by the point estimate


def empirical_epsilon_lower_bound(
    scores_members: ArrayLike,
    scores_nonmembers: ArrayLike,
    *,
    delta: float,
    alpha: float = 0.05,
    max_thresholds: int | None = None,
    split: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Empirical lower bound on epsilon at ``delta`` from a membership attack's scores (Jagielski et al. 2020).

    For each threshold t (every distinct score, or ``max_thresholds`` rank-spaced ones) the test "member iff
    score >= t" gives member / non-member counts; Clopper-Pearson (``clopper_pearson`` at ``alpha``: each side
    holds with 1 - alpha/2, so by a union bound TPR >= TPR_lo and FPR <= FPR_hi hold jointly with 1 - alpha)
    gives eps_lo(t) = empirical_epsilon(TPR_lo, FPR_hi, delta). Returned: ``epsilon_lo`` = eps_lo at the best
    t, ``epsilon_point`` (raw rates) and ``epsilon_hi`` = empirical_epsilon(TPR_hi, FPR_lo, delta) at that t
    (inf when no non-member passes t), with the threshold, rates and sizes.

    ``split=False`` picks t on the same data it bounds, which makes ``epsilon_lo`` optimistic (a max over many
    1 - alpha statements). ``split=True`` (statistically valid) picks t on a random half of each group
    (``seed``) and reports the bound on the other half; ``n_members`` / ``n_nonmembers`` are then the
    evaluation halves. The threshold then sits midway between the chosen score and the next lower one of the
    selection half (same counts there), so that an attack separating the groups perfectly also separates the
    evaluation half, instead of losing the members that score just below the selection half's lowest one:
    such an attack reports ``certifiable_epsilon_max``.
    """
    sm, sn = _member_split(scores_members, scores_nonmembers)
    delta, alpha = _check_prob(delta, "delta"), _check_prob(alpha, "alpha")
    if max_thresholds is not None and not (isinstance(max_thresholds, int) and max_thresholds >= 1):
        raise ConfigError(f"max_thresholds must be None or an int >= 1, got {max_thresholds=}")
    if split:
        if sm.size < 2 or sn.size < 2:
            raise DataError(f"split=True needs >= 2 members and non-members, got {sm.size} and {sn.size}")
        rng = np.random.default_rng(seed)
        pm, pn = rng.permutation(sm.size), rng.permutation(sn.size)
        sel_m, sel_n = np.sort(sm[pm[: sm.size // 2]]), np.sort(sn[pn[: sn.size // 2]])
        ev_m, ev_n = np.sort(sm[pm[sm.size // 2 :]]), np.sort(sn[pn[sn.size // 2 :]])
        cand = _candidate_thresholds(sel_m, sel_n, max_thresholds)
        j = _best(_eps_at(sel_m, sel_n, cand, delta, alpha))
        thr = cand[j] if j == 0 else (cand[j - 1] + cand[j]) / 2  # the gap's middle: same counts on this half
        res, i = _eps_at(ev_m, ev_n, np.array([thr]), delta, alpha), 0
    else:
        ev_m, ev_n = np.sort(sm), np.sort(sn)
        cand = _candidate_thresholds(ev_m, ev_n, max_thresholds)
        res = _eps_at(ev_m, ev_n, cand, delta, alpha)
        i = _best(res)
        thr = cand[i]
    return {
        "epsilon_lo": float(res["eps_lo"][i]),
        "epsilon_point": float(res["eps_point"][i]),
        "epsilon_hi": float(res["eps_hi"][i]),
        "threshold": float(thr),
        "tpr": float(res["tpr"][i]),
        "fpr": float(res["fpr"][i]),
        "alpha": alpha,
        "delta": delta,
        "split": split,
        "n_members": int(ev_m.size),
        "n_nonmembers": int(ev_n.size),
    }


def evaluation_sizes(n_members: int, n_nonmembers: int, *, split: bool) -> tuple[int, int]:
    """The member and non-member counts ``empirical_epsilon_lower_bound`` bounds on: all of them, or with
    ``split`` the evaluation halves (``n - n // 2`` of each group; the threshold is chosen on the rest)."""
    for v, name in ((n_members, "n_members"), (n_nonmembers, "n_nonmembers")):
        if not (isinstance(v, (int, np.integer)) and v >= (2 if split else 1)):
            raise DataError(
                f"{name} must be an int >= {2 if split else 1}{' (split=True)' if split else ''}, got {name}={v!r}"
            )
    if not split:
        return int(n_members), int(n_nonmembers)
    return int(n_members - n_members // 2), int(n_nonmembers - n_nonmembers // 2)


def certifiable_epsilon_max(
    n_members: int, n_nonmembers: int, *, delta: float, alpha: float = 0.05, split: bool = True
) -> float:
    """The largest ``epsilon_lo`` that ``empirical_epsilon_lower_bound`` (same ``delta``, ``alpha``, ``split``)
    can report for ``n_members`` members and ``n_nonmembers`` non-members: that of a perfect attack, every
    evaluated member above the threshold and no non-member (eps_lo grows with TPR_lo and falls with FPR_hi,
    and both Clopper-Pearson bounds grow with the count). An audit at these sizes cannot find an accountant's
    epsilon violated unless this value exceeds it, whatever the attack: it is the power of the audit.

    Closed form, with m members and n non-members evaluated (``evaluation_sizes``): TPR_lo = (alpha/2)^(1/m)
    and FPR_hi = 1 - (alpha/2)^(1/n) (Clopper-Pearson at m of m and 0 of n), then
    ``empirical_epsilon(TPR_lo, FPR_hi, delta)``. For large m = n and small delta this is about
    log(n / log(2 / alpha)), i.e. log(n / 3.7) at alpha = 0.05.
    """
    m, n = evaluation_sizes(n_members, n_nonmembers, split=split)
    delta, alpha = _check_prob(delta, "delta"), _check_prob(alpha, "alpha")
    log_half_alpha = math.log(alpha / 2)
    tpr_lo = math.exp(log_half_alpha / m)
    fpr_hi = -math.expm1(log_half_alpha / n)
    return float(_eps_arrays(np.float64(tpr_lo), np.float64(fpr_hi), delta))


def two_sample_test(scores_a: ArrayLike, scores_b: ArrayLike) -> dict[str, float]:
    """Are ``scores_a`` (e.g. unlearned samples) and ``scores_b`` (non-members) from one distribution?
    Two-sided Kolmogorov-Smirnov and Mann-Whitney U p-values, and AUC = Pr[a > b] + Pr[a = b] / 2."""
    a = _as_array(scores_a, "scores_a", ndim=1)
    b = _as_array(scores_b, "scores_b", ndim=1)
    ks = stats.ks_2samp(a, b)
    mw = stats.mannwhitneyu(a, b, alternative="two-sided")
    return {
        "ks_statistic": float(ks.statistic),
        "ks_pvalue": float(ks.pvalue),
        "mw_statistic": float(mw.statistic),
        "mw_pvalue": float(mw.pvalue),
        "auc": float(mw.statistic) / (a.size * b.size),
    }
