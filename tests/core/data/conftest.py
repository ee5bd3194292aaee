"""Shared fixtures for the core.data tests: tiny files on disk and hand-made interactions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from core.data import Interactions

WriteFile = Callable[..., Path]
MakeInteractions = Callable[..., Interactions]


@pytest.fixture
def write_file(tmp_path: Path) -> WriteFile:
    """``write_file(name, text_or_bytes, encoding="utf-8") -> Path`` under a fresh temp dir."""

    def write(name: str, content: str | bytes, encoding: str = "utf-8") -> Path:
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode(encoding))
        return path

    return write


@pytest.fixture
def make_interactions() -> MakeInteractions:
    """``make_interactions([(user, item, timestamp), ...])`` with rating 1.0 everywhere."""

    def make(rows: Sequence[tuple[object, object, int]], source: str = "hand") -> Interactions:
        users, items, times = zip(*rows, strict=True)
        return Interactions(np.array(users), np.array(items), np.ones(len(rows), np.float32), np.array(times), source)

    return make
