"""Tasks that open and close a flow's parent run, and the helpers every task uses to record itself."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.runtime import flow_run, task_run
from pydantic import BaseModel

from core.errors import PrivbenchError
from storage.recording import Recorder, RunRef, fail_runs_of_prefect_flow, finish_run, record_run, start_run


def prefect_ids() -> dict[str, str | None]:
    """The current Prefect flow-run and task-run ids (None outside Prefect)."""
    return {
        "prefect_flow_run_id": _str_or_none(flow_run.get_id()),
        "prefect_task_run_id": _str_or_none(task_run.get_id()),
    }


def task_record(*, parent: RunRef, technique: str, config: BaseModel | dict[str, Any], dataset: str | None = None,
                run_name: str | None = None):
    """``record_run`` for a task: a child of the flow's parent run, in the same stage, with Prefect ids."""
    return record_run(flow=parent.flow, stage=parent.stage, technique=technique, config=config, dataset=dataset,
                      parent=parent, run_name=run_name, **prefect_ids())


@task(name="open-flow-record", retries=2, retry_delay_seconds=2, retry_condition_fn=lambda t, r, s: retry_transient(s))
def open_flow_record(*, flow: str, stage: str, config: BaseModel, profile: str | None,
                     parent: RunRef | None = None) -> RunRef:
    """The flow run's parent row and MLflow run; tasks nest their runs under it."""
    ids = prefect_ids()
    recorder = start_run(flow=flow, stage=stage, technique="flow", config=config, profile=profile, parent=parent,
                         run_name=f"{flow} flow", prefect_flow_run_id=ids["prefect_flow_run_id"])
    return recorder.ref


@task(name="close-flow-record")
def close_flow_record(ref: RunRef, *, metrics: dict[str, float] | None = None,
                      summary: Any | None = None) -> RunRef:
    """Finish the parent run with the flow's summary metrics and a ``summary.json`` artifact."""
    recorder = Recorder(ref=ref)
    recorder.metrics(metrics or {})
    if summary is not None:
        recorder.artifact_json("summary.json", summary)
    finish_run(recorder)
    return ref


def mark_flow_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow ``on_failure``/``on_crashed``/``on_cancellation`` hook: no row of this flow run stays ``running``."""
    message = getattr(state, "message", None) or f"flow run ended {getattr(state, 'name', 'badly')}"
    fail_runs_of_prefect_flow(str(flow_run.id), f"{getattr(state, 'name', 'Failed')}: {message}")


def retry_transient(state: Any) -> bool:
    """Retry only what may be transient (I/O, a busy database), never a bad config or bad data."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:  # the result itself could not be read: treat as transient
        return True
    return isinstance(error, BaseException) and not isinstance(error, PrivbenchError)


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
