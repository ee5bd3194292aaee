"""The prepare flow end to end under the session's Prefect harness: store rows, MLflow runs, caching, failure."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from core.errors import DataError
from flows.prepare import prepare_flow
from pbconfig.data import PrepareConfig
from storage.repository import ResultsRepository
from tasks.prepare import load_prepared

pytestmark = pytest.mark.usefixtures("prefect_harness")

TINY = PrepareConfig.model_validate(
    {
        "datasets": [
            {"name": "ml-100k", "source": "recbole-ml100k"},
            {"name": "ml-1m-tiny", "source": "synthetic", "synthetic": {"preset": "ml-1m", "scale": 0.05, "seed": 1}},
            {
                "name": "amazon-tiny",
                "source": "synthetic",
                "synthetic": {"preset": "amazon-games", "format": "amazon-jsonl", "scale": 0.02, "seed": 1},
            },
        ]
    }
)


def test_prepare_flow_records_every_dataset_once(home: Path, mlflow_uri: str) -> None:
    summary = prepare_flow(TINY, profile="quick")
    repo = ResultsRepository()
    flow_run = repo.get_run(summary["run_id"])
    assert flow_run["status"] == "finished" and flow_run["technique"] == "flow"
    assert flow_run["prefect_flow_run_id"]
    children = [repo.get_run(c["id"]) for c in flow_run["children"]]
    assert sorted(c["dataset"] for c in children) == ["amazon-tiny", "ml-100k", "ml-1m-tiny"]
    assert all(c["status"] == "finished" and c["mlflow_run_id"] for c in children)
    assert all(c["prefect_flow_run_id"] == flow_run["prefect_flow_run_id"] for c in children)

    ml100k = next(c for c in children if c["dataset"] == "ml-100k")
    metrics = {m["name"]: m["value"] for m in ml100k["metrics"]}
    assert metrics["n_users"] == 943 and metrics["cache_hit"] == 0.0
    assert ml100k["datasets"][0]["n_users"] == 943
    data = load_prepared(summary["datasets"]["ml-100k"]["path"])
    assert data.content_hash() == summary["datasets"]["ml-100k"]["content_hash"]

    mlflow.set_tracking_uri(mlflow_uri)
    found = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`privbench.run_id` = '{ml100k['id']}'")
    assert len(found) == 1 and found.iloc[0]["tags.mlflow.parentRunId"] == flow_run["mlflow_run_id"]

    again = prepare_flow(TINY, profile="quick")
    assert all(d["cached"] for d in again["datasets"].values())
    assert {k: d["content_hash"] for k, d in again["datasets"].items()} == {
        k: d["content_hash"] for k, d in summary["datasets"].items()
    }
    _, rows = repo.query("select count(*) from datasets")
    assert rows == [(3,)]


def test_missing_file_fails_the_flow_and_leaves_nothing_running(home: Path, tmp_path: Path) -> None:
    config = PrepareConfig.model_validate(
        {
            "datasets": [
                {"name": "gone", "source": "file", "format": "ml-1m", "path": str(tmp_path / "nope" / "ratings.dat")},
            ]
        }
    )
    with pytest.raises(DataError, match="nope/ratings.dat' does not exist"):
        prepare_flow(config, profile="quick")
    runs = ResultsRepository().list_runs(limit=None)
    assert runs and all(r["status"] == "failed" for r in runs)
    assert any("does not exist" in (r["error"] or "") for r in runs)


def test_malformed_file_gives_file_and_line(home: Path, tmp_path: Path) -> None:
    bad = tmp_path / "ratings.dat"
    bad.write_text("1::10::5::978300760\n1::11::oops::978300761\n", encoding="latin-1")
    config = PrepareConfig.model_validate(
        {"datasets": [{"name": "bad", "source": "file", "format": "ml-1m", "path": str(bad)}]}
    )
    with pytest.raises(DataError, match=r"ratings.dat:2"):
        prepare_flow(config, profile="quick")
    (failed_child,) = [r for r in ResultsRepository().list_runs(limit=None) if r["technique"] == "seqrec-prep"]
    assert failed_child["status"] == "failed" and "ratings.dat:2" in failed_child["error"]
    _, rows = ResultsRepository().query("select count(*) from metrics")
    assert rows == [(0,)]
