"""Format registry, the recbole ml-100k locator and the real MovieLens-100k numbers."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

import core.data
from core.data import (
    PARSERS,
    DatasetFormat,
    SyntheticSpec,
    build_sequential_dataset,
    load_recbole_ml100k,
    parse_ml100k,
    parse_ratings,
    recbole_ml100k_path,
    write_synthetic,
)
from core.errors import DataError


def test_every_format_has_a_parser() -> None:
    assert {f.value for f in DatasetFormat} == {
        "ml-1m",
        "ml-100k",
        "recbole-inter",
        "amazon-csv",
        "amazon-jsonl",
    }
    assert set(PARSERS) == set(DatasetFormat)


@pytest.mark.parametrize("fmt", [f.value for f in DatasetFormat])
def test_parse_ratings_dispatches_by_name(tmp_path: Path, fmt: str) -> None:
    spec = SyntheticSpec(n_users=5, n_items=10, mean_seq_len=7.0)
    path = write_synthetic(tmp_path / "f", spec, fmt=fmt, seed=0)  # type: ignore[arg-type]
    assert len(parse_ratings(fmt, path)) == len(parse_ratings(DatasetFormat(fmt), path)) > 0


def test_unknown_format_lists_known_ones(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="unknown dataset format 'movielens'.*'ml-1m'.*'amazon-jsonl'"):
        parse_ratings("movielens", tmp_path / "x")
    with pytest.raises(ValueError):
        DatasetFormat.of("ml1m")


def test_missing_recbole_gives_install_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"pip install --no-deps recbole==1\.2\.1"):
        recbole_ml100k_path()


@pytest.fixture(scope="module")
def ml100k_path() -> Path:
    try:
        return recbole_ml100k_path()
    except DataError as exc:
        pytest.skip(f"real ml-100k unavailable: {exc}")


def test_real_ml100k_numbers(ml100k_path: Path, tmp_path: Path) -> None:
    inter = load_recbole_ml100k()
    assert (inter.n_users, inter.n_items, len(inter)) == (943, 1682, 100_000)
    stats = build_sequential_dataset(inter, k=5).stats()
    assert (stats["n_users"], stats["n_items"], stats["n_interactions"]) == (943, 1349, 99_287)
    assert stats["gini"] == pytest.approx(0.5497, abs=1e-4)
    assert stats["top20_share"] == pytest.approx(0.5768, abs=1e-4)
    # The same ratings as a u.data file parse to the same rows (with int instead of str ids).
    body = ml100k_path.read_text().split("\n", 1)[1]
    (tmp_path / "u.data").write_text(body)
    as_udata = parse_ml100k(tmp_path / "u.data")
    assert as_udata.users.astype(str).tolist() == inter.users.tolist()
    assert as_udata.items.astype(str).tolist() == inter.items.tolist()
    assert (as_udata.timestamps == inter.timestamps).all() and (as_udata.ratings == inter.ratings).all()


def test_core_data_imports_only_numpy_torch_stdlib_and_core() -> None:
    allowed_third_party = {"numpy", "torch"}
    for module in Path(core.data.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top in allowed_third_party | {"core"} or top in sys.stdlib_module_names, (module, name)
