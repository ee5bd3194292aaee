"""datasets of every kind: image datasets and pretrained models next to sequential-recommendation data

``kind`` says what a row holds (``seqrec``, ``images``, ``model``); ``n_examples`` counts its examples
(users for seqrec, images for image datasets); the user/item/interaction counts only mean something for
seqrec rows, so they become nullable.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:10:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=False, server_default="seqrec"))
        batch.add_column(sa.Column("n_examples", sa.BigInteger(), nullable=True))
        batch.alter_column("n_users", existing_type=sa.Integer(), nullable=True)
        batch.alter_column("n_items", existing_type=sa.Integer(), nullable=True)
        batch.alter_column("n_interactions", existing_type=sa.BigInteger(), nullable=True)
    op.execute("UPDATE datasets SET n_examples = n_users WHERE kind = 'seqrec'")


def downgrade() -> None:
    op.execute("DELETE FROM datasets WHERE kind <> 'seqrec'")
    with op.batch_alter_table("datasets") as batch:
        batch.alter_column("n_interactions", existing_type=sa.BigInteger(), nullable=False)
        batch.alter_column("n_items", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("n_users", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("n_examples")
        batch.drop_column("kind")
