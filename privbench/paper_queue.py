"""``privbench paper-queue``: paper-scale measurements that accumulate across lent GPU sessions.

A lent GPU comes for minutes at a time, on a machine without the results store, MLflow or Prefect. The queue
(``configs/queue/paper.yaml``, :mod:`pbconfig.paper_queue`) lists, in priority order, benches at the paper profile
each sized to fit one call. :func:`run_queue` runs the items not yet measured on this device kind, each as its own
``privbench bench NAME --profile paper --no-record --json`` process under its own time limit, and stops before the
budget runs out. A finished item's JSON (the bench's provenance inside: device, host, commit, config, start and
finish) is written whole, by an atomic rename, to ``<root>/<device kind>/<item>-<key>.json``; an item cut short by
its limit or failing writes no result and is retried by the next call. Each item's progress (the bench's stderr)
goes to ``<root>/<device kind>/logs/<item>-<key>.log`` as it runs, so that a cut item still shows how far it got.
``key`` hashes what the item measures (its bench, options and the paper profile's resolved setting), so a change of
the profile's setting queues it again.

The committed files are the record: ``privbench results import-bench docs/results/raw/<device kind>`` rebuilds the
store's bench runs from them (skipping those already imported) and ``privbench report --profile paper`` renders
``docs/results/paper-gpu.md`` from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from pbconfig.paper_queue import PaperQueue, QueueItem

RAW_DIR = Path("docs/results/raw")
LOG_DIR = "logs"  # <root>/<kind>/logs/<item>-<key>.log: each item's progress, kept when it is cut (not a result)
MARGIN_S = 20.0  # kept back from the budget: process start and the write of the last result
Command = Callable[[QueueItem, str], Sequence[str]]


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` where torch sees a GPU, else ``cpu``; ``cuda`` without one is refused."""
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise ConfigError("device=cuda but torch sees no CUDA device; use --device auto or cpu")
    return "cpu"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_kind(device: str) -> str:
    """The folder a device's results go to: the GPU's name (``nvidia-h100-80gb-hbm3``) or ``cpu-<model>``."""
    if device == "cuda":
        import torch

        return _slug(torch.cuda.get_device_name(0))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    except OSError:
        pass
    return f"cpu-{_slug(model or os.uname().machine)}"


def item_options(item: QueueItem) -> dict[str, Any]:
    """The bench options the item's call gives (``methods``, ``overrides``), as ``privbench bench`` builds them."""
    options: dict[str, Any] = {}
    if item.methods:
        options["methods"] = tuple(item.methods)
    if item.sets:
        options["overrides"] = tuple(item.sets)
    return options


def item_key(item: QueueItem) -> str:
    """sha256 of what the item measures: bench, options and the paper profile's resolved setting (validated), less
    the machine it is computed on (:func:`_without_machine`)."""
    from privbench.bench.harness import resolve_benchmark

    try:
        setting = resolve_benchmark(item.bench, "paper", item_options(item))
    except ConfigError as exc:
        raise ConfigError(f"queue item {item.name!r}: {exc}") from None
    what = {"bench": item.bench, "options": item_options(item), "setting": _without_machine(setting)}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


MACHINE_KEYS = frozenset({"device", "device_name", "threads", "worker_env"})


def _without_machine(value: Any) -> Any:
    """``value`` without what names the machine that computes it (``MACHINE_KEYS``, at any depth): the device kind is
    the results' folder, so the key is the same on the lent GPU and on the machine that lists or imports them."""
    if isinstance(value, dict):
        return {k: _without_machine(v) for k, v in value.items() if k not in MACHINE_KEYS}
    if isinstance(value, list | tuple):
        return [_without_machine(v) for v in value]
    return value


def result_name(item: QueueItem, key: str) -> str:
    return f"{item.name}-{key[:12]}.json"


def bench_command(item: QueueItem, device: str) -> list[str]:
    """The ``privbench bench`` call of ``item`` (this interpreter, so it runs where the queue runs)."""
    command = [sys.executable, "-m", "privbench", "bench", item.bench, "--profile", "paper", "--no-record", "--json"]
    if item.methods:
        command += ["--methods", ",".join(item.methods)]
    for setting in item.sets:
        command += ["--set", setting]
    return command


@dataclass(frozen=True)
class Outcome:
    """What one item did in one call: ``done`` (measured before), ``measured``, ``cut`` (its limit or the budget
    stopped it: nothing written), ``failed`` (nothing written), ``stopped`` (not started: the budget left is short)."""

    item: str
    status: str
    seconds: float = 0.0
    path: str | None = None
    detail: str = ""


def _run(command: Sequence[str], *, timeout: float, env: dict[str, str], log: Path) -> tuple[int | None, str, str]:
    """Run ``command`` in its own process group, its stderr (the bench's progress) written to ``log`` as it comes;
    on the timeout kill the whole group. ``(returncode or None when cut, stdout, stderr)``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as progress:
        proc = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=progress, text=True, env=env, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = None
    return code, out, log.read_text(errors="replace")


def _checked(item: QueueItem, stdout: str) -> dict[str, Any]:
    """The bench's ``--no-record --json`` object, or ValueError saying why the output is not one."""
    result = json.loads(stdout)
    if not isinstance(result, dict) or result.get("benchmark") != item.bench or result.get("run_id") is not None:
        raise ValueError(f"not a `privbench bench {item.bench} --no-record --json` result")
    for key in ("started_at", "finished_at", "machine", "config"):
        if key not in result:
            raise ValueError(f"the result has no {key!r}")
    return result


def _write(path: Path, result: dict[str, Any]) -> None:
    """The whole file or nothing: a temporary file in the same folder, then an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def run_queue(
    queue: PaperQueue,
    *,
    budget_s: float,
    device: str,
    root: Path = RAW_DIR,
    kind: str | None = None,
    seen: Sequence[Path] = (),
    command: Command = bench_command,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = lambda _: None,
) -> list[Outcome]:
    """Advance ``queue`` on ``device`` (``cuda`` or ``cpu``) within ``budget_s`` seconds (module docstring);
    ``kind``: the device kind's folder name (default :func:`device_kind`); ``seen``: other results folders (e.g. the
    committed ``docs/results/raw`` where ``root`` is a folder the machine sends back) whose ``<kind>/`` results
    count as done too. One :class:`Outcome` per item looked at."""
    if budget_s <= 0:
        raise ConfigError(f"budget_s must be positive seconds, got {budget_s}")
    kind = kind or device_kind(device)
    folder = Path(root) / kind
    env = dict(os.environ)
    if device == "cuda":
        env["PRIVBENCH_BENCH_DEVICE"] = "cuda"
    start = clock()
    outcomes: list[Outcome] = []
    for item in queue.items:
        key = item_key(item)
        path = folder / result_name(item, key)
        earlier = [p for p in (path, *(Path(r) / kind / path.name for r in seen)) if p.exists()]
        if earlier:
            outcomes.append(Outcome(item.name, "done", path=str(earlier[0])))
            continue
        left = budget_s - (clock() - start) - MARGIN_S
        need = item.expected_s.get(device, item.time_limit_s)
        if need > left:
            basis = "measured" if device in item.expected_s else "its limit"
            detail = f"needs {need:.0f} s ({basis}), {left:.0f} s left"
            outcomes.append(Outcome(item.name, "stopped", detail=detail))
            log(f"{item.name}: not started: {detail}")
            break
        limit = min(item.time_limit_s, left)
        log(f"{item.name}: running (limit {limit:.0f} s)")
        began = clock()
        log_path = folder / LOG_DIR / f"{path.stem}.log"
        code, out, err = _run(command(item, device), timeout=limit, env=env, log=log_path)
        took = clock() - began
        if code is None:
            detail = f"cut at {limit:.0f} s; nothing written, retried by the next call"
            outcomes.append(Outcome(item.name, "cut", took, detail=detail))
        elif code != 0:
            tail = " ".join(err.strip().splitlines()[-3:])[-400:]
            outcomes.append(Outcome(item.name, "failed", took, detail=f"exit {code}: {tail}"))
        else:
            try:
                result = _checked(item, out)
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                outcomes.append(Outcome(item.name, "failed", took, detail=f"output unreadable: {exc}"))
            else:
                _write(path, result)
                outcomes.append(Outcome(item.name, "measured", took, path=str(path)))
        log(f"{item.name}: {outcomes[-1].status} in {took:.0f} s {outcomes[-1].detail}".rstrip())
    return outcomes


def queue_status(queue: PaperQueue, *, root: Path = RAW_DIR, device: str = "cpu") -> list[dict[str, Any]]:
    """Each item with where it is measured (every device kind's folder under ``root``: the commit and time of the
    run), or that it is left, and the seconds it is expected to take on ``device`` (None: not measured there)."""
    rows = []
    for item in queue.items:
        try:
            key = item_key(item)
        except ConfigError as exc:
            rows.append({"item": item.name, "bench": item.bench, "key": None, "done": [], "error": str(exc)})
            continue
        done = []
        for path in sorted(Path(root).glob(f"*/{result_name(item, key)}")):
            try:
                data = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            done.append(
                {
                    "device_kind": path.parent.name,
                    "commit": data.get("git_commit"),
                    "finished_at": data.get("finished_at"),
                    "path": str(path),
                }
            )
        rows.append(
            {
                "item": item.name,
                "bench": item.bench,
                "key": key[:12],
                "done": done,
                "expected_s": item.expected_s.get(device),
                "time_limit_s": item.time_limit_s,
            }
        )
    return rows


__all__ = [
    "RAW_DIR",
    "Outcome",
    "bench_command",
    "device_kind",
    "item_key",
    "queue_status",
    "resolve_device",
    "result_name",
    "run_queue",
]
