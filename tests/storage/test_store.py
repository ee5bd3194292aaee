"""The results store on SQLite and PostgreSQL: migrations, the recording API's atomicity, queries, export."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import func, inspect, select

from core.errors import StoreError
from storage.db import get_engine, session_scope
from storage.models import Metric, PrivacyLedger, Run
from storage.recording import fail_open_runs, record_run, start_run
from storage.repository import EXPORT_TABLES, ResultsRepository

CONFIG = {"epsilon": 8.0, "model": {"d": 64}}


def record_full_run(**kwargs) -> str:
    with record_run(
        flow="train-dp",
        stage="train-dp",
        technique="dpformer",
        config=CONFIG,
        dataset="ml-100k",
        track=kwargs.pop("track", False),
        **kwargs,
    ) as rec:
        rec.metrics({"ndcg_at_10": 0.031, "hit_at_10": 0.062}, units={"ndcg_at_10": "fraction"})
        rec.metric("loss", 2.5, step=0)
        rec.metric("loss", 2.0, step=1)
        rec.privacy(
            epsilon=7.98,
            delta=1e-6,
            noise_multiplier=1.2,
            sample_rate=0.01,
            steps=500,
            accountant="rdp",
            clip_norm=1.0,
            target_epsilon=8.0,
            unit="user",
        )
        rec.mpc_cost(op_category="Softmax", party=0, seconds=0.5, bytes=1 << 33, rounds=12)
        rec.attack(
            attack="lira",
            target="dpformer",
            auc=0.52,
            tpr_at_0_1pct_fpr=0.001,
            empirical_epsilon=0.3,
            empirical_epsilon_lo=0.1,
            empirical_epsilon_hi=0.6,
            accountant_epsilon=8.0,
        )
    return rec.run_id


def counts(url: str) -> dict[str, int]:
    with session_scope(url) as s:
        return {m.__tablename__: s.scalar(select(func.count()).select_from(m)) for m in (Run, Metric, PrivacyLedger)}


def test_migrations_create_every_table(store_url: str) -> None:
    names = set(inspect(get_engine(store_url)).get_table_names())
    assert set(EXPORT_TABLES) | {"alembic_version"} <= names


def test_finished_run_has_everything_it_recorded(store_url: str) -> None:
    run_id = record_full_run()
    run = ResultsRepository().get_run(run_id)
    assert run["status"] == "finished" and run["error"] is None and run["duration_s"] >= 0
    assert run["config"] == CONFIG
    assert {(m["name"], m["step"]) for m in run["metrics"]} == {
        ("hit_at_10", None),
        ("ndcg_at_10", None),
        ("loss", 0),
        ("loss", 1),
    }
    assert run["privacy_ledger"][0]["epsilon"] == 7.98 and run["privacy_ledger"][0]["accountant"] == "rdp"
    assert run["mpc_costs"][0]["bytes"] == 1 << 33  # BigInteger: > 2^31 survives
    attack = run["attack_results"][0]
    for key in (
        "auc",
        "tpr_at_0.1pct_fpr",
        "tpr_at_1pct_fpr",
        "empirical_epsilon",
        "empirical_epsilon_ci",
        "accountant_epsilon",
    ):
        assert key in attack
    assert attack["empirical_epsilon_ci"] == [0.1, 0.6]


def test_task_that_raises_leaves_failed_row_and_no_metrics(store_url: str) -> None:
    before = counts(store_url)
    with (
        pytest.raises(RuntimeError, match="diverged"),
        record_run(flow="train-dp", stage="train-dp", technique="dpformer", config=CONFIG, track=False) as rec,
    ):
        rec.metric("ndcg_at_10", 0.5)
        rec.privacy(epsilon=1, delta=1e-6, noise_multiplier=1, sample_rate=0.1, steps=1, accountant="rdp")
        raise RuntimeError("loss diverged at step 3")
    after = counts(store_url)
    assert after["runs"] == before["runs"] + 1
    assert after["metrics"] == before["metrics"] and after["privacy_ledger"] == before["privacy_ledger"]
    (row,) = ResultsRepository().list_runs(status="failed")
    assert row["error"] == "RuntimeError: loss diverged at step 3"


def test_keyboard_interrupt_marks_run_failed_interrupted(store_url: str) -> None:
    with (
        pytest.raises(KeyboardInterrupt),
        record_run(flow="prepare", stage="data", technique="t", config={}, track=False),
    ):
        raise KeyboardInterrupt
    (row,) = ResultsRepository().list_runs()
    assert row["status"] == "failed" and row["error"].startswith("interrupted")


def test_fail_open_runs_closes_what_this_process_left_running(store_url: str) -> None:
    recorder = start_run(flow="prepare", stage="data", technique="flow", config={}, track=False)
    assert ResultsRepository().get_run(recorder.run_id)["status"] == "running"
    assert recorder.run_id in fail_open_runs("interrupted (Ctrl-C)")
    run = ResultsRepository().get_run(recorder.run_id)
    assert run["status"] == "failed" and "Ctrl-C" in run["error"]
    assert fail_open_runs("again") == []


def test_non_finite_metric_is_refused_and_run_fails(store_url: str) -> None:
    with (
        pytest.raises(ValueError, match="metric 'loss' has non-finite value nan"),
        record_run(flow="f", stage="s", technique="t", config={}, track=False) as rec,
    ):
        rec.metric("loss", float("nan"))
    assert ResultsRepository().list_runs()[0]["status"] == "failed"


def test_unknown_attack_field_is_refused(store_url: str) -> None:
    with (
        pytest.raises(ValueError, match="unknown attack-result fields \\['aucc'\\]"),
        record_run(flow="f", stage="s", technique="t", config={}, track=False) as rec,
    ):
        rec.attack(attack="lira", target="m", aucc=0.5)


def test_query_is_read_only_and_answers_sql(store_url: str) -> None:
    record_full_run()
    repo = ResultsRepository()
    cols, rows = repo.query(
        "select r.technique, m.value from runs r join metrics m on m.run_id = r.id where m.name = 'ndcg_at_10'"
    )
    assert cols == ["technique", "value"] and rows == [("dpformer", 0.031)]
    with pytest.raises(StoreError, match="query failed"):
        repo.query("delete from metrics")
    assert counts(store_url)["metrics"] == 4
    with pytest.raises(StoreError, match="query failed"):
        repo.query("select * from no_such_table")


def test_run_lookup_by_prefix_and_errors(store_url: str) -> None:
    run_id = record_full_run()
    repo = ResultsRepository()
    assert repo.get_run(run_id[:8])["id"] == run_id
    with pytest.raises(StoreError, match="no run with id 'zzzz'"):
        repo.get_run("zzzz")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_writes_every_table(store_url: str, tmp_path: Path, fmt: str) -> None:
    record_full_run()
    files = ResultsRepository().export(tmp_path / "out", fmt)  # type: ignore[arg-type]
    assert sorted(p.name for p in files) == sorted(f"{t}.{fmt}" for t in EXPORT_TABLES)
    frame = (
        pd.read_csv(tmp_path / "out/metrics.csv") if fmt == "csv" else pd.read_parquet(tmp_path / "out/metrics.parquet")
    )
    assert len(frame) == 4


def test_unreachable_database_fails_clearly_and_hides_password(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("PRIVBENCH_DB_URL", "postgresql://me:s3cret@127.0.0.1:1/privbench")
    with pytest.raises(StoreError, match="cannot reach the results store") as info:
        ResultsRepository().list_runs()
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    monkeypatch.setenv("PRIVBENCH_DB_URL", "not a url")
    with pytest.raises(StoreError, match="is not a database URL"):
        ResultsRepository().list_runs()


def _writer(args: tuple[str, str, int]) -> list[str]:
    home, url, n = args
    os.environ["PRIVBENCH_HOME"] = home
    os.environ["PRIVBENCH_DB_URL"] = url
    return [record_full_run() for _ in range(n)]


def test_concurrent_processes_write_safely(store_url: str, home: Path) -> None:
    """Several processes (like parallel tasks or MPC parties) record at once; every run lands whole."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        ids = [i for chunk in pool.map(_writer, [(str(home), store_url, 4)] * 3) for i in chunk]
    runs = {r["id"]: r for r in ResultsRepository().list_runs(limit=None)}
    assert set(ids) <= set(runs) and len(ids) == 12
    assert all(runs[i]["status"] == "finished" for i in ids)
    assert counts(store_url)["metrics"] == 12 * 4


def test_sqlite_store_runs_in_wal_mode(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{home / 'results.db'}"
    with get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    assert json.loads(json.dumps(ResultsRepository(url).list_runs())) == []


def test_metric_name_mlflow_cannot_store_is_refused_early(store_url: str) -> None:
    with (
        pytest.raises(ValueError, match="'ndcg_at_10' instead of 'ndcg@10'"),
        record_run(flow="f", stage="s", technique="t", config={}, track=False) as rec,
    ):
        rec.metric("ndcg@10", 0.1)


def test_upgrade_from_0001_keeps_seqrec_rows_and_accepts_image_datasets(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store created before migration 0002 keeps its datasets (kind 'seqrec', n_examples = n_users)."""
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import create_engine, text

    from storage.db import _alembic_config
    from storage.models import Base

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    cfg = _alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        conn.execute(
            text(
                "INSERT INTO datasets (name, content_hash, cache_key, path, source, n_users, n_items, "
                "n_interactions, stats_json, created_at) VALUES ('ml', 'h', 'k', '/p', 's', 7, 9, 70, "
                "'{}', '2026-01-01 00:00:00')"
            )
        )
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
        assert conn.execute(text("select kind, n_examples, n_users from datasets")).all() == [("seqrec", 7, 7)]
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"storage/models.py and the migrations disagree: {diff}"
    engine.dispose()

    monkeypatch.setenv("PRIVBENCH_DB_URL", url)
    with record_run(flow="prepare", stage="data", technique="image-prep", config={}, track=False) as rec:
        rec.dataset(
            name="fm",
            content_hash="c",
            cache_key="k2",
            path="/q",
            source="idx",
            kind="images",
            stats={"n_examples": 50, "n_train": 40},
        )
    with session_scope(url) as s:
        row = s.execute(text("select kind, n_examples, n_users from datasets where name = 'fm'")).one()
    assert tuple(row) == ("images", 50, None)


def test_seqrec_dataset_without_counts_is_refused(store_url: str) -> None:
    with (
        pytest.raises(ValueError, match="needs n_users, n_items and n_interactions"),
        record_run(flow="prepare", stage="data", technique="x", config={}, track=False) as rec,
    ):
        rec.dataset(name="d", content_hash="c", cache_key="k", path="/p", source="s", stats={"n_users": 1})


def test_a_locked_sqlite_store_is_opened_again_not_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite returns 'database is locked' at once where its busy timeout cannot help (several processes opening a
    new store together): opening tries again; only the last try's error reaches the user."""
    from storage import db as store_db

    calls: list[bool] = []

    def flaky(engine: object, url: str, *, last: bool = False) -> None:
        calls.append(last)
        if len(calls) < 3:
            raise store_db._Locked("database is locked")

    monkeypatch.setattr(store_db, "_migrate_once", flaky)
    monkeypatch.setattr(store_db.time, "sleep", lambda s: None)

    class Engine:
        def dispose(self) -> None:
            pass

    store_db._migrate(Engine(), "sqlite:///x.db")  # type: ignore[arg-type]
    assert calls == [False, False, False]
    calls.clear()

    def locked(engine: object, url: str, *, last: bool = False) -> None:
        calls.append(last)
        if not last:
            raise store_db._Locked("database is locked")
        raise StoreError("cannot reach the results store: database is locked")

    monkeypatch.setattr(store_db, "_migrate_once", locked)
    with pytest.raises(StoreError, match="database is locked"):
        store_db._migrate(Engine(), "sqlite:///x.db")  # type: ignore[arg-type]
    assert calls == [False] * store_db._LOCKED_RETRIES + [True]  # the last try reports
