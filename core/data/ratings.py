"""Parsers for public rating logs into aligned interaction arrays.

DPFormer (App. E.1) evaluates sequential recommendation on MovieLens and Amazon review data,
preprocessed as in SASRec (Kang & McAuley, 2018). This module only *reads* those files; the
preprocessing (k-core filter, chronological sequences, leave-last-out split) is in
:mod:`core.data.sequential`.

Supported layouts (one record per line, blank lines skipped, ``.gz`` files read transparently):

======================  ===========================================================  =========
parser                  line layout                                                  raw ids
======================  ===========================================================  =========
:func:`parse_ml1m`      ``UserID::MovieID::Rating::Timestamp`` (latin-1)             int64
:func:`parse_ml100k`    ``user<TAB>item<TAB>rating<TAB>timestamp`` (``u.data``)      int64
:func:`parse_recbole`   RecBole atomic ``.inter``: header ``user_id:token<TAB>...``   str
:func:`parse_amazon_csv`  ``user,item,rating,timestamp`` (no header)                 str
:func:`parse_amazon_jsonl`  JSON objects with ``reviewerID, asin, overall,
                        unixReviewTime`` (other keys ignored)                        str
======================  ===========================================================  =========

MovieLens ids are integers by definition and are kept as ``int64``; RecBole tokens and Amazon
ids are strings (ASINs such as ``"0000013714"`` have meaningful leading zeros), kept as numpy
``str`` arrays. Either way the raw id of every interaction is recoverable.

Delimited files are parsed column-wise (a few Python-level passes, about 1 s per million lines);
if that fast path meets anything unexpected, the line-by-line reference parser re-reads the file
and raises a :class:`~core.errors.DataError` naming the file, the 1-based line number and the
offending line. Both paths share the same field converters, so they accept exactly the same files.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import DataError

__all__ = [
    "Interactions",
    "parse_amazon_csv",
    "parse_amazon_jsonl",
    "parse_ml1m",
    "parse_ml100k",
    "parse_recbole",
]

PathLike = str | os.PathLike[str]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_SHOWN = 120  # characters of a bad line quoted in an error message


@dataclass(frozen=True, eq=False)
class Interactions:
    """One row per (user, item) event, as four aligned 1-D arrays.

    Attributes:
        users: raw user ids, ``int64`` or numpy ``str`` (shape ``(N,)``).
        items: raw item ids, ``int64`` or numpy ``str`` (shape ``(N,)``).
        ratings: explicit rating, ``float32`` (``1.0`` where the source has none).
        timestamps: event time in whole seconds since the epoch, ``int64``.
        source: where the rows came from (a path, or ``"synthetic:..."``).

    Rows keep the order of the source file, which breaks timestamp ties downstream. The arrays
    are read-only views; use :meth:`take` to select rows.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    timestamps: np.ndarray
    source: str = "<memory>"

    def __post_init__(self) -> None:
        columns = {
            "users": _id_column("users", self.users),
            "items": _id_column("items", self.items),
            "ratings": np.asarray(self.ratings, dtype=np.float32),
            "timestamps": _int_column("timestamps", self.timestamps),
        }
        for name, col in columns.items():
            if col.ndim != 1:
                raise DataError(f"Interactions.{name} must be 1-D, got shape {col.shape}")
            if len(col) != len(columns["users"]):
                lengths = {k: len(v) for k, v in columns.items()}
                raise DataError(f"Interactions columns must have one length, got {lengths}")
            view = col.view()
            view.flags.writeable = False
            object.__setattr__(self, name, view)

    def __len__(self) -> int:
        return len(self.users)

    @property
    def n_users(self) -> int:
        """Number of distinct users."""
        return len(np.unique(self.users))

    @property
    def n_items(self) -> int:
        """Number of distinct items."""
        return len(np.unique(self.items))

    def take(self, rows: np.ndarray) -> Interactions:
        """The interactions at ``rows`` (a boolean mask or integer indices), in that order."""
        return Interactions(self.users[rows], self.items[rows], self.ratings[rows], self.timestamps[rows], self.source)

    def same_data(self, other: Interactions) -> bool:
        """Whether both hold the same rows in the same order (``source`` is not compared)."""
        return all(
            a.dtype.kind == b.dtype.kind and np.array_equal(a, b)
            for a, b in zip(self._columns(), other._columns(), strict=True)
        )

    def _columns(self) -> tuple[np.ndarray, ...]:
        return self.users, self.items, self.ratings, self.timestamps


def _id_column(name: str, values: np.ndarray | Sequence[object]) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind == "O" and all(isinstance(v, str) for v in arr.ravel()):
        arr = arr.astype(str)
    if arr.dtype.kind in "iu":
        return _int_column(name, arr)
    if arr.dtype.kind == "U":
        return arr
    raise DataError(f"Interactions.{name} must hold int or str ids, got dtype {arr.dtype}")


def _int_column(name: str, values: np.ndarray | Sequence[int]) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size and arr.dtype.kind not in "iu":
        raise DataError(f"Interactions.{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


# --------------------------------------------------------------------------------------- fields
# Each converter raises ValueError with a message that names the field; callers add file:line.


def _int_id(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not an integer") from None
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"{name} {text!r} does not fit in int64")
    return value


def _str_id(name: str, text: str) -> str:
    if not text or text.isspace():
        raise ValueError(f"{name} is empty")
    return text


def _rating(name: str, text: str) -> float:
    try:
        with np.errstate(over="ignore"):
            value = np.float32(float(text))
    except ValueError:
        raise ValueError(f"{name} {text!r} is not a number") from None
    if not np.isfinite(value):
        raise ValueError(f"{name} {text!r} is not a finite float32")
    return float(value)


def _timestamp(name: str, text: str) -> int:
    """Whole seconds; integral floats such as ``'881250949.0'`` are accepted."""
    try:
        return _int_id(name, text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name} {text!r} is not a number") from None
    if not (math.isfinite(value) and value.is_integer() and _INT64_MIN <= value < 2.0**63):
        raise ValueError(f"{name} {text!r} is not a whole number of seconds; round it")
    return int(value)


def _show(line: str) -> str:
    return repr(line if len(line) <= _MAX_SHOWN else line[:_MAX_SHOWN] + "...")


# ---------------------------------------------------------------------------------------- files


def _read_lines(path: PathLike, encoding: str) -> tuple[Path, list[str]]:
    """All lines of ``path`` (gzip-aware), with a DataError for a missing or unreadable file."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file; check the path or download the dataset first")
    if not path.is_file():
        raise DataError(f"{path}: is not a file; pass the ratings file itself, not its folder")
    opener: Callable[..., object] = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding=encoding, newline="") as handle:  # type: ignore[attr-defined]
            text: str = handle.read()
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: byte {exc.start} is not valid {encoding} ({exc.reason}); re-encode it as {encoding}"
        ) from exc
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot be read ({exc}); check the file is complete") from exc
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    return path, text.split("\n")


def _non_blank(lines: list[str]) -> list[str]:
    return [line for line in lines if line and not line.isspace()]


def _empty_error(path: Path, what: str = "interactions") -> DataError:
    return DataError(f"{path}: file is empty (no {what}); check the download or the path")


@dataclass(frozen=True)
class _Layout:
    """Where the four fields sit in a delimited line, and how ids are typed."""

    sep: str
    fields: tuple[str, ...]  # field names, for error messages
    user: int
    item: int
    rating: int | None  # None: implicit feedback, every rating is 1.0
    timestamp: int
    int_ids: bool

    @property
    def spec(self) -> str:
        return self.sep.join(self.fields)


_ML1M = _Layout("::", ("UserID", "MovieID", "Rating", "Timestamp"), 0, 1, 2, 3, int_ids=True)
_ML100K = _Layout("\t", ("user", "item", "rating", "timestamp"), 0, 1, 2, 3, int_ids=True)
_AMAZON_CSV = _Layout(",", ("user", "item", "rating", "timestamp"), 0, 1, 2, 3, int_ids=False)

_Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _parse_delimited(path: Path, lines: list[str], layout: _Layout, first_lineno: int) -> _Columns:
    """Fast column-wise parse, falling back to the reference parser (which names the bad line)."""
    columns = _parse_columns(_non_blank(lines), layout)
    return columns if columns is not None else _parse_reference(path, lines, layout, first_lineno)


def _parse_columns(lines: list[str], layout: _Layout) -> _Columns | None:
    """Vectorised parse of blank-free ``lines``; ``None`` if any line is not well formed."""
    n_fields, n = len(layout.fields), len(lines)
    if any(line.count(layout.sep) != n_fields - 1 for line in lines):
        return None
    cells = layout.sep.join(lines).split(layout.sep)
    try:
        users = _fast_ids(cells[layout.user :: n_fields], layout.int_ids)
        items = _fast_ids(cells[layout.item :: n_fields], layout.int_ids)
        if layout.rating is None:
            ratings = np.ones(n, dtype=np.float32)
        else:
            ratings64 = np.fromiter(map(float, cells[layout.rating :: n_fields]), np.float64, n)
            with np.errstate(over="ignore"):
                ratings = ratings64.astype(np.float32)
            if not np.isfinite(ratings).all():
                return None
        timestamps = _fast_timestamps(cells[layout.timestamp :: n_fields])
    except (ValueError, OverflowError):
        return None
    return None if timestamps is None else (users, items, ratings, timestamps)


def _fast_ids(cells: list[str], int_ids: bool) -> np.ndarray:
    if int_ids:
        return np.fromiter(map(int, cells), np.int64, len(cells))
    if any(not c or c.isspace() for c in cells):
        raise ValueError("empty id")
    return np.array(cells, dtype=str)


def _fast_timestamps(cells: list[str]) -> np.ndarray | None:
    try:
        return np.fromiter(map(int, cells), np.int64, len(cells))
    except ValueError:
        pass
    values = np.fromiter(map(float, cells), np.float64, len(cells))
    # Below 2**53 a float holds every integer exactly, so this agrees with _timestamp line by line.
    if not (np.isfinite(values).all() and (np.abs(values) < 2.0**53).all()):
        return None
    if not (values == np.floor(values)).all():
        return None
    return values.astype(np.int64)


def _parse_reference(path: Path, lines: list[str], layout: _Layout, first_lineno: int) -> _Columns:
    """Line-by-line parser: slow, obviously correct, and precise about the first bad line."""
    to_id = _int_id if layout.int_ids else _str_id
    users: list[int | str] = []
    items: list[int | str] = []
    ratings: list[float] = []
    timestamps: list[int] = []
    for lineno, line in enumerate(lines, start=first_lineno):
        if not line or line.isspace():
            continue
        fields = line.split(layout.sep)
        if len(fields) != len(layout.fields):
            raise DataError(f"{path}:{lineno}: expected {len(layout.fields)} fields {layout.spec!r}, got {_show(line)}")
        names = layout.fields
        try:
            users.append(to_id(names[layout.user], fields[layout.user]))
            items.append(to_id(names[layout.item], fields[layout.item]))
            r = layout.rating
            ratings.append(1.0 if r is None else _rating(names[r], fields[r]))
            timestamps.append(_timestamp(names[layout.timestamp], fields[layout.timestamp]))
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: {exc} in {_show(line)}; fix or delete that line") from None
    id_dtype = np.int64 if layout.int_ids else str
    return (
        np.array(users, dtype=id_dtype),
        np.array(items, dtype=id_dtype),
        np.array(ratings, dtype=np.float32),
        np.array(timestamps, dtype=np.int64),
    )


def _delimited(path: PathLike, layout: _Layout, encoding: str) -> Interactions:
    file, lines = _read_lines(path, encoding)
    if not _has_content(lines):
        raise _empty_error(file)
    return Interactions(*_parse_delimited(file, lines, layout, first_lineno=1), source=str(file))


def _has_content(lines: list[str]) -> bool:
    return any(line and not line.isspace() for line in lines)


# -------------------------------------------------------------------------------------- parsers


def parse_ml1m(path: PathLike) -> Interactions:
    """MovieLens-1M ``ratings.dat``: ``UserID::MovieID::Rating::Timestamp``, latin-1 encoded."""
    return _delimited(path, _ML1M, encoding="latin-1")


def parse_ml100k(path: PathLike) -> Interactions:
    """MovieLens-100k ``u.data``: tab-separated ``user item rating timestamp``, no header."""
    return _delimited(path, _ML100K, encoding="latin-1")


def parse_amazon_csv(path: PathLike) -> Interactions:
    """Amazon "ratings only" CSV: ``user,item,rating,timestamp``, no header, UTF-8."""
    return _delimited(path, _AMAZON_CSV, encoding="utf-8-sig")


def parse_recbole(path: PathLike) -> Interactions:
    """RecBole atomic ``.inter`` file, e.g. the ``ml-100k.inter`` shipped in the recbole wheel.

    The first line is a tab-separated header of ``name:type`` fields; columns are found by name:
    ``user_id``, ``item_id`` and ``timestamp`` are required, ``rating`` is optional (``1.0`` when
    absent, i.e. implicit feedback) and other columns are ignored. Ids are kept as strings
    (RecBole ``token``); timestamps may be written as integral floats (``881250949.0``).
    """
    file, lines = _read_lines(path, encoding="utf-8-sig")
    header_at = next((i for i, line in enumerate(lines) if line and not line.isspace()), None)
    if header_at is None:
        raise _empty_error(file)
    header = lines[header_at].split("\t")
    names = [field.split(":", 1)[0].strip() for field in header]
    missing = [name for name in ("user_id", "item_id", "timestamp") if name not in names]
    if missing or len(set(names)) != len(names):
        raise DataError(
            f"{file}:{header_at + 1}: a RecBole .inter header needs distinct columns user_id, item_id "
            f"and timestamp (rating optional), missing {missing} in {_show(lines[header_at])}"
        )
    layout = _Layout(
        sep="\t",
        fields=tuple(header),
        user=names.index("user_id"),
        item=names.index("item_id"),
        rating=names.index("rating") if "rating" in names else None,
        timestamp=names.index("timestamp"),
        int_ids=False,
    )
    body = lines[header_at + 1 :]
    if not _has_content(body):
        raise _empty_error(file, "interactions below the header")
    return Interactions(*_parse_delimited(file, body, layout, first_lineno=header_at + 2), source=str(file))


_AMAZON_KEYS = ("reviewerID", "asin", "overall", "unixReviewTime")


def parse_amazon_jsonl(path: PathLike) -> Interactions:
    """Amazon review JSON lines (e.g. the 5-core ``reviews_Video_Games_5.json``).

    Each line is a JSON object; ``reviewerID`` and ``asin`` (non-empty strings), ``overall``
    (a number) and ``unixReviewTime`` (whole seconds) are read, every other key is ignored.
    """
    file, lines = _read_lines(path, encoding="utf-8-sig")
    users: list[str] = []
    items: list[str] = []
    ratings: list[float] = []
    timestamps: list[int] = []
    for lineno, line in enumerate(lines, start=1):
        if not line or line.isspace():
            continue
        try:
            user, item, rating, timestamp = _amazon_record(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}:{lineno}: invalid JSON ({exc.msg}) in {_show(line)}") from None
        except (ValueError, TypeError) as exc:
            raise DataError(f"{file}:{lineno}: {exc} in {_show(line)}; fix or delete that line") from None
        users.append(user)
        items.append(item)
        ratings.append(rating)
        timestamps.append(timestamp)
    if not users:
        raise _empty_error(file)
    return Interactions(
        np.array(users, dtype=str),
        np.array(items, dtype=str),
        np.array(ratings, dtype=np.float32),
        np.array(timestamps, dtype=np.int64),
        source=str(file),
    )


def _amazon_record(obj: object) -> tuple[str, str, float, int]:
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object with keys {list(_AMAZON_KEYS)}, got {type(obj).__name__}")
    missing = [key for key in _AMAZON_KEYS if key not in obj]
    if missing:
        raise ValueError(f"missing key(s) {missing} (an Amazon review needs {list(_AMAZON_KEYS)})")
    user, item, rating, timestamp = (obj[key] for key in _AMAZON_KEYS)
    for key, value in (("reviewerID", user), ("asin", item)):
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got {value!r}")
        _str_id(key, value)
    for key, value in (("overall", rating), ("unixReviewTime", timestamp)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{key} must be a number, got {value!r}")
    return user, item, _rating("overall", repr(rating)), _timestamp("unixReviewTime", repr(timestamp))
