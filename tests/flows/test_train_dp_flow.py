"""The train-dp flow end to end (tiny grid, real process pool): runs, curves, privacy ledger, SQL by epsilon."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.train_dp import train_dp_flow, train_dp_runner
from pbconfig.benchmark import BenchmarkConfig, validate
from storage.repository import ResultsRepository
from tasks.train_dp import expand_grid

pytestmark = pytest.mark.usefixtures("prefect_harness")

TINY = validate(
    BenchmarkConfig,
    {
        "profile": "tiny",
        "prepare": {
            "datasets": [
                {
                    "name": "ml-1m-tiny",
                    "source": "synthetic",
                    "synthetic": {"preset": "ml-1m", "scale": 0.05, "seed": 3},
                }
            ]
        },
        "train_dp": {
            "datasets": [{"name": "ml-1m-tiny"}],
            "methods": ["transformer", "dpformer"],
            "epsilons": [8],
            "nonprivate": True,
            "peers": ["transformer_opacus_hooks"],
            "peer_epsilons": [8],
            "epochs": 1,
            "lrs": [0.005],
            "batch_sizes": [64],
            "max_len": 16,
            "d_model": 16,
            "eval_every": 1,
            "workers": 2,
        },
    },
    origin="test",
)


def test_grid_expansion_counts_every_combination() -> None:
    assert TINY.train_dp is not None
    points = expand_grid(TINY.train_dp, {"ml-1m-tiny": "/x"})
    labels = sorted((p.method, p.epsilon or 0.0) for p in points)  # 0.0 stands for non-private
    assert labels == [("dpformer", 8.0), ("transformer", 0.0), ("transformer", 8.0), ("transformer_opacus_hooks", 8.0)]


def test_train_dp_flow_records_runs_with_ledger_and_curves(home: Path) -> None:
    assert TINY.train_dp is not None
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(TINY.train_dp))
    summary = flow(TINY.train_dp, TINY.prepare, profile="tiny")
    assert len(summary["runs"]) == 4
    repo = ResultsRepository()
    _, rows = repo.query(
        "select r.technique, p.epsilon, p.target_epsilon, p.delta, p.noise_multiplier, p.sample_rate, p.steps, "
        "m.value from runs r join metrics m on m.run_id = r.id and m.name = 'test_ndcg_at_10' "
        "left join privacy_ledger p on p.run_id = r.id where r.stage = 'train-dp' and r.status = 'finished' "
        "order by r.technique, p.epsilon"
    )
    assert len(rows) == 4
    private = [r for r in rows if r[1] is not None]
    assert {r[0] for r in private} == {"transformer", "dpformer", "transformer_opacus_hooks"}
    for _, eps, target, delta, sigma, q, steps, ndcg in private:
        assert 0 < eps <= target == 8.0 and eps > 7.0  # the budget is spent, never exceeded
        assert 0 < delta < 1 / 302 and sigma > 0 and 0 < q < 1 and steps >= 1  # 302 users in the tiny set
        assert 0.0 <= ndcg <= 1.0
    run = repo.get_run(summary["runs"][0]["run_id"])
    curve = [m for m in run["metrics"] if m["name"] == "curve/valid_ndcg_at_10"]
    assert [m["step"] for m in curve] == [1]
    assert run["mlflow_run_id"] and run["status"] == "finished"
