"""Ranking metrics: hand-worked examples, ties, padding, exclusion, k > M, batching, sampled variant."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ConfigError, DataError
from core.metrics import (
    TieBreak,
    hit_at_k,
    hit_from_ranks,
    ndcg_at_k,
    ndcg_from_ranks,
    rank_of_target,
    sampled_rank_of_target,
)

# M = 5 items (ids 1..5), column 0 = padding.
SCORES = torch.tensor(
    [
        # pad  1    2    3    4    5
        [9.0, 0.1, 0.5, 0.3, 0.9, 0.2],  # target 3 (0.3): items 2 (0.5), 4 (0.9) above -> rank 2
        [0.0, 0.7, 0.7, 0.7, 0.1, 0.0],  # target 2 (0.7): tied with 1 and 3 -> rank 2 / 0
        [0.0, 0.2, 0.3, 0.4, 0.5, 1.0],  # target 5 (1.0): the best -> rank 0
    ]
)
TARGETS = torch.tensor([3, 2, 5])


def test_hand_worked_ranks_and_metrics() -> None:
    ranks = rank_of_target(SCORES, TARGETS)
    assert ranks.tolist() == [2, 2, 0]  # padding's 9.0 in row 0 is ignored
    # NDCG@10: 1/log2(2 + 2) = 0.5, 0.5, 1/log2(0 + 2) = 1
    torch.testing.assert_close(ndcg_at_k(SCORES, TARGETS, k=10), torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(hit_at_k(SCORES, TARGETS, k=10), torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))
    # k = 2: rank 2 is outside the top 2
    torch.testing.assert_close(ndcg_at_k(SCORES, TARGETS, k=2), torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(hit_at_k(SCORES, TARGETS, k=2), torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    # k = 3: rank 2 is in
    torch.testing.assert_close(hit_at_k(SCORES, TARGETS, k=3), torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64))
    assert float(ndcg_at_k(SCORES, TARGETS, k=10).mean()) == pytest.approx(2 / 3)


def test_ties_pessimistic_by_default_optimistic_on_request() -> None:
    assert rank_of_target(SCORES, TARGETS, ties="optimistic").tolist() == [2, 0, 0]
    # optimistic row 1: rank 0 -> NDCG 1
    assert ndcg_at_k(SCORES, TARGETS, ties=TieBreak.OPTIMISTIC).tolist() == [0.5, 1.0, 1.0]
    # a constant scorer must not look perfect: every other item ties above the target
    flat = torch.zeros(2, 6)
    assert rank_of_target(flat, torch.tensor([1, 4])).tolist() == [4, 4]
    assert ndcg_at_k(flat, torch.tensor([1, 4]), k=4).tolist() == [0.0, 0.0]


def test_padding_column_counts_only_when_asked() -> None:
    ranks = rank_of_target(SCORES, TARGETS, exclude_padding=False)
    assert ranks.tolist() == [3, 2, 0]  # the 9.0 padding score now ranks above target 3
    assert ndcg_at_k(SCORES, TARGETS, exclude_padding=False)[0].item() == pytest.approx(1 / math.log2(5))
    with pytest.raises(DataError, match="padding"):
        rank_of_target(SCORES, torch.tensor([0, 2, 5]))


def test_exclude_mask_removes_items_but_never_the_target() -> None:
    exclude = torch.zeros_like(SCORES, dtype=torch.bool)
    exclude[0, 4] = True  # row 0 history contains item 4 (0.9) -> only item 2 remains above
    exclude[1, 2] = True  # row 1 "excludes" its own target: ignored for the target itself
    exclude[1, 1] = True  # ... and item 1, one of the ties
    ranks = rank_of_target(SCORES, TARGETS, exclude=exclude)
    assert ranks.tolist() == [1, 1, 0]
    assert ndcg_at_k(SCORES, TARGETS, exclude=exclude)[0].item() == pytest.approx(1 / math.log2(3))
    with pytest.raises(DataError, match="exclude"):
        rank_of_target(SCORES, TARGETS, exclude=torch.zeros(3, 6))  # not bool


def test_k_larger_than_number_of_items() -> None:
    assert ndcg_at_k(SCORES, TARGETS, k=100).tolist() == [0.5, 0.5, 1.0]
    assert hit_at_k(SCORES, TARGETS, k=100).tolist() == [1.0, 1.0, 1.0]


def test_metrics_from_ranks() -> None:
    ranks = torch.tensor([0, 1, 2, 9, 10, 500])
    expected = [1.0, 1 / math.log2(3), 0.5, 1 / math.log2(11), 0.0, 0.0]
    assert ndcg_from_ranks(ranks, k=10).tolist() == pytest.approx(expected)
    assert hit_from_ranks(ranks, k=10).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def _slow_rank(scores: torch.Tensor, target: int, exclude_row: torch.Tensor | None, pessimistic: bool) -> int:
    rank = 0
    for item in range(1, scores.shape[0]):
        if item == target or (exclude_row is not None and bool(exclude_row[item])):
            continue
        if scores[item] > scores[target] or (pessimistic and scores[item] == scores[target]):
            rank += 1
    return rank


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=6),  # batch
    st.integers(min_value=2, max_value=12),  # M
    st.integers(min_value=0, max_value=2**31 - 1),  # seed
    st.booleans(),
    st.booleans(),
)
def test_rank_matches_slow_reference_and_batches_consistently(
    batch: int, num_items: int, seed: int, pessimistic: bool, use_exclude: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (batch, num_items + 1), generator=gen).float()  # many ties
    targets = torch.randint(1, num_items + 1, (batch,), generator=gen)
    exclude = torch.rand(batch, num_items + 1, generator=gen) < 0.3 if use_exclude else None
    ties = "pessimistic" if pessimistic else "optimistic"
    ranks = rank_of_target(scores, targets, exclude=exclude, ties=ties)
    expected = [
        _slow_rank(scores[b], int(targets[b]), None if exclude is None else exclude[b], pessimistic)
        for b in range(batch)
    ]
    assert ranks.tolist() == expected
    # batching: row-by-row evaluation equals the whole batch
    rows = [
        ndcg_at_k(
            scores[b : b + 1],
            targets[b : b + 1],
            exclude=None if exclude is None else exclude[b : b + 1],
            ties=ties,
        )
        for b in range(batch)
    ]
    whole = ndcg_at_k(scores, targets, exclude=exclude, ties=ties)
    assert torch.equal(torch.cat(rows), whole)


def test_sampled_rank_with_all_negatives_equals_full_rank() -> None:
    # M = 5: sampling all 4 non-target items reproduces the full ranking
    gen = torch.Generator().manual_seed(0)
    ranks = sampled_rank_of_target(SCORES, TARGETS, n_negatives=4, generator=gen)
    assert ranks.tolist() == rank_of_target(SCORES, TARGETS).tolist()


def test_sampled_rank_respects_item_probs_and_exclusion() -> None:
    gen = torch.Generator().manual_seed(0)
    # row 0: items 2 and 4 outrank target 3; give them zero probability -> rank 0 among 2 negatives
    probs = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    ranks = sampled_rank_of_target(SCORES[:1], TARGETS[:1], n_negatives=2, generator=gen, item_probs=probs)
    assert ranks.tolist() == [0]
    exclude = torch.zeros(1, 6, dtype=torch.bool)
    exclude[0, [2, 4]] = True
    ranks = sampled_rank_of_target(SCORES[:1], TARGETS[:1], n_negatives=2, generator=gen, exclude=exclude)
    assert ranks.tolist() == [0]
    with pytest.raises(DataError, match="n_negatives"):
        sampled_rank_of_target(SCORES[:1], TARGETS[:1], n_negatives=3, generator=gen, exclude=exclude)


def test_sampled_rank_is_bounded_and_seeded() -> None:
    gen_scores = torch.Generator().manual_seed(1)
    scores = torch.randn(8, 301, generator=gen_scores)
    targets = torch.randint(1, 301, (8,), generator=gen_scores)
    a = sampled_rank_of_target(scores, targets, n_negatives=100, generator=torch.Generator().manual_seed(3))
    b = sampled_rank_of_target(scores, targets, n_negatives=100, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    assert bool(((a >= 0) & (a <= 100)).all())
    assert bool((a <= rank_of_target(scores, targets)).all())  # a subset never ranks the target lower


def test_invalid_inputs() -> None:
    with pytest.raises(ConfigError, match="k"):
        ndcg_at_k(SCORES, TARGETS, k=0)
    with pytest.raises(ConfigError, match="'pessimistic', 'optimistic'"):
        rank_of_target(SCORES, TARGETS, ties="average")
    nan_scores = SCORES.clone()
    nan_scores[1, 4] = math.nan
    with pytest.raises(DataError, match="NaN"):
        rank_of_target(nan_scores, TARGETS)
    with pytest.raises(DataError, match="targets"):
        rank_of_target(SCORES, torch.tensor([1, 2, 6]))
    with pytest.raises(DataError, match="targets"):
        rank_of_target(SCORES, torch.tensor([1, 2]))
    with pytest.raises(DataError, match="scores"):
        rank_of_target(SCORES[0], TARGETS)
    with pytest.raises(ConfigError, match="n_negatives"):
        sampled_rank_of_target(SCORES, TARGETS, n_negatives=0, generator=None)
