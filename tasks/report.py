"""``privbench report``: the papers' claims, judged from the results store alone, as Markdown with figures.

``render_report(out, profile=...)`` writes ``out`` (Markdown) and, beside it, a folder ``<out stem>/`` with one
PNG per stage result group (``tasks.figures``, the groups the dashboard draws). The Markdown has:

* where the numbers come from: profile, commit(s), device, the newest finished flow run of each stage and its
  wall time (and the benchmark chain's, when one ran);
* the verdict counts, then one table per paper: claim, the paper's value, ours (mean and 95% interval per
  context, n, scale), the verdict and the rule that gave it (``storage.claims``); below each table every
  claim's one-line reason (why it is not reproduced, what held a verdict back, what a reproduced one set aside);
* the rule history: each claim's registration commit and every change to its rule since;
* the figures.

Nothing in it is written by hand: rerunning a stage and rendering again changes it.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import task

from core.errors import ConfigError
from pbconfig.claims import STAGE_SECTIONS, Verdict, load_papers, load_profile_history
from pbconfig.stages import TITLES
from storage import views
from storage.bench_runs import bench_runs
from storage.claim_context import IntervalKind
from storage.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    ClaimResult,
    bench_profile,
    claims_table,
    evaluate_claims,
)
from storage.stage_runs import STAGE_FLOWS, stage_runs, unfinished_runs
from tasks.report_tables import quality_section, reattention_section, search_section, seb_utility_section

log = logging.getLogger("privbench.report")
VERDICT_ORDER = tuple(Verdict)
STAGE_TITLES = TITLES  # pbconfig.stages


@dataclass
class Report:
    """What ``render_report`` wrote and found."""

    path: Path
    figures: list[Path] = field(default_factory=list)
    results: list[ClaimResult] = field(default_factory=list)
    table: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def counts(self) -> dict[str, int]:
        return {v: int((self.table["verdict"] == v).sum()) if len(self.table) else 0 for v in VERDICT_ORDER}

    @property
    def paper_counts(self) -> dict[str, int]:
        """The counts of the papers' own claims (``counts`` less the checks privbench adds)."""
        own = self.table[self.table["paper_claim"]] if len(self.table) else self.table
        return {v: int((own["verdict"] == v).sum()) if len(own) else 0 for v in VERDICT_ORDER}


def _paper_count_line(report: Report, total: int) -> list[str]:
    own = report.paper_counts
    n = sum(own.values())
    if n == total:
        return []
    return [
        f"The papers' own claims alone ({n} of the {total}; the other {total - n} are checks privbench adds, marked "
        "`privbench check` in the source column, each with its reason in the notes): "
        + ", ".join(f"{own[v]} {v}" for v in VERDICT_ORDER)
        + ".",
        "",
    ]


def _cell(value: Any) -> str:
    text = "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _duration(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    minutes, secs = divmod(round(float(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min {secs:02d} s" if hours else f"{minutes} min {secs:02d} s"


def _verdict(text: str) -> str:
    return f"**{text}**" if text in (REPRODUCED, NOT_REPRODUCED) else text


def _provenance(profile: str | None, stages: pd.DataFrame, unfinished: pd.DataFrame | None = None) -> list[str]:
    lines = ["## Where these numbers come from", ""]
    stopped = _unfinished(unfinished)
    if stages.empty:
        return [*lines, f"No finished stage flow run of profile `{profile}` is in the store.", "", *stopped]
    # a commit's first 12 characters, and -dirty where the checkout had uncommitted changes to tracked files
    commits = sorted(
        {str(c)[:12] + ("-dirty" if str(c).endswith("-dirty") else "") for c in stages["git_commit"].dropna()}
    )
    devices = sorted({str(d) for d in stages["device"].dropna()})
    lines += [
        f"- profile: `{profile}`" if profile else "- profile: every profile in the store",
        f"- commit{'s' if len(commits) != 1 else ''} the runs recorded: {', '.join(f'`{c}`' for c in commits) or '?'}",
        f"- device: {'; '.join(devices) or 'unknown'}",
        "",
        "| stage | run (results store id) | started (UTC) | wall time |",
        "|---|---|---|---|",
    ]
    for row in stages.itertuples(index=False):
        started = pd.Timestamp(row.started_at).strftime("%Y-%m-%d %H:%M") if pd.notna(row.started_at) else "-"
        lines.append(
            f"| {STAGE_TITLES.get(row.flow, row.flow)} | `{row.run_id}` | {started} | {_duration(row.duration_s)} |"
        )
    if "benchmark" not in set(stages["flow"]) and len(stages) > 1:
        total = _duration(float(stages["duration_s"].fillna(0).sum()))
        lines += ["", f"The stages ran as separate commands (no benchmark chain run): {total} in all."]
    missing = [s for s in STAGE_FLOWS if s not in set(stages["flow"])]
    if missing:
        lines += ["", f"Not run (to the end) in this profile: {', '.join(missing)}."]
    return [*lines, "", *stopped]


def _unfinished(unfinished: pd.DataFrame | None) -> list[str]:
    """The flow runs that did not finish: what stopped, when and why (their results that were recorded before the
    stop are in the store; a verdict reads them like any others)."""
    if unfinished is None or unfinished.empty:
        return []
    lines = [
        "Flow runs that did not finish (a seed pass is listed under its stage's flow run):",
        "",
        "| flow | run | part of | status | started (UTC) | ran for | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in unfinished.itertuples(index=False):
        started = pd.Timestamp(row.started_at).strftime("%Y-%m-%d %H:%M") if pd.notna(row.started_at) else "-"
        parent = f"`{row.parent_id}`" if isinstance(row.parent_id, str) and row.parent_id else "-"
        error = " ".join(str(row.error).split())[:160].replace("|", "/") if isinstance(row.error, str) else "-"
        lines.append(
            f"| {row.flow} | `{row.run_id}` | {parent} | {row.status} | {started} | {_duration(row.duration_s)} | "
            f"{error} |"
        )
    return [*lines, ""]


def _bench_section(benches: pd.DataFrame) -> list[str]:
    """The benchmark runs of the profile (``privbench bench``; imported ones carry the measuring machine), each
    with its top-level ratios: what the bench claims above read, and the device each ran on."""
    if benches.empty:
        return []
    lines = [
        "## Benchmark runs",
        "",
        (
            "`privbench bench` runs in this store (imported ones, `privbench results import-bench`, keep the host, "
            "device, commit and times of the machine that measured them)."
        ),
        "",
        (
            "| benchmark | run | model | device | host | commit | started (UTC) | wall time "
            "| ratios (its first measured length) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in benches.itertuples(index=False):
        started = pd.Timestamp(row.started_at).strftime("%Y-%m-%d %H:%M") if pd.notna(row.started_at) else "-"
        ratios = ", ".join(f"{k} {v:.3g}" for k, v in sorted(row.ratios.items()) if not k.startswith(("vanilla_",)))
        lines.append(
            "| "
            + " | ".join(
                [
                    _cell(row.benchmark),
                    f"`{row.run_id}`",
                    _cell(row.shape) or "-",
                    _cell(row.device),
                    _cell(row.host),
                    f"`{str(row.git_commit)[:12]}`" if row.git_commit else "-",
                    started,
                    _duration(row.duration_s),
                    _cell(ratios) or "-",
                ]
            )
            + " |"
        )
    return [*lines, ""]


def _paper_section(paper: str, title: str, file: str, rows: pd.DataFrame) -> list[str]:
    lines = [
        f"## {paper}",
        "",
        f"{title} (`shared/papers/{file}`).",
        "",
        "| claim | source | paper | ours (mean [95% interval], n) | scale | verdict | rule |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows.itertuples(index=False):
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{r.claim}`: {_cell(r.statement)}",
                    _cell(r.source),
                    _cell(r.paper_value),
                    _cell(r.ours),
                    _cell(r.scale),
                    _verdict(r.verdict),
                    _cell(r.rule),
                ]
            )
            + " |"
        )
    notes = [r for r in rows.itertuples(index=False) if r.reason]
    if notes:
        lines.append("")
        for r in notes:
            why = {NOT_REPRODUCED: "why not", REPRODUCED: "reproduced, with"}.get(r.verdict, "why " + r.verdict)
            lines.append(f"- `{r.claim}` ({why}): {_cell(r.reason)}")
    noted = [r for r in rows.itertuples(index=False) if r.note]
    if noted:
        lines += ["", "Notes:", ""] + [f"- `{r.claim}`: {_cell(r.note)}" for r in noted]
    names = {
        IntervalKind.ALL_RUNS: "every-run bounds (no interval needed)",
        IntervalKind.NONE: "one seed (no interval)",
    }
    # "; " joins them: a name may hold a comma ("the runs' own (normal, sides independent)")
    intervals = sorted({names.get(i, i) for v in rows["interval"] for i in str(v).split("; ") if i})
    if intervals:
        lines += ["", f"Intervals: {'; '.join(intervals)}."]
    return [*lines, ""]


def _history_section(results: list[ClaimResult], profile: str | None = None) -> list[str]:
    """Pre-registration: the commit that registered each claim's rule, and every change to a rule since (the old
    and new value, the verdict the old rule gave in the reports of the time, the reason); then every recorded
    change of the profile's stage sections, which every claim of that stage reads."""
    lines = [
        "## Rule history",
        "",
        (
            "The commit that added each claim to `configs/claims/` (where a claim was added after runs that measure "
            "it existed, that commit is not a pre-registration: compare its date with the runs'); every later change "
            "to a rule's measure, bound, n, data, precondition or scale is recorded with the verdict the old rule "
            "gave and its reason (`docs/claims.md`). Registered:"
        ),
        "",
    ]
    by_commit: dict[str, list[str]] = {}
    for r in sorted(results, key=lambda r: r.claim.registered.date):
        reg = r.claim.registered
        by_commit.setdefault(f"`{reg.commit}` ({reg.date})" if reg.commit else f"this change ({reg.date})", []).append(
            f"`{r.claim.id}`"
        )
    lines += [f"- {when}: {', '.join(ids)}" for when, ids in by_commit.items()]
    changed = [(r.claim, h) for r in results for h in r.claim.history]
    profile_lines = _profile_history(results, profile)
    if not changed:
        return [*lines, "", "No registered rule has changed.", "", *profile_lines]
    lines += [
        "",
        "| claim | date | commit | change (old -> new) | the old rule's verdict | reason |",
        "|---|---|---|---|---|---|",
    ]
    for claim, h in changed:
        what = "; ".join(f"{k}: {_shown(old)} -> {_shown(new)}" for k, (old, new) in h.change.items())
        commit = f"`{h.commit}`" if h.commit else "this change"
        lines.append(
            f"| `{claim.id}` | {h.date} | {commit} | {_cell(what)} | {_cell(h.verdict_before)} | {_cell(h.reason)} |"
        )
    return [*lines, "", *profile_lines]


def _profile_history(results: list[ClaimResult], profile: str | None) -> list[str]:
    """The recorded changes of the profile's stage sections (``configs/history/profiles.yaml``), each against the
    claims of its stage in this report."""
    stages = {section: stage for stage, section in STAGE_SECTIONS.items()}
    present = {r.claim.stage for r in results}
    changes = [
        c for c in load_profile_history() if (profile is None or profile in c.profiles) and stages[c.section] in present
    ]
    if not changes:
        return []
    lines = [
        (
            "Changes of the profile's stage sections (the data, recipe or budget every claim of the stage reads; "
            "`configs/history/profiles.yaml`):"
        ),
        "",
        "| claims | profiles | date | commit | change (old -> new) | the verdicts before | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in changes:
        what = "; ".join(f"{c.section}.{k}: {_shown(old)} -> {_shown(new)}" for k, (old, new) in c.change.items())
        commit = f"`{c.commit}`" if c.commit else "this change"
        lines.append(
            f"| every `{stages[c.section]}` claim | {', '.join(c.profiles)} | {c.date} | {commit} | {_cell(what)} | "
            f"{_cell(c.verdict_before)} | {_cell(c.reason)} |"
        )
    return [*lines, ""]


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return f"`{value}`" if isinstance(value, str) and " " not in value else str(value)


def _figures(stages: pd.DataFrame, folder: Path, db_url: str | None) -> list[Path]:
    from tasks.figures import GROUPS, render_figures

    written: list[Path] = []
    for row in stages.itertuples(index=False):
        if row.stage not in GROUPS:
            continue
        try:
            for path in render_figures(row.stage, row.run_id, folder, db_url=db_url):
                target = path.with_name(f"{row.flow}-{path.name}")
                path.replace(target)
                written.append(target)
        except Exception as exc:  # noqa: BLE001 -- a figure never stops the report
            log.warning("could not draw the %s figures: %s: %s", row.flow, type(exc).__name__, exc)
    return written


FIGURE_SUFFIXES = (".png",)  # what a report writes into its figures folder


def _clear_figures(folder: Path) -> None:
    """Empty ``folder`` of an earlier report's figures (creating it), refusing a folder that holds anything a report
    does not write there: ``--out x.md`` must never delete a folder ``x/`` of the user's (an export, say)."""
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError(f"the report's figures go to {folder}/, but {folder} is a file; choose another --out")
        foreign = sorted(p.name for p in folder.iterdir() if not (p.is_file() and p.suffix in FIGURE_SUFFIXES))
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(
                f"the report's figures go to {folder}/, which holds files a report does not write ({shown}); "
                "nothing was replaced: choose another --out (e.g. report.md beside the folder) or move them"
            )
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def render_report(
    out: Path,
    *,
    profile: str | None = None,
    db_url: str | None = None,
    root: str | None = None,
    figures: bool = True,
) -> Report:
    """Evaluate every claim on the runs of ``profile`` (under ``root`` when given) and write the report to
    ``out`` with its figures in ``<out stem>/`` (replaced). Returns what was written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = evaluate_claims(db_url, profile=profile, root=root)
    table = claims_table(results, profile)
    stages = stage_runs(db_url, profile=profile, root=root)
    folder = out.with_suffix("")
    written: list[Path] = []
    if figures:
        _clear_figures(folder)
        if root is not None:  # one chain: draw its own stage runs
            written = _figures(stages, folder, db_url)
        else:
            written = _figures(stages[stages["flow"] != "benchmark"], folder, db_url)
    report = Report(out, written, results, table)
    counts = report.counts
    lines = [
        f"# privbench report: {f'profile `{profile}`' if profile else 'every profile'}",
        "",
        (
            "Generated by `privbench report` from the results store alone: every verdict is computed by the rule shown "
            "beside it from the runs recorded in the store (`configs/claims/*.yaml` is the registry). Rendering it "
            "again after new runs changes it."
        ),
        "",
        "Verdicts: " + ", ".join(f"{counts[v]} {v}" for v in VERDICT_ORDER) + f" (of {len(table)} claims).",
        "",
        *_paper_count_line(report, len(table)),
        (
            "`underpowered`: at the n that ran the rule could not have reached one of its verdicts (the reason says "
            "the n it needs); `projected`: read from a fit, not a measurement, never counted as reproduced (the "
            "reason gives the fit's error on a held-out measured run); `exploratory`: registered after a result it "
            "bears on, so its rule's reading is shown but never counted as reproduced or not; `not applicable at this "
            "scale`: the bound is for another scale than the one that ran. The classes: `docs/claims.md`."
        ),
        "",
        *_provenance(profile, stages, unfinished_runs(db_url, profile=profile, root=root)),
    ]
    if profile != "paper" and stage_runs(db_url, profile="paper").empty:
        lines += [
            (
                "The paper profile has not run: no `paper` run is in this store (it needs hours and a GPU worker; "
                "`make run PROFILE=paper`)."
            ),
            "",
        ]
    papers = load_papers()
    for paper, spec in papers.items():
        rows = table[table["paper"] == paper]
        if len(rows):
            lines += _paper_section(paper, spec.title, spec.file, rows)
    filters = {"profile": profile, "root": root}
    lines += search_section(views.train_search(db_url, **filters), views.privacy_utility(db_url, **filters))
    lines += reattention_section(views.reattention_sizes(db_url, **filters))
    lines += quality_section(views.generation_quality(db_url, **filters))
    lines += seb_utility_section(views.seb_utility(db_url, **filters))
    # the benchmarks have only the quick and paper profiles: a reference report shows (and judges) the paper ones
    lines += _bench_section(bench_runs(db_url, profile=bench_profile(profile) if profile else None, root=root))
    lines += _history_section(results, profile)
    if written:
        lines += ["## Figures", ""]
        for path in written:
            lines += [f"![{path.stem}]({folder.name}/{path.name})", ""]
    out.write_text("\n".join(lines).rstrip() + "\n")
    return report


@task(name="claims-report")
def claims_report(parent: Any, profile: str | None) -> dict[str, Any]:
    """The ``benchmark`` flow's last step: the report of its own runs (``root`` = its parent run) rendered into a
    temporary folder (``report.md`` and ``report/*.png``) that ``close_flow_record`` logs to MLflow as the
    ``report`` artifact folder of the parent run; ``metrics`` counts the verdicts (``claims.<verdict>``) and
    each claim's verdict as a number (``claims.<id>``: 1 reproduced, 0 not reproduced, 0.5 inconclusive; a claim
    not run has none). A failure to render is logged and never fails the measured chain."""
    folder = Path(tempfile.mkdtemp(prefix="privbench-report-"))
    try:
        done = render_report(folder / "report.md", profile=profile, root=parent.run_id)
    except Exception as exc:  # noqa: BLE001 -- the report never fails the measured runs
        log.warning("could not render the claims report: %s: %s", type(exc).__name__, exc)
        shutil.rmtree(folder, ignore_errors=True)
        return {"folder": None, "metrics": {}, "counts": {}}
    scores = {REPRODUCED: 1.0, NOT_REPRODUCED: 0.0, INCONCLUSIVE: 0.5}
    metrics = {f"claims.{v.replace(' ', '_')}": float(n) for v, n in done.counts.items()}
    metrics |= {f"claims.{r.claim.id}": scores[r.verdict] for r in done.results if r.verdict in scores}
    return {"folder": folder, "metrics": metrics, "counts": done.counts}


__all__ = ["VERDICT_ORDER", "Report", "claims_report", "render_report"]
