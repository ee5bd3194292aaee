"""The one-run privacy audit of Steinke, Nasr & Jagielski (2023): a lower bound on epsilon from membership guesses
about ONE trained model whose examples were each included by an independent fair coin (the many-runs estimator,
``membership.empirical_epsilon_lower_bound``, treats examples as independent trials, which is established for many
training runs, not for one).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import optimize, special

from core.attacks.membership import ArrayLike, _as_array, _check_prob, _member_split
from core.errors import ConfigError, DataError

# Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run" (NeurIPS; arXiv 2305.08846). Each of m
# examples is IN (S_i = +1) or OUT (S_i = -1) of the ONE training run independently with probability 1/2; the auditor
# sees the trained model (here: the attack scores) and guesses T_i in {-1, 0, +1} (0: abstain), r guesses in all, of
# which W = #{i : T_i = S_i} are right. Their main theorem: if the training is (eps, delta)-DP, then for every v
#
#     P[W >= v] <= f(v) + 2 m delta max_{i = 1..m} (f(v - i) - f(v)) / i,    f(u) = P[Binomial(r, q) >= u],
#     q = e^eps / (1 + e^eps),
#
# and with delta = 0, W is stochastically dominated by Binomial(r, q) (the right guesses of eps-DP randomized
# response). The right-hand side at the observed v is a p-value for "the training is (eps, delta)-DP" (their App. D,
# ``p_value_DP_audit``); the bound is the largest eps it rejects at level alpha. f(v - i) = 1 for i >= v, so the max
# runs over i = 1..v. The number of guesses r must be fixed independently of S: a count chosen on the trained model's
# scores (of any examples: the model depends on every S_i) is not, so the audit fixes it on shadow models, whose
# memberships are drawn apart from the target's (``core.attacks.audit.one_run_counts``).


def _check_delta_one_run(delta: float) -> float:
    if not (isinstance(delta, (int, float, np.integer, np.floating)) and 0.0 <= float(delta) < 1.0):
        raise ConfigError(f"delta must be in [0, 1), got delta={delta!r}")
    return float(delta)


def _check_guess_counts(m: int, r: int, v: int) -> tuple[int, int, int]:
    for value, name in ((m, "m"), (r, "r"), (v, "v")):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an int, got {name}={value!r}")
    if not (m >= 1 and 0 <= v <= r <= m):
        raise ConfigError(
            f"one-run counts need m >= 1 examples, r <= m guesses and v <= r right ones, got m={m}, r={r}, v={v}"
        )
    return int(m), int(r), int(v)


def _one_run_p(m: int, r: int, v: int, eps: float, delta: float, log_comb: np.ndarray | None = None) -> float:
    """Steinke et al.'s p-value of ``v`` right guesses of ``r`` among ``m`` examples under (eps, delta)-DP;
    ``log_comb``: log C(r, k) for k = v - 1, ..., 0 (``_log_comb``), if already at hand."""
    if v == 0:
        return 1.0
    tail = float(special.betainc(v, r - v + 1, special.expit(eps)))  # f(v) = P[Bin(r, q) >= v] = I_q(v, r - v + 1)
    if delta == 0.0:
        return min(tail, 1.0)
    log_q, log_q_bar = -np.logaddexp(0.0, -eps), -np.logaddexp(0.0, eps)  # log q, log(1 - q), stable for any eps
    k = np.arange(v - 1, -1, -1)  # v - 1, v - 2, ..., 0
    log_pmf = (_log_comb(r, v) if log_comb is None else log_comb) + k * log_q + (r - k) * log_q_bar
    gap = np.cumsum(np.exp(log_pmf))  # gap[i - 1] = P[v - i <= Bin(r, q) < v] = f(v - i) - f(v)
    return min(tail + 2.0 * m * delta * float(np.max(gap / np.arange(1, v + 1))), 1.0)


def _log_comb(r: int, v: int) -> np.ndarray:
    k = np.arange(v - 1, -1, -1)
    return special.gammaln(r + 1) - special.gammaln(k + 1) - special.gammaln(r - k + 1)


def _one_run_eps_pure(r: Any, v: Any, alpha: float) -> np.ndarray:
    """The delta = 0 bound, vectorised: f(v) = I_q(v, r - v + 1) rises with q, so the bound is logit(q*) for
    I_q*(v, r - v + 1) = alpha (the one-sided Clopper-Pearson lower limit of the accuracy), 0 where q* <= 1/2."""
    r, v = np.asarray(r, dtype=np.float64), np.asarray(v, dtype=np.float64)
    some = v > 0
    a, b = np.where(some, v, 1.0), np.where(some, r - v + 1, 1.0)
    q = special.betaincinv(a, b, alpha)
    q_bar = special.betaincinv(b, a, 1.0 - alpha)  # 1 - q*, without the cancellation of 1 - q* near q* = 1
    with np.errstate(divide="ignore"):
        eps = np.log(q) - np.log(q_bar)
    return np.where(some, np.maximum(eps, 0.0), 0.0)


def _one_run_eps(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """The largest eps (to about 1e-9) whose p-value at (m, r, v) is below ``alpha``, itself rejected (p < alpha).
    The delta = 0 bound brackets it from above (the p-value only grows with delta, and f with eps)."""
    hi = float(_one_run_eps_pure(r, v, alpha))
    if delta == 0.0 or hi == 0.0:
        return hi
    log_comb = _log_comb(r, v)

    def excess(eps: float) -> float:
        return _one_run_p(m, r, v, eps, delta, log_comb) - alpha

    if excess(0.0) >= 0.0:
        return 0.0
    if excess(hi) < 0.0:  # the delta term below rounding: the delta = 0 bound stands
        return hi
    tol = 1e-9 * max(1.0, hi)
    root = optimize.brentq(excess, 0.0, hi, xtol=tol)
    lo, step = root, tol
    while excess(lo) >= 0.0:  # the crossing's low side (p(0) < alpha ends this)
        lo, step = max(0.0, root - step), 2.0 * step
    return lo


def one_run_p_value(m: int, r: int, v: int, *, epsilon: float, delta: float) -> float:
    """Steinke et al.'s p-value of the hypothesis "the training is (``epsilon``, ``delta``)-DP" after ``v`` right
    guesses of ``r`` (the rest abstained) among ``m`` examples, each included independently with probability 1/2:
    f(v) + 2 m delta max_{i=1..v} (f(v - i) - f(v)) / i, f(u) = P[Binomial(r, e^eps / (1 + e^eps)) >= u], capped
    at 1 (see the module comment above)."""
    m, r, v = _check_guess_counts(m, r, v)
    if not (isinstance(epsilon, (int, float, np.integer, np.floating)) and 0.0 <= float(epsilon) < math.inf):
        raise ConfigError(f"epsilon must be finite and >= 0, got epsilon={epsilon!r}")
    return _one_run_p(m, r, v, float(epsilon), _check_delta_one_run(delta))


def one_run_epsilon_from_counts(m: int, r: int, v: int, *, delta: float, alpha: float = 0.05) -> float:
    """The one-run lower bound on epsilon at ``delta`` from ``v`` right guesses of ``r`` among ``m`` examples: the
    largest eps whose ``one_run_p_value`` is below ``alpha`` (0 if none), so the training is not (eps, delta)-DP
    for any smaller eps, with confidence 1 - alpha. Closed form at delta = 0 (logit of the one-sided
    Clopper-Pearson lower limit of v / r); otherwise a root to about 1e-9, taken on the side the p-value rejects
    (never above the delta = 0 value)."""
    m, r, v = _check_guess_counts(m, r, v)
    return _one_run_eps(m, r, v, _check_delta_one_run(delta), _check_prob(alpha, "alpha"))


def _ranked(sm: np.ndarray, sn: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The pooled scores in ascending order and the member flags (1/0) in that order; equal scores in random order
    (``rng``), never by group: the guesses must not read the membership."""
    s = np.r_[sm, sn]
    y = np.r_[np.ones(sm.size, np.int64), np.zeros(sn.size, np.int64)]
    order = np.lexsort((rng.random(s.size), s))
    return s[order], y[order]


def _right_guesses(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N + 1,) members among the top k and non-members among the bottom k of the ranked flags ``y``, k = 0..N:
    guessing the top k+ IN and the bottom k- OUT (k+ + k- <= N) gets ``top[k+] + bottom[k-]`` right."""
    return np.r_[0, np.cumsum(y[::-1])], np.r_[0, np.cumsum(1 - y)]


def _candidate_counts(n: int, max_counts: int | None) -> np.ndarray:
    rs = np.arange(1, n + 1)
    if max_counts is not None and rs.size > max_counts:
        rs = rs[np.unique(np.linspace(0, n - 1, max_counts).round().astype(int))]
    return rs


def _best_split(y: np.ndarray, rs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each guess count r of ``rs``: the most right guesses over k+ + k- = r, and the (first) k+ reaching it."""
    top, bottom = _right_guesses(y)
    vs, kps = np.empty(rs.size, np.int64), np.empty(rs.size, np.int64)
    for j, r in enumerate(rs):
        right = top[: r + 1] + bottom[r::-1]  # k+ = 0..r, k- = r - k+
        kps[j] = int(np.argmax(right))
        vs[j] = right[kps[j]]
    return vs, kps


def _choose_counts(m: int, rs: np.ndarray, vs: np.ndarray, delta: float, alpha: float) -> tuple[int, float]:
    """The index of the best (r, v) by bound (ties by the add-half log-odds of a right guess) and its bound. The
    delta = 0 bound caps the delta > 0 one, so candidates are visited in its order until it falls to the best, and
    one whose p-value at the best bound so far is not below ``alpha`` is passed over (it cannot beat it where the
    p-value grows with eps, as it does at these counts; a choice on the selection half needs no more)."""
    upper = _one_run_eps_pure(rs, vs, alpha)
    lo = upper.copy()
    if delta > 0.0:
        lo = np.where(upper > 0.0, -np.inf, 0.0)  # -inf: passed over, at most the best
        best = 0.0
        for j in np.argsort(-upper, kind="stable"):
            if upper[j] <= best:
                break
            if best > 0.0 and _one_run_p(m, int(rs[j]), int(vs[j]), best, delta) >= alpha:
                continue
            lo[j] = _one_run_eps(m, int(rs[j]), int(vs[j]), delta, alpha)
            best = max(best, lo[j])
    point = np.log(vs + 0.5) - np.log(rs - vs + 0.5)
    j = int(np.lexsort((point, lo))[-1])
    return j, float(lo[j])


def one_run_epsilon_lower_bound(
    scores_members: ArrayLike,
    scores_nonmembers: ArrayLike,
    *,
    delta: float,
    alpha: float = 0.05,
    k_plus: int | None = None,
    k_minus: int | None = None,
    split: bool = False,
    seed: int = 0,
    selection: tuple[ArrayLike, ArrayLike] | None = None,
    max_counts: int | None = None,
) -> dict[str, Any]:
    """Lower bound on epsilon at ``delta`` from a membership attack on ONE trained model (Steinke, Nasr & Jagielski
    2023; see the module comment above): valid when each example's membership was drawn independently with
    probability 1/2, which ``empirical_epsilon_lower_bound`` (Jagielski et al. 2020, whose Clopper-Pearson rates
    assume independent training runs) does not use.

    The attack guesses the ``k_plus`` highest-scoring examples IN and the ``k_minus`` lowest OUT and abstains on the
    rest; with r = k_plus + k_minus guesses of which v are right, ``epsilon_lo`` is
    ``one_run_epsilon_from_counts(m, r, v, delta=delta, alpha=alpha)`` with m the examples bounded. Equal scores
    are ranked at random (``seed``), never by group.

    * ``k_plus`` and ``k_minus`` given: those counts on all examples (valid if fixed before the scores were seen).
    * neither, ``split=False``: the best (k_plus, k_minus) on the same data it bounds, which makes ``epsilon_lo``
      optimistic (a max over many 1 - alpha statements), as in ``empirical_epsilon_lower_bound``.
    * neither, ``split=True``: the counts are chosen on a selection half and the bound is
      reported on the other half (m = its size; ``n_members`` / ``n_nonmembers`` are then its groups), whose
      guesses read its scores and the selection half only. The halves are ``selection`` (boolean masks over the
      members and over the non-members, True = selection half; the caller draws them independently of
      membership, e.g. a fixed random half of all users) or, if None, a random half of the pooled examples
      (``seed``): unlike ``empirical_epsilon_lower_bound``'s halves they are not halves of each group, since the
      theorem needs the evaluation half's memberships independent and uniform given everything the guesses read.
      The evaluation half gets r = the selection half's guess count scaled to its size, chosen before its own
      scores are read; the fewer-guesses side (IN if k_plus <= k_minus) is every example
      beyond that side's threshold, set midway between the selection half's last guess and its next example on that
      side (none if that side had no guess), and the other side takes the remaining guesses from its own end, so an
      attack separating the groups perfectly guesses every example right: it reports
      ``one_run_certifiable_epsilon_max``. Not a valid bound on its own: the selection half's scores come from the
      same model, which depends on the evaluation half's memberships, so the count is not fixed with respect to
      them; ``core.attacks.audit`` passes counts fixed on shadow models instead (``k_plus``, ``k_minus``).

    ``max_counts`` (None: all) limits the guess counts r tried to that many rank-spaced ones; each r takes its best
    split into k_plus + k_minus. ``epsilon_point`` is log(v / (r - v)) (at least 0): the epsilon of randomized
    response as accurate as the guesses.

    Raises:
        ConfigError: ``alpha`` outside (0, 1), ``delta`` outside [0, 1), bad ``k_plus`` / ``k_minus`` /
            ``max_counts``, counts with ``split=True`` or ``selection`` without it.
        DataError: an empty or NaN score array; fewer than 2 examples to split; ``selection`` masks that do not
            fit the scores or leave a half empty.
    """
    sm, sn = _member_split(scores_members, scores_nonmembers)
    delta, alpha = _check_delta_one_run(delta), _check_prob(alpha, "alpha")
    if max_counts is not None and not (isinstance(max_counts, int) and max_counts >= 1):
        raise ConfigError(f"max_counts must be None or an int >= 1, got {max_counts=}")
    n = sm.size + sn.size
    fixed = k_plus is not None or k_minus is not None
    if fixed:
        for value, name in ((k_plus, "k_plus"), (k_minus, "k_minus")):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"{name} must be an int >= 0 (give k_plus and k_minus together), got {name}={value!r}"
                )
        if not 1 <= k_plus + k_minus <= n:
            raise ConfigError(f"k_plus + k_minus must be in 1..{n} (the examples), got {k_plus=}, {k_minus=}")
        if split:
            raise ConfigError("fixed k_plus / k_minus choose nothing on a selection half; pass split=False")
    if selection is not None and not split:
        raise ConfigError("selection names the selection half of split=True; pass split=True or selection=None")
    rng = np.random.default_rng(seed)
    thr = math.nan
    if split:
        if n < 2:
            raise DataError(f"split=True needs >= 2 examples, got {sm.size} members and {sn.size} non-members")
        if selection is None:
            pick = rng.permutation(n) < n // 2
            pick_m, pick_n = pick[: sm.size], pick[sm.size :]
        else:
            pick_m = _as_array(selection[0], "selection[0]", ndim=1, dtype=bool)
            pick_n = _as_array(selection[1], "selection[1]", ndim=1, dtype=bool)
            if pick_m.shape != sm.shape or pick_n.shape != sn.shape:
                raise DataError(
                    f"selection masks {pick_m.shape} and {pick_n.shape} do not fit {sm.shape} members and "
                    f"{sn.shape} non-members; pass one flag per example of each group"
                )
            if not 0 < int(pick_m.sum() + pick_n.sum()) < n:
                raise DataError("selection leaves a half empty; mark some examples, not all, as the selection half")
        s_sel, y_sel = _ranked(sm[pick_m], sn[pick_n], rng)
        s_ev, y_ev = _ranked(sm[~pick_m], sn[~pick_n], rng)
        rs = _candidate_counts(s_sel.size, max_counts)
        vs, kps = _best_split(y_sel, rs)
        j, _ = _choose_counts(s_sel.size, rs, vs, delta, alpha)
        sel_plus, sel_minus = int(kps[j]), int(rs[j] - kps[j])
        m = s_ev.size
        r = min(m, max(1, math.floor(rs[j] * m / s_sel.size + 0.5)))
        if sel_plus <= sel_minus:  # the IN side by threshold, OUT takes the rest from the bottom
            i = s_sel.size - sel_plus
            thr = math.inf if sel_plus == 0 else float((s_sel[i - 1] + s_sel[i]) / 2)
            k_plus = min(r, int(m - np.searchsorted(s_ev, thr, side="left")))
            k_minus = r - k_plus
        else:  # the OUT side by threshold, IN takes the rest from the top
            thr = -math.inf if sel_minus == 0 else float((s_sel[sel_minus - 1] + s_sel[sel_minus]) / 2)
            k_minus = min(r, int(np.searchsorted(s_ev, thr, side="left")))
            k_plus = r - k_minus
        top, bottom = _right_guesses(y_ev)
        v = int(top[k_plus] + bottom[k_minus])
        eps_lo = _one_run_eps(m, r, v, delta, alpha)
        n_in = int(y_ev.sum())
    else:
        m = n
        _, y = _ranked(sm, sn, rng)
        top, bottom = _right_guesses(y)
        if fixed:
            k_plus, k_minus = int(k_plus), int(k_minus)
            r, v = k_plus + k_minus, int(top[k_plus] + bottom[k_minus])
            eps_lo = _one_run_eps(m, r, v, delta, alpha)
        else:
            rs = _candidate_counts(n, max_counts)
            vs, kps = _best_split(y, rs)
            j, eps_lo = _choose_counts(m, rs, vs, delta, alpha)
            r, v, k_plus = int(rs[j]), int(vs[j]), int(kps[j])
            k_minus = r - k_plus
        n_in = sm.size
    point = 0.0 if v == 0 else math.inf if v == r else max(0.0, math.log(v) - math.log(r - v))
    return {
        "epsilon_lo": float(eps_lo),
        "epsilon_point": float(point),
        "n_guesses": int(r),
        "n_correct": int(v),
        "k_plus": int(k_plus),
        "k_minus": int(k_minus),
        "threshold": thr,
        "m": int(m),
        "alpha": alpha,
        "delta": delta,
        "split": split,
        "n_members": n_in,
        "n_nonmembers": int(m - n_in),
    }


def one_run_certifiable_epsilon_max(
    n_members: int, n_nonmembers: int, *, delta: float, alpha: float = 0.05, split: bool = True
) -> float:
    """The largest ``epsilon_lo`` that ``one_run_epsilon_lower_bound`` (same ``delta``, ``alpha``, ``split``) can
    report for ``n_members`` + ``n_nonmembers`` examples: that of a perfect attack, every one of the m examples
    bounded (all of them, or with ``split`` the evaluation half, m = N - N // 2 of the N pooled examples) guessed
    and every guess right, ``one_run_epsilon_from_counts(m, m, m)``. (The bound grows with v and, at v = r, with r;
    the tests check every (r, v) at small m.) At delta = 0 this is log(q / (1 - q)) with q = alpha^(1/m), about
    log(m / log(1 / alpha)); delta > 0 costs more than in ``certifiable_epsilon_max``, as the p-value adds 2 m delta
    times a binomial mass. An audit at these sizes cannot find an accountant's epsilon violated unless this value
    exceeds it, whatever the attack."""
    for value, name in ((n_members, "n_members"), (n_nonmembers, "n_nonmembers")):
        if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
            raise DataError(f"{name} must be an int >= 1, got {name}={value!r}")
    n = int(n_members) + int(n_nonmembers)
    m = n - n // 2 if split else n
    return _one_run_eps(m, m, m, _check_delta_one_run(delta), _check_prob(alpha, "alpha"))
