"""No password of a store URL reaches the terminal, the logs, MLflow or the results store.

The end-to-end test runs a real tiny ``privbench run prepare`` in a subprocess against PostgreSQL with a
password in ``PRIVBENCH_DB_URL`` (the test server trusts loopback, so any password connects), then looks for
the password in stdout, stderr (Prefect's and privbench's logs included), every text column of the store, the
MLflow runs' params and tags, and every file the run wrote (the MLflow and Prefect databases, artifacts).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from core.redact import redact_url
from privbench import cli
from privbench.cli import app
from tests.conftest import postgres_url, reset_postgres
from tests.privbench_process import privbench_process

SECRET = "S3cretPw-xyz"
TINY = "profile: tiny\nprepare:\n  datasets:\n    - {name: ml-100k, source: recbole-ml100k}\n"
runner = CliRunner()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://privbench:S3cretPw-xyz@db:5432/runs", "postgresql://privbench:***@db:5432/runs"),
        (
            "postgresql+psycopg://u:S3cretPw-xyz@127.0.0.1/x?sslmode=require",
            "postgresql+psycopg://u:***@127.0.0.1/x?sslmode=require",
        ),
        ("http://user:S3cretPw-xyz@mlflow.lan:5000", "http://user:***@mlflow.lan:5000"),
        ("https://user:S3cret@Pw-xyz@mlflow.lan/api?x=1", "https://user:***@mlflow.lan/api?x=1"),
        (
            "postgresql://u@db/runs?password=S3cretPw-xyz&sslmode=disable",
            "postgresql://u@db/runs?password=***&sslmode=disable",
        ),
        (
            "postgresql://db/runs?sslmode=require&sslpassword=S3cretPw-xyz#top",
            "postgresql://db/runs?sslmode=require&sslpassword=***#top",
        ),
        ("http://mlflow.lan:5000/?api_key=S3cretPw-xyz", "http://mlflow.lan:5000/?api_key=***"),
        ("sqlite:////home/me/.privbench/results.db", "sqlite:////home/me/.privbench/results.db"),
        ("http://user@mlflow.lan:5000/", "http://user@mlflow.lan:5000/"),
        ("file:///data/a@b/mlruns", "file:///data/a@b/mlruns"),
        ("no url here: password=S3cretPw-xyz is plain text", "no url here: password=S3cretPw-xyz is plain text"),
        (
            "cannot reach 'mysql://root:S3cretPw-xyz@h/db' or http://a:S3cretPw-xyz@h now",
            "cannot reach 'mysql://root:***@h/db' or http://a:***@h now",
        ),
    ],
)
def test_redact_url_hides_passwords_of_any_scheme(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_ui_prints_a_redacted_command_but_runs_the_real_one(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"postgresql://mlflow:{SECRET}@db.lan:5432/mlflow"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    printed = runner.invoke(app, ["ui", "--print"])
    assert printed.exit_code == 0 and SECRET not in printed.output
    assert "postgresql://mlflow:***@db.lan:5432/mlflow" in printed.stdout
    execs: list[list[str]] = []
    monkeypatch.setattr(cli.os, "execvpe", lambda file, args, env: execs.append(args))
    started = runner.invoke(app, ["ui"])
    assert started.exit_code == 0 and SECRET not in started.output
    (args,) = execs
    assert args[args.index("--backend-store-uri") + 1] == uri


def test_summary_redacts_the_store_and_the_tracking_uri(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from storage.recording import record_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SECRET}@mlflow.lan:5000")
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as rec:
        pass
    cli._print_summary("prepare", {"run_id": rec.run_id})
    out = capsys.readouterr()
    assert "MLflow tracking: http://user:***@mlflow.lan:5000" in out.err
    assert SECRET not in out.out + out.err


def test_a_real_run_leaks_no_password(tmp_path: Path) -> None:
    store = _with_password(postgres_url())
    reset_postgres(store)
    env = _env(tmp_path, store)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    done = _privbench(["run", "prepare", "--config", str(config)], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert SECRET not in done.stdout + done.stderr
    assert "Results store: postgresql+psycopg://postgres:***@127.0.0.1" in done.stderr
    listed = _privbench(["results", "list", "--json"], env, tmp_path)
    runs = json.loads(listed.stdout)
    assert runs and all(r["status"] == "finished" for r in runs)
    assert SECRET not in listed.stderr
    assert not _store_cells_with(store, SECRET)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    mlflow_runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert {r.info.run_id for r in mlflow_runs} >= {r["mlflow_run_id"] for r in runs}
    for run in mlflow_runs:
        assert SECRET not in json.dumps([run.data.params, run.data.tags])
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_an_unreachable_store_error_shows_no_password(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a free port: nothing listens on it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = f"postgresql+psycopg://privbench:{SECRET}@127.0.0.1:{port}/privbench"
    env = _env(tmp_path, store)
    for args in (["results", "list"], ["run", "prepare"]):
        done = _privbench(args, env, tmp_path)
        assert done.returncode == 1, done.stderr[-3000:]
        assert SECRET not in done.stdout + done.stderr
        assert "error: " in done.stderr
        assert "cannot reach the results store at postgresql+psycopg://privbench:***@127.0.0.1" in done.stderr


def test_a_malformed_store_url_error_shows_no_password(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIVBENCH_DB_URL", f"postgres ql://privbench:{SECRET}@db.lan/privbench")
    result = runner.invoke(app, ["results", "list"])
    assert result.exit_code == 1 and "is not a database URL" in result.stderr
    assert SECRET not in result.output


# ------------------------------------------------------------------------------------------------ helpers


def _privbench(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """A real ``privbench`` process (its own Prefect server and logging), output captured."""
    return privbench_process(args, env, cwd=cwd, timeout=540)


def _with_password(url: str) -> str:
    parsed = make_url(url)
    return parsed.set(username=parsed.username or "postgres", password=SECRET).render_as_string(hide_password=False)


def _env(tmp_path: Path, store: str) -> dict[str, str]:
    env = os.environ | {
        "PRIVBENCH_HOME": str(tmp_path / ".privbench"),
        "PRIVBENCH_DB_URL": store,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_LOGGING_LEVEL": "INFO",
        "COLUMNS": "200",
    }
    for name in ("PREFECT_API_URL", "PRIVBENCH_DEBUG", "PRIVBENCH_DASK_ADDRESS"):
        env.pop(name, None)
    return env


def _store_cells_with(url: str, needle: str) -> list[tuple[str, str]]:
    """(table, column) of every text cell of the store that contains ``needle``."""
    engine = create_engine(url)
    try:
        found = []
        with engine.connect() as conn:
            tables = inspect(conn).get_table_names()
            assert "runs" in tables
            for table in tables:
                for column in inspect(conn).get_columns(table):
                    hit = conn.execute(
                        text(f'select count(*) from "{table}" where "{column["name"]}"::text like :n'),
                        {"n": f"%{needle}%"},
                    ).scalar()
                    if hit:
                        found.append((table, column["name"]))
        return found
    finally:
        engine.dispose()
