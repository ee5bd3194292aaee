"""The most-popular-items floor against a plain loop over users (sorting by hand), and on cases with a known answer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.errors import ConfigError
from core.models.popularity import popularity_metrics, popularity_scores
from tests.hand_made import sequential_dataset as dataset

SHIFT = {"valid": 2, "test": 1}


def by_hand(items: list[list[int]], n_items: int, split: str, masked: bool, k: int = 10) -> tuple[float, float]:
    """NDCG@k and HIT@k by counting, user by user: the target's rank is the number of other candidate items whose
    training count is at least the target's (pessimistic ties)."""
    counts = [0] * (n_items + 1)
    for seq in items:
        for item in seq[:-2]:  # the training prefix: never a validation or test target
            counts[item] += 1
    ndcg, hit = [], []
    for seq in items:
        cut = len(seq) - SHIFT[split]
        target, history = seq[cut], set(seq[:cut]) - {seq[cut]}
        rank = sum(
            1
            for item in range(1, n_items + 1)
            if item != target and not (masked and item in history) and counts[item] >= counts[target]
        )
        ndcg.append(1 / math.log2(rank + 2) if rank < k else 0.0)
        hit.append(1.0 if rank < k else 0.0)
    return float(np.mean(ndcg)), float(np.mean(hit))


@pytest.mark.parametrize("split", ["valid", "test"])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_matches_a_loop_over_users(split: str, k: int) -> None:
    rng = np.random.default_rng(7)
    n_items = 30
    zipf = 1.0 / np.arange(1, n_items + 1)
    items = [
        rng.choice(np.arange(1, n_items + 1), size=int(rng.integers(3, 12)), p=zipf / zipf.sum()).tolist()
        for _ in range(57)
    ]
    got = popularity_metrics(dataset(items, n_items), split, k=k, batch_size=16)  # several batches
    ndcg, hit = by_hand(items, n_items, split, masked=False, k=k)
    ndcg_m, hit_m = by_hand(items, n_items, split, masked=True, k=k)
    assert got.ndcg == pytest.approx(ndcg, abs=1e-12)
    assert got.hit == pytest.approx(hit, abs=1e-12)
    assert got.ndcg_masked == pytest.approx(ndcg_m, abs=1e-12)
    assert got.hit_masked == pytest.approx(hit_m, abs=1e-12)
    assert got.ndcg_masked >= got.ndcg  # masking only removes competitors


def test_the_most_popular_item_as_every_target_scores_one() -> None:
    # item 1 fills every training prefix; every user's validation and test targets are item 1
    items = [[1, 1, 2, 1, 1], [1, 3, 1, 1], [4, 1, 1, 1]]
    for split in ("valid", "test"):
        got = popularity_metrics(dataset(items, 6), split)
        assert (got.ndcg, got.hit, got.ndcg_masked, got.hit_masked) == (1.0, 1.0, 1.0, 1.0)


def test_an_item_never_trained_on_ties_with_every_unseen_item_and_loses() -> None:
    # targets are item 6, absent from every training prefix: tied at count 0 with items 5..9, ranked below all
    items = [[1, 2, 6, 6], [2, 3, 4, 6, 6]]
    got = popularity_metrics(dataset(items, 9), "test", k=5)
    assert got.hit == 0.0 and got.ndcg == 0.0
    assert popularity_metrics(dataset(items, 9), "test", k=9).hit == 1.0  # 8 other items, all counted above


def test_scores_are_training_counts_and_padding_never_ranks() -> None:
    scores = popularity_scores(dataset([[1, 1, 2, 3, 3], [2, 2, 2, 3]], 4))
    assert scores[0] == -math.inf
    assert scores[1:].tolist() == [2.0, 3.0, 0.0, 0.0]  # the last two items of each user are held out


def test_bad_split_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"split must be one of \['valid', 'test'\], got split='train'"):
        popularity_metrics(dataset([[1, 2, 3]], 3), "train")
