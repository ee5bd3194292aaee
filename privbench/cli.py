"""The ``privbench`` command line: run the benchmark's Prefect flows, record them in the results store and
MLflow, and query the results. Machine-readable output (``--json``) goes to stdout; progress, tables and hints
go to stderr, so ``privbench results list --json | jq`` always works.

Everything shown is shown literally (user values are never read as Rich markup) and with the passwords of URLs
redacted (``core.redact``)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from core.errors import ConfigError, PrivbenchError
from core.redact import redact_url
from pbconfig.settings import get_settings
from pbconfig.stages import FLOW_NAMES
from privbench.display import cell as _cell
from privbench.display import literal as _literal
from privbench.display import seconds as _secs
from privbench.display import shown as _shown
from privbench.display import verdict_table
from privbench.results_cli import JsonOpt, err, fail, repo_root, results_app, store_call

PROFILE_HELP = (
    "run profile (configs/<name>.yaml): quick (every stage in minutes, CI), reference (models really trained, 3 "
    "seeds, under 2 h on 2 cores) or paper (paper scale); `privbench bench` takes quick or paper"
)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=" ".join(__doc__.split("\n\n")[0].split()),
    pretty_exceptions_enable=False,
)
app.add_typer(results_app, name="results")

ProfileOpt = Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP)]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="a YAML config file instead of the profile")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="override one value: key=value (repeatable)")]


def main() -> None:
    app()


@app.command()
def run(
    flow: Annotated[str, typer.Argument(help=f"which flow: {', '.join(FLOW_NAMES)} (benchmark: the whole chain)")],
    profile: ProfileOpt = "quick",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="also show the libraries' warnings and progress bars (hidden by default), and one "
            "line per run instead of the live display",
        ),
    ] = False,
) -> None:
    """Run a stage flow (or the whole ``benchmark`` chain) and record it in the store and MLflow.

    On a terminal a live display shows the stage, the runs done of those planned, the runs in progress, the time
    so far and an estimate of the time left; elsewhere (CI, a pipe) one line per run as it ends."""
    from flows.registry import FLOWS
    from pbconfig.benchmark import load_config

    if flow not in FLOWS:
        fail(f"unknown flow {flow!r}; known flows: {', '.join(FLOWS)}", code=2)
    try:
        cfg = load_config(profile, config_file=config, overrides=tuple(set_ or ()))
    except ConfigError as exc:
        fail(str(exc), code=2)
    from privbench.progress import LiveView, PlainView, Progress
    from privbench.supervisor import FlowFailed, Interrupted, hide_third_party_warnings, run_supervised

    progress = Progress(flow)
    debug = bool(os.environ.get("PRIVBENCH_DEBUG"))
    if not (verbose or debug):
        hide_third_party_warnings()
    live = err.is_terminal and not err.is_dumb_terminal and not verbose and not debug
    view = (
        LiveView(progress, err, f"privbench run {flow} (profile {cfg.profile})") if live else PlainView(progress, err)
    )
    try:
        summary = run_supervised(
            flow, cfg, echo=lambda line: err.print(_literal(line), highlight=False), view=view, verbose=verbose
        )
    except Interrupted as exc:
        # everything is recorded; leave now rather than wait on library threads and finalizers
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(143 if exc.signame == "SIGTERM" else 130)
    except FlowFailed as exc:
        kind = f"{exc.kind}: " if exc.kind else ""
        hint = "" if os.environ.get("PRIVBENCH_DEBUG") else "; set PRIVBENCH_DEBUG=1 for the traceback"
        fail(f"flow {flow} failed: {kind}{exc}\n(failed runs: `privbench results list --status failed`{hint})")
    except PrivbenchError as exc:  # the store is unreachable, a bad setting: before anything ran
        fail(str(exc))
    _print_summary(flow, summary)


@app.command()
def bench(
    name: Annotated[str, typer.Argument(help="benchmark name (see `privbench bench --list`)")] = "",
    profile: ProfileOpt = "quick",
    as_json: JsonOpt = False,
    list_: Annotated[bool, typer.Option("--list", help="list the benchmarks")] = False,
    max_batch_mem_mb: Annotated[
        float | None,
        typer.Option(
            "--max-batch-mem-mb",
            help="dp-clipping, paper profile: max-batch search memory cap (MB), 0 skips",
        ),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option(
            "--methods",
            help="mpc-generation: comma-separated methods to run (default: all)",
        ),
    ] = None,
    no_record: Annotated[
        bool,
        typer.Option(
            "--no-record",
            help="measure without the results store or MLflow (a GPU worker that cannot reach them); record the "
            "--json output later with `privbench results import-bench FILE`",
        ),
    ] = False,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="override one setting (repeatable): mpc-generation secure_inference.KEY=VALUE, e.g. "
            "secure_inference.n_layer=4 or secure_inference.methods=vanilla,merge; recbole-sasrec recbole.KEY=VALUE, "
            "e.g. recbole.seed=1 or recbole.epochs=2; dp-clipping dp_clipping.settings=recsys|large_vocab, "
            "dp_clipping.parts=rounds|search, dp_clipping.max_batch_mem_mb=MB",
        ),
    ] = None,
) -> None:
    """Micro-benchmarks: ratios measured side by side in one run (interleaved, medians), plus absolutes."""
    from privbench.bench import BENCHMARKS, run_benchmark
    from privbench.bench.harness import resolve_benchmark

    if list_ or not name:
        for key, spec in BENCHMARKS.items():
            err.print(f"[cyan]{_shown(key)}[/]: {_shown(spec.description)}")
        return
    if name not in BENCHMARKS:
        fail(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}", code=2)
    options: dict[str, object] = {} if max_batch_mem_mb is None else {"max_batch_mem_mb": max_batch_mem_mb}
    if methods:
        options["methods"] = tuple(m.strip() for m in methods.split(",") if m.strip())
    if set_:
        if "overrides" not in BENCHMARKS[name].options:
            takers = [k for k, s in BENCHMARKS.items() if "overrides" in s.options]
            fail(f"benchmark {name} takes no --set overrides; --set works for: {', '.join(takers)}", code=2)
        options["overrides"] = tuple(set_)
    try:
        resolve_benchmark(name, profile, options)  # a bad profile, option or --set: refused before anything runs
    except ConfigError as exc:
        fail(str(exc), code=2)
    try:
        result = run_benchmark(name, profile=profile, progress=err, record=not no_record, **options)
    except PrivbenchError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        err.print_json(json.dumps(result))


@app.command("paper-queue")
def paper_queue(
    budget_s: Annotated[
        float, typer.Option("--budget-s", min=1, help="seconds this call may take in all (one lent call: <= 600)")
    ] = 540.0,
    device: Annotated[str, typer.Option("--device", help="auto (cuda where torch sees a GPU), cuda or cpu")] = "auto",
    list_: Annotated[bool, typer.Option("--list", help="what is measured (where, which commit), what is left")] = False,
    out: Annotated[Path, typer.Option("--out", help="the committed results folder")] = Path("docs/results/raw"),
    queue_file: Annotated[Path | None, typer.Option("--queue", help="default: configs/queue/paper.yaml")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Advance the paper-scale queue: run the next benches not yet measured on this device kind, each in its own
    process under its own time limit, and write each finished one's JSON under OUT/<device kind>/
    (docs/paper-queue.md)."""
    from pbconfig.paper_queue import load_queue
    from privbench.paper_queue import RAW_DIR, device_kind, queue_status, resolve_device, run_queue

    try:
        queue = load_queue(queue_file)
        resolved = resolve_device(device)
    except ConfigError as exc:
        fail(str(exc), code=2)
    if list_:
        rows = queue_status(queue, root=out, device=resolved)
        if as_json:
            print(json.dumps(rows, indent=2))
            return
        table = Table(title=f"paper queue ({_shown(str(out))}; expected on {resolved})")
        for column in ("item", "bench", "measured on (commit)", "expected"):
            table.add_column(column)
        for row in rows:
            where = (
                row.get("error")
                or ", ".join(f"{d['device_kind']} ({(d['commit'] or '?')[:7]})" for d in row["done"])
                or "left"
            )
            expected = row.get("expected_s")
            shown = f"{expected:.0f} s" if expected else f"unmeasured (limit {row.get('time_limit_s', 0):.0f} s)"
            table.add_row(_shown(row["item"]), _shown(row["bench"]), _shown(where), shown)
        from rich.console import Console

        Console().print(table)
        return
    try:
        outcomes = run_queue(
            queue,
            budget_s=budget_s,
            device=resolved,
            root=out,
            kind=device_kind(resolved),
            seen=[RAW_DIR] if out.resolve() != RAW_DIR.resolve() else [],
            log=lambda line: err.print(_literal(line), highlight=False),
        )
    except ConfigError as exc:
        fail(str(exc), code=2)
    if as_json:
        print(json.dumps([o.__dict__ for o in outcomes], indent=2))
    if any(o.status == "failed" for o in outcomes):
        raise typer.Exit(1)


@app.command()
def report(
    profile: Annotated[str | None, typer.Option("--profile", "-p", help="judge the runs of this profile")] = "quick",
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="the Markdown file (default docs/results/<profile>.md)")
    ] = None,
    root: Annotated[str | None, typer.Option("--root", help="only this run and its descendants (one chain)")] = None,
    figures: Annotated[bool, typer.Option("--figures/--no-figures", help="draw the stage figures")] = True,
    source: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="render from this export (`privbench results export`, e.g. docs/results/data/<profile>) instead "
            "of the results store",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The papers' claims judged from the results store: one table per paper (claim, the paper's value, ours with
    a 95% interval, the verdict and its rule), the stage figures and where the numbers come from, as Markdown
    with the figures in a folder beside it. The registry is configs/claims/*.yaml. With --from, the store is an
    export loaded into a temporary SQLite store: the committed data behind a committed report renders it again."""
    from contextlib import nullcontext

    from storage.archive import restored
    from tasks.report import render_report

    if source is not None and not source.is_dir():
        fail(f"--from {source} is not a folder; give one written by `privbench results export --out DIR`", code=2)
    target = out or Path("docs") / "results" / f"{profile or 'all'}.md"

    def render() -> Any:
        with restored(source) if source is not None else nullcontext(None) as db_url:
            return render_report(target, profile=profile, root=root, figures=figures, db_url=db_url)

    try:
        result = store_call(render)
    except (ConfigError, ValueError) as exc:
        fail(str(exc), code=2)
    table = result.table
    if as_json:
        print(table.to_json(orient="records", indent=2))
    err.print(verdict_table(table))
    counts = ", ".join(f"{n} {v}" for v, n in result.counts.items())
    err.print(_literal(f"{counts}; wrote {target} ({len(result.figures)} figures in {target.with_suffix('')}/)"))


HostOpt = Annotated[str, typer.Option(help="interface to bind (keep 127.0.0.1 unless you mean it)")]
PrintOpt = Annotated[bool, typer.Option("--print", help="only print the command")]


def _serve_or_print(name: str, cmd: list[str], *, host: str, port: int, print_only: bool, env: dict[str, str]) -> None:
    """With ``--print``, print the server command ``cmd`` (passwords redacted); else say where ``name`` serves and
    replace this process by ``cmd``, with ``env`` added to the environment."""
    shown = redact_url(shlex.join(cmd))  # the real command keeps the tracking store's password
    if print_only:
        print(shown)
        return
    err.print(_literal(f"{name} on http://{host}:{port}  (Ctrl-C stops)\n  {shown}"))
    os.execvpe(cmd[0], cmd, os.environ | env)


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="port on 127.0.0.1")] = 5000,
    host: HostOpt = "127.0.0.1",
    print_only: PrintOpt = False,
) -> None:
    """Start the MLflow UI on the configured tracking store (or print the command with --print)."""
    cmd = mlflow_ui_command(port=port, host=host)
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    _serve_or_print("MLflow UI", cmd, host=host, port=port, print_only=print_only, env=env)


NamesOpt = Annotated[list[str] | None, typer.Option("--only", help="only this deployment (repeatable)")]
PoolOpt = Annotated[list[str] | None, typer.Option("--pool", help="only deployments of this work pool (repeatable)")]
SpecOpt = Annotated[Path | None, typer.Option("--file", help="the deployment file (default: deploy/prefect.yaml)")]


@app.command()
def serve(
    only: NamesOpt = None,
    pool: PoolOpt = None,
    schedules: Annotated[
        bool, typer.Option("--schedules/--no-schedules", help="attach the cron schedules of the deployment file")
    ] = True,
    spec_file: SpecOpt = None,
) -> None:
    """Serve the deployments of deploy/prefect.yaml on this machine, schedules included (Ctrl-C stops).

    Runs start in subprocesses of this command when their schedule fires or when triggered from the Prefect UI
    or ``prefect deployment run NAME``. Without PREFECT_API_URL, start a server first (``prefect server start``)
    so that the schedules and runs outlive this process."""
    from privbench import deployments as d

    try:
        path = spec_file or d.DEFAULT_SPEC
        deps = d.select(d.load_spec(path), only or (), pool or ())
    except ConfigError as exc:
        fail(str(exc), code=2)
    for dep in deps:
        crons = ", ".join(s["cron"] for s in dep.get("schedules") or ()) if schedules else ""
        err.print(
            f"serving [cyan]{_shown(dep['name'])}[/] ({_shown(dep['entrypoint'])})"
            f"{'  cron ' + _shown(crons) if crons else ''}"
        )
    d.serve(deps, schedules=schedules, echo=lambda message: err.print(_literal(message)))


@app.command()
def deploy(
    only: NamesOpt = None,
    pool: PoolOpt = None,
    spec_file: SpecOpt = None,
    repo: Annotated[
        Path | None,
        typer.Option(
            "--repo", help="the repository checkout path on the worker hosts (default: PRIVBENCH_REPO or this one)"
        ),
    ] = None,
    zombie_after: Annotated[
        float | None,
        typer.Option(
            "--zombie-after",
            metavar="SECONDS",
            help="mark a flow run Crashed after this long without a heartbeat (its worker host died), so that it can "
            "be retried; default 3 heartbeat periods (PREFECT_FLOWS_HEARTBEAT_FREQUENCY); 0 disables",
        ),
    ] = None,
) -> None:
    """Register the deployments of deploy/prefect.yaml on the Prefect server at PREFECT_API_URL, creating the
    process work pools they use; then start workers with ``prefect worker start --pool cpu`` (and ``gpu``)."""
    from privbench import deployments as d

    try:
        url = d.require_server()
        within = d.zombie_window(zombie_after)
        path = spec_file or d.DEFAULT_SPEC
        deps = d.select(d.load_spec(path), only or (), pool or ())
        created = d.ensure_work_pools(dep["work_pool"]["name"] for dep in deps)
        d.register(path, deps, repo=repo)
        zombie = d.ensure_zombie_automation(within)
    except ConfigError as exc:
        fail(str(exc), code=2)
    for name in created:
        err.print(f"created work pool [cyan]{_shown(name)}[/] (type process)")
    for dep in deps:
        flow_name = dep["entrypoint"].rsplit(":", 1)[1].replace("_", "-")
        err.print(
            f"deployed [cyan]{_shown(flow_name)}/{_shown(dep['name'])}[/] -> pool {_shown(dep['work_pool']['name'])}"
        )
    if zombie in {"created", "updated"}:
        err.print(f"{zombie} automation [cyan]{d.ZOMBIE_AUTOMATION}[/] (after {within:g} s without a heartbeat)")
    elif zombie == "disabled":
        err.print(f"disabled automation [cyan]{d.ZOMBIE_AUTOMATION}[/]")
    err.print(
        f"registered {len(deps)} deployment(s) on {_shown(url)}. Start workers from the repository root:\n"
        "  prefect worker start --pool cpu --type process\n  prefect worker start --pool gpu --type process"
    )


@app.command()
def dashboard(
    port: Annotated[int, typer.Option(help="port")] = 8501,
    host: HostOpt = "127.0.0.1",
    print_only: PrintOpt = False,
) -> None:
    """Start the Streamlit dashboard over the results store (links go to the MLflow UI of ``privbench ui``)."""
    cmd = dashboard_command(port=port, host=host)
    env = {"STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    _serve_or_print("dashboard", cmd, host=host, port=port, print_only=print_only, env=env)


def dashboard_command(*, port: int, host: str) -> list[str]:
    import dashboards

    app_file = Path(dashboards.__file__).resolve().with_name("app.py")
    return [
        str(Path(sys.executable).with_name("streamlit")),
        "run",
        str(app_file),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
    ]


def mlflow_ui_command(*, port: int, host: str) -> list[str]:
    settings = get_settings()
    mlflow_bin = str(Path(sys.executable).with_name("mlflow"))
    cmd = [
        mlflow_bin,
        "ui",
        "--backend-store-uri",
        settings.tracking_uri,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    if settings.tracking_is_default:
        cmd += ["--default-artifact-root", settings.artifact_root.as_uri()]
    return cmd


# ------------------------------------------------------------------------------------------------ helpers


def _print_summary(flow: str, summary: dict[str, Any]) -> None:
    settings = get_settings()
    repo = repo_root()
    rows = repo.list_runs(limit=None)
    ids = {summary["run_id"]}
    mine = []
    for r in reversed(rows):  # oldest first: parents precede children
        if r["id"] in ids or r["parent_id"] in ids:
            ids.add(r["id"])
            mine.append(r)
    table = Table("run", "stage", "technique", "dataset", "status", "secs", title=f"flow {_shown(flow)}")
    for r in mine:
        table.add_row(
            *(_cell(v) for v in (r["id"][:12], r["stage"], r["technique"], r["dataset"], r["status"])),
            _secs(r["duration_s"]),
        )
    err.print(table)
    err.print(
        Text.assemble(
            ("done", "green"),
            _literal(
                f". Results store: {settings.db_url}\n"
                f"  MLflow tracking: {settings.tracking_uri}\n"
                f"  list runs:      privbench results list\n"
                f"  this flow run:  privbench results show {summary['run_id'][:12]}\n"
                f'  query:          privbench results query "select name, value from metrics limit 20"\n'
                f"  MLflow UI:      privbench ui   (then open http://127.0.0.1:5000)"
            ),
        )
    )
