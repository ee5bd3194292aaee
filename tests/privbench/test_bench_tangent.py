"""`privbench bench tangent`: the contract keys, the exactness errors and the storing of the run, on a tiny
random Dinov2 (hidden 32, 2 layers, 2 heads, 28 px, patch 14); the real sizes are checked by running the
benchmark, not here."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from privbench.bench import BENCHMARKS, run_benchmark, tangent
from privbench.cli import app

runner = CliRunner()
RATIOS = {
    "jvp_over_plain_forward_time",
    "jvp_over_torch_func_jvp_time",
    "composed_over_single_inference_time",
    "ensemble_over_composed_inference_time",
    "full_retrain_over_unlearn_time",
    "full_retrain_over_subtraction_time",
}
ERRORS = {"jvp_max_rel_err", "composition_max_abs_err", "unlearning_max_abs_err"}
TARGETS = {
    "jvp_le_3x_plain",
    "jvp_le_2_5x_plain_aim",
    "jvp_no_slower_than_torch_func_jvp",
    "composed_within_5pct_of_single",
    "composition_err_le_1e_5",
    "unlearning_err_le_1e_6",
}
TINY = tangent.tiny_setting()


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> tangent.Setting:
    monkeypatch.setitem(tangent.PROFILES, "quick", TINY)
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "1")
    return TINY


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, mlflow_uri: str) -> dict[str, Any]:
    """One tiny run through `run_benchmark` (store + MLflow), shared by the contract checks."""
    home = tmp_path_factory.mktemp("tangent") / ".privbench"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRIVBENCH_HOME", str(home))
        mp.delenv("PRIVBENCH_DB_URL", raising=False)
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        mp.setenv("PRIVBENCH_BENCH_THREADS", "1")
        mp.setitem(tangent.PROFILES, "quick", TINY)
        return {"out": run_benchmark("tangent", profile="quick", progress=_Quiet()), "home": home}


@pytest.fixture
def tiny_result(tiny_run: dict[str, Any]) -> dict[str, Any]:
    return tiny_run["out"]


class _Quiet:
    def print(self, *args: object, **kwargs: object) -> None:
        return None


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_contract_keys_are_finite_and_positive(tiny_result: dict[str, Any]) -> None:
    out = tiny_result
    assert out["benchmark"] == "tangent" and out["profile"] == "quick" and out["run_id"]
    assert RATIOS <= set(out["ratios"])
    assert all(_finite(out["ratios"][k]) and out["ratios"][k] > 0 for k in RATIOS), out["ratios"]
    assert ERRORS <= set(out["errors"])
    assert all(_finite(v) and v >= 0 for v in out["errors"].values()), out["errors"]
    assert all(_finite(v) and v > 0 for v in out["absolute"].values()), out["absolute"]
    assert {"compose_s", "subtraction_s", "full_retrain_s", "shard_retrain_s"} <= set(out["absolute"])
    assert TARGETS <= set(out["targets"]) and all(isinstance(v, bool) for v in out["targets"].values())
    setting = out["setting"]
    assert setting["backbone"] == "random" and setting["data"] == "random"
    assert setting["tokens"] == 5 and setting["hidden"] == 32 and setting["n_layers"] == 2
    assert setting["threads"] == 1 and out["machine"]["torch_threads"] == 1
    assert set(out["by_k"]) == {"k1", "k2"}


def test_errors_are_small(tiny_result: dict[str, Any]) -> None:
    errors = tiny_result["errors"]
    assert errors["composition_max_abs_err"] < 1e-5
    assert errors["unlearning_max_abs_err"] < 1e-6
    assert errors["jvp_max_rel_err"] < 1e-4 and errors["jvp_max_rel_err_float64"] < 1e-10
    assert errors["linearised_max_rel_err"] < 1e-4
    for k in ("k1", "k2"):
        assert tiny_result["by_k"][k]["errors"]["jvp_max_rel_err"] < 1e-4
        assert tiny_result["by_k"][k]["delta_params_covered"] > 0  # a non-trivial direction
    # the JVP is not trivially zero and the logits are not trivially equal: real, non-zero outputs
    assert errors["logits_max_abs"] > 0
    targets = tiny_result["targets"]
    assert targets["composition_err_le_1e_5"] and targets["unlearning_err_le_1e_6"]


def test_ratios_come_from_real_interleaved_samples(tiny_result: dict[str, Any]) -> None:
    samples = tiny_result["samples"]
    jvp = samples["jvp"]["k1"]
    assert all(len(v) == TINY.repeats and all(s > 0 for s in v) for v in jvp["samples_s"].values())
    assert len(jvp["order"]) == 3 * TINY.repeats
    per_round = [a / b for a, b in zip(jvp["samples_s"]["linearised"], jvp["samples_s"]["plain"], strict=True)]
    assert jvp["ratio_samples"]["jvp_over_plain_forward_time"] == pytest.approx(per_round)
    assert tiny_result["ratios"]["jvp_over_plain_forward_time"] == pytest.approx(statistics.median(per_round))
    unlearn = samples["unlearning"]
    assert all(len(v) == TINY.train_repeats for v in unlearn["samples_s"].values())
    full, shard = unlearn["samples_s"]["full_retrain"], unlearn["samples_s"]["shard_retrain"]
    assert tiny_result["ratios"]["full_retrain_over_unlearn_time"] == pytest.approx(
        statistics.median(f / s for f, s in zip(full, shard, strict=True))
    )
    ens = samples["composition"]["ensemble_vs_composed"]["samples_s"]
    assert len(ens["ensemble"]) == TINY.ensemble_repeats
    assert len(samples["composition"]["compose_samples_s"]) == TINY.compose_repeats
    # an ensemble of n_components forwards is slower than one forward of the composed model
    assert tiny_result["ratios"]["ensemble_over_composed_inference_time"] > 1


def test_run_is_stored(tiny_run: dict[str, Any], mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRIVBENCH_HOME", str(tiny_run["home"]))
    monkeypatch.delenv("PRIVBENCH_DB_URL", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    shown = runner.invoke(app, ["results", "list", "--json", "--flow", "bench", "--status", "finished"])
    assert shown.exit_code == 0, shown.output
    (row,) = json.loads(shown.stdout)
    assert row["technique"] == "tangent" and row["id"] == tiny_run["out"]["run_id"]


def test_unknown_profile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="known: quick, paper"):
        run_benchmark("tangent", profile="huge")
    with pytest.raises(ConfigError, match=r"unknown profile 'huge' for tangent; known: quick, paper"):
        tangent.resolve_setting("huge")
    with pytest.raises(ConfigError, match="n_components"):
        tangent.tiny_setting(n_components=1)
    with pytest.raises(ConfigError, match="unknown backbone"):
        tangent.tiny_setting(backbone="vit-huge")
    assert "tangent" in BENCHMARKS and "torch.func.jvp" in BENCHMARKS["tangent"].description


def test_cli_bench_tangent_prints_json_and_stores_the_run(
    home: Path, tiny: tangent.Setting, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI and the fresh worker process (the profiles' default), with its CPU environment."""
    monkeypatch.setitem(tangent.PROFILES, "quick", tangent.tiny_setting(k=(1,), fresh_process=True))
    result = runner.invoke(app, ["bench", "tangent", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["benchmark"] == "tangent" and RATIOS <= set(out["ratios"]) and ERRORS <= set(out["errors"])
    assert "round 1/" in result.stderr  # progress on stderr
    assert out["setting"]["fresh_process"] and out["setting"]["worker_env"].get("OMP_WAIT_POLICY") == "PASSIVE"
    assert set(out["by_k"]) == {"k1"} and out["setting"]["threads"] == 1
    shown = json.loads(runner.invoke(app, ["results", "show", out["run_id"], "--json"]).stdout)
    metrics = {m["name"]: m for m in shown["metrics"]}
    assert metrics["ratios.jvp_over_plain_forward_time"]["value"] == out["ratios"]["jvp_over_plain_forward_time"]
    assert metrics["ratios.jvp_over_plain_forward_time"]["unit"] == "ratio"
    assert metrics["absolute.compose_s"]["unit"] == "s"
    assert metrics["errors.unlearning_max_abs_err"]["value"] == out["errors"]["unlearning_max_abs_err"]
    assert not any(name.startswith("setting.") for name in metrics)
