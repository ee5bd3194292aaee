"""Random sequential datasets for the tests: users with sequences of random lengths of uniformly random items."""

from __future__ import annotations

import numpy as np

from core.data.sequential import SequentialDataset


def random_sequences(
    n_users: int, n_items: int, *, min_len: int, max_len: int, seed: int = 0, source: str = "<memory>"
) -> SequentialDataset:
    """``n_users`` users, each with ``min_len..max_len`` items drawn uniformly from ``1..n_items`` (one
    ``np.random.default_rng(seed)``: the lengths first, then the items), timestamps in order."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_len, max_len + 1, size=n_users)
    items = rng.integers(1, n_items + 1, size=int(lens.sum()))
    return SequentialDataset(
        items=items,
        timestamps=np.arange(items.size),
        offsets=np.concatenate([[0], np.cumsum(lens)]),
        raw_user_ids=np.arange(n_users),
        raw_item_ids=np.arange(n_items),
        source=source,
    )
