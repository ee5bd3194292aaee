"""Runs that never end: heartbeats, a real SIGKILL of the process that holds a run, and reaping by evidence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy import select, update

from storage import liveness, provenance, recording, recovery
from storage.db import session_scope
from storage.models import Run
from storage.recording import fail_run, finish_run, record_run, start_run
from storage.recovery import reap_stale_runs
from tests.privbench_process import privbench_process

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"lr": 0.01}

HOLDER = textwrap.dedent("""
    import sys, time
    import pbconfig
    from storage.recording import start_run
    rec = start_run(flow="train-dp", stage="train-dp", technique="dpformer", config={"lr": 0.01},
                    dataset="ml-100k", track=True)
    print(rec.run_id, flush=True)
    time.sleep(600)
""")


def row(url: str, run_id: str) -> Run:
    with session_scope(url) as s:
        return s.get(Run, run_id)


def hold_run_in_subprocess() -> tuple[subprocess.Popen[str], str]:
    """A real process that opens a tracked run and holds it (heartbeating) until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    run_id = proc.stdout.readline().strip()
    assert len(run_id) == 32, f"the holder printed {run_id!r}"
    return proc, run_id


def test_a_run_records_its_process_and_heartbeats(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(liveness.HEARTBEAT_ENV, "0.2")
    rec = start_run(flow="f", stage="s", technique="t", config=CONFIG, track=False)
    first = row(store_url, rec.run_id)
    assert first.pid == os.getpid() and first.host == provenance.host()
    assert first.pid_started == pytest.approx(liveness.process_started(os.getpid()), abs=0.01)
    liveness_now = first.heartbeat_at
    for _ in range(300):
        time.sleep(0.1)
        if row(store_url, rec.run_id).heartbeat_at != liveness_now:
            break
    assert row(store_url, rec.run_id).heartbeat_at > liveness_now, "no heartbeat within 30 s at a 0.2 s period"
    assert rec.run_id in recording._held()
    finish_run(rec)
    assert rec.run_id not in recording._held()  # a finished run is no longer beaten for


def test_sigkilled_holder_is_reaped_at_once_and_mlflow_says_failed(store_url: str, mlflow_uri: str) -> None:
    proc, run_id = hold_run_in_subprocess()
    try:
        assert liveness.find_stale(store_url) == []  # alive: never stale
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert row(store_url, run_id).status == "running"  # a SIGKILL leaves it: nothing ran in the process
    stale = reap_stale_runs()
    assert [s.run_id for s in stale] == [run_id]
    assert stale[0].reason == f"stale: its process {proc.pid} on {provenance.host()} is gone"
    done = row(store_url, run_id)
    assert done.status == "failed" and done.error == stale[0].reason and done.finished_at is not None
    mlflow_run = MlflowClient(mlflow_uri).get_run(done.mlflow_run_id)
    assert mlflow_run.info.status == "FAILED"
    assert mlflow_run.data.tags["privbench.error"] == stale[0].reason
    assert reap_stale_runs() == []  # idempotent


def test_alive_process_is_never_reaped_however_old_its_heartbeat(store_url: str) -> None:
    rec = start_run(flow="f", stage="s", technique="t", config=CONFIG, track=False)
    with session_scope(store_url) as s:
        s.execute(update(Run).where(Run.id == rec.run_id).values(heartbeat_at=datetime.now(UTC) - timedelta(days=3)))
    assert reap_stale_runs(older_than=0) == []
    finish_run(rec)


def test_reused_pid_counts_as_gone(store_url: str) -> None:
    rec = start_run(flow="f", stage="s", technique="t", config=CONFIG, track=False)
    with session_scope(store_url) as s:  # this PID, but "started" an hour before the process that has it now
        s.execute(update(Run).where(Run.id == rec.run_id).values(pid_started=Run.pid_started - 3600))
    assert [s.run_id for s in reap_stale_runs()] == [rec.run_id]


def test_other_hosts_runs_are_stale_only_after_the_window(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = start_run(flow="f", stage="s", technique="t", config=CONFIG, track=False)
    with session_scope(store_url) as s:
        s.execute(
            update(Run)
            .where(Run.id == rec.run_id)
            .values(host="elsewhere", heartbeat_at=datetime.now(UTC) - timedelta(seconds=120))
        )
    assert reap_stale_runs(older_than=300) == []
    monkeypatch.setenv(liveness.STALE_ENV, "60")
    stale = reap_stale_runs()  # the configured window: 60 s
    assert [s.run_id for s in stale] == [rec.run_id]
    assert "no heartbeat from process" in stale[0].reason and "on elsewhere for 12" in stale[0].reason


def test_rows_from_before_liveness_use_their_start(store_url: str) -> None:
    rec = start_run(flow="f", stage="s", technique="t", config=CONFIG, track=False)
    with session_scope(store_url) as s:
        s.execute(
            update(Run)
            .where(Run.id == rec.run_id)
            .values(pid=None, pid_started=None, heartbeat_at=None, started_at=datetime.now(UTC) - timedelta(hours=2))
        )
    stale = reap_stale_runs(older_than=3600)
    assert [s.run_id for s in stale] == [rec.run_id] and "for 7200 s" in stale[0].reason


def test_bad_stale_settings_are_refused_with_the_fix(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.errors import ConfigError

    monkeypatch.setenv(liveness.STALE_ENV, "ten minutes")
    with pytest.raises(ConfigError, match="PRIVBENCH_STALE_AFTER_SECONDS='ten minutes' is not a number"):
        reap_stale_runs()
    with pytest.raises(ConfigError, match="must be >= 0"):
        reap_stale_runs(older_than=-1)


def test_failing_a_finished_run_leaves_its_mlflow_run_finished(home: Path, mlflow_uri: str) -> None:
    """An interrupt that arrives after a run finished (or a late reaper) must not turn FINISHED into KILLED."""
    with record_run(flow="f", stage="s", technique="t", config=CONFIG) as rec:
        rec.metric("x", 1.0)
    fail_run(rec.ref, KeyboardInterrupt("interrupted (SIGINT)"))
    with session_scope(f"sqlite:///{home / 'results.db'}") as s:
        status, mlflow_run_id = s.execute(select(Run.status, Run.mlflow_run_id).where(Run.id == rec.run_id)).one()
    assert status == "finished"
    assert MlflowClient(mlflow_uri).get_run(mlflow_run_id).info.status == "FINISHED"


def test_a_row_failed_by_a_process_killed_before_it_ended_mlflow_gets_its_mlflow_run_ended(
    store_url: str, mlflow_uri: str
) -> None:
    """The race behind an interrupted command's MLflow run left RUNNING: the flow process marks a worker's row
    failed (SIGTERM), is SIGKILLed before it ends the MLflow run, and every later ``fail_run`` sees the row no longer
    ``running`` and leaves MLflow alone. The supervisor's last pass ends it."""
    proc, run_id = hold_run_in_subprocess()
    try:
        with session_scope(store_url) as s:  # what the killed process got as far as: the row, not MLflow
            s.execute(update(Run).where(Run.id == run_id).values(status="failed", error="interrupted (SIGINT)"))
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    mlflow_run_id = row(store_url, run_id).mlflow_run_id
    client = MlflowClient(mlflow_uri)
    assert client.get_run(mlflow_run_id).info.status == "RUNNING"
    fail_run(recording.RunRef(run_id, mlflow_run_id, "train-dp", "train-dp", None, True), "late")  # a no-op
    assert client.get_run(mlflow_run_id).info.status == "RUNNING"
    assert recovery.end_mlflow_runs_of_processes({proc.pid}) == [mlflow_run_id]
    ended = client.get_run(mlflow_run_id)
    assert ended.info.status == "KILLED" and ended.data.tags["privbench.error"] == "interrupted (SIGINT)"
    assert recovery.end_mlflow_runs_of_processes({proc.pid}) == []  # idempotent
    assert recovery.end_mlflow_runs_of_processes({proc.pid + 1}) == []  # only the given processes' rows


def test_results_reap_cli_after_a_real_sigkill(home: Path, mlflow_uri: str) -> None:
    proc, run_id = hold_run_in_subprocess()
    proc.kill()
    proc.wait(timeout=30)
    env = os.environ | {"PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    env.pop("PREFECT_API_URL", None)
    out = privbench_process(["results", "reap", "--json"], env)
    assert out.returncode == 0, out.stderr
    reaped = json.loads(out.stdout)
    assert [r["run_id"] for r in reaped] == [run_id] and "is gone" in reaped[0]["reason"]
    assert "1 stale run(s) marked failed" in out.stderr
    bad = privbench_process(["results", "reap", "--older-than", "-5"], env)
    assert bad.returncode == 2 and "--older-than must be >= 0 seconds, got -5" in bad.stderr
