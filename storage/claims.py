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

Steps 2-4 for one context (the sides, the stat and its interval, the rule's verdict) are
``storage.claim_context``'s; this module finds the rows, runs them per context and combines the contexts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from core.errors import ConfigError
from pbconfig.claims import Claim, Verdict, column_names, load_claims
from storage.claim_context import ContextResult, IntervalKind, Sides, context_part, decide, fmt, sides_of
from storage.claim_rows import at_scale, choose_once, claim_rows, matches, run_configs
from storage.leaderboard import CONFIDENCE, run_meta
from storage.view_columns import SELECTION_COLUMNS

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_RUN = (
    Verdict.REPRODUCED,
    Verdict.NOT_REPRODUCED,
    Verdict.INCONCLUSIVE,
    Verdict.NOT_RUN,
)
UNDERPOWERED, PROJECTED, NOT_APPLICABLE = Verdict.UNDERPOWERED, Verdict.PROJECTED, Verdict.NOT_APPLICABLE
EXPLORATORY = Verdict.EXPLORATORY


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
            label = "runs" if c.interval == IntervalKind.ALL_RUNS else "n"
            if c.interval == IntervalKind.ALL_RUNS:  # an every-run rule judged each run (or pair), not each seed
                n = str(len(c.values))
            if self.claim.measure.b_source is not None and all(math.isfinite(m) for m in c.means):
                shown += f" (ours {fmt(c.means[0])}, peer {fmt(c.means[1])})"  # both numbers, not just the ratio
            parts.append(f"{c.context + ': ' if c.context else ''}{shown} ({label}={n})")
        shown = "; ".join(parts) if parts else "-"
        return f"projected: {shown}" if self.claim.measure.projected and parts else shown


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
            rows, _ = _chosen(rows, m, seeds)
            judged = [
                (name, decide(claim.rule, m, sides))
                for name, sides in sides_of(rows, m, seeds)[0].items()
                if sides.a and (m.stat == "value" or sides.b)
            ]
            reason = f"ran at {elsewhere}; the rule's bound applies at {claim.applies_at.scale}"
            if judged:  # what the rule reads at the scale that ran, shown and never counted
                would = ", ".join(f"{name}: {r.verdict}" if name else r.verdict for name, r in judged)
                reason += f"; at the scale that ran the rule would read {would} (not counted)"
            shown = tuple(replace(r, context=name, verdict=NOT_APPLICABLE, reason="") for name, r in judged)
            return ClaimResult(claim, NOT_APPLICABLE, shown, reason, run_ids, datasets, 0)
        rows = at
    superseded = sides_of(rows, m, seeds)[1]
    rows, choices = _chosen(rows, m, seeds)
    per_context = sides_of(rows, m, seeds)[0]
    kept = {run for sides in per_context.values() for run in sides.runs}
    choices += shown_per_side(rows[rows["run_id"].isin(kept)], claim)
    contexts: list[ContextResult] = []
    for name, sides in per_context.items():
        if sides.a and (m.stat == "value" or sides.b):  # a context without both sides is not a comparison
            contexts.append(replace(decide(claim.rule, m, sides), context=name))
    for column, wanted in m.require.items():
        for value in wanted:
            part = context_part(column, value)
            if not any(part in c.context.split(", ") for c in contexts):
                contexts.append(
                    ContextResult(part, NOT_RUN, math.nan, math.nan, math.nan, 0, 0, IntervalKind.NONE, (), "not run")
                )
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
        claim, verdict, tuple(contexts), reason, run_ids, datasets, len(rows), superseded, _recipes(rows, m) + choices
    )


def _shown_value(values: pd.Series) -> str:
    """One value as is, several numbers as their range, several others as the values seen (sorted)."""
    seen = values.dropna().unique().tolist()
    if not seen:
        return "-"
    if len(seen) == 1:
        value = seen[0]
        return f"{value:g}" if isinstance(value, float) else str(value)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in seen):
        return f"{min(seen):g}-{max(seen):g}"
    return "/".join(sorted(map(str, seen)))


def shown_per_side(rows: pd.DataFrame, claim: Claim) -> tuple[str, ...]:
    """``claim.shows`` as the scale column names them: per technique (``method``) and side, each shown column's
    value over the side's rows (``lr 0.01, pretrained True``; a range where the runs differ)."""
    columns = [c for c in claim.shows if c in rows.columns]
    if not columns or rows.empty:
        return ()
    m = claim.measure
    labels = [("a", m.a), ("b", m.b)] if m.b is not None else [("a", m.a)]
    out = []
    for _, selector in labels:
        side = rows[matches(rows, selector)] if selector else rows
        label = " ".join(str(v) if not isinstance(v, list) else "/".join(map(str, v)) for v in selector.values())
        keys = [k for k in ("method", "dataset") if k in side and (k == "method" or k in m.per)]
        groups = side.groupby(keys, sort=True) if keys else [((), side)]
        for key, part in groups:
            key = key if isinstance(key, tuple) else (key,)
            method = " ".join(map(str, key))
            name = method if label in ("", str(key[0]) if key else "") else f"{method} {label}".strip()
            shown = ", ".join(
                f"{c.removeprefix('config.')} {_shown_value(part[c])}" for c in columns if part[c].notna().any()
            )
            if shown:
                out.append(f"{name}: {shown}" if name else shown)
    return tuple(dict.fromkeys(out))


def _chosen(rows: pd.DataFrame, m: Any, seeds: dict[str, Any]) -> tuple[pd.DataFrame, tuple[str, ...]]:
    """``measure.choose`` on the rows the rule keeps (the newest commit's runs of each context, side and seed: an
    older commit's superseded runs do not vote), with how the scale column names the choice; the rows as they are
    for a claim without a choice."""
    if m.choose is None:
        return rows, ()
    check_choice(m)
    if rows.empty:
        return rows, ()
    kept = {run for sides in sides_of(rows, m, seeds)[0].values() for run in sides.runs}
    chosen_rows, chosen = choose_once(rows[rows["run_id"].isin(kept)], m)
    return chosen_rows, _choices(chosen, m)


def check_choice(m: Any) -> None:
    """Refuse a ``measure.choose`` whose ``by`` is not a selection column of its source view measured apart from the
    judged value (``storage.view_columns.SELECTION_COLUMNS``): the registry checks names only, this checks what the
    column is."""
    declared = SELECTION_COLUMNS.get(m.source, {})
    by = sorted(column_names(m.choose.by))
    judged = sorted(column_names(m.value).union(*(column_names(b) for b in m.run_interval or ())))
    apart = [c for c in by if c in declared and set(judged) <= set(declared[c])]
    if not by or len(apart) != len(by):
        known = "; ".join(f"{c} (apart from {', '.join(v)})" for c, v in declared.items()) or "none"
        raise ConfigError(
            f"choose.by {m.choose.by!r} on {m.source} is not a selection column measured apart from the judged "
            f"{', '.join(judged)}; selection columns of {m.source}: {known}. Choose on one of those, or declare a new "
            f"one in storage/view_columns.py SELECTION_COLUMNS with the columns it is measured apart from"
        )


def _choices(chosen: dict[tuple[Any, ...], Any], m: Any) -> tuple[str, ...]:
    """How the report names each ``measure.choose`` choice: ``<among> <value> chosen once on <by>, both sides
    pooled`` (prefixed by its context where the claim has several)."""
    if m.choose is None:
        return ()
    out = []
    for key, value in sorted(chosen.items(), key=lambda kv: tuple(map(str, kv[0]))):
        where = ", ".join(context_part(c, v) for c, v in zip(m.per, key, strict=True))
        label = f"{m.choose.among} {value} chosen once on {m.choose.by}, both sides pooled"
        out.append(f"{where}: {label}" if where and len(chosen) > 1 else label)
    return tuple(out)


def _family_spent(
    rows: pd.DataFrame, per_context: dict[str, Sides], verdict: Verdict, reason: str
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
            if m.where.get("config.setting.arch") == "t5":
                q += " --set secure_inference.arch=t5"  # the bench's T5 shape
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
    single = [c for c in weak if c.interval == IntervalKind.NONE]
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
            scale = f"{scale}; {'; '.join(r.recipes)}" if scale else "; ".join(r.recipes)
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
