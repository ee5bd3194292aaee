"""The example queries of docs/queries.md run, and return rows, on a store filled by real tiny runs of every stage; and
``privbench results query`` prints them as a table, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from privbench.cli import app
from storage.repository import ResultsRepository
from tests.filled_store import FilledStore

QUERIES_DOC = Path(__file__).resolve().parents[2] / "docs" / "queries.md"
QUERIES = re.findall(r"```sql\n(.*?)```", QUERIES_DOC.read_text(), flags=re.DOTALL)


def test_the_docs_have_the_example_queries() -> None:
    assert len(QUERIES) >= 4


@pytest.mark.parametrize("sql", QUERIES, ids=[f"query{i}" for i in range(len(QUERIES))])
def test_readme_query_returns_rows(filled_store: FilledStore, sql: str) -> None:
    columns, rows = ResultsRepository(filled_store.db_url).query(sql)
    assert columns and rows, sql
    assert all(any(v is not None for v in row) for row in rows)


def test_best_method_per_epsilon_matches_the_metric_rows(filled_store: FilledStore) -> None:
    repo = ResultsRepository(filled_store.db_url)
    _, best = repo.query(QUERIES[0])
    _, points = repo.query(
        "select r.dataset, p.target_epsilon, m.value from runs r join privacy_ledger p on p.run_id = r.id "
        "join metrics m on m.run_id = r.id and m.name = 'test_ndcg_at_10' where r.stage = 'train-dp'"
    )
    for dataset, epsilon, _method, value in best:
        assert value == max(v for d, e, v in points if d == dataset and e == epsilon)


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_results_query_formats(filled_store: FilledStore, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in filled_store.env.items():
        monkeypatch.setenv(key, value)
    sql = QUERIES[2]
    _, rows = ResultsRepository(filled_store.db_url).query(sql)
    out = CliRunner().invoke(app, ["results", "query", sql, "--format", fmt])
    assert out.exit_code == 0, out.output
    if fmt == "csv":
        parsed = list(csv.reader(io.StringIO(out.stdout)))
        assert parsed[0] == ["embedding", "setting", "rougeL", "recall", "batches"] and len(parsed) == len(rows) + 1
    elif fmt == "json":
        parsed = json.loads(out.stdout)
        assert len(parsed) == len(rows) and set(parsed[0]) == {"embedding", "setting", "rougeL", "recall", "batches"}
    else:
        assert "embedding" in out.stdout and str(rows[0][0]) in out.stdout


def test_results_query_rejects_an_unknown_format(filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in filled_store.env.items():
        monkeypatch.setenv(key, value)
    out = CliRunner().invoke(app, ["results", "query", "select 1", "--format", "xml"])
    assert out.exit_code == 2 and "--format must be table, csv or json, got 'xml'" in out.output
