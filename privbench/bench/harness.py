"""Generic benchmark machinery: registry, machine description, interleaved repeats, fresh-process
measurements, and ``run_benchmark`` (wrap, describe, store).

Contract of a benchmark (see DESIGN.md, "Benchmarks"): a function ``fn(profile, progress, options)``
returning a JSON-able dict; :func:`run_benchmark` adds ``benchmark``, ``profile``, ``started_at``,
``finished_at``, ``git_commit``, ``machine`` and ``run_id``, and records ONE run in the results store and
MLflow (``flow="bench"``, ``stage="bench"``, ``technique=<name>``, ``dataset`` where the spec names one):
every finite numeric leaf of the benchmark's dict becomes a metric named by its dotted path
(``methods.phantom.step_s``), except the ``setting`` object, which goes to the run's config (MLflow params);
lists (raw samples) and strings are kept only in the ``result.json`` artifact, which holds the whole printed
object.

Absolute times are noisy on shared machines, so benchmarks measure the things they compare side by
side: :func:`interleave` runs ``A B C A B C ...`` (order rotated each round by default) and keeps every
sample per round, so that a ratio can be taken per round (both terms measured back to back, under the
same background load) and then the median across rounds (:meth:`Interleaved.ratio`); that is more robust
to load drifting over the run than a ratio of two medians. :meth:`Interleaved.ratio_interval` adds that median's
distribution-free 95% interval from the order statistics of the per-round ratios (6 rounds or more).

Measurements that need a clean process (peak memory, first-step allocations) run through
:func:`run_in_fresh_process`: ``sys.executable -m privbench.bench._worker '<json spec>'``, result JSON
on stdout behind a marker line, with a timeout; a failing worker raises :class:`BenchmarkError` naming
what it measured and quoting the worker's error.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from core.errors import ConfigError, PrivbenchError
from core.order_stats import CONFIDENCE, MedianInterval, median_interval
from storage.provenance import cpu_model

PROFILES = ("quick", "paper")
WORKER_MODULE = "privbench.bench._worker"
RESULT_MARKER = "PRIVBENCH_BENCH_RESULT "
ERROR_MARKER = "PRIVBENCH_BENCH_ERROR "
THREADS_ENV = "PRIVBENCH_BENCH_THREADS"
_REPO = Path(__file__).resolve().parents[2]


class BenchmarkError(PrivbenchError):
    """A benchmark could not measure what it was asked to (worker failed, timed out, ...)."""

    def __init__(
        self, message: str, *, label: str | None = None, returncode: int | None = None, timed_out: bool = False
    ) -> None:
        super().__init__(message)
        self.label, self.returncode, self.timed_out = label, returncode, timed_out


class Progress(Protocol):
    """What benchmarks print progress to (a rich ``Console`` on stderr in the CLI)."""

    def print(self, *objects: Any, **kwargs: Any) -> None: ...


BenchFn = Callable[[str, Progress, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class BenchmarkSpec:
    """A registered benchmark.

    Attributes:
        name: the CLI name (``privbench bench NAME``).
        description: one line for ``privbench bench --list``.
        fn: ``fn(profile, progress, options) -> dict`` (the JSON body).
        options: names of the keyword options ``run_benchmark`` accepts for it.
        setting: optional ``setting(profile, options) -> dict``, the resolved setting recorded as the
            run's config before the benchmark starts.
        dataset: the dataset the benchmark measures on, recorded as the run's dataset (None: none).
        profile_aliases: other names of its profiles (``paper-shape`` -> ``paper``); a run is recorded under the
            profile's own name, so the claims report finds it.
    """

    name: str
    description: str
    fn: BenchFn
    options: tuple[str, ...] = ()
    setting: Callable[[str, Mapping[str, Any]], Mapping[str, Any]] | None = None
    dataset: str | None = None
    profile_aliases: Mapping[str, str] = field(default_factory=dict)


BENCHMARKS: dict[str, BenchmarkSpec] = {}


def register(
    name: str,
    description: str,
    *,
    options: tuple[str, ...] = (),
    setting: Callable[[str, Mapping[str, Any]], Mapping[str, Any]] | None = None,
    dataset: str | None = None,
    profile_aliases: Mapping[str, str] | None = None,
) -> Callable[[BenchFn], BenchFn]:
    """Decorator: register ``fn`` as benchmark ``name``."""

    def decorate(fn: BenchFn) -> BenchFn:
        if name in BENCHMARKS and BENCHMARKS[name].fn is not fn:
            raise ConfigError(f"benchmark {name!r} is registered twice")
        aliases = dict(profile_aliases or {})
        BENCHMARKS[name] = BenchmarkSpec(name, description, fn, tuple(options), setting, dataset, aliases)
        return fn

    return decorate


def get_benchmark(name: str) -> BenchmarkSpec:
    """The spec of ``name``; ConfigError listing the known names otherwise (same wording as the CLI)."""
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS) or '(none)'}")
    return BENCHMARKS[name]


# ------------------------------------------------------------------------------------------ machine


def available_cpus() -> int:
    """CPUs this process may run on (affinity), falling back to ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def bench_threads() -> int:
    """Torch intra-op threads for measurements: ``$PRIVBENCH_BENCH_THREADS`` or the available CPUs."""
    raw = os.environ.get(THREADS_ENV)
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ConfigError(f"{THREADS_ENV} must be a positive int, got {raw!r}")
        return value
    return available_cpus()


def _memory_total_mb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (how busy the machine was), None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(*, threads: int | None = None) -> dict[str, Any]:
    """Where the benchmark ran: CPU model and cores, memory, torch version/threads, CUDA device."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": available_cpus(),
        "memory_total_mb": _memory_total_mb(),
        "load_avg": load_average(),
        "torch": torch.__version__,
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "cuda_version": torch.version.cuda,
    }


# ------------------------------------------------------------------------------------------ interleave


def _value(sample: Any, key: str | None) -> float:
    if key is not None:
        sample = sample[key]
    return float(sample)


@dataclass
class Interleaved:
    """Samples of an interleaved run: ``rounds[r][name]`` is what ``fns[name]`` returned in round r
    (or its wall time in seconds if it returned None); ``order`` is the actual call order."""

    names: list[str]
    order: list[str] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def samples(self, name: str, key: str | None = None) -> list[float]:
        """All samples of ``name`` (field ``key`` of dict samples), in round order."""
        return [_value(r[name], key) for r in self.rounds]

    def median(self, name: str, key: str | None = None) -> float:
        return statistics.median(self.samples(name, key))

    def ratio_samples(self, num: str, den: str, key: str | None = None) -> list[float]:
        """Per-round ratios ``num / den`` (both measured in the same round, back to back)."""
        out = []
        for r in self.rounds:
            d = _value(r[den], key)
            out.append(_value(r[num], key) / d if d > 0 else math.nan)
        return out

    def ratio(self, num: str, den: str, key: str | None = None) -> float | None:
        """Median over rounds of the per-round ratio ``num / den`` (None if no round has den > 0)."""
        values = [v for v in self.ratio_samples(num, den, key) if math.isfinite(v)]
        return statistics.median(values) if values else None

    def ratio_interval(
        self, num: str, den: str, key: str | None = None, confidence: float = CONFIDENCE
    ) -> MedianInterval | None:
        """The median over rounds of the per-round ratio ``num / den`` with its distribution-free ``confidence``
        interval (:func:`core.order_stats.median_interval`: order statistics of the rounds' ratios, the sign-test
        interval; absent below 6 rounds at 95%); None if no round has den > 0."""
        values = [v for v in self.ratio_samples(num, den, key) if math.isfinite(v)]
        return median_interval(values, confidence) if values else None

    def summary(self, key: str | None = None) -> dict[str, Any]:
        """``{"order", "medians", "samples"}`` (JSON-able)."""
        return {
            "order": list(self.order),
            "medians": {n: self.median(n, key) for n in self.names},
            "samples": {n: self.samples(n, key) for n in self.names},
        }


def interleave(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int,
    *,
    rotate: bool = True,
    on_sample: Callable[[int, str, Any], None] | None = None,
) -> Interleaved:
    """Call every function once per round, ``repeats`` rounds: ``A B C A B C ...``.

    With ``rotate`` the order of round r starts at function ``r mod n`` (``A B C``, ``B C A``, ...), so
    no function is always first (after an idle gap) or always last. A function's return value is its
    sample (a number, or a dict of numbers); if it returns None, the sample is its wall time in
    seconds. ``on_sample(round, name, sample)`` is called after each call (progress).
    """
    if not fns:
        raise ConfigError("interleave needs at least one function")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive int, got repeats={repeats!r}")
    names = list(fns)
    result = Interleaved(names=names)
    for r in range(repeats):
        shift = r % len(names) if rotate else 0
        samples: dict[str, Any] = {}
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            out = fns[name]()
            samples[name] = time.perf_counter() - t0 if out is None else out
            result.order.append(name)
            if on_sample is not None:
                on_sample(r, name, samples[name])
        result.rounds.append({n: samples[n] for n in names})
    return result


# ------------------------------------------------------------------------------------------ fresh process


def _marked(stdout: str, marker: str) -> Any:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    return None


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_in_fresh_process(
    target: str,
    kwargs: Mapping[str, Any],
    *,
    label: str,
    timeout: float,
    threads: int | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``target(**kwargs)`` (``"privbench.bench.module:function"``) in a new Python process.

    The worker prints its result (a JSON object) on stdout behind :data:`RESULT_MARKER`. ``threads`` sets
    OMP/MKL thread counts in the child's environment before torch loads; ``extra_env`` adds variables.
    Raises :class:`BenchmarkError` naming ``label`` (e.g. the method) if the worker times out, exits
    non-zero, is killed by a signal, or prints no result; the message quotes the worker's error and the
    tail of its stderr.
    """
    spec = json.dumps({"target": target, "kwargs": dict(kwargs)})
    cmd = [sys.executable, "-m", WORKER_MODULE, spec]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
    env.update(extra_env or {})
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        tail = f"\n--- worker stderr (tail) ---\n{_tail(stderr)}" if stderr.strip() else ""
        raise BenchmarkError(
            f"benchmark worker for {label} timed out after {timeout:g} s ({target}); raise the timeout or "
            f"shrink the setting{tail}",
            label=label,
            timed_out=True,
        ) from None
    result = _marked(proc.stdout, RESULT_MARKER)
    if proc.returncode == 0 and isinstance(result, dict):
        return result
    error = _marked(proc.stdout, ERROR_MARKER)
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = str(-proc.returncode)
        why = f"killed by signal {sig}" + (" (out of memory?)" if sig == "SIGKILL" else "")
    elif isinstance(error, dict):
        why = f"exit {proc.returncode}: {error.get('type')}: {error.get('message')}"
    elif proc.returncode != 0:
        why = f"exit {proc.returncode}"
    else:
        why = "it printed no result"
    stderr = _tail(proc.stderr)
    raise BenchmarkError(
        f"benchmark worker for {label} failed ({why}); target {target}"
        + (f"\n--- worker stderr (tail) ---\n{stderr}" if stderr else ""),
        label=label,
        returncode=proc.returncode,
    )


# ------------------------------------------------------------------------------------------ run & store


def numeric_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """``(dotted.path, value)`` for every finite int/float leaf under dicts (lists and bools skipped)."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            yield from numeric_leaves(value, name)
    elif isinstance(obj, int | float) and not isinstance(obj, bool) and math.isfinite(obj):
        yield prefix, float(obj)


def metric_name(path: str) -> str:
    """A store/MLflow-safe metric name: characters outside ``[A-Za-z0-9_\\-. :/]`` become ``_``."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_-. :/") else "_" for c in path)[:250]


def metric_unit(path: str) -> str | None:
    """Unit from naming conventions: ``*_s`` seconds, ``*_mb`` MB, ``ratios.*`` ratio, ``ratio_intervals.*`` ratio
    (``lo``, ``hi``), rounds or share (``coverage``), ..."""
    leaf = path.rsplit(".", 1)[-1]
    if path.startswith("ratios."):
        return "ratio"
    if path.startswith("ratio_intervals.") or ".ratio_intervals." in path:
        return {"lo": "ratio", "hi": "ratio", "rounds": "rounds", "coverage": "share"}.get(leaf)
    if leaf.endswith("_s"):
        return "s"
    if leaf.endswith("_mb"):
        return "MB"
    if path.startswith("max_batch."):
        return "sequences"
    if leaf == "n_params":
        return "parameters"
    return None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def resolve_benchmark(name: str, profile: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The setting benchmark ``name`` would run for ``profile`` and ``options``, resolved before anything runs or
    is recorded; ConfigError for an unknown benchmark, profile, option or a bad option value."""
    spec = get_benchmark(name)
    profile = canonical_profile(name, profile)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        raise ConfigError(
            f"benchmark {name} has no option(s) {', '.join(unknown)}; known: {', '.join(spec.options) or '(none)'}"
        )
    return dict(spec.setting(profile, options)) if spec.setting else {}


def canonical_profile(name: str, profile: str) -> str:
    """``profile`` of benchmark ``name`` under its own name (an alias such as ``paper-shape`` resolved);
    ConfigError naming the known profiles and aliases otherwise."""
    aliases = get_benchmark(name).profile_aliases
    canonical = aliases.get(profile, profile)
    if canonical not in PROFILES:
        known = [*PROFILES, *(f"{a} (= {p})" for a, p in aliases.items())]
        raise ConfigError(f"unknown profile {profile!r} for benchmark {name}; known: {', '.join(known)}")
    return canonical


WRAPPER_KEYS = ("benchmark", "profile", "started_at", "finished_at", "git_commit", "run_id", "machine", "config")


def run_benchmark(
    name: str, *, profile: str = "quick", progress: Progress | None = None, record: bool = True, **options: Any
) -> dict[str, Any]:
    """Run benchmark ``name`` and record it (one run); returns the JSON object the CLI prints.

    Keys added around the benchmark's own dict: ``benchmark``, ``profile``, ``started_at``,
    ``finished_at``, ``git_commit`` (when known), ``run_id`` (the results-store run) and ``machine``.
    ``options`` are benchmark specific (``BENCHMARKS[name].options``). Raises ConfigError for an unknown
    benchmark, profile or option, BenchmarkError when a measurement fails (the run is then marked failed).

    ``record=False`` (``privbench bench --no-record``) measures without touching the results store or MLflow (a
    GPU worker that cannot reach them): ``run_id`` is None and ``config`` holds what the run would have recorded,
    so that :func:`import_benchmark_result` records it later, elsewhere, with this machine's provenance.
    """
    spec = get_benchmark(name)
    setting = resolve_benchmark(name, profile, options)
    profile = canonical_profile(name, profile)
    if progress is None:
        from rich.console import Console

        progress = Console(stderr=True)
    config = {"benchmark": name, "profile": profile, "options": dict(options), "setting": setting}
    started_at, load_start = _now(), load_average()
    if not record:
        body = spec.fn(profile, progress, options)
        return {**_wrap(name, profile, started_at, load_start, body, run_id=None), "config": config}
    from storage.recording import record_run

    with record_run(
        flow="bench", stage="bench", technique=name, dataset=spec.dataset, config=config, profile=profile
    ) as rec:
        body = spec.fn(profile, progress, options)
        result = _wrap(name, profile, started_at, load_start, body, run_id=rec.run_id)
        _log(rec, body, result)
    return result


def _wrap(
    name: str, profile: str, started_at: str, load_start: Any, body: dict[str, Any], *, run_id: str | None
) -> dict[str, Any]:
    from storage.provenance import git_commit

    machine = machine_info(threads=(body.get("setting") or {}).get("threads"))
    machine["load_avg_at_start"] = load_start
    commit = git_commit()
    return {
        "benchmark": name,
        "profile": profile,
        "started_at": started_at,
        "finished_at": _now(),
        **({"git_commit": commit} if commit else {}),
        "run_id": run_id,
        "machine": machine,
        **body,
    }


def _log(rec: Any, body: Mapping[str, Any], result: Mapping[str, Any]) -> None:
    """Every finite numeric leaf of ``body`` but its ``setting`` as a metric, ``result`` as ``result.json``, the
    benchmark's name and the machine's CPU, CUDA device, torch and threads as tags."""
    measured = {k: v for k, v in body.items() if k != "setting"}  # machine: tags, artifact
    for path, value in numeric_leaves(measured):
        rec.metric(metric_name(path), value, unit=metric_unit(path))
    rec.artifact_json("result.json", dict(result))
    rec.tag("privbench.bench", str(result["benchmark"]))
    machine = result.get("machine") or {}
    for key in ("cpu_model", "cuda_device", "torch", "torch_threads"):
        if machine.get(key) is not None:
            rec.tag(f"privbench.bench.{key}", str(machine[key]))
    if (body.get("setting") or {}).get("device"):
        rec.tag("privbench.bench.device", str(body["setting"]["device"]))


class AlreadyImported(ConfigError):
    """The measurement is in the store already (same benchmark, host, start time, commit and config)."""


def import_benchmark_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """Record in this machine's results store and MLflow one benchmark result measured elsewhere with
    ``--no-record`` (the JSON it printed), under the provenance of the machine that measured it: its commit, host,
    device, start and finish times; tagged ``privbench.bench.imported = true``. Returns the result with its new
    ``run_id``. ConfigError naming what is wrong when ``result`` is not such a JSON object (already recorded, a key
    missing, an unknown benchmark or profile)."""
    from storage.measured import Measured, find_measured_run
    from storage.recording import record_run

    if not isinstance(result, Mapping):
        raise ConfigError(f"a benchmark result must be a JSON object, got {type(result).__name__}")
    missing = [k for k in ("benchmark", "profile", "started_at", "finished_at", "machine", "config") if k not in result]
    if missing:
        raise ConfigError(
            f"not a `privbench bench --no-record --json` result: missing {', '.join(missing)}; rerun the "
            "benchmark with --no-record --json and import what it printed"
        )
    if result.get("run_id"):
        raise ConfigError(
            f"this result is already recorded as run {result['run_id']} (it was not measured with --no-record); "
            "import only --no-record results"
        )
    name = str(result["benchmark"])
    spec = get_benchmark(name)
    profile = canonical_profile(name, str(result["profile"]))
    config = result["config"]
    if not isinstance(config, Mapping) or config.get("benchmark") != name:
        raise ConfigError(f"the result's config is not benchmark {name}'s: {str(config)[:200]}")
    machine = result["machine"] if isinstance(result["machine"], Mapping) else {}
    try:
        started = datetime.fromisoformat(str(result["started_at"]))
        finished = datetime.fromisoformat(str(result["finished_at"]))
    except ValueError as exc:
        raise ConfigError(f"started_at/finished_at must be ISO 8601 times: {exc}") from exc
    started, finished = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (started, finished))  # naive: UTC
    if finished < started:
        raise ConfigError(f"finished_at {result['finished_at']} is before started_at {result['started_at']}")
    measured = Measured(
        started_at=started,
        finished_at=finished,
        git_commit=result.get("git_commit"),
        host=str(machine.get("host") or "unknown"),
        device=describe_device(machine),
    )
    earlier = find_measured_run(flow="bench", technique=name, measured=measured, config=config)
    if earlier is not None:
        raise AlreadyImported(
            f"this result (host {measured.host}, started {result['started_at']}, the same config) is already in the "
            f"store as run "
            f"{earlier}; nothing recorded"
        )
    body = {k: v for k, v in result.items() if k not in WRAPPER_KEYS}
    with record_run(
        flow="bench",
        stage="bench",
        technique=name,
        dataset=spec.dataset,
        config=config,
        profile=profile,
        measured=measured,
    ) as rec:
        recorded = {**result, "run_id": rec.run_id}
        recorded.pop("config", None)
        _log(rec, body, recorded)
        rec.tag("privbench.bench.imported", "true")
    return recorded


def describe_device(machine: Mapping[str, Any]) -> str:
    """A result's ``machine`` as the store's device text (``storage.provenance.device``'s form)."""
    torch = machine.get("torch")
    if machine.get("cuda_device"):
        return f"cuda: {machine['cuda_device']} (x{machine.get('cuda_device_count') or 1}), torch {torch}"
    return f"cpu: {machine.get('cpu_model') or 'unknown'}, {machine.get('cpu_count')} cores, torch {torch}"
