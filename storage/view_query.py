"""The query helpers every read-side view shares (``storage.views``, ``storage.attack_views``, the leaderboard and
the stage summaries): the dashboard's filters, the engine, a statement read into a DataFrame, the finished result
runs, scalar metrics one column per name, a run's config and seed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import pandas as pd
from sqlalchemy import Select, select
from sqlalchemy.engine import Engine

from core.errors import ConfigError
from pbconfig.settings import get_settings
from storage.db import get_engine
from storage.models import Metric, Run

CHUNK = 500


@dataclass(frozen=True, kw_only=True)
class Filters:
    """The dashboard's filters (see the module docstring); ``None`` means no restriction."""

    dataset: str | None = None
    profile: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    commit: str | None = None
    root: str | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and utc(self.since) > utc(self.until):
            raise ConfigError(
                f"since must not be after until, got since={self.since!r}, until={self.until!r}; swap them"
            )

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        """``stmt`` (which selects from ``runs``) restricted to the filtered runs."""
        if self.dataset is not None:
            stmt = stmt.where(Run.dataset == self.dataset)
        if self.profile is not None:
            stmt = stmt.where(Run.profile == self.profile)
        if self.since is not None:
            stmt = stmt.where(Run.started_at >= utc(self.since))
        if self.until is not None:
            stmt = stmt.where(Run.started_at <= utc(self.until))
        if self.commit:
            stmt = stmt.where(Run.git_commit.startswith(self.commit, autoescape=True))
        if self.root is not None:
            tree = select(Run.id).where(Run.id == self.root).cte("subtree", recursive=True)
            tree = tree.union_all(select(Run.id).where(Run.parent_id == tree.c.id))
            stmt = stmt.where(Run.id.in_(select(tree.c.id)))
        return stmt


def filters(given: dict[str, Any]) -> Filters:
    known = [f.name for f in fields(Filters)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"unknown filter(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return Filters(**given)


def utc(moment: datetime) -> datetime:
    """Naive datetimes are UTC (the store writes UTC); SQLite compares the stored text without an offset."""
    aware = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return aware.replace(tzinfo=None)


def engine(db_url: str | None) -> Engine:
    return get_engine(db_url or get_settings().db_url)


def read(engine: Engine, stmt: Select[Any], columns: list[str] | None = None) -> pd.DataFrame:
    with engine.connect() as conn:
        result = conn.execute(stmt)
        frame = pd.DataFrame(result.fetchall(), columns=list(result.keys()))
    if columns is not None and frame.empty:
        return pd.DataFrame(columns=columns)
    return frame


def timestamps(frame: pd.DataFrame, *names: str) -> pd.DataFrame:
    for name in names:
        if name in frame:
            frame[name] = pd.to_datetime(frame[name], utc=True)
    return frame


def result_runs(engine: Engine, f: Filters, *conditions: Any) -> pd.DataFrame:
    """Finished runs matching ``f`` and ``conditions``: id, technique, dataset, config_json, started_at, ..."""
    stmt = select(
        Run.id.label("run_id"),
        Run.technique,
        Run.dataset,
        Run.config_json,
        Run.started_at,
        Run.git_commit,
        Run.mlflow_run_id,
        Run.device,
    ).where(Run.status == "finished", *conditions)
    frame = read(engine, f.apply(stmt).order_by(Run.started_at, Run.id))
    return timestamps(frame, "started_at")


def metrics_wide(
    engine: Engine, run_ids: list[str], names: list[str] | None = None, like: str | None = None
) -> pd.DataFrame:
    """Scalar metrics (no step) of ``run_ids`` as one row per run, one column per metric name."""
    parts = []
    for start in range(0, len(run_ids), CHUNK):
        stmt = select(Metric.run_id, Metric.name, Metric.value).where(
            Metric.run_id.in_(run_ids[start : start + CHUNK]), Metric.step.is_(None)
        )
        if names is not None:
            stmt = stmt.where(Metric.name.in_(names))
        if like is not None:
            stmt = stmt.where(Metric.name.like(like))
        parts.append(read(engine, stmt, ["run_id", "name", "value"]))
    long = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run_id", "name", "value"])
    wide = long.pivot_table(index="run_id", columns="name", values="value", aggfunc="last") if len(long) else None
    out = pd.DataFrame({"run_id": run_ids})
    if wide is not None:
        out = out.merge(wide.reset_index(), on="run_id", how="left")
    for name in names or ():
        if name not in out:
            out[name] = math.nan
    return out


def finish(frame: pd.DataFrame, columns: list[str], sort: list[str]) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame(columns=columns)
    return frame[columns].sort_values(sort, kind="stable").reset_index(drop=True)


def parse_config(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def config_seed(config: dict[str, Any]) -> int | None:
    """The shallowest integer ``seed`` of a run's config (breadth first, keys in order), None if it has none."""
    level: list[dict[str, Any]] = [config]
    while level:
        for node in level:
            seed = node.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                return seed
        level = [v for node in level for v in node.values() if isinstance(v, dict)]
    return None


__all__ = [
    "CHUNK",
    "Filters",
    "config_seed",
    "engine",
    "filters",
    "finish",
    "metrics_wide",
    "parse_config",
    "read",
    "result_runs",
    "timestamps",
    "utc",
]
