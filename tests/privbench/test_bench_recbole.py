"""`privbench bench recbole-sasrec` (the peer check): its setting and ``--set`` validation, RecBole's config
carrying the train-dp protocol, the user subsample, and a tiny real RecBole run recorded with its metrics."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from core.data import parse_ratings, parse_recbole, recbole_ml100k_path
from core.data.ratings import Interactions
from core.data.sequential import SequentialDataset, build_sequential_dataset
from core.errors import ConfigError, DataError
from privbench.bench import recbole_sasrec, recbole_worker
from privbench.bench.harness import resolve_benchmark, run_in_fresh_process
from privbench.cli import app
from storage.repository import ResultsRepository

OURS = tuple(
    f"{split}_{metric}_at_10_{protocol}_ours"
    for split in ("valid", "test")
    for metric in ("ndcg", "hit")
    for protocol in ("ranked", "masked")
)
METRICS = ("test_ndcg_at_10", "test_hit_at_10", "valid_ndcg_at_10", "best_epoch", "epochs_run", "train_s", *OURS)
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
    assert config["normalize_all"] is False  # the timestamps RecBole reads are ranks (write_inter_file)
    assert recbole_sasrec.recbole_dataset(setting) == "ml-100k-all"
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


def test_the_user_subsample_keeps_the_first_users_of_the_file() -> None:
    inter = Interactions(np.array(["3", "1", "3", "2", "1"]), np.array(["1", "2", "4", "2", "5"]), [5] * 5, [10] * 5)
    kept = recbole_worker.first_users(inter, 2)
    assert kept.users.tolist() == ["3", "1", "3", "1"] and kept.items.tolist() == ["1", "2", "4", "5"]
    assert recbole_worker.first_users(inter, None) is inter


def test_recbole_gets_the_rows_with_time_ranks_that_break_ties_by_file_order(tmp_path: Path) -> None:
    """RecBole reads timestamps as float32 and sorts them unstably: the file it reads holds each row's rank in time
    order (equal timestamps in file order, as privbench's preparation orders them), which it cannot reorder."""
    stamps = np.array([881250949, 881250949, 5, 881250950, 881250949, 5])
    assert recbole_worker.time_ranks(stamps).tolist() == [2, 3, 0, 5, 4, 1]
    users, items = np.array(["7", "7", "8", "7", "8", "8"]), np.array(["a", "b", "c", "d", "e", "f"])
    inter = Interactions(users, items, [1] * 6, stamps)
    target = tmp_path / "x.inter"
    recbole_worker.write_inter_file(inter, target)
    rows = ["7\ta\t2", "7\tb\t3", "8\tc\t0", "7\td\t5", "8\te\t4", "8\tf\t1"]
    assert target.read_text() == "user_id:token\titem_id:token\ttimestamp:float\n" + "".join(f"{r}\n" for r in rows)
    again = parse_recbole(target)  # privbench reads the written file into the same sequences as the original rows
    ours, theirs = build_sequential_dataset(inter, k=1), build_sequential_dataset(again, k=1)
    assert ours.items.tolist() == theirs.items.tolist() and ours.offsets.tolist() == theirs.offsets.tolist()


def _dataset(sequences: dict[str, list[str]], items: list[str]) -> SequentialDataset:
    codes = {item: i + 1 for i, item in enumerate(items)}
    flat = [codes[i] for seq in sequences.values() for i in seq]
    return SequentialDataset(
        items=np.array(flat),
        timestamps=np.arange(len(flat)),
        offsets=np.cumsum([0, *(len(seq) for seq in sequences.values())]),
        raw_user_ids=np.array(list(sequences)),
        raw_item_ids=np.array(items),
    )


def test_the_split_is_compared_in_raw_tokens_and_a_difference_is_refused() -> None:
    ours = _dataset({"u1": ["a", "b", "c", "d"], "u2": ["c", "a", "b"]}, ["a", "b", "c", "d"])
    test = recbole_worker.our_split(ours, "test", 2)  # the last 2 inputs, then the target
    assert test == {"u1": ["b", "c", "d"], "u2": ["c", "a", "b"]}
    assert recbole_worker.our_split(ours, "valid", 50) == {"u1": ["a", "b", "c"], "u2": ["c", "a"]}
    recbole_worker.check_same_split(test, dict(test), "test")
    with pytest.raises(DataError, match=r"test split differs from privbench's for 1 of 2 users, e.g. user u2"):
        recbole_worker.check_same_split(test, test | {"u2": ["a", "c", "b"]}, "test")
    with pytest.raises(DataError, match=r"for 1 of 2 users, e.g. user u1: RecBole None"):
        recbole_worker.check_same_split(test, {"u2": test["u2"]}, "test")


class _LastItemModel(torch.nn.Module):
    """A stand-in for RecBole's SASRec: scores every RecBole item j as 0.1 j, plus 1 for the input's last item."""

    ITEM_SEQ, ITEM_SEQ_LEN = "item_id_list", "item_length"

    def __init__(self, n_items: int) -> None:
        super().__init__()
        self.n_items = n_items
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple[list[list[int]], list[int]]] = []

    def full_sort_predict(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seq, lengths = batch[self.ITEM_SEQ], batch[self.ITEM_SEQ_LEN]
        self.seen.append((seq.tolist(), lengths.tolist()))
        last = seq.gather(1, (lengths - 1)[:, None])
        return 0.1 * torch.arange(self.n_items) + (torch.arange(self.n_items)[None, :] == last).float()


def test_recbole_scores_come_back_in_our_item_columns() -> None:
    ours = _dataset({"u": ["a", "b", "c"]}, ["a", "b", "c"])
    to_recbole = recbole_worker.recbole_item_ids(ours, ["[PAD]", "c", "a", "b"])
    assert to_recbole.tolist() == [0, 2, 3, 1]
    model = _LastItemModel(4)
    inputs = torch.tensor([[0, 1, 2], [3, 3, 1], [0, 0, 3]])  # privbench ids, left-padded
    scores = recbole_worker.recbole_scores(model, inputs, to_recbole, batch_size=2)
    # RecBole sees its ids, the items first: [a b] -> [2 3], [c c a] -> [1 1 2], [c] -> [1]; two batches
    assert model.seen == [([[2, 3, 0], [1, 1, 2]], [2, 3]), ([[1, 0, 0]], [1])]
    # columns in privbench's order (pad, a, b, c) = RecBole's (0, 2, 3, 1); the last item gets +1
    expected = torch.tensor([[0.0, 0.2, 1.3, 0.1], [0.0, 1.2, 0.3, 0.1], [0.0, 0.2, 0.3, 1.1]])
    assert torch.allclose(scores, expected)
    left, lengths = recbole_worker.right_aligned(torch.tensor([[0, 0, 5], [4, 6, 7]]))
    assert left.tolist() == [[5, 0, 0], [4, 6, 7]] and lengths.tolist() == [1, 3]
    with pytest.raises(DataError, match=r"RecBole kept 2 items, privbench 3 \(privbench only, e.g. \['b'\]"):
        recbole_worker.recbole_item_ids(ours, ["[PAD]", "c", "a"])


def test_ranking_metrics_on_a_hand_made_score_matrix() -> None:
    """12 items; ranks worked out by hand under pessimistic ties, with the history ranked and masked."""
    scores = torch.zeros(3, 13)
    scores[0, [1, 2, 3, 5]] = torch.tensor([0.9, 0.5, 0.5, 0.7])  # target 2 ties item 3
    scores[1, 0], scores[1, 4] = 5.0, 0.8  # target 4 is the best real item; padding is never ranked
    scores[2, 1:] = 1.0  # target 12 ties all 11 other items
    targets = torch.tensor([2, 4, 12])
    history = torch.zeros(3, 13, dtype=torch.bool)
    history[0, [1, 5]] = True  # ranked: 1, 3, 5 above the target (rank 3); masked: 3 (rank 1)
    history[1, [1, 2]] = True  # rank 0 either way
    history[2, 1:10] = True  # ranked: rank 11, outside the top 10; masked: 10 and 11 above (rank 2)
    got = recbole_worker.ranking_metrics(scores, targets, history)
    assert got["ndcg_at_10_ranked"] == pytest.approx((1 / math.log2(5) + 1 + 0) / 3)
    assert got["hit_at_10_ranked"] == pytest.approx(2 / 3)
    assert got["ndcg_at_10_masked"] == pytest.approx((1 / math.log2(3) + 1 + 1 / math.log2(4)) / 3)
    assert got["hit_at_10_masked"] == pytest.approx(1.0)
    assert got["target_ties"] == 2  # rows 0 and 2


@needs_recbole
def test_recbole_builds_the_split_our_prepare_stage_builds() -> None:
    """On all of ml-100k, RecBole's validation and test example of every user (inputs and target, in raw tokens)
    and its items are those privbench's preparation (parse, 5-core, leave-last-out) gives."""
    setting = recbole_sasrec.resolve_setting("paper", {})
    theirs = run_in_fresh_process(
        "privbench.bench.recbole_worker:recbole_splits",
        {"setting": setting.model_dump(mode="json")},
        label="RecBole's split",
        timeout=600,
        threads=1,
    )
    ours = build_sequential_dataset(parse_ratings("recbole-inter", recbole_ml100k_path()), k=5)
    assert (ours.n_users, ours.n_items) == (943, 1349)
    assert sorted(theirs["items"]) == sorted(str(t) for t in ours.raw_item_ids)
    tokens = ours.raw_item_ids
    for split, shift in (("valid", 2), ("test", 1)):
        assert len(theirs[split]) == ours.n_users
        for user, raw in enumerate(ours.raw_user_ids):
            seq = [str(tokens[i - 1]) for i in ours.sequence(user)]
            target = len(seq) - shift
            assert theirs[split][str(raw)] == seq[max(0, target - 50) : target + 1], (split, raw)


@needs_recbole
def test_tiny_run_is_recorded_with_its_metrics(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """RecBole's real SASRec, 1 epoch on the first 30 users: the metrics, the seed in the config, the dataset; and
    privbench's scoring of its best checkpoint agrees with RecBole's own full sort with the history ranked (RecBole
    masks no history for a sequential model) to within tie handling: RecBole's top-k orders tied scores somehow,
    privbench ranks a tie above the target, so the two agree where no target ties and ours is lower otherwise."""
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
    assert metrics["test_ndcg_at_10_masked_ours"] == pytest.approx(body["test_ndcg_at_10_masked_ours"])
    for split in ("valid", "test"):
        ties = body[f"{split}_target_ties_ours"]
        for metric in ("ndcg", "hit"):
            theirs, ours = body[f"{split}_{metric}_at_10"], body[f"{split}_{metric}_at_10_ranked_ours"]
            if ties == 0:  # RecBole rounds to 8 decimals (metric_decimal_place)
                assert abs(ours - theirs) <= 1e-8, (split, metric, ours, theirs)
            else:
                assert ours <= theirs + 1e-8 and theirs - ours <= ties / 30 + 1e-8, (split, metric, ties)
            assert body[f"{split}_{metric}_at_10_masked_ours"] >= ours  # masking only removes competitors
