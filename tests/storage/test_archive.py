"""The store as files and back (``storage.archive``): an export is deterministic, export -> restore -> export gives
the same bytes and the same verdicts, every value survives exactly (NULL and the empty string, backslashes, floats,
times), a one-profile export keeps what that profile's report reads, and a restore refuses what it cannot load."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import select

from core.errors import StoreError
from storage.archive import TABLES, export_store, restore_store
from storage.db import dispose_engine, get_engine
from storage.models import Base
from storage.recording import record_run
from tests.hand_made import record_train_dp


def fill_tiny_store() -> dict[str, str]:
    """A tiny store with a row in every table: a train-dp grid of profile ``tiny`` under one flow run (ledgers,
    the popularity floor), a secure-inference run with MPC costs, an attacks run with attack results and a
    dataset, a ``paper`` benchmark run, and one run of another profile; text that is empty, NULL or holds
    backslashes, and floats with long expansions. Returns ``{what: run id}``."""
    ids: dict[str, str] = {}
    with record_run(flow="train-dp", stage="train-dp", technique="flow", profile="tiny", config={}, track=False) as top:
        ids["flow"] = top.run_id
    for method, lift in (("dpformer", 0.004), ("transformer", 0.0)):
        for eps in (5.0, 8.0, 10.0):
            for seed in range(3):
                record_train_dp(method, seed, 0.05 + 0.01 * seed + lift, 0.1 + 0.2, 1.0, epsilon=eps, popularity=0.03)
    with record_run(
        flow="train-dp", stage="train-dp", technique="child", dataset="d\\back", profile="tiny", config={"p": "a\\b"},
        parent=top.ref, track=False,
    ) as child:  # fmt: skip
        child.metric("curve", 1 / 3, step=2, unit="")
        ids["child"] = child.run_id
    with record_run(
        flow="secure-inference", stage="secure-inference", technique="merge", dataset="gpt2", profile="tiny",
        config={"seed": 0}, track=False,
    ) as mpc:  # fmt: skip
        mpc.mpc_cost(op_category="matmul", party=0, seconds=0.1 + 0.2, bytes=2**40 + 1, rounds=7, phase="decode")
        mpc.mpc_cost(op_category="softmax", party=1, seconds=1e-300, bytes=0, rounds=0, calls=3)
    with record_run(
        flow="attacks", stage="attacks", technique="film", dataset="texts", profile="tiny", config={}, track=False
    ) as attack:
        attack.attack(attack="film", target="", setting=None, rouge1=0.5, extra={"note": "\\n stays"})
        attack.attack(attack="lira", target="\\weird", setting="shadows=4", auc=0.61, empirical_epsilon_lo=0.0)
        attack.dataset(
            name="ml-tiny", content_hash="abc", cache_key="k", path="", source="synthetic",
            stats={"n_users": 3, "n_items": 4, "n_interactions": 12},
        )  # fmt: skip
    with record_run(
        flow="bench", stage="bench", technique="dp-clipping", dataset="synthetic", profile="paper", config={},
        track=False,
    ) as bench:  # fmt: skip
        bench.metrics({"exactness.phantom_norm_max_rel_err": 1e-16, "ratios.phantom_over_nonprivate_time": 1.1})
        ids["bench"] = bench.run_id
    with record_run(flow="prepare", stage="data", technique="flow", profile="other", config={}, track=False) as other:
        ids["other"] = other.run_id
    return ids


def table_rows(url: str) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every table, as SQLAlchemy reads it (ids and all)."""
    with get_engine(url).connect() as conn:
        return {name: sorted(tuple(r) for r in conn.execute(select(Base.metadata.tables[name]))) for name in TABLES}


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _verdicts(url: str) -> pd.DataFrame:
    from storage.claims import claims_table, evaluate_claims

    return claims_table(evaluate_claims(url, profile="tiny"), "tiny")


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_restore_export_gives_the_same_files_and_verdicts(home: Path, tmp_path: Path, fmt: str) -> None:
    fill_tiny_store()
    source = f"sqlite:///{home / 'results.db'}"
    first = export_store(tmp_path / "a", fmt)  # type: ignore[arg-type]
    assert [p.name for p in first.files] == [f"{t}{'.csv.gz' if fmt == 'csv' else '.parquet'}" for t in TABLES] + [
        "manifest.json"
    ]
    export_store(tmp_path / "again", fmt)  # type: ignore[arg-type]
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "again")  # the same store: the same bytes
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["profiles"] == ["other", "paper", "tiny"] and manifest["selection"] == {"profile": None}
    assert manifest["tables"]["runs"]["rows"] == 24 and manifest["tables"]["mpc_costs"]["rows"] == 2
    assert manifest["schema_revision"] == ["0004"]

    restored = f"sqlite:///{tmp_path / 'restored.db'}"
    counts = restore_store(tmp_path / "a", restored)
    assert counts == {name: entry["rows"] for name, entry in manifest["tables"].items()}
    assert table_rows(restored) == table_rows(source)  # every value, NULLs, empty strings and ids included
    export_store(tmp_path / "b", fmt, db_url=restored)  # type: ignore[arg-type]
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")

    if fmt == "csv":  # the same rows (above) give the same verdicts; judged once (seconds)
        before, after = _verdicts(source), _verdicts(restored)
        assert set(before["verdict"]) - {"not run"}, "the tiny store judges no claim: the comparison would be empty"
        pd.testing.assert_frame_equal(before, after)
    dispose_engine(restored)


def test_csv_text_keeps_null_apart_from_empty_and_backslashes(home: Path, tmp_path: Path) -> None:
    import gzip

    fill_tiny_store()
    export_store(tmp_path / "a")
    with gzip.open(tmp_path / "a" / "attack_results.csv.gz", "rt") as handle:
        text = handle.read()
    assert ",film,\\,," in text  # target "" is a lone backslash; setting NULL is an empty field
    assert ",lira,\\\\weird,shadows=4," in text  # a leading backslash gets one more
    with gzip.open(tmp_path / "a" / "metrics.csv.gz", "rt") as handle:
        assert ",curve,0.3333333333333333,2,\\\n" in handle.read()  # the exact double; unit "" is a backslash


def test_a_profile_export_keeps_what_its_report_reads(home: Path, tmp_path: Path) -> None:
    from tasks.report import render_report

    ids = fill_tiny_store()
    whole = render_report(tmp_path / "whole" / "tiny.md", profile="tiny", figures=False).path.read_text()
    done = export_store(tmp_path / "tiny", profile="tiny")
    assert done.manifest["selection"] == {"profile": "tiny"} and done.manifest["profiles"] == ["paper", "tiny"]
    url = f"sqlite:///{tmp_path / 'tiny.db'}"
    restore_store(tmp_path / "tiny", url)
    kept = {r[0] for r in table_rows(url)["runs"]}
    assert (
        ids["bench"] in kept and ids["child"] in kept and ids["other"] not in kept
    )  # paper bench: a tiny report reads it
    assert (
        render_report(tmp_path / "part" / "tiny.md", profile="tiny", db_url=url, figures=False).path.read_text()
        == whole
    )
    dispose_engine(url)


def test_restore_refuses_a_store_that_is_not_empty_and_a_changed_export(home: Path, tmp_path: Path) -> None:
    fill_tiny_store()
    export_store(tmp_path / "a")
    with pytest.raises(StoreError, match=r"is not empty \(24 runs, .*restore into an empty store: pass --db"):
        restore_store(tmp_path / "a")
    with pytest.raises(StoreError, match="no run of profile 'nope' in the store; its profiles: other, paper, tiny"):
        export_store(tmp_path / "b", profile="nope")
    with pytest.raises(StoreError, match="is not a results-store export"):
        restore_store(tmp_path, f"sqlite:///{tmp_path / 'x.db'}")
    metrics = tmp_path / "a" / "metrics.csv.gz"
    metrics.write_bytes(metrics.read_bytes()[:-8])
    url = f"sqlite:///{tmp_path / 'y.db'}"
    with pytest.raises(StoreError, match="metrics.csv.gz does not match .*manifest.json"):
        restore_store(tmp_path / "a", url)
    assert all(not rows for rows in table_rows(url).values())  # nothing half-loaded
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    manifest["schema_revision"] = ["9999"]
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="schema revision 9999, newer than this privbench's"):
        restore_store(tmp_path / "a", url)
    dispose_engine(url)


def test_an_export_reads_the_same_from_sqlite_and_postgresql(store_url: str, tmp_path: Path) -> None:
    """PostgreSQL returns aware times and sorts text by its collation: the export is still the SQLite store's."""
    fill_tiny_store()
    export_store(tmp_path / "a")
    url = f"sqlite:///{tmp_path / 'copy.db'}"
    restore_store(tmp_path / "a", url)
    export_store(tmp_path / "b", db_url=url)
    dispose_engine(url)
    assert _bytes(tmp_path / "a") == _bytes(tmp_path / "b")


def test_an_export_names_no_folder_of_the_measuring_machine(tmp_path: Path) -> None:
    """Paths under PRIVBENCH_HOME and the checkout become placeholders; other text is left as it is."""
    from storage import archive

    home = tmp_path / "home"
    rows = [(1, f"{home}/data/ml-100k", f"shakespeare: {archive._CHECKOUT_DIR}/.venv/share/x.txt", "plain", None)]
    (out,) = archive._without_home(rows, home)
    assert out == (
        1,
        "$PRIVBENCH_HOME/data/ml-100k",
        "shakespeare: $PRIVBENCH_CHECKOUT/.venv/share/x.txt",
        "plain",
        None,
    )
    inside = archive._CHECKOUT_DIR / ".privbench"  # the default home sits inside the checkout: the longer path wins
    assert archive._without_home([(f"{inside}/data",)], inside) == [("$PRIVBENCH_HOME/data",)]
