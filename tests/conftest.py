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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that fills or reads the session's stage store ``integration``, so that e.g.
    ``pytest tests/storage -m 'not integration and not slow and not gpu and not system'`` runs the unit tests alone
    and no stage flow starts unasked."""
    for item in items:
        if STORE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


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
        return url
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide PostgreSQL through {PG_ENV} (.ci/run starts one)")
    pytest.skip(f"no PostgreSQL: set {PG_ENV}=postgresql+psycopg://user@127.0.0.1:5432/db to run this test")


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
