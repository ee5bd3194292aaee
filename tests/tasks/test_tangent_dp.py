"""The Table 3 task on a tiny ViT and tiny images: one column of a regime searched on validation data and retrained
at every epsilon, one recorded run per cell with the chosen (lr, PT), the search and its privacy; full-batch steps
reach the ledger as sample rate 1; the search never reads the test set; the fc columns tie."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core.tangent.experiments import make_head
from pbconfig.tangent import TangentConfig
from storage.recording import RunRef, record_run
from storage.repository import ResultsRepository
from tasks.tangent import cache_features, load_backbone, load_features
from tasks.tangent_dp import DPColumn, train_dp_regime
from tasks.tangent_inputs import TangentInputs
from tests.flows.test_tangent_flow import _config, prepared  # noqa: F401  (the fixture)

pytestmark = pytest.mark.usefixtures("prefect_harness")

DP = {
    "regimes": ["fc"],
    "epsilons": [1, 8],
    "epochs": 2,
    "full_batch": True,
    "batch_size": None,
    "lrs": [0.05, 0.005],
    "pts": [True, False],
    "val_fraction": 0.25,
    "search_epsilon": 8,
}


def _setup(prepared: dict[str, str], **dp: object) -> tuple[TangentConfig, TangentInputs, RunRef]:  # noqa: F811
    cfg = _config(dp=DP | dp).tangent
    assert cfg is not None
    with record_run(flow="tangent", stage="tangent", technique="flow", config={}, track=False) as parent:
        pass
    return cfg, cache_features.fn(cfg, prepared["images"], prepared["model"], parent.ref), parent.ref


def test_a_column_is_searched_once_and_retrained_at_every_epsilon(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    cfg, inputs, parent = _setup(prepared)
    ours = train_dp_regime.fn("fc", True, cfg, inputs, parent)
    assert [r["target_epsilon"] for r in ours] == [1.0, 8.0]
    for r in ours:
        assert r["sample_rate"] == 1.0 and r["steps"] == 2  # full batch: q = 1, one step an epoch
        assert r["tuning.points"] == 4 and r["tuning.n_val"] == 12 and r["tuning.n_fit"] == 36  # 48 images
        assert r["epsilon_with_tuning"] == pytest.approx(4 * 8.0 + r["target_epsilon"])  # basic composition
        assert (r["lr"], r["pretrained"]) == (ours[0]["lr"], ours[0]["pretrained"])  # one search, at epsilon 8
    repo = ResultsRepository()
    _, rows = repo.query(
        "select r.id, r.config_json, p.sample_rate, p.steps, p.target_epsilon from runs r join privacy_ledger p "
        "on p.run_id = r.id where r.technique = 'dp-fc' and r.status = 'finished' order by p.target_epsilon"
    )
    assert [(q, steps, eps) for _, _, q, steps, eps in rows] == [(1.0, 2, 1.0), (1.0, 2, 8.0)]
    for run_id, config_json, *_ in rows:
        config = json.loads(config_json)
        assert config["parameters"] == "ours" and config["full_batch"] and config["search_epsilon"] == 8.0
        assert config["search_grid"] == [[0.05, True], [0.05, False], [0.005, True], [0.005, False]]
        assert (config["lr"], config["pretrained"]) == (ours[0]["lr"], ours[0]["pretrained"])
        assert config["batch_size"] == 48 and config["epochs"] == 2  # the whole DP training set each step
        _, series = repo.query(
            "select step, value from metrics where run_id = :r and name = 'tuning.valid_accuracy_by_point' "
            "order by step",
            {"r": run_id},
        )
        assert [s for s, _ in series] == [0, 1, 2, 3]
        chosen = config["search_grid"].index([config["lr"], config["pretrained"]])
        assert max(v for _, v in series) == series[chosen][1]  # the chosen point has the best validation accuracy
    _, timed = repo.query("select count(*) from metrics where name = 'tuning.search_s'")
    assert timed == [(1,)]  # the search ran once, in the first cell

    reg = train_dp_regime.fn("fc", False, cfg, inputs, parent)  # the fc control: the same linear model
    assert [(r["lr"], r["pretrained"]) for r in reg] == [(r["lr"], r["pretrained"]) for r in ours]
    assert [r["test_accuracy"] for r in reg] == [r["test_accuracy"] for r in ours]


def test_every_epsilon_searches_without_search_epsilon(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    cfg, inputs, parent = _setup(prepared, search_epsilon=None, full_batch=False, batch_size=12, pts=[True])
    rows = train_dp_regime.fn("fc", True, cfg, inputs, parent)
    assert [r["epsilon_with_tuning"] for r in rows] == [pytest.approx(2 * 1.0 + 1.0), pytest.approx(2 * 8.0 + 8.0)]
    assert all(r["sample_rate"] == pytest.approx(12 / 48) and r["steps"] == 8 for r in rows)
    _, timed = ResultsRepository().query("select count(*) from metrics where name = 'tuning.search_s'")
    assert timed == [(2,)]


def test_the_search_never_reads_the_test_set(home: Path, prepared: dict[str, str]) -> None:  # noqa: F811
    """A column whose test set cannot be read (no images) still searches: the search scores on validation only."""
    cfg, inputs, _ = _setup(prepared)
    assert cfg.dp is not None
    f = load_features(inputs.features_path)
    backbone = load_backbone(inputs.model_path)
    col = DPColumn(
        regime="fc",
        tangent=True,
        cfg=cfg,
        dp=cfg.dp,
        backbone=backbone,
        head=make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed),
        h=f["train_h"],
        y=f["train_y"],
        test_h=f["test_h"][:0],
        test_y=f["test_y"][:0],
        delta=1e-3,
    )
    search = col.search(8.0)
    assert search.points == 4 and all(0.0 <= v <= 1.0 for v in search.valid_accuracy)
    with pytest.raises(ValueError, match="non-empty"):  # the same column's final run does read the (empty) test set
        col.final(_NoRecord(), 8.0, search.point, col.schedule(48, search.point.lr, cfg.seed))
    full = replace(col, test_h=f["test_h"], test_y=f["test_y"]).search(8.0)
    assert full == replace(search, seconds=full.seconds)  # the test set changes nothing in the search
    assert torch.equal(col.h, f["train_h"])


class _NoRecord:
    """Stands in for a Recorder where the call fails before anything is recorded."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"nothing should be recorded, got {name}")
