"""The command line through Typer's runner, and Ctrl-C on a real `privbench run` process."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from typer.testing import CliRunner

from privbench.cli import app
from storage.recording import record_run

runner = CliRunner()
LIST_KEYS = {"id", "flow", "stage", "technique", "dataset", "status", "mlflow_run_id", "started_at", "finished_at"}


def fill_store() -> str:
    with record_run(
        flow="train-dp", stage="train-dp", technique="dpformer", config={"epsilon": 8}, dataset="ml-100k"
    ) as rec:
        rec.metric("ndcg_at_10", 0.03, unit="fraction")
        rec.privacy(epsilon=7.9, delta=1e-6, noise_multiplier=1.1, sample_rate=0.01, steps=100, accountant="rdp")
    return rec.run_id


def test_results_list_and_show_json(home: Path) -> None:
    run_id = fill_store()
    result = runner.invoke(app, ["results", "list", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert LIST_KEYS <= set(row) and row["id"] == run_id and row["status"] == "finished"
    shown = json.loads(runner.invoke(app, ["results", "show", run_id[:10], "--json"]).stdout)
    assert shown["metrics"] == [{"name": "ndcg_at_10", "value": 0.03, "step": None, "unit": "fraction"}]
    assert shown["privacy_ledger"][0]["epsilon"] == 7.9
    assert shown["mpc_costs"] == [] and shown["attack_results"] == []
    human = runner.invoke(app, ["results", "show", run_id])
    assert human.exit_code == 0 and "ndcg_at_10" in human.stdout


def test_results_query_and_export(home: Path, tmp_path: Path) -> None:
    fill_store()
    result = runner.invoke(app, ["results", "query", "select technique, count(*) as n from runs group by 1", "--json"])
    assert json.loads(result.stdout) == [{"technique": "dpformer", "n": 1}]
    bad = runner.invoke(app, ["results", "query", "drop table runs"])
    assert bad.exit_code == 1 and "query failed" in bad.stderr
    out = tmp_path / "export"
    done = runner.invoke(app, ["results", "export", "--format", "parquet", "--out", str(out)])
    assert done.exit_code == 0 and (out / "runs.parquet").is_file()
    assert runner.invoke(app, ["results", "export", "--format", "xlsx"]).exit_code == 2


def test_show_unknown_run_is_a_clear_error(home: Path) -> None:
    result = runner.invoke(app, ["results", "show", "deadbeef"])
    assert result.exit_code == 1 and "no run with id 'deadbeef'" in result.stderr


def test_run_refuses_bad_input_before_anything_runs(home: Path) -> None:
    result = runner.invoke(app, ["run", "prepare", "--set", "prepare.datasets.0.min_interactions=-3"])
    assert result.exit_code == 2
    assert "prepare.datasets.0.min_interactions = -3" in result.stderr
    result = runner.invoke(app, ["run", "prepare", "--set", "prepare.nope=1"])
    assert result.exit_code == 2 and "unknown key 'nope' under prepare; known keys: datasets" in result.stderr
    result = runner.invoke(app, ["run", "train-everything"])
    known = "prepare, train-dp, tangent, secure-inference"
    assert result.exit_code == 2 and f"unknown flow 'train-everything'; known flows: {known}" in result.stderr
    assert runner.invoke(app, ["run", "prepare", "--profile", "huge"]).exit_code == 2
    assert not (home / "results.db").exists()  # nothing ran, nothing was written


def test_ui_prints_a_loopback_command_for_the_configured_store(home: Path, mlflow_uri: str) -> None:
    result = runner.invoke(app, ["ui", "--print", "--port", "5123"])
    assert result.exit_code == 0
    assert "--host 127.0.0.1 --port 5123" in result.stdout and mlflow_uri in result.stdout


@pytest.mark.usefixtures("prefect_harness")
def test_run_prepare_through_the_cli(home: Path, tmp_path: Path, mlflow_uri: str) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text("profile: tiny\nprepare:\n  datasets:\n    - {name: ml-100k, source: recbole-ml100k}\n")
    result = runner.invoke(app, ["run", "prepare", "--config", str(config)])
    assert result.exit_code == 0, result.output
    runs = json.loads(runner.invoke(app, ["results", "list", "--json", "--flow", "prepare"]).stdout)
    flow_row = next(r for r in runs if r["technique"] == "flow")
    assert flow_row["status"] == "finished" and flow_row["mlflow_run_id"]
    mlflow.set_tracking_uri(mlflow_uri)
    found = mlflow.search_runs(
        search_all_experiments=True, filter_string=f"attributes.run_id = '{flow_row['mlflow_run_id']}'"
    )
    assert len(found) == 1 and found.iloc[0]["tags.privbench.profile"] == "tiny"


@pytest.mark.system
def test_ctrl_c_marks_the_run_failed_not_running(tmp_path: Path) -> None:
    """A real `privbench run` process interrupted mid-flow leaves failed (interrupted) rows, none running."""
    home = tmp_path / ".privbench"
    env = os.environ | {"PRIVBENCH_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    env.pop("PRIVBENCH_DB_URL", None)
    # ML-1M at full scale takes long enough to interrupt while its task runs
    cmd = [sys.executable, "-m", "privbench", "run", "prepare", "--profile", "paper"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _running_rows(home / "results.db"):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.2)
        assert _running_rows(home / "results.db"), "the flow never started"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr.decode()[-2000:]
    with sqlite3.connect(home / "results.db") as conn:
        statuses = conn.execute("select technique, status, error from runs").fetchall()
    assert not [s for s in statuses if s[1] == "running"], statuses
    flow_row = next(s for s in statuses if s[0] == "flow")
    assert flow_row[1] == "failed" and "interrupted" in flow_row[2]


def _running_rows(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db, timeout=1) as conn:
            return conn.execute("select count(*) from runs where status = 'running'").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_ui_serves_the_store_on_loopback(home: Path, mlflow_uri: str, tmp_path: Path) -> None:
    """`privbench ui` really starts MLflow on 127.0.0.1 and shows the runs privbench recorded."""
    import socket

    run_id = fill_store()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "privbench", "ui", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        body = _poll(
            f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/runs/search",
            proc,
            data=json.dumps({"experiment_ids": _experiment_ids(mlflow_uri)}).encode(),
        )
        assert run_id in body
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _experiment_ids(uri: str) -> list[str]:
    return [e.experiment_id for e in mlflow.MlflowClient(uri).search_experiments()]


def _poll(url: str, proc: subprocess.Popen, data: bytes) -> str:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else "ui exited"
        try:
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError(f"MLflow UI did not answer at {url}")
