"""``dp-clipping``: speed and memory of one DP-SGD step per clipping method (paper Sec. 4.2, Fig. 3).

Setting (paper profile): the ML-1M-shaped SASRec of App. E.2, 3,416 items, sequence length 200,
batch 256, d = 64, 2 blocks, 1 head, dropout 0.2, random item ids (uniform over 1..M, seeded) with
up to L/4 positions of left padding per sequence. The quick profile shrinks length and batch (L=50,
batch 64) and the steps per process so that it runs in a few minutes on 2 cores.

Methods (``METHODS``):

* ``nonprivate``: tied model, plain backward of ``sum_i L_i`` (no clipping, no noise), Adam step;
* ``phantom``: tied model, Phantom Clipping;
* ``opacus_hooks``: tied model, Opacus GradSampleModule (materialised per-sample gradients);
* ``opacus_ghost_untied``: Opacus ghost clipping, which refuses tied parameters, so the untied model
  with the embedding dimension halved (d = 32; the paper's footnote on the no-sharing setting);
* ``ghost_tied`` (large-vocabulary setting only): the paper's own baseline of Fig. 3, Ghost Clipping
  extended to the shared embedding (:mod:`core.dp.ghost_tied`, (B, L+M, L+M) Gram matrices, O(B M^2)).

Settings (``settings.<name>`` in the JSON; the top-level ``setting`` / ``methods`` / ``ratios`` /
``max_batch`` keys are those of the first, ``recsys``):

* ``recsys``: the shape above, methods nonprivate, phantom, opacus_hooks, opacus_ghost_untied;
* ``large_vocab``: a language model's tied vocabulary, M = 50,257 and L = 128 (batch 1 for the timed
  steps, where the baseline's Gram matrices alone take 12.7 GB; quick: M = 4,096, L = 32, batch 2),
  methods nonprivate, phantom, opacus_hooks, ghost_tied; its max-batch search has a stated budget of
  4 GB (``LARGE_VOCAB_CAP_MB``); a ghost_tied trial whose Gram matrices alone exceed the budget is
  refused before allocating them (reported as not fitting). Where ghost_tied fits no sample,
  ``phantom_over_ghost_tied_max_batch`` is Phantom's max batch over 1, a lower bound
  (``max_batch_lower_bound``). Timing runs of ghost_tied are refused when its Gram matrices need more
  than 80 % of the machine's available memory.

Where the time goes: every worker reports ``phases_s`` (forward, clipper backward, noise and optimizer;
seconds per step) and the book-keeping clippers ``layers_s`` (the output-grad backward, then norms and
weighted sums of the shared embedding and of all other layers), under ``settings.<name>.methods``.

One measured step = forward + per-sample loss (``sequence_loss(..., reduction="none")``) +
``clipper.backward`` + Gaussian noise and averaging (``privatize_grads_``, sigma = 1, C = 1; not for
nonprivate) + ``Adam.step`` + ``zero_grad``, timed after ``warmup`` steps; the step time of a process is
the median of its ``steps`` measured steps. On CPU the workers run with passive OpenMP waiting and glibc
malloc settings that keep freed memory for reuse (``CPU_WORKER_ENV``, reported as
``setting.worker_env``): the steady state of a long training run, robust to a busy co-tenant, rather than
the page faults of a young process or spinning threads.

Every (round, method) runs in its own FRESH Python process (``privbench.bench._worker``), so that the
peak memory of a method is not polluted by another method's allocations. Round r runs each method's
process in turn, the order rotated by r (``harness.interleave``). ``step_s`` / ``peak_mem_mb`` are the
medians over rounds; each ratio is computed **per round** (numerator and denominator measured back to
back under the same background load) and the median over rounds is reported, which is more robust to
load drifting during the run than a ratio of medians. Raw per-round samples are in ``samples`` and
``ratio_samples``. Every time ratio also has ``ratio_intervals.<ratio>``: ``rounds``, and ``lo`` / ``hi``, the
distribution-free 95% interval of the median of its per-round ratios (order statistics, the sign-test interval of
:mod:`core.order_stats`; ``coverage`` its exact coverage), which is what a timing verdict judges. Both profiles run
``ROUNDS`` = 6 rounds, the fewest for which that interval exists ([min, max] of the 6 ratios, coverage 1 - 2/64).
Memory ratios have no interval: a method's peak memory is deterministic on a device (one number per run).
The setting names the device that ran the steps (``device``: cpu or cuda; ``device_name``: the GPU's name or
the CPU model), recorded in the run's config (``config.setting.device_name``).

Peak memory (``peak_mem_mb``) is the growth over the state after setup (model, optimizer, clipper,
batch built; before the first step), i.e. what training adds: activations, gradients, per-sample
gradients or norms, Adam state. On CPU: peak RSS during the warm-up and measured steps minus the RSS
after setup. The kernel's RSS high-water mark is reset after setup (``/proc/self/clear_refs``), so the
peak is that of the steps only; where that is not possible the peak is
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (which then also covers setup, an upper bound).
``mem_source`` says which. On CUDA: ``torch.cuda.max_memory_allocated()`` after
``reset_peak_memory_stats()`` minus the memory allocated after setup (``peak_total_mb`` is the
absolute peak).

Paper profile only: the largest batch that fits a memory cap per method (Fig. 3a), ``max_batch.<name>``:
fresh-process trials (one warm-up + one measured step) doubling from the paper batch, then bisecting
to 5 %; a trial fits if it raises no out-of-memory error and (CPU) its peak RSS growth is at most the
cap (default 8192 MB; an address-space limit a bit above the cap guards the machine) or (CUDA) it does
not exceed the cap enforced with ``torch.cuda.set_per_process_memory_fraction`` (default: the whole
device). ``--max-batch-mem-mb 0`` skips the search.

Parts of a run (``--set``, so that a lent GPU measures the paper profile in calls that each fit its time limit;
every fresh process there costs seconds of start-up): ``dp_clipping.settings=recsys`` (or ``large_vocab``, or
both, the default) runs only the named settings; ``dp_clipping.parts=rounds`` (or ``search``, or both, the
default) runs only the timed rounds or only the max-batch search; ``dp_clipping.max_batch_mem_mb=MB`` is
``--max-batch-mem-mb``. The exactness check runs with the recsys setting's rounds. The top-level keys are the
recsys setting's only where it ran.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from core.errors import ConfigError
from core.order_stats import MedianInterval
from privbench.bench.dp_exactness import norm_exactness
from privbench.bench.harness import (
    BenchmarkError,
    Progress,
    bench_threads,
    cpu_model,
    interleave,
    register,
    run_in_fresh_process,
)
from privbench.bench.max_batch import largest_fitting

NAME = "dp-clipping"
WORKER_TARGET = "privbench.bench.dp_clipping_worker:measure_step"
DEVICE_NAME_TARGET = "privbench.bench.dp_clipping_worker:device_name"
CPU_DEFAULT_CAP_MB = 8192.0
BISECT_TOLERANCE = 0.05

# rounds of every profile and setting: the fewest with a distribution-free 95% interval of the median of the
# per-round ratios (core.order_stats: with 6 rounds [min, max] holds the median with probability 1 - 2/64)
ROUNDS = 6


@dataclass(frozen=True)
class Setting:
    """What one ``dp-clipping`` run measures (``PROFILES`` holds one per profile)."""

    items: int = 3416
    seq_len: int = 200
    batch: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 1
    dropout: float = 0.2
    repeats: int = ROUNDS  # rounds; each round runs every method once, each in a fresh process
    warmup: int = 2  # steps before timing, per process
    steps: int = 3  # timed steps per process (their median is the process' step time)
    seed: int = 0
    timeout_s: float = 600.0  # per worker process
    max_batch_mem_mb: float | None = 0.0  # 0: no max-batch search; None: default cap (CPU 8 GB, GPU all)
    max_batch_limit: int = 16384  # the search never tries beyond this batch
    cpu_worker_env: bool = True  # CPU workers run with CPU_WORKER_ENV (see the module docstring)
    name: str = "recsys"
    methods: tuple[str, ...] = ("nonprivate", "phantom", "opacus_hooks", "opacus_ghost_untied")
    max_batch_start: int | None = None  # first batch the max-batch search tries (None: ``batch``)
    kernel_profile: bool = False  # each method's first process profiles one extra step (``kernel_profile``)


PROFILES: dict[str, Setting] = {
    "quick": Setting(seq_len=50, batch=64, repeats=ROUNDS, warmup=1, steps=3, timeout_s=300.0),
    "paper": Setting(repeats=ROUNDS, warmup=2, steps=3, timeout_s=900.0, max_batch_mem_mb=None, kernel_profile=True),
}

LARGE_VOCAB_METHODS = ("nonprivate", "phantom", "opacus_hooks", "ghost_tied")
LARGE_VOCAB_CAP_MB = 4096.0
LARGE_VOCAB: dict[str, Setting] = {
    "quick": Setting(
        name="large_vocab", items=4096, seq_len=32, batch=2, repeats=ROUNDS, warmup=1, steps=2, timeout_s=300.0,
        methods=LARGE_VOCAB_METHODS,
    ),
    "paper": Setting(
        name="large_vocab", items=50257, seq_len=128, batch=1, repeats=ROUNDS, warmup=1, steps=2, timeout_s=900.0,
        methods=LARGE_VOCAB_METHODS, max_batch_mem_mb=LARGE_VOCAB_CAP_MB, max_batch_start=8, kernel_profile=True,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Method:
    clipping: str  # core.dp.clipping.ClippingMethod value
    tied: bool
    d_model_factor: float  # the model's d_model = setting.d_model * factor
    description: str


METHODS: dict[str, Method] = {
    "nonprivate": Method("nonprivate", True, 1.0, "tied model, plain backward, no clipping or noise"),
    "phantom": Method("phantom", True, 1.0, "tied model, Phantom Clipping"),
    "opacus_hooks": Method("opacus_hooks", True, 1.0, "tied model, Opacus per-sample gradients (hooks)"),
    "opacus_ghost_untied": Method(
        "opacus_ghost", False, 0.5, "untied model, d_model halved, Opacus ghost clipping (refuses tying)"
    ),
    "ghost_tied": Method(
        "ghost_tied", True, 1.0, "tied model, Ghost Clipping extended to the shared embedding (paper baseline)"
    ),
}

# Environment of CPU workers (``Setting.cpu_worker_env``), for steady-state numbers on shared machines:
# * OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning; with a busy co-tenant on a
#   2-core machine, spinning threads made a step 5-10x slower and the timings erratic (measured);
# * glibc malloc keeps freed memory for reuse (allocations up to 32 MB come from the heap, which is never
#   trimmed) instead of returning it to the kernel, so that a step does not pay page faults on every
#   large temporary: without it a young process on a VM spent up to 10x the compute time in page faults
#   for several steps, penalising the methods with more temporaries.
CPU_WORKER_ENV: dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_TOP_PAD_": str(2**28),
}

# ratio name -> (numerator method, denominator method, measured field)
RATIOS: dict[str, tuple[str, str, str]] = {
    "phantom_over_nonprivate_time": ("phantom", "nonprivate", "step_s"),
    "phantom_over_nonprivate_mem": ("phantom", "nonprivate", "peak_mem_mb"),
    "opacus_hooks_over_phantom_time": ("opacus_hooks", "phantom", "step_s"),
    "opacus_ghost_untied_over_phantom_time": ("opacus_ghost_untied", "phantom", "step_s"),
    "ghost_tied_over_phantom_time": ("ghost_tied", "phantom", "step_s"),
    "ghost_tied_over_phantom_mem": ("ghost_tied", "phantom", "peak_mem_mb"),
    "opacus_hooks_over_phantom_mem": ("opacus_hooks", "phantom", "peak_mem_mb"),
}


@functools.cache
def bench_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def bench_device_name() -> str:
    """What runs the steps: the GPU's name (``NVIDIA H200``) on ``cuda``, else the CPU model; recorded as the
    setting's ``device_name``, so that a claim can judge each device's runs apart (``config.setting.device_name``).
    The GPU is named by a fresh worker process, so that this process opens no CUDA context (it would hold device
    memory through the max-batch search)."""
    if bench_device() != "cuda":
        return cpu_model()
    out = run_in_fresh_process(DEVICE_NAME_TARGET, {"device": "cuda"}, label="the GPU's name", timeout=300.0)
    return str(out["device_name"])


SETTING_NAMES = ("recsys", "large_vocab")
PARTS = ("rounds", "search")
OVERRIDE_KEYS = ("settings", "parts", "max_batch_mem_mb")


def _names(key: str, value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise ConfigError(
            f"--set dp_clipping.{key}={value!r}: name one or more of {', '.join(known)} (comma-separated), "
            f"e.g. dp_clipping.{key}={known[0]}"
        )
    return tuple(n for n in known if n in names)


def parse_overrides(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options["overrides"]`` (``--set dp_clipping.KEY=VALUE``) as ``{"settings", "parts",
    "max_batch_mem_mb"}`` (only those given); ConfigError naming a bad item and the keys it may use."""
    out: dict[str, Any] = {}
    for item in options.get("overrides") or ():
        key, sep, value = str(item).partition("=")
        section, _, name = key.strip().partition(".")
        if not sep or section != "dp_clipping" or name not in OVERRIDE_KEYS:
            raise ConfigError(
                f"dp-clipping --set {item!r}: the keys are dp_clipping.{', dp_clipping.'.join(OVERRIDE_KEYS)}, "
                "e.g. --set dp_clipping.settings=recsys --set dp_clipping.parts=rounds"
            )
        value = value.strip()
        if name == "settings":
            out[name] = _names(name, value, SETTING_NAMES)
        elif name == "parts":
            out[name] = _names(name, value, PARTS)
        else:
            try:
                out[name] = float(value)
            except ValueError:
                raise ConfigError(
                    f"--set dp_clipping.max_batch_mem_mb={value!r}: give megabytes (a number >= 0; 0 = no search)"
                ) from None
    return out


def _cap_option(options: Mapping[str, Any]) -> Any:
    """The max-batch cap asked for: ``--set dp_clipping.max_batch_mem_mb`` over ``--max-batch-mem-mb``."""
    return parse_overrides(options).get("max_batch_mem_mb", options.get("max_batch_mem_mb"))


def resolve_setting(profile: str, options: Mapping[str, Any]) -> Setting:
    """The profile's setting with the CLI options applied (``max_batch_mem_mb``)."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    setting = PROFILES[profile]
    cap = _cap_option(options)
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap) or cap < 0:
            raise ConfigError(f"max_batch_mem_mb must be a number >= 0 (0 = no search), got {cap!r}")
        if cap > 0 and profile != "paper":
            raise ConfigError(
                "the max-batch search (--max-batch-mem-mb) runs only in the paper profile; add --profile paper"
            )
        setting = replace(setting, max_batch_mem_mb=float(cap))
    return setting


def _setting_json(setting: Setting, device: str, threads: int) -> dict[str, Any]:
    out = asdict(setting)
    if out["max_batch_mem_mb"] is None:
        out["max_batch_mem_mb"] = CPU_DEFAULT_CAP_MB if device == "cpu" else "device"
    out["worker_env"] = _worker_env(setting, device)
    out.update(
        device=device,
        device_name=bench_device_name(),
        threads=threads,
        methods={name: asdict(METHODS[name]) for name in setting.methods},
        noise_multiplier=1.0,
        clip_norm=1.0,
        optimizer="Adam(lr=1e-3)",
    )
    return out


def _worker_env(setting: Setting, device: str) -> dict[str, str]:
    return dict(CPU_WORKER_ENV) if setting.cpu_worker_env and device == "cpu" else {}


def _worker_kwargs(
    setting: Setting,
    method: str,
    *,
    batch: int,
    device: str,
    threads: int,
    warmup: int,
    steps: int,
    fit_trial: bool = False,
    mem_cap_mb: float | None = None,
    kernel_profile: bool = False,
) -> dict[str, Any]:
    m = METHODS[method]
    return {
        "method": method,
        "clipping": m.clipping,
        "tied": m.tied,
        "d_model": max(int(m.d_model_factor * setting.d_model), 1),
        "items": setting.items,
        "seq_len": setting.seq_len,
        "batch": batch,
        "n_layers": setting.n_layers,
        "n_heads": setting.n_heads,
        "dropout": setting.dropout,
        "warmup": warmup,
        "steps": steps,
        "seed": setting.seed,
        "device": device,
        "threads": threads,
        "fit_trial": fit_trial,
        "mem_cap_mb": mem_cap_mb,
        "kernel_profile": kernel_profile,
    }


def _run_worker(
    setting: Setting, method: str, label: str, *, device: str, threads: int, **options: Any
) -> dict[str, Any]:
    """One fresh worker process measuring ``method`` (``options``: the rest of :func:`_worker_kwargs`), killed after
    the setting's timeout; ``label`` names it in errors."""
    return run_in_fresh_process(
        WORKER_TARGET,
        _worker_kwargs(setting, method, device=device, threads=threads, **options),
        label=label,
        timeout=setting.timeout_s,
        threads=threads,
        extra_env=_worker_env(setting, device),
    )


def resolve_settings(profile: str, options: Mapping[str, Any]) -> list[Setting]:
    """Every setting the profile measures: ``recsys`` (``PROFILES``), then ``large_vocab`` (``LARGE_VOCAB``).

    A ``max_batch_mem_mb`` option of 0 skips both max-batch searches; a positive one is the budget of both."""
    primary = resolve_setting(profile, options)
    second = LARGE_VOCAB[profile]
    cap = _cap_option(options)
    if cap is not None:
        second = replace(second, max_batch_mem_mb=float(cap))
    chosen = parse_overrides(options).get("settings", SETTING_NAMES)
    return [s for s in (primary, second) if s.name in chosen]


def resolve_parts(options: Mapping[str, Any]) -> tuple[str, ...]:
    """``rounds``, ``search`` or both (``--set dp_clipping.parts``; :func:`_setting_jsons` refuses a search-only run
    whose search is switched off)."""
    return parse_overrides(options).get("parts", PARTS)


def _setting_jsons(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    device, threads = bench_device(), bench_threads()
    chosen = resolve_settings(profile, options)
    parts = resolve_parts(options)
    if parts == ("search",) and not any(s.max_batch_mem_mb != 0 for s in chosen):
        raise ConfigError("dp_clipping.parts=search with no max-batch search (max_batch_mem_mb 0): nothing to run")
    if chosen[0].name == SETTING_NAMES[0]:
        out = _setting_json(chosen[0], device, threads)
    else:
        out = {"device": device, "device_name": bench_device_name(), "threads": threads}
    out["settings"] = {s.name: _setting_json(s, device, threads) for s in chosen}
    if parts != PARTS:
        out["parts"] = list(parts)
    return out


@register(
    NAME,
    "one DP-SGD step per clipping method (nonprivate, phantom, opacus hooks, opacus ghost untied; the "
    "paper's ghost-clipping baseline at a large vocabulary): time and peak memory, fresh process each, "
    "interleaved rounds (paper Fig. 3)",
    options=("max_batch_mem_mb", "overrides"),
    setting=_setting_jsons,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    device, threads = bench_device(), bench_threads()
    parts = resolve_parts(options)
    result: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for setting in resolve_settings(profile, options):
        settings[setting.name] = _run_setting(setting, device, threads, progress, parts=parts)
        if setting.name == SETTING_NAMES[0]:  # the top-level keys: the recsys setting's
            result.update(settings[setting.name])
            if "rounds" in parts:
                result["exactness"] = norm_exactness(setting)  # privbench.bench.dp_exactness
                progress.print(
                    "  exactness: Phantom per-sample norms vs a per-sample backward loop (float64, batch "
                    f"{result['exactness']['batch']}): max relative error "
                    f"{result['exactness']['phantom_norm_max_rel_err']:.1e}"
                )
    result["settings"] = settings
    # without the recsys setting: the device and threads at the top all the same (the run's machine and tags)
    result.setdefault("setting", {"device": device, "device_name": bench_device_name(), "threads": threads})
    return result


def _run_setting(
    setting: Setting, device: str, threads: int, progress: Progress, *, parts: tuple[str, ...] = PARTS
) -> dict[str, Any]:
    """One setting: interleaved rounds of its methods and their ratios, and (if asked) the max-batch search;
    ``parts`` drops one of the two (``rounds``, ``search``)."""
    if "rounds" not in parts:
        result: dict[str, Any] = {"setting": _setting_json(setting, device, threads), "ratios": {}}
        if setting.max_batch_mem_mb != 0:
            result.update(_max_batch_search(setting, device, threads, progress))
            result["ratios"].update(_max_batch_ratios(result["max_batch"]))
        return result
    names = list(setting.methods)
    progress.print(
        f"[bold]{NAME}[/] {setting.name}: items={setting.items} L={setting.seq_len} "
        f"batch={setting.batch} d={setting.d_model} on {device}, {threads} threads, "
        f"{setting.repeats} rounds x {len(names)} fresh processes"
    )

    profiled: set[str] = set()  # kernel_profile: each method's first process only

    def measure(method: str) -> dict[str, Any]:
        profile = setting.kernel_profile and method not in profiled
        profiled.add(method)
        return _run_worker(
            setting,
            method,
            f"method {method!r}",
            device=device,
            threads=threads,
            batch=setting.batch,
            warmup=setting.warmup,
            steps=setting.steps,
            kernel_profile=profile,
        )

    def report(r: int, method: str, out: dict[str, Any]) -> None:
        progress.print(
            f"  round {r + 1}/{setting.repeats} {method:<20} step {out['step_s'] * 1e3:9.1f} ms"
            f"   peak +{out['peak_mem_mb']:8.1f} MB"
        )

    runs = interleave({m: functools.partial(measure, m) for m in names}, setting.repeats, rotate=True, on_sample=report)
    methods: dict[str, Any] = {}
    for name in names:
        spec, first = METHODS[name], runs.rounds[0][name]
        methods[name] = {
            "step_s": runs.median(name, "step_s"),
            "peak_mem_mb": runs.median(name, "peak_mem_mb"),
            "n_params": first["n_params"],
            "d_model": first["d_model"],
            "tied": spec.tied,
            "clipping": spec.clipping,
            "mem_source": first["mem_source"],
            "phases_s": _median_dict([r[name].get("phases_s", {}) for r in runs.rounds]),
            "samples": {
                "step_s": runs.samples(name, "step_s"),
                "peak_mem_mb": runs.samples(name, "peak_mem_mb"),
                "step_s_within_process": [r[name]["step_samples_s"] for r in runs.rounds],
            },
        }
        if "layers_s" in first:
            methods[name]["layers_s"] = _median_dict([r[name]["layers_s"] for r in runs.rounds])
        profiles = [r[name]["kernel_profile"] for r in runs.rounds if "kernel_profile" in r[name]]
        if profiles:
            methods[name]["kernel_profile"] = profiles[0]
    ratios_spec = {key: spec for key, spec in RATIOS.items() if spec[0] in names and spec[1] in names}
    intervals = {key: runs.ratio_interval(*spec) for key, spec in ratios_spec.items() if spec[2] == "step_s"}
    result: dict[str, Any] = {
        "setting": _setting_json(setting, device, threads),
        "methods": methods,
        "ratios": {key: runs.ratio(*spec) for key, spec in ratios_spec.items()},
        "ratio_intervals": {key: _interval_json(iv) for key, iv in intervals.items() if iv is not None},
        "ratio_samples": {key: runs.ratio_samples(*spec) for key, spec in ratios_spec.items()},
        "order": runs.order,
        "notes": (
            "step_s and peak_mem_mb: medians over rounds (one fresh process per method and round); "
            "ratios: median over rounds of the per-round ratio (methods of a round run back to back, "
            "order rotated each round); ratio_intervals (time ratios): the distribution-free 95% interval of that "
            "median from the order statistics of the per-round ratios (sign test; lo/hi absent below 6 rounds), "
            "rounds: the rounds it is over, coverage: its exact coverage; peak_mem_mb: growth over the state after "
            "model/data setup; phases_s / layers_s: seconds per step (median over rounds) of the step's phases and "
            "of the book-keeping clippers' output-grad backward, norms and weighted sums; kernel_profile: one extra "
            "step of the method's first process under torch.profiler (top ops by self device time; kernels launched on "
            "CUDA), after its timed steps"
        ),
    }
    if setting.max_batch_mem_mb != 0 and "search" in parts:
        result.update(_max_batch_search(setting, device, threads, progress))
        result["ratios"].update(_max_batch_ratios(result["max_batch"]))
    return result


def _interval_json(interval: MedianInterval) -> dict[str, Any]:
    """``{"rounds", "lo", "hi", "coverage"}`` of a per-round ratio's median (lo/hi/coverage only where they exist)."""
    out: dict[str, Any] = {"rounds": interval.n}
    if interval.lo is not None:
        out.update(lo=interval.lo, hi=interval.hi, coverage=interval.coverage)
    return out


def _median_dict(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: statistics.median(d[k] for d in dicts if k in d) for k in keys}


def _max_batch_ratios(best: dict[str, int]) -> dict[str, Any]:
    """Phantom's max batch over each other method's (Fig. 3a); over 1, a lower bound, where that fits none."""
    out: dict[str, Any] = {}
    bounds = []
    for other in ("ghost_tied", "opacus_hooks", "nonprivate"):
        if other in best and "phantom" in best:
            out[f"phantom_over_{other}_max_batch"] = best["phantom"] / max(best[other], 1)
            if best[other] == 0:
                bounds.append(f"phantom_over_{other}_max_batch")
    if bounds:
        out["max_batch_lower_bound"] = bounds
    return out


# ------------------------------------------------------------------------------------------ max batch


def _max_batch_search(setting: Setting, device: str, threads: int, progress: Progress) -> dict[str, Any]:
    cap = setting.max_batch_mem_mb
    if cap is None:
        cap = CPU_DEFAULT_CAP_MB if device == "cpu" else None  # None on CUDA: the whole device
    progress.print(
        f"[bold]max batch[/] ({setting.name}) under {f'{cap:.0f} MB' if cap else 'the device memory'} per "
        "method (fresh process per trial)"
    )
    best: dict[str, int] = {}
    trials: dict[str, list[dict[str, Any]]] = {}
    for method in setting.methods:
        best[method], trials[method] = _search_one(setting, method, cap, device, threads, progress)
    return {"max_batch": best, "max_batch_trials": trials, "max_batch_cap_mb": cap if cap is not None else "device"}


def _trial(setting: Setting, method: str, batch: int, cap: float | None, device: str, threads: int) -> dict[str, Any]:
    try:
        out = _run_worker(
            setting,
            method,
            f"method {method!r} (batch {batch})",
            device=device,
            threads=threads,
            batch=batch,
            warmup=1,
            steps=1,
            fit_trial=True,
            mem_cap_mb=cap,
        )
    except BenchmarkError as exc:
        if exc.timed_out or (exc.returncode is not None and exc.returncode < 0):
            return {"batch": batch, "fits": False, "error": str(exc).splitlines()[0]}
        raise
    fits = bool(out.get("ok")) and (cap is None or device != "cpu" or out["peak_mem_mb"] <= cap)
    trial = {"batch": batch, "fits": fits}
    if out.get("ok"):
        trial.update(peak_mem_mb=out["peak_mem_mb"], step_s=out["step_s"])
    else:
        trial["error"] = out.get("error")
    return trial


def _search_one(
    setting: Setting, method: str, cap: float | None, device: str, threads: int, progress: Progress
) -> tuple[int, list[dict[str, Any]]]:
    trials: list[dict[str, Any]] = []

    def fits(batch: int) -> bool:
        trial = _trial(setting, method, batch, cap, device, threads)
        trials.append(trial)
        mem = f"peak +{trial['peak_mem_mb']:.0f} MB" if "peak_mem_mb" in trial else trial.get("error", "")
        verdict = "fits" if trial["fits"] else "does not fit"
        progress.print(f"  {method:<20} batch {batch:6d}: {verdict} ({mem})")
        return trial["fits"]

    start = setting.max_batch_start or setting.batch
    best = largest_fitting(fits, start=start, limit=setting.max_batch_limit, tolerance=BISECT_TOLERANCE)
    return best, trials
