"""The results store's schema (SQLAlchemy 2.0 typed ORM). Alembic migrations in ``storage/migrations``.

One ``runs`` row per recorded unit of work (a flow run, or one task inside it, linked by
``parent_id``); everything a run measured hangs off it and is written in the same transaction as the
run's ``finished`` status, so a failed run has its error and no partial results.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

RUN_STATUSES = ("running", "finished", "failed")


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    flow: Mapped[str] = mapped_column(String(64), index=True)
    stage: Mapped[str] = mapped_column(String(32), index=True)
    technique: Mapped[str] = mapped_column(String(64), index=True)
    dataset: Mapped[str | None] = mapped_column(String(128), index=True)
    profile: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), index=True)
    error: Mapped[str | None] = mapped_column(Text)
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(64), index=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    duration_s: Mapped[float | None] = mapped_column(Float)
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    prefect_task_run_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str | None] = mapped_column(String(255))
    device: Mapped[str | None] = mapped_column(String(255))
    privbench_version: Mapped[str | None] = mapped_column(String(32))
    # liveness of a ``running`` row: the process holding it (on ``host``) and its last heartbeat
    pid: Mapped[int | None] = mapped_column(Integer)
    pid_started: Mapped[float | None] = mapped_column(Float)  # the process's start time (epoch s): PID reuse
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    metrics: Mapped[list[Metric]] = relationship(back_populates="run", cascade="all, delete-orphan")
    mpc_costs: Mapped[list[MpcCost]] = relationship(back_populates="run", cascade="all, delete-orphan")
    privacy: Mapped[list[PrivacyLedger]] = relationship(back_populates="run", cascade="all, delete-orphan")
    attacks: Mapped[list[AttackResult]] = relationship(back_populates="run", cascade="all, delete-orphan")


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_run_name", "run_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128), index=True)
    value: Mapped[float] = mapped_column(Float)
    step: Mapped[int | None] = mapped_column(Integer)
    unit: Mapped[str | None] = mapped_column(String(32))

    run: Mapped[Run] = relationship(back_populates="metrics")


class MpcCost(Base):
    """Per-operation cost of a secure-inference run: one row per (op category, party[, phase])."""

    __tablename__ = "mpc_costs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    op_category: Mapped[str] = mapped_column(String(32), index=True)
    party: Mapped[int] = mapped_column(Integer)
    phase: Mapped[str | None] = mapped_column(String(32))
    seconds: Mapped[float] = mapped_column(Float)
    bytes: Mapped[int] = mapped_column(BigInteger)
    rounds: Mapped[int] = mapped_column(BigInteger)
    calls: Mapped[int | None] = mapped_column(Integer)

    run: Mapped[Run] = relationship(back_populates="mpc_costs")


class PrivacyLedger(Base):
    """What a DP run spent, as the accountant computed it."""

    __tablename__ = "privacy_ledger"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    noise_multiplier: Mapped[float] = mapped_column(Float)
    sample_rate: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    accountant: Mapped[str] = mapped_column(String(32))
    clip_norm: Mapped[float | None] = mapped_column(Float)
    target_epsilon: Mapped[float | None] = mapped_column(Float)
    unit: Mapped[str | None] = mapped_column(String(32))  # the protected unit: "user", "example", ...
    # the neighbouring relation the guarantee holds for: "add/remove" (one unit) or "replace" (one unit)
    neighbouring: Mapped[str | None] = mapped_column(String(32))

    run: Mapped[Run] = relationship(back_populates="privacy")


class AttackResult(Base):
    """One attack against one target (a model, a defence, a protocol) in one setting."""

    __tablename__ = "attack_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    attack: Mapped[str] = mapped_column(String(64), index=True)
    target: Mapped[str] = mapped_column(String(128))
    setting: Mapped[str | None] = mapped_column(String(128))
    auc: Mapped[float | None] = mapped_column(Float)
    tpr_at_0_1pct_fpr: Mapped[float | None] = mapped_column(Float)
    tpr_at_1pct_fpr: Mapped[float | None] = mapped_column(Float)
    empirical_epsilon: Mapped[float | None] = mapped_column(Float)
    empirical_epsilon_lo: Mapped[float | None] = mapped_column(Float)
    empirical_epsilon_hi: Mapped[float | None] = mapped_column(Float)
    accountant_epsilon: Mapped[float | None] = mapped_column(Float)
    rouge1: Mapped[float | None] = mapped_column(Float)
    rouge2: Mapped[float | None] = mapped_column(Float)
    rougeL: Mapped[float | None] = mapped_column(Float)
    recall: Mapped[float | None] = mapped_column(Float)
    recovered_fraction: Mapped[float | None] = mapped_column(Float)
    extra_json: Mapped[str | None] = mapped_column(Text)

    run: Mapped[Run] = relationship(back_populates="attacks")


class Dataset(Base):
    """A prepared dataset, content-addressed: the same name and content hash is prepared once."""

    __tablename__ = "datasets"
    __table_args__ = (UniqueConstraint("name", "content_hash", name="uq_datasets_name_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    cache_key: Mapped[str] = mapped_column(String(64), index=True)
    path: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16), default="seqrec", server_default="seqrec")
    n_examples: Mapped[int | None] = mapped_column(BigInteger)
    n_users: Mapped[int | None] = mapped_column(Integer)
    n_items: Mapped[int | None] = mapped_column(Integer)
    n_interactions: Mapped[int | None] = mapped_column(BigInteger)
    stats_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
