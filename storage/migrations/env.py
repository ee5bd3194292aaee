"""Alembic environment: migrations run programmatically on first use (``storage.db``), on the
connection handed in through ``config.attributes["connection"]``; ``alembic -c storage/migrations/alembic.ini``
works too for authoring new revisions (it reads ``PRIVBENCH_DB_URL``)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from storage.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs go through batch mode
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    from pbconfig.settings import get_settings
    from storage.db import normalize_url

    engine = create_engine(normalize_url(get_settings().db_url))
    with engine.connect() as conn:
        _run(conn)
