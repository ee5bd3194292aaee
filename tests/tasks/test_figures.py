"""Every stage flow logs PNG figures of its result groups to its parent MLflow run (``figures/``), drawn from the
runs under it; a flow with nothing to draw logs none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from storage.repository import ResultsRepository
from tasks.figures import GROUPS, render_figures
from tests.filled_store import FilledStore

EXPECTED = {stage: {name for name, _, _ in groups} for stage, groups in GROUPS.items()}


@pytest.mark.parametrize("stage", sorted(EXPECTED))
def test_flow_run_logs_its_figures_to_mlflow(filled_store: FilledStore, stage: str, tmp_path: Path) -> None:
    if stage in filled_store.skipped:
        pytest.skip(filled_store.skipped[stage])
    run = ResultsRepository(filled_store.db_url).get_run(filled_store.flow_runs[stage])
    client = MlflowClient(tracking_uri=filled_store.tracking_uri)
    pngs = {Path(f.path).stem for f in client.list_artifacts(run["mlflow_run_id"], "figures")}
    assert pngs == EXPECTED[stage]
    local = Path(client.download_artifacts(run["mlflow_run_id"], "figures", str(tmp_path)))
    for png in local.glob("*.png"):
        with Image.open(png) as img:
            assert img.width > 600 and img.height > 300 and len(np.unique(np.asarray(img.convert("L")))) > 20


def test_nothing_to_draw_writes_nothing(filled_store: FilledStore, tmp_path: Path) -> None:
    other = filled_store.flow_runs["stip"]  # the train-dp groups have no rows under the stip flow
    assert render_figures("train-dp", other, tmp_path, db_url=filled_store.db_url) == []
    assert render_figures("benchmark", other, tmp_path, db_url=filled_store.db_url) == []
