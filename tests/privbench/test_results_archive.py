"""``privbench results export`` / ``restore``, ``privbench report --from`` an export, and ``privbench results
import-bench`` over a folder of benchmark JSONs (the committed data behind a report, ``docs/results/data/``)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from privbench.cli import app
from storage.db import dispose_engines
from tests.privbench.test_bench_import import _measured_elsewhere, toy  # noqa: F401 -- toy is a fixture
from tests.storage.test_archive import fill_tiny_store

runner = CliRunner()


def test_export_restore_and_a_report_from_the_export(home: Path, tmp_path: Path) -> None:
    fill_tiny_store()
    data = tmp_path / "data" / "tiny"
    done = runner.invoke(app, ["results", "export", "--out", str(data), "--json"])
    assert done.exit_code == 0, done.output
    manifest = json.loads(done.stdout)
    assert manifest["tables"]["runs"]["rows"] == 24 and "wrote 7 files" in done.stderr
    assert (data / "runs.csv.gz").is_file() and (data / "manifest.json").is_file()

    from_store = runner.invoke(
        app, ["report", "--profile", "tiny", "--out", str(tmp_path / "a/tiny.md"), "--no-figures"]
    )
    assert from_store.exit_code == 0, from_store.output
    from_data = runner.invoke(
        app, ["report", "--profile", "tiny", "--from", str(data), "--out", str(tmp_path / "b/tiny.md"), "--no-figures"]
    )
    assert from_data.exit_code == 0, from_data.output
    assert (tmp_path / "b/tiny.md").read_text() == (tmp_path / "a/tiny.md").read_text()
    missing = runner.invoke(app, ["report", "--from", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "is not a folder" in missing.stderr

    refused = runner.invoke(app, ["results", "restore", str(data)])  # into the configured store, which is not empty
    assert refused.exit_code == 1 and "is not empty (24 runs" in refused.stderr
    target = f"sqlite:///{tmp_path / 'restored.db'}"
    restored = runner.invoke(app, ["results", "restore", str(data), "--db", target, "--json"])
    assert restored.exit_code == 0, restored.output
    assert json.loads(restored.stdout) == {name: entry["rows"] for name, entry in manifest["tables"].items()}
    not_one = runner.invoke(app, ["results", "restore", str(tmp_path), "--db", f"sqlite:///{tmp_path / 'x.db'}"])
    assert not_one.exit_code == 1 and "is not a results-store export" in not_one.stderr
    dispose_engines()


def test_import_bench_takes_a_folder_of_results(home: Path, toy: str, tmp_path: Path) -> None:  # noqa: F811
    folder = tmp_path / "bench"
    folder.mkdir()
    first = _measured_elsewhere(tmp_path)
    first.rename(folder / "a.json")
    body = json.loads((folder / "a.json").read_text())
    body["config"]["setting"] = {"n": 4}  # another measurement of the same benchmark
    (folder / "b.json").write_text(json.dumps(body))
    (folder / "notes.txt").write_text("not a result")
    result = runner.invoke(app, ["results", "import-bench", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert [Path(r["file"]).name for r in json.loads(result.stdout)] == ["a.json", "b.json"]
    again = runner.invoke(app, ["results", "import-bench", str(folder)])  # a folder again: skipped, nothing added
    assert again.exit_code == 0 and again.output.count("already in the store; skipped") == 2
    assert len(json.loads(runner.invoke(app, ["results", "list", "--json"]).stdout)) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["results", "import-bench", str(empty)])
    assert result.exit_code == 2 and "holds no *.json file" in result.output
