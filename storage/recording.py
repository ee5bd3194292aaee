"""The one recording API every task uses: a results-store row and an MLflow run, opened and closed together.

    with record_run(flow="prepare", stage="data", technique="seqrec-prep", config=spec,
                    dataset="ml-100k", parent=flow_ref) as rec:
        rec.metric("n_users", 943, unit="users")
        rec.privacy(epsilon=8.0, delta=1e-6, ...)
        rec.artifact_json("stats.json", stats)

On entry the run row is committed as ``running`` and the MLflow run created (params = the flattened
config; tags = store run id, Prefect ids, git commit, dataset hash). Everything recorded inside is
buffered; on a clean exit it is written in ONE transaction together with ``status='finished'``, and
logged to MLflow. On any exception (KeyboardInterrupt included) the buffer is dropped, the row becomes
``failed`` with the error, the MLflow run ends FAILED (KILLED when interrupted), and the exception
propagates: a failed run never leaves partial metrics.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select, update

from core.dp.accounting import PrivacyLedger as SpentPrivacy
from core.errors import ConfigError, DataError, StoreError
from core.redact import redact_url
from pbconfig import __version__
from pbconfig.canon import canonical_json, config_hash, flatten
from pbconfig.settings import get_settings
from storage import liveness, provenance
from storage.db import session_scope
from storage.measured import Measured, canonical_mapping
from storage.models import AttackResult, Dataset, Metric, MpcCost, PrivacyLedger, Run
from storage.tracking import Tracker

_ATTACK_FIELDS = frozenset(c.name for c in AttackResult.__table__.columns) - {"id", "run_id", "extra_json"}
_METRIC_NAME = re.compile(r"[\w\-. :/]{1,250}")
_open_runs: dict[str, tuple[RunRef, str]] = {}  # run id -> (handle, store URL) of the rows this process holds
_open_lock = threading.RLock()
_trackers: dict[tuple[str, str | None], Tracker] = {}
PROGRESS_FILE_ENV = "PRIVBENCH_PROGRESS_FILE"  # set by `privbench run` for its flow process (privbench.progress)


@dataclass(frozen=True)
class RunRef:
    """A picklable handle on a recorded run, passed between tasks to nest child runs under it."""

    run_id: str
    mlflow_run_id: str | None
    flow: str
    stage: str
    profile: str | None = None
    tracked: bool = True
    scope: str | None = None  # the root Prefect flow run: a retry of it may reuse this run's completed tasks

    @classmethod
    def of_row(cls, run_id: str, mlflow_run_id: str | None, flow: str, stage: str, profile: str | None) -> RunRef:
        """The handle on a stored row (crash recovery: a run another process opened); tracked where it has an MLflow
        run."""
        return cls(run_id, mlflow_run_id, flow, stage, profile, mlflow_run_id is not None)


@dataclass
class Recorder:
    """What a running task records into; flushed atomically when the ``record_run`` block exits."""

    ref: RunRef
    finished_at: datetime | None = None  # a measured run's own finish (``Measured``); None: when it is flushed
    _metrics: list[Metric] = field(default_factory=list)
    _rows: list[Any] = field(default_factory=list)
    _json: dict[str, Any] = field(default_factory=dict)
    _files: list[tuple[Path, str | None]] = field(default_factory=list)
    _tags: dict[str, str] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.ref.run_id

    def metric(self, name: str, value: float, *, step: int | None = None, unit: str | None = None) -> None:
        if not _METRIC_NAME.fullmatch(name):
            raise ConfigError(
                f"metric name {name!r} may only contain letters, digits, _ - . : / and spaces "
                "(the same name goes to MLflow); e.g. 'ndcg_at_10' instead of 'ndcg@10'"
            )
        value = float(value)
        if not math.isfinite(value):
            raise DataError(f"metric {name!r} has non-finite value {value}; fix the computation or skip it")
        self._metrics.append(Metric(name=name, value=value, step=step, unit=unit))

    def metrics(
        self, values: Mapping[str, float], *, step: int | None = None, units: Mapping[str, str] | None = None
    ) -> None:
        for name, value in values.items():
            self.metric(name, value, step=step, unit=(units or {}).get(name))

    def mpc_cost(
        self,
        *,
        op_category: str,
        party: int,
        seconds: float,
        bytes: int,
        rounds: int,
        phase: str | None = None,
        calls: int | None = None,
    ) -> None:
        self._rows.append(
            MpcCost(
                op_category=op_category,
                party=party,
                seconds=float(seconds),
                bytes=int(bytes),
                rounds=int(rounds),
                phase=phase,
                calls=calls,
            )
        )

    def privacy(
        self,
        *,
        epsilon: float,
        delta: float,
        noise_multiplier: float,
        sample_rate: float,
        steps: int,
        accountant: str,
        clip_norm: float | None = None,
        target_epsilon: float | None = None,
        unit: str | None = None,
        neighbouring: str | None = None,
    ) -> None:
        """One ledger row: what the accountant spent, for which protected ``unit`` and ``neighbouring`` relation
        (``"add/remove"``: datasets differing by one unit more or less; ``"replace"``: by one unit swapped)."""
        self._rows.append(
            PrivacyLedger(
                epsilon=epsilon,
                delta=delta,
                noise_multiplier=noise_multiplier,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
                clip_norm=clip_norm,
                target_epsilon=target_epsilon,
                unit=unit,
                neighbouring=neighbouring,
            )
        )

    def ledger(self, spent: SpentPrivacy, *, unit: str, neighbouring: str) -> None:
        """The ledger row of a private training run from its accountant's record (``core.dp.accounting``): what it
        spent, the mechanism's parameters, the protected ``unit`` ("user", "example") and the ``neighbouring``
        relation its sampling gives (Poisson sampling: ``"add/remove"``). The one way a task writes the ledger."""
        self.privacy(
            epsilon=spent.epsilon,
            delta=spent.delta,
            noise_multiplier=spent.noise_multiplier,
            sample_rate=spent.sample_rate,
            steps=spent.steps,
            accountant=str(spent.accountant),
            clip_norm=spent.clip_norm,
            target_epsilon=spent.target_epsilon,
            unit=unit,
            neighbouring=neighbouring,
        )

    def attack(self, *, attack: str, target: str, extra: Mapping[str, Any] | None = None, **values: Any) -> None:
        unknown = set(values) - _ATTACK_FIELDS
        if unknown:
            raise ConfigError(
                f"unknown attack-result fields {sorted(unknown)}; known: {sorted(_ATTACK_FIELDS)} "
                "(put anything else in extra=)"
            )
        self._rows.append(
            AttackResult(
                attack=attack, target=target, extra_json=json.dumps(extra, default=str) if extra else None, **values
            )
        )

    def dataset(
        self,
        *,
        name: str,
        content_hash: str,
        cache_key: str,
        path: str,
        source: str,
        stats: Mapping[str, Any],
        kind: str = "seqrec",
    ) -> None:
        """A prepared dataset (``kind="seqrec"``: ``stats`` holds n_users/n_items/n_interactions; ``"images"``:
        n_examples; ``"model"``: a converted pretrained model, n_parameters)."""

        def count(key: str) -> int | None:
            return int(stats[key]) if key in stats else None

        if kind == "seqrec" and any(count(k) is None for k in ("n_users", "n_items", "n_interactions")):
            raise DataError(f"a seqrec dataset needs n_users, n_items and n_interactions in stats, got {sorted(stats)}")
        self._rows.append(
            Dataset(
                name=name,
                content_hash=content_hash,
                cache_key=cache_key,
                path=path,
                source=source,
                kind=kind,
                n_examples=count("n_examples") if kind != "seqrec" else count("n_users"),
                n_users=count("n_users"),
                n_items=count("n_items"),
                n_interactions=count("n_interactions"),
                stats_json=json.dumps(dict(stats), sort_keys=True),
                created_at=_now(),
            )
        )
        self._tags["privbench.dataset_hash"] = content_hash

    def artifact_json(self, name: str, obj: Any) -> None:
        self._json[name] = obj

    def artifact_file(self, path: Path | str, artifact_path: str | None = None) -> None:
        self._files.append((Path(path), artifact_path))

    def tag(self, key: str, value: str) -> None:
        self._tags[key] = str(value)


def get_tracker() -> Tracker:
    settings = get_settings()
    root = settings.artifact_root if settings.tracking_is_default else None
    key = (settings.tracking_uri, str(root) if root else None)
    if key not in _trackers:
        _trackers[key] = Tracker(settings.tracking_uri, root)
    return _trackers[key]


def start_run(
    *,
    flow: str,
    stage: str,
    technique: str,
    config: BaseModel | Mapping[str, Any],
    dataset: str | None = None,
    profile: str | None = None,
    parent: RunRef | None = None,
    run_name: str | None = None,
    prefect_flow_run_id: str | None = None,
    prefect_task_run_id: str | None = None,
    track: bool = True,
    measured: Measured | None = None,
) -> Recorder:
    """Commit a ``running`` row and create its MLflow run; close it with ``finish_run`` or ``fail_run``.
    ``measured``: a run measured elsewhere, recorded with that machine's times, commit, host and device.

    Prefer ``record_run`` (a context manager over these two) wherever the work fits in one block; the
    explicit pair is for runs that span several tasks, like a flow's parent run.
    """
    settings = get_settings()
    cfg_json, cfg_hash, params = _describe(config)
    run_id = uuid.uuid4().hex
    profile = profile or (parent.profile if parent else None)
    # the same five params on every run, whatever its config, so MLflow's compare view lines up any runs
    params = {
        "run.flow": flow,
        "run.stage": stage,
        "run.technique": technique,
        "run.dataset": dataset or "",
        "run.profile": profile or "",
    } | params
    row = Run(
        id=run_id,
        parent_id=parent.run_id if parent else None,
        flow=flow,
        stage=stage,
        technique=technique,
        dataset=dataset,
        profile=profile,
        status="running",
        config_json=cfg_json,
        config_hash=cfg_hash,
        started_at=measured.started_at if measured else _now(),
        prefect_flow_run_id=prefect_flow_run_id,
        prefect_task_run_id=prefect_task_run_id,
        git_commit=measured.git_commit if measured else provenance.git_commit(),
        host=measured.host if measured else provenance.host(),
        device=measured.device if measured else provenance.device(),
        privbench_version=__version__,
    )
    row.pid, row.pid_started = liveness.this_process()
    row.heartbeat_at = _now() if measured else row.started_at
    with session_scope(settings.db_url) as session:
        session.add(row)
    if run_name:
        _announce(run_id, run_name)
    ref = RunRef(run_id, None, flow, stage, profile, track)
    try:
        if track:
            exp_id, mlflow_run_id = get_tracker().start_run(
                stage=stage,
                run_name=run_name or f"{technique}:{dataset or flow}",
                params=params,
                tags=_tags(row, parent),
                parent_mlflow_run_id=parent.mlflow_run_id if parent else None,
            )
            ref = RunRef(run_id, mlflow_run_id, flow, stage, profile, track)
            with session_scope(settings.db_url) as session:
                session.execute(
                    update(Run).where(Run.id == run_id).values(mlflow_run_id=mlflow_run_id, mlflow_experiment_id=exp_id)
                )
    except BaseException as exc:
        fail_run(ref, exc)
        raise
    with _open_lock:
        _open_runs[run_id] = (ref, settings.db_url)
    _heartbeat.ensure_started()
    return Recorder(ref=ref, finished_at=measured.finished_at if measured else None)


def _announce(run_id: str, run_name: str) -> None:
    """Append the run's name to the progress file of the ``privbench run`` command this process works for (one
    JSON line in one ``write``: the lines of several processes do not interleave); nothing without one."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    line = json.dumps({"run": run_id, "name": run_name[:200]}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:  # a display's loss, never the run's
        pass


def _held() -> dict[str, str]:
    with _open_lock:
        return {run_id: url for run_id, (_ref, url) in _open_runs.items()}


def _release(run_ids: Any) -> None:
    with _open_lock:
        for run_id in run_ids:
            _open_runs.pop(run_id, None)


_heartbeat = liveness.Heartbeat(_held, _release)


def finish_run(recorder: Recorder) -> None:
    """Log the buffered results to MLflow, then commit them with ``status='finished'`` in one transaction."""
    ref = recorder.ref
    try:
        _finish(get_settings().db_url, recorder, get_tracker() if ref.tracked else None)
    except BaseException as exc:
        fail_run(ref, exc)
        raise
    with _open_lock:
        _open_runs.pop(ref.run_id, None)


def fail_run(ref: RunRef, error: BaseException | str) -> None:
    """Mark the run failed (store row and MLflow run) with the error; nothing it buffered is written."""
    with _open_lock:
        _open_runs.pop(ref.run_id, None)
    _fail(get_settings().db_url, ref, error, get_tracker() if ref.tracked and ref.mlflow_run_id else None)


@contextmanager
def record_run(**kwargs: Any) -> Iterator[Recorder]:
    """``start_run(**kwargs)``; ``finish_run`` on a clean exit, ``fail_run`` on any exception (re-raised)."""
    recorder = start_run(**kwargs)
    try:
        yield recorder
    except BaseException as exc:
        fail_run(recorder.ref, exc)
        raise
    finish_run(recorder)


def fail_open_runs(reason: str) -> list[str]:
    """Mark every run this process still holds open as failed (Ctrl-C, SIGTERM). Returns their ids."""
    with _open_lock:
        pending = dict(_open_runs)
        _open_runs.clear()
    for ref, _url in pending.values():
        fail_run(ref, KeyboardInterrupt(reason))
    return list(pending)


# ---------------------------------------------------------------------------------------------- internals


def _describe(config: BaseModel | Mapping[str, Any]) -> tuple[str, str, dict[str, str]]:
    if isinstance(config, BaseModel):
        return canonical_json(config), config_hash(config), flatten(config)
    tree, text, digest = canonical_mapping(config)
    return text, digest, flatten(tree)


def _tags(row: Run, parent: RunRef | None) -> dict[str, str]:
    tags = {
        "privbench.run_id": row.id,
        "privbench.flow": row.flow,
        "privbench.stage": row.stage,
        "privbench.technique": row.technique,
        "privbench.config_hash": row.config_hash,
        "privbench.host": row.host or "",
        "privbench.device": row.device or "",
        "privbench.version": row.privbench_version or "",
    }
    optional = {
        "privbench.dataset": row.dataset,
        "privbench.profile": row.profile,
        "privbench.parent_run_id": parent.run_id if parent else None,
        "prefect.flow_run_id": row.prefect_flow_run_id,
        "prefect.task_run_id": row.prefect_task_run_id,
        "mlflow.source.git.commit": row.git_commit,
        "privbench.git_commit": row.git_commit,
    }
    tags.update({k: v for k, v in optional.items() if v})
    return tags


def _finish(db_url: str, rec: Recorder, tracker: Tracker | None) -> None:
    run_id, mlflow_run_id = rec.ref.run_id, rec.ref.mlflow_run_id
    if tracker is not None and mlflow_run_id is not None:
        tracker.log_metrics(mlflow_run_id, [(m.name, m.value, m.step) for m in rec._metrics])
        if rec._tags:
            tracker.set_tags(mlflow_run_id, rec._tags)
        for name, obj in rec._json.items():
            tracker.log_json(mlflow_run_id, name, obj)
        for path, artifact_path in rec._files:
            tracker.log_file(mlflow_run_id, path, artifact_path)
    finished = rec.finished_at or _now()
    with session_scope(db_url) as session:
        started = session.scalar(select(Run.started_at).where(Run.id == run_id))
        for obj in [*rec._metrics, *rec._rows]:
            obj.run_id = run_id
            session.add(obj)
        result = session.execute(
            update(Run)
            .where(Run.id == run_id, Run.status == "running")
            .values(status="finished", finished_at=finished, duration_s=_seconds(started, finished))
        )
        if result.rowcount != 1:
            raise StoreError(f"run {run_id} was no longer 'running' when it finished (marked failed meanwhile?)")
    if tracker is not None and mlflow_run_id is not None:
        tracker.end_run(mlflow_run_id, "FINISHED")


def _fail(db_url: str, ref: RunRef, exc: BaseException | str, tracker: Tracker | None) -> None:
    interrupted = isinstance(exc, KeyboardInterrupt | SystemExit)
    if isinstance(exc, str):
        error = exc
    else:
        text = str(exc) or type(exc).__name__
        error = (
            (text if text.startswith("interrupted") else f"interrupted: {text}")
            if interrupted
            else f"{type(exc).__name__}: {exc}"
        )
    error = redact_url(error)  # e.g. an MLflow client error quotes its server's URL, password and all
    finished = _now()
    ended_elsewhere = False
    try:
        with session_scope(db_url) as session:
            started, status = session.execute(select(Run.started_at, Run.status).where(Run.id == ref.run_id)).one()
            result = session.execute(
                update(Run)
                .where(Run.id == ref.run_id, Run.status == "running")
                .values(
                    status="failed", error=error[:20000], finished_at=finished, duration_s=_seconds(started, finished)
                )
            )
            # already finished or failed (by a reaper, an interrupt, another process): its MLflow run is final
            ended_elsewhere = result.rowcount == 0 and status != "running"
    except Exception as store_exc:  # noqa: BLE001 -- never mask the run's own error
        _note(exc, f"privbench: could not mark run {ref.run_id} failed in the store: {store_exc}")
    if tracker is not None and ref.mlflow_run_id is not None and not ended_elsewhere:
        try:
            tracker.set_tags(ref.mlflow_run_id, {"privbench.error": error[:5000]})
            tracker.end_run(ref.mlflow_run_id, "KILLED" if interrupted else "FAILED")
        except Exception as ml_exc:  # noqa: BLE001 -- never mask the run's own error
            _note(exc, f"privbench: could not mark MLflow run {ref.mlflow_run_id} failed: {ml_exc}")


def _note(exc: BaseException | str, note: str) -> None:
    if isinstance(exc, BaseException):
        exc.add_note(note)
    else:
        warnings.warn(note, stacklevel=3)


def _seconds(started: datetime | None, finished: datetime) -> float | None:
    if started is None:
        return None
    if started.tzinfo is None:  # SQLite returns naive datetimes; they were written in UTC
        started = started.replace(tzinfo=UTC)
    return (finished - started).total_seconds()


def _now() -> datetime:
    return datetime.now(UTC)
