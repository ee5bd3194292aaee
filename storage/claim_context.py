"""One context of a claim (``storage.claims``): its rows grouped into sides and replicates (``sides_of``: a run's
rows reduced, older commits' runs of a seed superseded, repeats of one seed averaged), the stat with its two-sided
95% interval (``estimate``: t over seeds, paired t, Welch's t or the delta method, or the runs' own intervals), and
the rule's verdict on it with the reason drawn from the numbers (``decide``; every-run rules judge each run, and a
run that could not have failed is set aside). What ``storage.claims`` does with the contexts of a claim, and where
the rows come from, is that module's."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from pbconfig.claims import Measure, Rule, Verdict
from storage.claim_rows import matches
from storage.leaderboard import CONFIDENCE, seed_interval

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNDERPOWERED = (
    Verdict.REPRODUCED,
    Verdict.NOT_REPRODUCED,
    Verdict.INCONCLUSIVE,
    Verdict.UNDERPOWERED,
)


class IntervalKind(StrEnum):
    """How a context's 95% interval was computed (its value is what the report prints)."""

    NONE = "none"  # one seed: no interval
    SEEDS = "t over seeds"  # Student t over the seeds' values (stat ``value``)
    PAIRED = "paired t over seeds"  # t over the per-seed stats of two sides run with the same seeds
    WELCH = "Welch t"  # the difference of two sides with different seeds
    DELTA_WELCH = "delta method (Welch)"  # a ratio of two sides with different seeds
    RUN_OWN = "the run's own (recorded over its examples or rounds)"  # one run, its own recorded interval
    RUNS_OWN = "the runs' own (normal, sides independent)"  # one run a side, their own recorded intervals
    ALL_RUNS = "all runs"  # an every-run rule: each run judged, no interval


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
    interval: IntervalKind
    values: tuple[float, ...]  # the per-seed stats (paired, or value), or the per-run values (all_* rules)
    reason: str = ""
    means: tuple[float, float] = (math.nan, math.nan)  # side a's and side b's mean over replicates (two sides)


@dataclass
class Sides:
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


def context_part(column: str, value: Any) -> str:
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if column == "epsilon":
        return f"ε={shown}"
    return shown if column in _BARE else f"{column.removeprefix('config.')}={shown}"


def _sort_key(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((0, float(v), "") if isinstance(v, int | float) else (1, 0.0, str(v)) for v in values)


def _context_name(measure: Measure, values: Sequence[Any]) -> str:
    return ", ".join(context_part(c, v) for c, v in zip(measure.per, values, strict=True))


def sides_of(frame: pd.DataFrame, measure: Measure, seeds: dict[str, Any]) -> tuple[dict[str, Sides], int]:
    """Per context: side -> {replicate: value} (and every run, ``Sides.each``), the rows of a run reduced; with
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
    out: dict[str, Sides] = {}
    for row in reduced.itertuples(index=False):
        sides = out.setdefault(row.context, Sides(order=row.order))
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


def context_stat(measure: Measure, sides: Sides) -> tuple[float, float, float, IntervalKind, tuple[float, ...]]:
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
                    IntervalKind.RUN_OWN,
                    tuple(sides.a.values()),
                )
        return ci.mean, ci.low, ci.high, IntervalKind.SEEDS if ci.n >= 2 else IntervalKind.NONE, tuple(sides.a.values())
    common = sorted(set(sides.a) & set(sides.b) - {k for k in sides.a if k.startswith("run:")})
    paired = measure.b_source is None  # a peer's seed 0 has nothing in common with ours
    if paired and len(common) >= 2 and len(common) == len(sides.a) == len(sides.b):
        per_seed = [_stat(measure.stat, sides.a[k], sides.b[k]) for k in common]
        ci = seed_interval(per_seed)
        return ci.mean, ci.low, ci.high, IntervalKind.PAIRED, tuple(per_seed)
    a, b = seed_interval(sides.a.values()), seed_interval(sides.b.values())
    estimate = _stat(measure.stat, a.mean, b.mean)
    pairs = tuple(_stat(measure.stat, x, y) for x in sides.a.values() for y in sides.b.values())
    if a.n == b.n == 1 and measure.run_interval is not None:  # one run a side: their own intervals over examples
        own = _runs_own_difference(sides)
        if own is not None:
            return estimate, estimate - own, estimate + own, IntervalKind.RUNS_OWN, pairs
    if a.n < 2 or b.n < 2:
        return estimate, math.nan, math.nan, IntervalKind.NONE, pairs
    va, vb = a.std**2 / a.n, b.std**2 / b.n
    if measure.stat == "difference":
        se = math.sqrt(va + vb)
    else:  # delta method on a / b
        if b.mean == 0 or a.mean == 0:
            return estimate, math.nan, math.nan, IntervalKind.NONE, pairs
        ratio = a.mean / b.mean
        se = abs(ratio) * math.sqrt(va / a.mean**2 + vb / b.mean**2)
    if se == 0:
        return estimate, estimate, estimate, IntervalKind.WELCH, pairs
    df = (va + vb) ** 2 / ((va**2 / (a.n - 1) if va else 0) + (vb**2 / (b.n - 1) if vb else 0) or 1e-300)
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, max(df, 1.0))) * se
    kind = IntervalKind.WELCH if measure.stat == "difference" else IntervalKind.DELTA_WELCH
    return estimate, estimate - half, estimate + half, kind, pairs


def _runs_own_difference(sides: Sides) -> float | None:
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


def _own_interval(sides: Sides, side: str, replicate: Any) -> tuple[float, float]:
    """A replicate's own 95% interval: its one run's recorded interval; for several runs of it at one commit
    (repeats of one sample, their mean the replicate's value) the hull of their intervals, which holds the mean and
    every run's interval (repeats that disagree show it); NaN where a run recorded none."""
    recorded = sides.intervals.get((side, replicate), [])
    if not recorded or not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in recorded):
        return math.nan, math.nan
    return min(lo for lo, _ in recorded), max(hi for _, hi in recorded)


def decide(rule: Rule, measure: Measure, sides: Sides) -> ContextResult:
    result = _verdict(rule, measure, sides)
    if measure.stat == "value" or not (sides.a and sides.b):
        return result
    return replace(result, means=(float(np.mean(list(sides.a.values()))), float(np.mean(list(sides.b.values())))))


def _every_run(measure: Measure, sides: Sides) -> list[tuple[float, float]]:
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


def _verdict_every_run(rule: Rule, measure: Measure, sides: Sides) -> ContextResult:
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
        return ContextResult(
            "", UNDERPOWERED, worst, math.nan, math.nan, n_a, n_b, IntervalKind.ALL_RUNS, values, reason
        )
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
        return ContextResult(
            "", REPRODUCED, worst, math.nan, math.nan, n_a, n_b, IntervalKind.ALL_RUNS, values, note.strip(" ()")
        )
    reason = f"worst run {fmt(worst, unit)} against the bound {bound}{note}"
    return ContextResult("", NOT_REPRODUCED, worst, math.nan, math.nan, n_a, n_b, IntervalKind.ALL_RUNS, values, reason)


def _verdict(rule: Rule, measure: Measure, sides: Sides) -> ContextResult:
    if rule.kind in ("all_at_most", "all_at_least"):
        return _verdict_every_run(rule, measure, sides)
    estimate, low, high, interval, values = context_stat(measure, sides)
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
