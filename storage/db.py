"""Engines and sessions for the results store, migrated to the newest schema on first use.

SQLite (the default) runs in WAL mode with a busy timeout, so several processes (parallel Prefect
tasks, CrypTen or STIP parties, the dashboard) read and write the same file safely. PostgreSQL works
through any ``postgresql+psycopg://`` URL. Every process (and every thread) gets its own session from
``session_scope``; engines are cached per URL and per process.

Reading needs no write access: a store already at the newest schema is neither locked nor migrated, and a
SQLite store whose file or folder is not writable (a mounted copy of someone's ``PRIVBENCH_HOME``) is opened
read-only; writing to it raises a ``StoreError`` that names the path and the fix.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import StoreError
from core.redact import redact_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_ADVISORY_LOCK_ID = 0x70726976  # "priv": serialises concurrent first-use migrations on PostgreSQL
_lock = threading.RLock()
_engines: dict[tuple[int, str], Engine] = {}
_read_only: dict[tuple[int, str], str] = {}  # engines opened read-only -> why (for messages)


def normalize_url(url: str) -> str:
    """Let users write ``postgresql://`` and get the installed psycopg 3 driver."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact(url: str) -> str:
    """The URL with any password hidden, for messages and logs (also in ``?password=`` and unparseable URLs)."""
    return redact_url(url)


def get_engine(url: str) -> Engine:
    """The migrated engine for ``url`` (one per process). Raises ``StoreError`` naming the URL if unusable."""
    url = normalize_url(url)
    key = (os.getpid(), url)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _create(url)
            _migrate(engine, url)
            _engines[key] = engine
        return engine


def open_sqlite_read_only(url: str) -> sqlite3.Connection | None:
    """A new read-only (``mode=ro``), autocommit connection to the SQLite file of ``url``; None for an
    in-memory store or a ``file:`` URI."""
    path = _sqlite_file(make_url(normalize_url(url)))
    return None if path is None else _connect_read_only(path, autocommit=True)


def dispose_engines() -> None:
    """Close every cached engine (tests, and before forking worker processes)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _read_only.clear()


def dispose_engine(url: str) -> None:
    """Close this process's engine of ``url`` (a temporary store about to be deleted); others stay open."""
    url = normalize_url(url)
    with _lock:
        engine = _engines.pop((os.getpid(), url), None)
        _read_only.pop((os.getpid(), url), None)
    if engine is not None:
        engine.dispose()


def schema_revisions(url: str) -> tuple[list[str], list[str]]:
    """(the store's alembic revisions, every revision this code knows, oldest first); the store migrated first."""
    engine = get_engine(url)
    script = ScriptDirectory.from_config(_alembic_config())
    known = [r.revision for r in reversed(list(script.walk_revisions()))]
    with engine.connect() as conn:
        return sorted(MigrationContext.configure(conn).get_current_heads()), known


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any exception (including KeyboardInterrupt)."""
    factory = sessionmaker(get_engine(url), expire_on_commit=False)
    session = factory()
    try:
        yield session
        session.commit()
    except DBAPIError as exc:
        session.rollback()
        if _is_read_only_error(exc):
            raise _read_only_error(url) from None
        raise
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _is_read_only_error(exc: DBAPIError) -> bool:
    message = str(exc.orig).lower()
    return "readonly database" in message or "read-only transaction" in message


def _read_only_error(url: str) -> StoreError:
    url = normalize_url(url)
    path = _sqlite_file(make_url(url))
    where = f"the results store {path}" if path else f"the results store at {redact(url)}"
    why = _read_only.get((os.getpid(), url), "the database refused the write")
    return StoreError(
        f"{where} is read-only ({why}); to record runs, copy it somewhere writable and set "
        "PRIVBENCH_HOME (or PRIVBENCH_DB_URL) to the copy, or make it writable"
    )


def _create(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(
            f"PRIVBENCH_DB_URL={redact(url)!r} is not a database URL; use e.g. sqlite:///.privbench/results.db "
            "or postgresql+psycopg://USER@127.0.0.1:5432/privbench (with the password in PGPASSWORD or ~/.pgpass)"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        return _create_sqlite(url)
    try:
        return create_engine(url, pool_pre_ping=True, connect_args=_connect_timeout(parsed.get_backend_name()))
    except (NoSuchModuleError, ImportError) as exc:
        raise StoreError(f"no driver for {redact(url)} ({exc}); install it or use a sqlite:/// URL") from None


def _connect_timeout(backend: str) -> dict[str, int]:
    return {"connect_timeout": 10} if backend == "postgresql" else {}


def _create_sqlite(url: str) -> Engine:
    path = _sqlite_file(make_url(url))
    read_only = None if path is None else _sqlite_read_only_reason(path)
    if path is not None and read_only is None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the folder of the results store {redact(url)}: {exc}") from None
    if path is not None and read_only is not None:
        if not path.exists():
            raise StoreError(
                f"the results store {path} does not exist and cannot be created ({read_only}); "
                "set PRIVBENCH_HOME to a writable folder"
            )
        engine = create_engine(url, creator=lambda: _connect_read_only(path, autocommit=False))
        _read_only[(os.getpid(), url)] = read_only
    else:
        engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:
        cursor = dbapi_conn.cursor()
        if read_only is None:  # a read-only connection cannot switch the journal mode (the file keeps WAL)
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    return engine


def _sqlite_file(parsed: URL) -> Path | None:
    """The file of a ``sqlite:///path`` URL; None for in-memory stores and ``file:`` URIs."""
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or database in (None, "", ":memory:") or parsed.query.get("uri"):
        return None
    return Path(database).expanduser().absolute()


def _sqlite_read_only_reason(path: Path) -> str | None:
    """Why SQLite cannot write the store at ``path`` (it also creates -wal/-shm files next to it), or None."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    problems = [f"file {path}"] if path.exists() and not os.access(path, os.W_OK) else []
    if not os.access(folder, os.W_OK | os.X_OK):
        problems.append(f"directory {folder}")
    if not problems:
        return None
    return " and ".join(problems) + (" are" if len(problems) > 1 else " is") + " not writable"


def _connect_read_only(path: Path, *, autocommit: bool) -> sqlite3.Connection:
    """``mode=ro``, plus ``immutable=1`` where the folder is not writable and no WAL is pending: SQLite
    cannot create the -shm file a WAL database needs there, and without a -wal file the main file holds
    every commit."""
    uri = f"{path.as_uri()}?mode=ro"
    wal, shm = path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")
    if not os.access(path.parent, os.W_OK) and not shm.exists() and (not wal.exists() or wal.stat().st_size == 0):
        uri += "&immutable=1"
    return sqlite3.connect(
        uri, uri=True, timeout=60, check_same_thread=False, **({"isolation_level": None} if autocommit else {})
    )


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


_LOCKED_RETRIES = 8  # SQLite "database is locked" at open: waits of 0.25, 0.5, 1, 2, 2, 2, 2 s between tries


def _migrate(engine: Engine, url: str) -> None:
    """:func:`_migrate_once`, tried again when SQLite reports ``database is locked`` although its busy timeout is
    set: SQLite returns SQLITE_BUSY at once, without waiting, where waiting cannot help the statement that asked
    (a read snapshot that must become a write after another process committed, a journal-mode change while
    another connection holds the file), as when several processes open a new store at the same moment."""
    for attempt in range(_LOCKED_RETRIES):
        try:
            return _migrate_once(engine, url)
        except _Locked:
            engine.dispose()  # drop connections whose snapshot is stale
            time.sleep(min(0.25 * 2**attempt, 2.0))
    _migrate_once(engine, url, last=True)


class _Locked(Exception):
    """SQLite said ``database is locked`` while opening the store (retried by :func:`_migrate`)."""


def _migrate_once(engine: Engine, url: str, *, last: bool = False) -> None:
    """Upgrade to head, if behind, under a cross-process lock (a file lock for SQLite, an advisory lock for
    PostgreSQL); a store at head is neither locked nor written."""
    cfg = _alembic_config()
    read_only = _read_only.get((os.getpid(), url))
    try:
        current, heads = _revisions(engine, cfg)
        if current == heads:  # the usual case: nothing to lock, nothing to write
            return
        if read_only is not None:
            raise StoreError(
                f"the results store {_sqlite_file(make_url(url))} is read-only ({read_only}) and needs "
                f"migrating to this privbench's schema (revision {', '.join(sorted(current)) or 'none'} -> "
                f"{', '.join(sorted(heads))}); open it once with write access, or copy it somewhere writable "
                "and set PRIVBENCH_HOME to the copy"
            )
        with _migration_lock(engine, url), engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except OperationalError as exc:
        if not last and engine.dialect.name == "sqlite" and "database is locked" in str(exc.orig):
            raise _Locked(str(exc.orig)) from None
        if read_only is not None:
            raise StoreError(
                f"cannot open the read-only results store {_sqlite_file(make_url(url))} ({read_only}): "
                f"{exc.orig}; copy it (with any -wal file next to it) somewhere writable and set "
                "PRIVBENCH_HOME to the copy"
            ) from None
        raise StoreError(
            f"cannot reach the results store at {redact(url)}: {exc.orig}. Check that the server is up and "
            "PRIVBENCH_DB_URL is right, or unset PRIVBENCH_DB_URL to use the local SQLite file"
        ) from None


def _revisions(engine: Engine, cfg: Config) -> tuple[set[str], set[str]]:
    """(the store's alembic revisions, the newest ones of this code); a cheap read, no lock."""
    heads = set(ScriptDirectory.from_config(cfg).get_heads())
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads()), heads


@contextmanager
def held(handle: IO[str]) -> Iterator[None]:
    """An exclusive ``flock`` on the open lock file ``handle`` for the block; the file is closed after."""
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _migration_lock(engine: Engine, url: str) -> Iterator[None]:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        lock_path = Path(str(parsed.database) + ".migrate.lock")
        try:
            handle = open(lock_path, "a")  # noqa: SIM115 -- closed by the with below
        except OSError as exc:
            raise StoreError(
                f"cannot create {lock_path} to migrate the results store ({exc.strerror}); make "
                "its folder writable, or set PRIVBENCH_HOME to a writable folder"
            ) from None
        with held(handle):
            yield
    elif parsed.get_backend_name() == "postgresql":
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _ADVISORY_LOCK_ID})
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _ADVISORY_LOCK_ID})
                conn.commit()
    else:
        yield
