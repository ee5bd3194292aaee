"""Stage 6 flow: the STIP protocol per model and design, then every attack on each design at every fine-tune
noise, one after the other (each protocol run starts three processes; timings want the cores to themselves)."""

from __future__ import annotations

from typing import Any

from flows.recorded import recorded_flow
from pbconfig.stip import StipConfig
from storage.recording import RunRef
from tasks.records import close_flow_record, open_flow_record
from tasks.stip import attack, plan, protocol

STAGE = "stip"


@recorded_flow("stip")
def stip_flow(config: StipConfig, profile: str = "quick", parent: RunRef | None = None) -> dict[str, Any]:
    run = open_flow_record(flow="stip", stage=STAGE, config=config, profile=profile, parent=parent)
    jobs = plan(config)
    runs = [protocol(j.model, j.design, config, run) for j in jobs if j.step == "protocol"]
    found = [attack(j.model, j.design, config, run) for j in jobs if j.step == "attack"]
    metrics: dict[str, float] = {}
    for r in runs:
        for k in (
            "max_abs_err",
            "server_over_plaintext_time",
            "user_overhead_fraction",
            "bytes_up_per_token",
            "bytes_down_per_token",
            "tokens_match",
        ):
            metrics[f"{r['model']}.{r['design']}.{k}"] = r[k]
    for a in found:
        for target in ("pi", "sigma", "tokens"):
            for prior in ("checkpoint", "none", "strongest"):
                key = f"{prior}.{target}_recovered"
                if key in a["metrics"]:
                    metrics[f"{a['model']}.{a['design']}.{key}"] = a["metrics"][key]
    summary = {"run_id": run.run_id, "protocol": runs, "attacks": found}
    close_flow_record(run, metrics=metrics, summary=summary)
    return summary
