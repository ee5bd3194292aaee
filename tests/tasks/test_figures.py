"""Every stage flow logs PNG figures of its result groups to its parent MLflow run (``figures/``), drawn from the
runs under it; a flow with nothing to draw logs none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from storage.repository import ResultsRepository
from tasks.figures import (
    GROUPS,
    _bars,
    _film,
    _lines,
    _membership,
    _mpc_projection,
    _privacy_utility,
    render_figures,
)
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
        with Image.open(png) as img:  # the figure's size at 110 dpi: 11 in wide, 4.2 in (membership 5 in) high
            assert img.size == (1210, 550 if png.stem == "membership" else 462), (png.name, img.size)


def _figure(draw, frame: pd.DataFrame):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    draw(fig, frame)
    return fig


def _lines_by_label(ax) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def _bar_sizes(ax, attr: str = "get_height") -> list[float]:
    return [round(getattr(patch, attr)(), 9) for patch in ax.patches]


def test_lines_plot_each_group_sorted_by_x_one_panel_per_value() -> None:
    frame = pd.DataFrame(
        {
            "method": ["taft", "taft", "soup", "taft"],
            "n_shards": [4, 2, 2, 2],
            "test_accuracy": [0.7, 0.8, 0.6, 0.9],
            "panel": ["a", "a", "a", "b"],
        }
    )
    fig = _figure(_lines("n_shards", "test_accuracy", "method", panel="panel"), frame)
    a, b = fig.axes
    assert a.get_title() == "a" and b.get_title() == "b"
    assert _lines_by_label(a) == {"soup": ([2], [0.6]), "taft": ([2, 4], [0.8, 0.7])}
    assert _lines_by_label(b) == {"taft": ([2], [0.9])}


def test_privacy_utility_plots_the_seed_mean_per_epsilon_and_the_non_private_reference() -> None:
    frame = pd.DataFrame(
        {
            "dataset": ["ml-1m"] * 5,
            "method": ["phantom", "phantom", "phantom", "opacus", "non-private"],
            "private": [True, True, True, True, False],
            "epsilon": [1.0, 1.0, 8.0, 1.0, None],
            "ndcg_at_10": [0.10, 0.20, 0.30, 0.05, 0.40],
        }
    )
    (ax,) = _figure(_privacy_utility, frame).axes
    assert ax.get_title() == "ml-1m"
    lines = _lines_by_label(ax)
    assert lines["phantom"][0] == [1.0, 8.0] and np.allclose(lines["phantom"][1], [0.15, 0.30])
    assert lines["opacus"] == ([1.0], [0.05])
    # the non-private run: a horizontal reference line at its NDCG
    references = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert [list(line.get_ydata()) for line in references] == [[0.40, 0.40]]
    floored = _figure(_privacy_utility, frame.assign(popularity_ndcg_at_10=0.12)).axes[0]
    references = [line for line in floored.get_lines() if line.get_label().startswith("_")]
    assert [list(line.get_ydata()) for line in references] == [[0.40, 0.40], [0.12, 0.12]]  # and the popularity floor


def test_stacked_bars_sum_each_category_and_mpc_projection_takes_each_method_once() -> None:
    frame = pd.DataFrame(
        {
            "method": ["mpc", "mpc", "merge"],
            "op_category": ["softmax", "matmul", "matmul"],
            "seconds": [3.0, 1.0, 0.5],
            "bytes": [30.0, 10.0, 5.0],
        }
    )
    seconds, nbytes = _figure(_bars("method", ("seconds", "bytes"), stack="op_category"), frame).axes
    # pandas orders the index (merge, mpc) and the stacks (matmul, softmax): matmul bars, then softmax bars
    assert _bar_sizes(seconds) == [0.5, 1.0, 0.0, 3.0]
    assert _bar_sizes(nbytes) == [5.0, 10.0, 0.0, 30.0]
    proj = pd.DataFrame(
        {
            "method": ["mpc", "mpc", "merge"],
            "total_s": [10.0, 10.0, 2.0],
            "lan_projected_s": [11.0, 11.0, 3.0],
            "wan_projected_s": [50.0, 50.0, 9.0],
        }
    )
    (ax,) = _figure(_mpc_projection, proj).axes
    assert _bar_sizes(ax) == [2.0, 10.0, 3.0, 11.0, 9.0, 50.0]


def test_film_plots_mean_rouge_per_victim_and_batch_size() -> None:
    frame = pd.DataFrame(
        {
            "embedding": ["subword", "subword", "subword", "seb"],
            "attacker": ["film", "film", "film", "film"],
            "batch_size": [1, 1, 4, 1],
            "rougeL": [0.9, 0.7, 0.5, 0.1],
            "recall": [1.0, 1.0, 1.0, 1.0],
        }
    )
    (ax,) = _figure(_film, frame).axes
    lines = _lines_by_label(ax)
    assert lines["seb / film"] == ([1], [0.1])
    assert lines["subword / film"][0] == [1, 4] and np.allclose(lines["subword / film"][1], [0.8, 0.5])


def test_membership_bars_are_the_aucs_and_the_accountant_bound_is_drawn() -> None:
    frame = pd.DataFrame(
        {
            "method": ["dp", "dp", "plain"],
            "setting": ["eps=1,shadows=8", "eps=1,shadows=8", ""],
            "attack": ["lira", "loss", "lira"],
            "auc": [0.52, 0.50, 0.81],
            "empirical_epsilon": [0.3, 0.1, None],
            "accountant_epsilon": [1.0, 1.0, None],
        }
    )
    auc, eps = _figure(_membership, frame).axes
    # targets "dp eps=1" and "plain " (sorted); attacks lira then loss; a missing pair draws no bar (width 0)
    assert _bar_sizes(auc, "get_width") == [0.52, 0.81, 0.5, 0.0]
    assert [list(line.get_xdata()) for line in eps.get_lines()] == [[1.0, 1.0]]


def test_nothing_to_draw_writes_nothing(filled_store: FilledStore, tmp_path: Path) -> None:
    other = filled_store.flow_runs["stip"]  # the train-dp groups have no rows under the stip flow
    assert render_figures("train-dp", other, tmp_path, db_url=filled_store.db_url) == []
    assert render_figures("benchmark", other, tmp_path, db_url=filled_store.db_url) == []
