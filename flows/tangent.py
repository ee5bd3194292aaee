"""Stage 3 flow: Tangent Transformers (TAFT) on a pretrained ViT: Table 1 (TAFT-k vs NLFT-k vs FC, each method's
recipe chosen on validation where ``tangent.search`` gives it a grid), Table 2 (TAFT composition vs Model Soup and
SISA per shard count, the shards at Table 1's choice), Fig. 1 (forgetting by subtraction and by shard retraining; one
forget request served by TAFT, SISA and full retraining) and Table 3 (DP fine-tuning regimes), shard models trained
in parallel by the task runner."""

from __future__ import annotations

import shutil
from typing import Any

from prefect import unmapped

from flows.prepare import prepare_flow
from flows.recorded import over_seeds, recorded_flow
from flows.runners import task_runner
from pbconfig.data import PrepareConfig
from pbconfig.tangent import TangentConfig
from storage.recording import RunRef
from tasks.jobs import of_type, unique
from tasks.records import close_flow_record, open_flow_record
from tasks.tangent import (
    cache_features,
    check_search,
    check_shard_counts,
    compose_shards,
    parent_workdir,
    train_full,
    train_shard,
    tune_table2,
)
from tasks.tangent_dp import check_dp, train_dp_regime
from tasks.tangent_inputs import ShardJob
from tasks.tangent_plan import DPCellJob, ForgetFractionJob, Table1Job, Table2Job, plan_pass
from tasks.tangent_report import tangent_summary
from tasks.tangent_unlearning import (
    forget_by_subtraction_curve,
    forget_fraction,
    forget_one_by_retraining,
    forget_request_costs,
)

STAGE = "tangent"


@recorded_flow("tangent")
def tangent_flow(
    config: TangentConfig,
    prepare: PrepareConfig,
    profile: str = "quick",
    parent: RunRef | None = None,
    prepared: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the four result groups on ``config.dataset`` with ``config.model`` (prepared here when not given:
    ``prepared = {"images": path, "model": path}``), once, or with ``config.seeds`` once per seed: a run of the
    flow with its config (``n_seeds``) holds one seed pass each, a pass's run recording its own seed."""
    if prepared is None:
        wanted = PrepareConfig(images=(prepare.image_dataset(config.dataset),), models=(prepare.model(config.model),))
        done = prepare_flow(wanted, profile=profile, parent=parent)
        prepared = {"images": done["images"][config.dataset]["path"], "model": done["models"][config.model]["path"]}
    images = prepared
    return over_seeds("tangent", STAGE, config, profile, parent, lambda c, p, r: seed_pass(c, p, r, images))


def seed_pass(config: TangentConfig, profile: str, parent: RunRef | None, prepared: dict[str, str]) -> dict[str, Any]:
    """The stage's whole work at ``config.seed`` (its shards, heads, training order and forget samples), recorded
    as one ``tangent`` flow run under ``parent``; the features of the prepared images are cached once for all."""
    run = open_flow_record(flow="tangent", stage=STAGE, config=config, profile=profile, parent=parent)
    try:
        inputs = cache_features.submit(config, prepared["images"], prepared["model"], run).result()
        check_shard_counts(config, inputs)
        check_dp(config, inputs)
        check_search(config, inputs)
        jobs = plan_pass(config)
        methods = [j.method for j in of_type(jobs, Table1Job)]
        table1 = train_full.map(methods, unmapped(config), unmapped(inputs), unmapped(run))
        columns = unique([j.column for j in of_type(jobs, DPCellJob)])

        def table3_columns() -> Any:  # one task per column of a regime, one recorded run per epsilon
            regimes, tangent = [c[0] for c in columns], [c[1] for c in columns]
            return train_dp_regime.map(regimes, tangent, unmapped(config), unmapped(inputs), unmapped(run))

        tuned, tuning, table3 = config, None, None
        if config.searches_table2:  # Table 2 (and Fig. 1, which reads its shards) waits for Table 1's choice
            table3 = table3_columns()  # started first, so that it runs meanwhile
            tuned, tuning = tune_table2(config, dict(zip(methods, table1.result(), strict=True)))
        shard_jobs = of_type(jobs, ShardJob)
        shards = train_shard.map(shard_jobs, unmapped(tuned), unmapped(inputs), unmapped(run), unmapped(tuning))
        if table3 is None:
            table3 = table3_columns()
        done_shards = shards.result()
        counts = unique([j.n_shards for j in of_type(jobs, Table2Job)])
        by_n = [[s for s in done_shards if s["n_shards"] == n] for n in counts]
        table2 = compose_shards.map(counts, by_n, unmapped(tuned), unmapped(inputs), unmapped(run), unmapped(tuning))
        n1 = config.fig1_n_shards
        fig1a = forget_by_subtraction_curve.submit(n1, tuned, inputs, run)
        fig1c = forget_one_by_retraining.submit(n1, tuned, inputs, run)
        fig1r = forget_request_costs.submit(n1, tuned, inputs, run)
        fractions = [j.fraction for j in of_type(jobs, ForgetFractionJob)]
        fig1f = forget_fraction.map(unmapped(n1), fractions, unmapped(tuned), unmapped(inputs), unmapped(run))
        summary = tangent_summary(
            config,
            table1=table1.result(),
            table2=table2.result(),
            fig1={
                "subtraction": fig1a.result(),
                "retrain_one": fig1c.result(),
                "fractions": fig1f.result(),
                "request": fig1r.result(),
            },
            table3=[cell for cells in table3.result() for cell in cells],
        )
    finally:
        shutil.rmtree(parent_workdir(run), ignore_errors=True)
    summary["run_id"] = run.run_id
    close_flow_record(run, metrics=summary.pop("metrics"), summary=summary)
    return summary


def tangent_runner(config: TangentConfig) -> Any:
    """The task runner of ``config.task_runner`` (:func:`flows.runners.task_runner`): processes (default: true
    parallelism on one machine), threads, or Dask (``dask_address`` of a running cluster for several machines; a
    local cluster otherwise). ``PRIVBENCH_DASK_ADDRESS`` applies where the config does not say otherwise."""
    return task_runner(
        config.workers,
        config.task_runner,
        dask_address=config.dask_address,
        threads_per_worker=config.threads_per_worker,
    )
