"""``dp-clipping``: speed and memory of one DP-SGD step per clipping method (paper Sec. 4.2, Fig. 3).

Setting (paper profile): the ML-1M-shaped SASRec of App. E.2, 3,416 items, sequence length 200,
batch 256, d = 64, 2 blocks, 1 head, dropout 0.2, random item ids (uniform over 1..M, seeded) with
up to L/4 positions of left padding per sequence. The quick profile shrinks length and batch (L=50,
batch 64) and the repeats so that it runs in about a minute on 2 cores.

Methods (``METHODS``):

* ``nonprivate``: tied model, plain backward of ``sum_i L_i`` (no clipping, no noise), Adam step;
* ``phantom``: tied model, Phantom Clipping;
* ``opacus_hooks``: tied model, Opacus GradSampleModule (materialised per-sample gradients);
* ``opacus_ghost_untied``: Opacus ghost clipping, which refuses tied parameters, so the untied model
  with the embedding dimension halved (d = 32; the paper's footnote on the no-sharing setting).

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
``ratio_samples``.

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
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from core.errors import ConfigError
from privbench.bench.dp_exactness import norm_exactness
from privbench.bench.harness import (
    BenchmarkError,
    Progress,
    bench_threads,
    interleave,
    register,
    run_in_fresh_process,
)

NAME = "dp-clipping"
WORKER_TARGET = "privbench.bench.dp_clipping:measure_step"
CPU_DEFAULT_CAP_MB = 8192.0
BISECT_TOLERANCE = 0.05


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
    repeats: int = 3  # rounds; each round runs every method once, each in a fresh process
    warmup: int = 2  # steps before timing, per process
    steps: int = 3  # timed steps per process (their median is the process' step time)
    seed: int = 0
    timeout_s: float = 600.0  # per worker process
    max_batch_mem_mb: float | None = 0.0  # 0: no max-batch search; None: default cap (CPU 8 GB, GPU all)
    max_batch_limit: int = 16384  # the search never tries beyond this batch
    cpu_worker_env: bool = True  # CPU workers run with CPU_WORKER_ENV (see the module docstring)


PROFILES: dict[str, Setting] = {
    "quick": Setting(seq_len=50, batch=64, repeats=3, warmup=1, steps=3, timeout_s=300.0),
    "paper": Setting(repeats=3, warmup=2, steps=3, timeout_s=900.0, max_batch_mem_mb=None),
}


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
}


@functools.cache
def bench_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_setting(profile: str, options: Mapping[str, Any]) -> Setting:
    """The profile's setting with the CLI options applied (``max_batch_mem_mb``)."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r} for {NAME}; known: {', '.join(PROFILES)}")
    setting = PROFILES[profile]
    cap = options.get("max_batch_mem_mb")
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
        threads=threads,
        methods={name: asdict(m) for name, m in METHODS.items()},
        noise_multiplier=1.0,
        clip_norm=1.0,
        optimizer="Adam(lr=1e-3)",
    )
    return out


def _worker_env(setting: Setting, device: str) -> dict[str, str]:
    return dict(CPU_WORKER_ENV) if setting.cpu_worker_env and device == "cpu" else {}


def _config(profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    return _setting_json(resolve_setting(profile, options), bench_device(), bench_threads())


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
    }


@register(
    NAME,
    "one DP-SGD step per clipping method (nonprivate, phantom, opacus hooks, opacus ghost "
    "untied): time and peak memory, fresh process each, interleaved rounds (paper Fig. 3)",
    options=("max_batch_mem_mb",),
    setting=_config,
)
def run(profile: str, progress: Progress, options: Mapping[str, Any]) -> dict[str, Any]:
    setting = resolve_setting(profile, options)
    device, threads = bench_device(), bench_threads()
    progress.print(
        f"[bold]{NAME}[/] ({profile}): items={setting.items} L={setting.seq_len} "
        f"batch={setting.batch} d={setting.d_model} on {device}, {threads} threads, "
        f"{setting.repeats} rounds x {len(METHODS)} fresh processes"
    )

    def measure(method: str) -> dict[str, Any]:
        kwargs = _worker_kwargs(
            setting,
            method,
            batch=setting.batch,
            device=device,
            threads=threads,
            warmup=setting.warmup,
            steps=setting.steps,
        )
        return run_in_fresh_process(
            WORKER_TARGET,
            kwargs,
            label=f"method {method!r}",
            timeout=setting.timeout_s,
            threads=threads,
            extra_env=_worker_env(setting, device),
        )

    def report(r: int, method: str, out: dict[str, Any]) -> None:
        progress.print(
            f"  round {r + 1}/{setting.repeats} {method:<20} step {out['step_s'] * 1e3:9.1f} ms"
            f"   peak +{out['peak_mem_mb']:8.1f} MB"
        )

    runs = interleave(
        {m: functools.partial(measure, m) for m in METHODS}, setting.repeats, rotate=True, on_sample=report
    )
    methods: dict[str, Any] = {}
    for name, spec in METHODS.items():
        first = runs.rounds[0][name]
        methods[name] = {
            "step_s": runs.median(name, "step_s"),
            "peak_mem_mb": runs.median(name, "peak_mem_mb"),
            "n_params": first["n_params"],
            "d_model": first["d_model"],
            "tied": spec.tied,
            "clipping": spec.clipping,
            "mem_source": first["mem_source"],
            "samples": {
                "step_s": runs.samples(name, "step_s"),
                "peak_mem_mb": runs.samples(name, "peak_mem_mb"),
                "step_s_within_process": [r[name]["step_samples_s"] for r in runs.rounds],
            },
        }
    ratios = {key: runs.ratio(*spec) for key, spec in RATIOS.items()}
    result: dict[str, Any] = {
        "setting": _setting_json(setting, device, threads),
        "methods": methods,
        "ratios": ratios,
        "ratio_samples": {key: runs.ratio_samples(*spec) for key, spec in RATIOS.items()},
        "order": runs.order,
        "notes": (
            "step_s and peak_mem_mb: medians over rounds (one fresh process per method and round); "
            "ratios: median over rounds of the per-round ratio (methods of a round run back to back, "
            "order rotated each round); peak_mem_mb: growth over the state after model/data setup"
        ),
    }
    result["exactness"] = norm_exactness(setting)  # privbench.bench.dp_exactness
    progress.print(
        f"  exactness: Phantom per-sample norms vs a per-sample backward loop (float64, batch "
        f"{result['exactness']['batch']}): max relative error {result['exactness']['phantom_norm_max_rel_err']:.1e}"
    )
    if setting.max_batch_mem_mb != 0:
        result.update(_max_batch_search(setting, device, threads, progress))
    return result


# ------------------------------------------------------------------------------------------ max batch


def _max_batch_search(setting: Setting, device: str, threads: int, progress: Progress) -> dict[str, Any]:
    cap = setting.max_batch_mem_mb
    if cap is None:
        cap = CPU_DEFAULT_CAP_MB if device == "cpu" else None  # None on CUDA: the whole device
    progress.print(
        f"[bold]max batch[/] under {f'{cap:.0f} MB' if cap else 'the device memory'} per method "
        f"(fresh process per trial)"
    )
    best: dict[str, int] = {}
    trials: dict[str, list[dict[str, Any]]] = {}
    for method in METHODS:
        best[method], trials[method] = _search_one(setting, method, cap, device, threads, progress)
    return {"max_batch": best, "max_batch_trials": trials, "max_batch_cap_mb": cap if cap is not None else "device"}


def _trial(setting: Setting, method: str, batch: int, cap: float | None, device: str, threads: int) -> dict[str, Any]:
    kwargs = _worker_kwargs(
        setting, method, batch=batch, device=device, threads=threads, warmup=1, steps=1, fit_trial=True, mem_cap_mb=cap
    )
    try:
        out = run_in_fresh_process(
            WORKER_TARGET,
            kwargs,
            label=f"method {method!r} (batch {batch})",
            timeout=setting.timeout_s,
            threads=threads,
            extra_env=_worker_env(setting, device),
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

    limit = setting.max_batch_limit
    lo, hi = 0, None
    batch = min(setting.batch, limit)
    if fits(batch):
        lo = batch
        while hi is None and lo < limit:
            batch = min(lo * 2, limit)
            if fits(batch):
                lo = batch
            else:
                hi = batch
        if hi is None:
            return lo, trials  # fits at the limit
    else:
        hi = batch
        while lo == 0 and hi > 1:
            batch = hi // 2
            if fits(batch):
                lo = batch
            else:
                hi = batch
        if lo == 0:
            return 0, trials
    while hi - lo > max(1, int(lo * BISECT_TOLERANCE)):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


# ------------------------------------------------------------------------------------------ worker side


def _status_mb(field: str) -> float | None:
    """A ``/proc/self/status`` field (VmRSS, VmHWM, VmSize) in MB, None where unavailable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _status_mb("VmHWM") is not None


def _maxrss_mb() -> float:
    import resource
    import sys

    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value / (1024 * 1024) if sys.platform == "darwin" else value / 1024  # bytes on macOS, KiB on Linux


def _random_batch(items: int, seq_len: int, batch: int, seed: int) -> tuple[Any, Any]:
    """Left-padded random sequences: inputs (B, L) and next-item targets (B, L), 0 = padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, items + 1, (batch, seq_len + 1), generator=g)
    pad = torch.randint(0, seq_len // 4 + 1, (batch,), generator=g)  # leading padding per sequence
    seq[torch.arange(seq_len + 1) < pad[:, None]] = 0
    inputs, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    targets[inputs == 0] = 0  # no target predicted from a padding position
    return inputs, targets


def measure_step(
    *,
    method: str,
    clipping: str,
    tied: bool,
    d_model: float,
    items: int,
    seq_len: int,
    batch: int,
    n_layers: int,
    n_heads: int,
    dropout: float,
    warmup: int,
    steps: int,
    seed: int,
    device: str,
    threads: int,
    fit_trial: bool = False,
    mem_cap_mb: float | None = None,
) -> dict[str, Any]:
    """Worker side: time ``steps`` DP-SGD steps of one method after ``warmup``; peak memory growth.

    ``fit_trial`` (max-batch search): an out-of-memory error is reported as ``ok: False`` instead of
    raised, and ``mem_cap_mb`` is enforced: on CPU by an address-space limit of about 1.5 x cap above the
    current size (guards the machine; the caller compares the peak RSS growth with the cap), on CUDA by
    the caching allocator (``set_per_process_memory_fraction``; None = the whole device).
    """
    import torch

    from core.dp.clipping import make_clipper
    from core.dp.noise import privatize_grads_
    from core.models import SeqRecConfig, build_seqrec, sequence_loss

    t_setup = time.perf_counter()
    torch.set_num_threads(int(threads))
    torch.manual_seed(seed)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = SeqRecConfig(
        num_items=items,
        max_len=seq_len,
        d_model=int(d_model),
        n_heads=n_heads,
        n_layers=n_layers,
        dropout=dropout,
        tied=tied,
    )
    model = build_seqrec(cfg).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    clipper = make_clipper(clipping, model, clip_norm=1.0, normalize=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    inputs, targets = (t.to(dev) for t in _random_batch(items, seq_len, batch, seed))
    generator = torch.Generator(device=dev).manual_seed(seed + 1)
    private = clipping != "nonprivate"

    def step() -> None:
        logits = clipper.model(inputs)
        loss = sequence_loss(logits, targets, reduction="none")  # (B,)
        del logits
        clipper.backward(loss)
        if private:
            privatize_grads_(
                params, noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=batch, generator=generator
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    sync()
    setup_s = time.perf_counter() - t_setup
    if cuda:
        if fit_trial and mem_cap_mb is not None:
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, mem_cap_mb * 2**20 / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
        baseline = torch.cuda.memory_allocated(dev) / 2**20
        mem_source = "cuda max_memory_allocated - allocated after setup"
    else:
        baseline = _status_mb("VmRSS") or _maxrss_mb()
        if _reset_peak_rss():
            mem_source = "VmHWM (reset after setup) - VmRSS after setup"
        else:
            mem_source = "ru_maxrss - RSS after setup (high-water mark not resettable: includes setup)"
        if fit_trial and mem_cap_mb is not None:
            import resource

            size = _status_mb("VmSize") or 0.0
            limit = int((size + 1.5 * mem_cap_mb + 2048) * 2**20)
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            if hard == resource.RLIM_INFINITY or limit < hard:
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))

    times: list[float] = []
    error: str | None = None
    try:
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        oom = isinstance(exc, torch.OutOfMemoryError | MemoryError) or "memory" in str(exc).lower()
        if not fit_trial or not oom:
            raise
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"

    if cuda:
        peak_total = torch.cuda.max_memory_allocated(dev) / 2**20
        peak = peak_total - baseline
    else:
        hwm = _status_mb("VmHWM") if mem_source.startswith("VmHWM") else None
        peak_total = hwm if hwm is not None else _maxrss_mb()
        peak = max(peak_total - baseline, 0.0)
    clipper.close()
    out: dict[str, Any] = {
        "method": method,
        "ok": error is None,
        "batch": batch,
        "n_params": n_params,
        "d_model": int(d_model),
        "peak_mem_mb": peak,
        "peak_total_mb": peak_total,
        "baseline_mb": baseline,
        "mem_source": mem_source,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "setup_s": setup_s,
    }
    if error is not None:
        out["error"] = error
    if times:
        out["step_s"] = statistics.median(times)
        out["step_samples_s"] = times
    elif error is None:
        raise BenchmarkError(f"method {method!r}: no measured step (steps={steps})")
    stats = getattr(getattr(torch, "cpu", None), "memory_stats", None)  # a CPU allocator's stats, if any
    if not cuda and callable(stats):
        out["cpu_allocator_peak_mb"] = stats().get("allocated_bytes.all.peak", 0) / 2**20
    return out
