"""A learning-rate sweep with one diverging point (train-dp flow, tiny grid, real process pool).

At lr=1e12 the GRU's loss explodes from ~5 to ~1e25 while staying finite: that point's run must end ``failed`` with
the reason and no metrics, while the sweep's healthy point trains and is recorded ``finished`` as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows.train_dp import train_dp_flow, train_dp_runner
from storage.repository import ResultsRepository
from tests.tiny_benchmark import tiny_benchmark

pytestmark = pytest.mark.usefixtures("prefect_harness")

SWEEP = tiny_benchmark(
    {
        "methods": ["gru"],
        "nonprivate": False,
        "peers": [],
        "lrs": [0.005, 1e12],
        "eval_every": 1,
        "workers": 2,
    }
)


def _runs_by_lr(repo: ResultsRepository) -> dict[float, dict[str, Any]]:
    runs = [repo.get_run(r["id"]) for r in repo.list_runs(stage="train-dp", technique="gru", limit=None)]
    return {run["config"]["point"]["lr"]: run for run in runs}


def test_diverged_grid_point_is_failed_with_the_reason_and_no_metrics(home: Path) -> None:
    assert SWEEP.train_dp is not None
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(SWEEP.train_dp))
    summary = flow(SWEEP.train_dp, SWEEP.prepare, profile="tiny")

    repo = ResultsRepository()
    runs = _runs_by_lr(repo)
    assert sorted(runs) == [0.005, 1e12]
    diverged, healthy = runs[1e12], runs[0.005]
    assert diverged["status"] == "failed", diverged["status"]
    error = diverged["error"]
    assert error.startswith("TrainingDivergedError: training diverged at step 2 (epoch 1): loss=")
    assert "lower the learning rate (lr=1e+12)" in error and "config keys: train_dp.lrs" in error
    assert diverged["metrics"] == [] and diverged["privacy_ledger"] == []
    _, rows = repo.query("select count(*) from metrics where run_id = :id", {"id": diverged["id"]})
    assert rows == [(0,)]

    # the sweep goes on: the healthy point is recorded as usual, and the flow run finishes
    assert healthy["status"] == "finished" and healthy["privacy_ledger"]
    assert any(m["name"] == "test_ndcg_at_10" for m in healthy["metrics"])
    by_run = {r["run_id"]: r for r in summary["runs"]}
    assert by_run[diverged["id"]]["status"] == "failed" and by_run[diverged["id"]]["error"] == error
    assert by_run[healthy["id"]]["status"] == "finished"
    assert repo.get_run(summary["run_id"])["status"] == "finished"


def test_a_run_whose_every_point_diverged_fails(home: Path) -> None:
    """The user's case, ``train_dp.lrs=[1e12]``: nothing trained, so the flow run itself ends ``failed``."""
    from core.errors import DivergedError

    assert SWEEP.train_dp is not None
    only = SWEEP.train_dp.model_copy(update={"lrs": (1e12,), "workers": 1})
    with pytest.raises(
        DivergedError,
        match=r"every grid point diverged \(1\): TrainingDivergedError: training "
        r"diverged at step 2",
    ):
        train_dp_flow.with_options(task_runner=train_dp_runner(only))(only, SWEEP.prepare, profile="tiny")
    repo = ResultsRepository()
    flows = repo.list_runs(stage="train-dp", technique="flow", limit=None)
    assert [r["status"] for r in flows] == ["failed"] and "every grid point diverged" in flows[0]["error"]
    assert [r["status"] for r in repo.list_runs(stage="train-dp", technique="gru", limit=None)] == ["failed"]
