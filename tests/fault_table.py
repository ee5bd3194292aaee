"""The fault table of docs/operations.md, measured: signal x target x backend against a real
``privbench run train-dp`` whose process-pool workers are training.

    python -m tests.fault_table [--pg postgresql+psycopg://user@host:port/db] [--parallel 3]

For each cell a fresh command starts (its own PRIVBENCH_HOME, PREFECT_HOME and, on PostgreSQL, a database of its
own created next to the one given), is signalled once a grid point trains in a worker, and is then read back: rows
left ``running``, metrics rows of failed runs (partial results), the MLflow states of the failed runs, the exit
code and the seconds from the signal to the exit. After a SIGKILL the rows are left ``running`` by construction;
the table shows them, then what a rerun (a flow start, which reaps) leaves. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.flows.test_interrupts import HANG_S, PREPARE_ONLY, start

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
TARGETS = ("group", "main")


def rows(url: str) -> list[dict]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            runs = [dict(r._mapping) for r in conn.execute(text("select * from runs"))]
            partial = dict(
                conn.execute(
                    text(
                        "select r.id, count(m.id) from runs r join metrics m on m.run_id = r.id "
                        "where r.status = 'failed' group by r.id"
                    )
                ).all()
            )
        for r in runs:
            r["partial_metrics"] = partial.get(r["id"], 0)
        return runs
    finally:
        engine.dispose()


def cell_name(signum: int, target: str, pg: str | None) -> str:
    return f"{signal.Signals(signum).name.lower()}-{target}-{'pg' if pg else 'sqlite'}"


def cell(base: Path, signum: int, target: str, pg: str | None, index: int) -> dict:
    name = cell_name(signum, target, pg)
    home = base / name
    url = f"sqlite:///{home / 'results.db'}"
    if pg:
        db = f"privbench_fault_{index}"
        admin = create_engine(pg, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {db}"))
            conn.execute(text(f"CREATE DATABASE {db}"))
        admin.dispose()
        url = pg.rsplit("/", 1)[0] + "/" + db
    c = start(name, base, home=home, extra_env={"PRIVBENCH_DB_URL": url} if pg else None)
    c.wait_until_training()
    t0 = time.monotonic()
    if target == "group":
        os.killpg(c.proc.pid, signum)
    else:
        c.proc.send_signal(signum)
    try:
        code = c.proc.wait(timeout=HANG_S)
        seconds = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        code, seconds = None, None
        os.killpg(c.proc.pid, signal.SIGKILL)
    survivors = c.survivors(within=15)
    after = rows(url)
    left = sum(r["status"] == "running" for r in after)
    failed = [r for r in after if r["status"] == "failed"]
    states = sorted({c.mlflow_status(r["mlflow_run_id"]) for r in failed if r["mlflow_run_id"]})
    reaped = None
    if left:
        rerun = start(
            f"{name}-rerun", base, PREPARE_ONLY, home=home, extra_env={"PRIVBENCH_DB_URL": url} if pg else None
        )
        rerun.proc.wait(timeout=900)
        again = rows(url)
        reaped = {
            "left": sum(r["status"] == "running" for r in again),
            "mlflow": sorted(
                {c.mlflow_status(r["mlflow_run_id"]) for r in again if r["status"] == "failed" and r["mlflow_run_id"]}
            ),
        }
    return {
        "signal": signal.Signals(signum).name,
        "target": target,
        "backend": "PostgreSQL" if pg else "SQLite",
        "exit": code,
        "seconds": seconds,
        "left_running": left,
        "failed": len(failed),
        "partial_metrics": sum(r["partial_metrics"] for r in failed),
        "mlflow": states,
        "survivors": survivors,
        "after_rerun": reaped,
        "prefect": c.prefect_states().get("train-dp"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pg", help="a PostgreSQL URL whose server may create databases (optional)")
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="only cells whose name (e.g. sigkill-main-sqlite) contains this (repeatable)",
    )
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="privbench-faults-"))
    backends = [None, args.pg] if args.pg else [None]
    jobs = [
        (s, t, pg)
        for pg in backends
        for s in SIGNALS
        for t in TARGETS
        if not args.only or any(o in cell_name(s, t, pg) for o in args.only)
    ]

    def one(ij: tuple[int, tuple]) -> dict:
        result = cell(base, *ij[1], index=ij[0])
        print(json.dumps(result, default=str), file=sys.stderr, flush=True)
        return result

    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(one, enumerate(jobs)))
    print(
        "| signal | target | backend | exit | s to exit | rows left running | after rerun | partial metrics "
        "| MLflow (failed runs) | Prefect flow run | processes left |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rerun = (
            "" if r["after_rerun"] is None else f"{r['after_rerun']['left']} ({', '.join(r['after_rerun']['mlflow'])})"
        )
        secs = "hung" if r["seconds"] is None else f"{r['seconds']:.1f}"
        print(
            f"| {r['signal']} | {r['target']} | {r['backend']} | {r['exit']} | {secs} | {r['left_running']} | "
            f"{rerun} | {r['partial_metrics']} | {', '.join(r['mlflow'])} | {r['prefect']} | "
            f"{len(r['survivors'])} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
