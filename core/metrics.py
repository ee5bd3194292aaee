"""Next-item ranking metrics: full-ranking NDCG@k / HIT@k, and a labelled sampled variant.

The paper reports NDCG@10 and HIT@10 (Tables 1-2) for next-item prediction with one relevant item
per sequence (the held-out last item, E.1). With a single relevant item at 0-based rank ``r``,

    NDCG@k = 1 / log2(r + 2)  if r < k  else 0,          HIT@k = 1[r < k]

(the ideal DCG is 1). Ranks here are **full rankings** over all items ``1..M`` of the score matrix
``(B, M+1)``; column 0 is the padding item and is never ranked.

Rank rule: ``rank = #{candidates j != target : s_j > s_target}`` plus, under the default
:attr:`TieBreak.PESSIMISTIC`, every other candidate whose score *equals* the target's. Pessimistic
ties keep a degenerate model honest -- one that scores every item equally gets rank ``M-1``
(NDCG ~ 0), not rank 0 (NDCG = 1) as with "strictly higher" counting (:attr:`TieBreak.OPTIMISTIC`).

``exclude`` (default off) removes items from the candidate set, e.g. the items already in the user's
history. Whether to do so is a protocol choice: the paper does not say, and SASRec's original
evaluation samples negatives from items *not* in the history. It is off by default so the reported
number is the plain full ranking; the target itself is never excluded.

:func:`sampled_rank_of_target` ranks the target against ``n_negatives`` sampled items only. Sampled
metrics are NOT comparable to full-ranking ones and are inconsistent estimators of them (Krichene
& Rendle, KDD 2020); use them only to reproduce protocols that require them.
"""

from __future__ import annotations

import numbers
from enum import Enum
from typing import Any

import torch

from core.errors import ConfigError, DataError

__all__ = [
    "PADDING_IDX",
    "TieBreak",
    "hit_at_k",
    "hit_from_ranks",
    "ndcg_at_k",
    "ndcg_from_ranks",
    "rank_of_target",
    "sampled_rank_of_target",
]

#: Index of the padding item: column 0 of a ``(B, M+1)`` score matrix.
PADDING_IDX = 0


class TieBreak(str, Enum):
    """How candidates whose score equals the target's are ranked."""

    PESSIMISTIC = "pessimistic"  # tied candidates rank above the target
    OPTIMISTIC = "optimistic"  # tied candidates rank below the target (rank = # strictly higher)

    @classmethod
    def _missing_(cls, value: object) -> TieBreak:
        known = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"unknown tie rule {value!r}; known rules: {known}")


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ConfigError(f"k must be an integer >= 1, got k={k!r}")


def _check_scores_targets(scores: torch.Tensor, targets: torch.Tensor, *, exclude_padding: bool) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise DataError(
            f"scores must be a floating (B, M+1) tensor, got shape {tuple(scores.shape)}, dtype {scores.dtype}"
        )
    if targets.dim() != 1 or targets.shape[0] != scores.shape[0] or targets.dtype != torch.long:
        raise DataError(
            f"targets must be a LongTensor of shape (B,) = ({scores.shape[0]},), "
            f"got shape {tuple(targets.shape)}, dtype {targets.dtype}"
        )
    if targets.numel() == 0:
        return
    num_items = scores.shape[1]
    low = int(targets.min())
    high = int(targets.max())
    if low < 0 or high >= num_items:
        raise DataError(f"targets must be item ids in [0, {num_items - 1}], got min={low}, max={high}")
    if exclude_padding and low == PADDING_IDX:
        raise DataError(
            f"a target is the padding item {PADDING_IDX}; drop sequences without a held-out item before scoring"
        )
    if bool(torch.isnan(scores).any()):
        raise DataError("scores contain NaN; ranks would be meaningless -- check the model's output")


def _candidates(scores: torch.Tensor, *, exclude_padding: bool, exclude: torch.Tensor | None) -> torch.Tensor:
    """Bool (B, M+1): which items compete with the target."""
    mask = torch.ones_like(scores, dtype=torch.bool)
    if exclude_padding:
        mask[:, PADDING_IDX] = False
    if exclude is not None:
        if exclude.shape != scores.shape or exclude.dtype != torch.bool:
            raise DataError(
                f"exclude must be a bool tensor of shape {tuple(scores.shape)}, "
                f"got shape {tuple(exclude.shape)}, dtype {exclude.dtype}"
            )
        mask &= ~exclude.to(scores.device)
    return mask


def _count_above(
    candidate_scores: torch.Tensor, target_scores: torch.Tensor, valid: torch.Tensor, ties: TieBreak
) -> torch.Tensor:
    """# valid candidates ranked above the target (``valid`` already excludes the target itself)."""
    above = candidate_scores > target_scores
    if ties is TieBreak.PESSIMISTIC:
        above |= candidate_scores == target_scores
    return (above & valid).sum(dim=1)


# --------------------------------------------------------------------------------------------------
# ranks
# --------------------------------------------------------------------------------------------------


def rank_of_target(
    scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    exclude_padding: bool = True,
    exclude: torch.Tensor | None = None,
    ties: TieBreak | str = TieBreak.PESSIMISTIC,
) -> torch.Tensor:
    """0-based full-ranking rank of each target: ``scores (B, M+1)``, ``targets (B,)`` -> ``(B,)`` long."""
    _check_scores_targets(scores, targets, exclude_padding=exclude_padding)
    ties = TieBreak(ties)
    targets = targets.to(scores.device)
    valid = _candidates(scores, exclude_padding=exclude_padding, exclude=exclude)
    valid[torch.arange(scores.shape[0], device=scores.device), targets] = False
    target_scores = scores.gather(1, targets[:, None])
    return _count_above(scores, target_scores, valid, ties)


def sampled_rank_of_target(
    scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_negatives: int = 100,
    generator: torch.Generator | None,
    item_probs: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
    ties: TieBreak | str = TieBreak.PESSIMISTIC,
) -> torch.Tensor:
    """SAMPLED-NEGATIVES rank: the target's rank among ``n_negatives`` sampled items, ``(B,)`` long.

    Not a full ranking (see module docstring). Negatives are drawn per row without replacement
    from the items ``1..M`` other than the target and the ``exclude``-d items, uniformly or
    proportionally to ``item_probs (M+1,)`` (e.g. popularity), with ``torch.multinomial``. The
    padding item is never sampled. The result lies in ``[0, n_negatives]``.
    """
    _check_scores_targets(scores, targets, exclude_padding=True)
    if isinstance(n_negatives, bool) or not isinstance(n_negatives, numbers.Integral) or n_negatives < 1:
        raise ConfigError(f"n_negatives must be an integer >= 1, got n_negatives={n_negatives!r}")
    ties = TieBreak(ties)
    targets = targets.to(scores.device)
    rows = torch.arange(scores.shape[0], device=scores.device)
    weights = _negative_weights(scores, item_probs)
    weights = weights * _candidates(scores, exclude_padding=True, exclude=exclude)
    weights[rows, targets] = 0.0
    available = (weights > 0).sum(dim=1)
    if scores.shape[0] and int(available.min()) < n_negatives:
        raise DataError(
            f"a row has only {int(available.min())} candidate negatives < n_negatives={n_negatives}; "
            "lower n_negatives or exclude fewer items"
        )
    negatives = torch.multinomial(weights, int(n_negatives), replacement=False, generator=generator)
    target_scores = scores.gather(1, targets[:, None])
    valid = torch.ones_like(negatives, dtype=torch.bool)
    return _count_above(scores.gather(1, negatives), target_scores, valid, ties)


def _negative_weights(scores: torch.Tensor, item_probs: torch.Tensor | None) -> torch.Tensor:
    if item_probs is None:
        return torch.ones_like(scores, dtype=torch.float32)
    if item_probs.shape != (scores.shape[1],):
        raise DataError(f"item_probs must have shape ({scores.shape[1]},), got {tuple(item_probs.shape)}")
    if not bool(torch.isfinite(item_probs).all()) or bool((item_probs < 0).any()):
        raise DataError("item_probs must be finite and >= 0")
    return item_probs.to(device=scores.device, dtype=torch.float32).expand_as(scores).clone()


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------


def ndcg_from_ranks(ranks: torch.Tensor, *, k: int = 10) -> torch.Tensor:
    """Per-example NDCG@k of one relevant item at 0-based ``ranks``: ``1/log2(rank+2)`` if ``rank < k``."""
    _check_k(k)
    ranks = ranks.to(torch.float64)
    gain = 1.0 / torch.log2(ranks + 2.0)
    return torch.where(ranks < k, gain, torch.zeros_like(gain))


def hit_from_ranks(ranks: torch.Tensor, *, k: int = 10) -> torch.Tensor:
    """Per-example HIT@k (recall@k with one relevant item): ``1.0`` if ``rank < k`` else ``0.0``."""
    _check_k(k)
    return (ranks < k).to(torch.float64)


def ndcg_at_k(scores: torch.Tensor, targets: torch.Tensor, *, k: int = 10, **ranking: Any) -> torch.Tensor:
    """Per-example full-ranking NDCG@k, ``(B,)`` float64; average with ``.mean()``. ``ranking``: the rank rule's
    options, those of :func:`rank_of_target` (``exclude_padding``, ``exclude``, ``ties``)."""
    _check_k(k)
    return ndcg_from_ranks(rank_of_target(scores, targets, **ranking), k=k)


def hit_at_k(scores: torch.Tensor, targets: torch.Tensor, *, k: int = 10, **ranking: Any) -> torch.Tensor:
    """Per-example full-ranking HIT@k, ``(B,)`` float64; average with ``.mean()``. ``ranking``: as for
    :func:`ndcg_at_k`."""
    _check_k(k)
    return hit_from_ranks(rank_of_target(scores, targets, **ranking), k=k)
