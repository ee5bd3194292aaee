"""``privbench run`` as a user sees it: one clean message for a data error (the traceback only when debugging)
after the line of each run that ended, and an unreachable store reported before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.privbench_process import privbench_process

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "PRIVBENCH_"))}
    base |= {
        "PRIVBENCH_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
    return privbench_process(args, base | env, timeout=900)


@pytest.fixture
def bad_data_config(tmp_path: Path) -> Path:
    data = tmp_path / "ratings.dat"
    data.write_text("1::2::5::978300760\n1::3::4::978300761\nthis is not a rating line\n")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(
        f"profile: tiny\nprepare:\n  datasets:\n    - {{name: bad, source: file, format: ml-1m, path: '{data}'}}\n"
    )
    return cfg


def test_a_data_error_is_one_clean_message(tmp_path: Path, bad_data_config: Path) -> None:
    out = run_cli(tmp_path, "run", "prepare", "-c", str(bad_data_config))
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "Finished in state" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    # before it, one line per run that ended (not a terminal: no live display), with its error's first line
    assert len(lines) == 4, text
    assert re.fullmatch(
        r"\[1/2\]  prepare  seqrec-prep  bad  failed  \d+\.\ds  \(DataError: .*ratings\.dat:3: "
        r"expected 4 fields .*\)",
        lines[0],
    ), text
    assert re.fullmatch(r"\[2/2\]  prepare  flow  failed  \d+\.\ds  \(.*DataError: .*\)", lines[1]), text
    assert lines[-2:] == [
        (
            f"error: flow prepare failed: {tmp_path / 'ratings.dat'}:3: expected 4 fields "
            "'UserID::MovieID::Rating::Timestamp', got 'this is not a rating line'"
        ),
        "(failed runs: `privbench results list --status failed`; set PRIVBENCH_DEBUG=1 for the traceback)",
    ], text


def test_debugging_shows_the_traceback(tmp_path: Path, bad_data_config: Path, prefect_harness: None) -> None:
    from prefect.settings import get_current_settings

    # the session's Prefect API (the test above starts the command's own temporary one, as a user's run does)
    api = str(get_current_settings().api.url)
    out = run_cli(tmp_path, "run", "prepare", "-c", str(bad_data_config), PRIVBENCH_DEBUG="1", PREFECT_API_URL=api)
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr and "DataError" in out.stderr


def test_an_unreachable_store_is_reported_before_anything_starts(tmp_path: Path) -> None:
    # nothing listens on port 1; the URL carries a password that must not be shown
    out = run_cli(tmp_path, "run", "prepare", PRIVBENCH_DB_URL="postgresql+psycopg://bob:hunter2@127.0.0.1:1/privbench")
    assert out.returncode == 1
    assert "cannot reach the results store at postgresql+psycopg://bob:***@127.0.0.1:1/privbench" in out.stderr
    assert "hunter2" not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    # no Prefect API was started (it would have created its database) and no flow ran
    assert not (tmp_path / "prefect" / "prefect.db").exists()
    assert not (tmp_path / "home" / "mlflow.db").exists()


def test_the_temporary_api_server_leaves_other_prefect_servers_of_the_process_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefect keeps one server per port in a class-level table; a command run in-process (a notebook, a test
    under ``prefect_test_harness``) must neither reuse nor stop the server that table already holds."""
    from prefect.server.api.server import SubprocessASGIServer

    from privbench.supervisor import prefect_api

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    # a session's test harness may hold the table's default entry: this test's server must not be that one
    monkeypatch.delitem(SubprocessASGIServer._instances, None, raising=False)
    real_popen = subprocess.Popen
    outer = SubprocessASGIServer()
    outer.start()
    try:
        with prefect_api() as mine:
            assert mine is not outer and mine.server_process.pid != outer.server_process.pid
            assert os.getsid(mine.server_process.pid) == mine.server_process.pid  # a session of its own
            assert subprocess.Popen is real_popen  # passed to its Popen, not patched into the module
        assert mine.server_process is None  # stopped
        assert outer.server_process is not None and outer.server_process.poll() is None  # still serving
        assert SubprocessASGIServer() is outer
    finally:
        outer.stop()
