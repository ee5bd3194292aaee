"""MLflow adapter: one experiment per stage, explicit run ids through ``MlflowClient`` (never the fluent
``mlflow.start_run`` stack, so parallel tasks cannot log into each other's runs).

By default tracking goes to ``sqlite:///.privbench/mlflow.db`` with artifacts under
``.privbench/mlartifacts``; ``MLFLOW_TRACKING_URI`` (a file, database or ``http://`` server) wins.

MLflow creates its schema the first time a client opens a fresh SQLite file, with no guard against another
process doing the same; so that first open happens under a file lock next to the file
(``mlflow.db.init.lock``), the way ``storage.db`` serialises the results store's migrations.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from mlflow.entities import Metric as MlflowMetric
from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from core.errors import StoreError
from core.redact import redact_url
from storage.db import held

EXPERIMENT_PREFIX = "privbench"
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
_BATCH = 100  # MLflow's limit on params/tags per log_batch call
_sqlite_locks: dict[str, threading.RLock] = {}
_T = TypeVar("_T")

# MLflow announces its own schema migrations at INFO on every new store; keep our output clean
logging.getLogger("mlflow").setLevel(logging.WARNING)


def experiment_name(stage: str) -> str:
    return f"{EXPERIMENT_PREFIX}/{stage}"


class Tracker:
    """Thin, thread-safe wrapper over ``MlflowClient`` for privbench's runs."""

    def __init__(self, tracking_uri: str, artifact_root: Path | None = None) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root
        self._is_sqlite = tracking_uri.startswith("sqlite:")
        db_file = _sqlite_file(tracking_uri)
        if db_file is not None:
            db_file.parent.mkdir(parents=True, exist_ok=True)
        self._lock = _sqlite_locks.setdefault(tracking_uri, threading.RLock()) if self._is_sqlite else None
        with _first_init_lock(db_file):  # MlflowClient creates (migrates) the store's schema right here
            self.client = MlflowClient(tracking_uri=tracking_uri)
        self._experiments: dict[str, str] = {}

    # ---------------------------------------------------------------------------------------- runs
    def experiment_id(self, stage: str) -> str:
        name = experiment_name(stage)
        if name not in self._experiments:
            self._experiments[name] = self._call(lambda: self._get_or_create_experiment(name))
        return self._experiments[name]

    def start_run(
        self,
        *,
        stage: str,
        run_name: str,
        params: Mapping[str, str],
        tags: Mapping[str, str],
        parent_mlflow_run_id: str | None = None,
    ) -> tuple[str, str]:
        """Create a run (nested under ``parent_mlflow_run_id`` if given); returns (experiment id, run id)."""
        exp_id = self.experiment_id(stage)
        all_tags = dict(tags)
        if parent_mlflow_run_id:
            all_tags["mlflow.parentRunId"] = parent_mlflow_run_id
        run = self._call(lambda: self.client.create_run(exp_id, run_name=run_name, tags=all_tags))
        run_id = run.info.run_id
        items = [Param(k, _clip(v)) for k, v in params.items()]
        for i in range(0, len(items), _BATCH):
            chunk = items[i : i + _BATCH]
            self._call(lambda chunk=chunk: self.client.log_batch(run_id, params=chunk, synchronous=True))
        return exp_id, run_id

    def log_metrics(self, run_id: str, metrics: Iterable[tuple[str, float, int | None]]) -> None:
        now = int(time.time() * 1000)
        items = [MlflowMetric(name, float(value), now, int(step or 0)) for name, value, step in metrics]
        for i in range(0, len(items), 1000):
            chunk = items[i : i + 1000]
            self._call(lambda chunk=chunk: self.client.log_batch(run_id, metrics=chunk, synchronous=True))

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        items = [RunTag(k, _clip(str(v))) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH):
            chunk = items[i : i + _BATCH]
            self._call(lambda chunk=chunk: self.client.log_batch(run_id, tags=chunk, synchronous=True))

    def log_json(self, run_id: str, name: str, obj: Any) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
            self._call(lambda: self.client.log_artifact(run_id, str(path)))

    def load_json(self, run_id: str, name: str) -> Any | None:
        """The JSON artifact ``name`` of ``run_id``, wherever MLflow keeps it (a local directory, an MLflow server
        serving artifacts, object storage); None when the run or the artifact is missing or unreadable."""
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = self._call(lambda: self.client.download_artifacts(run_id, name, tmp))
                return json.loads(Path(path).read_text())
            except (MlflowException, OSError, ValueError):
                return None

    def log_file(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self._call(lambda: self.client.log_artifact(run_id, str(path), artifact_path))

    def end_run(self, run_id: str, status: str) -> None:
        self._call(lambda: self.client.set_terminated(run_id, status=status))

    def run_status(self, run_id: str) -> str:
        """``RUNNING``, ``FINISHED``, ``FAILED`` or ``KILLED``."""
        return self._call(lambda: self.client.get_run(run_id).info.status)

    # ------------------------------------------------------------------------------------ internals
    def _get_or_create_experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if self.artifact_root is not None:
            location = (self.artifact_root / name.replace("/", "-")).absolute().as_uri()
        try:
            exp_id = self.client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # created concurrently by another process
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise StoreError(
                    f"cannot create MLflow experiment {name!r} at {redact_url(self.tracking_uri)}: "
                    f"{redact_url(str(exc))}"
                ) from None
            return found.experiment_id
        self._enable_wal()
        return exp_id

    def _enable_wal(self) -> None:
        """WAL lets the MLflow UI read while flows write; it persists in the file once set."""
        if not self._is_sqlite:
            return
        path = self.tracking_uri.split(":///", 1)[1]
        conn = sqlite3.connect(path, timeout=60)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()

    def _call(self, fn: Callable[[], _T]) -> _T:
        """Serialise calls per SQLite file within a process and retry when another process holds the lock."""
        for attempt in range(8):
            try:
                if self._lock is None:
                    return fn()
                with self._lock:
                    return fn()
            except MlflowException as exc:
                if "locked" not in str(exc).lower() or attempt == 7:
                    raise
                time.sleep(0.25 * 2**attempt)
        raise AssertionError("unreachable")


def _sqlite_file(tracking_uri: str) -> Path | None:
    """The file of a ``sqlite:///path`` tracking URI; None for anything else (servers, in-memory)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri.split(":///", 1)[1].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path).expanduser()


def _initialised(db_file: Path) -> bool:
    """Whether MLflow has finished creating the store in ``db_file`` (its last step: experiment 0)."""
    if not db_file.is_file() or db_file.stat().st_size == 0:
        return False
    try:
        conn = sqlite3.connect(f"{db_file.absolute().as_uri()}?mode=ro", uri=True, timeout=60)
        try:
            return conn.execute("SELECT 1 FROM experiments WHERE experiment_id = 0").fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error:
        return False


@contextmanager
def _first_init_lock(db_file: Path | None) -> Iterator[None]:
    """Hold ``<db_file>.init.lock`` exclusively (across processes) while the block runs, unless the store is
    already initialised (the usual case: no lock, no lock file).

    On a read-only home the lock is opened read-only when it exists (flock needs no write access), and
    skipped when it cannot be created: nobody can create a store there, so there is nothing to serialise."""
    if db_file is None or _initialised(db_file):
        yield
        return
    lock_path = db_file.with_name(db_file.name + ".init.lock")
    try:
        handle = open(lock_path, "a")  # noqa: SIM115 -- closed by the with below
    except OSError:
        try:
            handle = open(lock_path)  # noqa: SIM115
        except OSError:
            yield
            return
    with held(handle):
        yield


def _clip(value: str) -> str:
    return value if len(value) <= MAX_PARAM_LEN else value[: MAX_PARAM_LEN - 14] + "...[truncated]"
