"""The whole chain: prepare -> private training -> tangent -> secure inference -> attacks, then the claims report.

Each stage runs as a subflow under the benchmark's parent run; the chain ends by judging the papers' claims on
its own runs (``tasks.report``) and logs the report (``report/report.md`` and its figures) and the verdict counts
(``claims.*`` metrics) to the parent run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.attacks import attacks_flow, attacks_runner
from flows.prepare import prepare_flow
from flows.secure_inference import secure_inference_flow
from flows.stip import stip_flow
from flows.tangent import tangent_flow, tangent_runner
from flows.train_dp import train_dp_flow, train_dp_runner
from pbconfig.benchmark import BenchmarkConfig
from tasks.records import close_flow_record, mark_flow_failed, open_flow_record
from tasks.report import claims_report


@flow(
    name="benchmark", on_failure=[mark_flow_failed], on_crashed=[mark_flow_failed], on_cancellation=[mark_flow_failed]
)
def benchmark_flow(config: BenchmarkConfig) -> dict[str, Any]:
    run = open_flow_record(flow="benchmark", stage="benchmark", config=config, profile=config.profile)
    prepared = prepare_flow(config.prepare, profile=config.profile, parent=run)
    stages: dict[str, Any] = {"prepare": prepared}
    if config.train_dp is not None:
        paths = {name: d["path"] for name, d in prepared["datasets"].items()}
        stages["train-dp"] = train_dp_flow.with_options(task_runner=train_dp_runner(config.train_dp))(
            config.train_dp, config.prepare, profile=config.profile, parent=run, prepared=paths
        )
    if config.tangent is not None:
        t = config.tangent
        done = {"images": prepared["images"][t.dataset]["path"], "model": prepared["models"][t.model]["path"]}
        stages["tangent"] = tangent_flow.with_options(task_runner=tangent_runner(t))(
            t, config.prepare, profile=config.profile, parent=run, prepared=done
        )
    if config.secure_inference is not None:
        stages["secure-inference"] = secure_inference_flow(config.secure_inference, profile=config.profile, parent=run)
    if config.stip is not None:
        stages["stip"] = stip_flow(config.stip, profile=config.profile, parent=run)
    if config.attacks is not None:
        texts = {name: d["path"] for name, d in prepared.get("texts", {}).items()}
        seqrec = {name: d["path"] for name, d in prepared["datasets"].items()}
        stages["attacks"] = attacks_flow.with_options(task_runner=attacks_runner(config.attacks))(
            config.attacks,
            config.prepare,
            profile=config.profile,
            parent=run,
            prepared=texts,
            train_dp=config.train_dp,
            seqrec=seqrec,
            tangent=config.tangent,
            vision={
                "images": prepared["images"][config.tangent.dataset]["path"],
                "model": prepared["models"][config.tangent.model]["path"],
            }
            if config.tangent
            else None,
        )
    report = claims_report(run, config.profile)
    summary = {"run_id": run.run_id, "stages": stages, "claims": report["counts"]}
    close_flow_record(
        run,
        metrics={"n_stages": len(stages), **report["metrics"]},
        summary=summary,
        artifact_dirs={"report": report["folder"]} if report["folder"] else None,
    )
    return summary
