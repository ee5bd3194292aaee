"""Sequential-recommendation preprocessing: DPFormer App. E.1, following SASRec (Kang & McAuley, 2018).

:func:`build_sequential_dataset` turns raw :class:`~core.data.ratings.Interactions` into a
:class:`SequentialDataset` in four steps:

1. **k-core filter** (:func:`kcore_filter`): users and items with fewer than ``k`` interactions
   are dropped, repeatedly, until every survivor has at least ``k`` (the k-core of the user-item
   multigraph; duplicates count). SASRec's script filters in a single pass; iterating to the
   fixed point guarantees the "5-core" property the papers state.
2. **Re-indexing**: users become ``0..U-1`` and items ``1..M`` (``0`` is padding), both in order
   of first appearance in the source file, as SASRec's and RecBole's preprocessing do. The raw
   ids are kept (``raw_user_ids[u]``, ``raw_item_ids[i - 1]``).
3. **Chronological sequences**: each user's items sorted by timestamp, ties broken stably by
   file order; stored CSR-style as one ``items`` array and per-user ``offsets``.
4. **Leave-last-out split**: for a user with sequence ``s`` (``len(s) >= 3``), training uses the
   prefix ``s[:-2]``, validation predicts ``s[-2]`` from ``s[:-2]`` and test predicts ``s[-1]``
   from ``s[:-1]``. :meth:`SequentialDataset.history_mask` marks the items of that input part (the
   target excepted) for a full ranking that excludes them, RecBole's protocol.

Item frequencies ``p_i`` (:meth:`SequentialDataset.item_frequencies`) are computed on the
training prefixes only, so that they reveal nothing about held-out targets; DPFormer's
Re-Attention treats them as public.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from numpy.typing import ArrayLike

from core.data.ratings import Interactions
from core.errors import ConfigError, DataError

__all__ = [
    "SequentialDataset",
    "Split",
    "build_sequential_dataset",
    "gini",
    "kcore_filter",
    "top_share",
]

Split = Literal["train", "valid", "test"]
# For each split, how many items at the end of a user's sequence are not in its input.
_SPLIT_SHIFT: dict[str, int] = {"train": 3, "valid": 2, "test": 1}
_ARRAYS_FILE, _META_FILE, _FILE_FORMAT = "sequential.npz", "sequential.json", "privbench.sequential/1"


def kcore_filter(inter: Interactions, k: int = 5) -> Interactions:
    """The k-core of ``inter``: drop users and items with < ``k`` interactions until none is left.

    All violating rows are removed at once each round, which reaches the same (unique, maximal)
    k-core as removing them one by one. Row order is preserved.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"k must be a positive integer, got k={k!r}; SASRec and DPFormer use k=5")
    if len(inter) == 0:
        raise DataError(f"{inter.source}: no interactions to filter; check the input file")
    users = np.unique(inter.users, return_inverse=True)[1].reshape(-1)
    items = np.unique(inter.items, return_inverse=True)[1].reshape(-1)
    keep = np.ones(len(inter), dtype=bool)
    while True:
        user_counts = np.bincount(users[keep], minlength=users.max() + 1)
        item_counts = np.bincount(items[keep], minlength=items.max() + 1)
        drop = keep & ((user_counts[users] < k) | (item_counts[items] < k))
        if not drop.any():
            break
        keep &= ~drop
    if not keep.any():
        raise DataError(
            f"{inter.source}: the {k}-core is empty ({inter.n_users} users, {inter.n_items} items, "
            f"{len(inter)} interactions before filtering); use a smaller k or more data"
        )
    return inter.take(keep)


def build_sequential_dataset(inter: Interactions, *, k: int = 5) -> SequentialDataset:
    """k-core filter, re-index and sort ``inter`` into chronological per-user sequences."""
    filtered = kcore_filter(inter, k)
    user_codes, raw_users = _factorize(filtered.users)
    item_codes, raw_items = _factorize(filtered.items)
    seq_lens = np.bincount(user_codes, minlength=len(raw_users))
    if (short := seq_lens < 3).any():
        raise DataError(
            f"{inter.source}: {int(short.sum())} users (e.g. {raw_users[short.argmax()]!r}) have fewer "
            f"than 3 interactions after the {k}-core filter; leave-last-out needs 3, use k >= 3"
        )
    order = np.lexsort((np.arange(len(filtered)), filtered.timestamps, user_codes))
    return SequentialDataset(
        items=item_codes[order] + 1,
        timestamps=filtered.timestamps[order],
        offsets=np.concatenate(([0], np.cumsum(seq_lens))),
        raw_user_ids=raw_users,
        raw_item_ids=raw_items,
        source=inter.source,
        k=k,
    )


def _factorize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes ``0..n-1`` numbering distinct values by first appearance, and those values in order."""
    uniques, first, inverse = np.unique(values, return_index=True, return_inverse=True)
    by_appearance = np.argsort(first)
    rank = np.empty_like(by_appearance)
    rank[by_appearance] = np.arange(len(by_appearance))
    return rank[inverse.reshape(-1)], uniques[by_appearance]


def gini(counts: ArrayLike) -> float:
    """Gini coefficient of item popularity ``counts`` (sample definition, no n/(n-1) correction).

    ``G = sum_i (2i - n - 1) x_(i) / (n sum_i x_i)`` with ``x`` sorted ascending, ``i = 1..n``:
    ``0`` when every item is equally popular, ``(n - 1) / n`` when one item has every interaction.
    """
    x = np.sort(_popularity(counts))
    n = len(x)
    weights = 2 * np.arange(1, n + 1) - n - 1
    return float(np.dot(weights, x) / (n * x.sum()))


def top_share(counts: ArrayLike, frac: float = 0.2) -> float:
    """Share of all interactions that fall on the ``ceil(frac * n)`` most popular items."""
    if not 0.0 < frac <= 1.0:
        raise ConfigError(f"frac must be in (0, 1], got frac={frac!r}; 0.2 gives the top-20% share")
    x = np.sort(_popularity(counts))[::-1]
    n_top = max(1, math.ceil(frac * len(x) - 1e-9))  # the epsilon keeps 0.2 * 15 at 3, not 4
    return float(x[:n_top].sum() / x.sum())


def _popularity(counts: ArrayLike) -> np.ndarray:
    x = np.asarray(counts, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0 or not np.isfinite(x).all() or (x < 0).any() or x.sum() <= 0:
        raise DataError(f"popularity counts must be a non-empty 1-D array of counts >= 0, not all 0, got {x!r}")
    return x


@dataclass(frozen=True, eq=False)
class SequentialDataset:
    """Chronological per-user item sequences with a leave-last-out split (CSR layout).

    Attributes:
        items: ``(N,)`` int64 item ids in ``1..M``; user ``u``'s sequence, oldest first, is
            ``items[offsets[u]:offsets[u + 1]]``.
        timestamps: ``(N,)`` int64 seconds, aligned with ``items``.
        offsets: ``(U + 1,)`` int64, ``offsets[0] == 0``, ``offsets[-1] == N``, every sequence >= 3.
        raw_user_ids: ``(U,)`` raw id of user ``u`` (int64 or str).
        raw_item_ids: ``(M,)`` raw id of item ``i`` at index ``i - 1`` (int64 or str).
        source: where the interactions came from.
        k: the k of the k-core filter that was applied.
    """

    items: np.ndarray
    timestamps: np.ndarray
    offsets: np.ndarray
    raw_user_ids: np.ndarray
    raw_item_ids: np.ndarray
    source: str = "<memory>"
    k: int = 5

    def __post_init__(self) -> None:
        for name in ("items", "timestamps", "offsets", "raw_user_ids", "raw_item_ids"):
            arr = np.asarray(getattr(self, name))
            if name in ("items", "timestamps", "offsets"):
                arr = _int64(name, arr)
            elif arr.dtype.kind not in "iuU" or arr.ndim != 1:
                raise DataError(f"SequentialDataset.{name} must be 1-D int or str ids, got {arr.dtype}{arr.shape}")
            view = arr.view()
            view.flags.writeable = False
            object.__setattr__(self, name, view)
        self._validate()

    def _validate(self) -> None:
        items, offsets, n = self.items, self.offsets, len(self.items)
        if len(self.timestamps) != n:
            raise DataError(f"SequentialDataset: {n} items but {len(self.timestamps)} timestamps")
        if len(offsets) != len(self.raw_user_ids) + 1 or offsets[0] != 0 or offsets[-1] != n:
            raise DataError(
                f"SequentialDataset.offsets must run from 0 to {n} with one entry per user plus one, "
                f"got {len(offsets)} offsets ending at {offsets[-1] if len(offsets) else None}"
            )
        if len(offsets) < 2:
            raise DataError("SequentialDataset needs at least one user")
        if (np.diff(offsets) < 3).any():
            raise DataError("SequentialDataset: every user needs >= 3 items for leave-last-out")
        if n and (items.min() < 1 or items.max() > len(self.raw_item_ids)):
            raise DataError(f"SequentialDataset.items must lie in 1..{len(self.raw_item_ids)} (0 is padding)")

    # ------------------------------------------------------------------------------ sizes
    @property
    def n_users(self) -> int:
        return len(self.raw_user_ids)

    @property
    def n_items(self) -> int:
        """M, the number of real items; embedding tables need ``M + 1`` rows (row 0 = padding)."""
        return len(self.raw_item_ids)

    @property
    def n_interactions(self) -> int:
        return len(self.items)

    @cached_property
    def seq_lens(self) -> np.ndarray:
        """``(U,)`` int64 full sequence length of each user (train prefix + 2)."""
        return _readonly(np.diff(self.offsets))

    def sequence(self, user: int) -> np.ndarray:
        """User ``user``'s chronological item ids (all splits)."""
        return self.items[self.offsets[user] : self.offsets[user + 1]]

    # ---------------------------------------------------------------------- popularity
    @cached_property
    def _train_mask(self) -> np.ndarray:
        row_user = np.repeat(np.arange(self.n_users), self.seq_lens)
        position = np.arange(self.n_interactions) - self.offsets[row_user]
        return position < self.seq_lens[row_user] - 2

    def item_counts(self, part: Literal["all", "train"] = "all") -> np.ndarray:
        """``(M + 1,)`` int64 interaction count per item id (index 0, padding, is 0)."""
        if part not in ("all", "train"):
            raise ConfigError(f"part must be 'all' or 'train', got {part!r}")
        items = self.items if part == "all" else self.items[self._train_mask]
        return np.bincount(items, minlength=self.n_items + 1)

    def item_frequencies(self) -> np.ndarray:
        """``(M + 1,)`` float64 ``p_i``: share of training interactions on item ``i`` (``p_0 = 0``).

        Computed on the training prefixes only (not the validation/test targets), so ``p`` can be
        treated as public, as DPFormer's Re-Attention does; it sums to 1.
        """
        counts = self.item_counts("train")
        return counts / counts.sum()

    def stats(self) -> dict[str, float | int]:
        """Size and long-tail statistics over all interactions (all splits)."""
        lens, popularity = self.seq_lens, self.item_counts("all")[1:]
        return {
            "n_users": self.n_users,
            "n_items": self.n_items,
            "n_interactions": self.n_interactions,
            "n_train_interactions": int(self._train_mask.sum()),
            "density": self.n_interactions / (self.n_users * self.n_items),
            "seq_len_mean": float(lens.mean()),
            "seq_len_median": float(np.median(lens)),
            "seq_len_min": int(lens.min()),
            "seq_len_max": int(lens.max()),
            "gini": gini(popularity),
            "top20_share": top_share(popularity, 0.2),
        }

    # -------------------------------------------------------------------------- batches
    def padded_batch(
        self, user_idx: ArrayLike | torch.Tensor, max_len: int, split: Split = "test"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-item inputs and targets of the users ``user_idx`` (``B`` indices in ``0..U-1``).

        For a user's sequence ``s``: ``"test"`` feeds ``s[:-1]`` and targets ``s[-1]``;
        ``"valid"`` feeds ``s[:-2]`` and targets ``s[-2]``; ``"train"`` feeds ``s[:-3]`` and targets
        ``s[-3]``, the last training item (that input may be all padding).

        Returns:
            ``input_ids``: ``(B, max_len)`` int64, the last ``max_len`` input items, left-padded with 0.
            ``targets``: ``(B,)`` int64 target item ids.
        """
        if split not in _SPLIT_SHIFT:
            raise ConfigError(f"split must be one of {list(_SPLIT_SHIFT)}, got split={split!r}")
        users, length = self._user_index(user_idx), _check_max_len(max_len)
        ends = self.offsets[users + 1] - _SPLIT_SHIFT[split]
        inputs = _left_padded(self.items, self.offsets[users], ends, length)
        return torch.from_numpy(inputs), torch.from_numpy(self.items[ends])

    def train_examples(
        self, max_len: int, user_idx: ArrayLike | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SASRec training pairs: at every position, predict the next item of the training prefix.

        Row ``b`` is user ``user_idx[b]`` (default: every user, in order). With training prefix
        ``t = s[:-2]``, the inputs are the last ``max_len`` items of ``t[:-1]`` and the targets the
        same positions shifted by one (``t[1:]``), both left-padded with 0; a target of 0 is
        padding and must be ignored by the loss (a prefix of one item gives an all-padding row).

        Returns:
            ``(input_ids, targets)``, both ``(B, max_len)`` int64.
        """
        users = np.arange(self.n_users) if user_idx is None else self._user_index(user_idx)
        length = _check_max_len(max_len)
        starts, ends = self.offsets[users], self.offsets[users + 1] - _SPLIT_SHIFT["train"]
        inputs = _left_padded(self.items, starts, ends, length)
        targets = _left_padded(self.items, starts + 1, ends + 1, length)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def train_window_counts(self, max_len: int) -> np.ndarray:
        """``(U,)`` int64: windows of ``max_len`` that hold user ``u``'s training pairs (at least 1)."""
        length = _check_max_len(max_len)
        pairs = self.seq_lens - _SPLIT_SHIFT["train"]  # len(t) - 1 pairs for the training prefix t = s[:-2]
        return np.maximum(-(-pairs // length), 1).astype(np.int64)

    def train_windows(
        self, max_len: int, user_idx: ArrayLike | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every SASRec training pair of each user, in consecutive windows of ``max_len``.

        Row ``b`` holds all of user ``user_idx[b]``'s pairs of :meth:`train_examples` (not only the last
        ``max_len``), left-padded to ``K * max_len`` with ``K`` the most windows any selected user needs
        (:meth:`train_window_counts`): counted from the end, the last window is :meth:`train_examples`' row and
        each earlier window the ``max_len`` pairs before it. A model reads such a row as ``K`` windows
        (:mod:`core.models.seqrec`, "Windows"); a user's earlier items are then targets too.

        Returns:
            ``(input_ids, targets)``, both ``(B, K * max_len)`` int64.
        """
        users = np.arange(self.n_users) if user_idx is None else self._user_index(user_idx)
        length = _check_max_len(max_len)
        k = int(self.train_window_counts(length)[users].max()) if len(users) else 1
        starts, ends = self.offsets[users], self.offsets[users + 1] - _SPLIT_SHIFT["train"]
        inputs = _left_padded(self.items, starts, ends, k * length)
        targets = _left_padded(self.items, starts + 1, ends + 1, k * length)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def history_mask(self, user_idx: ArrayLike | torch.Tensor, split: Split = "test") -> torch.Tensor:
        """Items to exclude from the full ranking of each user's ``split`` target (RecBole's protocol).

        Row ``b`` marks every item user ``user_idx[b]`` interacted with before the target of
        :meth:`padded_batch`: ``"test"``: the items of ``s[:-1]`` (training prefix and validation
        item); ``"valid"``: those of ``s[:-2]``; ``"train"``: those of ``s[:-3]``. The whole prefix
        counts, not only the last ``max_len`` items the model sees. The target itself is never
        marked, even where it also occurs earlier in the sequence; column 0 (padding) is never
        marked. Pass it as ``exclude=`` to :func:`core.metrics.rank_of_target`, which is the same as
        setting the marked scores to ``-inf``.

        Returns:
            ``(B, M + 1)`` bool, True = excluded.
        """
        if split not in _SPLIT_SHIFT:
            raise ConfigError(f"split must be one of {list(_SPLIT_SHIFT)}, got split={split!r}")
        users = self._user_index(user_idx)
        starts, ends = self.offsets[users], self.offsets[users + 1] - _SPLIT_SHIFT[split]
        lens = ends - starts
        rows = np.repeat(np.arange(len(users)), lens)  # (H,): the row of each history interaction
        positions = np.arange(lens.sum()) + np.repeat(starts - (np.cumsum(lens) - lens), lens)  # (H,) into items
        mask = np.zeros((len(users), self.n_items + 1), dtype=bool)
        mask[rows, self.items[positions]] = True
        mask[np.arange(len(users)), self.items[ends]] = False  # the target always competes
        return torch.from_numpy(mask)

    def _user_index(self, user_idx: ArrayLike | torch.Tensor) -> np.ndarray:
        users = np.asarray(user_idx.cpu() if isinstance(user_idx, torch.Tensor) else user_idx)
        if users.ndim != 1 or (users.size and users.dtype.kind not in "iu"):
            raise ConfigError(f"user_idx must be a 1-D array of integer user indices, got {users!r}")
        users = users.astype(np.int64)
        if users.size and (users.min() < 0 or users.max() >= self.n_users):
            raise ConfigError(f"user_idx must lie in 0..{self.n_users - 1}, got {users.min()}..{users.max()}")
        return users

    # ---------------------------------------------------------------- identity and files
    def content_hash(self) -> str:
        """Hex sha256 of the sequences, timestamps and raw id maps (not ``source`` or ``k``)."""
        digest = hashlib.sha256()
        for name in ("items", "timestamps", "offsets"):
            arr = np.ascontiguousarray(getattr(self, name), dtype="<i8")
            digest.update(f"{name}:{arr.size};".encode())
            digest.update(arr.tobytes())
        ids = {"users": self.raw_user_ids.tolist(), "items": self.raw_item_ids.tolist()}
        digest.update(json.dumps(ids, separators=(",", ":")).encode())
        return digest.hexdigest()

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``sequential.npz`` (arrays) and ``sequential.json`` (id maps, metadata, hash)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / _ARRAYS_FILE, items=self.items, timestamps=self.timestamps, offsets=self.offsets)
        meta = {
            "format": _FILE_FORMAT,
            "source": self.source,
            "k": self.k,
            "content_hash": self.content_hash(),
            "raw_user_ids": self.raw_user_ids.tolist(),
            "raw_item_ids": self.raw_item_ids.tolist(),
        }
        (directory / _META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> SequentialDataset:
        """Read what :meth:`save` wrote; a missing, corrupt or tampered file raises DataError."""
        directory = Path(directory)
        for file in (directory / _ARRAYS_FILE, directory / _META_FILE):
            if not file.is_file():
                raise DataError(f"{file}: no such file; write it with SequentialDataset.save({str(directory)!r})")
        try:
            meta = json.loads((directory / _META_FILE).read_text(encoding="utf-8"))
            if meta.get("format") != _FILE_FORMAT:
                raise DataError(f"{directory / _META_FILE}: format {meta.get('format')!r}, expected {_FILE_FORMAT!r}")
            with np.load(directory / _ARRAYS_FILE, allow_pickle=False) as arrays:
                columns = {name: arrays[name] for name in ("items", "timestamps", "offsets")}
            dataset = cls(
                **columns,
                raw_user_ids=np.asarray(meta["raw_user_ids"]),
                raw_item_ids=np.asarray(meta["raw_item_ids"]),
                source=str(meta["source"]),
                k=int(meta["k"]),
            )
        except DataError as exc:
            raise DataError(f"{directory}: corrupt sequential dataset ({exc}); rebuild and save it") from exc
        except (
            OSError,
            EOFError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            zipfile.BadZipFile,
        ) as exc:
            raise DataError(
                f"{directory}: corrupt sequential dataset ({type(exc).__name__}: {exc}); rebuild and save it"
            ) from exc
        if dataset.content_hash() != meta["content_hash"]:
            raise DataError(f"{directory}: content hash mismatch, the files were modified; rebuild and save it")
        return dataset


def _int64(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise DataError(f"SequentialDataset.{name} must be a 1-D integer array, got {arr.dtype}{arr.shape}")
    return arr.astype(np.int64, copy=False)


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def _check_max_len(max_len: int) -> int:
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
        raise ConfigError(f"max_len must be a positive integer, got max_len={max_len!r}; SASRec uses 200 on ML-1M")
    return int(max_len)


def _left_padded(values: np.ndarray, starts: np.ndarray, ends: np.ndarray, length: int) -> np.ndarray:
    """``(B, length)``: row b holds the last ``length`` of ``values[starts[b]:ends[b]]``, left-padded with 0."""
    positions = ends[:, None] - length + np.arange(length)
    return np.where(positions >= starts[:, None], values[np.maximum(positions, 0)], 0).astype(np.int64, copy=False)
