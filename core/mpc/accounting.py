"""Per-operation cost accounting for one MPC party (MERGE Tables 1-2: Embed / Linear / Softmax time and bytes).

A :class:`CostMeter` attributes wall seconds (``time.perf_counter``) and CrypTen communicator bytes and rounds
to op categories. Attribution is *exclusive*: when ops nest, every interval is charged to the innermost open
op only, so nothing is counted twice. Inside :meth:`CostMeter.region` everything not under an op is charged
to ``Other``, hence the per-category sums equal the region's totals (up to float rounding of the seconds).

Bytes and rounds are this party's own counters (``crypten.comm.get().get_communication_stats()``, which count
only with ``crypten.cfg.communicator.verbose = True``; CrypTen counts 8 bytes per ring element). CrypTen's own
``time`` counter is not used (it is wrong in 0.4.1).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

from core.errors import ConfigError


class OpCategory(str, Enum):
    """Cost categories; the first four follow MERGE Table 1 (Embed, Linear, Softmax, Act) plus Gen."""

    EMBED = "Embed"
    LINEAR = "Linear"
    SOFTMAX = "Softmax"
    ACTIVATION = "Activation"
    NORM = "Norm"
    GENERATION = "Generation"
    OTHER = "Other"


CATEGORIES: tuple[str, ...] = tuple(c.value for c in OpCategory)


def category_name(category: str | OpCategory) -> str:
    """The canonical name of a category; ConfigError listing the known ones for an unknown name."""
    value = category.value if isinstance(category, OpCategory) else category
    if value not in CATEGORIES:
        raise ConfigError(f"unknown op category {category!r}; known: {list(CATEGORIES)}")
    return value


def crypten_comm_stats() -> tuple[int, int]:
    """(bytes, rounds) of this party's CrypTen communicator so far; (0, 0) when CrypTen is not initialized."""
    import sys

    crypten = sys.modules.get("crypten")
    if crypten is None or not crypten.is_initialized():
        return 0, 0
    stats = crypten.comm.get().get_communication_stats()
    return int(stats["bytes"]), int(stats["rounds"])


@dataclass
class OpCost:
    """Accumulated cost of one category: wall seconds, bytes sent/received by this party, rounds."""

    s: float = 0.0
    bytes: int = 0
    rounds: int = 0
    calls: int = 0

    def as_dict(self) -> dict[str, float | int]:
        return {"s": self.s, "bytes": self.bytes, "rounds": self.rounds, "calls": self.calls}


class CostMeter:
    """Exclusive per-category wall time and communication of one party.

    >>> meter = CostMeter(stats=lambda: (0, 0))
    >>> with meter.region():
    ...     with meter.op("Linear"):
    ...         pass
    >>> sorted(meter.as_dict())[:2]
    ['Activation', 'Embed']
    """

    def __init__(
        self,
        *,
        stats: Callable[[], tuple[int, int]] = crypten_comm_stats,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._stats = stats
        self._clock = clock
        self._costs = {c: OpCost() for c in CATEGORIES}
        self._stack: list[str] = []
        self._mark: tuple[float, int, int] | None = None
        self._total = OpCost()
        self._region_start: tuple[float, int, int] | None = None

    def _now(self) -> tuple[float, int, int]:
        b, r = self._stats()
        return self._clock(), b, r

    def _charge(self) -> None:
        """Charge the interval since the last mark to the innermost open category (if any)."""
        now = self._now()
        if self._mark is not None and self._stack:
            cost = self._costs[self._stack[-1]]
            cost.s += now[0] - self._mark[0]
            cost.bytes += now[1] - self._mark[1]
            cost.rounds += now[2] - self._mark[2]
        self._mark = now

    @contextmanager
    def op(self, category: str | OpCategory) -> Iterator[None]:
        """Charge what happens inside to ``category`` (inner ops take their own share)."""
        name = category_name(category)
        self._charge()
        self._stack.append(name)
        self._costs[name].calls += 1
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    @contextmanager
    def region(self) -> Iterator[None]:
        """A metered region: time outside any op is charged to ``Other``; totals() covers all regions."""
        self._charge()
        self._stack.append(OpCategory.OTHER.value)
        start = self._mark
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()
            end = self._mark
            assert start is not None and end is not None
            self._total.s += end[0] - start[0]
            self._total.bytes += end[1] - start[1]
            self._total.rounds += end[2] - start[2]

    def snapshot(self) -> tuple[float, int, int]:
        """(clock seconds, bytes, rounds) now: differences of two snapshots split a region into phases."""
        return self._now()

    def counters(self) -> tuple[int, int]:
        """This meter's communication counters now, (bytes, rounds): differences split a region into steps."""
        return self._stats()

    def totals(self) -> dict[str, float | int]:
        """Wall seconds, bytes and rounds of all closed regions (``total_s``, ``comm_bytes``, ``rounds``)."""
        return {"total_s": self._total.s, "comm_bytes": self._total.bytes, "rounds": self._total.rounds}

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        """category -> {s, bytes, rounds, calls} for every category (zeros included)."""
        return {c: self._costs[c].as_dict() for c in CATEGORIES}


class NullMeter(CostMeter):
    """A meter that records nothing (plaintext references, or when costs are not wanted)."""

    def __init__(self) -> None:
        super().__init__(stats=lambda: (0, 0))

    @contextmanager
    def op(self, category: str | OpCategory) -> Iterator[None]:
        category_name(category)
        yield
