"""MLflow round trip: what the recording API logs is what ``mlflow.search_runs`` finds."""

from __future__ import annotations

from pathlib import Path

import mlflow
import pytest

from storage.recording import record_run
from storage.repository import ResultsRepository
from storage.tracking import experiment_name


def search(uri: str, run_id: str):
    mlflow.set_tracking_uri(uri)
    frame = mlflow.search_runs(search_all_experiments=True, filter_string=f"attributes.run_id = '{run_id}'")
    assert len(frame) == 1, f"MLflow run {run_id} not found"
    return frame.iloc[0]


def test_params_metrics_tags_and_nesting_round_trip(home: Path, mlflow_uri: str) -> None:
    config = {"train": {"epsilon": 8.0, "method": "dpformer"}}
    with record_run(flow="train-dp", stage="train-dp", technique="flow", config=config, profile="quick") as parent:
        pass
    with record_run(
        flow="train-dp",
        stage="train-dp",
        technique="dpformer",
        config=config,
        dataset="ml-100k",
        parent=parent.ref,
        prefect_flow_run_id="pf-123",
    ) as rec:
        rec.metric("ndcg_at_10", 0.031)
        rec.metric("loss", 3.0, step=0)
        rec.metric("loss", 2.0, step=1)
        rec.tag("privbench.dataset_hash", "abc123")
        rec.artifact_json("curve.json", {"loss": [3.0, 2.0]})
    row = ResultsRepository().get_run(rec.run_id)
    found = search(mlflow_uri, row["mlflow_run_id"])
    assert found["status"] == "FINISHED"
    assert found["params.train.epsilon"] == "8.0" and found["params.train.method"] == "dpformer"
    assert found["metrics.ndcg_at_10"] == pytest.approx(0.031)
    assert found["metrics.loss"] == pytest.approx(2.0)  # the latest step
    assert found["tags.privbench.run_id"] == rec.run_id
    assert found["tags.prefect.flow_run_id"] == "pf-123"
    assert found["tags.privbench.dataset_hash"] == "abc123"
    assert found["tags.privbench.profile"] == "quick"  # inherited from the parent
    assert found["tags.mlflow.parentRunId"] == parent.ref.mlflow_run_id
    client = mlflow.MlflowClient(mlflow_uri)
    assert [m.value for m in client.get_metric_history(row["mlflow_run_id"], "loss")] == [3.0, 2.0]
    assert "curve.json" in [a.path for a in client.list_artifacts(row["mlflow_run_id"])]
    exp = client.get_experiment(found["experiment_id"])
    assert exp.name == experiment_name("train-dp")


def test_failed_run_is_failed_in_mlflow_with_no_metrics(home: Path, mlflow_uri: str) -> None:
    with (
        pytest.raises(ZeroDivisionError),
        record_run(flow="f", stage="attacks", technique="lira", config={}) as rec,
    ):
        rec.metric("auc", 0.9)
        _ = 1 / 0
    row = ResultsRepository().get_run(rec.run_id)
    found = search(mlflow_uri, row["mlflow_run_id"])
    assert found["status"] == "FAILED"
    assert "ZeroDivisionError" in found["tags.privbench.error"]
    assert "metrics.auc" not in found or found.isna()["metrics.auc"]


def test_default_tracking_store_is_under_privbench_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIVBENCH_HOME", str(tmp_path / "h"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PRIVBENCH_DB_URL", raising=False)
    with record_run(flow="f", stage="data", technique="t", config={}) as rec:
        rec.artifact_json("x.json", {"a": 1})
    uri = f"sqlite:///{tmp_path / 'h' / 'mlflow.db'}"
    found = search(uri, ResultsRepository().get_run(rec.run_id)["mlflow_run_id"])
    assert found["artifact_uri"].startswith((tmp_path / "h" / "mlartifacts").as_uri())
    assert list((tmp_path / "h" / "mlartifacts").rglob("x.json"))
