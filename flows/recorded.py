"""What every flow of the chain shares: the flow decorator that leaves no row of a failed run ``running``, and the
seed passes of a stage that runs once per seed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from prefect import flow

from storage.recording import RunRef
from tasks.records import close_flow_record, mark_flow_failed, open_flow_record


def recorded_flow(name: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Prefect's ``@flow(name=...)`` with the hooks that mark the flow's open rows ``failed`` when it fails, crashes
    or is cancelled (``tasks.records.mark_flow_failed``); ``options`` go to ``flow`` as they are."""
    hooks = [mark_flow_failed]
    return flow(name=name, on_failure=hooks, on_crashed=hooks, on_cancellation=hooks, **options)


class SeededConfig(Protocol):
    seeds: Any

    def seed_configs(self) -> Any: ...


def over_seeds(
    flow_name: str,
    stage: str,
    config: SeededConfig,
    profile: str,
    parent: RunRef | None,
    one_pass: Callable[[Any, str, RunRef | None], dict[str, Any]],
) -> dict[str, Any]:
    """``one_pass(config, profile, parent)`` once, or with ``config.seeds`` once per seed under one run of the flow
    that records the config (``n_seeds``), each pass's run recording its own seed."""
    if config.seeds is None:
        return one_pass(config, profile, parent)
    run = open_flow_record(flow=flow_name, stage=stage, config=config, profile=profile, parent=parent)
    passes = {str(c.seed): one_pass(c, profile, run) for c in config.seed_configs()}
    summary = {"run_id": run.run_id, "seeds": passes}
    close_flow_record(run, metrics={"n_seeds": len(passes)}, summary=summary)
    return summary
