"""Synthetic generator: determinism, exact parse-back through the real parsers, realistic shape."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from core.data import (
    PARSERS,
    DatasetFormat,
    SyntheticFormat,
    SyntheticSpec,
    amazon_games_shaped,
    build_sequential_dataset,
    generate_interactions,
    ml1m_shaped,
    write_synthetic,
)
from core.errors import ConfigError

FORMATS: tuple[str, ...] = get_args(SyntheticFormat)
SPEC = SyntheticSpec(n_users=60, n_items=50, mean_seq_len=12.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_seed_same_bytes(tmp_path: Path, fmt: str) -> None:
    a = write_synthetic(tmp_path / "a", SPEC, fmt=fmt, seed=7)  # type: ignore[arg-type]
    b = write_synthetic(tmp_path / "b", SPEC, fmt=fmt, seed=7)  # type: ignore[arg-type]
    c = write_synthetic(tmp_path / "c", SPEC, fmt=fmt, seed=8)  # type: ignore[arg-type]
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_real_parser_reads_back_exactly_the_generated_rows(tmp_path: Path, fmt: str) -> None:
    spec = SyntheticSpec(n_users=30, n_items=40, mean_seq_len=10.0, drift=0.5)
    path = write_synthetic(tmp_path / "sub" / "ratings", spec, fmt=fmt, seed=1)  # type: ignore[arg-type]
    parsed = PARSERS[DatasetFormat(fmt)](path)
    assert parsed.same_data(generate_interactions(spec, fmt=fmt, seed=1))  # type: ignore[arg-type]


def test_file_conventions(tmp_path: Path) -> None:
    first = write_synthetic(tmp_path / "r.dat", SPEC, fmt="ml-1m").read_text("latin-1").splitlines()[0]
    assert len(first.split("::")) == 4 and first.split("::")[2] in "12345"
    amazon = generate_interactions(SPEC, fmt="amazon-csv")
    assert (amazon.timestamps % 86_400 == 0).all()  # unixReviewTime is a day
    assert all(u.startswith("A") and len(u) == 14 for u in amazon.users.tolist())
    assert all(i.startswith("B") and len(i) == 10 for i in amazon.items.tolist())
    assert list(amazon.items) == sorted(amazon.items)  # the real files are sorted by item


def test_sequences_are_chronological_with_lengths_in_range() -> None:
    spec = SyntheticSpec(n_users=400, n_items=300, mean_seq_len=20.0, min_seq_len=5, max_seq_len=120)
    inter = generate_interactions(spec, seed=2)
    lengths = np.bincount(inter.users)[1:]
    assert lengths.min() >= 5 and lengths.max() <= 120
    assert lengths.mean() == pytest.approx(20.0, rel=0.15)
    for user in range(1, 30):
        rows = inter.users == user
        assert len(np.unique(inter.items[rows])) == rows.sum()  # distinct items per user
    ds = build_sequential_dataset(inter)
    for user in range(ds.n_users):
        assert (np.diff(ds.timestamps[ds.offsets[user] : ds.offsets[user + 1]]) >= 0).all()


@pytest.mark.parametrize(
    ("spec", "min_kept"),
    [(ml1m_shaped(0.1), 0.95), (amazon_games_shaped(0.05), 0.95)],
    ids=["ml1m", "amazon"],
)
def test_long_tail_survives_5core(spec: SyntheticSpec, min_kept: float) -> None:
    inter = generate_interactions(spec, seed=0)
    stats = build_sequential_dataset(inter, k=5).stats()
    assert stats["n_interactions"] >= min_kept * len(inter)
    assert stats["n_users"] >= 0.95 * spec.n_users
    assert stats["top20_share"] > 0.5 and stats["gini"] > 0.45


def test_drift_moves_popularity_over_time() -> None:
    spec = SyntheticSpec(n_users=400, n_items=200, mean_seq_len=10.0, drift=1.0, zipf_a=1.5)
    inter = generate_interactions(spec, seed=0)
    order = np.argsort(inter.timestamps)
    early, late = inter.items[order[: len(order) // 5]], inter.items[order[-len(order) // 5 :]]
    assert np.bincount(early).argmax() != np.bincount(late).argmax()
    assert not inter.same_data(generate_interactions(replace(spec, drift=0.0), seed=0))


def test_presets_match_the_real_datasets() -> None:
    ml = ml1m_shaped()
    assert (ml.n_users, ml.n_items, ml.mean_seq_len, ml.min_seq_len) == (6040, 3416, 165.6, 20)
    amazon = amazon_games_shaped()
    assert (amazon.n_users, amazon.n_items, amazon.mean_seq_len) == (24_303, 10_672, 9.5)
    small = ml1m_shaped(0.05)
    assert (small.n_users, small.min_seq_len) == (302, 5) and small.mean_seq_len < 10
    assert amazon_games_shaped(0.1).mean_seq_len == 9.5


def test_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mean_seq_len"):
        SyntheticSpec(n_users=10, n_items=10, mean_seq_len=5.0)  # must exceed min_seq_len=5
    with pytest.raises(ConfigError, match="n_items"):
        SyntheticSpec(n_users=10, n_items=3, mean_seq_len=8.0)
    with pytest.raises(ConfigError, match="must be integers"):
        SyntheticSpec(n_users=10.5, n_items=10, mean_seq_len=8.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="scale"):
        ml1m_shaped(0)
    with pytest.raises(ConfigError, match="unknown synthetic format 'csv'"):
        write_synthetic(tmp_path / "x", SPEC, fmt="csv")  # type: ignore[arg-type]
