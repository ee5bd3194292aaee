"""privacy ledger: the neighbouring relation of the guarantee

``neighbouring`` says which datasets the (epsilon, delta) guarantee makes indistinguishable: ``add/remove``
(one protected unit more or less) or ``replace`` (one unit swapped for another); NULL on rows written before.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 09:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.add_column(sa.Column("neighbouring", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("privacy_ledger") as batch:
        batch.drop_column("neighbouring")
