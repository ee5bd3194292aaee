"""The paper-scale measurement queue (``configs/queue/paper.yaml``): what a lent GPU session measures next.

Each item is one ``privbench bench NAME --profile paper --no-record --json`` call (with its methods and ``--set``
overrides), sized to fit one call on the lent machine (``time_limit_s``), in priority order. ``expected_s`` holds
the seconds an item took where it has been measured, per device class (``cuda``, ``cpu``): the queue starts an
item only where that (or, unmeasured, its time limit) fits the budget left. ``privbench.paper_queue`` runs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from core.errors import ConfigError
from pbconfig.base import FrozenConfig
from pbconfig.benchmark import CONFIG_DIR

QUEUE_FILE = CONFIG_DIR / "queue" / "paper.yaml"
DeviceClass = Literal["cuda", "cpu"]


class QueueItem(FrozenConfig):
    """One measurement: a bench at the paper profile with its options; ``name`` names its result file."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$", description="lower-case words joined by '-'")
    bench: str
    methods: tuple[str, ...] = ()
    sets: tuple[str, ...] = Field((), description="--set KEY=VALUE items, as `privbench bench --set`")
    time_limit_s: float = Field(gt=0, le=600, description="one call on a lent machine: at most 10 minutes")
    expected_s: dict[DeviceClass, float] = Field(default_factory=dict, description="measured seconds per device")
    why: str = Field(min_length=10, description="what the measurement is for (the claim or issue it serves)")

    @field_validator("sets")
    @classmethod
    def _sets(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        bad = [v for v in values if "=" not in v]
        if bad:
            raise ValueError(f"sets must be KEY=VALUE items, got {bad}; e.g. secure_inference.gen_len=14")
        return values

    @field_validator("expected_s")
    @classmethod
    def _expected(cls, values: dict[str, float]) -> dict[str, float]:
        bad = {k: v for k, v in values.items() if not v > 0}
        if bad:
            raise ValueError(f"expected_s must be positive seconds, got {bad}")
        return values


class PaperQueue(FrozenConfig):
    """The ordered items (first: measured first)."""

    items: tuple[QueueItem, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> PaperQueue:
        names = [i.name for i in self.items]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"queue item names must be distinct, got {repeated} more than once")
        return self


def load_queue(path: Path | None = None) -> PaperQueue:
    """The queue in ``path`` (default ``configs/queue/paper.yaml``); ConfigError naming the file and the fault."""
    path = QUEUE_FILE if path is None else Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the queue {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    try:
        return PaperQueue.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None


__all__ = ["QUEUE_FILE", "DeviceClass", "PaperQueue", "QueueItem", "load_queue"]
