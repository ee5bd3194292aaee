"""What `privbench bench mpc-generation` builds from runs measured at several lengths, on synthetic costs of a
known model (no CrypTen): measured and projected lengths flagged apart, the hold-out check exact where the model
holds and far off where it does not, the measured-only growth, the metric names the claims read."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest

from core.errors import ConfigError
from privbench.bench import mpc_generation
from privbench.bench.harness import numeric_leaves

METHODS = ("vanilla", "vanilla_kv", "merge")
SETTING = mpc_generation.Setting(
    n_layer=1,
    n_embd=16,
    n_head=2,
    prefix_len=8,
    gen_len=6,
    more_runs=((20, 3), (40, 3)),
    project_lengths=(128, 512),
    methods=METHODS,
)
# per method: a step's bytes and rounds at sequence length n (vanilla recomputes the sequence, the others attend
# one position to n), and seconds = 3e-9 bytes + 2e-3 rounds + 0.1 per step
BYTES = {
    "vanilla": lambda n: 4e7 + 2e6 * n + 5e3 * n * n,
    "vanilla_kv": lambda n: 3e7 + 4e5 * n,
    "merge": lambda n: 1e7 + 1e5 * n,
}
ROUNDS = {"vanilla": lambda n: 900 + 40 * math.log2(n), "vanilla_kv": lambda n: 800.0 + n, "merge": lambda n: 300.0}


def _linear(b: float, r: float) -> float:
    return 3e-9 * b + 2e-3 * r + 0.1


def _measured(setting: mpc_generation.Setting, price: Callable[[str, float, float], float]) -> list[dict]:
    """The bench's per-run results: each method's phases, steps (step 0 reads the prompt) and totals."""
    out = []
    for p, g in setting.runs():
        res = {}
        for m in setting.methods:
            steps = {"bytes": [BYTES[m](p) * 2], "rounds": [ROUNDS[m](p) + 50]}
            steps["bytes"] += [BYTES[m](p + i) for i in range(1, g)]
            steps["rounds"] += [ROUNDS[m](p + i) for i in range(1, g)]
            steps["s"] = [price(m, b, r) for b, r in zip(steps["bytes"], steps["rounds"], strict=True)]
            phases = {
                "prefix": {"s": 0.05 * p, "bytes": 1e5 * p, "rounds": 4.0},
                "decode": {"s": 0.3 * g, "bytes": 2e6 * g, "rounds": 20.0 * g},
            }
            total = {u: phases["prefix"][u] + sum(steps[u]) + phases["decode"][u] for u in ("s", "bytes", "rounds")}
            res[m] = {
                "total_s": total["s"],
                "comm_bytes": total["bytes"],
                "rounds": total["rounds"],
                "phases": phases,
                "steps": steps,
            }
        out.append(res)
    return out


def test_model_costs_are_validated_exactly_and_flagged_measured_or_projected() -> None:
    measured = _measured(SETTING, lambda m, b, r: _linear(b, r))
    out = mpc_generation._lengths(SETTING, measured)
    lengths = out["lengths"]
    assert {k: (v["kind"], v["projected"]) for k, v in lengths.items()} == {
        "L14": ("measured", 0),
        "L23": ("measured", 0),
        "L43": ("measured", 0),
        "L128": ("projected", 1),
        "L512": ("projected", 1),
    }
    val = out["validation"]
    assert (val["held_out_length"], val["fit_lengths"], val["longest_fit_length"]) == (43, [14, 23], 23)
    for m in METHODS:
        v = val[m]
        assert v["time_measured_s"] == measured[2][m]["total_s"] and v["bytes_measured"] == measured[2][m]["comm_bytes"]
        for unit in ("time", "bytes", "rounds"):
            assert v[f"{unit}_rel_err"] < 1e-9 and v[f"{unit}_tail_rel_err"] < 1e-9, (m, unit, v)
        assert v["time_predicted_s"] == pytest.approx(v["time_measured_s"], rel=1e-9)
    for key in ("merge_speedup_over_vanilla", "merge_comm_fraction_of_vanilla", "merge_speedup_over_vanilla_kv"):
        r = val["ratios"][key]
        assert r["measured"] == lengths["L43"]["ratios"][key] and r["rel_err"] < 1e-9
    # measured figures under their own keys, from the measurements alone
    assert out["measured"]["longest"] == out["measured"]["L43"] and out["measured"]["shortest"]["total_len"] == 14
    speedup = {
        n: measured[j]["vanilla"]["total_s"] / measured[j]["merge"]["total_s"] for j, n in enumerate((14, 23, 43))
    }
    assert out["measured"]["L23"]["ratios"]["merge_speedup_over_vanilla"] == pytest.approx(speedup[23])
    growth = out["measured_growth"]
    assert (growth["from_length"], growth["to_length"]) == (14, 43)
    assert growth["merge_speedup_over_vanilla"] == pytest.approx(speedup[43] / speedup[14])
    # the projections are the fit on all three runs: exact for this model (prompt 8, 120 new tokens)
    head = {m: measured[0][m]["phases"]["prefix"]["s"] + measured[0][m]["steps"]["s"][0] for m in METHODS}
    want = {
        m: head[m] + sum(_linear(BYTES[m](8 + i), ROUNDS[m](8 + i)) for i in range(1, 120)) + 0.3 * 120 for m in METHODS
    }
    assert lengths["L128"]["methods"]["merge"]["total_s"] == pytest.approx(want["merge"], rel=1e-6)
    assert lengths["L128"]["ratios"]["merge_speedup_over_vanilla"] == pytest.approx(
        want["vanilla"] / want["merge"], rel=1e-6
    )
    names = dict(numeric_leaves(out))
    for name in (
        "lengths.L128.ratios.merge_speedup_over_vanilla",
        "lengths.L512.ratios.merge_speedup_over_vanilla",
        "lengths.L128.projected",
        "lengths.L43.projected",
        "validation.ratios.merge_speedup_over_vanilla.rel_err",
        "validation.vanilla.time_rel_err",
        "validation.held_out_length",
        "measured_growth.merge_speedup_over_vanilla",
        "measured.longest.ratios.merge_speedup_over_vanilla",
        "measured.longest.ratios.merge_comm_fraction_of_vanilla",
        "measured.L43.ratios.lan.merge_speedup_over_vanilla",
    ):
        assert name in names, name
    assert names["lengths.L128.projected"] == 1.0 and names["lengths.L43.projected"] == 0.0
    assert not any(n.endswith(".kind") for n in names)  # a label, not a metric


def test_a_wrong_model_shows_in_the_held_out_error() -> None:
    """Vanilla's seconds grow with the square of its step bytes while the fit prices them linearly: its
    held-out seconds and the speedup there are far off and reported, its bytes (the right model) exact."""

    def quadratic(m: str, b: float, r: float) -> float:
        return (b / 1e8) ** 2 if m == "vanilla" else _linear(b, r)

    out = mpc_generation._lengths(SETTING, _measured(SETTING, quadratic))
    val = out["validation"]
    assert val["vanilla"]["time_tail_rel_err"] > 0.1 and val["vanilla"]["time_rel_err"] > 0.05
    assert val["merge"]["time_rel_err"] < 1e-9 and val["vanilla"]["bytes_rel_err"] < 1e-9
    assert val["ratios"]["merge_speedup_over_vanilla"]["rel_err"] == pytest.approx(val["vanilla"]["time_rel_err"])
    assert val["max_time_rel_err"] == val["vanilla"]["time_rel_err"]


def test_two_measured_runs_give_measured_lengths_and_growth_without_a_fit() -> None:
    two = SETTING.model_copy(update={"more_runs": ((40, 3),), "project_lengths": ()})
    out = mpc_generation._lengths(two, _measured(two, lambda m, b, r: _linear(b, r)))
    assert set(out) == {"lengths", "measured", "measured_growth"}
    assert list(out["lengths"]) == ["L14", "L43"] and all(v["projected"] == 0 for v in out["lengths"].values())
    assert out["measured_growth"]["to_length"] == 43


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["more_runs=40+3"], "project_lengths needs 3 or more measured runs"),
        (["more_runs=20+3,40+3", "gen_len=2"], "the hold-out fit (every run but the longest"),
        (["more_runs=8+6,40+3"], "repeat a total length"),
        (["project_lengths=23,128"], "project_lengths [23] are measured lengths"),
        (["more_runs=20x3"], "must read PROMPT+NEW"),
    ],
)
def test_runs_that_cannot_be_validated_are_refused(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        mpc_generation.resolve_setting("paper", {"overrides": [f"secure_inference.{s}" for s in sets]})
