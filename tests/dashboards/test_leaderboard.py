"""The leaderboard ("which method wins"): the seed interval on hand-computed cases, the ranking over a hand-made
store with known answers (seeds, repeats, parents' seeds, direction of the metric, best and clear win), the
table the dashboard shows for it (headless app), MLflow compare links and the store's label."""

from __future__ import annotations

import json
import math
import urllib.parse
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboards import tables
from storage import leaderboard as lb
from storage.recording import finish_run, record_run, start_run
from tests.hand_made import record_train_dp as _train_dp

APP = str(Path(__file__).resolve().parents[2] / "dashboards" / "app.py")
T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom
T_975_1 = 12.706204736174698  # ... 1 degree of freedom


def test_seed_interval_three_seeds_one_two_three() -> None:
    ci = lb.seed_interval([1.0, 2.0, 3.0])
    assert ci.n == 3 and ci.mean == 2.0 and ci.std == pytest.approx(1.0)
    assert ci.half_width == pytest.approx(T_975_2 / math.sqrt(3))  # 2.484
    assert (ci.low, ci.high) == pytest.approx((2 - 2.4841, 2 + 2.4841), abs=1e-4)


def test_seed_interval_small_and_degenerate_cases() -> None:
    one = lb.seed_interval([0.7])
    assert one.n == 1 and one.mean == 0.7 and math.isnan(one.low) and math.isnan(one.high)
    assert math.isnan(one.half_width)  # one seed: no interval
    two = lb.seed_interval([0.5, 0.7, math.nan])  # NaN: a run without the metric, left out
    assert two.n == 2 and two.mean == pytest.approx(0.6)
    assert two.half_width == pytest.approx(T_975_1 * math.sqrt(0.02) / math.sqrt(2))
    flat = lb.seed_interval([5.0, 5.0])
    assert (flat.low, flat.high) == (5.0, 5.0)
    assert lb.seed_interval([]).n == 0
    assert lb.seed_interval([1, 2, 3], confidence=0.9).half_width < lb.seed_interval([1, 2, 3]).half_width
    with pytest.raises(ValueError, match="confidence"):
        lb.seed_interval([1.0], confidence=95)


def test_config_seed_is_the_shallowest() -> None:
    assert lb.config_seed({"point": {"seed": 2, "lr": 1}, "train": {"seed": 9}}) == 2
    assert lb.config_seed({"seed": 1, "inner": {"seed": 5}}) == 1
    assert lb.config_seed({"seeds": [0, 1], "n_shards": 2}) is None
    assert lb.config_seed({"seed": True}) is None


def _tangent(seed: int, accuracies: dict[str, float]) -> None:
    """A tangent flow run (its config has the seed) with composed-model children that do not."""
    flow = start_run(
        flow="tangent",
        stage="tangent",
        technique="flow",
        config={"seed": seed, "shards": [2]},
        profile="tiny",
        track=False,
    )
    for technique, accuracy in accuracies.items():
        with record_run(
            flow="tangent",
            stage="tangent",
            technique=technique,
            dataset="imgs",
            config={"k": 1, "n_shards": 2},
            parent=flow.ref,
            track=False,
        ) as rec:
            rec.metric("test_accuracy", accuracy)
    finish_run(flow)


@pytest.fixture
def ranked_store(home: Path) -> str:
    """dpformer: seeds 0, 1, 2 with NDCG 1, 2, 3 (an older run of seed 2 with NDCG 100 is superseded), HIT
    0.9, 1.0, 1.1, wall 10 s; transformer: seeds 0, 1 with NDCG 0.5, 0.7, HIT 0.1, 0.12, wall 5 s; one
    non-private transformer. Tangent: taft-composed 0.8 (seed 0), 0.9 then 0.7 (seed 1 twice: the newer
    counts); sisa 0.6 (seed 0), 0.5 (seed 1)."""
    _train_dp("dpformer", 2, 100.0, 100.0, 10.0)
    for seed, value in enumerate((1.0, 2.0, 3.0)):
        _train_dp("dpformer", seed, value, 0.9 + 0.1 * seed, 10.0)
    _train_dp("transformer", 0, 0.5, 0.1, 5.0)
    _train_dp("transformer", 1, 0.7, 0.12, 5.0)
    _train_dp("transformer", 0, 5.0, 1.0, 1.0, epsilon=None)
    _tangent(0, {"taft-composed": 0.8, "sisa": 0.6})
    _tangent(1, {"taft-composed": 0.9, "sisa": 0.5})
    _tangent(1, {"taft-composed": 0.7})
    return f"sqlite:///{home / 'results.db'}"


def _row(frame: pd.DataFrame, metric: str, context: str, method: str) -> dict:
    rows = frame[(frame["metric"] == metric) & (frame["context"] == context) & (frame["method"] == method)]
    assert len(rows) == 1, (metric, context, method, rows)
    return rows.iloc[0].to_dict()


def test_leaderboard_on_a_hand_made_store(ranked_store: str) -> None:
    frame = lb.leaderboard(ranked_store)
    assert list(frame.columns) == lb.LEADERBOARD_COLUMNS
    assert set(frame["board"]) == {"train-dp", "tangent"}

    dpformer = _row(frame, "ndcg_at_10", "d, ε=8", "dpformer")
    assert dpformer["n"] == 3 and dpformer["mean"] == pytest.approx(2.0)  # the superseded seed-2 run is out
    assert dpformer["half_width"] == pytest.approx(T_975_2 / math.sqrt(3))
    assert dpformer["best"] and not dpformer["clear_win"]  # the intervals overlap
    assert len(dpformer["run_ids"]) == 3
    transformer = _row(frame, "ndcg_at_10", "d, ε=8", "transformer")
    assert transformer["n"] == 2 and transformer["mean"] == pytest.approx(0.6) and not transformer["best"]
    assert transformer["half_width"] == pytest.approx(T_975_1 * math.sqrt(0.02) / math.sqrt(2))
    ranked = frame[(frame["metric"] == "ndcg_at_10") & (frame["context"] == "d, ε=8")]["method"].tolist()
    assert ranked == ["dpformer", "transformer"]  # best first

    hit = _row(frame, "hit_at_10", "d, ε=8", "dpformer")  # [0.752, 1.248] clears transformer's [-0.017, 0.237]
    assert hit["best"] and hit["clear_win"]
    wall = frame[(frame["metric"] == "train_wall_s") & (frame["context"] == "d, ε=8")]
    assert wall["method"].tolist() == ["transformer", "dpformer"]  # lower is better
    assert wall["best"].tolist() == [True, False] and wall["clear_win"].tolist() == [True, False]

    alone = _row(frame, "ndcg_at_10", "d, non-private", "transformer")
    assert alone["n"] == 1 and math.isnan(alone["ci_low"]) and not alone["best"]  # nothing to beat

    taft = _row(frame, "test_accuracy", "imgs, 2 shards", "taft")  # seeds from the parent flow runs
    assert taft["n"] == 2 and taft["mean"] == pytest.approx(0.75) and taft["best"]
    sisa = _row(frame, "test_accuracy", "imgs, 2 shards", "sisa")
    assert sisa["n"] == 2 and sisa["mean"] == pytest.approx(0.55)

    assert lb.leaderboard(ranked_store, boards=["tangent"])["board"].unique().tolist() == ["tangent"]
    assert set(lb.leaderboard(ranked_store, dataset="imgs")["board"]) == {"tangent"}  # the views' filters


def test_leaderboard_is_empty_with_its_columns_on_an_empty_store(store_url: str) -> None:
    frame = lb.leaderboard(store_url)
    assert frame.empty and list(frame.columns) == lb.LEADERBOARD_COLUMNS


def test_ties_and_references_are_not_best() -> None:
    def row(method: str, mean: float, *, reference: bool = False) -> dict:
        return {
            "method": method,
            "mean": mean,
            "n": 1,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "reference": reference,
            "best": False,
            "clear_win": False,
        }

    tie = [row("a", 1.0), row("b", 1.0)]
    lb._mark_best(tie, higher_is_better=True)
    assert not any(r["best"] for r in tie)
    with_ref = [row("a", 2.0), row("b", 3.0), row("nonprivate", 1.0, reference=True)]
    lb._mark_best(with_ref, higher_is_better=False)
    assert [r["best"] for r in with_ref] == [True, False, False]


def test_leaderboard_table_and_compare_links() -> None:
    frame = pd.DataFrame(
        [
            {
                "context": "d, ε=8",
                "method": "dpformer",
                "reference": False,
                "n": 3,
                "mean": 2.0,
                "ci_low": -0.4841,
                "ci_high": 4.4841,
                "half_width": 2.4841,
                "best": True,
                "clear_win": False,
                "mlflow_run_ids": ["r1", "r2", "r3"],
                "mlflow_experiment_ids": ["7"],
            },
            {
                "context": "d, ε=8",
                "method": "transformer",
                "reference": False,
                "n": 1,
                "mean": 0.6,
                "ci_low": math.nan,
                "ci_high": math.nan,
                "half_width": math.nan,
                "best": False,
                "clear_win": False,
                "mlflow_run_ids": ["r4"],
                "mlflow_experiment_ids": ["7"],
            },
            {
                "context": "d, ε=8",
                "method": "nonprivate",
                "reference": True,
                "n": 2,
                "mean": 9.0,
                "ci_low": 8.0,
                "ci_high": 10.0,
                "half_width": 1.0,
                "best": False,
                "clear_win": False,
                "mlflow_run_ids": [],
                "mlflow_experiment_ids": [],
            },
        ]
    )
    shown = tables.leaderboard_table(frame, "http://mlflow:5000/")
    assert list(shown.columns) == tables.LEADERBOARD_TABLE_COLUMNS
    assert shown["mean ± 95% CI"].tolist() == ["2 ± 2.484", "0.6", "9 ± 1"]
    assert shown["95% interval"].tolist() == ["[-0.4841, 4.484]", tables.NO_INTERVAL, "[8, 10]"]
    assert shown["best"].tolist() == ["★", "", ""]
    assert shown["method"].tolist() == ["dpformer", "transformer", "nonprivate (reference)"]
    assert pd.isna(shown["mlflow"].iloc[2])  # untracked runs: no link
    url = shown["mlflow"].iloc[0]
    assert url.startswith("http://mlflow:5000/#/compare-runs?")
    query = urllib.parse.parse_qs(url.split("?", 1)[1])
    assert json.loads(query["runs"][0]) == ["r1", "r2", "r3"] and json.loads(query["experiments"][0]) == ["7"]
    ((context, every),) = tables.context_compare_links(frame, "http://mlflow:5000")
    assert context == "d, ε=8"
    assert json.loads(urllib.parse.parse_qs(every.split("?", 1)[1])["runs"][0]) == ["r1", "r2", "r3", "r4"]
    assert tables.mlflow_compare_url("http://x", [], []) is None


def test_store_label_is_relative_and_redacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work, project, home = tmp_path / "work", tmp_path / "project", tmp_path / "home"
    for d in (work, project, home):
        d.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    assert tables.store_label(f"sqlite:///{work}/.privbench/results.db") == "sqlite:///.privbench/results.db"
    assert (
        tables.store_label(f"sqlite:///{project}/.privbench/results.db", [project])
        == "sqlite:///…/project/.privbench/results.db"
    )
    assert tables.store_label(f"sqlite:///{home}/runs/r.db?mode=ro") == "sqlite:///~/runs/r.db?mode=ro"
    assert tables.store_label("sqlite:///.privbench/results.db") == "sqlite:///.privbench/results.db"
    assert tables.store_label("sqlite:////elsewhere/r.db") == "sqlite:////elsewhere/r.db"
    assert (
        tables.store_label("postgresql+psycopg://bench:s3cret@db:5432/runs")
        == "postgresql+psycopg://bench:***@db:5432/runs"
    )


def test_dashboard_leads_with_the_known_answer(
    ranked_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PRIVBENCH_DB_URL", ranked_store)
    monkeypatch.chdir(tmp_path)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert [h.value for h in at.subheader][:2] == ["Which method wins", "Recent runs"]
    board = at.dataframe[0].value  # the first board: private training, on its key metric NDCG@10
    assert list(board.columns) == tables.LEADERBOARD_TABLE_COLUMNS
    rows = {(r["setting"], r["method"]): r for r in board.to_dict("records")}
    assert rows[("d, ε=8", "dpformer")]["mean ± 95% CI"] == "2 ± 2.484"
    assert rows[("d, ε=8", "dpformer")]["95% interval"] == "[-0.4841, 4.484]"
    assert rows[("d, ε=8", "dpformer")]["n"] == 3 and rows[("d, ε=8", "dpformer")]["best"] == "★"
    assert rows[("d, ε=8", "transformer")]["n"] == 2 and rows[("d, ε=8", "transformer")]["best"] == ""
    assert rows[("d, non-private", "transformer")]["95% interval"] == tables.NO_INTERVAL

    at.radio(key="leaderboard_train-dp").set_value("train_wall_s").run()
    assert not at.exception
    wall = at.dataframe[0].value
    wall = wall[wall["setting"] == "d, ε=8"]
    assert wall["method"].tolist() == ["transformer", "dpformer"]  # lower is better
    assert wall["best"].tolist() == ["★ clear win", ""]
    tangent = at.dataframe[1].value
    assert tangent[["method", "mean ± 95% CI", "n"]].values.tolist()[:2] == [
        ["taft", "0.75 ± 0.6353", 2],
        ["sisa", "0.55 ± 0.6353", 2],
    ]
    assert any("Not ranked yet" in c.value and "Secure inference" in c.value for c in at.caption)
    assert at.sidebar.caption[0].value.startswith("store: `sqlite:///.privbench/results.db`")  # not /tmp/...
