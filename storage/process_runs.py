"""The rows a command's processes opened: what ``privbench run`` shows as progress and what its supervisor ends in
Prefect when the flow process is gone. Queries only; ``storage.recovery`` marks such rows failed."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from pbconfig.settings import get_settings
from storage import provenance
from storage.db import session_scope
from storage.models import Run

PROGRESS_COLUMNS = (
    "id",
    "parent_id",
    "flow",
    "stage",
    "technique",
    "dataset",
    "status",
    "started_at",
    "duration_s",
    "error",
)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value  # SQLite: naive, written in UTC


def runs_of_processes(pids: set[int], since: datetime, running: set[str]) -> list[dict[str, Any]]:
    """The rows opened on this host by one of ``pids`` since ``since``, and (transitively) those nested under
    ``running`` rows or under the rows found (a remote worker's, say): one dict of ``PROGRESS_COLUMNS`` each
    (``started_at`` in UTC). One query, plus one per level of nesting found."""
    columns = tuple(getattr(Run, c) for c in PROGRESS_COLUMNS)
    found: dict[str, Any] = {}
    with session_scope(get_settings().db_url) as session:
        if pids:
            for row in session.execute(
                select(*columns).where(Run.host == provenance.host(), Run.pid.in_(sorted(pids)))
            ):
                if _utc(row.started_at) >= since:
                    found[row.id] = row
        parents = set(running) | {i for i, r in found.items() if r.status == "running"}
        while parents:
            children = session.execute(select(*columns).where(Run.parent_id.in_(sorted(parents)))).all()
            parents = {r.id for r in children if r.id not in found and r.status == "running"}
            found.update({r.id: r for r in children})
    return [{**r._asdict(), "started_at": _utc(r.started_at)} for r in found.values()]


def prefect_flow_runs_of_processes(pids: set[int]) -> set[str]:
    """The Prefect flow runs of every row these processes of this host opened (any status)."""
    if not pids:
        return set()
    with session_scope(get_settings().db_url) as session:
        ids = session.scalars(
            select(Run.prefect_flow_run_id)
            .distinct()
            .where(Run.host == provenance.host(), Run.pid.in_(sorted(pids)), Run.prefect_flow_run_id.is_not(None))
        )
        return set(ids)


__all__ = ["PROGRESS_COLUMNS", "prefect_flow_runs_of_processes", "runs_of_processes"]
