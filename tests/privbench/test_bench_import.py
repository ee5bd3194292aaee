"""``privbench bench --no-record`` (measure on a machine without the store, e.g. a GPU worker) and ``privbench
results import-bench`` (record that JSON here, with the measuring machine's provenance)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from privbench.bench import harness
from privbench.cli import app

runner = CliRunner()


def _toy(profile: str, progress: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "setting": {"device": "cuda", "n": 3},
        "methods": {"a": {"step_s": 0.5}, "b": {"step_s": 2.0}},
        "ratios": {"b_over_a": 4.0},
        "label": "kept in the artifact only",
    }


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> str:
    spec = harness.BenchmarkSpec(
        "toy", "a toy benchmark", _toy, setting=lambda profile, options: {"n": 3}, profile_aliases={"big": "paper"}
    )
    monkeypatch.setitem(harness.BENCHMARKS, "toy", spec)
    return "toy"


def _measured_elsewhere(tmp_path: Path, **changes: Any) -> Path:
    """What `privbench bench toy --no-record --json` printed on another machine (a GPU worker)."""
    result = harness.run_benchmark("toy", profile="big", record=False)
    result["machine"] |= {"host": "gpu-worker-7", "cuda_device": "NVIDIA H100 80GB HBM3", "cuda_device_count": 1}
    result |= {"started_at": "2026-11-25T10:00:00+00:00", "finished_at": "2026-11-25T10:05:30+00:00"}
    result["git_commit"] = "abc123"
    result |= changes
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(result))
    return path


def test_no_record_touches_no_store(home: Path, toy: str) -> None:
    result = runner.invoke(app, ["bench", "toy", "--profile", "big", "--no-record", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["run_id"] is None and out["profile"] == "paper" and out["ratios"] == {"b_over_a": 4.0}
    assert out["config"] == {"benchmark": "toy", "profile": "paper", "options": {}, "setting": {"n": 3}}
    assert not home.exists() or not any(home.rglob("*.db"))  # nothing was recorded anywhere


def test_import_records_the_run_with_the_measuring_machines_provenance(home: Path, toy: str, tmp_path: Path) -> None:
    path = _measured_elsewhere(tmp_path)
    result = runner.invoke(app, ["results", "import-bench", str(path), "--json"])
    assert result.exit_code == 0, result.output
    (imported,) = json.loads(result.stdout)
    shown = json.loads(runner.invoke(app, ["results", "show", imported["run_id"], "--json"]).stdout)
    run = shown
    assert (run["flow"], run["stage"], run["technique"], run["profile"], run["status"]) == (
        "bench",
        "bench",
        "toy",
        "paper",
        "finished",
    )
    assert run["host"] == "gpu-worker-7" and run["git_commit"] == "abc123"
    assert run["device"].startswith("cuda: NVIDIA H100 80GB HBM3 (x1)")
    assert run["duration_s"] == 330.0 and str(run["started_at"]).startswith("2026-11-25")
    metrics = {m["name"]: m["value"] for m in shown["metrics"]}
    assert metrics == {"methods.a.step_s": 0.5, "methods.b.step_s": 2.0, "ratios.b_over_a": 4.0}
    assert run["config"]["setting"] == {"n": 3}
    again = runner.invoke(app, ["results", "import-bench", str(path)])  # the same measurement twice: refused
    assert again.exit_code == 2 and f"already in the store as run {imported['run_id']}" in again.output
    assert len(json.loads(runner.invoke(app, ["results", "list", "--json"]).stdout)) == 1
    # started side by side in the same second on the same machine with another setting (e.g. one per seed): a
    # different measurement, recorded; it too only once
    body = json.loads(path.read_text())
    body["config"]["setting"] = {"n": 4}
    sibling = tmp_path / "toy-n4.json"
    sibling.write_text(json.dumps(body))
    result = runner.invoke(app, ["results", "import-bench", str(sibling), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["run_id"] != imported["run_id"]
    assert runner.invoke(app, ["results", "import-bench", str(sibling)]).exit_code == 2
    assert len(json.loads(runner.invoke(app, ["results", "list", "--json"]).stdout)) == 2


def test_import_refuses_what_is_not_a_no_record_result(home: Path, toy: str, tmp_path: Path) -> None:
    recorded = _measured_elsewhere(tmp_path, run_id="0123abcd")
    result = runner.invoke(app, ["results", "import-bench", str(recorded)])
    assert result.exit_code == 2 and "already recorded as run 0123abcd" in result.output
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"benchmark": "toy", "profile": "quick"}))
    result = runner.invoke(app, ["results", "import-bench", str(broken)])
    assert result.exit_code == 2 and "missing started_at, finished_at, machine, config" in result.output
    garbage = tmp_path / "garbage.json"
    garbage.write_text("mpc-generation (quick): GPT-2 ...")
    result = runner.invoke(app, ["results", "import-bench", str(garbage)])
    assert result.exit_code == 2 and "cannot read" in result.output and "--no-record --json" in result.output
    backwards = _measured_elsewhere(tmp_path, finished_at="2026-11-25T09:00:00+00:00")
    result = runner.invoke(app, ["results", "import-bench", str(backwards)])
    assert result.exit_code == 2 and "is before started_at" in result.output
    listed = json.loads(runner.invoke(app, ["results", "list", "--json"]).stdout)
    assert listed == []  # nothing half-recorded
