"""Shared fixtures: an isolated PRIVBENCH_HOME per test, one MLflow store per session (creating one costs
seconds), the results store on SQLite and (in CI, or when PRIVBENCH_TEST_PG_URL is set) PostgreSQL, and one
session-scoped Prefect test harness for the flow tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import pbconfig  # noqa: F401  - offline defaults before prefect/mlflow are imported

PG_ENV = "PRIVBENCH_TEST_PG_URL"
# fixtures that run real tiny stage flows (minutes, on first use in a session): a test using one is `integration`
STORE_FIXTURES = {"stage_store", "filled_store", "prefect_harness"}


# under pytest-xdist (``make test`` runs ``-n 2``), the tests that share one process-wide thing run on one worker:
# the session's stage store (filled once, by the worker that holds its tests) and the system tests (real servers,
# signals to process trees), each a group of its own
STAGE_STORE_FIXTURES = {"stage_store", "filled_store"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that fills or reads the session's stage store ``integration``, so that e.g.
    ``pytest tests/storage -m 'not integration and not slow and not gpu and not system'`` runs the unit tests alone
    and no stage flow starts unasked; and group, for pytest-xdist's ``--dist loadgroup``, the stage store's tests
    on one worker (so that it is filled once) and the system tests on one worker."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if STORE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.integration)
        if STAGE_STORE_FIXTURES & fixtures:
            item.add_marker(pytest.mark.xdist_group("stage-store"))
        elif item.get_closest_marker("system") is not None:
            item.add_marker(pytest.mark.xdist_group("system"))
    if getattr(config.option, "loadgroup", False):  # only a pytest-xdist worker under --dist loadgroup has it
        _suffix_groups(items)


def _suffix_groups(items: list[pytest.Item]) -> None:
    """Give each grouped test's node id the ``@<group>`` suffix pytest-xdist's ``loadgroup`` scheduler sends a group
    to one worker by. pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9 no longer reads (a node's id is
    ``item._id``), so without this every group was spread over the workers like any other test."""
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        if names and "@" not in item.nodeid.rsplit("]", 1)[-1]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker computes with its share of the cores (torch's default is all of them, and two workers
    each spinning every core's thread slow each other down); a test that sets threads itself still does."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread (as the stages' workers run, ``threads_per_worker``: 1; tiny models run fastest on it and
    the test machine's cores are shared); the count is restored afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_uri: str) -> Path:
    """A fresh PRIVBENCH_HOME with its own SQLite results store; MLflow shared for the session."""
    monkeypatch.setenv("PRIVBENCH_HOME", str(tmp_path / ".privbench"))
    monkeypatch.delenv("PRIVBENCH_DB_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return tmp_path / ".privbench"


def postgres_url() -> str:
    """The CI PostgreSQL URL; outside CI a missing server skips with a reason, in CI it fails."""
    url = os.environ.get(PG_ENV)
    if url:
        return _worker_database(url)
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide PostgreSQL through {PG_ENV} (.ci/run starts one)")
    pytest.skip(f"no PostgreSQL: set {PG_ENV}=postgresql+psycopg://user@127.0.0.1:5432/db to run this test")


_WORKER_DATABASES: set[str] = set()


def _worker_database(url: str) -> str:
    """``url`` itself, or under pytest-xdist a database of this worker's own beside it (``<db>_gw0``, created on
    first use), so that one worker's ``reset_postgres`` never drops the schema another worker's test is using."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = make_url(url)
    name = f"{base.database}_{worker}"
    if name not in _WORKER_DATABASES:
        engine = create_engine(base, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            if conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).scalar() is None:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        _WORKER_DATABASES.add(name)
    return base.set(database=name).render_as_string(hide_password=False)


def reset_postgres(url: str) -> None:
    from sqlalchemy import create_engine, text

    from storage.db import dispose_engines, normalize_url

    dispose_engines()
    engine = create_engine(normalize_url(url))
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The results store under test, exported as PRIVBENCH_DB_URL: SQLite, then PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{home / 'results.db'}"
    else:
        url = postgres_url()
        reset_postgres(url)
    monkeypatch.setenv("PRIVBENCH_DB_URL", url)
    yield url
    from storage.db import dispose_engines

    dispose_engines()


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One ephemeral Prefect API for the whole session (starting one costs ~15 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.filled_store import FilledStore, StageStore


@pytest.fixture(scope="session")
def stage_store(tmp_path_factory: pytest.TempPathFactory, prefect_harness: None) -> StageStore:
    """The session's results store (and MLflow store), filled one stage at a time on first use by real tiny runs
    of the stage flows (see ``tests/filled_store.py``): a flow test reads its stage's run with
    ``stage_store.summary(stage)`` and points privbench at the store with ``stage_store.point_at(monkeypatch)``,
    so no flow runs twice in a session."""
    from tests.filled_store import StageStore

    return StageStore(tmp_path_factory.mktemp("filled"))


@pytest.fixture(scope="session")
def filled_store(stage_store: StageStore) -> FilledStore:
    """The session's store with every stage flow and a tiny ``dp-clipping`` bench filled in. A ``FilledStore``
    with ``home``, ``db_url``, ``tracking_uri`` (and ``env``, ``flow_runs``); the environment is restored after
    filling, so set ``filled_store.env`` yourself where a test needs privbench pointed at it."""
    return stage_store.filled()
