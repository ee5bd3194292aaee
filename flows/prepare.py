"""Stage 1 flow: prepare every dataset of the profile (in parallel), recorded under one parent run."""

from __future__ import annotations

from typing import Any

from prefect import flow, unmapped

from privbench.config import PrepareConfig
from storage.recording import RunRef
from tasks.prepare import materialize_source, prepare_dataset
from tasks.records import close_flow_record, mark_flow_failed, open_flow_record

STAGE = "data"


@flow(name="prepare", on_failure=[mark_flow_failed], on_crashed=[mark_flow_failed],
      on_cancellation=[mark_flow_failed], log_prints=True)
def prepare_flow(config: PrepareConfig, profile: str = "quick", parent: RunRef | None = None) -> dict[str, Any]:
    """Materialise each dataset's source, then parse, filter, split and save it, once per content."""
    run = open_flow_record(flow="prepare", stage=STAGE, config=config, profile=profile, parent=parent)
    sources = materialize_source.map(list(config.datasets)).result()  # a bad source stops here, named
    prepared = prepare_dataset.map(list(config.datasets), sources, parent=unmapped(run)).result()
    summary = {"run_id": run.run_id, "datasets": {p.name: {"path": p.path, "content_hash": p.content_hash,
                                                           "cached": p.cached, "stats": p.stats} for p in prepared}}
    close_flow_record(run, metrics={"n_datasets": len(prepared),
                                    "n_cached": sum(p.cached for p in prepared)}, summary=summary)
    return summary
