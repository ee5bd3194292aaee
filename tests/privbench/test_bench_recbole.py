"""`privbench bench recbole-sasrec` (the peer check): its setting and ``--set`` validation, RecBole's config
carrying the train-dp protocol, the user subsample, and a tiny real RecBole run recorded with its metrics."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from privbench.bench import recbole_sasrec
from privbench.bench.harness import resolve_benchmark
from privbench.cli import app
from storage.repository import ResultsRepository

METRICS = ("test_ndcg_at_10", "test_hit_at_10", "valid_ndcg_at_10", "best_epoch", "epochs_run", "train_s")
needs_recbole = pytest.mark.skipif(importlib.util.find_spec("recbole") is None, reason="recbole is not installed")


def test_profiles_and_overrides_resolve() -> None:
    quick = recbole_sasrec.resolve_setting("quick", {})
    paper = recbole_sasrec.resolve_setting("paper", {})
    assert (paper.users, paper.epochs, paper.stopping_step, paper.seed) == (None, 300, 10, 0)
    assert quick.users is not None and quick.epochs <= 5
    for s in (quick, paper):  # the train-dp protocol: L 50, d 64, 2 blocks, 1 head, dropout 0.2, 5-core
        assert (s.max_len, s.hidden_size, s.n_layers, s.n_heads, s.dropout, s.kcore) == (50, 64, 2, 1, 0.2, 5)
    tiny = recbole_sasrec.resolve_setting("paper", {"overrides": ("recbole.epochs=2", "recbole.seed=3")})
    assert (tiny.epochs, tiny.seed, tiny.users) == (2, 3, None)
    setting = resolve_benchmark("recbole-sasrec", "quick", {"overrides": ("recbole.seed=1",)})
    assert setting["seed"] == 1 and setting["overrides"] == ["recbole.seed=1"] and setting["model"] == "SASRec"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("recbole.layers=3", "unknown key 'layers' under recbole; known keys:"),
        ("recbole.epochs=0", "recbole.epochs = 0: Input should be greater than or equal to 1"),
        ("recbole.users=5", "recbole.users = 5: Input should be greater than or equal to 10"),
        ("recbole.n_heads=3", "hidden_size=64 must be a multiple of n_heads=3"),
        ("recbole.dropout=1.5", "recbole.dropout = 1.5: Input should be less than 1"),
        ("recbole.device=tpu", "recbole.device = 'tpu': Input should be 'auto', 'cpu' or 'cuda'"),
    ],
)
def test_bad_set_is_refused_before_anything_runs(home: Path, item: str, message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "recbole-sasrec", "--set", item, "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert message in " ".join(result.stderr.split()), result.stderr
    assert ResultsRepository().list_runs() == []
    with pytest.raises(ConfigError, match="unknown profile 'huge'"):
        recbole_sasrec.resolve_setting("huge", {})


def test_recbole_config_is_the_protocol() -> None:
    setting = recbole_sasrec.resolve_setting("paper", {})
    config = recbole_sasrec.recbole_config(setting, "/data", "/saved")
    assert config["eval_args"] == {
        "split": {"LS": "valid_and_test"},
        "order": "TO",
        "group_by": "user",
        "mode": "full",
    }
    assert config["user_inter_num_interval"] == config["item_inter_num_interval"] == "[5,inf)"
    assert (config["MAX_ITEM_LIST_LENGTH"], config["hidden_size"], config["n_layers"], config["n_heads"]) == (
        50,
        64,
        2,
        1,
    )
    assert config["hidden_dropout_prob"] == config["attn_dropout_prob"] == 0.2
    assert config["loss_type"] == "CE" and config["train_neg_sample_args"] is None
    assert config["valid_metric"] == "NDCG@10" and config["metrics"] == ["NDCG", "Hit"] and config["topk"] == [10]
    assert (config["epochs"], config["stopping_step"], config["eval_step"]) == (300, 10, 1)
    assert config["gpu_id"] == "" and config["use_gpu"] is False and config["seed"] == 0
    on_gpu = recbole_sasrec.recbole_config(setting, "/data", "/saved", "cuda")
    assert on_gpu["gpu_id"] == "0" and on_gpu["use_gpu"] is True
    assert {k: v for k, v in on_gpu.items() if k not in ("gpu_id", "use_gpu")} == {
        k: v for k, v in config.items() if k not in ("gpu_id", "use_gpu")
    }  # the device changes where it runs, nothing of the protocol
    with pytest.raises(ConfigError, match="'tpu' is not cpu or cuda"):
        recbole_sasrec.recbole_config(setting, "/data", "/saved", "tpu")
    assert recbole_sasrec.recbole_dataset(setting) == "ml-100k"
    assert recbole_sasrec.recbole_dataset(setting.model_copy(update={"users": 150})) == "ml-100k-first150"


@pytest.mark.parametrize("gpu", [False, True])
def test_the_device_resolves_and_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    setting = recbole_sasrec.resolve_setting("paper", {})
    assert setting.device == "auto"
    assert recbole_sasrec.resolve_device(setting) == ("cuda" if gpu else "cpu")
    assert recbole_sasrec.resolve_device(setting.model_copy(update={"device": "cpu"})) == "cpu"
    on_gpu = recbole_sasrec.resolve_setting("paper", {"overrides": ("recbole.device=cuda",)})
    if gpu:
        assert recbole_sasrec.resolve_device(on_gpu) == "cuda"
    else:
        with pytest.raises(ConfigError, match="recbole.device=cuda but torch sees no GPU.*recbole.device=cpu"):
            recbole_sasrec.resolve_device(on_gpu)


def test_the_user_subsample_keeps_the_first_users_of_the_file(tmp_path: Path) -> None:
    source, target = tmp_path / "in.inter", tmp_path / "out.inter"
    header = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    rows = ["3\t1\t5\t10\n", "1\t2\t4\t11\n", "3\t4\t3\t12\n", "2\t2\t4\t13\n", "1\t5\t1\t14\n"]
    source.write_text(header + "".join(rows))
    recbole_sasrec.write_inter_file(source, target, 2)
    assert target.read_text() == header + rows[0] + rows[1] + rows[2] + rows[4]


@needs_recbole
def test_tiny_run_is_recorded_with_its_metrics(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RecBole's real SASRec, 1 epoch on the first 30 users: the metrics, the seed in the config, the dataset."""
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "2")
    args = ["bench", "recbole-sasrec", "--set", "recbole.epochs=1", "--set", "recbole.users=30"]
    result = CliRunner().invoke(app, [*args, "--set", "recbole.seed=7", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    for key in METRICS:
        assert math.isfinite(body[key]), key
    assert 0 <= body["test_ndcg_at_10"] <= body["test_hit_at_10"] <= 1
    assert body["epochs_run"] == body["best_epoch"] == 1 and body["stopped_early"] is False
    assert (
        body["trained_on"]
        == body["setting"]["device"]
        == recbole_sasrec.resolve_device(recbole_sasrec.resolve_setting("quick", {}))
    )
    assert body["data"]["users"] == 30 and 0 < body["data"]["items"] < 1682 and len(body["valid_curve"]) == 1
    run = ResultsRepository().get_run(body["run_id"])
    assert run["status"] == "finished" and run["technique"] == "recbole-sasrec" and run["dataset"] == "ml-100k"
    assert run["stage"] == "bench" and run["config"]["setting"]["seed"] == 7
    metrics = {m["name"]: m["value"] for m in run["metrics"]}
    assert set(METRICS) <= set(metrics), metrics
    assert metrics["test_ndcg_at_10"] == pytest.approx(body["test_ndcg_at_10"])
