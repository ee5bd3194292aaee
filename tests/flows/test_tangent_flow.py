"""The tangent flow end to end on a tiny Dinov2 and tiny IDX images: the four result groups are recorded,
composition is exact, forgetting by subtraction equals recomposing the rest, a bad shard count fails cleanly,
and with ``seeds`` the stage runs once per seed so that the TAFT claims pair their sides by seed."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import Dinov2Config, Dinov2Model

from core.errors import DataError
from flows.registry import plan
from flows.tangent import tangent_flow, tangent_runner
from pbconfig.benchmark import BenchmarkConfig, validate
from pbconfig.claims import load_claims
from storage.claims import evaluate_claims
from storage.leaderboard import config_seed
from storage.recording import record_run
from storage.repository import ResultsRepository
from tasks.prepare_images import prepare_image_dataset, write_prepared_model

if TYPE_CHECKING:
    from tests.filled_store import StageStore

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _config(**tangent: object) -> BenchmarkConfig:
    base = {
        "dataset": "tiny-images",
        "model": "tiny-vit",
        "epochs": 1,
        "batch_size": 16,
        "shards": [2, 3],
        "fig1_shards": 3,
        "fig1_trials": 2,
        "forget_fractions": [0.5],
        "task_runner": "thread",
        "workers": 2,
        "dp": {"regimes": ["full", "fc"], "epsilons": [8], "epochs": 1, "batch_size": 16},
    }
    return validate(
        BenchmarkConfig,
        {
            "profile": "tiny",
            "prepare": {
                "images": [{"name": "tiny-images", "source": "idx", "path": "/x", "image_size": 28}],
                "models": [{"name": "tiny-vit"}],
            },
            "tangent": base | tangent,
        },
        origin="test",
    )


def _write_idx(folder: Path, prefix: str, n: int, gen: torch.Generator) -> None:
    labels = torch.arange(n) % 4
    images = (torch.rand(n, 28, 28, generator=gen) * 60 + labels.view(n, 1, 1) * 50).to(torch.uint8)  # learnable
    (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">IIII", 0x803, n, 28, 28) + images.numpy().tobytes())
    )
    (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
        gzip.compress(struct.pack(">II", 0x801, n) + labels.to(torch.uint8).numpy().tobytes())
    )


@pytest.fixture
def prepared(home: Path, tmp_path: Path) -> dict[str, str]:
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as parent:
        pass
    return prepare_tiny_inputs(tmp_path / "idx", home, parent.ref)


def prepare_tiny_inputs(folder: Path, home: Path, parent_ref: Any) -> dict[str, str]:
    """Tiny MNIST-format images prepared under ``parent_ref`` and a tiny ViT in ``home/models``: the
    ``prepared`` mapping the tangent flow takes."""
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    _write_idx(folder, "train", 48, gen)
    _write_idx(folder, "t10k", 16, gen)
    cfg = _config()
    images = prepare_image_dataset.fn(cfg.prepare.images[0].model_copy(update={"path": str(folder)}), parent_ref)
    torch.manual_seed(0)
    vit = Dinov2Model(
        Dinov2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=28,
            patch_size=14,
        )
    ).eval()
    model_dir = home / "models" / "tiny-vit"
    write_prepared_model(
        vit, model_dir, name="tiny-vit", cache_key="k", source="test", source_sha256="s", spec={}, stats={}
    )
    return {"images": images.path, "model": str(model_dir)}


def test_tangent_flow_records_all_four_result_groups(stage_store: StageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = stage_store.summary("tangent")  # the tangent flow on _config() and prepare_tiny_inputs, run once
    prepared = stage_store.inputs["tangent"]
    stage_store.point_at(monkeypatch)
    repo = ResultsRepository()
    flow_run = repo.get_run(summary["run_id"])
    assert flow_run["status"] == "finished"
    _, rows = repo.query(
        "select r.technique, r.status, count(*) from runs r where r.stage = 'tangent' "
        "group by r.technique, r.status order by r.technique"
    )
    counts = {t: c for t, s, c in rows if s == "finished"}
    assert all(s == "finished" for _, s, _ in rows)
    assert counts == {
        "feature-cache": 1,
        "taft-1": 1,
        "nlft-1": 1,
        "fc": 1,
        "taft-shard": 5,
        "nlft-shard": 5,
        "taft-composed": 2,
        "model-soup": 2,
        "sisa": 2,
        "forget-subtraction": 1,
        "forget-retrain": 1,
        "forget-fraction": 1,
        "forget-taft": 1,
        "forget-taft-subtract": 1,
        "forget-sisa": 1,
        "forget-sisa-drop": 1,
        "forget-full-retrain": 1,
        "dp-full": 2,
        "dp-fc": 2,
        "flow": 1,
    }

    assert set(summary["table1"]) == {"taft-1", "nlft-1", "fc"}
    assert set(summary["table2"]) == {"2", "3"} and set(summary["table2"]["3"]) == {"taft", "soup", "sisa"}
    assert set(summary["table3"]) == {"full", "fc"} and set(summary["table3"]["full"]) == {"ours", "reg"}
    fig1 = summary["fig1"]
    assert fig1["removed"] == [0, 1, 2] and len(fig1["taft_accuracy"]) == len(fig1["sisa_accuracy"]) == 3
    assert fig1["unlearning_max_abs_err"] < 1e-6  # subtraction == composing the remaining shards
    assert all(r["taft"]["composition_max_abs_err"] < 1e-10 for r in summary["details"]["table2"])  # eq. 13, float64
    assert all(r["taft"]["composition_max_abs_err_float32"] < 1e-4 for r in summary["details"]["table2"])
    assert "Table 3" in summary["markdown"] and "| 2 |" in summary["markdown"]
    request = fig1["request"]  # one image of one of the 3 shards, served five ways
    assert len(request["examples"]) == 1 and len(request["shards"]) == 1 and "| forget-sisa |" in summary["markdown"]
    forwards = {m: request[m]["inference_forwards"] for m in request if m.startswith("forget-")}
    assert forwards == {
        "forget-taft": 1,
        "forget-taft-subtract": 1,
        "forget-sisa": 3,
        "forget-sisa-drop": 2,
        "forget-full-retrain": 1,
    }
    steps = {m: request[m]["forget_steps"] for m in forwards}
    assert steps["forget-taft-subtract"] == steps["forget-sisa-drop"] == 0
    assert 0 < steps["forget-taft"] < steps["forget-full-retrain"]  # one shard's images vs all of them
    assert max(request[m]["forget_max_abs_err"] for m in ("forget-taft", "forget-taft-subtract")) < 1e-6
    _, flow_metric = repo.query(
        "select value from metrics where run_id = :run and name = 'fig1.forget-sisa.inference_forwards'",
        {"run": summary["run_id"]},
    )
    assert flow_metric == [(3.0,)]
    _, forget_metrics = repo.query(
        "select m.name, m.value from metrics m join runs r on r.id = m.run_id where r.stage = 'tangent' "
        "and r.technique = 'forget-subtraction' and m.name in ('unlearning_max_abs_err', 'forget_output_max_abs_err')"
    )
    recorded = dict(forget_metrics)  # both in the run the claim forgetting-exact reads
    assert set(recorded) == {"unlearning_max_abs_err", "forget_output_max_abs_err"}
    assert recorded["forget_output_max_abs_err"] <= 1e-9  # float64: the subtracted model == the rest's ensemble

    _, ledger = repo.query(
        "select r.technique, p.epsilon, p.target_epsilon from runs r join privacy_ledger p "
        "on p.run_id = r.id where r.stage = 'tangent'"
    )
    assert len(ledger) == 4 and all(0 < eps <= target == 8.0 for _, eps, target in ledger)
    _, groups = repo.query(
        "select count(*) from runs where stage = 'tangent' and technique <> 'flow' and technique <> 'feature-cache'"
    )
    assert groups[0][0] == 31
    assert not (Path(prepared["model"]).parent.parent / "cache" / "tangent" / f"run-{summary['run_id']}").exists()


def test_seeds_run_the_stage_once_per_seed_and_the_taft_claims_pair_by_seed(prepared: dict[str, str]) -> None:
    dp = {"regimes": ["layernorm"], "epsilons": [8], "epochs": 1, "batch_size": 16}  # a judged regime (not fc)
    cfg = _config(shards=[2], fig1_shards=2, fig1_trials=1, dp=dp, seeds=[0, 1])
    assert cfg.tangent is not None
    summary = tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
    )
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished" and set(summary["seeds"]) == {"0", "1"}
    _, rows = repo.query("select id, parent_id, technique, status, config_json from runs where stage = 'tangent'")
    assert len(rows) == plan("tangent", cfg)["tangent"] and all(status == "finished" for *_, status, _ in rows)
    passes = {r[0]: config_seed(json.loads(r[4])) for r in rows if r[2] == "flow" and r[1] == summary["run_id"]}
    assert sorted(passes.values()) == [0, 1]  # one seed pass each, its config carrying its seed
    assert {passes[summary["seeds"][s]["run_id"]] for s in ("0", "1")} == {0, 1}
    assert all(r[1] in passes for r in rows if r[2] == "taft-1")  # every task run under its pass

    taft = [c for c in load_claims() if c.paper == "TAFT"]
    assert len(taft) == 8
    for result in evaluate_claims(profile="tiny", claims=taft):  # every context measured on both seeds
        m = result.claim.measure
        assert result.contexts, result.claim.id
        for ctx in result.contexts:
            assert (ctx.n_a, ctx.n_b) == (2, 2 if m.b is not None else 0), (result.claim.id, ctx)
            assert len(ctx.values) == 2, (result.claim.id, ctx)  # per seed (paired: not the 4 cross pairs)
            if result.claim.rule.kind == "above":
                assert ctx.interval == "paired t over seeds", (result.claim.id, ctx)


def test_table2_trains_at_the_point_table1_chose_on_validation(prepared: dict[str, str]) -> None:
    """``tangent.search``: Table 1 chooses TAFT's (lr, PT, CLS) and NLFT's lr on validation, and Table 2's shards,
    its composition, Model Soup, SISA and Fig. 1 train at those points, each run recording the search; the runs are
    the same as without a search (the search trains inside the Table 1 runs), and composition stays exact."""
    search = {"lrs": {"taft": [0.01, 0.001], "nlft": [0.01, 0.001]}, "pts": [True, False], "cls": [False, True]}
    cfg = _config(shards=[2], fig1_shards=2, fig1_trials=1, dp=None, search=search | {"val_fraction": 0.25})
    assert cfg.tangent is not None and cfg.tangent.searches_table2
    summary = tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
    )
    repo = ResultsRepository()
    _, rows = repo.query("select id, technique, status, config_json from runs where stage = 'tangent'")
    assert all(status == "finished" for _, _, status, _ in rows)
    assert len(rows) == plan("tangent", _config(shards=[2], fig1_shards=2, fig1_trials=1, dp=None))["tangent"]
    config = {t: [json.loads(c) for _, tt, _, c in rows if tt == t] for t in {r[1] for r in rows}}
    (taft,), (nlft,) = config["taft-1"], config["nlft-1"]
    assert len(taft["search_grid"]) == 8 and len(nlft["search_grid"]) == 2 and "search_grid" not in config["fc"][0]
    chosen = {k: taft[k] for k in ("lr", "pretrained", "cls")}
    for technique in ("taft-shard", "taft-composed"):  # Table 2's TAFT at Table 1's choice, the search recorded
        assert all(
            {k: c[k] for k in chosen} == chosen and c["search_grid"] == taft["search_grid"] for c in config[technique]
        )
    for technique in ("nlft-shard", "model-soup", "sisa"):
        assert all(c["lr"] == nlft["lr"] and c["search_grid"] == nlft["search_grid"] for c in config[technique])
    assert config["forget-retrain"][0]["lr"] == chosen["lr"]  # Fig. 1 reads Table 2's shards: the same recipe
    ids = [run_id for run_id, t, _, _ in rows if t in ("taft-composed", "model-soup", "sisa")]
    _, points = repo.query(
        "select value from metrics where name = 'tuning.points' and run_id in (" + ",".join(f"'{i}'" for i in ids) + ")"
    )
    assert sorted(v for (v,) in points) == [2.0, 2.0, 8.0]
    assert all(r["taft"]["composition_max_abs_err"] < 1e-10 for r in summary["details"]["table2"])  # eq. 13 at PT/CLS
    assert "chosen on validation" in summary["markdown"]


def test_more_shards_than_images_fails_with_the_fix_and_leaves_nothing_running(prepared: dict[str, str]) -> None:
    cfg = _config(shards=[2, 49], fig1_shards=2, dp=None)
    assert cfg.tangent is not None
    with pytest.raises(DataError, match="cannot split 48 training images into 49 shards"):
        tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
            cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
        )
    _, rows = ResultsRepository().query("select technique, status, error from runs where stage = 'tangent'")
    assert rows and all(status in ("finished", "failed") for _, status, _ in rows)
    flow_row = next(r for r in rows if r[0] == "flow")
    assert flow_row[1] == "failed" and "49 shards" in flow_row[2]


@pytest.mark.system
def test_dask_task_runner_trains_the_shards(prepared: dict[str, str]) -> None:
    """The several-machines option: the same flow on a local Dask cluster (two worker processes)."""
    cfg = _config(shards=[2], fig1_shards=2, fig1_trials=1, dp=None, task_runner="dask")
    assert cfg.tangent is not None
    summary = tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
    )
    assert set(summary["table2"]) == {"2"} and summary["fig1"]["unlearning_max_abs_err"] < 1e-6
    _, rows = ResultsRepository().query(
        "select count(*) from runs where technique = 'taft-shard' and status = 'finished'"
    )
    assert rows == [(2,)]
