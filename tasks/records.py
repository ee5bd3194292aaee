"""Tasks that open and close a flow's parent run, and the helpers every task uses to record itself.

Resuming: the tasks that do a stage's real work (a grid point, a shard, a method) are declared with
``**RESUMABLE``. When a deployment's flow run is retried after a lost worker (``prefect flow-run retry ID``), they
reuse the results of the attempts that completed, keyed on the root flow run, the task's source and its inputs
(minus the parent run handle); any other run recomputes everything. At every flow start, rows left ``running`` by
a flow run that Prefect knows has ended (a killed worker's) are marked failed, and their Prefect runs Crashed.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import CachePolicy
from prefect.runtime import flow_run, task_run
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel

from core.errors import PrivbenchError
from storage.recording import Recorder, RunRef, finish_run, record_run, start_run
from storage.recovery import fail_runs_of_prefect_flow, reap_stale_runs, running_prefect_flow_runs

log = logging.getLogger("privbench.records")


@dataclass
class RetryScope(CachePolicy):
    """Cache key = (root flow run, task source, inputs except ``parent``), or no caching when the task's
    ``parent`` handle carries no root flow run. A new flow run never sees another run's cache."""

    def compute_key(
        self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        parent = inputs.get("parent")
        if not isinstance(parent, RunRef) or parent.scope is None:
            return None
        try:
            import inspect

            source = inspect.getsource(task_ctx.task.fn)
        except (OSError, TypeError):
            source = task_ctx.task.fn.__qualname__
        rest = {k: v for k, v in inputs.items() if k != "parent"}
        return hash_objects(parent.scope, source, rest, raise_on_failure=False)


RESUMABLE: dict[str, Any] = {"cache_policy": RetryScope(), "persist_result": True}


def prefect_ids() -> dict[str, str | None]:
    """The current Prefect flow-run and task-run ids (None outside Prefect)."""
    return {
        "prefect_flow_run_id": _str_or_none(flow_run.get_id()),
        "prefect_task_run_id": _str_or_none(task_run.get_id()),
    }


def task_record(
    *,
    parent: RunRef,
    technique: str,
    config: BaseModel | dict[str, Any],
    dataset: str | None = None,
    run_name: str | None = None,
):
    """``record_run`` for a task: a child of the flow's parent run, in the same stage, with Prefect ids."""
    return record_run(
        flow=parent.flow,
        stage=parent.stage,
        technique=technique,
        config=config,
        dataset=dataset,
        parent=parent,
        run_name=run_name,
        **prefect_ids(),
    )


@task(name="open-flow-record", retries=2, retry_delay_seconds=2, retry_condition_fn=lambda t, r, s: retry_transient(s))
def open_flow_record(
    *, flow: str, stage: str, config: BaseModel, profile: str | None, parent: RunRef | None = None
) -> RunRef:
    """The flow run's parent row and MLflow run; tasks nest their runs under it."""
    ids = prefect_ids()
    reconcile_lost_runs()
    recorder = start_run(
        flow=flow,
        stage=stage,
        technique="flow",
        config=config,
        profile=profile,
        parent=parent,
        run_name=f"{flow} flow",
        prefect_flow_run_id=ids["prefect_flow_run_id"],
    )
    return replace(recorder.ref, scope=_root_flow_run_id())


@task(name="close-flow-record")
def close_flow_record(
    ref: RunRef,
    *,
    metrics: dict[str, float] | None = None,
    summary: Any | None = None,
    artifact_dirs: dict[str, Path] | None = None,
) -> RunRef:
    """Finish the parent run with the flow's summary metrics, a ``summary.json`` artifact, the PNG figures of
    its result groups (``figures/``, see ``tasks.figures``) and the files of ``artifact_dirs`` (artifact folder ->
    a temporary folder whose files, subfolders kept, are logged there and which is then removed)."""
    recorder = Recorder(ref=ref)
    recorder.metrics(metrics or {})
    if summary is not None:
        recorder.artifact_json("summary.json", summary)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if ref.tracked and ref.mlflow_run_id is not None:
                for path in _figures(ref, Path(tmp)):
                    recorder.artifact_file(path, "figures")
                for name, folder in (artifact_dirs or {}).items():
                    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
                        parent = path.parent.relative_to(folder)
                        recorder.artifact_file(path, name if parent == Path(".") else f"{name}/{parent.as_posix()}")
            finish_run(recorder)
    finally:
        for folder in (artifact_dirs or {}).values():
            shutil.rmtree(folder, ignore_errors=True)
    return ref


def _figures(ref: RunRef, out_dir: Path) -> list[Path]:
    """The flow's figures; a drawing error is logged, never allowed to fail the measured run."""
    from tasks.figures import render_figures

    try:
        return render_figures(ref.stage, ref.run_id, out_dir)
    except Exception as exc:  # noqa: BLE001 -- a figure never fails the measured run
        log.warning("could not draw the figures of %s run %s: %s: %s", ref.stage, ref.run_id, type(exc).__name__, exc)
        return []


def mark_flow_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow ``on_failure``/``on_crashed``/``on_cancellation`` hook: no row of this flow run stays ``running``."""
    message = getattr(state, "message", None) or f"flow run ended {getattr(state, 'name', 'badly')}"
    error: str | BaseException = f"{getattr(state, 'name', 'Failed')}: {message}"
    if "aborted by an interrupt signal" in message or "aborted by a termination signal" in message:
        error = KeyboardInterrupt(error)  # stopped, not broken: MLflow KILLED, as for an interrupted command
    fail_runs_of_prefect_flow(str(flow_run.id), error)


def reconcile_lost_runs() -> int:
    """Mark failed the rows still ``running`` of runs lost with their process or worker (a killed process cannot
    run its crash hooks): first the stale rows (their process gone from this host, or no heartbeat for the stale
    window: ``storage.liveness``), then those whose Prefect flow run, or one of its ancestors, has ended. The
    Prefect flow runs of both that were left Running are set Crashed. Flow runs that are still going, or that this
    Prefect API does not know, are left alone. Returns the number of rows failed."""
    from prefect.states import Crashed

    stale = reap_stale_runs()
    failed = len(stale)
    with _client() as client:
        for fr_id, reason in {s.prefect_flow_run_id: s.reason for s in stale if s.prefect_flow_run_id}.items():
            crash_flow_run(client, fr_id, f"Crashed: {reason}")
        for fr_id, chain in _chains(client):
            ended = next((fr for fr in chain if fr.state is not None and fr.state.is_final()), None)
            if ended is None:
                continue
            message = f"Crashed: Prefect flow run {ended.id} ended {ended.state.name} while this run was open"
            failed += fail_runs_of_prefect_flow(fr_id, message)
            if chain[0].state is None or not chain[0].state.is_final():
                client.set_flow_run_state(fr_id, Crashed(message=message), force=True)
    if failed:
        log.warning("marked %d run(s) of lost flow runs failed", failed)
    return failed


def crash_flow_run(client: Any, flow_run_id: str, message: str, *, cancelled: bool = False) -> bool:
    """Set a Prefect flow run that is not final Crashed (or Cancelled); False when it is final or unknown."""
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled, Crashed

    try:
        run = client.read_flow_run(flow_run_id)
    except (ObjectNotFound, ValueError):
        return False
    if run.state is not None and run.state.is_final():
        return False
    state = Cancelled(message=message) if cancelled else Crashed(message=message)
    client.set_flow_run_state(flow_run_id, state, force=True)
    return True


def end_prefect_flow_runs(
    flow_run_ids: set[str], message: str, *, cancelled: bool = False, api_url: str | None = None
) -> int:
    """``crash_flow_run`` for each id (an operator's reap, an interrupted command); returns how many changed.

    ``api_url``: the Prefect API to use (a supervisor's temporary server) instead of ``PREFECT_API_URL``; without
    either, Prefect would start an ephemeral server of its own for this call."""
    if not flow_run_ids:
        return 0
    with _client(api_url) as client:
        return sum(crash_flow_run(client, fr_id, message, cancelled=cancelled) for fr_id in sorted(flow_run_ids))


@task(name="reclaim-retried-runs")
def reclaim_retried_runs() -> int:
    """In a retried flow run (``prefect flow-run retry``, ``run_count > 1``), before anything of this attempt is
    recorded: every row still ``running`` under this flow run belongs to an attempt that died with its worker;
    mark it failed. Returns the number of rows failed."""
    if (flow_run.get_run_count() or 1) <= 1:
        return 0
    root = str(flow_run.get_id())
    failed = 0
    with _client() as client:
        for fr_id, chain in _chains(client):
            if str(chain[-1].id) == root:
                failed += fail_runs_of_prefect_flow(
                    fr_id, f"Crashed: Prefect flow run {root} was restarted while this run was open (worker lost)"
                )
    return failed


def _client(api_url: str | None = None) -> Any:
    from prefect.client.orchestration import SyncPrefectClient, get_client

    return SyncPrefectClient(api_url) if api_url else get_client(sync_client=True)


def _chains(client: Any) -> list[tuple[str, list[Any]]]:
    """For each Prefect flow run with rows still ``running``: the flow run and its ancestors, innermost first."""
    from prefect.exceptions import ObjectNotFound

    out = []
    for fr_id in running_prefect_flow_runs():
        try:
            chain = [client.read_flow_run(fr_id)]
            while chain[-1].parent_task_run_id is not None and len(chain) < 32:
                parent_task = client.read_task_run(chain[-1].parent_task_run_id)
                chain.append(client.read_flow_run(parent_task.flow_run_id))
        except ObjectNotFound:  # another Prefect API's run
            continue
        out.append((fr_id, chain))
    return out


def _root_flow_run_id() -> str | None:
    try:
        return _str_or_none(flow_run.get_root_flow_run_id())
    except Exception:  # noqa: BLE001 -- outside Prefect, or its API is unreachable: no resuming
        return None


def retry_transient(state: Any) -> bool:
    """Retry only what may be transient (I/O, a busy database), never a bad config or bad data."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # noqa: BLE001 -- the result itself could not be read: treat as transient
        return True
    return isinstance(error, BaseException) and not isinstance(error, PrivbenchError)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
