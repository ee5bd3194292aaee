"""The trainer's two full-ranking protocols: history ranked and history masked (RecBole), against a plain loop
over users, a hand-scored model with known ranks, and best-epoch selection on validation only."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from core.data.sequential import SequentialDataset
from core.dp import trainer
from core.dp.schedule import run_schedule
from core.dp.trainer import EpochLog, method_config, train_seqrec
from tests.hand_made import sequential_dataset as dataset

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"d_model": 16, "max_len": 8, "batch_size": 8, "lr": 1e-2, "epochs": 2, "dropout": 0.0}
SHIFT = {"valid": 2, "test": 1}


def repeating_dataset(n_users: int = 40, n_items: int = 12, seed: int = 0) -> SequentialDataset:
    """Random sequences over few items: most users repeat items, and many targets were seen before."""
    rng = np.random.default_rng(seed)
    return dataset([rng.integers(1, n_items + 1, size=rng.integers(4, 15)).tolist() for _ in range(n_users)], n_items)


def loop_metrics(scores: Tensor, data: SequentialDataset, split: str, *, masked: bool) -> tuple[float, float]:
    """NDCG@10, HIT@10 one user at a time: mask by setting scores to -inf, count the items scored >= the target."""
    ndcg, hit = [], []
    for user in range(data.n_users):
        seq = data.sequence(user).tolist()
        target, history = seq[len(seq) - SHIFT[split]], seq[: len(seq) - SHIFT[split]]
        row = scores[user].tolist()
        row[0] = -math.inf  # padding is never ranked
        for item in history if masked else []:
            if item != target:
                row[item] = -math.inf
        rank = sum(1 for item in range(1, len(row)) if item != target and row[item] >= row[target])
        ndcg.append(1 / math.log2(rank + 2) if rank < 10 else 0.0)
        hit.append(1.0 if rank < 10 else 0.0)
    return sum(ndcg) / len(ndcg), sum(hit) / len(hit)


def test_both_protocols_match_a_python_loop_over_users() -> None:
    data = repeating_dataset()
    seen_before = sum(data.sequence(u)[-1] in data.sequence(u)[:-1] for u in range(data.n_users))
    assert seen_before >= 5  # the target-is-never-masked rule is exercised
    result = train_seqrec(data, method_config("transformer", **TINY, clipping="nonprivate"))
    final = result.history[-1]
    for split in ("valid", "test"):
        inputs, _ = data.padded_batch(np.arange(data.n_users), TINY["max_len"], split)  # type: ignore[arg-type]
        with torch.inference_mode():  # one batch, as in the trainer (N < EVAL_BATCH_SIZE): the same scores
            scores = result.model.output(result.model.hidden(inputs)[:, -1])
        ranked = loop_metrics(scores, data, split, masked=False)
        masked = loop_metrics(scores, data, split, masked=True)
        assert (getattr(final, f"{split}_ndcg10"), getattr(final, f"{split}_hit10")) == pytest.approx(ranked, abs=1e-12)
        fast_masked = (getattr(final, f"{split}_ndcg10_masked"), getattr(final, f"{split}_hit10_masked"))
        assert fast_masked == pytest.approx(masked, abs=1e-12)
        assert masked[0] > ranked[0]  # fewer competitors: masking can only raise a rank
    assert result.final_test_ndcg10_masked == final.test_ndcg10_masked


class HandScores(nn.Module):
    """Scores item ``i`` as ``i`` for every user: a higher id ranks higher."""

    def __init__(self, n_items: int) -> None:
        super().__init__()
        self.register_buffer("row", torch.arange(n_items + 1, dtype=torch.float32))

    def hidden(self, input_ids: Tensor, score_correction: object = None) -> Tensor:
        return torch.zeros(*input_ids.shape, 1)

    def output(self, hidden: Tensor) -> Tensor:
        return self.row.expand(hidden.shape[0], -1).clone()


def test_hand_scored_model_has_the_known_ranks() -> None:
    """Item i scores i among 20 items (0-based rank = # higher ids competing).

    user 0 = [20, 19, 18, 17, 5, 20, 7]: valid target 20 (seen before, never masked): rank 0 in both.
      test target 7: ranked, 8..20 compete -> rank 13 (miss); masked, 20, 19, 18, 17 go -> rank 9 (hit).
    user 1 = [1, 20, 19, 2, 12, 15]: valid target 12: rank 8 ranked, 6 masked (20, 19 go).
      test target 15: rank 5 ranked, 3 masked.
    """
    data = dataset([[20, 19, 18, 17, 5, 20, 7], [1, 20, 19, 2, 12, 15]], n_items=20)
    cfg = method_config("transformer", **TINY | {"batch_size": 2}, clipping="nonprivate")
    run = trainer._Run(data, cfg, run_schedule(data, cfg), torch.device("cpu"))
    run.model = HandScores(data.n_items)
    try:
        log = run.evaluate(epoch=1, started=time.perf_counter())
    finally:
        run.close()

    def ndcg(rank: int) -> float:
        return 1 / math.log2(rank + 2) if rank < 10 else 0.0

    expected = {
        "valid_ndcg10": (ndcg(0) + ndcg(8)) / 2,
        "valid_ndcg10_masked": (ndcg(0) + ndcg(6)) / 2,
        "test_ndcg10": (ndcg(13) + ndcg(5)) / 2,
        "test_ndcg10_masked": (ndcg(9) + ndcg(3)) / 2,
        "valid_hit10": 1.0,
        "valid_hit10_masked": 1.0,
        "test_hit10": 0.5,
        "test_hit10_masked": 1.0,
    }
    assert {name: getattr(log, name) for name in expected} == pytest.approx(expected, abs=1e-12)


def test_each_protocol_selects_its_best_epoch_on_its_own_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted evaluations: the best test values sit at epochs no validation picks; they must not be chosen."""
    scripted = {  # epoch: (valid, valid_masked, test, test_masked)
        1: (0.50, 0.10, 0.01, 0.02),
        2: (0.40, 0.60, 0.03, 0.04),
        3: (0.30, 0.20, 0.90, 0.95),
    }

    def evaluate(self: trainer._Run, epoch: int, started: float) -> EpochLog:
        valid, valid_masked, test, test_masked = scripted[epoch]
        return EpochLog(
            epoch=epoch, step=self.step, train_loss=1.0, valid_ndcg10=valid, valid_hit10=valid,
            test_ndcg10=test, test_hit10=test, valid_ndcg10_masked=valid_masked, valid_hit10_masked=valid_masked,
            test_ndcg10_masked=test_masked, test_hit10_masked=test_masked, epsilon_spent=math.inf, wall_s=0.0,
        )  # fmt: skip

    monkeypatch.setattr(trainer._Run, "evaluate", evaluate)
    data = repeating_dataset(n_users=16)
    cfg = method_config("gru", **TINY | {"epochs": 3}, clipping="nonprivate", eval_every=1)
    result = train_seqrec(data, cfg)
    assert (result.best_epoch, result.test_ndcg10, result.test_hit10) == (1, 0.01, 0.01)
    assert (result.best_epoch_masked, result.test_ndcg10_masked, result.test_hit10_masked) == (2, 0.04, 0.04)
    assert (result.final_test_ndcg10_masked, result.final_test_hit10_masked) == (0.95, 0.95)
