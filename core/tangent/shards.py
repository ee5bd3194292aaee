"""Disjoint data shards for parallel training, composition and unlearning (Sect. 3.2-3.3, App. A).

App. A: "datasets are split into multiple shards with respect to a fixed random seed by uniform
sampling without replacement". :func:`split_shards` does exactly that (a seeded permutation cut into
balanced pieces); :class:`ShardIndex` answers "which shard holds sample i" for a forget request and
gives the shard's remaining indices for optional shard retraining (Sect. 3.3, Fig. 1(c)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from core.errors import ConfigError, DataError

__all__ = ["ShardIndex", "split_shards"]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {name}={value!r}")
    return value


def split_shards(n: int, n_shards: int, *, seed: int) -> list[Tensor]:
    """Split ``range(n)`` into ``n_shards`` disjoint, covering, balanced shards (uniform, seeded).

    Shard sizes differ by at most one (the first ``n % n_shards`` shards get one more sample);
    indices within a shard are sorted. The same ``(n, n_shards, seed)`` always gives the same split.

    Args:
        n: dataset size (>= 1).
        n_shards: number of shards, ``1 <= n_shards <= n``.
        seed: seed of the permutation (keyword only).
    Returns:
        list of ``n_shards`` int64 tensors of shape (n_k,), ``sum n_k = n``.
    """
    n = _check_int("n", n)
    n_shards = _check_int("n_shards", n_shards)
    seed = _check_int("seed", seed)
    if n_shards < 1:
        raise ConfigError(f"n_shards must be >= 1, got n_shards={n_shards}; use 1 for a single model")
    if n < 1:
        raise DataError(f"cannot shard an empty dataset (n={n}); pass at least one sample")
    if n_shards > n:
        raise ConfigError(
            f"shard count larger than the dataset: n_shards={n_shards} > n={n}; "
            f"use at most {n} shards so no shard is empty"
        )
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)  # (n,)
    base, extra = divmod(n, n_shards)
    sizes = [base + (1 if k < extra else 0) for k in range(n_shards)]
    shards = [s.sort().values for s in torch.split(perm, sizes)]
    for k, s in enumerate(shards):  # cannot happen given the checks above; kept as a data guard
        if s.numel() == 0:
            raise DataError(f"shard {k} is empty (n={n}, n_shards={n_shards}); use fewer shards")
    return shards


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """Lookup from sample index to shard, validated at construction (disjoint, no empty shard).

    ``ShardIndex.from_split(n, n_shards, seed=...)`` or ``ShardIndex(shards)`` with ``shards`` a
    sequence of 1-D integer tensors. The training set is the union of the shards (it need not be
    ``range(n)``: shards of a subset are fine).
    """

    shards: tuple[Tensor, ...]
    _owner: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.shards, Tensor) or not isinstance(self.shards, Sequence):
            raise ConfigError(f"shards must be a sequence of 1-D index tensors, got {type(self.shards).__name__}")
        shards = tuple(self.shards)
        if not shards:
            raise ConfigError("ShardIndex needs at least one shard, got 0; pass split_shards(...) output")
        owner: dict[int, int] = {}
        for k, s in enumerate(shards):
            if not isinstance(s, Tensor) or s.dim() != 1 or s.is_floating_point() or s.dtype == torch.bool:
                desc = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, Tensor) else type(s).__name__
                raise DataError(f"shard {k} must be a 1-D integer tensor, got {desc}")
            if s.numel() == 0:
                raise DataError(f"shard {k} is empty; every shard needs at least one sample (use fewer shards)")
            for i in s.tolist():
                if i < 0:
                    raise DataError(f"shard {k} holds a negative sample index {i}; indices must be >= 0")
                if i in owner:
                    raise DataError(
                        f"sample {i} is in shard {owner[i]} and shard {k}; shards must be disjoint (use split_shards)"
                    )
                owner[i] = k
        object.__setattr__(self, "shards", tuple(s.long() for s in shards))
        object.__setattr__(self, "_owner", owner)

    @classmethod
    def from_split(cls, n: int, n_shards: int, *, seed: int) -> ShardIndex:
        """Index of :func:`split_shards` ``(n, n_shards, seed=seed)``."""
        return cls(tuple(split_shards(n, n_shards, seed=seed)))

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    def __len__(self) -> int:
        """Number of training samples (the union of the shards)."""
        return len(self._owner)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and not isinstance(index, bool) and index in self._owner

    def _check(self, index: int) -> int:
        if isinstance(index, Tensor) and index.numel() == 1 and not index.is_floating_point():
            index = int(index.item())
        if isinstance(index, bool) or not isinstance(index, int):
            raise DataError(f"sample index must be an int, got {index!r}")
        if index not in self._owner:
            raise DataError(
                f"forget request for sample {index} not in the training set "
                f"({len(self._owner)} samples in {self.n_shards} shards); check the index"
            )
        return index

    def shard_of(self, index: int) -> int:
        """Shard id ``k`` in ``[0, n_shards)`` holding sample ``index`` (O(1))."""
        return self._owner[self._check(index)]

    def without(self, index: int) -> Tensor:
        """Indices (n_k - 1,) of ``index``'s shard with ``index`` removed, for retraining that shard.

        Does not modify this index (it is frozen); build a new :class:`ShardIndex` to record the removal.
        """
        index = self._check(index)
        shard = self.shards[self._owner[index]]
        return shard[shard != index]
