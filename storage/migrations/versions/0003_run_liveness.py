"""run liveness: the process that holds a ``running`` row, and its last heartbeat

``pid`` and ``pid_started`` name the process (on ``host``) that opened the run and keeps it alive;
``heartbeat_at`` is refreshed by that process while the run is open. A ``running`` row whose process is gone
from this host, or whose heartbeat is older than the stale window, is reaped (marked ``failed``) by the next
flow start or ``privbench results reap``.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 09:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("pid_started", sa.Float(), nullable=True))
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("heartbeat_at")
        batch.drop_column("pid_started")
        batch.drop_column("pid")
