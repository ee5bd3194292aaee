"""Hand-made inputs: runs recorded by hand into the store, for the tests of the read side (leaderboards, claims),
and small sequential datasets written out item by item."""

from __future__ import annotations

import numpy as np

from core.data.sequential import SequentialDataset
from storage.recording import record_run


def sequential_dataset(items: list[list[int]], n_items: int) -> SequentialDataset:
    """User ``u``'s chronological items are ``items[u]`` (ids in ``1..n_items``), timestamps in order."""
    lens = [len(seq) for seq in items]
    return SequentialDataset(
        items=np.concatenate([np.asarray(seq) for seq in items]),
        timestamps=np.arange(sum(lens)),
        offsets=np.concatenate(([0], np.cumsum(lens))),
        raw_user_ids=np.arange(len(items)),
        raw_item_ids=np.arange(n_items),
    )


def record_train_dp(
    method: str,
    seed: int,
    ndcg: float,
    hit: float,
    wall: float,
    *,
    epsilon: float | None = 8.0,
    popularity: float | None = None,
) -> None:
    """A train-dp grid point on dataset ``d`` (profile ``tiny``) with its test metrics (and the popularity floor's
    test NDCG@10 when given), and its ledger when private."""
    with record_run(
        flow="train-dp",
        stage="train-dp",
        technique=method,
        dataset="d",
        profile="tiny",
        config={"point": {"method": method, "seed": seed, "epsilon": epsilon, "lr": 0.005}},
        track=False,
    ) as rec:
        rec.metrics({"test_ndcg_at_10": ndcg, "test_hit_at_10": hit, "train_wall_s": wall})
        if popularity is not None:
            rec.metric("popularity.test_ndcg_at_10", popularity)
        if epsilon is not None:
            rec.privacy(
                epsilon=epsilon,
                delta=1e-5,
                noise_multiplier=1.0,
                sample_rate=0.1,
                steps=10,
                accountant="rdp",
                target_epsilon=epsilon,
            )
