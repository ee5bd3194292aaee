"""``privbench results``: query the results store (list, show, query), write it to files and load them back
(export, restore), end stale runs (reap) and record benchmark results measured on another machine (import-bench);
and the helpers every command shares (the error console, :func:`fail`, the store calls). Everything shown is shown
literally and redacted (``privbench.display``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from core.errors import ConfigError, PrivbenchError
from privbench.display import cell as _cell
from privbench.display import literal as _literal
from privbench.display import seconds as _secs
from privbench.display import shown as _shown

results_app = typer.Typer(no_args_is_help=True, help="Query the results store.")
err = Console(stderr=True, soft_wrap=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON on stdout")]


@results_app.command("import-bench")
def results_import_bench(
    files: Annotated[
        list[Path],
        typer.Argument(
            help="JSON files printed by `privbench bench ... --no-record --json`, or folders of them (every *.json)"
        ),
    ],
    as_json: JsonOpt = False,
) -> None:
    """Record benchmark results measured elsewhere (`privbench bench --no-record --json`, e.g. on a GPU worker that
    cannot reach the store) as bench runs, with the measuring machine's commit, host, device and times. A folder
    (``docs/results/data/<profile>/bench/``) gives its ``*.json`` files in name order; every file is read before
    any is recorded. A result already in the store is refused where its file is named, and skipped where it comes
    from a folder (a folder of committed results, e.g. ``docs/results/raw/<device kind>/``, is imported again as it
    grows)."""
    from privbench.bench.harness import AlreadyImported, import_benchmark_result

    paths: list[Path] = []
    from_folder: set[Path] = set()
    for given in files:
        found = sorted(given.glob("*.json")) if given.is_dir() else [given]
        if not found:
            fail(f"{given} holds no *.json file; give files printed by `privbench bench NAME --no-record --json`", 2)
        paths += found
        if given.is_dir():
            from_folder.update(found)
    read: list[tuple[Path, Any]] = []
    for path in paths:
        try:
            read.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            fail(f"cannot read {path}: {exc}; give a file printed by `privbench bench NAME --no-record --json`", 2)
    results = []
    for path, data in read:
        try:
            recorded = import_benchmark_result(data)
        except AlreadyImported as exc:
            if path not in from_folder:
                fail(f"{path}: {exc}", code=2)
            err.print(f"{_shown(str(path))}: already in the store; skipped")
            continue
        except ConfigError as exc:
            fail(f"{path}: {exc}", code=2)
        except PrivbenchError as exc:
            fail(f"{path}: {exc}")
        results.append({"file": str(path), "run_id": recorded["run_id"], "benchmark": recorded["benchmark"]})
        err.print(f"{_shown(str(path))}: recorded as run {recorded['run_id']} ({_shown(recorded['benchmark'])})")
    if as_json:
        print(json.dumps(results, indent=2))


@results_app.command("list")
def results_list(
    as_json: JsonOpt = False,
    stage: Annotated[str | None, typer.Option(help="only this stage")] = None,
    flow: Annotated[str | None, typer.Option(help="only this flow")] = None,
    status: Annotated[str | None, typer.Option(help="running, finished or failed")] = None,
    limit: Annotated[int, typer.Option(min=0, help="newest N runs (0 = all)")] = 50,
) -> None:
    """Runs, newest first. Filters that match nothing (an unknown stage or flow) list nothing."""
    from storage.models import RUN_STATUSES

    if status is not None and status not in RUN_STATUSES:
        fail(f"unknown --status {status!r}; use one of {', '.join(RUN_STATUSES)}", code=2)
    repo = repo_root()
    rows = store_call(lambda: repo.list_runs(stage=stage, flow=flow, status=status, limit=limit or None))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("id", "flow", "stage", "technique", "dataset", "status", "started", "secs", "mlflow run")
    for r in rows:
        colour = {"finished": "green", "failed": "red"}.get(r["status"], "yellow")
        table.add_row(
            _cell(r["id"][:12]),
            _cell(r["flow"]),
            _cell(r["stage"]),
            _cell(r["technique"]),
            _cell(r["dataset"]),
            Text(r["status"], style=colour),
            _cell((r["started_at"] or "")[:19]),
            _secs(r["duration_s"]),
            _cell(r["mlflow_run_id"]),
        )
    Console().print(table)


@results_app.command("show")
def results_show(
    run_id: Annotated[str, typer.Argument(help="run id or a unique prefix")], as_json: JsonOpt = False
) -> None:
    """One run with its metrics, privacy ledger, MPC costs, attack results and child runs."""
    repo = repo_root()
    data = store_call(lambda: repo.get_run(run_id))
    if as_json:
        print(json.dumps(data, indent=2))
        return
    out = Console()
    out.print(
        Text.assemble(
            (data["id"], "bold"),
            _literal(
                f"  {data['flow']}/{data['stage']}/{data['technique']}  dataset={data['dataset']}  "
                f"status={data['status']}  mlflow={data['mlflow_run_id']}"
            ),
        )
    )
    if data["error"]:
        out.print(Text.assemble(("error", "red"), ": ", _literal(data["error"])))
    for section in ("metrics", "privacy_ledger", "mpc_costs", "attack_results", "datasets", "children"):
        rows = data[section]
        if section == "datasets":
            rows = [
                {k: d[k] for k in ("name", "n_users", "n_items", "n_interactions", "content_hash", "path")}
                for d in rows
            ]
        if rows:
            table = Table(*rows[0].keys(), title=section)
            for row in rows:
                table.add_row(*(_cell(v) for v in row.values()))
            out.print(table)


@results_app.command("query")
def results_query(
    sql: Annotated[str, typer.Argument(help="one read-only SQL statement")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="table, csv or json")] = "table",
    as_json: Annotated[bool, typer.Option("--json", help="same as --format json")] = False,
) -> None:
    """Run read-only SQL against the store, e.g. ``select technique, count(*) from runs group by 1``.

    ``--format csv`` and ``--format json`` write to stdout (pipe them into pandas, jq or a spreadsheet)."""
    fmt = "json" if as_json else fmt
    if fmt not in ("table", "csv", "json"):
        fail(f"--format must be table, csv or json, got {fmt!r}", code=2)
    repo = repo_root()
    columns, rows = store_call(lambda: repo.query(sql))
    if fmt == "json":
        print(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], indent=2, default=str))
    elif fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(["" if v is None else v for v in row] for row in rows)
    else:
        table = Table(*(escape(str(c)) for c in columns))
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        Console().print(table)


@results_app.command("export")
def results_export(
    fmt: Annotated[str, typer.Option("--format", "-f", help="csv (gzip-compressed) or parquet")] = "csv",
    out: Annotated[Path, typer.Option("--out", "-o", help="output folder")] = Path("privbench-export"),
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            "-p",
            help="only what the report of this profile reads (its runs, the bench and peer runs its claims read, "
            "the paper profile's stage runs); default: the whole store",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write every table of the store to ``OUT/<table>.csv.gz`` (or ``.parquet``) with ``OUT/manifest.json`` (schema
    revision, profiles, commits, row counts, checksums): all a report needs, deterministic (the same store gives
    the same bytes). ``privbench results restore OUT`` loads it into an empty store; ``privbench report --from
    OUT`` renders a report from it."""
    from storage.archive import export_store

    if fmt not in ("csv", "parquet"):
        fail(f"--format must be csv or parquet, got {fmt!r}", code=2)
    try:
        done = store_call(lambda: export_store(out, fmt, profile=profile))  # type: ignore[arg-type]
    except OSError as exc:
        where = exc.filename if exc.filename is not None else out
        fail(
            f"cannot write the export to {str(where)!r}: {exc.strerror or exc}; pass --out a folder you can "
            "create and write to (e.g. --out ./privbench-export)"
        )
    if as_json:
        print(json.dumps(done.manifest, indent=2))
    rows = ", ".join(f"{n} {t['rows']}" for n, t in done.manifest["tables"].items())
    size = sum(p.stat().st_size for p in done.files)
    err.print(_literal(f"wrote {len(done.files)} files ({size / 1024:.0f} KiB) to {out}: {rows}"))


@results_app.command("restore")
def results_restore(
    src: Annotated[Path, typer.Argument(help="a folder written by `privbench results export`")],
    db: Annotated[
        str | None, typer.Option("--db", help="the empty store to load it into (default: PRIVBENCH_DB_URL)")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Load an export (``privbench results export``) into an empty results store, all or nothing: the store
    behind a committed report (``docs/results/data/<profile>/``) becomes one to query, browse or report on."""
    from storage.archive import restore_store

    if not src.is_dir():
        fail(f"{src} is not a folder; give the folder `privbench results export --out DIR` wrote", code=2)
    counts = store_call(lambda: restore_store(src, db))
    if as_json:
        print(json.dumps(counts, indent=2))
    err.print(_literal(f"restored {src}: " + ", ".join(f"{n} {t}" for t, n in counts.items())))


@results_app.command("reap")
def results_reap(
    older_than: Annotated[
        float | None,
        typer.Option(
            "--older-than",
            metavar="SECONDS",
            help="a run of another host (or of an unknown process) is stale after this long without a heartbeat; "
            "default PRIVBENCH_STALE_AFTER_SECONDS or 600. A run whose process is gone from this host is stale "
            "at once; one whose process still runs here never is",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Mark ``failed`` the runs left ``running`` by a killed process or a lost host (store and MLflow), with the
    reason; their Prefect flow runs are set Crashed when PREFECT_API_URL names a server. Every flow start does
    the same."""
    from storage.recovery import reap_stale_runs

    if older_than is not None and older_than < 0:
        fail(f"--older-than must be >= 0 seconds, got {older_than:g}", code=2)
    stale = store_call(lambda: reap_stale_runs(older_than))
    crashed = 0
    flow_runs = {s.prefect_flow_run_id for s in stale if s.prefect_flow_run_id}
    if flow_runs and os.environ.get("PREFECT_API_URL"):
        from tasks.records import end_prefect_flow_runs

        try:
            crashed = end_prefect_flow_runs(flow_runs, "Crashed: reaped by `privbench results reap`")
        except Exception as exc:  # noqa: BLE001 -- the store is already right; say what was left undone
            err.print(Text(f"note: could not set the Prefect flow runs Crashed ({type(exc).__name__}: {exc})"))
    rows = [
        {
            "run_id": s.run_id,
            "flow": s.flow,
            "stage": s.stage,
            "reason": s.reason,
            "prefect_flow_run_id": s.prefect_flow_run_id,
        }
        for s in stale
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            err.print(Text(f"reaped {r['run_id'][:12]} ({r['flow']}/{r['stage']}): {r['reason']}"))
    err.print(
        Text(
            f"{len(rows)} stale run(s) marked failed"
            + (f"; {crashed} Prefect flow run(s) set Crashed" if crashed else "")
        )
    )


# ------------------------------------------------------------------------------------------------ helpers


def repo_root():
    from storage.repository import ResultsRepository

    return ResultsRepository()


def store_call(fn):
    try:
        return fn()
    except PrivbenchError as exc:
        fail(str(exc))


def fail(message: str, code: int = 1) -> None:
    """Print ``message`` literally (redacted) as the error and exit with ``code``."""
    err.print(Text.assemble(("error", "bold red"), ": ", _literal(message)), highlight=False)
    raise typer.Exit(code)
