"""Stage 2 flow: DP-SGD training grid (DPFormer and its baselines), one process per grid point."""

from __future__ import annotations

from typing import Any

from prefect import unmapped

from core.errors import DivergedError
from flows.prepare import prepare_flow
from flows.recorded import recorded_flow
from flows.runners import task_runner
from pbconfig.data import PrepareConfig
from pbconfig.train_dp import TrainDPConfig
from storage.recording import RunRef
from tasks.records import close_flow_record, open_flow_record
from tasks.train_dp import choose_recipes, plan_grid, plan_tuning, train_point

STAGE = "train-dp"
TUNING_STAGE = "train-dp-tuning"  # the search's runs: never read as results (storage.views reads stage train-dp)


@recorded_flow("train-dp")
def train_dp_flow(
    config: TrainDPConfig,
    prepare: PrepareConfig,
    profile: str = "quick",
    parent: RunRef | None = None,
    prepared: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Train every grid point of ``config`` on the prepared datasets (prepared here first when not given)."""
    if prepared is None:
        wanted = PrepareConfig(datasets=tuple(prepare.dataset(d.name) for d in config.datasets))
        done = prepare_flow(wanted, profile=profile, parent=parent)
        prepared = {name: d["path"] for name, d in done["datasets"].items()}
    run = open_flow_record(flow="train-dp", stage=STAGE, config=config, profile=profile, parent=parent)
    chosen = None
    if config.tuning is not None:  # the search on validation first, recorded apart (stage train-dp-tuning)
        search = open_flow_record(flow="train-dp", stage=TUNING_STAGE, config=config, profile=profile, parent=run)
        tried = (
            train_point.with_options(name="train-dp-tuning-point")
            .map(plan_tuning(config, prepared), unmapped(config), unmapped(search))
            .result()
        )
        chosen = choose_recipes(config, tried)
        close_flow_record(search, metrics={"n_runs": len(tried)}, summary={"runs": tried, "chosen": chosen})
    points = plan_grid(config, prepared, chosen)
    results = train_point.with_options(name="train-dp-point").map(points, unmapped(config), unmapped(run)).result()
    diverged = [r for r in results if r.get("status") == "failed"]
    if results and len(diverged) == len(results):  # a sweep may lose some points; losing all of them is a failure
        raise DivergedError(f"every grid point diverged ({len(diverged)}): " + "; ".join(r["error"] for r in diverged))
    summary = {"run_id": run.run_id, "runs": results}
    close_flow_record(run, metrics={"n_runs": len(results), "n_diverged": len(diverged)}, summary=summary)
    return summary


def train_dp_runner(config: TrainDPConfig) -> Any:
    """Grid points train in parallel processes (true parallelism, per-process RNG seeding); on the Dask cluster
    of ``PRIVBENCH_DASK_ADDRESS`` when it is set (several machines)."""
    return task_runner(config.workers)
