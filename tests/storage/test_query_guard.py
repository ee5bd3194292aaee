"""``privbench results query``: exactly one read-only statement, checked before it is sent and again by the
database.

Every refused string runs against a store holding one full run, on SQLite and PostgreSQL; the store's tables,
their row counts and a hash of all their rows must be the same afterwards, and no file may appear where an
``ATTACH`` or ``VACUUM INTO`` pointed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from core.errors import StoreError
from storage import repository
from storage.db import get_engine
from storage.recording import record_run
from storage.repository import ResultsRepository, read_only_statement

TARGET = "{target}"  # replaced by a path under the test's tmp_path

REFUSED = [
    # the reported ones
    "commit; delete from metrics returning id",
    "rollback; delete from metrics",
    "end; drop table metrics",
    "select 1; commit; delete from metrics",
    # several statements, however hidden
    "select 1; delete from metrics",
    "select 1;delete from metrics;",
    "select 1 /* ; */ ; delete from metrics",
    "/* harmless */ commit; /* */ delete from metrics",
    "select 1 -- ;\n; delete from metrics",
    "select 'a\\'; delete from metrics; --'",
    'select 1 as "x;"; delete from metrics',
    "select $$;$$; delete from metrics",
    "select 1; select 2",
    "begin; delete from metrics; commit",
    "start transaction read write; delete from metrics",
    "pragma query_only = off; delete from metrics",
    "; select 1",
    # one statement that writes or changes the session
    "delete from metrics",
    "DELETE FROM metrics",
    "update runs set status = 'x'",
    "insert into runs select * from runs",
    "drop table metrics",
    "create temp table t as select 1 as x",
    "create table t (x int)",
    "with d as (delete from metrics returning *) select * from d",
    "with d as (update runs set status = 'x' returning id) select count(*) from d",
    "select * into stolen from metrics",
    "select * from metrics for update",
    "select * from metrics for share",
    "select * from metrics for key share",
    "explain analyze delete from metrics",
    "explain analyze select 1",
    "explain delete from metrics",
    "copy metrics to stdout",
    "copy (select 1) to stdout",
    "set transaction read write",
    "set session characteristics as transaction read write",
    "pragma query_only = off",
    "pragma journal_mode = delete",
    "vacuum",
    "analyze",
    "reindex",
    "commit",
    "select set_config('transaction_read_only', 'off', false)",
    "select pg_terminate_backend(pg_backend_pid())",
    "select load_extension('x')",
    "",
    "  ;  ",
    "-- only a comment",
    # files: nothing may be created at the target
    f"attach '{TARGET}' as x",
    f"ATTACH DATABASE '{TARGET}' AS x",
    f"select 1; attach '{TARGET}' as x",
    f"vacuum into '{TARGET}'",
    "detach main",
]

ALLOWED = [
    ("select count(*) from runs", [(1,)]),
    ("SELECT COUNT(*) FROM runs;", [(1,)]),
    ("select count(*) from runs;  \n", [(1,)]),
    ("select count(*) from runs; -- done\n", [(1,)]),
    ("select ';' as x", [(";",)]),
    ("select 'a;b' as x; ", [("a;b",)]),
    ("select 'it''s' as x", [("it's",)]),
    ("select 'delete from metrics' as x", [("delete from metrics",)]),
    ("select '100%' as x", [("100%",)]),
    ('select "status" from runs', [("finished",)]),
    ("/* leading */ select 1 as x -- trailing", [(1,)]),
    ("values (1), (2)", [(1,), (2,)]),
    (
        (
            "with m as (select run_id, count(*) as n from metrics group by run_id) "
            "select r.technique, m.n from runs r join m on m.run_id = r.id"
        ),
        [("dpformer", 4)],
    ),
    ("select r.status, count(*) from runs r join metrics m on m.run_id = r.id group by r.status", [("finished", 4)]),
    ("select name from metrics where name like 'loss%' order by step limit 1", [("loss",)]),
    ("select replace(status, 'fin', 'FIN') from runs", [("FINished",)]),
    ("select 1 as x union all select 2 order by 1", [(1,), (2,)]),
]


def full_run() -> str:
    with record_run(
        flow="train-dp", stage="train-dp", technique="dpformer", config={"epsilon": 8.0}, dataset="ml-100k", track=False
    ) as rec:
        rec.metrics({"ndcg_at_10": 0.031, "hit_at_10": 0.062})
        rec.metric("loss", 2.5, step=0)
        rec.metric("loss", 2.0, step=1)
        rec.privacy(epsilon=7.98, delta=1e-6, noise_multiplier=1.2, sample_rate=0.01, steps=500, accountant="rdp")
    return rec.run_id


def snapshot(url: str) -> dict[str, tuple[int, str]]:
    """Every table of the store: its row count and a hash of all its rows (order-independent)."""
    with get_engine(url).connect() as conn:
        out = {}
        for name in sorted(inspect(conn).get_table_names()):
            rows = sorted(repr(tuple(r)) for r in conn.execute(text(f'select * from "{name}"')))
            out[name] = (len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest())
    return out


@pytest.fixture
def filled(store_url: str) -> str:
    full_run()
    return store_url


# reads or plans the database itself would run: only the statement check refuses them
PARSER_ONLY = {
    "; select 1",
    "explain analyze select 1",
    "explain delete from metrics",
    "",
    "  ;  ",
    "-- only a comment",
}


def refusal_problems(url: str, statements: list[str], tmp_path: Path) -> list[str]:
    """Run each statement; what went wrong for each one that was not refused cleanly and harmlessly."""
    problems = []
    for i, sql in enumerate(statements):
        target = tmp_path / f"attached-{i}.db"
        sql = sql.replace(TARGET, str(target))
        before = snapshot(url)
        try:
            ResultsRepository(url).query(sql)
            problems.append(f"{sql!r} was not refused")
        except StoreError as exc:
            if "query failed" not in str(exc) and "query returned no rows" not in str(exc):
                problems.append(f"{sql!r}: unexpected message {exc}")
        if snapshot(url) != before:
            problems.append(f"{sql!r} changed the store")
        if list(tmp_path.glob(f"attached-{i}.db*")):
            problems.append(f"{sql!r} created {target}")
    return problems


def test_query_refuses_everything_but_one_read(filled: str, tmp_path: Path) -> None:
    problems = refusal_problems(filled, REFUSED, tmp_path)
    assert not problems, "\n".join(problems)


def test_refusals_say_query_failed_and_the_rule(filled: str) -> None:
    for sql in REFUSED:
        with pytest.raises(StoreError, match="query failed: only one read-only statement") as info:
            ResultsRepository(filled).query(sql.replace(TARGET, "/nonexistent/x.db"))
        assert "SQL: " in str(info.value) and "fix: " in str(info.value)


def test_database_refuses_writes_even_without_the_parser(
    filled: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second line of defence: with the statement check switched off, the connection itself refuses."""
    monkeypatch.setattr(repository, "read_only_statement", lambda sql, dialect: sql)
    problems = refusal_problems(filled, [s for s in REFUSED if s not in PARSER_ONLY], tmp_path)
    assert not problems, "\n".join(problems)


def test_query_answers_reads(filled: str) -> None:
    before = snapshot(filled)
    wrong = []
    for sql, expected in ALLOWED:
        try:
            rows = ResultsRepository(filled).query(sql)[1]
        except StoreError as exc:
            rows = exc
        if rows != expected:
            wrong.append(f"{sql!r}: {rows!r} != {expected!r}")
    assert not wrong, "\n".join(wrong)
    assert snapshot(filled) == before


def test_query_takes_parameters_and_names_columns(filled: str) -> None:
    cols, rows = ResultsRepository(filled).query(
        "select name, value from metrics where name = :name and step = :step", {"name": "loss", "step": 1}
    )
    assert cols == ["name", "value"] and rows == [("loss", 2.0)]


def test_query_error_names_the_statements_and_the_fix(filled: str) -> None:
    with pytest.raises(StoreError) as info:
        ResultsRepository(filled).query("commit; delete from metrics returning id")
    message = str(info.value)
    assert "only one read-only statement" in message and "got 2 statements" in message
    assert "'commit'" in message and "'delete from metrics returning id'" in message


def test_query_error_names_a_write_inside_a_select(filled: str) -> None:
    with pytest.raises(StoreError, match="only one read-only statement.*DELETE"):
        ResultsRepository(filled).query("with d as (delete from metrics returning *) select * from d")


def test_query_explains_and_describes_the_schema(filled: str) -> None:
    repo = ResultsRepository(filled)
    assert repo.query("explain select * from runs")[1]
    if filled.startswith("sqlite"):
        assert repo.query("explain query plan select * from runs")[1]
        rows = repo.query("select name from pragma_table_info('runs') where name = 'status'")[1]
    else:
        rows = repo.query(
            "select column_name from information_schema.columns where table_name = 'runs' and column_name = 'status'"
        )[1]
    assert rows == [("status",)]


def test_query_with_postgres_dollar_quotes(store_url: str) -> None:
    if not store_url.startswith("postgres"):
        pytest.skip("dollar quoting is PostgreSQL syntax")
    _cols, rows = ResultsRepository(store_url).query("select $$a;b$$ as x, $tag$it's; $$ok$$$tag$ as y;")
    assert rows == [("a;b", "it's; $$ok$$")]
    _cols, rows = ResultsRepository(store_url).query("select e'it\\'s; fine' as x /* /* nested */ ; */")
    assert rows == [("it's; fine",)]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
@pytest.mark.parametrize(
    ("sql", "sent"),
    [
        ("select 1;", "select 1"),
        ("select ';' ; -- bye", "select ';' "),
        ("select 1 -- x\n;;", "select 1 -- x\n"),
        ("with a as (select 1) select * from a", "with a as (select 1) select * from a"),
        ("explain select 1", "explain select 1"),
        ("explain query plan select 1", "explain query plan select 1"),
    ],
)
def test_read_only_statement_strips_the_trailing_semicolon(dialect: str, sql: str, sent: str) -> None:
    assert read_only_statement(sql, dialect) == sent


@pytest.mark.parametrize(
    ("sql", "dialect"),
    [
        ("select 1 /* /* */ ; delete from metrics */", "sqlite"),  # SQLite comments do not nest
        ("select 1 /* /* */ ; delete from metrics", "postgresql"),  # ... PostgreSQL's do: unterminated
        ("select 'unterminated", "sqlite"),
        ("select [a;b] from t; delete from t", "sqlite"),
        ("select `a;b` from t; delete from t", "sqlite"),
        ("select $x$ ; $y$; delete from t", "postgresql"),
    ],
)
def test_read_only_statement_lexes_like_the_database(sql: str, dialect: str) -> None:
    with pytest.raises(StoreError, match="only one read-only statement"):
        read_only_statement(sql, dialect)


def test_nested_comment_hides_nothing_on_postgres() -> None:
    nested = "select 1 /* /* */ ; delete */"
    assert read_only_statement(nested, "postgresql") == nested
    assert read_only_statement("select [a;b] from t", "sqlite") == "select [a;b] from t"
