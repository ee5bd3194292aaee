"""Seeded disjoint shards and the forget-request lookup (Sect. 3.3, App. A)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.errors import ConfigError, DataError
from core.tangent.shards import ShardIndex, split_shards


@pytest.mark.parametrize(("n", "k"), [(10, 3), (7, 7), (100, 1), (101, 10)])
def test_disjoint_covering_balanced(n: int, k: int) -> None:
    shards = split_shards(n, k, seed=0)
    assert len(shards) == k
    assert all(s.dtype == torch.int64 and s.dim() == 1 for s in shards)
    allidx = torch.cat(shards)
    assert allidx.numel() == n
    assert torch.equal(allidx.sort().values, torch.arange(n))  # disjoint and covering
    sizes = [s.numel() for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) >= 1


def test_seeded() -> None:
    a, b = split_shards(50, 4, seed=3), split_shards(50, 4, seed=3)
    c = split_shards(50, 4, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_split_errors() -> None:
    with pytest.raises(ConfigError, match="shard count larger than the dataset"):
        split_shards(3, 4, seed=0)
    with pytest.raises(ConfigError, match="n_shards=0"):
        split_shards(3, 0, seed=0)
    with pytest.raises(DataError, match="n=0"):
        split_shards(0, 1, seed=0)
    with pytest.raises(ConfigError, match="seed"):
        split_shards(3, 1, seed=1.5)  # type: ignore[arg-type]


def test_shard_index_lookup_and_without() -> None:
    idx = ShardIndex.from_split(20, 4, seed=1)
    assert idx.n_shards == 4 and len(idx) == 20
    for k, shard in enumerate(idx.shards):
        for i in shard.tolist():
            assert idx.shard_of(i) == k
            rest = idx.without(i)
            assert i not in rest.tolist()
            assert rest.numel() == shard.numel() - 1
            assert set(rest.tolist()) == set(shard.tolist()) - {i}
    assert idx.shard_of(torch.tensor(3)) == idx.shard_of(3)
    assert 3 in idx and 20 not in idx


def test_forget_request_not_in_training_set() -> None:
    idx = ShardIndex((torch.tensor([0, 2]), torch.tensor([5])))  # a subset of some dataset
    assert idx.shard_of(5) == 1
    for bad in (1, 6, -1):
        with pytest.raises(DataError, match=f"forget request for sample {bad} not in the training set"):
            idx.shard_of(bad)
        with pytest.raises(DataError, match=f"forget request for sample {bad} not in the training set"):
            idx.without(bad)
    assert idx.without(5).numel() == 0  # removing a singleton shard's only sample


def test_shard_index_validation() -> None:
    with pytest.raises(DataError, match="shard 1 is empty"):
        ShardIndex((torch.tensor([0, 1]), torch.tensor([], dtype=torch.long)))
    with pytest.raises(DataError, match="sample 1 is in shard 0 and shard 1"):
        ShardIndex((torch.tensor([0, 1]), torch.tensor([1, 2])))
    with pytest.raises(ConfigError, match="at least one shard"):
        ShardIndex(())
    with pytest.raises(DataError, match="integer"):
        ShardIndex((torch.tensor([0.0, 1.0]),))
    idx = ShardIndex([torch.tensor([0])])  # any sequence, stored as a tuple
    assert isinstance(idx.shards, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        idx.shards = ()  # type: ignore[misc]
