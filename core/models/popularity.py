"""The most-popular-items ranking: the floor a trained sequential recommender has to clear.

Every user gets the same ranking, items ordered by how often they occur in the training prefixes
(:meth:`~core.data.sequential.SequentialDataset.item_counts` ``("train")``: the items a model trains on,
never a validation or test target). A recommender that does not rank the held-out item better than this has
learned item counts and nothing of the user's sequence; on MovieLens-100k under user-level DP-SGD that is
where a small Transformer ends (docs/stages/train-dp.md), and there Re-Attention, which reweights the
attention over the user's history, has nothing to act on.

Scored like the trained models (:mod:`core.dp.trainer`): full ranking over all items, padding excluded,
pessimistic ties (an item tied with the target counts above it, which matters here: every never-seen item
ties at count 0), with the user's history ranked and with it masked (RecBole's protocol).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.data.sequential import SequentialDataset
from core.errors import ConfigError
from core.metrics import hit_from_ranks, ndcg_from_ranks, rank_of_target

__all__ = ["PopularityMetrics", "popularity_metrics", "popularity_scores"]

_SPLITS = ("valid", "test")


@dataclass(frozen=True)
class PopularityMetrics:
    """NDCG@k and HIT@k of the popularity ranking on one split, history ranked and history masked."""

    ndcg: float
    hit: float
    ndcg_masked: float
    hit_masked: float


def popularity_scores(data: SequentialDataset) -> torch.Tensor:
    """``(M + 1,)`` float64 score of each item id: its count in the training prefixes; padding (0) is ``-inf``."""
    scores = torch.from_numpy(data.item_counts("train").astype(np.float64))
    scores[0] = -torch.inf
    return scores


def popularity_metrics(
    data: SequentialDataset, split: str = "test", *, k: int = 10, batch_size: int = 256
) -> PopularityMetrics:
    """The popularity ranking's NDCG@k and HIT@k over every user's ``split`` target (``valid`` or ``test``)."""
    if split not in _SPLITS:
        raise ConfigError(f"split must be one of {list(_SPLITS)}, got split={split!r}")
    scores = popularity_scores(data)
    ranks, masked = [], []
    for start in range(0, data.n_users, batch_size):
        users = np.arange(start, min(start + batch_size, data.n_users))
        _, targets = data.padded_batch(users, 1, split)
        rows = scores.expand(len(users), -1)
        ranks.append(rank_of_target(rows, targets))
        masked.append(rank_of_target(rows, targets, exclude=data.history_mask(users, split)))
    rank, rank_masked = torch.cat(ranks), torch.cat(masked)
    return PopularityMetrics(
        ndcg=float(ndcg_from_ranks(rank, k=k).mean()),
        hit=float(hit_from_ranks(rank, k=k).mean()),
        ndcg_masked=float(ndcg_from_ranks(rank_masked, k=k).mean()),
        hit_masked=float(hit_from_ranks(rank_masked, k=k).mean()),
    )
