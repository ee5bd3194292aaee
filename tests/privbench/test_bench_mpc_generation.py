"""`privbench bench mpc-generation` on a tiny GPT-2: every method and key of the contract, ops summing to
totals, ratios computed from the methods' own numbers, the run stored, bad input refused."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from core.mpc.crypten_compat import crypten_available
from privbench.bench import mpc_generation, run_benchmark
from privbench.cli import app
from storage.repository import ResultsRepository

pytestmark = pytest.mark.skipif(not crypten_available(), reason="CrypTen is not installed")
TINY = mpc_generation.Setting(n_layer=1, n_embd=16, n_head=2, prefix_len=3, gen_len=2, vocab=100, timeout_s=300)
CATS = {"Embed", "Linear", "Softmax", "Activation", "Norm", "Generation", "Other"}


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(mpc_generation.PROFILES, "quick", TINY)
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "2")


def test_every_method_and_ratio_key(home, tiny) -> None:
    out = run_benchmark("mpc-generation", profile="quick")
    assert set(out["methods"]) == set(mpc_generation.METHOD_NAMES)
    for name, m in out["methods"].items():
        assert m["total_s"] > 0 and m["comm_bytes"] > 0 and m["rounds"] > 0, name
        assert set(m["ops"]) == CATS
        assert all(set(v) == {"s", "bytes", "rounds"} for v in m["ops"].values())
        assert sum(v["bytes"] for v in m["ops"].values()) >= m["comm_bytes"]  # max per op >= the busiest party
    r, ms = out["ratios"], out["methods"]
    assert r["merge_speedup_over_vanilla"] == pytest.approx(ms["vanilla"]["total_s"] / ms["merge"]["total_s"])
    assert r["merge_comm_fraction_of_vanilla"] == pytest.approx(ms["merge"]["comm_bytes"] / ms["vanilla"]["comm_bytes"])
    assert r["merge_speedup_over_vanilla_kv"] == pytest.approx(ms["vanilla_kv"]["total_s"] / ms["merge"]["total_s"])
    assert ms["merge"]["ops"]["Softmax"]["bytes"] == 0 < ms["vanilla"]["ops"]["Softmax"]["bytes"]
    assert r["merge_comm_fraction_of_vanilla"] < 1.0  # no per-step lookup of the vocabulary table
    assert all(math.isfinite(v) for v in r.values()) and "merge_speedup_ge_target" in out["targets"]
    run = ResultsRepository().get_run(out["run_id"])
    assert run["status"] == "finished" and run["technique"] == "mpc-generation"


def test_cli_subset_and_bad_method(home, tiny) -> None:
    result = CliRunner().invoke(app, ["bench", "mpc-generation", "--methods", "vanilla,merge", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert set(body["methods"]) == {"vanilla", "merge"} and "merge_speedup_over_vanilla" in body["ratios"]
    with pytest.raises(ConfigError, match="unknown methods \\['fast'\\]; known: vanilla"):
        run_benchmark("mpc-generation", profile="quick", methods=("fast",))
    with pytest.raises(ConfigError, match="unknown profile 'huge'"):
        run_benchmark("mpc-generation", profile="huge")


def test_set_overrides_change_the_shape_run_and_recorded(home, tiny) -> None:
    sets = ["n_layer=2", "n_head=4", "gen_len=1", "batch_size=2", "vocab=50", "seed=3", "methods=vanilla"]
    args = [a for s in sets for a in ("--set", f"secure_inference.{s}")]
    result = CliRunner().invoke(app, ["bench", "mpc-generation", *args, "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    shape = {"n_layer": 2, "n_embd": 16, "n_head": 4, "gen_len": 1, "batch_size": 2, "vocab": 50, "seed": 3}
    assert {k: body["setting"][k] for k in shape} == shape and body["setting"]["methods"] == ["vanilla"]
    assert body["setting"]["overrides"] == [f"secure_inference.{s}" for s in sets]
    assert set(body["methods"]) == {"vanilla"}
    van = body["methods"]["vanilla"]
    assert van["projection"]["wan"]["bytes_sent"] == van["comm_bytes"] / 2  # logged bytes are sent + received
    config = ResultsRepository().get_run(body["run_id"])["config"]
    assert {k: config["setting"][k] for k in shape} == shape
    assert config["options"]["overrides"] == body["setting"]["overrides"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("secure_inference.layers=3", "unknown key 'layers' under secure_inference; known keys: arch, batch_size"),
        ("layers=3", "unknown key 'layers' under <top level>; known keys: secure_inference"),
        ("secure_inference.n_layer=0", "secure_inference.n_layer = 0: Input should be greater than or equal to 1"),
        ("secure_inference.n_embd=15", "n_embd=15 must be a multiple of n_head=2"),
        ("secure_inference.methods=vanilla,fast", "secure_inference.methods.1 = 'fast': Input should be 'vanilla'"),
        ("secure_inference.n_layer", "--set expects key=value, got 'secure_inference.n_layer'"),
    ],
)
def test_bad_set_is_refused_before_anything_runs(home, tiny, item: str, message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "mpc-generation", "--set", item, "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert message in " ".join(result.stderr.split()), result.stderr
    assert ResultsRepository().list_runs() == []


def test_set_is_refused_by_benchmarks_without_overrides(home) -> None:
    result = CliRunner().invoke(app, ["bench", "stip", "--set", "secure_inference.n_layer=2"])
    shown = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "benchmark stip takes no --set overrides; --set works for: " in shown
    takers = shown.split("--set works for: ")[1].split(",")
    assert {"dp-clipping", "mpc-generation", "recbole-sasrec"} <= {t.strip() for t in takers}


def test_length_fit_projects_from_three_measured_runs(home, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper profile's machinery on a tiny shape, reached by its alias: three measured runs, a fit per method
    and unit that reproduces the measured bytes and rounds exactly, projections flagged as such, the hold-out
    check of the longest measured run and the measured ratios under their own keys."""
    tiny = TINY.model_copy(
        update={
            "gen_len": 4,
            "more_runs": ((6, 2), (9, 2)),
            "project_lengths": (16, 24),
            "target_comm_fraction": 0.9,
            "methods": ("vanilla", "merge"),
        }
    )
    monkeypatch.setitem(mpc_generation.PROFILES, "paper", tiny)
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "2")
    out = run_benchmark("mpc-generation", profile="paper-shape")
    assert out["profile"] == "paper" and ResultsRepository().get_run(out["run_id"])["profile"] == "paper"
    lengths = out["lengths"]
    assert {k: (v["kind"], v["projected"]) for k, v in lengths.items()} == {
        "L7": ("measured", 0),
        "L8": ("measured", 0),
        "L11": ("measured", 0),
        "L16": ("projected", 1),
        "L24": ("projected", 1),
    }
    for name in ("vanilla", "merge"):
        assert set(out["fits"][name]) == {"s", "s_poly", "bytes", "rounds"}
        for key in ("L7", "L8", "L11"):  # deterministic costs: the fit reproduces each measured run (to the odd
            m = lengths[key]["methods"][name]  # levels of the softmax maximum's comparison tree)
            assert m["fit_rel_err"]["bytes"] < 1e-2 and m["fit_rel_err"]["rounds"] < 1e-2, (name, key, m)
        assert lengths["L7"]["methods"][name]["comm_bytes"] == out["methods"][name]["comm_bytes"]
        bytes_at = [lengths[k]["methods"][name]["comm_bytes"] for k in ("L7", "L16", "L24")]  # all after prefix 3
        assert bytes_at == sorted(bytes_at)  # more new tokens never cost fewer bytes
        held = out["validation"][name]  # fitted on lengths 7 and 8, predicting 11
        assert held["bytes_measured"] == lengths["L11"]["methods"][name]["comm_bytes"]
        for unit, suffix in (("bytes", ""), ("time", "_s")):
            pred, meas = held[f"{unit}_predicted{suffix}"], held[f"{unit}_measured{suffix}"]
            assert held[f"{unit}_rel_err"] == pytest.approx(abs(pred - meas) / meas)
        assert held["bytes_rel_err"] < 0.2  # extrapolated from steps at 4 lengths only (4-7), to 10
    val = out["validation"]
    assert (val["held_out_length"], val["fit_lengths"]) == (11, [7, 8])
    r = val["ratios"]["merge_speedup_over_vanilla"]
    assert r["measured"] == lengths["L11"]["ratios"]["merge_speedup_over_vanilla"] > 0 and r["predicted"] > 0
    assert out["measured"]["longest"]["ratios"] == lengths["L11"]["ratios"]
    assert out["measured_growth"]["merge_speedup_over_vanilla"] == pytest.approx(
        lengths["L11"]["ratios"]["merge_speedup_over_vanilla"] / lengths["L7"]["ratios"]["merge_speedup_over_vanilla"]
    )
    for key in ("L16", "L24"):
        row = lengths[key]
        assert row["gen_len"] == row["total_len"] - 3 == int(key[1:]) - 3
        assert "merge_comm_le_target" in row["targets"]
        assert row["ratios"]["merge_comm_fraction_of_vanilla"] == pytest.approx(
            row["methods"]["merge"]["comm_bytes"] / row["methods"]["vanilla"]["comm_bytes"]
        )
        assert "lan.merge_speedup_over_vanilla" in row["ratios"] and "merge_lan_speedup_ge_target" in row["targets"]
        assert "poly.merge_speedup_over_vanilla" in row["ratios"]  # the seconds' own polynomial, beside
        assert all(v["total_s"] > 0 and v["total_s_poly"] > 0 for v in row["methods"].values())
    # vanilla recomputes the sequence: its step bytes grow faster with the length than MERGE's
    van, mer = (out["fits"][m]["bytes"]["step"] for m in ("vanilla", "merge"))
    assert van[1] + 8 * van[2] > mer[1] + 8 * mer[2]
    stored = {m["name"]: m["value"] for m in ResultsRepository().get_run(out["run_id"])["metrics"]}
    assert stored["lengths.L16.projected"] == 1 and stored["lengths.L11.projected"] == 0
    for name in (
        "validation.ratios.merge_speedup_over_vanilla.rel_err",
        "measured_growth.merge_speedup_over_vanilla",
        "measured.longest.ratios.merge_speedup_over_vanilla",
    ):
        assert name in stored, name


def test_projection_needs_enough_steps_to_fit() -> None:
    with pytest.raises(ConfigError, match="3 or more measured runs"):
        mpc_generation.resolve_setting("quick", {"overrides": ["secure_inference.more_runs="]})
    with pytest.raises(ConfigError, match="4 or more sequence lengths"):
        mpc_generation.resolve_setting("quick", {"overrides": ["secure_inference.gen_len=2"]})


def test_paper_profile_can_measure_length_128_directly() -> None:
    sets = ["gen_len=120", "project_lengths=", "more_runs="]
    s = mpc_generation.resolve_setting("paper-shape", {"overrides": [f"secure_inference.{x}" for x in sets]})
    assert s.runs() == [(8, 120)] and s.project_lengths == () and s.n_layer == 12
    s = mpc_generation.resolve_setting("paper", {"overrides": ["secure_inference.project_lengths=128,256,512"]})
    assert s.project_lengths == (128, 256, 512) and s.runs() == [(8, 6), (20, 3), (40, 3)]
    quick = mpc_generation.PROFILES["quick"]
    assert len(quick.runs()) >= 3 and len(mpc_generation.PROFILES["paper"].runs()) >= 3


def test_payloads_come_from_the_seed_and_leave_the_global_rng_alone() -> None:
    """The methods' payloads are drawn from ``setting.seed`` under a fork of the RNG: the same seed gives the same
    weights whatever the global RNG was, and the global RNG is left as it was."""
    import torch

    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    one = mpc_generation.payloads(TINY, ("vanilla", "merge"))
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(456)
    two = mpc_generation.payloads(TINY, ("vanilla", "merge"))
    assert torch.equal(one["vanilla"].wte, two["vanilla"].wte)
    other = mpc_generation.payloads(TINY.model_copy(update={"seed": 1}), ("vanilla",))
    assert not torch.equal(one["vanilla"].wte, other["vanilla"].wte)


TINY_T5 = mpc_generation.Setting(
    arch="t5", n_layer=1, n_embd=16, n_head=2, prefix_len=3, gen_len=2, vocab=100, timeout_s=300,
    feed_forward_proj="gated-gelu",
)  # fmt: skip


def test_arch_t5_selects_the_t5_shape_and_runs(home, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(mpc_generation.T5_PROFILES, "quick", TINY_T5)
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "2")
    args = ["--set", "secure_inference.arch=t5", "--methods", "vanilla,vanilla_kv,merge"]  # every method: test_t5.py
    result = CliRunner().invoke(app, ["bench", "mpc-generation", *args, "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["setting"]["arch"] == "t5" and body["setting"]["weights"] == "random (T5 shape)"
    assert set(body["methods"]) == {"vanilla", "vanilla_kv", "merge"}
    ms = body["methods"]
    assert ms["merge"]["ops"]["Softmax"]["bytes"] == 0 < ms["vanilla"]["ops"]["Softmax"]["bytes"]
    assert body["ratios"]["merge_comm_fraction_of_vanilla"] < 1.0
    config = ResultsRepository().get_run(body["run_id"])["config"]
    assert config["setting"]["arch"] == "t5" and config["profile"] == "quick"


def test_t5_profiles_are_the_papers_shape_with_one_prompt_length() -> None:
    paper = mpc_generation.resolve_setting("paper", {"overrides": ["secure_inference.arch=t5"]})
    assert (paper.arch, paper.n_layer, paper.n_embd, paper.n_head, paper.vocab) == ("t5", 6, 768, 12, 50257)
    assert len({p for p, _ in paper.runs()}) == 1 and paper.target_comm_fraction == 0.26
    assert mpc_generation.resolve_setting("paper", {}).arch == "gpt2"
    with pytest.raises(ConfigError, match="must share one prompt length"):
        mpc_generation.resolve_setting(
            "paper", {"overrides": ["secure_inference.arch=t5", "secure_inference.more_runs=20+3,40+3"]}
        )
    with pytest.raises(ConfigError, match="feed_forward_proj"):
        mpc_generation.resolve_setting(
            "quick", {"overrides": ["secure_inference.arch=t5", "secure_inference.feed_forward_proj=swiglu"]}
        )


def test_t5_payloads_merge_the_same_model() -> None:
    """The merged T5 is built from the very weights the other methods run (its value and output projections)."""
    import torch

    loads = mpc_generation.payloads(TINY_T5, ("vanilla", "merge"))
    weights, spec = loads["vanilla"], loads["merge"]
    assert torch.equal(spec.decoder[0].W_V, weights.decoder[0].attn.v) and torch.equal(spec.shared, weights.shared)
    assert spec.p_max == TINY_T5.prefix_len and spec.n_max == TINY_T5.gen_len
    assert not weights.rerun_encoder
    every = mpc_generation.payloads(TINY_T5.model_copy(update={"t5_encoder": "every_step"}), ("vanilla_kv",))
    assert every["vanilla_kv"].rerun_encoder
