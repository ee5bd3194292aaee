"""Engines and sessions for the results store, migrated to the newest schema on first use.

SQLite (the default) runs in WAL mode with a busy timeout, so several processes (parallel Prefect
tasks, CrypTen or STIP parties, the dashboard) read and write the same file safely. PostgreSQL works
through any ``postgresql+psycopg://`` URL. Every process (and every thread) gets its own session from
``session_scope``; engines are cached per URL and per process.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import StoreError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_ADVISORY_LOCK_ID = 0x70726976  # "priv": serialises concurrent first-use migrations on PostgreSQL
_lock = threading.RLock()
_engines: dict[tuple[int, str], Engine] = {}


def normalize_url(url: str) -> str:
    """Let users write ``postgresql://`` and get the installed psycopg 3 driver."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def redact(url: str) -> str:
    """The URL with any password hidden, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


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


def dispose_engines() -> None:
    """Close every cached engine (tests, and before forking worker processes)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """One transaction: commit on success, roll back on any exception (including KeyboardInterrupt)."""
    factory = sessionmaker(get_engine(url), expire_on_commit=False)
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _create(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreError(
            f"PRIVBENCH_DB_URL={url!r} is not a database URL; use e.g. sqlite:///.privbench/results.db "
            "or postgresql+psycopg://user:pass@127.0.0.1:5432/privbench"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        return _create_sqlite(url, parsed.database)
    try:
        return create_engine(url, pool_pre_ping=True, connect_args=_connect_timeout(parsed.get_backend_name()))
    except (NoSuchModuleError, ImportError) as exc:
        raise StoreError(f"no driver for {redact(url)} ({exc}); install it or use a sqlite:/// URL") from None


def _connect_timeout(backend: str) -> dict[str, int]:
    return {"connect_timeout": 10} if backend == "postgresql" else {}


def _create_sqlite(url: str, database: str | None) -> Engine:
    if database and database != ":memory:":
        path = Path(database).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the folder of the results store {redact(url)}: {exc}") from None
    engine = create_engine(url, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    return engine


def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def _migrate(engine: Engine, url: str) -> None:
    """Upgrade to head under a cross-process lock (a file lock for SQLite, an advisory lock for PostgreSQL)."""
    cfg = _alembic_config()
    try:
        with _migration_lock(engine, url), engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except OperationalError as exc:
        raise StoreError(
            f"cannot reach the results store at {redact(url)}: {exc.orig}. Check that the server is up and "
            "PRIVBENCH_DB_URL is right, or unset PRIVBENCH_DB_URL to use the local SQLite file"
        ) from None


@contextmanager
def _migration_lock(engine: Engine, url: str) -> Iterator[None]:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        lock_path = Path(str(parsed.database) + ".migrate.lock")
        with open(lock_path, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
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
