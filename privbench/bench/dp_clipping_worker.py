"""Worker side of ``dp-clipping`` (:mod:`privbench.bench.dp_clipping`): one method's DP-SGD steps in a fresh
process, timed, with the growth of peak memory over the state after setup (see that module's docstring)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from privbench.bench.harness import BenchmarkError


def _proc_mb(path: str, field: str) -> float | None:
    """A ``field: <n> kB`` line of the ``/proc`` file ``path`` in MB, None where unavailable."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _status_mb(field: str) -> float | None:
    """A ``/proc/self/status`` field (VmRSS, VmHWM, VmSize) in MB, None where unavailable."""
    return _proc_mb("/proc/self/status", field)


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


def _check_gram_fits(batch: int, seq_len: int, vocab: int, cap_mb: float | None) -> None:
    """The ghost-tied baseline's (B, L+M, L+M) Gram matrices, before they are allocated: in a max-batch
    trial, more than the cap does not fit (``MemoryError``, reported as such); in a timing run, more than
    80 % of the machine's available memory is refused so that the baseline cannot exhaust a shared host."""
    from core.dp.ghost_tied import gram_bytes

    need = gram_bytes(batch, seq_len, vocab) / 2**20
    if cap_mb is not None and need > cap_mb:
        raise MemoryError(f"ghost_tied's Gram matrices alone need {need:.0f} MB at batch {batch} (cap {cap_mb:.0f} MB)")
    available = _meminfo_mb("MemAvailable")
    if available is not None and need > 0.8 * available:
        raise BenchmarkError(
            f"ghost_tied at batch {batch}: its Gram matrices need {need:.0f} MB but only {available:.0f} MB "
            "are available; run the bench on a quieter or larger machine"
        )


def _meminfo_mb(field: str) -> float | None:
    """A ``/proc/meminfo`` field (MemAvailable) in MB, None where unavailable."""
    return _proc_mb("/proc/meminfo", field)


def _layer_times(timings: dict[str, float], model: Any, steps: int) -> dict[str, float]:
    """Seconds per step in the clipper's phases: the output-grad backward, then norms and weighted sums,
    split into the shared (tied) embedding and all other layers."""
    from core.dp.clipping import tied_parameter_names

    shared = {names.split(" = ")[0] for names in tied_parameter_names(model)}
    out: dict[str, float] = {}
    for key, seconds in timings.items():
        phase, _, param = key.partition(":")
        group = phase if not param else f"{phase}_{'shared_embedding' if param in shared else 'other_layers'}"
        out[group] = out.get(group, 0.0) + seconds / steps
    return out


def _kernel_profile(step: Any, *, cuda: bool, top: int = 12) -> dict[str, Any]:
    """One ``step()`` under ``torch.profiler``: where its time goes. On CUDA the device's own events only (each
    kernel, memcpy and memset once, grouped by name; the aten ops that launched them carry the same time again
    and are left out): ``top`` by device time, their total, the kernels launched and the memory copies and sets.
    On the CPU: the ``top`` ops by self CPU time and the total over all ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    if not cuda:
        averages = prof.key_averages()
        rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
        return {
            "activity": "cpu",
            "self_time_ms": sum(e.self_cpu_time_total for e in averages) / 1e3,
            "top": [
                {"op": e.key, "calls": int(e.count), "self_ms": e.self_cpu_time_total / 1e3}
                for e in rows[:top]
                if e.self_cpu_time_total > 0
            ],
        }
    device = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    grouped: dict[str, list[float]] = {}
    for e in device:
        grouped.setdefault(e.name, []).append(e.device_time_total)
    copies = sum(len(v) for name, v in grouped.items() if name.startswith(("Memcpy", "Memset")))
    ranked = sorted(grouped.items(), key=lambda kv: sum(kv[1]), reverse=True)
    return {
        "activity": "cuda",
        "self_time_ms": sum(sum(v) for v in grouped.values()) / 1e3,
        "kernels": len(device) - copies,
        "memcpy_memset": copies,
        "top": [{"op": name, "calls": len(v), "self_ms": sum(v) / 1e3} for name, v in ranked[:top] if sum(v) > 0],
    }


def random_batch(items: int, seq_len: int, batch: int, seed: int) -> tuple[Any, Any]:
    """Left-padded random sequences: inputs (B, L) and next-item targets (B, L), 0 = padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, items + 1, (batch, seq_len + 1), generator=g)
    pad = torch.randint(0, seq_len // 4 + 1, (batch,), generator=g)  # leading padding per sequence
    seq[torch.arange(seq_len + 1) < pad[:, None]] = 0
    inputs, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    targets[inputs == 0] = 0  # no target predicted from a padding position
    return inputs, targets


def indexed_device(device: str) -> Any:
    """``device`` as a ``torch.device`` with its index: a bare ``cuda`` is the current CUDA device (``cuda:N``), which
    ``torch.cuda.set_per_process_memory_fraction`` needs (it refuses an index-less device)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def device_name(*, device: str) -> dict[str, Any]:
    """Worker side: ``{"device_name"}``, the name of the GPU that ``device`` (``cuda``, ``cuda:N``) is."""
    import torch

    return {"device_name": torch.cuda.get_device_name(indexed_device(device))}


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
    kernel_profile: bool = False,
) -> dict[str, Any]:
    """Worker side: time ``steps`` DP-SGD steps of one method after ``warmup``; peak memory growth.

    ``kernel_profile``: after the timed steps and the memory reading, one more step under ``torch.profiler``
    (:func:`_kernel_profile`): where a step's time goes, op by op, and on CUDA how many kernels it launches. The
    phases and layer timings are those of the timed steps only.

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
    dev = indexed_device(device)
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
    book_keeping = getattr(clipper, "phantom", None)  # phantom / ghost_tied: time each phase and layer
    if book_keeping is not None:
        book_keeping.timings = {}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    inputs, targets = (t.to(dev) for t in random_batch(items, seq_len, batch, seed))
    generator = torch.Generator(device=dev).manual_seed(seed + 1)
    private = clipping != "nonprivate"

    phases: dict[str, float] = {"forward": 0.0, "backward": 0.0, "noise_and_optimizer": 0.0}

    def step() -> None:
        t0 = time.perf_counter()
        logits = clipper.model(inputs)
        loss = sequence_loss(logits, targets, reduction="none")  # (B,)
        del logits
        sync()
        t1 = time.perf_counter()
        clipper.backward(loss)
        sync()
        t2 = time.perf_counter()
        if private:
            privatize_grads_(
                params, noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=batch, generator=generator
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["noise_and_optimizer"] += time.perf_counter() - t2

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
        if clipping == "ghost_tied":
            _check_gram_fits(batch, seq_len, items + 1, mem_cap_mb if fit_trial else None)
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
    profiled: dict[str, Any] | None = None
    if kernel_profile and times:
        kept_phases = dict(phases)
        kept_layers = dict(book_keeping.timings) if book_keeping is not None else None
        try:
            profiled = _kernel_profile(step, cuda=cuda)
        except Exception as exc:  # noqa: BLE001 - auxiliary: a profiler failure must not lose the measurement
            profiled = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        phases.update(kept_phases)
        if book_keeping is not None:
            book_keeping.timings = kept_layers
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
        n = warmup + steps
        out["phases_s"] = {k: v / n for k, v in phases.items()}  # mean per step, warm-up included
        if book_keeping is not None:
            out["layers_s"] = _layer_times(book_keeping.timings, model, n)
    elif error is None:
        raise BenchmarkError(f"method {method!r}: no measured step (steps={steps})")
    if profiled is not None:
        out["kernel_profile"] = profiled
    stats = getattr(getattr(torch, "cpu", None), "memory_stats", None)  # a CPU allocator's stats, if any
    if not cuda and callable(stats):
        out["cpu_allocator_peak_mb"] = stats().get("allocated_bytes.all.peak", 0) / 2**20
    return out
