"""The whole chain: prepare, then every configured stage of ``flows.registry.STAGES`` in order (private training,
tangent, secure inference, STIP, attacks), then the claims report.

Each stage runs as a subflow under the benchmark's parent run; the chain ends by judging the papers' claims on
its own runs (``tasks.report``) and logs the report (``report/report.md`` and its figures) and the verdict counts
(``claims.*`` metrics) to the parent run.
"""

from __future__ import annotations

from typing import Any

from flows.prepare import prepare_flow
from flows.recorded import recorded_flow
from flows.registry import run_stages
from pbconfig.benchmark import BenchmarkConfig
from tasks.records import close_flow_record, open_flow_record
from tasks.report import claims_report


@recorded_flow("benchmark")
def benchmark_flow(config: BenchmarkConfig) -> dict[str, Any]:
    run = open_flow_record(flow="benchmark", stage="benchmark", config=config, profile=config.profile)
    prepared = prepare_flow(config.prepare, profile=config.profile, parent=run)
    stages: dict[str, Any] = {"prepare": prepared, **run_stages(config, run, prepared)}
    report = claims_report(run, config.profile)
    summary = {"run_id": run.run_id, "stages": stages, "claims": report["counts"]}
    close_flow_record(
        run,
        metrics={"n_stages": len(stages), **report["metrics"]},
        summary=summary,
        artifact_dirs={"report": report["folder"]} if report["folder"] else None,
    )
    return summary
