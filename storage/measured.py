"""Runs measured on another machine and recorded here afterwards (``privbench results import-bench``): their
provenance, and the check that one measurement is not recorded twice."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

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


def canonical_mapping(config: Mapping[str, Any]) -> tuple[dict[str, Any], str, str]:
    """A plain-mapping config as the store records it: its JSON tree (non-JSON values as text), the canonical JSON
    text (sorted keys) and that text's sha256 (the run's ``config_hash``)."""
    tree = json.loads(json.dumps(dict(config), default=str))
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"))
    return tree, text, hashlib.sha256(text.encode()).hexdigest()


def find_measured_run(
    *, flow: str, technique: str, measured: Measured, config: Mapping[str, Any] | None = None
) -> str | None:
    """The id of a finished run of ``flow``/``technique`` recorded from the same measurement (same host, start time
    and commit and, when ``config`` is given, the same configuration: runs started side by side in the same second,
    e.g. one per seed, are different measurements), e.g. a benchmark result imported twice; None when there is
    none."""
    want_hash = None if config is None else canonical_mapping(config)[2]
    with session_scope(get_settings().db_url) as session:
        rows = session.execute(
            select(Run.id, Run.started_at, Run.git_commit, Run.config_hash).where(
                Run.flow == flow, Run.technique == technique, Run.host == measured.host, Run.status == "finished"
            )
        ).all()
    want = measured.started_at.astimezone(UTC)
    for run_id, started, commit, cfg_hash in rows:
        started = started if started.tzinfo else started.replace(tzinfo=UTC)  # SQLite: naive, written in UTC
        if started == want and commit == measured.git_commit and want_hash in (None, cfg_hash):
            return run_id
    return None


__all__ = ["Measured", "canonical_mapping", "find_measured_run"]
