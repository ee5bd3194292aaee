"""Liveness of ``running`` rows: which process holds each one, its heartbeat, and reaping the stale ones.

Every row is opened by a process, recorded with the row (``host``, ``pid``, ``pid_started``). While that process
holds rows open, a daemon thread refreshes their ``heartbeat_at`` every ``PRIVBENCH_HEARTBEAT_SECONDS`` (30 s).
A ``running`` row is *stale*, and reaped (marked ``failed`` with the reason, its MLflow run ``FAILED``), when

- it was opened on this host by a process that is gone (no such PID, or the PID now belongs to a process that
  started later: PID reuse), decided at once; or
- it was opened on another host, or by an unknown process (rows from before liveness was recorded), and its last
  sign of life (heartbeat, else start) is older than the stale window: ``older_than`` seconds, by default
  ``PRIVBENCH_STALE_AFTER_SECONDS`` (600 s, 20 heartbeats).

A row whose process is alive on this host is never reaped, however old its heartbeat: a slow run is not a dead
one (stop the process and the next reap marks it). Hosts are compared by name, so two containers that share a
hostname but not a PID namespace must not share a store without distinct hostnames.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update

from core.errors import ConfigError
from storage import provenance
from storage.db import session_scope
from storage.models import Run

log = logging.getLogger("privbench.liveness")

HEARTBEAT_ENV = "PRIVBENCH_HEARTBEAT_SECONDS"
STALE_ENV = "PRIVBENCH_STALE_AFTER_SECONDS"
DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_STALE_AFTER_S = 600.0
_PID_START_SLACK_S = 2.0  # process start times are read at clock-tick resolution


@dataclass(frozen=True)
class Stale:
    """A ``running`` row found stale, and why."""

    run_id: str
    mlflow_run_id: str | None
    flow: str
    stage: str
    profile: str | None
    prefect_flow_run_id: str | None
    reason: str


def _seconds_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds; set e.g. {name}={default:g}") from None
    if not value > 0:
        raise ConfigError(f"{name}={raw!r} must be > 0 seconds; set e.g. {name}={default:g}")
    return value


def heartbeat_seconds() -> float:
    return _seconds_from_env(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S)


def stale_after_seconds() -> float:
    return _seconds_from_env(STALE_ENV, DEFAULT_STALE_AFTER_S)


def process_started(pid: int) -> float | None:
    """The start time (epoch seconds) of process ``pid`` on this host, or None when there is no such process."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # it exists, we may not look: alive, start unknown
        return float("nan")


def this_process() -> tuple[int, float | None]:
    pid = os.getpid()
    return pid, process_started(pid)


def process_gone(pid: int, started: float | None) -> bool:
    """True when ``pid`` (which started at ``started``) no longer runs on this host."""
    now_started = process_started(pid)
    if now_started is None:
        return True
    if started is None or math.isnan(now_started):  # unknown start: trust the PID
        return False
    return now_started > started + _PID_START_SLACK_S  # the PID was reused by a newer process


def find_stale(db_url: str, *, older_than: float | None = None, now: datetime | None = None) -> list[Stale]:
    """The ``running`` rows of the store that are stale under the rules of this module's docstring."""
    window = stale_after_seconds() if older_than is None else float(older_than)
    if window < 0:
        raise ConfigError(f"--older-than must be >= 0 seconds, got {older_than}")
    now = now or datetime.now(UTC)
    here = provenance.host()
    with session_scope(db_url) as session:
        rows = session.execute(
            select(
                Run.id,
                Run.mlflow_run_id,
                Run.flow,
                Run.stage,
                Run.profile,
                Run.prefect_flow_run_id,
                Run.host,
                Run.pid,
                Run.pid_started,
                Run.heartbeat_at,
                Run.started_at,
            ).where(Run.status == "running")
        ).all()
    stale = []
    for r in rows:
        reason = _stale_reason(r, here=here, window=window, now=now)
        if reason:
            stale.append(Stale(r.id, r.mlflow_run_id, r.flow, r.stage, r.profile, r.prefect_flow_run_id, reason))
    return stale


def _stale_reason(r: Any, *, here: str, window: float, now: datetime) -> str | None:  # r: a result Row
    if r.host == here and r.pid is not None:
        if process_gone(r.pid, r.pid_started):
            return f"stale: its process {r.pid} on {here} is gone"
        return None
    last = _aware(r.heartbeat_at or r.started_at)
    age = (now - last).total_seconds() if last is not None else float("inf")
    if age <= window:
        return None
    who = f"process {r.pid} on {r.host}" if r.pid is not None else f"host {r.host or 'unknown'}"
    return f"stale: no heartbeat from {who} for {age:.0f} s (stale after {window:g} s)"


def _aware(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


class Heartbeat:
    """A daemon thread that refreshes ``heartbeat_at`` of the rows this process holds open.

    ``open_runs`` returns ``{run_id: db_url}``; ``forget`` is told the ids that are no longer ``running`` (finished
    or failed elsewhere), so that a process does not keep beating for rows it no longer holds."""

    def __init__(self, open_runs: Callable[[], dict[str, str]], forget: Callable[[Iterable[str]], None]) -> None:
        self._open_runs = open_runs
        self._forget = forget
        self._pid: int | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()

    def ensure_started(self) -> None:
        """Start the thread in this process (again after a fork: threads do not survive one)."""
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._wake = threading.Event()
            threading.Thread(target=self._loop, args=(self._wake,), name="privbench-heartbeat", daemon=True).start()

    def beat(self) -> None:
        """Refresh every open row now (also called by the thread)."""
        by_url: dict[str, list[str]] = {}
        for run_id, url in self._open_runs().items():
            by_url.setdefault(url, []).append(run_id)
        now = datetime.now(UTC)
        for url, ids in by_url.items():
            with session_scope(url) as session:
                session.execute(update(Run).where(Run.id.in_(ids), Run.status == "running").values(heartbeat_at=now))
                done = session.scalars(select(Run.id).where(Run.id.in_(ids), Run.status != "running")).all()
            if done:
                self._forget(done)

    def _loop(self, wake: threading.Event) -> None:
        period = heartbeat_seconds()
        while not wake.wait(period):
            if self._pid != os.getpid():
                return
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 -- a missed beat is retried; the run itself must not fail for it
                log.debug("missed a heartbeat: %s: %s", type(exc).__name__, exc)
