"""Tables 1-2's search on a tiny ViT and tiny images (``tangent.search``): the config and its errors, a one-point
grid that trains once on all the images and records what it recorded before, a searched method chosen on a
validation part (the test set read only by the retrained run) with the search recorded, and Table 2's shards at
Table 1's choice."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from core.errors import ConfigError, DataError
from core.tangent import experiments
from core.tangent import search as search_module
from core.tangent.search import FTPoint, Selection
from core.tangent.train import train_tangent
from pbconfig.benchmark import load_config
from pbconfig.tangent import TangentConfig, TangentSearchConfig
from storage.recording import RunRef, record_run
from storage.repository import ResultsRepository
from tasks import tangent as T
from tasks.tangent import TABLE1, cache_features, check_search, load_features, train_full, train_shard, tune_table2
from tasks.tangent_inputs import ShardJob, TangentInputs, train_config
from tests.flows.test_tangent_flow import _config, prepared  # noqa: F401  (the fixture)

SEARCH = {"lrs": {"taft": [0.01, 0.001], "nlft": [0.01, 0.001]}, "pts": [True, False], "val_fraction": 0.25}
BEFORE_KEYS = {"method", "test_accuracy", "train_accuracy", "train_s", "trainable_parameters", "steps"}


# ------------------------------------------------------------------------------ the config
def test_the_default_is_one_point_built_from_the_stage_values() -> None:
    cfg = TangentConfig(dataset="d", model="m", lr=0.01, nlft_lr=0.002, fc_lr=0.03, reinit_last_block=True)
    taft, nlft, fc = (cfg.method_grid(m) for m in ("taft", "nlft", "fc"))
    assert (taft.lrs, taft.pts, taft.cls, taft.points) == ((0.01,), (False,), (False,), 1)
    assert (nlft.lrs, fc.lrs, nlft.points, fc.points) == ((0.002,), (0.03,), 1, 1)
    assert not cfg.searches_table2
    quick = load_config("quick").tangent  # the quick profile runs no search: Table 1 at one point per method
    assert quick is not None and all(quick.method_grid(m).points == 1 for m in TABLE1) and not quick.searches_table2


def test_the_reference_profile_searches_the_learning_rates_only() -> None:
    """App. A's {1e-3, 1e-4} for every method on validation, App. A's schedule scaled to 10 epochs; PT and CLS
    stay at one value each (cut for the budget, said in the profile)."""
    t = load_config("reference").tangent
    assert t is not None and t.epochs == 10 and t.lr_milestones == (5, 8) and t.searches_table2
    for method in TABLE1:
        assert set(t.method_grid(method).lrs) == {1e-3, 1e-4}
    taft = t.method_grid("taft")
    assert (taft.pts, taft.cls, taft.points) == ((True,), (False,), 2)


def test_the_paper_profile_searches_app_a_grid() -> None:
    t = load_config("paper").tangent
    assert t is not None and t.epochs == 30 and t.lr_milestones == (15, 25)
    taft = t.method_grid("taft")
    assert set(taft.lrs) == {1e-3, 1e-4} and set(taft.pts) == set(taft.cls) == {True, False} and taft.points == 8
    assert set(t.method_grid("nlft").lrs) == set(t.method_grid("fc").lrs) == {1e-3, 1e-4} and t.searches_table2


def test_with_point_collapses_the_method_to_the_chosen_point() -> None:
    cfg = TangentConfig(dataset="d", model="m", search=SEARCH | {"cls": [False, True]})
    tuned = cfg.with_point("taft", lr=0.005, pretrained=False, cls=True).with_point("nlft", lr=0.001)
    assert (tuned.lr, tuned.reinit_last_block, tuned.linearize_cls_token, tuned.nlft_lr) == (0.005, True, True, 0.001)
    assert tuned.method_grid("taft").points == tuned.method_grid("nlft").points == 1 and not tuned.searches_table2
    assert tuned.search.val_fraction == 0.25
    with pytest.raises(ValueError, match="PT and CLS are TAFT's knobs; nlft has neither"):
        cfg.with_point("nlft", lr=0.001, pretrained=False)


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"lrs": {"taft": [0.001, 0.001]}}, "learning rates in search.lrs.taft must be distinct, got [0.001, 0.001]"),
        ({"lrs": {"nlft": [0.0]}}, "every learning rate in search.lrs.nlft must be a finite number > 0, got [0.0]"),
        ({"lrs": {"fc": []}}, "search.lrs.fc is empty; give at least one learning rate, or null for [fc_lr]"),
        ({"lrs": {"sisa": [0.001]}}, "search.lrs names ['sisa'], not Table 1 methods; known: taft, nlft, fc"),
        ({"pts": [True, True]}, "search.pts (PT) values must be distinct, got [True, True]; [true, false] searches"),
        ({"cls": []}, "search.cls (CLS) is empty; give [true], [false] or [true, false], or null for [linearize"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"nlft_pts": [True]}, "nlft_pts"),  # PT and CLS are TAFT's: no such knob for the other methods
    ],
)
def test_bad_search_values_name_the_value_and_the_fix(search: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        TangentConfig(dataset="d", model="m", search=search)
    assert message in str(err.value)


def test_bad_search_values_in_a_profile_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"tangent\.search\.lrs\.taft = \[0\.01, 0\.01\]: .*must be distinct"):
        load_config("quick", overrides=("tangent.search.lrs.taft=[0.01, 0.01]",))


# ------------------------------------------------------------------------------ the tasks
def _setup(prepared: dict[str, str], **tangent: object) -> tuple[TangentConfig, TangentInputs, RunRef]:  # noqa: F811
    cfg = _config(dp=None, **tangent).tangent
    assert cfg is not None
    with record_run(flow="tangent", stage="tangent", technique="flow", config={}, track=False) as parent:
        pass
    return cfg, cache_features.fn(cfg, prepared["images"], prepared["model"], parent.ref), parent.ref


def _runs(technique: str) -> list[tuple[str, dict[str, Any]]]:
    _, rows = ResultsRepository().query(
        "select id, config_json from runs where technique = :t and status = 'finished'", {"t": technique}
    )
    return [(run_id, json.loads(config)) for run_id, config in rows]


def _metrics(run_id: str) -> dict[str, list[tuple[int, float]]]:
    _, rows = ResultsRepository().query(
        "select name, step, value from metrics where run_id = :r order by name, step", {"r": run_id}
    )
    out: dict[str, list[tuple[int, float]]] = {}
    for name, step, value in rows:
        out.setdefault(name, []).append((step, value))
    return out


class _Spy:
    """Wraps ``table1_cell``, noting each call's method, training size and whether it evaluated on the test set."""

    def __init__(self, test_h: torch.Tensor) -> None:
        self.calls: list[tuple[str, int, bool]] = []
        self.test_h, self.real = test_h, experiments.table1_cell

    def __call__(self, method: str, backbone: Any, head: Any, h: torch.Tensor, *a: Any, **kw: Any) -> Any:
        eval_h = a[1]  # after the training labels
        on_test = eval_h.shape == self.test_h.shape and torch.equal(eval_h, self.test_h)
        self.calls.append((method, h.shape[0], on_test))
        return self.real(method, backbone, head, h, *a, **kw)


def test_one_point_trains_once_on_all_images_and_records_as_before(
    home: Path,
    prepared: dict[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, inputs, parent = _setup(prepared)
    f = load_features(inputs.features_path)
    spy = _Spy(f["test_h"])
    monkeypatch.setattr(experiments, "table1_cell", spy)
    monkeypatch.setattr(T, "search_table1", lambda *a, **k: pytest.fail("a one-point grid must not search"))
    results = {m: train_full.fn(m, cfg, inputs, parent) for m in TABLE1}
    assert spy.calls == [(m, 48, True) for m in TABLE1]  # once each, on all 48 training images, tested on test
    for method, r in results.items():
        assert set(r) == BEFORE_KEYS, method
        ((run_id, config),) = _runs(r["method"])
        assert config == {"method": method, **T.config_json(train_config(cfg, method)), "k": cfg.k}
        assert not [n for n in _metrics(run_id) if n.startswith("tuning.")]
    model = T.tangent_model(inputs, cfg)  # the code path before the search: TAFT trained on all, read on test
    train_tangent(model, f["train_h"], f["train_y"], train_config(cfg, "taft"))
    before = experiments.accuracy(experiments.logits_of(model, f["test_h"]), f["test_y"])
    assert results["taft"]["test_accuracy"] == before


def test_a_searched_method_is_chosen_on_validation_and_retrained_on_all(
    home: Path,
    prepared: dict[str, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, inputs, parent = _setup(prepared, search=SEARCH)
    f = load_features(inputs.features_path)
    spy = _Spy(f["test_h"])
    monkeypatch.setattr(experiments, "table1_cell", spy)
    monkeypatch.setattr(search_module, "table1_cell", spy)
    r = train_full.fn("taft", cfg, inputs, parent)
    assert spy.calls == [("taft", 36, False)] * 4 + [("taft", 48, True)]  # 4 points on 36 images, then all 48
    assert (r["tuning.points"], r["tuning.n_fit"], r["tuning.n_val"]) == (4, 36, 12)
    search = Selection.from_dict(r["search"])
    assert search.grid == (FTPoint(0.01, True), FTPoint(0.01, False), FTPoint(0.001, True), FTPoint(0.001, False))
    best = max(v for v in search.valid_accuracy if math.isfinite(v))
    assert search.chosen == search.valid_accuracy.index(best)  # the best validation accuracy, the first on ties
    assert (r["lr"], r["pretrained"], r["cls"]) == (search.point.lr, search.point.pretrained, search.point.cls)
    ((run_id, config),) = _runs("taft-1")
    assert config["search_grid"] == [[p.lr, p.pretrained, p.cls] for p in search.grid]
    chosen = (search.point.lr, search.point.pretrained, search.point.cls, 0.25)
    assert (config["lr"], config["pretrained"], config["cls"], config["val_fraction"]) == chosen
    metrics = _metrics(run_id)
    assert metrics["tuning.valid_accuracy_by_point"] == [
        (j, v) for j, v in enumerate(search.valid_accuracy) if math.isfinite(v)
    ]
    assert [v for _, v in metrics["tuning.valid_accuracy"]] == [best] and len(metrics["tuning.search_s"]) == 1
    assert [v for _, v in metrics["lr"]] == [search.point.lr]
    assert [v for _, v in metrics["test_accuracy"]] == [r["test_accuracy"]]

    fc = train_full.fn("fc", cfg, inputs, parent)  # search.lrs.fc is null: one point, no search
    assert set(fc) == BEFORE_KEYS and spy.calls[-1] == ("fc", 48, True)


def test_a_search_that_cannot_split_fails_before_training(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    cfg, inputs, _ = _setup(prepared, search=SEARCH | {"val_fraction": 0.001})
    with pytest.raises(
        DataError, match="0.001 of 48 training images leaves an empty part.*tangent.search.val_fraction"
    ):
        check_search(cfg, inputs)
    check_search(cfg.model_copy(update={"search": TangentSearchConfig(val_fraction=0.001)}), inputs)  # no grid


def test_table2_shards_train_at_table1s_choice_and_record_it(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    cfg, inputs, parent = _setup(prepared, search=SEARCH)
    grid = tuple(FTPoint(lr, pt) for lr in (0.01, 0.001) for pt in (True, False))
    taft = Selection(grid, (0.1, 0.2, 0.4, 0.3), 2, 36, 12, 1.0)
    nlft = Selection((FTPoint(0.01), FTPoint(0.001)), (0.5, 0.25), 0, 36, 12, 1.0)
    table1 = {"taft": {"search": taft.as_dict()}, "nlft": {"search": nlft.as_dict()}, "fc": {}}
    tuned, tuning = tune_table2(cfg, table1)
    assert (tuned.lr, tuned.reinit_last_block, tuned.linearize_cls_token, tuned.nlft_lr) == (0.001, False, False, 0.01)
    assert tuning == {"taft": taft, "nlft": nlft} and not tuned.searches_table2
    assert tune_table2(cfg.with_point("taft", lr=0.01).with_point("nlft", lr=0.01), {"taft": {}, "nlft": {}})[1] == {}
    for kind, lr in (("taft", 0.001), ("nlft", 0.01)):
        train_shard.fn(ShardJob(kind, 2, 0), tuned, inputs, parent, tuning)
        ((run_id, config),) = _runs(f"{kind}-shard")
        assert config["lr"] == lr and len(config["search_grid"]) == tuning[kind].points
        assert [v for _, v in _metrics(run_id)["tuning.points"]] == [tuning[kind].points]
    assert _runs("taft-shard")[0][1]["pretrained"] is True  # PT=T chosen: the pretrained block linearised
