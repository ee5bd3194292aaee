"""Verdicts on the papers' claims, computed from the results store alone (the registry: ``pbconfig.claims``).

``evaluate_claims(db_url, profile=...)`` measures every claim of the registry and returns one ``ClaimResult`` each:

1. the claim's ``measure.source`` gives rows (``storage.claim_rows``: a ``storage.views`` view, or the scalar
   metrics of a stage's runs), restricted by the filters (profile, root run, ...) and by ``where``; ``value``
   gives one number per row; a ``measure.b_source`` gives side b's rows from its own source (a peer's runs: the
   filters' profile, root and commit do not apply to it, its own ``profile`` does);
2. rows go to side ``a`` or ``b`` and to a context (the ``per`` columns); the rows of one run reduce to one
   number per (side, context) (``reduce``); every recorded run counts, except that where one (side, context, seed)
   was measured at several git commits the older commits' runs are superseded (counted, and named in the reason);
   runs of one seed at one commit are repeats: their mean is the seed's value for an interval, and each is judged
   by an every-run rule (seeds as in ``storage.leaderboard``: the run's config seed, else its nearest ancestor's);
   a claim with ``applies_at`` keeps only the runs at that scale (none: ``not applicable at this scale``);
3. per context, the stat and its two-sided 95% interval: ``value``: Student t over seeds; a comparison of two
   sides run with the same seeds: the per-seed stat (paired), t over seeds; otherwise (unpaired) Welch's t for
   the difference and the delta method on the ratio of means for ``relative``/``ratio`` (always so against a
   ``b_source``: its seeds are another implementation's). One seed: no interval;
4. the rule decides each context and the contexts decide the claim (``pbconfig.claims``): ``underpowered`` where
   the rule could not have reached a verdict at the n that ran (fewer seeds than ``min_n``; every run's ``power``
   short of the bound); a ``projected`` measure gives ``projected`` whatever the fit says; every verdict but
   ``reproduced`` carries a one-line reason drawn from the measured numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from core.errors import ConfigError
from pbconfig.claims import Claim, Measure, Rule, Verdict, load_claims
from storage.claim_rows import at_scale, claim_rows, matches, run_configs
from storage.leaderboard import CONFIDENCE, run_meta, seed_interval

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_RUN = (
    Verdict.REPRODUCED,
    Verdict.NOT_REPRODUCED,
    Verdict.INCONCLUSIVE,
    Verdict.NOT_RUN,
)
UNDERPOWERED, PROJECTED, NOT_APPLICABLE = Verdict.UNDERPOWERED, Verdict.PROJECTED, Verdict.NOT_APPLICABLE
EXPLORATORY = Verdict.EXPLORATORY


@dataclass(frozen=True)
class ContextResult:
    """One context of a claim: the stat's estimate and 95% interval (NaN bounds when there is none)."""

    context: str
    verdict: str
    estimate: float
    low: float
    high: float
    n_a: int
    n_b: int
    interval: str  # "t over seeds", "paired t over seeds", "Welch t", "delta method (Welch)", "none", "all runs"
    values: tuple[float, ...]  # the per-seed stats (paired, or value), or the per-run values (all_* rules)
    reason: str = ""
    means: tuple[float, float] = (math.nan, math.nan)  # side a's and side b's mean over replicates (two sides)


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    verdict: str
    contexts: tuple[ContextResult, ...]
    reason: str
    run_ids: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    rows: int = 0
    superseded: int = 0  # runs set aside because a newer commit measured the same (context, side, seed)
    recipes: tuple[str, ...] = ()  # train-dp: each judged method's learning rate x batch size ("method lr x batch")

    @property
    def n(self) -> int:
        """Seeds (or runs) behind the claim: the smallest count over its contexts and sides."""
        counts = [c.n_a if c.n_b == 0 else min(c.n_a, c.n_b) for c in self.contexts]
        return min(counts) if counts else 0

    def ours(self) -> str:
        """``context: estimate [low, high] (n)`` per context, as the report shows it."""
        unit = self.claim.measure.unit
        parts = []
        for c in self.contexts:
            if c.verdict == NOT_RUN:
                parts.append(f"{c.context}: not run")
                continue
            shown = fmt(c.estimate, unit)
            if math.isfinite(c.low) and math.isfinite(c.high):
                shown += f" [{fmt(c.low, unit)}, {fmt(c.high, unit)}]"
            n = str(c.n_a) if c.n_b == 0 or c.n_a == c.n_b else f"{c.n_a}/{c.n_b}"
            label = "runs" if c.interval == "all runs" else "n"
            if c.interval == "all runs":  # an every-run rule judged each run (or pair of runs), not each seed
                n = str(len(c.values))
            if self.claim.measure.b_source is not None and all(math.isfinite(m) for m in c.means):
                shown += f" (ours {fmt(c.means[0])}, peer {fmt(c.means[1])})"  # both numbers, not just the ratio
            parts.append(f"{c.context + ': ' if c.context else ''}{shown} ({label}={n})")
        shown = "; ".join(parts) if parts else "-"
        return f"projected: {shown}" if self.claim.measure.projected and parts else shown


@dataclass
class _Sides:
    a: dict[Any, float] = field(default_factory=dict)  # replicate -> value (the mean of its runs)
    b: dict[Any, float] = field(default_factory=dict)
    runs: set[str] = field(default_factory=set)
    # every run, for the every-run rules: side -> [(replicate, run id, value, power)]
    each: dict[str, list[tuple[Any, str, float, float]]] = field(default_factory=dict)
    # (side, replicate) -> its runs' own 95% intervals (run_interval), in the order of ``each``
    intervals: dict[tuple[str, Any], list[tuple[float, float]]] = field(default_factory=dict)
    order: tuple[Any, ...] = ()  # the context's sort key (numbers in numeric order)


def fmt(value: float, unit: str = "") -> str:
    """A stat as the report shows it: ``+3.1%`` (unit %), ``2.41x`` (unit x), else 4 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if value == 0 and unit in ("%", "pt"):
        return "0%" if unit == "%" else "0 pt"
    if unit == "%":
        return f"{100 * value:+.1f}%"
    if unit == "pt":
        return f"{100 * value:+.2f} pt"
    if unit == "share":
        return f"{100 * value:.1f}%"
    if unit == "x":
        return f"{value:.3g}x"
    return f"{value:.4g}"


_BARE = {"dataset", "method", "model", "design", "embedding"}  # columns whose values name themselves


def _part(column: str, value: Any) -> str:
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if column == "epsilon":
        return f"ε={shown}"
    return shown if column in _BARE else f"{column.removeprefix('config.')}={shown}"


def _sort_key(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((0, float(v), "") if isinstance(v, int | float) else (1, 0.0, str(v)) for v in values)


def _context_name(measure: Measure, values: Sequence[Any]) -> str:
    return ", ".join(_part(c, v) for c, v in zip(measure.per, values, strict=True))


def _sides(frame: pd.DataFrame, measure: Measure, seeds: dict[str, Any]) -> tuple[dict[str, _Sides], int]:
    """Per context: side -> {replicate: value} (and every run, ``_Sides.each``), the rows of a run reduced; with
    the number of runs superseded. Every recorded run counts, except that where one (context, side, seed) was
    measured at several commits only the newest commit's runs count (the code changed: its newer measurement
    replaces the older); runs of one seed at one commit are repeats of one sample: their mean is the seed's value
    for an interval, and each is judged by an every-run rule."""
    frame = frame.copy()
    if measure.b_source is None:  # else claim_rows has set each row's side
        frame["side"] = np.where(matches(frame, measure.a), "a", "")
        if measure.b is not None:
            in_b = matches(frame, measure.b)
            frame.loc[in_b & (frame["side"] == ""), "side"] = "b"
    frame = frame[(frame["side"] != "") & matches(frame, measure.require)]
    keys = [tuple(row) for row in frame[list(measure.per)].itertuples(index=False)]
    frame["context"] = [_context_name(measure, k) for k in keys]
    frame["order"] = [_sort_key(k) for k in keys]
    frame = frame.sort_values("order", kind="stable")
    extra = {c: (c, "first") for c in ("low", "high") if c in frame}  # a run's own interval (run_interval)
    if extra and measure.reduce in ("max", "min"):  # the interval of the row the reduction keeps
        frame = frame.sort_values("value", ascending=measure.reduce == "min", kind="stable")
    if "power" in frame:  # the strongest result a run could have given: its most extreme row
        extra["power"] = ("power", "max" if measure.reduce != "min" else "min")
    if "git_commit" not in frame:
        frame["git_commit"] = None
    reduced = frame.groupby(["context", "side", "run_id"], as_index=False, sort=False, dropna=False).agg(
        value=("value", measure.reduce),
        started_at=("started_at", "max"),
        order=("order", "first"),
        git_commit=("git_commit", "first"),
        **extra,
    )
    reduced["replicate"] = [
        f"seed:{int(seeds[r])}" if seeds.get(r) is not None and not pd.isna(seeds.get(r)) else f"run:{r}"
        for r in reduced["run_id"]
    ]
    reduced["git_commit"] = reduced["git_commit"].fillna("")
    reduced = reduced.sort_values("started_at", kind="stable")
    newest = reduced.groupby(["context", "side", "replicate"])["git_commit"].transform("last")
    superseded = int((reduced["git_commit"] != newest).sum())
    reduced = reduced[reduced["git_commit"] == newest]
    out: dict[str, _Sides] = {}
    for row in reduced.itertuples(index=False):
        sides = out.setdefault(row.context, _Sides(order=row.order))
        power = float(row.power) if "power" in reduced and pd.notna(row.power) else math.nan
        sides.each.setdefault(row.side, []).append((row.replicate, row.run_id, float(row.value), power))
        sides.runs.add(row.run_id)
        if extra.keys() & {"low", "high"}:
            sides.intervals.setdefault((row.side, row.replicate), []).append((float(row.low), float(row.high)))
    for sides in out.values():
        for side, entries in sides.each.items():
            per_replicate: dict[Any, list[float]] = {}
            for replicate, _, value, _ in entries:
                per_replicate.setdefault(replicate, []).append(value)
            setattr(sides, side, {k: float(np.mean(v)) for k, v in per_replicate.items()})
    return dict(sorted(out.items(), key=lambda item: item[1].order)), superseded


def _stat(kind: str, a: float, b: float) -> float:
    if kind == "difference":
        return a - b
    if b == 0:
        return math.nan
    return a / b - 1 if kind == "relative" else a / b


def _estimate(measure: Measure, sides: _Sides) -> tuple[float, float, float, str, tuple[float, ...]]:
    """(estimate, low, high, interval kind, per-seed stats) of one context."""
    if measure.stat == "value":
        ci = seed_interval(sides.a.values())
        if ci.n == 1 and measure.run_interval is not None:  # one run: its own interval over examples, if recorded
            low, high = _own_interval(sides, "a", next(iter(sides.a)))
            if math.isfinite(low) and math.isfinite(high):
                return (
                    ci.mean,
                    low,
                    high,
                    "the run's own (recorded over its examples or rounds)",
                    tuple(sides.a.values()),
                )
        return ci.mean, ci.low, ci.high, "t over seeds" if ci.n >= 2 else "none", tuple(sides.a.values())
    common = sorted(set(sides.a) & set(sides.b) - {k for k in sides.a if k.startswith("run:")})
    paired = measure.b_source is None  # a peer's seed 0 has nothing in common with ours
    if paired and len(common) >= 2 and len(common) == len(sides.a) == len(sides.b):
        per_seed = [_stat(measure.stat, sides.a[k], sides.b[k]) for k in common]
        ci = seed_interval(per_seed)
        return ci.mean, ci.low, ci.high, "paired t over seeds", tuple(per_seed)
    a, b = seed_interval(sides.a.values()), seed_interval(sides.b.values())
    estimate = _stat(measure.stat, a.mean, b.mean)
    pairs = tuple(_stat(measure.stat, x, y) for x in sides.a.values() for y in sides.b.values())
    if a.n == b.n == 1 and measure.run_interval is not None:  # one run a side: their own intervals over examples
        own = _runs_own_difference(sides)
        if own is not None:
            return estimate, estimate - own, estimate + own, "the runs' own (normal, sides independent)", pairs
    if a.n < 2 or b.n < 2:
        return estimate, math.nan, math.nan, "none", pairs
    va, vb = a.std**2 / a.n, b.std**2 / b.n
    if measure.stat == "difference":
        se = math.sqrt(va + vb)
    else:  # delta method on a / b
        if b.mean == 0 or a.mean == 0:
            return estimate, math.nan, math.nan, "none", pairs
        ratio = a.mean / b.mean
        se = abs(ratio) * math.sqrt(va / a.mean**2 + vb / b.mean**2)
    if se == 0:
        return estimate, estimate, estimate, "Welch t", pairs
    df = (va + vb) ** 2 / ((va**2 / (a.n - 1) if va else 0) + (vb**2 / (b.n - 1) if vb else 0) or 1e-300)
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, max(df, 1.0))) * se
    kind = "Welch t" if measure.stat == "difference" else "delta method (Welch)"
    return estimate, estimate - half, estimate + half, kind, pairs


def _runs_own_difference(sides: _Sides) -> float | None:
    """Half-width of the 95% interval of a - b from one run a side with their own recorded intervals (module
    docstring of ``pbconfig.claims``), or None where either run recorded none."""
    z = float(stats.norm.ppf((1 + CONFIDENCE) / 2))
    ses = []
    for side, values in (("a", sides.a), ("b", sides.b)):
        key, value = next(iter(values.items()))
        low, high = _own_interval(sides, side, key)
        if not (math.isfinite(low) and math.isfinite(high)):
            return None
        ses.append(max(high - value, value - low, 0.0) / z)
    return z * math.sqrt(ses[0] ** 2 + ses[1] ** 2)


def _own_interval(sides: _Sides, side: str, replicate: Any) -> tuple[float, float]:
    """A replicate's own 95% interval: its one run's recorded interval; for several runs of it at one commit
    (repeats of one sample, their mean the replicate's value) the hull of their intervals, which holds the mean and
    every run's interval (repeats that disagree show it); NaN where a run recorded none."""
    recorded = sides.intervals.get((side, replicate), [])
    if not recorded or not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in recorded):
        return math.nan, math.nan
    return min(lo for lo, _ in recorded), max(hi for _, hi in recorded)


def _decide(rule: Rule, measure: Measure, sides: _Sides) -> ContextResult:
    result = _verdict(rule, measure, sides)
    if measure.stat == "value" or not (sides.a and sides.b):
        return result
    return replace(result, means=(float(np.mean(list(sides.a.values()))), float(np.mean(list(sides.b.values())))))


def _every_run(measure: Measure, sides: _Sides) -> list[tuple[float, float]]:
    """(stat, power) of every run (stat ``value``) or of every pair of runs of one seed (two sides; every pair of
    runs where the sides share no seed, a peer's against ours)."""
    a, b = sides.each.get("a", []), sides.each.get("b", [])
    if measure.stat == "value":
        return [(value, power) for _, _, value, power in a]
    common = {r for r, *_ in a} & {r for r, *_ in b} - {r for r, *_ in a if str(r).startswith("run:")}
    pairs = {(i, k) for i, (ra, *_) in enumerate(a) for k, (rb, *_) in enumerate(b) if ra == rb and ra in common}
    lone_a = {i for i, (ra, *_) in enumerate(a) if ra not in common}  # a run with no seed-mate meets every run
    lone_b = {k for k, (rb, *_) in enumerate(b) if rb not in common}  # on the other side
    pairs |= {(i, k) for i in lone_a for k in range(len(b))} | {(i, k) for k in lone_b for i in range(len(a))}
    return [(_stat(measure.stat, a[i][2], b[k][2]), math.nan) for i, k in sorted(pairs)]


def _verdict_every_run(rule: Rule, measure: Measure, sides: _Sides) -> ContextResult:
    """``all_at_most`` / ``all_at_least``: every run must meet the bound. A run whose ``power`` (the stat at the
    strongest result its sample size allows) does not reach past the bound could not have failed: it is set aside,
    and where every run is so the context is ``underpowered``."""
    n_a, n_b = len(sides.a), len(sides.b)
    unit, bound = measure.unit, fmt(rule.bound, measure.unit)
    at_most = rule.kind == "all_at_most"
    runs = _every_run(measure, sides)
    could_fail = [(v, p) for v, p in runs if math.isnan(p) or (p > rule.bound if at_most else p < rule.bound)]
    values = tuple(v for v, _ in runs)
    if not could_fail:
        strongest = max(p for _, p in runs) if at_most else min(p for _, p in runs)
        reason = (
            f"no run could have failed: the most a run could have shown ({measure.power}) is "
            f"{fmt(strongest, unit)}, not past the bound {bound} ({len(runs)} run{'s' if len(runs) != 1 else ''})"
        )
        worst = max(values) if at_most else min(values)
        return ContextResult("", UNDERPOWERED, worst, math.nan, math.nan, n_a, n_b, "all runs", values, reason)
    judged = [v for v, _ in could_fail]
    worst = max(judged) if at_most else min(judged)
    ok = worst <= rule.bound if at_most else worst >= rule.bound
    aside = len(runs) - len(could_fail)
    note = f" ({aside} run{'s' if aside != 1 else ''} that could not have failed set aside)" if aside else ""
    powers = [p for _, p in could_fail if not math.isnan(p)]
    if powers:  # what the judged runs could have shown at their sample size: the rule's reach
        reach = min(powers) if at_most else max(powers)
        judged_runs = f"{len(could_fail)} run{'s' if len(could_fail) != 1 else ''}"
        aside_runs = f"; {aside} that could not have failed set aside" if aside else ""
        reached = f"each could have reached {fmt(reach, unit)} against the bound {bound}"
        note = f" (judged: {judged_runs}, {reached}{aside_runs})"
    if ok:
        return ContextResult("", REPRODUCED, worst, math.nan, math.nan, n_a, n_b, "all runs", values, note.strip(" ()"))
    reason = f"worst run {fmt(worst, unit)} against the bound {bound}{note}"
    return ContextResult("", NOT_REPRODUCED, worst, math.nan, math.nan, n_a, n_b, "all runs", values, reason)


def _verdict(rule: Rule, measure: Measure, sides: _Sides) -> ContextResult:
    if rule.kind in ("all_at_most", "all_at_least"):
        return _verdict_every_run(rule, measure, sides)
    estimate, low, high, interval, values = _estimate(measure, sides)
    powers = [p for *_, p in sides.each.get("a", [])]
    if powers and not any(
        math.isnan(p) or (p < rule.bound if rule.kind == "above" else p > rule.bound) for p in powers
    ):
        reach = min(powers) if rule.kind == "above" else max(powers)
        reason = (
            f"no run could have failed: the most its runs could have shown ({measure.power}) is "
            f"{fmt(reach, measure.unit)}, not past "
            f"the bound {fmt(rule.bound, measure.unit)} ({len(powers)} run{'s' if len(powers) != 1 else ''})"
        )
        return ContextResult("", UNDERPOWERED, estimate, low, high, len(sides.a), 0, interval, values, reason)
    n_a, n_b = len(sides.a), len(sides.b)
    unit = measure.unit
    bound = fmt(rule.bound, unit)
    n = n_a if measure.stat == "value" else min(n_a, n_b)
    above = rule.kind == "above"
    shown = f"{fmt(estimate, unit)}"
    more = f"the rule needs n >= {rule.min_n}: run {rule.min_n - n} more seed{'s' if rule.min_n - n != 1 else ''}"
    if not (math.isfinite(low) and math.isfinite(high)):
        if math.isfinite(estimate) and n >= 2 and not math.isfinite(low):
            reason = f"{shown}: no interval could be computed"
            return ContextResult("", INCONCLUSIVE, estimate, low, high, n_a, n_b, interval, values, reason)
        if n >= rule.min_n and measure.run_interval is not None:  # one run, but it recorded no interval of its own
            reason = f"{shown} from {n} run: it recorded no interval of its own ({', '.join(measure.run_interval)})"
            return ContextResult("", INCONCLUSIVE, estimate, low, high, n_a, n_b, interval, values, reason)
        tail = more if rule.min_n >= 2 else f"run {2 - n} more seed{'s' if 2 - n != 1 else ''}"
        reason = f"{shown} from {n} seed{'s' if n != 1 else ''}: no interval (needs >= 2); {tail}"
        verdict = UNDERPOWERED if n < rule.min_n or n < 2 else INCONCLUSIVE
        return ContextResult("", verdict, estimate, low, high, n_a, n_b, interval, values, reason)
    interval_text = f"{shown} [{fmt(low, unit)}, {fmt(high, unit)}], n={n}"
    wrong = (above and high <= rule.bound) or (not above and low >= rule.bound)
    clears = (above and low > rule.bound) or (not above and high < rule.bound)
    if n < rule.min_n:  # below the registered n neither verdict is given, whichever side the interval lies on
        side = "clears" if clears else "lies on the wrong side of" if wrong else "straddles"
        reason = f"{interval_text} {side} {bound}, but {more}"
        return ContextResult("", UNDERPOWERED, estimate, low, high, n_a, n_b, interval, values, reason)
    if wrong:
        reason = f"{interval_text} lies entirely {'at or below' if above else 'at or above'} {bound}"
        return ContextResult("", NOT_REPRODUCED, estimate, low, high, n_a, n_b, interval, values, reason)
    if clears:
        return ContextResult("", REPRODUCED, estimate, low, high, n_a, n_b, interval, values)
    reason = f"{interval_text} straddles {bound}"
    return ContextResult("", INCONCLUSIVE, estimate, low, high, n_a, n_b, interval, values, reason)


BENCH_PROFILES = ("quick", "paper")  # the benchmarks' own profiles


def bench_profile(profile: str | None) -> str | None:
    """The benchmark profile whose runs judge a ``bench`` claim in a report of ``profile``: the benchmarks have only
    ``quick`` and ``paper``; any other run profile (``reference``) reads the ``paper`` bench, the papers' shapes."""
    return profile if profile is None or profile in BENCH_PROFILES else "paper"


def evaluate_claim(db_url: str | None, claim: Claim, **filters: Any) -> ClaimResult:
    """Measure one claim in the store (``filters`` as ``storage.views``: profile, root, since, ...). A ``bench``
    claim in a report of a profile the benchmarks do not have reads the ``paper`` bench runs (:func:`bench_profile`),
    wherever they ran (not only under the chain ``root``)."""
    if claim.stage == "bench" and bench_profile(filters.get("profile")) != filters.get("profile"):
        filters = {k: v for k, v in filters.items() if k != "root"}
        filters["profile"] = bench_profile(filters.get("profile"))
    m = claim.measure
    rows = claim_rows(db_url, claim, **filters)
    if rows.empty:
        lacking = rows.attrs.get("unmeasured_runs", 0)
        if lacking:
            return ClaimResult(
                claim,
                NOT_RUN,
                (),
                f"{lacking} recorded run{'s' if lacking != 1 else ''} lack{'s' if lacking == 1 else ''} the rule's "
                f"measure ({m.value}): {_how(claim, filters.get('profile'))}",
            )
        return ClaimResult(claim, NOT_RUN, (), f"nothing measured: {_how(claim, filters.get('profile'))}")
    meta = run_meta(db_url, rows["run_id"].drop_duplicates().tolist())
    seeds = dict(zip(meta["run_id"], meta["seed"], strict=True))
    rows = rows.drop(columns=[c for c in ("started_at", "git_commit") if c in rows]).merge(
        meta[["run_id", "started_at", "git_commit"]], on="run_id", how="left"
    )
    run_ids = tuple(sorted(rows["run_id"].unique()))
    datasets = tuple(sorted({str(d) for d in rows.get("dataset", pd.Series(dtype=object)).dropna().unique()}))
    if claim.applies_at is not None:
        at, elsewhere = at_scale(db_url, claim, rows)
        if at.empty:  # what ran elsewhere is shown, each context marked not applicable, and judged nowhere
            reason = f"ran at {elsewhere}; the rule's bound applies at {claim.applies_at.scale}"
            shown = tuple(
                replace(_decide(claim.rule, m, sides), context=name, verdict=NOT_APPLICABLE, reason="")
                for name, sides in _sides(rows, m, seeds)[0].items()
                if sides.a and (m.stat == "value" or sides.b)
            )
            return ClaimResult(claim, NOT_APPLICABLE, shown, reason, run_ids, datasets, 0)
        rows = at
    per_context, superseded = _sides(rows, m, seeds)
    contexts: list[ContextResult] = []
    for name, sides in per_context.items():
        if sides.a and (m.stat == "value" or sides.b):  # a context without both sides is not a comparison
            contexts.append(replace(_decide(claim.rule, m, sides), context=name))
    for column, wanted in m.require.items():
        for value in wanted:
            part = _part(column, value)
            if not any(part in c.context.split(", ") for c in contexts):
                contexts.append(ContextResult(part, NOT_RUN, math.nan, math.nan, math.nan, 0, 0, "none", (), "not run"))
    verdict, reason = _combine(contexts, claim.rule.min_n)
    if m.family is not None and verdict in (REPRODUCED, NOT_REPRODUCED):
        verdict, reason = _family_spent(rows, per_context, verdict, reason)
    half = sorted(name or "-" for name, sides in per_context.items() if m.stat != "value" and not (sides.a and sides.b))
    if verdict == NOT_RUN and half:
        reason = f"only one side measured ({', '.join(half)}): {_how(claim, filters.get('profile'))}"
    if m.projected and verdict not in (NOT_RUN,):
        verdict, reason = PROJECTED, _projection(claim, verdict, rows)
    if claim.exploratory and verdict != NOT_RUN:  # registered after a result it bears on: its rule's reading only
        reason = f"its rule reads {verdict}{f' ({reason})' if reason else ''}; exploratory: {claim.exploratory}"
        verdict = EXPLORATORY
    if superseded:
        note = f"{superseded} run{'s' if superseded != 1 else ''} of an older commit superseded by the newest commit's"
        reason = f"{reason}; {note}" if reason else note
    return ClaimResult(
        claim, verdict, tuple(contexts), reason, run_ids, datasets, len(rows), superseded, _recipes(rows, m)
    )


def _family_spent(
    rows: pd.DataFrame, per_context: dict[str, _Sides], verdict: Verdict, reason: str
) -> tuple[Verdict, str]:
    """``measure.family``: the verdict stands only where the alpha shares of the bounds it judged (every row of the
    runs that count) add up to at most 1 - CONFIDENCE, so that all of them hold together at 95% (Bonferroni); a row
    without a share (computed at the full alpha) or more bounds than the family was fixed for (seeds or targets
    audited after it) make it ``inconclusive``."""
    counted = set().union(*(s.runs for s in per_context.values())) if per_context else set()
    shares = rows.loc[rows["run_id"].isin(counted), "family"]
    spent = float(shares.sum()) if shares.notna().all() else math.inf
    if spent <= (1 - CONFIDENCE) * (1 + 1e-9):
        return verdict, reason
    why = (
        f"its {len(shares)} bounds were computed for a smaller family (their alpha shares add up to {spent:.3g} > "
        f"{1 - CONFIDENCE:.2g}), so the strongest of them is not a {CONFIDENCE:.0%} statement; re-run the audit with "
        "every target it judges in one family"
    )
    return INCONCLUSIVE, f"its rule reads {verdict}{f' ({reason})' if reason else ''}, but {why}"


def _recipes(rows: pd.DataFrame, m: Any) -> tuple[str, ...]:
    """``method lr L x B for E epochs`` of each method the claim's sides select among ``rows`` that names its
    learning rate and batch size (the train-dp views: a search picks them per method, so the report says which ones
    the verdict rests on; the epochs say how far the schedule is from the paper's)."""
    if not {"method", "lr", "batch_size"} <= set(rows.columns):
        return ()
    known = rows.dropna(subset=["lr", "batch_size"])
    wanted = [side.get("method") for side in (m.a, m.b or {}) if side.get("method") is not None]
    if wanted:
        names = {str(w) for v in wanted for w in (v if isinstance(v, list) else [v])}
        known = known[known["method"].astype(str).isin(names)]
    epochs = known["epochs"] if "epochs" in known else pd.Series(math.nan, index=known.index)
    points = {
        (str(m), float(lr), int(b), None if pd.isna(e) else int(e))
        for m, lr, b, e in zip(known["method"], known["lr"], known["batch_size"], epochs, strict=True)
    }
    return tuple(
        f"{m} lr {lr:g} x {b}" + (f" for {e} epoch{'s' if e != 1 else ''}" if e is not None else "")
        for m, lr, b, e in sorted(points, key=lambda p: (p[0], p[1], p[2], -1 if p[3] is None else p[3]))
    )


def _projection(claim: Claim, verdict: str, rows: pd.DataFrame) -> str:
    """The reason of a ``projected`` verdict: what the fit says against the bound, and how far the fit missed a
    measured run it was not fitted on (``validation``)."""
    says = {REPRODUCED: "meets", NOT_REPRODUCED: "misses"}.get(verdict, "straddles")
    text = f"read from a fit, not measured: the projection {says} the bound {fmt(claim.rule.bound, claim.measure.unit)}"
    errors = rows["validation"].dropna() if "validation" in rows else pd.Series(dtype=float)
    if errors.empty:
        return f"{text}; the fit was not validated on a held-out measured run"
    worst = float(errors.abs().max())
    return f"{text}; its prediction error on a held-out measured run: {100 * worst:.1f}% (worst of {len(errors)})"


def _how(claim: Claim, profile: str | None) -> str:
    """What to run to measure ``claim``."""
    p = f" --profile {profile}" if profile else ""
    m = claim.measure
    if claim.stage == "bench":  # the benchmarks have their own profiles, quick and paper
        q = p if profile in BENCH_PROFILES else ""
        if m.where and any(k.startswith(("config.setting.", "settings.")) for k in m.where):
            q = " --profile paper"  # the claim reads a shape only the paper bench runs (GPT-2, M = 50,257)
        ours = f"run `privbench bench {m.techniques[0] if m.techniques else 'dp-clipping'}{q}`"
    else:
        ours = f"run `privbench run {claim.stage}{p}`"
    peer = m.b_source
    if peer is not None and peer.stage == "bench" and peer.techniques:
        q = f" --profile {peer.profile}" if peer.profile else ""
        return f"{ours} and `privbench bench {peer.techniques[0]}{q}` (side b)"
    return ours


def _combine(contexts: Sequence[ContextResult], min_n: int) -> tuple[str, str]:
    """The claim's verdict from its contexts': any context ``not reproduced`` decides; then any ``inconclusive``
    (or a required context not run); then any ``underpowered``; else ``reproduced``."""
    measured = [c for c in contexts if c.verdict != NOT_RUN]
    if not measured:
        return NOT_RUN, "; ".join(f"{c.context}: {c.reason}" for c in contexts) or "nothing measured"

    def line(cs: Sequence[ContextResult]) -> str:
        return "; ".join(f"{c.context + ': ' if c.context else ''}{c.reason}" for c in cs if c.reason)

    failed = [c for c in contexts if c.verdict == NOT_REPRODUCED]
    if failed:
        return NOT_REPRODUCED, line(failed)
    open_ = [c for c in contexts if c.verdict in (INCONCLUSIVE, NOT_RUN)]
    if open_:
        return INCONCLUSIVE, line([*open_, *(c for c in contexts if c.verdict == UNDERPOWERED)])
    weak = [c for c in contexts if c.verdict == UNDERPOWERED]
    single = [c for c in weak if c.interval == "none"]
    if weak and len(single) == len(weak) and len(weak) > 1:
        return UNDERPOWERED, (
            f"one seed in each of the {len(weak)} contexts: no interval, so no verdict (the rule needs n >= "
            f"{min_n}); run more seeds"
        )
    if weak:
        return UNDERPOWERED, line(weak)
    return REPRODUCED, line(contexts)


def evaluate_claims(
    db_url: str | None = None, *, claims: Sequence[Claim] | None = None, **filters: Any
) -> list[ClaimResult]:
    """Every claim of the registry (or ``claims``), in registry order, each read beside its ``precondition``
    (:func:`with_precondition`; a precondition outside ``claims`` is taken from the registry)."""
    chosen = list(claims if claims is not None else load_claims())
    results = {c.id: evaluate_claim(db_url, c, **filters) for c in chosen}
    registry: dict[str, Claim] | None = None
    for claim in chosen:
        if claim.precondition is None:
            continue
        pre = results.get(claim.precondition)
        if pre is None:
            registry = registry if registry is not None else {c.id: c for c in load_claims()}
            if claim.precondition not in registry:
                raise ConfigError(
                    f"claim {claim.id!r}: precondition {claim.precondition!r} is no claim of the registry"
                )
            pre = evaluate_claim(db_url, registry[claim.precondition], **filters)
        results[claim.id] = with_precondition(results[claim.id], pre)
    return [results[c.id] for c in chosen]


def with_precondition(result: ClaimResult, pre: ClaimResult) -> ClaimResult:
    """``result`` read beside its precondition's ``pre`` (rule in ``pbconfig.claims``): a claim whose precondition
    is not ``reproduced`` cannot show its comparison either way, so its ``reproduced`` or ``not reproduced`` reads
    ``inconclusive``, with both measurements in the reason (the other verdicts stand, the precondition named)."""
    if pre.verdict == REPRODUCED or result.verdict == NOT_RUN:
        return result
    about = f"its precondition `{pre.claim.id}` is {pre.verdict}" + (f" ({pre.reason})" if pre.reason else "")
    if result.verdict in (REPRODUCED, NOT_REPRODUCED):
        measured = f"measured {result.verdict}" + (f": {result.reason}" if result.reason else "")
        return replace(result, verdict=INCONCLUSIVE, reason=f"cannot show here: {about}; {measured}")
    return replace(result, reason=f"{result.reason}; {about}" if result.reason else about)


CLAIM_COLUMNS = [
    "paper",
    "claim",
    "source",
    "statement",
    "paper_value",
    "ours",
    "n",
    "scale",
    "verdict",
    "rule",
    "reason",
    "interval",
    "stage",
    "note",
    "paper_claim",
    "run_ids",
]


def claims_table(results: Sequence[ClaimResult], profile: str | None = None) -> pd.DataFrame:
    """One row per claim (``CLAIM_COLUMNS``): what the report and the dashboard's Claims tab show."""
    rows = []
    for r in results:
        c = r.claim
        scale = ", ".join(r.datasets) if r.datasets else ""
        shown = bench_profile(profile) if c.stage == "bench" else profile
        if shown:
            scale = f"{'bench ' if c.stage == 'bench' else ''}{shown} profile" + (f": {scale}" if scale else "")
        if r.recipes:
            scale = f"{scale}; {', '.join(r.recipes)}" if scale else ", ".join(r.recipes)
        rows.append(
            {
                "paper": c.paper,
                "claim": c.id,
                "source": f"privbench check ({c.source})" if c.check else c.source,
                "statement": c.statement,
                "paper_value": c.paper_value,
                "ours": r.ours() if r.contexts else "-",
                "n": r.n,
                "scale": scale,
                "verdict": r.verdict,
                "rule": c.rule.describe(c.stat_label, c.measure.unit),
                "reason": r.reason,
                "interval": "; ".join(sorted({x.interval for x in r.contexts if x.verdict != NOT_RUN})),
                "stage": c.stage,
                "note": f"{c.note} (privbench check: {c.check})"
                if c.note and c.check
                else c.note or (f"privbench check: {c.check}" if c.check else ""),
                "paper_claim": not c.check,
                "run_ids": list(r.run_ids),
            }
        )
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


__all__ = [
    "CLAIM_COLUMNS",
    "EXPLORATORY",
    "INCONCLUSIVE",
    "NOT_APPLICABLE",
    "NOT_REPRODUCED",
    "NOT_RUN",
    "PROJECTED",
    "REPRODUCED",
    "UNDERPOWERED",
    "ClaimResult",
    "ContextResult",
    "claim_rows",
    "claims_table",
    "evaluate_claim",
    "evaluate_claims",
    "fmt",
    "run_configs",
    "with_precondition",
]
