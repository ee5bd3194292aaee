"""Seeded synthetic rating logs with realistic long-tail statistics, written in the real file formats.

The real MovieLens-1M and Amazon dumps of DPFormer's evaluation (App. E.1, preprocessed as in
SASRec, Kang & McAuley 2018) cannot be downloaded offline, so the benchmark generates look-alikes
that exercise the same code path (real parser, k-core filter, leave-last-out split):

* **Popularity**: Zipf's law, item of popularity rank ``r`` drawn with weight ``r ** -zipf_a``
  (ranks randomly assigned to item ids). Each user picks distinct items (weighted sampling without
  replacement), as on MovieLens where a user rates a film once.
* **Sequence lengths**: ``min_seq_len + round(LogNormal)`` with the requested mean, capped at
  ``max_seq_len``; the heavy right tail mimics a few very active users.
* **Order and time**: each item has a latent "era" ``tau`` in [0, 1]; a user consumes the picked
  items roughly in era order (``order_strength``), a learnable sequential signal. Timestamps start
  at a uniformly drawn time per user and advance in sessions (gaps of about a minute, and now and
  then a break of days), so they are chronological per user, with occasional ties.
* **Drift** (optional): popularity ranks rotate by ``drift * n_items`` over the time span, so
  late users prefer other items than early ones.

The output format fixes only surface conventions: MovieLens files get integer ids and ratings
and second-resolution times; Amazon files get Amazon-like string ids (``"A1B2..."``, ``"B0..."``),
ratings written as ``5.0`` and day-resolution times (``unixReviewTime`` is midnight UTC); row
order follows the real files (ML-1M grouped by user, ml-100k shuffled, Amazon sorted by item).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from core.data.ratings import Interactions
from core.errors import ConfigError

__all__ = [
    "SyntheticFormat",
    "SyntheticSpec",
    "amazon_games_shaped",
    "generate_interactions",
    "ml1m_shaped",
    "write_synthetic",
]

SyntheticFormat = Literal["ml-1m", "ml-100k", "recbole-inter", "amazon-csv", "amazon-jsonl"]
_DAY = 86_400
_ML_RATINGS = (0.056, 0.108, 0.261, 0.349, 0.226)  # MovieLens-1M star shares
_AMAZON_RATINGS = (0.065, 0.05, 0.1, 0.2, 0.585)  # Amazon Video Games star shares
_BASE36 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic rating log (see the module docstring for the model).

    Attributes:
        n_users: number of users, each with at least ``min_seq_len`` interactions.
        n_items: catalogue size (items nobody picks do not appear in the output).
        mean_seq_len: target mean interactions per user (before the ``max_seq_len`` cap).
        zipf_a: Zipf exponent of item popularity (larger: longer tail, more concentrated head).
        min_seq_len: shortest sequence (5 keeps users through a 5-core filter).
        max_seq_len: longest sequence; ``None`` means ``n_items``.
        len_sigma: log-normal shape of the lengths above ``min_seq_len`` (larger: heavier tail).
        order_strength: 0 gives a random order within a user, 1 sorts by the items' latent era.
        drift: popularity ranks rotate by ``drift * n_items`` over the time span (0: no drift).
        rating_probs: probability of 1..5 stars.
        start_time: earliest first-interaction time (Unix seconds).
        span_days: users start uniformly within ``span_days`` of ``start_time``.
        break_days: mean length of a break between sessions.
    """

    n_users: int
    n_items: int
    mean_seq_len: float
    zipf_a: float = 1.1
    min_seq_len: int = 5
    max_seq_len: int | None = None
    len_sigma: float = 1.0
    order_strength: float = 0.8
    drift: float = 0.0
    rating_probs: tuple[float, ...] = field(default=_ML_RATINGS)
    start_time: int = 956_703_932  # 2000-04-25, the first ML-1M rating
    span_days: float = 1000.0
    break_days: float = 5.0

    def __post_init__(self) -> None:
        integers = ("n_users", "n_items", "min_seq_len", "start_time")
        if not all(_is_int(getattr(self, name)) for name in integers) or not (
            self.max_seq_len is None or _is_int(self.max_seq_len)
        ):
            values = {name: getattr(self, name) for name in (*integers, "max_seq_len")}
            raise ConfigError(f"SyntheticSpec fields {values} must be integers")
        checks = {
            "n_users": self.n_users >= 1,
            "min_seq_len": self.min_seq_len >= 1,
            "n_items": self.n_items >= self.min_seq_len,
            "mean_seq_len": self.mean_seq_len > self.min_seq_len,
            "max_seq_len": self.max_seq_len is None or self.min_seq_len <= self.max_seq_len <= self.n_items,
            "zipf_a": self.zipf_a >= 0,
            "len_sigma": self.len_sigma > 0,
            "order_strength": 0 <= self.order_strength <= 1,
            "drift": 0 <= self.drift <= 1,
            "rating_probs": len(self.rating_probs) == 5 and math.isclose(sum(self.rating_probs), 1.0),
            "span_days": self.span_days >= 0,
            "break_days": self.break_days > 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            values = {name: getattr(self, name) for name in bad}
            raise ConfigError(
                f"invalid SyntheticSpec field(s) {values}; need n_users >= 1, min_seq_len <= n_items, "
                "mean_seq_len > min_seq_len, min_seq_len <= max_seq_len <= n_items, zipf_a >= 0, "
                "len_sigma > 0, order_strength and drift in [0, 1], 5 rating_probs summing to 1"
            )

    @property
    def seq_len_cap(self) -> int:
        return self.n_items if self.max_seq_len is None else self.max_seq_len


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def ml1m_shaped(scale: float = 1.0) -> SyntheticSpec:
    """MovieLens-1M look-alike: 6,040 users, 3,416 items, ~165 ratings per user (min 20, max 2,314).

    The catalogue is ML-1M's 5-core one; at full scale every item survives a 5-core filter.
    ``scale`` in (0, 1] shrinks users, items *and* sequence lengths together (lengths >= 5), which
    keeps the density, so interactions shrink about as ``scale ** 2`` (0.05: ~300 users, ~2.5k
    interactions) and a 5-core filter trims more of the tail at small scales.
    """
    spec = SyntheticSpec(
        n_users=6040, n_items=3416, mean_seq_len=165.6, min_seq_len=20, max_seq_len=2314, len_sigma=1.14
    )
    return _scaled(spec, scale, scale_lengths=True)


def amazon_games_shaped(scale: float = 1.0) -> SyntheticSpec:
    """Amazon Video Games (5-core) look-alike: 24,303 users, 10,672 items, ~9.5 reviews per user.

    Much sparser than MovieLens: most users have 5-10 items, day-resolution timestamps. A flatter
    Zipf exponent (0.8) keeps most items above 5 interactions at this density. ``scale`` in
    (0, 1] shrinks users and items only (sequences are already short), keeping ~21 interactions
    per item so that a 5-core filter keeps most of the data.
    """
    spec = SyntheticSpec(
        n_users=24_303, n_items=10_672, mean_seq_len=9.5, zipf_a=0.8, len_sigma=0.9,
        rating_probs=_AMAZON_RATINGS, start_time=1_104_537_600, span_days=3300.0, break_days=60.0,
    )  # fmt: skip
    return _scaled(spec, scale, scale_lengths=False)


def _scaled(spec: SyntheticSpec, scale: float, *, scale_lengths: bool) -> SyntheticSpec:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale <= 1:
        raise ConfigError(f"scale must be in (0, 1], got scale={scale!r}")
    if scale == 1:
        return spec
    length_scale = scale if scale_lengths else 1.0
    min_len = max(5, round(spec.min_seq_len * length_scale))
    n_items = max(2 * min_len, round(spec.n_items * scale))
    max_len = spec.max_seq_len
    if max_len is not None:
        max_len = min(n_items, max(min_len, round(max_len * length_scale)))
    return replace(
        spec,
        n_users=max(1, round(spec.n_users * scale)),
        n_items=n_items,
        mean_seq_len=max(min_len + 1.0, spec.mean_seq_len * length_scale),
        min_seq_len=min_len,
        max_seq_len=max_len,
    )


def generate_interactions(spec: SyntheticSpec, *, fmt: SyntheticFormat = "ml-1m", seed: int = 0) -> Interactions:
    """The interactions :func:`write_synthetic` writes for the same arguments, rows in file order."""
    _check_format(fmt)
    rng = np.random.default_rng(seed)
    lengths = _sequence_lengths(spec, rng)
    starts = rng.random(spec.n_users)  # each user's first interaction, as a fraction of the span
    item_idx = _pick_items(spec, lengths, starts, rng)
    user_idx = np.repeat(np.arange(spec.n_users), lengths)
    era = rng.random(spec.n_items)
    order_key = spec.order_strength * era[item_idx] + (1 - spec.order_strength) * rng.random(len(item_idx))
    item_idx = item_idx[np.lexsort((order_key, user_idx))]  # chronological within each user
    timestamps = _session_times(spec, lengths, starts, rng)
    ratings = rng.choice(np.arange(1, 6), size=len(user_idx), p=spec.rating_probs).astype(np.float32)
    if fmt.startswith("amazon"):
        timestamps = timestamps // _DAY * _DAY
    rows = _file_order(fmt, user_idx, item_idx, rng)
    user_ids, item_ids = _raw_ids(fmt, spec, seed)
    return Interactions(
        user_ids[user_idx[rows]],
        item_ids[item_idx[rows]],
        ratings[rows],
        timestamps[rows],
        source=f"synthetic:{fmt}:seed={seed}",
    )


def _check_format(fmt: str) -> None:
    if fmt not in get_args(SyntheticFormat):
        raise ConfigError(f"unknown synthetic format {fmt!r}; choose one of {list(get_args(SyntheticFormat))}")


def _sequence_lengths(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    excess = spec.mean_seq_len - spec.min_seq_len  # E[LogNormal(mu, s)] = exp(mu + s^2 / 2) = excess
    mu = math.log(excess) - spec.len_sigma**2 / 2
    extra = np.rint(rng.lognormal(mu, spec.len_sigma, size=spec.n_users)).astype(np.int64)
    return np.minimum(spec.min_seq_len + extra, spec.seq_len_cap)


def _pick_items(spec: SyntheticSpec, lengths: np.ndarray, starts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``(sum(lengths),)`` user-major item indices: ``lengths[u]`` distinct items for user ``u``.

    Items are drawn with probability proportional to the Zipf weight of their popularity rank,
    without replacement. Keeping the first distinct values of i.i.d. draws is exactly such
    successive sampling, and cheap for short sequences; a user whose draws hold too few distinct
    items falls back to the Gumbel top-k trick (also exact, O(n_items) per user).
    """
    n_items = spec.n_items
    log_weight = -spec.zipf_a * np.log(np.arange(1, n_items + 1))  # by popularity rank 0, 1, ...
    cdf = np.cumsum(np.exp(log_weight))
    item_of_rank = rng.permutation(n_items)
    n_draws = 2 * lengths + 8
    draws = np.searchsorted(cdf / cdf[-1], rng.random(int(n_draws.sum())), side="right")
    picked = []
    for ranks, length in zip(np.split(np.minimum(draws, n_items - 1), np.cumsum(n_draws)[:-1]), lengths):
        first = np.unique(ranks, return_index=True)[1]
        if len(first) >= length:
            picked.append(ranks[np.sort(first)[:length]])
        else:
            keys = log_weight + rng.gumbel(size=n_items)
            picked.append(np.argpartition(-keys, length - 1)[:length])
    shifts = np.repeat((spec.drift * starts * n_items).astype(np.int64), lengths)  # popularity drift
    return item_of_rank[(np.concatenate(picked) + shifts) % n_items]


def _session_times(
    spec: SyntheticSpec, lengths: np.ndarray, starts: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """User-major whole seconds, nondecreasing per user: ~1 minute gaps in a session, days between."""
    n = int(lengths.sum())
    gaps = np.where(rng.random(n) < 0.1, rng.exponential(spec.break_days * _DAY, n), rng.exponential(60.0, n))
    first_row = np.cumsum(lengths) - lengths
    gaps[first_row] = 0.0
    elapsed = np.cumsum(gaps)
    elapsed -= np.repeat(elapsed[first_row], lengths)
    first_time = spec.start_time + starts * spec.span_days * _DAY
    return np.floor(np.repeat(first_time, lengths) + elapsed).astype(np.int64)


def _file_order(fmt: str, users: np.ndarray, items: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row permutation mimicking the real files (generation order is user-major, chronological)."""
    if fmt == "ml-1m":  # grouped by user, unordered within a user
        return np.lexsort((rng.random(len(users)), users))
    if fmt.startswith("amazon"):  # sorted by item
        return np.argsort(items, kind="stable")
    return rng.permutation(len(users))  # u.data and its RecBole copy are shuffled


def _raw_ids(fmt: str, spec: SyntheticSpec, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw ids of user index ``0..U-1`` and item index ``0..M-1`` in the format's style."""
    users, items = np.arange(1, spec.n_users + 1), np.arange(1, spec.n_items + 1)
    if fmt in ("ml-1m", "ml-100k"):
        return users, items
    if fmt == "recbole-inter":
        return users.astype(str), items.astype(str)
    return _amazon_ids("A", 13, spec.n_users, seed), _amazon_ids("B", 9, spec.n_items, seed + 1)


def _amazon_ids(prefix: str, width: int, n: int, seed: int) -> np.ndarray:
    """``n`` distinct Amazon-looking ids: ``i -> (i * m + c) mod 36**width`` is a bijection (gcd(m, 36) = 1)."""
    modulus, multiplier = 36**width, 1_000_000_007
    offset = int(np.random.default_rng(seed).integers(2**62)) % modulus
    return np.array([prefix + _base36((i * multiplier + offset) % modulus, width) for i in range(n)])


def _base36(value: int, width: int) -> str:
    digits = []
    for _ in range(width):
        value, digit = divmod(value, 36)
        digits.append(_BASE36[digit])
    return "".join(reversed(digits))


def write_synthetic(path: str | os.PathLike[str], spec: SyntheticSpec, *, fmt: SyntheticFormat, seed: int = 0) -> Path:
    """Write :func:`generate_interactions` ``(spec, fmt=fmt, seed=seed)`` to ``path`` in format ``fmt``.

    The bytes depend only on the arguments; parsing the file with the matching parser of
    :mod:`core.data.ratings` gives back exactly the generated interactions.
    """
    inter = generate_interactions(spec, fmt=fmt, seed=seed)
    rows = zip(inter.users.tolist(), inter.items.tolist(), inter.ratings.tolist(), inter.timestamps.tolist())
    if fmt == "ml-1m":
        lines = [f"{u}::{i}::{r:.0f}::{t}" for u, i, r, t in rows]
    elif fmt == "ml-100k":
        lines = [f"{u}\t{i}\t{r:.0f}\t{t}" for u, i, r, t in rows]
    elif fmt == "recbole-inter":
        header = "user_id:token\titem_id:token\trating:float\ttimestamp:float"
        lines = [header, *(f"{u}\t{i}\t{r:.0f}\t{t}" for u, i, r, t in rows)]
    elif fmt == "amazon-csv":
        lines = [f"{u},{i},{r:.1f},{t}" for u, i, r, t in rows]
    else:
        lines = [_amazon_review(u, i, r, t) for u, i, r, t in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoding = "latin-1" if fmt == "ml-1m" else "utf-8"
    path.write_bytes(("\n".join(lines) + "\n").encode(encoding))
    return path


def _amazon_review(user: str, item: str, rating: float, time: int) -> str:
    day = datetime.fromtimestamp(time, tz=UTC)
    review = {
        "reviewerID": user,
        "asin": item,
        "helpful": [0, 0],
        "overall": rating,
        "unixReviewTime": time,
        "reviewTime": f"{day.month:02d} {day.day}, {day.year}",
    }
    return json.dumps(review)
