"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:54:01.344722

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# the single-column indexes ``ix_<table>_<column>`` of each table, in the order they are made, and a composite
# index as (name, columns); the tables in the order they are made (the downgrade drops them in reverse)
INDEXES: dict[str, tuple[str | tuple[str, list[str]], ...]] = {
    "runs": (
        "config_hash",
        "dataset",
        "flow",
        "mlflow_run_id",
        "parent_id",
        "prefect_flow_run_id",
        "stage",
        "status",
        "technique",
    ),
    "attack_results": ("attack", "run_id"),
    "datasets": ("cache_key", "name"),
    "metrics": ("name", ("ix_metrics_run_name", ["run_id", "name"])),
    "mpc_costs": ("op_category", "run_id"),
    "privacy_ledger": ("run_id",),
}


def _run_rows_table(name: str, *columns: sa.Column) -> None:
    """A table of rows that belong to one run and go with it: an integer ``id``, the ``run_id``, then ``columns``."""
    op.create_table(
        name,
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        *columns,
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )


def _index_name(batch_op, table: str, index: str | tuple[str, list[str]]) -> str:
    return batch_op.f(f"ix_{table}_{index}") if isinstance(index, str) else index[0]


def _create_indexes(table: str) -> None:
    with op.batch_alter_table(table, schema=None) as batch_op:
        for index in INDEXES[table]:
            columns = [index] if isinstance(index, str) else index[1]
            batch_op.create_index(_index_name(batch_op, table, index), columns, unique=False)


def _drop_indexes_and_table(table: str) -> None:
    with op.batch_alter_table(table, schema=None) as batch_op:
        for index in reversed(INDEXES[table]):
            batch_op.drop_index(_index_name(batch_op, table, index))

    op.drop_table(table)


def upgrade() -> None:
    """Upgrade schema."""
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("parent_id", sa.String(length=32), nullable=True),
        sa.Column("flow", sa.String(length=64), nullable=False),
        sa.Column("stage", sa.String(length=32), nullable=False),
        sa.Column("technique", sa.String(length=64), nullable=False),
        sa.Column("dataset", sa.String(length=128), nullable=True),
        sa.Column("profile", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("prefect_flow_run_id", sa.String(length=64), nullable=True),
        sa.Column("prefect_task_run_id", sa.String(length=64), nullable=True),
        sa.Column("mlflow_run_id", sa.String(length=64), nullable=True),
        sa.Column("mlflow_experiment_id", sa.String(length=64), nullable=True),
        sa.Column("git_commit", sa.String(length=64), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("device", sa.String(length=255), nullable=True),
        sa.Column("privbench_version", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["parent_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
    )
    _create_indexes("runs")
    _run_rows_table(
        "attack_results",
        sa.Column("attack", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("setting", sa.String(length=128), nullable=True),
        sa.Column("auc", sa.Float(), nullable=True),
        sa.Column("tpr_at_0_1pct_fpr", sa.Float(), nullable=True),
        sa.Column("tpr_at_1pct_fpr", sa.Float(), nullable=True),
        sa.Column("empirical_epsilon", sa.Float(), nullable=True),
        sa.Column("empirical_epsilon_lo", sa.Float(), nullable=True),
        sa.Column("empirical_epsilon_hi", sa.Float(), nullable=True),
        sa.Column("accountant_epsilon", sa.Float(), nullable=True),
        sa.Column("rouge1", sa.Float(), nullable=True),
        sa.Column("rouge2", sa.Float(), nullable=True),
        sa.Column("rougeL", sa.Float(), nullable=True),
        sa.Column("recall", sa.Float(), nullable=True),
        sa.Column("recovered_fraction", sa.Float(), nullable=True),
        sa.Column("extra_json", sa.Text(), nullable=True),
    )
    _create_indexes("attack_results")
    op.create_table(
        "datasets",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("cache_key", sa.String(length=64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("n_users", sa.Integer(), nullable=False),
        sa.Column("n_items", sa.Integer(), nullable=False),
        sa.Column("n_interactions", sa.BigInteger(), nullable=False),
        sa.Column("stats_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name", "content_hash", name="uq_datasets_name_hash"),
    )
    _create_indexes("datasets")
    _run_rows_table(
        "metrics",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("unit", sa.String(length=32), nullable=True),
    )
    _create_indexes("metrics")
    _run_rows_table(
        "mpc_costs",
        sa.Column("op_category", sa.String(length=32), nullable=False),
        sa.Column("party", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(length=32), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("rounds", sa.BigInteger(), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=True),
    )
    _create_indexes("mpc_costs")
    _run_rows_table(
        "privacy_ledger",
        sa.Column("epsilon", sa.Float(), nullable=False),
        sa.Column("delta", sa.Float(), nullable=False),
        sa.Column("noise_multiplier", sa.Float(), nullable=False),
        sa.Column("sample_rate", sa.Float(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("accountant", sa.String(length=32), nullable=False),
        sa.Column("clip_norm", sa.Float(), nullable=True),
        sa.Column("target_epsilon", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(length=32), nullable=True),
    )
    _create_indexes("privacy_ledger")


def downgrade() -> None:
    """Downgrade schema."""
    for table in reversed(INDEXES):
        _drop_indexes_and_table(table)
