"""The train-dp flow end to end (tiny grid, real process pool): runs, curves, privacy ledger, SQL by epsilon."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
from mlflow.tracking import MlflowClient

from core.dp.noise import NOISE_SOURCES
from core.dp.trainer import EVAL_PROTOCOL
from core.errors import ConfigError
from core.models.popularity import popularity_metrics
from storage import views
from storage.repository import ResultsRepository
from tasks.prepare import load_prepared
from tasks.train_dp import expand_grid, train_overrides
from tests.tiny_benchmark import tiny_benchmark

if TYPE_CHECKING:
    from tests.filled_store import StageStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

TINY = tiny_benchmark(
    {
        "methods": ["transformer", "dpformer"],
        "nonprivate": True,
        "peers": ["transformer_opacus_hooks"],
        "peer_epsilons": [8],
        "eval_every": 1,
        "workers": 2,
    }
)


def test_grid_expansion_counts_every_combination() -> None:
    assert TINY.train_dp is not None
    points = expand_grid(TINY.train_dp, {"ml-1m-tiny": "/x"})
    labels = sorted((p.method, p.epsilon or 0.0) for p in points)  # 0.0 stands for non-private
    assert labels == [("dpformer", 8.0), ("transformer", 0.0), ("transformer", 8.0), ("transformer_opacus_hooks", 8.0)]


def test_nonprivate_schedule_applies_to_the_baselines_only() -> None:
    assert TINY.train_dp is not None
    grid = TINY.train_dp.model_copy(update={"lrs": (0.001, 0.005), "batch_sizes": (32, 64)})
    scheduled = grid.model_validate(grid.model_dump() | {"nonprivate_schedule": {"epochs": 7, "lr": 0.01}})
    points = expand_grid(scheduled, {"ml-1m-tiny": "/x"})
    private = [p for p in points if p.epsilon is not None]
    assert private == [p for p in expand_grid(grid, {"ml-1m-tiny": "/x"}) if p.epsilon is not None]
    assert {(p.epochs, p.lr) for p in private} == {(None, 0.001), (None, 0.005)}
    baselines = [p for p in points if p.epsilon is None]  # one lr now: the lrs grid collapses, batch sizes stay
    assert [(p.method, p.epochs, p.lr, p.batch_size) for p in baselines] == [
        ("transformer", 7, 0.01, 32),
        ("transformer", 7, 0.01, 64),
    ]
    assert baselines[0].label == "transformer:ml-1m-tiny:nonprivate:seed0:lr0.01:b32:e7"
    assert train_overrides(baselines[0], scheduled)["epochs"] == 7
    assert train_overrides(private[0], scheduled)["epochs"] == grid.epochs == 1
    assert train_overrides(baselines[0], scheduled)["patience"] is None
    patient = grid.model_validate(grid.model_dump() | {"nonprivate_schedule": {"patience": 10}})
    points = expand_grid(patient, {"ml-1m-tiny": "/x"})
    assert {p.epsilon is None: train_overrides(p, patient)["patience"] for p in points} == {True: 10, False: None}
    assert next(p for p in points if p.epsilon is None).label.endswith(":p10")


def test_secure_mode_reaches_the_private_runs_only() -> None:
    assert TINY.train_dp is not None and TINY.train_dp.secure_mode is False  # reproducible research runs by default
    secure = TINY.train_dp.model_copy(update={"secure_mode": True})
    points = expand_grid(secure, {"ml-1m-tiny": "/x"})
    assert {p.epsilon is not None: train_overrides(p, secure).get("secure_mode") for p in points} == {
        True: True,
        False: None,  # non-private: no noise to secure
    }


def test_train_dp_flow_records_runs_with_ledger_and_curves(
    stage_store: StageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = stage_store.summary("train-dp")  # the train-dp flow on TINY, run once for the session's tests
    stage_store.point_at(monkeypatch)
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
    _, ledger = repo.query(
        "select p.unit, p.neighbouring from privacy_ledger p join runs r on r.id = p.run_id where r.stage = 'train-dp'"
    )
    assert set(ledger) == {("user", "add/remove")}
    run = repo.get_run(summary["runs"][0]["run_id"])
    curve = [m for m in run["metrics"] if m["name"] == "curve/valid_ndcg_at_10"]
    assert [m["step"] for m in curve] == [1]
    assert run["mlflow_run_id"] and run["status"] == "finished"
    metrics = {m["name"]: m["value"] for m in run["metrics"] if m["step"] is None}
    for name in ("test_ndcg_at_10", "test_hit_at_10", "valid_ndcg_at_10", "valid_hit_at_10"):
        ranked, masked = metrics[name], metrics[f"{name}_masked"]
        assert 0.0 <= ranked <= masked <= 1.0, name  # one epoch: both protocols rank the same scores
    assert metrics["best_epoch"] == metrics["best_epoch_masked"] == 1
    prepared = load_prepared(run["config"]["point"]["dataset_path"])
    for split in ("valid", "test"):  # the popularity floor of the same users, recorded beside the run's own metrics
        floor = popularity_metrics(prepared, split)
        assert metrics[f"popularity.{split}_ndcg_at_10"] == pytest.approx(floor.ndcg)
        assert metrics[f"popularity.{split}_hit_at_10_masked"] == pytest.approx(floor.hit_masked)
    frame = views.privacy_utility()
    assert frame["popularity_ndcg_at_10"].tolist() == pytest.approx([metrics["popularity.test_ndcg_at_10"]] * 4)
    assert [m["step"] for m in run["metrics"] if m["name"] == "curve/test_ndcg_at_10_masked"] == [1]
    assert summary["runs"][0]["test_ndcg_at_10_masked"] == metrics["test_ndcg_at_10_masked"]
    client = MlflowClient(tracking_uri=stage_store.tracking_uri)  # not mlflow's process-wide URI another test set
    mlflow_run = client.get_run(run["mlflow_run_id"])
    assert mlflow_run.data.tags["privbench.protocol"] == EVAL_PROTOCOL
    _, sources = repo.query(  # every run names its noise source, in its config and as a tag
        "select r.mlflow_run_id, r.config_json, p.epsilon from runs r left join privacy_ledger p on p.run_id = r.id "
        "where r.stage = 'train-dp' and r.technique != 'flow'"
    )
    assert len(sources) == 4
    for mlflow_id, config_json, eps in sources:
        expected = NOISE_SOURCES["seeded"] if eps is not None else "none (non-private)"
        assert json.loads(config_json)["noise_source"] == expected
        assert client.get_run(mlflow_id).data.tags["privbench.noise_source"] == expected


# ------------------------------------------------------------------------------ the search on validation
def _tuned_config(**tuning: object):
    assert TINY.train_dp is not None
    data = TINY.train_dp.model_dump() | {"lrs": [0.001, 0.005], "batch_sizes": [32, 64], "tuning": tuning or {}}
    return TINY.train_dp.model_validate(data)


def _result(point, valid: float, status: str = "finished") -> dict:
    return {
        "run_id": point.label, "dataset": point.dataset, "method": point.method, "epsilon": point.epsilon,
        "lr": point.lr, "batch_size": point.batch_size, "status": status,
        "valid_ndcg_at_10": 1.0 - valid, "valid_ndcg_at_10_masked": valid,
    }  # fmt: skip


def test_search_picks_each_methods_best_validation_point_and_the_grid_runs_only_it() -> None:
    from tasks.train_dp import expand_tuning, select_recipes

    cfg = _tuned_config(epsilon=8, seed=7)
    search = expand_tuning(cfg, {"ml-1m-tiny": "/x"})
    # transformer and dpformer at eps 8 over 2 x 2, the non-private transformer over 2 x 2: 12 points
    assert len(search) == 12 and {p.role for p in search} == {"tuning"} and {p.seed for p in search} == {7}
    assert all(p.label.endswith(":tuning") for p in search)
    values = {  # hand-made validation NDCG@10 (masked): the best of each method is known
        ("transformer", 8.0, 0.005, 32): 0.30, ("transformer", 8.0, 0.001, 64): 0.30,  # a tie: grid order wins
        ("dpformer", 8.0, 0.001, 64): 0.25, ("transformer", None, 0.005, 64): 0.40,
    }  # fmt: skip
    results = [_result(p, values.get((p.method, p.epsilon, p.lr, p.batch_size), 0.1)) for p in search]
    results[[r["method"] for r in results].index("dpformer")]["status"] = "failed"  # a diverged point is skipped
    chosen = select_recipes(cfg, results)
    assert {k: (v["lr"], v["batch_size"], v["points"]) for k, v in chosen.items()} == {
        "ml-1m-tiny|transformer|dp": (0.001, 64, 4),  # (0.001, 64) comes before (0.005, 32) in the grid
        "ml-1m-tiny|dpformer|dp": (0.001, 64, 4),
        "ml-1m-tiny|transformer|nonprivate": (0.005, 64, 4),
    }
    grid = expand_grid(cfg, {"ml-1m-tiny": "/x"}, chosen)
    got = {(p.method, p.epsilon): (p.lr, p.batch_size) for p in grid}
    assert got == {
        ("transformer", 8.0): (0.001, 64),
        ("dpformer", 8.0): (0.001, 64),
        ("transformer", None): (0.005, 64),
        ("transformer_opacus_hooks", 8.0): (0.001, 64),  # a peer follows its model's search
    }
    assert len(grid) == 4 and all(p.tuned is not None and p.role == "final" for p in grid)
    assert {p.tuned.run_id for p in grid if p.method == "dpformer"} == {
        "dpformer:ml-1m-tiny:eps8:seed7:lr0.001:b64:tuning"
    }
    # basic composition: the 4 search runs at eps 8 and the final run's own 8
    assert {p.method: p.epsilon_with_tuning for p in grid} == {
        "transformer": None,  # (the non-private one comes last and overwrites: no epsilon)
        "dpformer": 40.0,
        "transformer_opacus_hooks": 40.0,
    }


def test_a_point_at_its_recipe_is_the_grids_point() -> None:
    """``at_recipe`` (which the membership audit uses for its models) gives exactly the point the grid trains:
    the non-private schedule where it applies and the search's (lr, batch size) where the search chose one."""
    from tasks.train_dp import GridPoint, at_recipe, expand_tuning, select_recipes

    cfg = _tuned_config(epsilon=8, seed=7)
    cfg = cfg.model_validate(cfg.model_dump() | {"nonprivate_schedule": {"epochs": 7, "batch_size": 16}})
    search = expand_tuning(cfg, {"ml-1m-tiny": "/x"})
    chosen = select_recipes(
        cfg, [_result(p, 0.5 if p.lr == 0.005 and p.batch_size in (16, 64) else 0.1) for p in search]
    )
    grid = {(p.method, p.epsilon, p.seed): p for p in expand_grid(cfg, {"ml-1m-tiny": "/x"}, chosen)}
    for (method, epsilon, seed), point in grid.items():
        first = GridPoint("ml-1m-tiny", "/x", point.dropout, method, epsilon, seed, cfg.lrs[0], cfg.batch_sizes[0])
        assert at_recipe(first, cfg, chosen) == point and point.lr == 0.005
        assert point.batch_size == (16 if epsilon is None else 64)
        assert (point.epochs == 7) == (epsilon is None)
    plain = GridPoint("ml-1m-tiny", "/x", 0.2, "transformer", None, 0, cfg.lrs[0], cfg.batch_sizes[0])
    assert at_recipe(plain, cfg, {}) == replace(plain, epochs=7, batch_size=16)  # no search: the grid's first
    assert at_recipe(replace(plain, epsilon=8.0), cfg, {}) == replace(plain, epsilon=8.0)


def test_search_that_diverges_everywhere_names_the_method() -> None:
    from core.errors import DivergedError
    from tasks.train_dp import expand_tuning, select_recipes

    cfg = _tuned_config(methods=["dpformer"], nonprivate=False, seed=7)
    search = expand_tuning(cfg, {"ml-1m-tiny": "/x"})
    assert {p.method for p in search} == {"dpformer"}
    with pytest.raises(DivergedError, match=r"ml-1m-tiny\|dpformer\|dp diverged .*smaller learning rates"):
        select_recipes(cfg, [_result(p, 0.1, status="failed") for p in search])


@pytest.mark.parametrize(
    "update, fragment",
    [
        ({"lrs": [0.005], "batch_sizes": [64], "tuning": {}}, "has one point"),
        ({"lrs": [0.001, 0.005], "tuning": {"seed": 0}}, r"tuning.seed=0 is also one of seeds \[0\]"),
        ({"lrs": [0.001, 0.005], "tuning": {"methods": ["gru"]}}, r"tuning.methods \['gru'\] are not in"),
    ],
)
def test_tuning_config_is_checked(update: dict, fragment: str) -> None:
    from pydantic import ValidationError

    assert TINY.train_dp is not None
    with pytest.raises(ValidationError, match=fragment):
        TINY.train_dp.model_validate(TINY.train_dp.model_dump() | update)


def test_train_dp_flow_searches_then_runs_the_chosen_points(home, prefect_harness) -> None:
    """End to end on the tiny set: the search's runs sit in stage train-dp-tuning, the results view never reads
    them, and every final run was trained at its method's chosen point and records the composed epsilon."""
    from flows.train_dp import train_dp_flow

    cfg = TINY.train_dp.model_validate(
        TINY.train_dp.model_dump()
        | {"lrs": [0.001, 0.005], "methods": ["transformer"], "peers": [], "workers": 1, "tuning": {"epsilon": 8}}
    )
    summary = train_dp_flow(cfg, TINY.prepare, profile="tiny")
    repo = ResultsRepository()
    _, rows = repo.query(
        "select r.stage, r.technique, r.config_json from runs r where r.status = 'finished' and r.technique != 'flow' "
        "and r.stage like 'train-dp%'"
    )
    search = [json.loads(c)["point"] for s, _, c in rows if s == "train-dp-tuning"]
    final = [json.loads(c)["point"] for s, _, c in rows if s == "train-dp"]
    assert len(search) == 4 and {p["role"] for p in search} == {"tuning"}  # 2 lrs, private and non-private
    assert len(final) == 2 and len(summary["runs"]) == 2
    frame = views.privacy_utility()
    assert len(frame) == 2  # the search is not a result
    _, searched = repo.query(
        "select r.config_json, m.value from runs r join metrics m on m.run_id = r.id "
        "where r.stage = 'train-dp-tuning' and m.name = 'valid_ndcg_at_10_masked'"
    )
    for p in final:  # each final run at the search point of highest masked validation NDCG@10 (grid order on ties)
        mine = [(json.loads(c)["point"], v) for c, v in searched]
        mine = [(q["lr"], v) for q, v in mine if (q["epsilon"] is None) == (p["epsilon"] is None)]
        best = max(v for _, v in mine)
        assert (p["lr"], p["tuned"]["points"], p["tuned"]["valid"]) == (
            next(lr for lr, v in mine if v == best),
            2,
            pytest.approx(best),
        )
    _, composed = repo.query("select value from metrics where name = 'epsilon_with_tuning'")
    assert [v for (v,) in composed] == [pytest.approx(24.0)]  # 2 search runs at eps 8 and the final run's 8

    # the membership audit attacks the models train-dp reports: it reads the same choice back from the store
    from pbconfig.attacks import AuditConfig
    from tasks.audit import searched_recipes

    audit = AuditConfig(datasets=["ml-1m-tiny"], methods=["transformer"], epsilons=[5], unlearning=False)
    recipes = searched_recipes(cfg, audit, "tiny")
    assert sorted(recipes) == ["ml-1m-tiny|transformer|dp"]  # both arms of an audit train at the DP recipe
    dp_final = next(p for p in final if p["epsilon"] is not None)
    pick = recipes["ml-1m-tiny|transformer|dp"]
    assert (pick["lr"], pick["batch_size"], pick["run_id"]) == (
        dp_final["lr"],
        dp_final["batch_size"],
        dp_final["tuned"]["run_id"],
    )
    with pytest.raises(ConfigError, match=r"no finished search run .*privbench run train-dp --profile other"):
        searched_recipes(cfg, audit, "other")  # another profile's search is not this one's
    moved = cfg.model_validate(cfg.model_dump() | {"lrs": [0.002, 0.003]})  # a grid the store did not search
    with pytest.raises(ConfigError, match="no finished search run"):
        searched_recipes(moved, audit, "tiny")


def test_report_shows_the_search(home, prefect_harness, tmp_path) -> None:
    """The report's recipe-search table: the chosen point of each method, its validation figure, and the
    composed epsilon, read from the store (views.train_search)."""
    from flows.train_dp import train_dp_flow
    from tasks.report import render_report

    cfg = TINY.train_dp.model_validate(
        TINY.train_dp.model_dump()
        | {"lrs": [0.001, 0.005], "methods": ["dpformer"], "peers": [], "nonprivate": False, "workers": 1,
           "tuning": {"epsilon": 8}}
    )  # fmt: skip
    train_dp_flow(cfg, TINY.prepare, profile="tiny")
    search = views.train_search()
    assert len(search) == 2 and search["chosen"].sum() == 1
    chosen = search[search["chosen"]].iloc[0]
    text = render_report(tmp_path / "r.md", profile="tiny", figures=False).path.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ml-1m-tiny | dpformer |"))
    assert f"{chosen['lr']:g} x 64" in row and f"{chosen['valid_ndcg_at_10_masked']:.4f}" in row
    assert "| 2 (2) | 100 |" in row and row.rstrip(" |").endswith("24")  # 2 search runs at eps 8 + the final 8
    sizes = views.reattention_sizes()  # the one final DPFormer run, per block, with the report's table beside it
    assert sizes["block"].tolist() == [1, 2] and (sizes["attention_tv"] >= 0).all()
    assert set(sizes["epsilon"]) == {8.0} and (sizes["correction_max"] >= sizes["correction_median"]).all()
    table = text.split("## Re-Attention's reach (DPFormer)")[1]
    assert f"| ml-1m-tiny | 8 | 1 | 1 | {sizes['correction_median'][0]:.4f} |" in table


def test_claims_name_the_recipe_they_rest_on(stage_store, monkeypatch) -> None:
    """The report's scale column names each judged method's learning rate, batch size and epochs (a search may pick
    the first two; the epochs say how far the schedule is from the paper's)."""
    from storage.claims import claims_table, evaluate_claims

    stage_store.summary("train-dp")
    stage_store.point_at(monkeypatch)
    table = claims_table(evaluate_claims(profile="tiny"), "tiny").set_index("claim")
    assert table.loc["dpformer-beats-transformer", "scale"] == (
        "tiny profile: ml-1m-tiny; dpformer lr 0.005 x 64 for 1 epoch; transformer lr 0.005 x 64 for 1 epoch"
    )


def test_the_queue_starts_the_longest_points_first_and_the_choice_ignores_it() -> None:
    """The pool takes the non-private points (the schedule's longer run) first, then DPFormer's (Re-Attention: the
    costlier epoch), then the rest, each group in grid order; the search's choice on a tie is the grid's first
    point whatever order the results come back in."""
    import random

    from tasks.train_dp import expand_tuning, select_recipes

    cfg = _tuned_config(epsilon=8, seed=7)
    cfg = cfg.model_validate(cfg.model_dump() | {"nonprivate_schedule": {"epochs": 45, "batch_size": 16}})
    search = expand_tuning(cfg, {"ml-1m-tiny": "/x"})
    kinds = [("nonprivate" if p.epsilon is None else p.method) for p in search]
    assert kinds == sorted(kinds, key=["nonprivate", "dpformer", "transformer"].index)
    grid_order = [(p.lr, p.batch_size) for p in search if p.method == "transformer" and p.epsilon is not None]
    assert grid_order == [(lr, b) for lr in cfg.lrs for b in cfg.batch_sizes]
    grid = expand_grid(cfg, {"ml-1m-tiny": "/x"})
    assert [p.epsilon is None for p in grid][:1] == [True] and grid[1].method == "dpformer"
    results = [_result(p, 0.3) for p in search]  # every point ties
    for seed in range(5):
        random.Random(seed).shuffle(results)
        chosen = select_recipes(cfg, results)
        assert (chosen["ml-1m-tiny|transformer|dp"]["lr"], chosen["ml-1m-tiny|transformer|dp"]["batch_size"]) == (
            cfg.lrs[0],
            cfg.batch_sizes[0],
        )
