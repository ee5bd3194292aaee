"""Stage 4 flow: train the models (one task each, teachers first, reused when already trained), then run every
method's encrypted generation (two parties, one process each) one after the other (each run uses both parties'
cores), then the scaling sweep; recorded under one parent run."""

from __future__ import annotations

import shutil
from typing import Any

from flows.recorded import over_seeds, recorded_flow
from pbconfig.secure_inference import SecureInferenceConfig
from storage.recording import RunRef
from tasks.jobs import of_type
from tasks.records import close_flow_record, open_flow_record
from tasks.secure_inference import (
    GenerationJob,
    ScalingJob,
    TrainJob,
    check_prompts,
    collect_models,
    mpc_generation,
    plan_pass,
    scaling_point,
    si_summary,
    train_model,
    workdir_of,
)
from tasks.secure_inference_models import ModelRef, teacher_of

STAGE = "secure-inference"


@recorded_flow("secure-inference")
def secure_inference_flow(
    config: SecureInferenceConfig, profile: str = "quick", parent: RunRef | None = None
) -> dict[str, Any]:
    """Tables 1-2 analogues (per-op time and communication per method), quality of the decrypted text, and
    time/bytes vs generated length and model size; once, or with ``config.seeds`` once per seed: a run of the flow
    with its config (``n_seeds``) holds one seed pass each, a pass's run recording its own seed."""
    return over_seeds("secure-inference", STAGE, config, profile, parent, seed_pass)


def seed_pass(config: SecureInferenceConfig, profile: str, parent: RunRef | None) -> dict[str, Any]:
    """The stage's whole work at ``config.seed`` (its models, prompts and shares), recorded as one
    ``secure-inference`` flow run under ``parent``."""
    run = open_flow_record(flow="secure-inference", stage=STAGE, config=config, profile=profile, parent=parent)
    try:
        check_prompts(config)  # before any training: a seed whose test split is too small fails in seconds
        jobs = plan_pass(config)
        trained: dict[str, ModelRef] = {}
        for name in (j.name for j in of_type(jobs, TrainJob)):  # each after its teacher
            teacher = teacher_of(name, config)
            trained[name] = train_model(name, config, run, teacher=trained[teacher] if teacher else None)
        models = collect_models(config, trained, run)
        results = [mpc_generation(j.method, config, models, run) for j in of_type(jobs, GenerationJob)]
        scaling = [scaling_point(j.method, j.gen_len, j.size, config, models, run) for j in of_type(jobs, ScalingJob)]
        summary = si_summary(config, results, scaling)
    finally:
        shutil.rmtree(workdir_of(run), ignore_errors=True)
    summary["run_id"] = run.run_id
    close_flow_record(run, metrics=summary.pop("metrics"), summary=summary)
    return summary
