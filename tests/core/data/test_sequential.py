"""k-core filter, chronological sequences, leave-last-out split, statistics and persistence."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.data import (
    Interactions,
    SequentialDataset,
    SyntheticSpec,
    build_sequential_dataset,
    generate_interactions,
    gini,
    kcore_filter,
    top_share,
)
from core.errors import ConfigError, DataError

# File order matters: user "u2" and item "b" appear first; u2's b and a tie at t=20, u1's a and b at t=30.
HAND_ROWS = [("u2", "b", 20), ("u1", "a", 30), ("u1", "c", 10), ("u2", "a", 20), ("u1", "b", 30),
             ("u2", "c", 5), ("u1", "d", 40)]  # fmt: skip


@pytest.fixture
def hand(make_interactions) -> SequentialDataset:
    return build_sequential_dataset(make_interactions(HAND_ROWS), k=1)


# ------------------------------------------------------------------------------------ k-core


def test_kcore_cascades_over_several_rounds(make_interactions) -> None:
    # k=2. Round 1 drops the single-use items w and v; losing v leaves user D with one item,
    # so D-z goes; then z has one interaction left (C-z), which leaves C with one item (C-y).
    rows = [("A", "x", 1), ("A", "y", 2), ("B", "x", 3), ("B", "y", 4), ("C", "y", 5), ("C", "z", 6),
            ("C", "w", 7), ("D", "z", 8), ("D", "v", 9)]  # fmt: skip
    core = kcore_filter(make_interactions(rows), k=2)
    survivors = list(zip(core.users.tolist(), core.items.tolist(), core.timestamps.tolist(), strict=True))
    assert survivors == [("A", "x", 1), ("A", "y", 2), ("B", "x", 3), ("B", "y", 4)]


def reference_kcore(rows: list[tuple[int, int]], k: int) -> list[int]:
    """Remove one violating row at a time until none is left (slow and obviously correct)."""
    alive = list(range(len(rows)))
    while True:
        users = Counter(rows[i][0] for i in alive)
        items = Counter(rows[i][1] for i in alive)
        bad = next((i for i in alive if users[rows[i][0]] < k or items[rows[i][1]] < k), None)
        if bad is None:
            return alive
        alive.remove(bad)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40),
    k=st.integers(1, 4),
)
def test_kcore_matches_one_at_a_time_reference(rows: list[tuple[int, int]], k: int) -> None:
    inter = Interactions(
        np.array([u for u, _ in rows]),
        np.array([i for _, i in rows]),
        np.ones(len(rows)),
        np.arange(len(rows)),
    )
    expected = reference_kcore(rows, k)
    if not expected:
        with pytest.raises(DataError, match="smaller k"):
            kcore_filter(inter, k)
        return
    assert kcore_filter(inter, k).timestamps.tolist() == expected  # timestamps are row numbers here


def test_kcore_empty_result_and_bad_k(make_interactions) -> None:
    inter = make_interactions([("A", "x", 1), ("B", "y", 2)])
    with pytest.raises(DataError, match=r"5-core is empty \(2 users, 2 items, 2 interactions.*smaller k"):
        kcore_filter(inter, 5)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="k must be a positive integer"):
            kcore_filter(inter, bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- sequences and split


def test_sequences_are_chronological_with_stable_ties_and_first_appearance_ids(hand) -> None:
    assert hand.raw_user_ids.tolist() == ["u2", "u1"]  # users 0, 1 by first appearance
    assert hand.raw_item_ids.tolist() == ["b", "a", "c", "d"]  # items 1..4 by first appearance
    assert hand.sequence(0).tolist() == [3, 1, 2]  # c@5, b@20 (row 0), a@20 (row 3)
    assert hand.sequence(1).tolist() == [3, 2, 1, 4]  # c@10, a@30 (row 1), b@30 (row 4), d@40
    assert hand.offsets.tolist() == [0, 3, 7]
    assert hand.timestamps.tolist() == [5, 20, 20, 10, 30, 30, 40]
    assert (hand.n_users, hand.n_items, hand.n_interactions) == (2, 4, 7)


def test_leave_last_out_batches_by_hand(hand) -> None:
    def batch(max_len: int, split: str) -> tuple[list[list[int]], list[int]]:
        inputs, targets = hand.padded_batch([0, 1], max_len, split)  # type: ignore[arg-type]
        assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == (2, max_len)
        return inputs.tolist(), targets.tolist()

    assert batch(3, "test") == ([[0, 3, 1], [3, 2, 1]], [2, 4])
    assert batch(2, "test") == ([[3, 1], [2, 1]], [2, 4])  # truncation keeps the most recent items
    assert batch(3, "valid") == ([[0, 0, 3], [0, 3, 2]], [1, 1])
    assert batch(2, "train") == ([[0, 0], [0, 3]], [3, 2])
    inputs, targets = hand.train_examples(max_len=3)
    assert inputs.tolist() == [[0, 0, 0], [0, 0, 3]]  # user 0's training prefix is just [3]
    assert targets.tolist() == [[0, 0, 0], [0, 0, 2]]
    inputs, targets = hand.train_examples(max_len=1, user_idx=torch.tensor([1]))
    assert (inputs.tolist(), targets.tolist()) == ([[3]], [[2]])


def reference_batch(ds: SequentialDataset, users: np.ndarray, max_len: int, split: str):
    shift = {"train": 3, "valid": 2, "test": 1}[split]
    rows, targets = [], []
    for u in users:
        seq = ds.sequence(u).tolist()
        history = seq[: len(seq) - shift][-max_len:]
        rows.append([0] * (max_len - len(history)) + history)
        targets.append(seq[len(seq) - shift])
    return rows, targets


def reference_train(ds: SequentialDataset, users: np.ndarray, max_len: int):
    inputs, targets = [], []
    for u in users:
        prefix = ds.sequence(u).tolist()[:-2]
        x, y = prefix[:-1][-max_len:], prefix[1:][-max_len:]
        inputs.append([0] * (max_len - len(x)) + x)
        targets.append([0] * (max_len - len(y)) + y)
    return inputs, targets


@pytest.fixture(scope="module")
def small() -> SequentialDataset:
    spec = SyntheticSpec(n_users=40, n_items=30, mean_seq_len=9.0, zipf_a=0.7)
    return build_sequential_dataset(generate_interactions(spec, seed=3))


@pytest.mark.parametrize("max_len", [1, 4, 50])
@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_vectorised_batches_match_loop_reference(small, max_len: int, split: str) -> None:
    users = np.random.default_rng(max_len).integers(0, small.n_users, size=17)
    inputs, targets = small.padded_batch(users, max_len, split)  # type: ignore[arg-type]
    assert (inputs.tolist(), targets.tolist()) == reference_batch(small, users, max_len, split)
    inputs, targets = small.train_examples(max_len, users)
    assert (inputs.tolist(), targets.tolist()) == reference_train(small, users, max_len)


def test_history_mask_by_hand(hand) -> None:
    """user 0 = [3, 1, 2], user 1 = [3, 2, 1, 4]; a repeated item that is also the target stays unmasked."""

    def masked(ds: SequentialDataset, users: list[int], split: str) -> list[list[int]]:
        mask = ds.history_mask(users, split)  # type: ignore[arg-type]
        assert mask.dtype == torch.bool and mask.shape == (len(users), ds.n_items + 1)
        return [torch.nonzero(row).flatten().tolist() for row in mask]

    assert masked(hand, [0, 1], "test") == [[1, 3], [1, 2, 3]]
    assert masked(hand, [1, 0], "valid") == [[2, 3], [3]]
    assert masked(hand, [0, 1], "train") == [[], [3]]
    repeat = SequentialDataset(
        items=np.array([2, 1, 2, 3, 2]), timestamps=np.arange(5), offsets=np.array([0, 5]),
        raw_user_ids=np.array([7]), raw_item_ids=np.array([10, 20, 30]),
    )  # fmt: skip
    assert masked(repeat, [0], "test") == [[1, 3]]  # target 2 was seen twice before: still ranked
    assert masked(repeat, [0], "valid") == [[1, 2]]  # target 3 is new
    with pytest.raises(ConfigError, match="split must be one of"):
        hand.history_mask([0], "dev")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"user_idx must lie in 0\.\.1"):
        hand.history_mask([2])


def reference_history_mask(ds: SequentialDataset, users: np.ndarray, split: str) -> list[set[int]]:
    shift = {"train": 3, "valid": 2, "test": 1}[split]
    out = []
    for u in users:
        seq = ds.sequence(u).tolist()
        out.append(set(seq[: len(seq) - shift]) - {seq[len(seq) - shift]})
    return out


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_history_mask_matches_loop_reference(small, split: str) -> None:
    rng = np.random.default_rng(7)
    lens = rng.integers(3, 13, size=30)
    repeats = SequentialDataset(
        items=rng.integers(1, 9, size=lens.sum()), timestamps=np.arange(lens.sum()),
        offsets=np.concatenate(([0], np.cumsum(lens))), raw_user_ids=np.arange(30), raw_item_ids=np.arange(8),
    )  # fmt: skip  # 8 items: most sequences repeat items, and many targets were seen before
    for ds in (small, repeats):
        users = rng.integers(0, ds.n_users, size=23)
        mask = ds.history_mask(users, split)  # type: ignore[arg-type]
        got = [set(torch.nonzero(row).flatten().tolist()) for row in mask]
        assert got == reference_history_mask(ds, users, split)


def test_batch_argument_errors(hand) -> None:
    with pytest.raises(ConfigError, match="split must be one of"):
        hand.padded_batch([0], 3, "dev")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_len must be a positive integer"):
        hand.padded_batch([0], 0)
    with pytest.raises(ConfigError, match=r"user_idx must lie in 0\.\.1"):
        hand.padded_batch([2], 3)
    with pytest.raises(ConfigError, match="integer user indices"):
        hand.train_examples(3, [0.5])


def test_users_need_three_items(make_interactions) -> None:
    with pytest.raises(DataError, match="fewer than 3 interactions.*use k >= 3"):
        build_sequential_dataset(make_interactions([("a", "x", 1), ("a", "y", 2)]), k=1)


# -------------------------------------------------------------------------------- statistics


def test_item_frequencies_use_training_prefixes_only(hand) -> None:
    # training prefixes: user 0 -> [3], user 1 -> [3, 2]
    np.testing.assert_allclose(hand.item_frequencies(), [0, 0, 1 / 3, 2 / 3, 0])
    assert hand.item_counts("all").tolist() == [0, 2, 2, 2, 1]


def test_stats_by_hand(hand) -> None:
    stats = hand.stats()
    assert stats == {
        "n_users": 2, "n_items": 4, "n_interactions": 7, "n_train_interactions": 3, "density": 7 / 8,
        "seq_len_mean": 3.5, "seq_len_median": 3.5, "seq_len_min": 3, "seq_len_max": 4,
        "gini": pytest.approx(3 / 28),  # counts [1, 2, 2, 2]: (-3*1 - 1*2 + 1*2 + 3*2) / (4 * 7)
        "top20_share": 2 / 7,  # ceil(0.2 * 4) = 1 item with 2 of the 7 interactions
    }  # fmt: skip


def test_gini_known_distributions() -> None:
    assert gini([5, 5, 5, 5]) == 0.0
    assert gini([0, 0, 0, 9]) == pytest.approx(3 / 4)  # (n - 1) / n
    assert gini([1, 2, 3, 4]) == pytest.approx(0.25)
    with pytest.raises(DataError, match="popularity counts"):
        gini([0, 0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=20).filter(any))
def test_gini_matches_mean_absolute_difference(counts: list[int]) -> None:
    x = np.array(counts, dtype=float)
    expected = np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean())
    assert gini(counts) == pytest.approx(expected)


def test_top_share_by_hand() -> None:
    assert top_share([10, 1, 1, 1, 1, 1, 1, 1, 1, 1]) == 11 / 19  # top 2 of 10 items
    assert top_share([1] * 15) == 3 / 15  # 0.2 * 15 is 3.0000000000000004 in floating point
    assert top_share([4, 3, 2, 1, 1, 1, 1]) == 7 / 13  # ceil(1.4) = 2 items
    with pytest.raises(ConfigError):
        top_share([1, 2], frac=0)


# ------------------------------------------------------------------------ identity and files


def test_content_hash_is_stable_and_sensitive(hand, make_interactions) -> None:
    digest = hand.content_hash()
    assert len(digest) == 64 and digest == hand.content_hash()
    assert build_sequential_dataset(make_interactions(HAND_ROWS), k=1).content_hash() == digest
    later = [(u, i, t + 1 if (u, i) == ("u1", "d") else t) for u, i, t in HAND_ROWS]
    assert build_sequential_dataset(make_interactions(later), k=1).content_hash() != digest
    renamed = [(u, "e" if i == "d" else i, t) for u, i, t in HAND_ROWS]
    assert build_sequential_dataset(make_interactions(renamed), k=1).content_hash() != digest


def assert_same(a: SequentialDataset, b: SequentialDataset) -> None:
    for name in ("items", "timestamps", "offsets", "raw_user_ids", "raw_item_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.source, a.k, a.content_hash()) == (b.source, b.k, b.content_hash())


def test_save_load_round_trip(hand, small, tmp_path: Path) -> None:
    for name, ds in (("str-ids", hand), ("int-ids", small)):
        assert_same(SequentialDataset.load(ds.save(tmp_path / name)), ds)
    assert small.raw_user_ids.dtype == np.int64


def test_load_missing_or_corrupt(hand, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        SequentialDataset.load(tmp_path / "nothing")
    folder = hand.save(tmp_path / "ds")
    meta = json.loads((folder / "sequential.json").read_text())
    (folder / "sequential.json").write_text(json.dumps({**meta, "raw_item_ids": ["b", "a", "c", "X"]}))
    with pytest.raises(DataError, match="content hash mismatch"):
        SequentialDataset.load(folder)
    (folder / "sequential.json").write_text('{"format": ')
    with pytest.raises(DataError, match="corrupt"):
        SequentialDataset.load(folder)
    hand.save(folder)
    (folder / "sequential.npz").write_bytes(b"not a zip file")
    with pytest.raises(DataError, match="corrupt"):
        SequentialDataset.load(folder)


def test_dataset_validates_its_arrays(hand) -> None:
    arrays = {name: getattr(hand, name) for name in ("items", "timestamps", "raw_user_ids", "raw_item_ids")}
    with pytest.raises(DataError, match="offsets"):
        SequentialDataset(**arrays, offsets=np.array([0, 3, 6]))
    with pytest.raises(DataError, match=">= 3 items"):
        SequentialDataset(**arrays, offsets=np.array([0, 2, 7]))
    with pytest.raises(DataError, match="must lie in 1..4"):
        SequentialDataset(**{**arrays, "items": np.array([3, 1, 2, 3, 2, 1, 0])}, offsets=hand.offsets)
    with pytest.raises(ValueError, match="read-only"):
        hand.items[0] = 1


@pytest.mark.parametrize("max_len", [1, 3, 4, 50])
def test_train_windows_hold_every_pair_once(small, max_len: int) -> None:
    """Reference: split each user's (input, target) pairs from the end into windows of max_len, by a loop."""
    users = np.random.default_rng(max_len).integers(0, small.n_users, size=13)
    inputs, targets = small.train_windows(max_len, users)
    counts = small.train_window_counts(max_len)[users]
    assert inputs.shape == targets.shape == (13, int(counts.max()) * max_len)
    for row, u in enumerate(users):
        prefix = small.sequence(u).tolist()[:-2]
        pairs = list(itertools.pairwise(prefix))
        windows = [pairs[max(0, end - max_len) : end] for end in range(len(pairs), 0, -max_len)][::-1] or [[]]
        assert len(windows) == counts[row]
        expected = []
        for w in [[]] * (int(counts.max()) - len(windows)) + windows:
            expected += [(0, 0)] * (max_len - len(w)) + w
        assert list(zip(inputs[row].tolist(), targets[row].tolist(), strict=True)) == expected
        # the last window is train_examples' row
        last_x, last_y = small.train_examples(max_len, [u])
        assert inputs[row, -max_len:].tolist() == last_x[0].tolist()
        assert targets[row, -max_len:].tolist() == last_y[0].tolist()
