"""`privbench bench`: the harness (interleaving, fresh-process workers, storing) and the dp-clipping
contract, on a tiny setting (the real sizes are checked by running the benchmark, not here)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import types
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from privbench.bench import (
    BENCHMARKS,
    BenchmarkError,
    dp_clipping,
    interleave,
    run_benchmark,
    run_in_fresh_process,
)
from privbench.bench.harness import metric_name, metric_unit, numeric_leaves
from privbench.cli import app

runner = CliRunner()
METHODS = {"nonprivate", "phantom", "opacus_hooks", "opacus_ghost_untied"}
RATIOS = {
    "phantom_over_nonprivate_time",
    "phantom_over_nonprivate_mem",
    "opacus_hooks_over_phantom_time",
    "opacus_ghost_untied_over_phantom_time",
    "opacus_hooks_over_phantom_mem",
}
SETTING_KEYS = {"items", "seq_len", "batch", "d_model", "repeats", "device", "threads"}
# big enough that every step allocates fresh pages (logits 8 x 16 x 2001 floats = 1 MB), so that the
# peak RSS growth is > 0; one round, one warm-up and one timed step per process
TINY = dp_clipping.Setting(
    items=2000,
    seq_len=16,
    batch=8,
    d_model=16,
    n_layers=1,
    repeats=1,
    warmup=1,
    steps=1,
    timeout_s=240.0,
    max_batch_mem_mb=0.0,
)
# the large-vocabulary setting, tiny: the ghost-tied baseline's Gram matrices are (2, 208, 208)
TINY_LARGE_VOCAB = replace(
    TINY, name="large_vocab", items=200, seq_len=8, batch=2, methods=dp_clipping.LARGE_VOCAB_METHODS
)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> dp_clipping.Setting:
    monkeypatch.setitem(dp_clipping.PROFILES, "quick", TINY)
    monkeypatch.setitem(dp_clipping.LARGE_VOCAB, "quick", TINY_LARGE_VOCAB)
    monkeypatch.setenv("PRIVBENCH_BENCH_THREADS", "1")
    return TINY


def _positive_finite(value: object) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def test_interleave_alternates_and_keeps_every_sample() -> None:
    calls: list[str] = []

    def fn(name: str, value: float) -> Callable[[], float]:
        def call() -> float:
            calls.append(name)
            return value + len(calls)

        return call

    plain = interleave({"A": fn("A", 0.0), "B": fn("B", 100.0)}, 3, rotate=False)
    assert calls == ["A", "B"] * 3 == plain.order
    assert plain.samples("A") == [1, 3, 5] and plain.samples("B") == [102, 104, 106]
    assert plain.median("A") == 3 and plain.summary()["medians"] == {"A": 3, "B": 104}

    calls.clear()
    rotated = interleave({"A": fn("A", 0), "B": fn("B", 0), "C": fn("C", 0)}, 4)
    assert calls == list("ABCBCACABABC") == rotated.order
    assert all(set(r) == {"A", "B", "C"} for r in rotated.rounds)

    timed = interleave({"x": lambda: None}, 2)  # None -> wall time of the call
    assert len(timed.samples("x")) == 2 and all(s >= 0 for s in timed.samples("x"))
    with pytest.raises(ConfigError, match="repeats"):
        interleave({"x": lambda: None}, 0)


def test_ratio_is_the_median_of_per_round_ratios() -> None:
    # the load drifts (round 2 is slow for both): per-round ratios 2, 2, 3 -> 2; the ratio of medians is 3
    values = iter([{"t": 1.0}, {"t": 2.0}, {"t": 10.0}, {"t": 20.0}, {"t": 4.0}, {"t": 12.0}])
    runs = interleave({"den": lambda: next(values), "num": lambda: next(values)}, 3, rotate=False)
    assert runs.samples("den", "t") == [1.0, 10.0, 4.0]
    assert runs.ratio_samples("num", "den", "t") == [2.0, 2.0, 3.0]
    assert runs.ratio("num", "den", "t") == 2.0
    assert runs.median("num", "t") / runs.median("den", "t") == 3.0
    few = runs.ratio_interval("num", "den", "t")  # 3 rounds: a median, but no 95% interval
    assert (few.median, few.n, few.lo, few.hi) == (2.0, 3, None, None)


def test_ratio_interval_is_the_order_statistic_interval_of_the_per_round_ratios() -> None:
    # 6 rounds: [min, max] of the per-round ratios (coverage 1 - 2/64), not of the per-method samples
    den = [1.0, 10.0, 4.0, 2.0, 8.0, 5.0]
    ratios = [1.2, 1.0, 1.5, 1.1, 1.3, 0.9]
    values = iter([{"t": x} for d, r in zip(den, ratios, strict=True) for x in (d, d * r)])
    runs = interleave({"den": lambda: next(values), "num": lambda: next(values)}, 6, rotate=False)
    interval = runs.ratio_interval("num", "den", "t")
    assert interval.n == 6 and interval.median == pytest.approx(runs.ratio("num", "den", "t"))
    assert (interval.lo, interval.hi) == (pytest.approx(0.9), pytest.approx(1.5))
    assert interval.coverage == 1 - 2 / 64


def test_worker_timeout_names_what_it_measured() -> None:
    kwargs = dp_clipping._worker_kwargs(TINY, "phantom", batch=2, device="cpu", threads=1, warmup=1, steps=1)
    with pytest.raises(BenchmarkError, match=r"method 'phantom'.*timed out after 0.3 s") as info:
        run_in_fresh_process(dp_clipping.WORKER_TARGET, kwargs, label="method 'phantom'", timeout=0.3)
    assert info.value.timed_out


def test_failing_worker_is_a_clear_error_and_a_failed_run(
    home: Path, tiny: dp_clipping.Setting, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = {**dp_clipping.METHODS, "phantom": dp_clipping.Method("no_such_clipping", True, 1.0, "broken on purpose")}
    monkeypatch.setattr(dp_clipping, "METHODS", broken)
    expected = r"worker for method 'phantom' failed .*ConfigError: unknown clipping"
    with pytest.raises(BenchmarkError, match=expected):
        run_benchmark("dp-clipping", profile="quick")
    shown = runner.invoke(app, ["results", "list", "--json", "--status", "failed"])
    (row,) = json.loads(shown.stdout)
    assert row["flow"] == "bench" and row["technique"] == "dp-clipping"


def test_unknown_benchmark_profile_and_option_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="known: dp-clipping"):
        run_benchmark("no-such-bench")
    with pytest.raises(ConfigError, match="known: quick, paper"):
        run_benchmark("dp-clipping", profile="huge")
    with pytest.raises(ConfigError, match="no option"):
        run_benchmark("dp-clipping", colour="red")
    with pytest.raises(ConfigError, match="only in the paper profile"):
        run_benchmark("dp-clipping", profile="quick", max_batch_mem_mb=1024)
    assert "dp-clipping" in BENCHMARKS and BENCHMARKS["dp-clipping"].description
    listed = runner.invoke(app, ["bench", "--list"])
    assert listed.exit_code == 0 and "dp-clipping" in listed.stderr
    unknown = runner.invoke(app, ["bench", "nope"])
    assert unknown.exit_code == 2 and "known: dp-clipping" in unknown.stderr


def test_max_batch_search_finds_the_largest_fitting_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []

    def fake_trial(setting: object, method: str, batch: int, *rest: object) -> dict[str, object]:
        tried.append(batch)
        return {"batch": batch, "fits": batch <= 1000, "peak_mem_mb": batch / 10, "step_s": 0.1}

    monkeypatch.setattr(dp_clipping, "_trial", fake_trial)
    setting = dp_clipping.Setting(batch=256)
    best, trials = dp_clipping._search_one(setting, "phantom", 100.0, "cpu", 1, _Quiet())
    assert 950 <= best <= 1000 and tried[:3] == [256, 512, 1024] and len(trials) == len(tried)
    tried.clear()
    best, _ = dp_clipping._search_one(dp_clipping.Setting(batch=4096), "phantom", 100.0, "cpu", 1, _Quiet())
    assert 950 <= best <= 1000 and tried[:4] == [4096, 2048, 1024, 512]
    monkeypatch.setattr(dp_clipping, "_trial", lambda *a: {"batch": a[2], "fits": False})
    assert dp_clipping._search_one(setting, "phantom", 100.0, "cpu", 1, _Quiet())[0] == 0


class _Quiet:
    def print(self, *args: object, **kwargs: object) -> None:
        return None


def test_metric_names_and_units() -> None:
    body = {
        "methods": {"phantom": {"step_s": 0.5, "peak_mem_mb": 3, "tied": True, "samples": [1, 2]}},
        "ratios": {"a_over_b": 1.5, "none": None},
        "note": "x",
        "bad@key": {"v": float("nan")},
    }
    assert dict(numeric_leaves(body)) == {
        "methods.phantom.step_s": 0.5,
        "methods.phantom.peak_mem_mb": 3.0,
        "ratios.a_over_b": 1.5,
    }
    assert metric_name("max_batch.x@y") == "max_batch.x_y"
    names = ("methods.p.step_s", "methods.p.peak_mem_mb", "ratios.x", "max_batch.p")
    assert [metric_unit(n) for n in names] == ["s", "MB", "ratio", "sequences"]
    intervals = ("ratio_intervals.x.lo", "ratio_intervals.x.rounds", "settings.s.ratio_intervals.x.hi")
    assert [metric_unit(n) for n in intervals] == ["ratio", "rounds", "ratio"]


def test_setting_intervals_cover_every_time_ratio_from_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_setting`` with scripted workers: each time ratio gets the interval of its per-round ratios."""
    step = {"nonprivate": 1.0, "phantom": 1.2, "opacus_hooks": 2.0, "opacus_ghost_untied": 1.5}
    calls = {name: 0 for name in step}

    def fake_worker(target: str, kwargs: dict, **_: object) -> dict:
        method = kwargs["method"]
        calls[method] += 1
        load = calls[method]  # round r is r times slower for every method: the ratios stay put but for phantom
        jitter = 1.0 + 0.1 * (calls[method] - 3) if method == "phantom" else 1.0
        return {
            "step_s": step[method] * load * jitter, "peak_mem_mb": 100.0, "n_params": 1, "d_model": 16,
            "mem_source": "scripted", "step_samples_s": [step[method] * load * jitter], "phases_s": {},
        }  # fmt: skip

    monkeypatch.setattr(dp_clipping, "run_in_fresh_process", fake_worker)
    setting = replace(TINY, repeats=dp_clipping.ROUNDS)
    out = dp_clipping._run_setting(setting, "cpu", 1, _Quiet())
    assert set(out["ratio_intervals"]) == {k for k in RATIOS if k.endswith("_time")}  # memory: deterministic
    phantom = [1.2 * (1.0 + 0.1 * (r - 2)) for r in range(6)]  # per-round phantom / nonprivate
    interval = out["ratio_intervals"]["phantom_over_nonprivate_time"]
    assert interval["rounds"] == 6 and interval["coverage"] == 1 - 2 / 64
    assert (interval["lo"], interval["hi"]) == (pytest.approx(min(phantom)), pytest.approx(max(phantom)))
    assert out["ratios"]["phantom_over_nonprivate_time"] == pytest.approx(statistics.median(phantom))
    hooks = out["ratio_intervals"]["opacus_hooks_over_phantom_time"]
    assert hooks["lo"] <= out["ratios"]["opacus_hooks_over_phantom_time"] <= hooks["hi"]
    assert out["setting"]["device_name"] == dp_clipping.bench_device_name() != ""


def test_cli_bench_prints_the_contract_json_and_stores_the_run(home: Path, tiny: dp_clipping.Setting) -> None:
    """One real (tiny) run through the CLI: run_benchmark, fresh-process workers, the store."""
    result = runner.invoke(app, ["bench", "dp-clipping", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    top = {"benchmark", "profile", "machine", "started_at", "setting", "methods", "ratios", "run_id"}
    assert top <= set(out)
    assert out["benchmark"] == "dp-clipping" and out["profile"] == "quick"
    assert set(out["methods"]) == METHODS
    for name, method in out["methods"].items():
        assert _positive_finite(method["step_s"]) and _positive_finite(method["peak_mem_mb"]), (name, method)
    assert set(out["ratios"]) == RATIOS
    assert all(_positive_finite(v) for v in out["ratios"].values()), out["ratios"]
    assert SETTING_KEYS <= set(out["setting"])
    assert {k: out["setting"][k] for k in ("items", "seq_len", "batch", "repeats", "threads")} == {
        "items": 2000,
        "seq_len": 16,
        "batch": 8,
        "repeats": 1,
        "threads": 1,
    }
    ghost = out["methods"]["opacus_ghost_untied"]
    assert ghost["d_model"] == 8 and not ghost["tied"] and out["methods"]["phantom"]["d_model"] == 16
    assert len(out["order"]) == len(METHODS) and "max_batch" not in out
    # Claim 4.1 at the bench's shape: Phantom's norms equal a per-sample backward loop (float64)
    assert out["exactness"]["dtype"] == "float64" and out["exactness"]["phantom_norm_max_rel_err"] < 1e-12
    # both settings under settings.<name>; the first repeats the top-level keys
    assert set(out["settings"]) == {"recsys", "large_vocab"}
    assert out["settings"]["recsys"]["ratios"] == out["ratios"]
    large = out["settings"]["large_vocab"]
    assert set(large["methods"]) == set(dp_clipping.LARGE_VOCAB_METHODS) and large["setting"]["items"] == 200
    assert {"ghost_tied_over_phantom_time", "opacus_hooks_over_phantom_time", "phantom_over_nonprivate_time"} <= set(
        large["ratios"]
    )
    assert all(_positive_finite(v) for v in large["ratios"].values()), large["ratios"]
    # where the time goes: the step's phases, and the book-keeping clippers' backward, norms and sums
    layers = large["methods"]["phantom"]["layers_s"]
    assert {"output_grads", "norm_shared_embedding", "weighted_sum_shared_embedding"} <= set(layers)
    assert set(large["methods"]["nonprivate"]["phases_s"]) == {"forward", "backward", "noise_and_optimizer"}
    assert out["machine"]["cpu_model"] and out["machine"]["torch"] and out["machine"]["torch_threads"] == 1
    assert "round 1/1" in result.stderr  # progress goes to stderr

    shown = json.loads(runner.invoke(app, ["results", "show", out["run_id"], "--json"]).stdout)
    metrics = {m["name"]: m for m in shown["metrics"]}
    assert metrics["methods.phantom.step_s"]["value"] == out["methods"]["phantom"]["step_s"]
    assert metrics["methods.phantom.step_s"]["unit"] == "s"
    assert metrics["ratios.phantom_over_nonprivate_mem"]["unit"] == "ratio"
    assert not any(name.startswith("setting.") for name in metrics)
    # one round: the interval of a time ratio says how many rounds it had, and is absent (needs 6)
    assert out["ratio_intervals"]["phantom_over_nonprivate_time"] == {"rounds": 1}
    assert metrics["ratio_intervals.phantom_over_nonprivate_time.rounds"]["value"] == 1.0
    assert metrics["settings.large_vocab.ratio_intervals.ghost_tied_over_phantom_time.rounds"]["unit"] == "rounds"

    # the device, per run, as the claims' metrics source and the clipping_bench view see it
    from storage.claim_rows import _metric_rows
    from storage.views import clipping_bench

    assert out["setting"]["device_name"] == out["machine"]["cpu_model"]  # no GPU here
    wanted = {"config.setting.device_name", "device", "ratio_intervals.phantom_over_nonprivate_time.rounds"}
    rows = _metric_rows(None, "bench", ("dp-clipping",), wanted)
    assert rows["config.setting.device_name"].tolist() == [out["machine"]["cpu_model"]]
    assert rows["device"].tolist()[0].startswith("cpu: ")
    assert rows["ratio_intervals.phantom_over_nonprivate_time.rounds"].tolist() == [1.0]
    assert set(clipping_bench(None)["device"]) == set(rows["device"])


def test_max_batch_ratios_and_the_baseline_refused_before_its_gram_matrices() -> None:
    from privbench.bench import dp_clipping_worker

    ratios = dp_clipping._max_batch_ratios({"nonprivate": 40, "phantom": 36, "opacus_hooks": 30, "ghost_tied": 0})
    assert ratios["phantom_over_ghost_tied_max_batch"] == 36.0  # over 1: a lower bound, and said so
    assert ratios["max_batch_lower_bound"] == ["phantom_over_ghost_tied_max_batch"]
    assert ratios["phantom_over_opacus_hooks_max_batch"] == pytest.approx(1.2)
    assert ratios["phantom_over_nonprivate_max_batch"] == pytest.approx(0.9)
    # M = 50,257, L = 128: the (1, L+M, L+M) Gram matrices alone are 12.7 GB, refused under a 4 GB budget
    with pytest.raises(MemoryError, match="Gram matrices alone need 12"):
        dp_clipping_worker._check_gram_fits(1, 128, 50258, 4096.0)
    dp_clipping_worker._check_gram_fits(2, 8, 201, 4096.0)  # the tiny setting fits


def test_a_bare_cuda_device_gets_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # the max-batch search caps CUDA memory with set_per_process_memory_fraction, which refuses a bare "cuda"
    import torch

    from privbench.bench.dp_clipping_worker import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


def test_the_gpu_is_named_by_a_worker_so_the_bench_process_opens_no_cuda_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[str, dict]] = []

    def fake_worker(target: str, kwargs: dict, **_: object) -> dict:
        asked.append((target, kwargs))
        return {"device_name": "NVIDIA H200"}

    monkeypatch.setattr(dp_clipping, "bench_device", lambda: "cuda")
    monkeypatch.setattr(dp_clipping, "run_in_fresh_process", fake_worker)
    dp_clipping.bench_device_name.cache_clear()
    try:
        assert dp_clipping.bench_device_name() == "NVIDIA H200"
        assert dp_clipping._setting_json(TINY, "cuda", 1)["device_name"] == "NVIDIA H200"
    finally:
        dp_clipping.bench_device_name.cache_clear()
    assert asked == [(dp_clipping.DEVICE_NAME_TARGET, {"device": "cuda"})]  # once: cached


@pytest.mark.gpu
def test_the_gpu_name_worker_names_the_gpu() -> None:
    import torch

    from privbench.bench.dp_clipping_worker import device_name

    assert device_name(device="cuda") == {"device_name": torch.cuda.get_device_name(0)}


@pytest.mark.gpu
def test_a_max_batch_trial_under_a_memory_cap_runs_on_cuda() -> None:
    from privbench.bench.dp_clipping_worker import measure_step

    out = measure_step(
        method="phantom", clipping="phantom", tied=True, d_model=16.0, items=50, seq_len=8, batch=4, n_layers=1,
        n_heads=1, dropout=0.0, warmup=1, steps=1, seed=0, device="cuda", threads=1, fit_trial=True, mem_cap_mb=512.0,
    )  # fmt: skip
    assert out["ok"] is True


def test_a_kernel_profile_step_names_where_the_time_goes_and_leaves_the_timed_phases_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from privbench.bench import dp_clipping_worker
    from privbench.bench.dp_clipping_worker import measure_step

    kwargs: dict[str, Any] = {
        "method": "phantom", "clipping": "phantom", "tied": True, "d_model": 16.0, "items": 50, "seq_len": 8,
        "batch": 4, "n_layers": 1, "n_heads": 1, "dropout": 0.0, "warmup": 1, "steps": 2, "seed": 0,
        "device": "cpu", "threads": 1,
    }  # fmt: skip
    plain = measure_step(**kwargs)
    out = measure_step(**kwargs, kernel_profile=True)
    assert "kernel_profile" not in plain
    profile = out["kernel_profile"]
    assert profile["activity"] == "cpu" and "kernels" not in profile  # kernels are counted on CUDA only
    times = [row["self_ms"] for row in profile["top"]]
    assert times and times == sorted(times, reverse=True) and sum(times) <= profile["self_time_ms"] + 1e-9
    assert any(row["op"].startswith("aten::") for row in profile["top"])  # which aten op leads varies by machine

    # a known answer: a step that is one large matrix product spends its time in that product
    import torch

    a, b = torch.randn(384, 384), torch.randn(384, 384)
    known = dp_clipping_worker._kernel_profile(lambda: torch.mm(a, b), cuda=False)
    assert known["top"][0]["op"] == "aten::mm" and known["top"][0]["calls"] == 1

    # the profiled step is not a timed one: a profiler that ran 50 steps leaves the phases and layer timings (means
    # over the 3 warm-up and timed steps) exactly as without it. A clock that ticks 1 s a reading makes every step
    # read the same, whatever the machine's load: 50 leaked steps would multiply them by 53/3.
    from core.dp import phantom

    ticks = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(dp_clipping_worker, "time", clock)
    monkeypatch.setattr(phantom, "time", clock)

    def fifty_steps(step: Callable[[], None], *, cuda: bool) -> dict[str, Any]:
        for _ in range(50):
            step()
        return {"activity": "stub"}

    unprofiled = measure_step(**kwargs)
    monkeypatch.setattr(dp_clipping_worker, "_kernel_profile", fifty_steps)
    out = measure_step(**kwargs, kernel_profile=True)
    assert out["kernel_profile"] == {"activity": "stub"}
    assert out["phases_s"] == unprofiled["phases_s"] and sum(out["phases_s"].values()) > 0
    assert out["layers_s"] == unprofiled["layers_s"] and sum(out["layers_s"].values()) > 0


@pytest.mark.gpu
def test_a_cuda_kernel_profile_counts_each_kernel_once() -> None:
    import torch

    from privbench.bench.dp_clipping_worker import _kernel_profile

    a = torch.randn(256, 256, device="cuda")
    profile = _kernel_profile(lambda: a @ a, cuda=True)
    assert profile["activity"] == "cuda" and profile["kernels"] >= 1
    assert (
        abs(sum(r["self_ms"] for r in profile["top"]) - profile["self_time_ms"])
        < 1e-6 * max(1.0, profile["self_time_ms"])
        or len(profile["top"]) == 12
    )


def _scripted_worker(calls: list[tuple[str, int, bool]]) -> Callable[..., dict]:
    def worker(target: str, kwargs: dict, **_: object) -> dict:
        calls.append((kwargs["method"], kwargs["batch"], kwargs["fit_trial"]))
        fits = kwargs["batch"] <= 64
        return {
            "ok": fits, "step_s": 1.0, "peak_mem_mb": 1.0 * kwargs["batch"], "n_params": 1, "d_model": 16,
            "mem_source": "scripted", "step_samples_s": [1.0], "phases_s": {}, "error": None if fits else "OOM",
        }  # fmt: skip

    return worker


def test_a_run_can_be_split_by_setting_and_part_so_each_call_fits_a_lent_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--set dp_clipping.settings`` / ``parts``: only the named settings and parts run; the top-level keys (what
    the phantom claims read) are the recsys setting's only where its rounds ran."""
    calls: list[tuple[str, int, bool]] = []
    monkeypatch.setattr(dp_clipping, "run_in_fresh_process", _scripted_worker(calls))
    monkeypatch.setitem(dp_clipping.PROFILES, "paper", replace(TINY, max_batch_mem_mb=100.0, max_batch_limit=256))
    monkeypatch.setitem(dp_clipping.LARGE_VOCAB, "paper", replace(TINY_LARGE_VOCAB, max_batch_mem_mb=100.0))
    monkeypatch.setattr(dp_clipping, "norm_exactness", lambda setting: {"batch": 1, "phantom_norm_max_rel_err": 0.0})

    only_vocab = {"overrides": ("dp_clipping.settings=large_vocab", "dp_clipping.parts=rounds")}
    out = dp_clipping.run("paper", _Quiet(), only_vocab)
    assert set(out) == {"settings", "setting"} and set(out["settings"]) == {"large_vocab"}
    assert out["setting"]["threads"] == dp_clipping.bench_threads() and out["setting"]["device"] == "cpu"
    assert "max_batch" not in out["settings"]["large_vocab"] and not any(fit for _, _, fit in calls)
    assert {m for m, _, _ in calls} == set(dp_clipping.LARGE_VOCAB_METHODS)
    config = dp_clipping._setting_jsons("paper", only_vocab)
    assert config["device_name"] and config["parts"] == ["rounds"] and set(config["settings"]) == {"large_vocab"}

    calls.clear()
    search = {"overrides": ("dp_clipping.settings=recsys", "dp_clipping.parts=search")}
    out = dp_clipping.run("paper", _Quiet(), search)
    assert all(fit for _, _, fit in calls)  # trials only, no timed rounds
    assert out["max_batch"] == {m: 64 for m in TINY.methods} and "exactness" not in out and "methods" not in out
    assert out["ratios"]["phantom_over_nonprivate_max_batch"] == 1.0

    calls.clear()
    out = dp_clipping.run("paper", _Quiet(), {"overrides": ("dp_clipping.settings=recsys",)})
    assert "exactness" in out and "max_batch" in out and set(out["methods"]) == set(TINY.methods)
    # the default is the whole bench, the same key as before the split existed
    whole = dp_clipping._setting_jsons("paper", {})
    assert set(whole["settings"]) == {"recsys", "large_vocab"} and "parts" not in whole


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("dp_clipping.setting=recsys", "the keys are dp_clipping.settings"),
        ("dp_clipping.settings=imagenet", "name one or more of recsys, large_vocab"),
        ("dp_clipping.parts=", "name one or more of rounds, search"),
        ("dp_clipping.max_batch_mem_mb=lots", "give megabytes"),
        ("secure_inference.n_layer=2", "the keys are dp_clipping.settings"),
    ],
)
def test_a_bad_split_is_refused_by_name_before_anything_runs(item: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        dp_clipping._setting_jsons("paper", {"overrides": (item,)})


def test_a_search_only_part_with_the_search_switched_off_is_refused() -> None:
    bad = {"overrides": ("dp_clipping.parts=search", "dp_clipping.max_batch_mem_mb=0")}
    with pytest.raises(ConfigError, match="nothing to run"):
        dp_clipping._setting_jsons("paper", bad)
