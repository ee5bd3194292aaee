"""A results store that cannot be written (a mounted copy of someone's PRIVBENCH_HOME): reading works, writing
fails with an error that names the path and the fix.

Root ignores file permissions, so when the tests run as root the reader runs as ``nobody`` (``setpriv``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from storage.db import dispose_engines, get_engine
from storage.recording import record_run

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
WRITE = """
from core.errors import StoreError
from storage.recording import start_run
try:
    start_run(flow="prepare", stage="data", technique="x", config={}, track=False)
except StoreError as exc:
    print(f"StoreError: {exc}")
"""


def as_reader(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``args`` as a user the store's permissions apply to (``nobody`` when we are root)."""
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: no way to run as a user file permissions apply to")
        args = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args]
    return subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def privbench(*args: str) -> list[str]:
    return [sys.executable, "-m", "privbench", *args]


@pytest.fixture
def read_only_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, dict[str, str]]]:
    """A home holding one finished run, then made read-only (folder 0555, files 0444); the reader's env."""
    base = Path(tempfile.mkdtemp(prefix="privbench-ro-"))  # not tmp_path: its parents are private to root
    base.chmod(0o755)
    home = base / ".privbench"
    reader_home = base / "reader"
    reader_home.mkdir(mode=0o777)
    reader_home.chmod(0o777)
    monkeypatch.setenv("PRIVBENCH_HOME", str(home))
    monkeypatch.delenv("PRIVBENCH_DB_URL", raising=False)
    with record_run(
        flow="prepare", stage="data", technique="seqrec-prep", config={"k": 1}, dataset="ml", track=False
    ) as rec:
        rec.metric("n_users", 943)
    dispose_engines()
    for lock in home.glob("*.lock"):  # a copy of a store brings the database, not our lock files
        lock.unlink()
    for path in home.iterdir():
        path.chmod(0o444)
    home.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIVBENCH_", "MLFLOW_", "PREFECT_"))}
    env |= {
        "PRIVBENCH_HOME": str(home),
        "HOME": str(reader_home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PREFECT_HOME": str(reader_home / ".prefect"),
        "NO_COLOR": "1",
        "COLUMNS": "200",
    }
    probe = as_reader([sys.executable, "-c", "import privbench.cli, storage.repository"], env)
    if probe.returncode != 0:
        pytest.skip(f"the unprivileged reader cannot import privbench here: {probe.stderr[-500:]}")
    try:
        yield home, env
    finally:
        home.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def test_read_only_home_lists_and_queries_runs(read_only_home: tuple[Path, dict[str, str]]) -> None:
    home, env = read_only_home
    before = sorted(p.name for p in home.iterdir())
    listed = as_reader(privbench("results", "list", "--json"), env)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout)
    assert [(r["technique"], r["status"]) for r in runs] == [("seqrec-prep", "finished")]
    queried = as_reader(privbench("results", "query", "select count(*) as n from runs", "--json"), env)
    assert queried.returncode == 0, queried.stderr
    assert json.loads(queried.stdout) == [{"n": 1}]
    shown = as_reader(privbench("results", "show", runs[0]["id"][:8], "--json"), env)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["metrics"][0]["name"] == "n_users"
    assert sorted(p.name for p in home.iterdir()) == before


def test_writing_a_read_only_home_fails_clearly(read_only_home: tuple[Path, dict[str, str]]) -> None:
    home, env = read_only_home
    out = as_reader([sys.executable, "-c", WRITE], env)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 0 and out.stdout.startswith("StoreError: "), (out.stdout, out.stderr)
    message = out.stdout
    assert str(home / "results.db") in message and "read-only" in message
    assert f"directory {home}" in message and "not writable" in message
    assert "PRIVBENCH_HOME" in message


def test_read_only_home_behind_the_schema_says_how_to_migrate(read_only_home: tuple[Path, dict[str, str]]) -> None:
    home, env = read_only_home
    home.chmod(0o755)
    (home / "results.db").chmod(0o644)
    engine = create_engine(f"sqlite:///{home / 'results.db'}")
    with engine.begin() as conn:
        conn.execute(text("update alembic_version set version_num = '0001'"))
    engine.dispose()
    (home / "results.db").chmod(0o444)
    home.chmod(0o555)
    out = as_reader(privbench("results", "list", "--json"), env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "read-only" in out.stderr and "migrat" in out.stderr and str(home / "results.db") in out.stderr


def test_store_at_the_newest_schema_is_opened_without_the_migration_lock(home: Path) -> None:
    """Reading needs no write access: at the newest revision no lock file is taken (or created)."""
    url = f"sqlite:///{home / 'results.db'}"
    get_engine(url)
    dispose_engines()
    lock = home / "results.db.migrate.lock"
    lock.unlink(missing_ok=True)
    get_engine(url)
    assert not lock.exists()
