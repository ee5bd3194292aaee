"""Reading the results store: run listings, one run with everything it recorded, read-only SQL, export."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Engine, select, text
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.orm import Session

from core.errors import StoreError
from privbench.settings import get_settings
from storage.db import get_engine, session_scope
from storage.models import AttackResult, Base, Dataset, Metric, MpcCost, PrivacyLedger, Run

RUN_LIST_FIELDS = (
    "id", "parent_id", "flow", "stage", "technique", "dataset", "profile", "status", "error",
    "mlflow_run_id", "prefect_flow_run_id", "started_at", "finished_at", "duration_s", "git_commit",
)
EXPORT_TABLES = ("runs", "metrics", "mpc_costs", "privacy_ledger", "attack_results", "datasets")


class ResultsRepository:
    """Queries over the results store at ``db_url`` (default: the configured ``PRIVBENCH_DB_URL``)."""

    def __init__(self, db_url: str | None = None) -> None:
        self.db_url = db_url or get_settings().db_url

    @property
    def engine(self) -> Engine:
        return get_engine(self.db_url)

    def list_runs(self, *, stage: str | None = None, flow: str | None = None, status: str | None = None,
                  technique: str | None = None, limit: int | None = 50) -> list[dict[str, Any]]:
        """Newest first."""
        stmt = select(Run).order_by(Run.started_at.desc(), Run.id)
        for column, value in ((Run.stage, stage), (Run.flow, flow), (Run.status, status), (Run.technique, technique)):
            if value is not None:
                stmt = stmt.where(column == value)
        if limit is not None:
            stmt = stmt.limit(limit)
        with session_scope(self.db_url) as session:
            return [_run_dict(r) for r in session.scalars(stmt)]

    def get_run(self, run_id: str) -> dict[str, Any]:
        """One run (a unique id prefix is enough) with metrics, privacy ledger, MPC costs, attacks, children."""
        with session_scope(self.db_url) as session:
            run = self._resolve(session, run_id)
            out = _run_dict(run)
            out["config"] = json.loads(run.config_json)
            out["config_hash"] = run.config_hash
            out.update(host=run.host, device=run.device, privbench_version=run.privbench_version)
            out["metrics"] = [
                {"name": m.name, "value": m.value, "step": m.step, "unit": m.unit}
                for m in sorted(run.metrics, key=lambda m: (m.name, m.step if m.step is not None else -1, m.id))
            ]
            out["privacy_ledger"] = [_columns(p, exclude={"id", "run_id"}) for p in run.privacy]
            out["mpc_costs"] = [_columns(c, exclude={"id", "run_id"}) for c in run.mpc_costs]
            out["attack_results"] = [_attack_dict(a) for a in run.attacks]
            out["datasets"] = [
                _columns(d, exclude={"id", "run_id", "stats_json"}) | {"stats": json.loads(d.stats_json)}
                for d in session.scalars(select(Dataset).where(Dataset.run_id == run.id))
            ]
            out["children"] = [
                {k: c[k] for k in ("id", "technique", "dataset", "status")}
                for c in (_run_dict(r) for r in session.scalars(
                    select(Run).where(Run.parent_id == run.id).order_by(Run.started_at)))
            ]
            return out

    def find_dataset(self, name: str, cache_key: str) -> dict[str, Any] | None:
        with session_scope(self.db_url) as session:
            row = session.scalars(select(Dataset).where(Dataset.name == name, Dataset.cache_key == cache_key)
                                  .order_by(Dataset.created_at.desc())).first()
            if row is None:
                return None
            return _columns(row, exclude={"stats_json"}) | {"stats": json.loads(row.stats_json)}

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run one read-only SQL statement; writes are refused by the database itself."""
        engine = self.engine
        with engine.connect() as conn:
            try:
                if engine.dialect.name == "sqlite":
                    conn.exec_driver_sql("PRAGMA query_only = ON")
                elif engine.dialect.name == "postgresql":
                    conn.exec_driver_sql("SET TRANSACTION READ ONLY")
                result = conn.execute(text(sql), params or {})
                if not result.returns_rows:
                    raise StoreError(f"query returned no rows (only SELECT-like statements are allowed): {sql!r}")
                columns = list(result.keys())
                rows = [tuple(r) for r in result]
            except (DBAPIError, StatementError) as exc:
                raise StoreError(f"query failed: {exc.orig if hasattr(exc, 'orig') else exc}\n  SQL: {sql}") from None
            finally:
                if engine.dialect.name == "sqlite":
                    conn.exec_driver_sql("PRAGMA query_only = OFF")
                conn.rollback()
        return columns, rows

    def export(self, out_dir: Path, fmt: Literal["csv", "parquet"],
               tables: tuple[str, ...] = EXPORT_TABLES) -> list[Path]:
        """Write each table to ``out_dir/<table>.<fmt>``; returns the files written."""
        import pandas as pd

        unknown = set(tables) - set(EXPORT_TABLES)
        if unknown:
            raise StoreError(f"unknown tables {sorted(unknown)}; known: {', '.join(EXPORT_TABLES)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in tables:
            table = Base.metadata.tables[name]
            with self.engine.connect() as conn:
                frame = pd.read_sql(select(table), conn)
            path = out_dir / f"{name}.{fmt}"
            if fmt == "csv":
                frame.to_csv(path, index=False)
            else:
                frame.to_parquet(path, index=False)
            written.append(path)
        return written

    @staticmethod
    def _resolve(session: Session, run_id: str) -> Run:
        run = session.get(Run, run_id)
        if run is not None:
            return run
        matches = session.scalars(select(Run).where(Run.id.startswith(run_id, autoescape=True)).limit(3)).all()
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise StoreError(f"no run with id {run_id!r}; list runs with `privbench results list`")
        raise StoreError(f"run id prefix {run_id!r} is ambiguous ({', '.join(m.id for m in matches)}, ...); "
                         "give more characters")


def _run_dict(run: Run) -> dict[str, Any]:
    return {k: _jsonable(getattr(run, k)) for k in RUN_LIST_FIELDS}


def _attack_dict(row: AttackResult) -> dict[str, Any]:
    out = _columns(row, exclude={"id", "run_id", "extra_json"})
    # public names of the contract (dots are not allowed in column names)
    out["tpr_at_0.1pct_fpr"] = out.pop("tpr_at_0_1pct_fpr")
    lo, hi = out.pop("empirical_epsilon_lo"), out.pop("empirical_epsilon_hi")
    out["empirical_epsilon_ci"] = None if lo is None and hi is None else [lo, hi]
    out["extra"] = json.loads(row.extra_json) if row.extra_json else {}
    return out


def _columns(obj: Any, exclude: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    return {c.name: _jsonable(getattr(obj, c.name)) for c in obj.__table__.columns if c.name not in exclude}


def _jsonable(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


__all__ = ["EXPORT_TABLES", "Metric", "MpcCost", "PrivacyLedger", "ResultsRepository"]
