"""storage.views against the filled store (values cross-checked against the raw rows, filters, the run
subtree) and against an empty store on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest

from storage import view_columns as cols
from storage import views
from storage.repository import ResultsRepository
from tests.filled_store import FilledStore

EMPTY_VIEWS = {
    "runs": cols.RUNS_COLUMNS,
    "privacy_utility": cols.PRIVACY_UTILITY_COLUMNS,
    "clipping_bench": cols.CLIPPING_COLUMNS,
    "tangent_accuracy": cols.TANGENT_ACCURACY_COLUMNS,
    "unlearning": cols.UNLEARNING_COLUMNS,
    "mpc_costs": cols.MPC_COSTS_COLUMNS,
    "generation_quality": cols.GENERATION_QUALITY_COLUMNS,
    "seb_utility": cols.SEB_UTILITY_COLUMNS,
    "stip_overhead": cols.STIP_OVERHEAD_COLUMNS,
    "stip_attacks": cols.STIP_ATTACKS_COLUMNS,
    "film": cols.FILM_COLUMNS,
    "membership": cols.MEMBERSHIP_COLUMNS,
    "membership_roc": cols.ROC_COLUMNS,
}


def _metric(repo: ResultsRepository, run_id: str, name: str) -> float:
    _, rows = repo.query(
        "select value from metrics where run_id = :r and name = :n and step is null", {"r": run_id, "n": name}
    )
    assert len(rows) == 1, (run_id, name, rows)
    return rows[0][0]


def test_every_view_is_empty_with_its_columns_on_an_empty_store(store_url: str) -> None:
    for name, columns in EMPTY_VIEWS.items():
        frame = getattr(views, name)(store_url, dataset="x", since=datetime(2020, 1, 1), commit="ab")
        assert frame.empty and list(frame.columns) == columns, name
        assert list(getattr(views, name)(store_url).columns) == columns, name
    assert views.filter_options(store_url) == {
        "datasets": [],
        "profiles": [],
        "commits": [],
        "first": None,
        "last": None,
    }


def test_bad_filters_are_refused_with_the_fix(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with pytest.raises(TypeError, match="unknown filter.*datset.*known: dataset"):
        views.runs(url, datset="ml-100k")
    with pytest.raises(ValueError, match="since must not be after until"):
        views.film(url, since=datetime(2025, 1, 2), until=datetime(2025, 1, 1))


def test_runs_and_root_subtree(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    every = views.runs(url, limit=None)
    repo = ResultsRepository(url)
    _, rows = repo.query("select id, parent_id, mlflow_experiment_id from runs")
    assert set(every["id"]) == {r[0] for r in rows}
    assert every["started_at"].is_monotonic_decreasing and every["started_at"].dt.tz is not None
    children: dict[str, list[str]] = {}
    for run_id, parent, _ in rows:
        children.setdefault(parent, []).append(run_id)
    for stage, root in filled_store.flow_runs.items():
        subtree, todo = set(), [root]
        while todo:
            node = todo.pop()
            subtree.add(node)
            todo += children.get(node, [])
        got = views.runs(url, root=root, limit=None)
        assert set(got["id"]) == subtree, stage
    train_root = filled_store.flow_runs["train-dp"]
    assert len(views.runs(url, root=train_root, limit=None)) == 5  # the flow run and its 4 grid points
    assert set(views.privacy_utility(url, root=train_root)["run_id"]) == set(views.privacy_utility(url)["run_id"])
    assert views.film(url, root=train_root).empty
    assert len(views.runs(url, limit=3)) == 3
    assert set(views.runs(url, status="finished", limit=None)["status"]) == {"finished"}


def test_privacy_utility_matches_the_metric_and_ledger_rows(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    repo = ResultsRepository(url)
    frame = views.privacy_utility(url)
    assert sorted(zip(frame["method"], frame["private"], strict=True)) == [
        ("dpformer", True),
        ("transformer", False),
        ("transformer", True),
        ("transformer_opacus_hooks", True),
    ]
    for row in frame.to_dict("records"):
        assert row["ndcg_at_10"] == _metric(repo, row["run_id"], "test_ndcg_at_10")
        assert row["hit_at_10"] == _metric(repo, row["run_id"], "test_hit_at_10")
        assert row["ndcg_at_10_masked"] == _metric(repo, row["run_id"], "test_ndcg_at_10_masked")
        assert row["hit_at_10_masked"] == _metric(repo, row["run_id"], "test_hit_at_10_masked")
        _, ledger = repo.query(
            "select epsilon, target_epsilon from privacy_ledger where run_id = :r", {"r": row["run_id"]}
        )
        if row["private"]:
            assert (row["epsilon_spent"], row["epsilon"]) == ledger[0] and row["epsilon"] == 8.0
        else:
            assert not ledger and pd.isna(row["epsilon"]) and pd.isna(row["epsilon_spent"])
    assert (frame["dataset"] == "ml-1m-tiny").all()


def test_filters_select_by_dataset_profile_commit_and_dates(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    opts = views.filter_options(url)
    assert {"ml-1m-tiny", "tiny-images", "gpt2-tiny", "private"} <= set(opts["datasets"])
    assert set(opts["profiles"]) == {"tiny", "quick"} and opts["first"] <= opts["last"]
    assert len(views.privacy_utility(url, dataset="ml-1m-tiny")) == 4
    assert views.privacy_utility(url, dataset="tiny-images").empty
    assert len(views.privacy_utility(url, profile="tiny")) == 4 and views.privacy_utility(url, profile="quick").empty
    assert len(views.clipping_bench(url, profile="quick")) == 4  # the bench ran at profile quick
    commit = opts["commits"][0]
    assert len(views.runs(url, commit=commit[:7], limit=None)) == len(views.runs(url, limit=None))
    assert views.runs(url, commit="zzzz", limit=None).empty
    later = opts["last"].to_pydatetime() + timedelta(seconds=1)
    assert views.runs(url, since=later, limit=None).empty
    assert views.runs(url, until=opts["first"].to_pydatetime() - timedelta(seconds=1), limit=None).empty
    naive = opts["first"].to_pydatetime().astimezone(UTC).replace(tzinfo=None)  # naive = UTC
    assert len(views.runs(url, since=naive, limit=None)) == len(views.runs(url, limit=None))


def test_clipping_bench_is_one_row_per_method(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    frame = views.clipping_bench(url)
    assert sorted(frame["method"]) == ["nonprivate", "opacus_ghost_untied", "opacus_hooks", "phantom"]
    repo = ResultsRepository(url)
    for row in frame.to_dict("records"):
        assert row["step_s"] == _metric(repo, row["run_id"], f"methods.{row['method']}.step_s") > 0
        assert row["peak_mem_mb"] == _metric(repo, row["run_id"], f"methods.{row['method']}.peak_mem_mb")


def test_tangent_accuracy_and_unlearning_curves(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    repo = ResultsRepository(url)
    acc = views.tangent_accuracy(url)
    assert set(zip(acc["method"], acc["n_shards"], strict=True)) == {
        ("taft", 1),
        ("nlft", 1),
        ("fc", 1),
        *{(m, n) for m in ("taft", "soup", "sisa") for n in (2, 3)},
    }
    for row in acc.to_dict("records"):
        assert row["test_accuracy"] == _metric(repo, row["run_id"], "test_accuracy")
    # the filled stage trains at one rate, constant: no search to show, and "none" for the schedule of a run that
    # records one
    single = acc[acc["n_shards"] == 1]
    assert single["searched_lrs"].isna().all()
    assert set(single["lr_milestones"].dropna()) <= {"none"}
    curves = views.unlearning(url)
    assert set(curves["method"]) == {"taft", "sisa"} and (curves["n_shards"] == 3).all()
    taft = curves[curves["method"] == "taft"]
    assert taft["shards_removed"].tolist() == [0, 1, 2]
    assert taft["fraction_removed"].tolist() == pytest.approx([0, 1 / 3, 2 / 3])
    _, raw = repo.query(
        "select step, value from metrics where name = 'taft_accuracy' and step is not null order by step"
    )
    assert taft["accuracy"].tolist() == [v for _, v in raw]


def test_mpc_costs_take_the_slower_party_per_operation(filled_store: FilledStore) -> None:
    if "secure-inference" in filled_store.skipped:
        pytest.skip(f"no secure-inference runs in the filled store: {filled_store.skipped['secure-inference']}")
    url = filled_store.db_url
    frame = views.mpc_costs(url)
    assert set(frame["method"]) == {"vanilla", "mpcformer_2quad", "merge"}
    repo = ResultsRepository(url)
    for row in frame.to_dict("records"):
        _, raw = repo.query(
            "select party, sum(seconds), sum(bytes), sum(rounds) from mpc_costs where run_id = :r "
            "and op_category = :o group by party",
            {"r": row["run_id"], "o": row["op_category"]},
        )
        assert row["parties"] == len(raw) == 2
        assert row["seconds"] == max(r[1] for r in raw) and row["bytes"] == max(r[2] for r in raw)
        assert row["wan_projected_s"] == _metric(repo, row["run_id"], "wan.projected_s") > row["lan_projected_s"]
    for _, run in frame.groupby("run_id"):
        assert run["bytes"].sum() >= run["comm_bytes"].iloc[0]  # per-op maxima bound the slower party's total


def test_stip_views(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    overhead = views.stip_overhead(url)
    assert set(overhead["design"]) == {"user_embed", "vocab_perm"} and (overhead["tokens_match"] == 1.0).all()
    attacks = views.stip_attacks(url)
    assert set(attacks["attack"]) == {"checkpoint_match", "activation_stats", "frequency"}
    assert (attacks.loc[attacks["attack"] == "checkpoint_match", "recovery_rate"] == 1.0).all()
    _, raw = ResultsRepository(url).query(
        "select attack, recovered_fraction from attack_results where attack like 'stip_%'"
    )
    assert sorted((a.removeprefix("stip_"), v) for a, v in raw) == sorted(
        zip(attacks["attack"], attacks["recovery_rate"], strict=True)
    )


def test_film_rows_match_attack_results(filled_store: FilledStore) -> None:
    url = filled_store.db_url
    frame = views.film(url)
    assert set(zip(frame["embedding"], frame["attacker"], frame["batch_size"], strict=True)) == {
        ("subword", "subwords", 1),
        ("subword", "subwords", 2),
        *{("seb_co", s, b) for s in ("bytes", "positional", "relaxed") for b in (1, 2)},
    }
    _, raw = ResultsRepository(url).query(
        "select target, setting, rouge1, rouge2, rougeL, recall from attack_results where attack = 'film'"
    )
    expected = {(t, s.split(",")[0], int(s.split("batch=")[1])): (r1, r2, rl, rec) for t, s, r1, r2, rl, rec in raw}
    for row in frame.to_dict("records"):
        key = (row["embedding"], row["attacker"], int(row["batch_size"]))
        assert (row["rouge1"], row["rouge2"], row["rougeL"], row["recall"]) == expected[key]


def test_membership_and_roc_points(filled_store: FilledStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = filled_store.db_url
    frame = views.membership(url)
    assert set(zip(frame["setting"].str.split(",").str[0], frame["attack"], strict=True)) == {
        (s, a) for s in ("eps=8", "nonprivate") for a in ("loss", "lira_online", "lira_offline")
    }
    private = frame[frame["private"]]
    assert (private["epsilon"] == 8.0).all() and (private["accountant_epsilon"] <= 8.0).all()
    assert frame[~frame["private"]]["epsilon"].isna().all()
    assert (frame["empirical_epsilon_lo"] <= frame["empirical_epsilon_hi"]).all()
    roc = views.membership_roc(url, artifact_root=filled_store.home / "mlartifacts")
    assert set(roc["attack"]) == {"loss", "lira_online", "lira_offline"}
    assert set(roc["run_id"]) == set(frame["run_id"])
    assert roc["fpr"].between(0, 1).all() and roc["tpr"].between(0, 1).all()
    # away from the local artifact root (an MLflow server's artifacts) the curves come through MLflow's client
    monkeypatch.setenv("MLFLOW_TRACKING_URI", filled_store.tracking_uri)
    fetched = views.membership_roc(url, artifact_root=filled_store.home / "nowhere")
    pd.testing.assert_frame_equal(fetched, roc)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'other-mlflow.db'}")
    assert views.membership_roc(url, artifact_root=filled_store.home / "nowhere").empty


@pytest.mark.parametrize(
    ("grid", "shown"),
    [
        ([[0.001, True, False], [0.0001, True, False]], "0.001/0.0001"),  # TAFT's points: [lr, PT, CLS]
        ([[0.001, True, True], [0.001, False, True], [0.0001, True, True]], "0.001/0.0001"),  # PT/CLS searched too
        ([0.001, 0.0001], "0.001/0.0001"),  # NLFT's and FC's points: the rate alone
        ([0.001], None),  # one point: no search
        (None, None),
    ],
)
def test_tangent_accuracy_names_the_learning_rates_a_search_chose_among(grid: list | None, shown: str | None) -> None:
    assert views._searched_lrs(grid) == shown


def test_tangent_accuracy_names_the_schedule() -> None:
    assert views._joined([5, 8]) == "5/8"
    assert views._joined([]) == "none"
