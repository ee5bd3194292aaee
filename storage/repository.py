"""Reading the results store: run listings, one run with everything it recorded, read-only SQL, export."""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Engine, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from core.errors import StoreError
from pbconfig.settings import get_settings
from storage.db import get_engine, open_sqlite_read_only, session_scope
from storage.models import AttackResult, Base, Dataset, Metric, MpcCost, PrivacyLedger, Run

RUN_LIST_FIELDS = (
    "id",
    "parent_id",
    "flow",
    "stage",
    "technique",
    "dataset",
    "profile",
    "status",
    "error",
    "mlflow_run_id",
    "prefect_flow_run_id",
    "started_at",
    "finished_at",
    "duration_s",
    "git_commit",
)
EXPORT_TABLES = ("runs", "metrics", "mpc_costs", "privacy_ledger", "attack_results", "datasets")


class ResultsRepository:
    """Queries over the results store at ``db_url`` (default: the configured ``PRIVBENCH_DB_URL``)."""

    def __init__(self, db_url: str | None = None) -> None:
        self.db_url = db_url or get_settings().db_url

    @property
    def engine(self) -> Engine:
        return get_engine(self.db_url)

    def list_runs(
        self,
        *,
        stage: str | None = None,
        flow: str | None = None,
        status: str | None = None,
        technique: str | None = None,
        limit: int | None = 50,
    ) -> list[dict[str, Any]]:
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
                for c in (
                    _run_dict(r)
                    for r in session.scalars(select(Run).where(Run.parent_id == run.id).order_by(Run.started_at))
                )
            ]
            return out

    def find_dataset(self, name: str, cache_key: str) -> dict[str, Any] | None:
        with session_scope(self.db_url) as session:
            row = session.scalars(
                select(Dataset)
                .where(Dataset.name == name, Dataset.cache_key == cache_key)
                .order_by(Dataset.created_at.desc())
            ).first()
            if row is None:
                return None
            return _columns(row, exclude={"stats_json"}) | {"stats": json.loads(row.stats_json)}

    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run ONE read-only statement (SELECT, WITH ... SELECT, VALUES, EXPLAIN); returns (columns, rows).

        ``read_only_statement`` refuses anything else before the database sees it; the database refuses writes
        again: SQLite through a separate read-only connection with an authorizer, PostgreSQL through a
        dedicated connection whose transactions are read-only and the extended protocol (one statement).
        """
        engine = self.engine
        statement = read_only_statement(sql, engine.dialect.name)
        driver_error = engine.dialect.loaded_dbapi.Error
        try:
            if engine.dialect.name == "sqlite":
                columns, rows = _query_sqlite(engine, self.db_url, statement, params or {})
            elif engine.dialect.name == "postgresql":
                columns, rows = _query_postgres(engine, statement, params or {})
            else:
                columns, rows = _query_generic(engine, statement, params or {})
        except (driver_error, SQLAlchemyError) as exc:
            raise StoreError(f"query failed: {getattr(exc, 'orig', None) or exc}\n  SQL: {sql}") from None
        if columns is None:
            raise StoreError(f"query returned no rows (only SELECT-like statements are allowed): {sql!r}")
        return columns, rows

    def export(
        self, out_dir: Path, fmt: Literal["csv", "parquet"], tables: tuple[str, ...] = EXPORT_TABLES
    ) -> list[Path]:
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
        raise StoreError(
            f"run id prefix {run_id!r} is ambiguous ({', '.join(m.id for m in matches)}, ...); give more characters"
        )


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


# ------------------------------------------------------------------------------------ read-only SQL

QUERY_TIMEOUT_S = 300  # PostgreSQL's statement_timeout for `privbench results query`
_QUERY_RULE = "only one read-only statement (SELECT, WITH ... SELECT, VALUES or EXPLAIN) is allowed"
_READ_STARTS = frozenset({"select", "with", "values", "table", "explain"})  # TABLE t: SELECT * FROM t (PG)
# words that make a SELECT write or run something else: data-modifying CTEs, SELECT INTO, EXPLAIN ANALYZE
_WRITE_WORDS = frozenset({"insert", "update", "delete", "merge", "into", "analyze", "analyse"})
_ROW_LOCKS = frozenset({"update", "share", "key", "no"})  # FOR UPDATE / SHARE / KEY SHARE / NO KEY UPDATE
_EXPLAIN_OPTIONS = frozenset(
    {
        "query",
        "plan",
        "verbose",
        "costs",
        "settings",
        "buffers",
        "wal",
        "timing",
        "summary",
        "format",
        "text",
        "xml",
        "json",
        "yaml",
        "generic_plan",
        "true",
        "false",
        "on",
        "off",
    }
)
# functions that act on the server, other sessions, files or settings rather than read the store
_REFUSED_FUNCTIONS = frozenset(
    {
        "set_config",
        "pg_terminate_backend",
        "pg_cancel_backend",
        "pg_reload_conf",
        "pg_rotate_logfile",
        "pg_promote",
        "pg_switch_wal",
        "pg_create_restore_point",
        "pg_log_backend_memory_contexts",
        "pg_notify",
        "pg_read_file",
        "pg_read_binary_file",
        "pg_ls_dir",
        "pg_stat_file",
        "pg_file_write",
        "load_extension",
    }
)
_REFUSED_FUNCTION_PREFIXES = ("dblink", "lo_", "pg_advisory", "pg_try_advisory")
_SQLITE_SCHEMA_PRAGMAS = frozenset(
    {  # the table-valued pragma_*() functions that only describe the schema
        "table_info",
        "table_xinfo",
        "table_list",
        "index_list",
        "index_info",
        "index_xinfo",
        "foreign_key_list",
        "database_list",
        "collation_list",
        "function_list",
        "module_list",
        "pragma_list",
        "compile_options",
    }
)
_SQLITE_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})
_PG_WORD = re.compile(r"[^\W\d][\w$]*")
_SQLITE_WORD = re.compile(r"[^\W\d]\w*")
_NUMBER = re.compile(r"\d[\w.]*")
_DOLLAR_TAG = re.compile(r"\$(?:[^\W\d]\w*)?\$")


@dataclass(frozen=True)
class _Token:
    kind: Literal["word", "name", "string", "symbol", "end"]  # end: a statement-ending semicolon
    text: str  # words lower-cased; names (quoted identifiers) without their quotes
    start: int
    stop: int


def read_only_statement(sql: str, dialect: str) -> str:
    """The one read statement in ``sql`` (without its trailing semicolons), as it will be sent.

    Lexes ``sql`` the way ``dialect`` ("sqlite" or "postgresql") does -- quoted strings and identifiers,
    ``--`` and ``/* */`` comments (nested on PostgreSQL), PostgreSQL's dollar quotes and E'' escapes, SQLite's
    [] and `` quoting -- and raises ``StoreError`` naming the statements unless there is exactly one and it
    only reads: no data-modifying CTE, SELECT INTO, FOR UPDATE/SHARE, EXPLAIN ANALYZE, nor a function that
    acts on the server (``set_config``, ``pg_terminate_backend``, ``load_extension``, ...)."""
    tokens = _lex(sql, postgres=dialect == "postgresql")
    statements: list[list[_Token]] = [[]]
    for token in tokens:
        if token.kind == "end":
            statements.append([])
        else:
            statements[-1].append(token)
    found = [s for s in statements if s]
    if not found:
        raise _refused(sql, "got no statement")
    if len(found) > 1 or not statements[0]:
        shown = ", ".join(repr(sql[s[0].start : s[-1].stop]) for s in found)
        raise _refused(
            sql, f"got {len(found)} statements: {shown}" if len(found) > 1 else "got an empty statement before it"
        )
    _check_reads_only(sql, statements[0])
    ends = [t.start for t in tokens if t.kind == "end"]
    return sql[: ends[0]] if ends else sql


def _check_reads_only(sql: str, body: list[_Token]) -> None:
    words = [t for t in body if not _is_open(t)]
    if not words:
        raise _refused(sql, "got no statement")
    first = words[0]
    if first.kind != "word" or first.text not in _READ_STARTS:
        raise _refused(sql, f"got a {sql[first.start : first.stop].upper()} statement")
    if first.text == "explain":
        _check_explained(sql, body[body.index(first) + 1 :])
    for i, token in enumerate(body):
        after = body[i + 1] if i + 1 < len(body) else None
        after_kind = after.kind if after else None
        if token.kind == "word" and token.text in _WRITE_WORDS:
            raise _refused(
                sql, f"{token.text.upper()} is not allowed in a query (it writes, or runs the statement it explains)"
            )
        if token.text == "for" and token.kind == after_kind == "word" and after.text in _ROW_LOCKS:
            raise _refused(sql, "SELECT ... FOR UPDATE/SHARE takes row locks")
        if token.kind in ("word", "name") and _is_open(after) and _refused_function(token.text):
            raise _refused(sql, f"the function {token.text}() acts on the server, not on the results")


def _check_explained(sql: str, rest: list[_Token]) -> None:
    """EXPLAIN [QUERY PLAN | (options) | VERBOSE ...] followed by a read."""
    i = 0
    if rest and _is_open(rest[0]) and len(rest) > 1 and rest[1].text not in _READ_STARTS:
        while i < len(rest) and rest[i].text != ")":
            i += 1
        i += 1
    while i < len(rest) and rest[i].kind == "word" and rest[i].text in _EXPLAIN_OPTIONS:
        i += 1
    target = rest[i] if i < len(rest) else None
    if target is None or not (_is_open(target) or (target.kind == "word" and target.text in _READ_STARTS)):
        raise _refused(sql, "EXPLAIN must be followed by a SELECT, WITH or VALUES statement")


def _is_open(token: _Token | None) -> bool:
    return token is not None and token.kind == "symbol" and token.text == "("


def _refused_function(name: str) -> bool:
    name = name.lower()
    return name in _REFUSED_FUNCTIONS or name.startswith(_REFUSED_FUNCTION_PREFIXES)


def _refused(sql: str, why: str) -> StoreError:
    return StoreError(
        f"query failed: {_QUERY_RULE}; {why}\n  SQL: {sql.strip()}\n  fix: send a single "
        "read-only statement (the results store is written only by privbench's flows)"
    )


def _lex(sql: str, *, postgres: bool) -> list[_Token]:
    tokens: list[_Token] = []
    word = _PG_WORD if postgres else _SQLITE_WORD
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace():
            i += 1
        elif sql.startswith("--", i):
            stop = sql.find("\n", i)
            i = n if stop < 0 else stop + 1
        elif sql.startswith("/*", i):
            i = _comment_end(sql, i, nested=postgres)
        elif c == "'":
            stop = _quote_end(sql, i, "'", backslash=False)
            tokens.append(_Token("string", sql[i + 1 : stop - 1], i, stop))
            i = stop
        elif c == '"' or (not postgres and c in "`["):
            stop = _quote_end(sql, i, "]" if c == "[" else c, backslash=False)
            tokens.append(_Token("name", sql[i + 1 : stop - 1], i, stop))
            i = stop
        elif postgres and (tag := _DOLLAR_TAG.match(sql, i)):
            close = sql.find(tag.group(), tag.end())
            if close < 0:
                raise _refused(sql, f"unterminated dollar-quoted string {tag.group()} at character {i + 1}")
            stop = close + len(tag.group())
            tokens.append(_Token("string", sql[tag.end() : close], i, stop))
            i = stop
        elif (m := word.match(sql, i)) or (m := _NUMBER.match(sql, i)):
            if postgres and m.group().lower() == "e" and sql.startswith("'", m.end()):  # E'...' escapes
                stop = _quote_end(sql, m.end(), "'", backslash=True)
                tokens.append(_Token("string", sql[m.end() + 1 : stop - 1], i, stop))
                i = stop
            else:
                tokens.append(_Token("word", m.group().lower(), i, m.end()))
                i = m.end()
        else:
            tokens.append(_Token("end" if c == ";" else "symbol", c, i, i + 1))
            i += 1
    return tokens


def _quote_end(sql: str, start: int, quote: str, *, backslash: bool) -> int:
    """The index just past the quote closing the one at ``start`` (a doubled quote is part of the text)."""
    i = start + 1
    while i < len(sql):
        doubled = sql[i] == quote and quote != "]" and sql.startswith(quote, i + 1)
        if doubled or (backslash and sql[i] == "\\"):
            i += 2
        elif sql[i] == quote:
            return i + 1
        else:
            i += 1
    raise _refused(sql, f"unterminated {sql[start]}...{quote} starting at character {start + 1}")


def _comment_end(sql: str, start: int, *, nested: bool) -> int:
    depth, i = 0, start
    while i < len(sql):
        if sql.startswith("/*", i):
            depth = depth + 1 if nested or depth == 0 else depth
            i += 2
        elif sql.startswith("*/", i):
            depth -= 1
            i += 2
            if depth == 0:
                return i
        else:
            i += 1
    raise _refused(sql, f"unterminated /* comment starting at character {start + 1}")


def _query_sqlite(
    engine: Engine, db_url: str, statement: str, params: dict[str, Any]
) -> tuple[list[str] | None, list[tuple[Any, ...]]]:
    """On a separate read-only connection (query_only, an authorizer that allows reads only); sqlite3's
    ``execute`` itself refuses a second statement."""
    conn = open_sqlite_read_only(db_url)
    raw = engine.raw_connection() if conn is None else None  # an in-memory store: its own connection
    if raw is not None:
        conn = raw.driver_connection
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_sqlite_authorizer)
        try:
            cursor = conn.execute(statement, params)
            columns = None if cursor.description is None else [d[0] for d in cursor.description]
            return columns, [tuple(r) for r in cursor.fetchall()] if columns is not None else []
        finally:
            conn.set_authorizer(None)
    finally:
        if raw is None:
            conn.close()
        else:
            conn.rollback()
            conn.execute("PRAGMA query_only = OFF")
            raw.close()


def _sqlite_authorizer(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
    """Reads only: no ATTACH/DETACH (nor VACUUM INTO, which attaches), writes, DDL, transactions or pragmas
    beyond the schema-describing ones, and no load_extension()."""
    if action in _SQLITE_READ_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_DENY if _refused_function(arg2 or "") else sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA:
        return sqlite3.SQLITE_OK if (arg1 or "").lower() in _SQLITE_SCHEMA_PRAGMAS else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_UPDATE and arg1 in ("sqlite_master", "sqlite_schema"):
        # how SQLite authorises loading a pragma_*() table-valued function; mode=ro and query_only refuse
        # any real write to the schema
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def _query_postgres(
    engine: Engine, statement: str, params: dict[str, Any]
) -> tuple[list[str] | None, list[tuple[Any, ...]]]:
    """On a dedicated connection, closed afterwards (nothing the statement changes in the session outlives
    it), whose transactions are read-only by default and begin READ ONLY, with a statement timeout; psycopg 3
    sends the statement prepared (extended protocol), so the server refuses a second one."""
    compiled = text(statement).compile(dialect=engine.dialect)  # :name -> the driver's placeholders
    values = compiled.construct_params(params)
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        conn.rollback()
        cursor = conn.cursor()
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        conn.commit()
        if engine.dialect.driver == "psycopg":
            conn.read_only = True  # BEGIN READ ONLY
        # the first query takes the transaction's snapshot: from here SET TRANSACTION READ WRITE is refused
        cursor.execute(f"SELECT set_config('statement_timeout', '{QUERY_TIMEOUT_S * 1000}', true)")
        if engine.dialect.driver == "psycopg":
            cursor.execute(str(compiled), values, prepare=True)
        else:
            cursor.execute(str(compiled), values)
        columns = None if cursor.description is None else [d[0] for d in cursor.description]
        rows = [tuple(r) for r in cursor.fetchall()] if columns is not None else []
        conn.rollback()
        return columns, rows
    finally:
        raw.invalidate()  # closed, never back to the pool, whatever state the statement left it in
        raw.close()


def _query_generic(
    engine: Engine, statement: str, params: dict[str, Any]
) -> tuple[list[str] | None, list[tuple[Any, ...]]]:
    """Other databases: the statement check above is the guard; nothing is committed."""
    with engine.connect() as conn:
        try:
            result = conn.execute(text(statement), params)
            if not result.returns_rows:
                return None, []
            return list(result.keys()), [tuple(r) for r in result]
        finally:
            conn.rollback()


__all__ = ["EXPORT_TABLES", "Metric", "MpcCost", "PrivacyLedger", "ResultsRepository", "read_only_statement"]
