"""Crash recovery: the ``running`` rows whose process is gone (stopped, killed, or a lost worker) marked ``failed``
in the store and MLflow, with the reason. ``storage.recording`` records runs; this module finds and ends the ones
another process left open (the supervisor of ``privbench run``, a flow's failure hooks, ``privbench results reap``).
"""

from __future__ import annotations

import warnings

from sqlalchemy import select

from pbconfig.settings import get_settings
from storage import liveness, provenance
from storage.db import session_scope
from storage.models import Run
from storage.recording import RunRef, fail_run, get_tracker


def fail_runs_of_processes(pids: set[int], reason: str, *, interrupted: bool = True) -> list[tuple[str, str | None]]:
    """Mark ``failed`` the ``running`` rows held by these processes of this host, e.g. a stopped command's flow
    process and its workers; ``interrupted``: stopped on purpose (MLflow ``KILLED``), else ``FAILED``. Returns
    (run id, Prefect flow-run id) of each."""
    if not pids:
        return []
    with session_scope(get_settings().db_url) as session:
        rows = session.execute(
            select(Run.id, Run.mlflow_run_id, Run.flow, Run.stage, Run.profile, Run.prefect_flow_run_id).where(
                Run.status == "running", Run.host == provenance.host(), Run.pid.in_(sorted(pids))
            )
        ).all()
    for run_id, mlflow_run_id, flow, stage, profile, _ in rows:
        fail_run(
            RunRef.of_row(run_id, mlflow_run_id, flow, stage, profile),
            KeyboardInterrupt(reason) if interrupted else reason,
        )
    return [(r[0], r[5]) for r in rows]


def end_mlflow_runs_of_processes(pids: set[int], *, interrupted: bool = True) -> list[str]:
    """Once these processes are gone: end the MLflow run of each of their ``failed`` rows that is still
    ``RUNNING`` (``KILLED`` if ``interrupted``, else ``FAILED``), with the row's error as ``privbench.error``.

    A process that marked a row failed and was killed before it ended the row's MLflow run (e.g. the flow process
    failing its workers' rows on SIGTERM, then SIGKILLed) leaves exactly that; ``_fail`` in another process then
    sees the row no longer ``running`` and leaves MLflow alone. Returns the MLflow run ids ended here."""
    if not pids:
        return []
    with session_scope(get_settings().db_url) as session:
        rows = session.execute(
            select(Run.mlflow_run_id, Run.error).where(
                Run.status == "failed",
                Run.host == provenance.host(),
                Run.pid.in_(sorted(pids)),
                Run.mlflow_run_id.is_not(None),
            )
        ).all()
    if not rows:
        return []
    tracker = get_tracker()
    ended = []
    for mlflow_run_id, error in rows:
        try:
            if tracker.run_status(mlflow_run_id) != "RUNNING":
                continue
            tracker.set_tags(mlflow_run_id, {"privbench.error": (error or "")[:5000]})
            tracker.end_run(mlflow_run_id, "KILLED" if interrupted else "FAILED")
        except Exception as exc:  # noqa: BLE001 -- a missing or unreachable run: the rest still get ended
            warnings.warn(f"privbench: could not end MLflow run {mlflow_run_id}: {exc}", stacklevel=2)
            continue
        ended.append(mlflow_run_id)
    return ended


def reap_stale_runs(older_than: float | None = None) -> list[liveness.Stale]:
    """Mark ``failed`` every stale ``running`` row of the store (its process gone, or no heartbeat for
    ``older_than`` seconds; see ``storage.liveness``), store and MLflow (``FAILED``), with the reason."""
    stale = liveness.find_stale(get_settings().db_url, older_than=older_than)
    for s in stale:
        fail_run(RunRef.of_row(s.run_id, s.mlflow_run_id, s.flow, s.stage, s.profile), s.reason)
    return stale


def running_prefect_flow_runs() -> list[str]:
    """The Prefect flow-run ids of the rows still ``running`` (to reconcile with Prefect after a lost worker)."""
    with session_scope(get_settings().db_url) as session:
        return sorted(
            session.scalars(
                select(Run.prefect_flow_run_id)
                .distinct()
                .where(Run.status == "running", Run.prefect_flow_run_id.is_not(None))
            )
        )


def fail_runs_of_prefect_flow(prefect_flow_run_id: str, error: str | BaseException) -> int:
    """Mark still-running rows of a Prefect flow run failed, store and MLflow (flow on_failure/on_crashed hooks)."""
    with session_scope(get_settings().db_url) as session:
        rows = session.execute(
            select(Run.id, Run.mlflow_run_id, Run.flow, Run.stage, Run.profile).where(
                Run.prefect_flow_run_id == prefect_flow_run_id, Run.status == "running"
            )
        ).all()
    for run_id, mlflow_run_id, flow, stage, profile in rows:
        fail_run(RunRef.of_row(run_id, mlflow_run_id, flow, stage, profile), error)
    return len(rows)


__all__ = [
    "end_mlflow_runs_of_processes",
    "fail_runs_of_prefect_flow",
    "fail_runs_of_processes",
    "reap_stale_runs",
    "running_prefect_flow_runs",
]
