"""The Streamlit app headless (``streamlit.testing.v1.AppTest``): empty states on an empty store; the
leaderboards (the values of ``storage.leaderboard``), charts, MLflow links and working filters on the filled
store."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboards import tables
from storage import leaderboard as lb
from tests.filled_store import FilledStore

APP = str(Path(__file__).resolve().parents[2] / "dashboards" / "app.py")
STAGE_EMPTY_STATES = (
    "No runs yet: run `privbench run benchmark --profile quick`",
    "No private-training runs yet: run `privbench run train-dp --profile quick`",
    "No clipping benchmark yet: run `privbench bench dp-clipping`",
    "No tangent runs yet: run `privbench run tangent --profile quick`",
    "No secure-inference runs yet: run `privbench run secure-inference --profile quick`",
    "No STIP runs yet: run `privbench run stip --profile quick`",
    "No FILM attack runs yet: run `privbench run attacks --profile quick`",
    "No membership-inference audits yet: run `privbench run attacks --profile quick`",
)


def _app() -> AppTest:
    return AppTest.from_file(APP, default_timeout=60).run()


def _infos(at: AppTest) -> list[str]:
    return [i.value for i in at.info]


def _runs(at: AppTest) -> pd.DataFrame:
    """The overview's table of runs (after the leaderboards)."""
    return next(d.value for d in at.dataframe if "status" in d.value.columns)


def _boards(at: AppTest) -> list[pd.DataFrame]:
    return [d.value for d in at.dataframe if list(d.value.columns) == tables.LEADERBOARD_TABLE_COLUMNS]


def test_empty_store_shows_what_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIVBENCH_HOME", str(tmp_path / ".privbench"))
    monkeypatch.delenv("PRIVBENCH_DB_URL", raising=False)
    at = _app()
    assert not at.exception
    infos = _infos(at)
    for message in STAGE_EMPTY_STATES:
        assert any(i.startswith(message) for i in infos), message
    assert not at.get("plotly_chart") and not at.dataframe


def test_filled_store_renders_every_stage_with_links_and_filters(
    filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in filled_store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PRIVBENCH_MLFLOW_UI_URL", "http://mlflow.test:5000/")
    at = _app()
    assert not at.exception
    expected_empty = ["No secure-inference runs yet"] if "secure-inference" in filled_store.skipped else []
    assert [i for i in _infos(at) if not any(i.startswith(e) for e in expected_empty)] == []  # all have data
    assert len(at.get("plotly_chart")) >= 11
    assert [h.value for h in at.subheader][:2] == ["Which method wins", "Recent runs"]
    # the leaderboards lead, one per stage with results, each on its key metric, with the store's values
    expected = lb.leaderboard(filled_store.db_url)
    boards = [b for b in lb.BOARDS if b.name in set(expected["board"])]
    assert {"train-dp", "tangent", "stip", "film", "membership", "dp-clipping"} <= {b.name for b in boards}
    shown = _boards(at)
    assert len(shown) == len(boards)
    for board, table in zip(boards, shown, strict=True):
        key = expected[(expected["board"] == board.name) & (expected["metric"] == board.metrics[0].name)]
        assert len(table) == len(key) > 0, board.name
        assert table["setting"].tolist() == key["context"].tolist(), board.name
        assert table["mean ± 95% CI"].tolist() == [tables.fmt(m) for m in key["mean"]], board.name  # n = 1
        assert all(pd.notna(float(v.split(" ± ")[0])) for v in table["mean ± 95% CI"])  # numbers, not blanks
        assert (table["n"] >= 1).all() and set(table["best"]) <= {"", "★", "★ clear win"}
        assert table["mlflow"].str.startswith("http://mlflow.test:5000/#/compare-runs?runs=").all(), board.name
    runs = _runs(at)
    tracked = runs.dropna(subset=["mlflow"])
    assert len(tracked) > 0 and len(runs) > len(tracked) - 1
    link = tracked["mlflow"].iloc[0]
    assert link.startswith("http://mlflow.test:5000/#/experiments/") and "/runs/" in link

    at.selectbox(key="dataset").select("ml-1m-tiny").run()
    assert not at.exception
    assert set(_runs(at)["dataset"]) == {"ml-1m-tiny"}
    assert set(_boards(at)[0]["setting"]) <= {"ml-1m-tiny, non-private", "ml-1m-tiny, ε=8"}
    infos = _infos(at)
    assert any(i.startswith("No STIP runs yet") and "widen the filters" in i for i in infos)
    assert not any(i.startswith("No private-training runs yet") for i in infos)

    at.selectbox(key="dataset").select("(all)").run()
    at.text_input(key="root").input(filled_store.flow_runs["stip"]).run()
    assert not at.exception
    assert set(_runs(at)["stage"]) == {"stip"}
    assert [b["setting"].iloc[0] for b in _boards(at)] == ["gpt2-tiny"]  # only the STIP board is left
    assert any(i.startswith("No private-training runs yet") for i in _infos(at))


def test_claims_tab_shows_the_report_table(filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Claims tab: one table per paper, the claims of ``storage.claims`` in registry order with their
    verdicts (the same computation as ``privbench report``)."""
    from storage import claims as sc

    for key, value in filled_store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    at = _app()
    assert not at.exception
    expected = sc.claims_table(sc.evaluate_claims(filled_store.db_url))
    shown = [d.value for d in at.dataframe if {"claim", "verdict", "ours", "rule"} <= set(d.value.columns)]
    assert len(shown) == expected["paper"].nunique()
    claims = pd.concat(shown, ignore_index=True)
    assert claims["claim"].tolist() == expected["claim"].tolist()
    assert [v.split(" ", 1)[1] for v in claims["verdict"]] == expected["verdict"].tolist()
    assert claims["ours"].tolist() == expected["ours"].tolist()


def test_every_verdict_has_an_icon() -> None:
    from dashboards.app import VERDICT_ICONS
    from pbconfig.claims import Verdict

    assert set(VERDICT_ICONS) == set(Verdict)
