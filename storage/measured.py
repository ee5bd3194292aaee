"""Runs measured on another machine and recorded here afterwards (``privbench results import-bench``): their
provenance, and the check that one measurement is not recorded twice."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select

from pbconfig.settings import get_settings
from storage.db import session_scope
from storage.models import Run


@dataclass(frozen=True)
class Measured:
    """Provenance of a run measured on another machine and recorded here afterwards (``privbench results
    import-bench``): its times, commit, host and device replace this process's."""

    started_at: datetime
    finished_at: datetime
    git_commit: str | None
    host: str
    device: str


def find_measured_run(*, flow: str, technique: str, measured: Measured) -> str | None:
    """The id of a finished run of ``flow``/``technique`` recorded from the same measurement (same host, same start
    time and commit), e.g. a benchmark result imported twice; None when there is none."""
    with session_scope(get_settings().db_url) as session:
        rows = session.execute(
            select(Run.id, Run.started_at, Run.git_commit).where(
                Run.flow == flow, Run.technique == technique, Run.host == measured.host, Run.status == "finished"
            )
        ).all()
    want = measured.started_at.astimezone(UTC)
    for run_id, started, commit in rows:
        started = started if started.tzinfo else started.replace(tzinfo=UTC)  # SQLite: naive, written in UTC
        if started == want and commit == measured.git_commit:
            return run_id
    return None


__all__ = ["Measured", "find_measured_run"]
