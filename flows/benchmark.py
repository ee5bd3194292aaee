"""The whole chain: prepare -> private training -> tangent -> secure inference -> attacks.

Stages are appended here as they land; each runs as a subflow under the benchmark's parent run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.prepare import prepare_flow
from privbench.config import BenchmarkConfig
from tasks.records import close_flow_record, mark_flow_failed, open_flow_record


@flow(name="benchmark", on_failure=[mark_flow_failed], on_crashed=[mark_flow_failed],
      on_cancellation=[mark_flow_failed])
def benchmark_flow(config: BenchmarkConfig) -> dict[str, Any]:
    run = open_flow_record(flow="benchmark", stage="benchmark", config=config, profile=config.profile)
    prepared = prepare_flow(config.prepare, profile=config.profile, parent=run)
    summary = {"run_id": run.run_id, "stages": {"prepare": prepared}}
    close_flow_record(run, metrics={"n_stages": len(summary["stages"])}, summary=summary)
    return summary
