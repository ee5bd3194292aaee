"""What ``privbench run`` shows while its flow works: the stage, runs done of those planned, the runs in progress,
the time so far and an estimate of the time left.

No IPC beyond the results store: the supervisor polls it for this command's rows (those opened on this host, since
the command started, by a process of the flow's tree, and the rows nested under them, e.g. by remote Dask
workers). The flow process adds two things through the file named by ``PRIVBENCH_PROGRESS_FILE``, one JSON line
each: ``{"plan": {flow: runs}}`` (``flows.registry.plan``, from the config alone) and, from every process that
records a run, ``{"run": id, "name": "taft shard 3/5"}`` (its MLflow run name). Without the file the display shows
techniques and datasets, and the done count without a total.

A terminal gets a live display (``LiveView``); anything else (CI, a pipe, ``-v``) one plain line per ended run
(``PlainView``), e.g. ``[12/46] train-dp  transformer  ml-100k  eps8:seed0:lr0.005:b128  finished  41.2s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Protocol

from rich.console import Console, Group, RenderableType
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

PROGRESS_FILE_ENV = "PRIVBENCH_PROGRESS_FILE"  # the same name as storage.recording.PROGRESS_FILE_ENV
POLL_S = 1.0
RUNNING_SHOWN = 4  # runs in progress listed by the live display (then "and N more")


@dataclass(frozen=True)
class RunState:
    """One row of the command, as the progress display needs it."""

    id: str
    parent_id: str | None
    flow: str
    stage: str
    technique: str
    dataset: str | None
    status: str  # running, finished or failed
    started: float  # epoch seconds
    duration_s: float | None = None
    error: str | None = None
    name: str | None = None  # its MLflow run name, when the flow process announced one

    @property
    def detail(self) -> str:
        """The run name where it says more than technique and dataset (``eps8:seed0`` of ``gru:ml-100k:eps8:seed0``)."""
        if self.technique == "flow":  # "train-dp flow": the flow column says it
            return ""
        name = self.name or ""
        for known in (self.technique, self.dataset):
            if known and name.startswith(f"{known}:"):
                name = name[len(known) + 1 :]
        return "" if name in ("", self.technique, self.dataset, self.flow) else name

    @property
    def title(self) -> str:
        """``technique  dataset  detail``: what the run is."""
        return "  ".join(p for p in (self.technique, self.dataset, self.detail) if p)


class Progress:
    """The state of one command's runs (thread-safe): fed row snapshots, it numbers the runs as they end and
    counts them against the plan."""

    def __init__(self, flow: str, *, started: float | None = None) -> None:
        self.flow = flow
        self.started = time.time() if started is None else started
        self.plan: dict[str, int | None] | None = None
        self.runs: dict[str, RunState] = {}
        self.names: dict[str, str] = {}
        self.ended: list[str] = []  # run ids, in the order they were seen to end
        self._lock = threading.RLock()

    # ----------------------------------------------------------------------------------------------- feeding

    def set_plan(self, plan: dict[str, int | None]) -> None:
        with self._lock:
            self.plan = dict(plan)

    def name(self, run_id: str, name: str) -> None:
        with self._lock:
            self.names[run_id] = name
            if run_id in self.runs:
                self.runs[run_id] = replace(self.runs[run_id], name=name)

    def update(self, rows: Iterable[RunState]) -> list[tuple[int, RunState]]:
        """Take the rows' current states; the runs that ended since the last call, numbered, in the order they
        ended."""
        new = []
        with self._lock:
            for row in sorted(rows, key=_end_time):
                row = replace(row, name=row.name or self.names.get(row.id))
                before = self.runs.get(row.id)
                self.runs[row.id] = row
                if row.status != "running" and (before is None or before.status == "running"):
                    self.ended.append(row.id)
                    new.append((len(self.ended), row))
        return new

    # --------------------------------------------------------------------------------------------- reading

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.ended)

    @property
    def total(self) -> int | None:
        """The planned number of runs; None when the plan is unknown (or already exceeded: a retried task)."""
        with self._lock:
            if not self.plan or None in self.plan.values():
                return None
            total = sum(v for v in self.plan.values() if v is not None)
            return total if total >= len(self.runs) else None

    def stages(self) -> list[tuple[str, int, int | None]]:
        """``(flow, done, planned or None)`` per flow: the planned ones in plan order, then any others seen."""
        with self._lock:
            done: dict[str, int] = {}
            seen: dict[str, int] = {}
            for run in self.runs.values():
                seen[run.flow] = seen.get(run.flow, 0) + 1
                done[run.flow] = done.get(run.flow, 0) + (run.status != "running")
            names = [*(self.plan or {}), *(f for f in seen if f not in (self.plan or {}))]
            out = []
            for flow in names:
                planned = (self.plan or {}).get(flow)
                out.append(
                    (flow, done.get(flow, 0), planned if planned is not None and planned >= seen.get(flow, 0) else None)
                )
            return out

    def running(self) -> list[RunState]:
        """The runs in progress, oldest first; the flows' own runs only where no task runs."""
        with self._lock:
            live = sorted((r for r in self.runs.values() if r.status == "running"), key=lambda r: r.started)
        tasks = [r for r in live if r.technique != "flow"]
        return tasks or live

    @property
    def stage(self) -> str | None:
        """The flow working now: that of the newest run in progress (a task's before a flow's)."""
        running = self.running()
        return running[-1].flow if running else None

    def last_ended(self) -> RunState | None:
        with self._lock:
            return self.runs[self.ended[-1]] if self.ended else None

    def eta(self, now: float | None = None) -> float | None:
        """Seconds left: the runs left at the rate runs have ended since the first one started (start-up
        excluded); None without a total, before a run has ended and after the last."""
        now = time.time() if now is None else now
        with self._lock:
            total, done = self.total, len(self.ended)
            if total is None or done == 0 or done >= total:
                return None
            first = min(r.started for r in self.runs.values())
        return max(0.0, (now - first) / done * (total - done))

    def counter(self, index: int | None = None) -> str:
        """``12/46``, or ``12/?`` when the total is not known."""
        total = self.total
        return f"{self.done if index is None else index}/{'?' if total is None else total}"

    def line(self, index: int, run: RunState) -> str:
        """The plain line of an ended run: ``[12/46] train-dp  transformer  ml-100k  eps8  finished  41.2s``."""
        parts = [f"[{self.counter(index)}]", run.flow, run.title, run.status]
        if run.duration_s is not None:
            parts.append(duration(run.duration_s))
        if run.status == "failed" and run.error:
            parts.append(f"({_first_line(run.error, 160)})")
        return "  ".join(p for p in parts if p)

    # ------------------------------------------------------------------------------------------ live display

    def renderable(self, title: str, now: float | None = None) -> tuple[Text, RenderableType | None]:
        """The live display: a header line; then the stages, the runs in progress and the last one that ended."""
        now = time.time() if now is None else now
        elapsed = now - self.started
        head = Text(f"{title} · {duration(elapsed)}", no_wrap=True, overflow="ellipsis")
        with self._lock:
            seen_any = bool(self.runs)
        if not seen_any:
            head.append(" · starting the flow process (imports, Prefect API) ...", style="dim")
            return head, None
        total, eta = self.total, self.eta(now)
        head.append(" · ")
        head.append(f"{self.counter()} runs", style="bold")
        if total is None:
            head.append(" (total not known up front)", style="dim")
        elif eta is not None:
            head.append(f" · ETA ~{duration(eta)}")
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        current = self.stage
        stages = Text(no_wrap=True, overflow="ellipsis")
        for flow, done, planned in self.stages():
            if flow == "benchmark":
                continue
            if stages:
                stages.append(" · ", style="dim")
            style = "bold cyan" if flow == current else ("green" if planned is not None and done == planned else "")
            stages.append(f"{flow} {done}/{'?' if planned is None else planned}", style=style)
        grid.add_row("stages", stages)
        running = self.running()
        for i, run in enumerate(running[:RUNNING_SHOWN]):
            grid.add_row(
                "running" if i == 0 else "",
                Text(f"{run.flow}  {run.title}  {duration(now - run.started)}", no_wrap=True, overflow="ellipsis"),
            )
        if len(running) > RUNNING_SHOWN:
            grid.add_row("", Text(f"and {len(running) - RUNNING_SHOWN} more", style="dim"))
        last = self.last_ended()
        if last is not None:
            text = Text(f"{last.flow}  {last.title}  ", no_wrap=True, overflow="ellipsis")
            text.append(last.status, style="green" if last.status == "finished" else "red")
            if last.duration_s is not None:
                text.append(f"  {duration(last.duration_s)}")
            grid.add_row("last", text)
        return head, grid


def duration(seconds: float) -> str:
    """``3.2s``, ``1m05s``, ``2h03m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _end_time(row: RunState) -> float:
    return row.started + (row.duration_s or 0.0) if row.status != "running" else float("inf")


def _first_line(text: str, limit: int) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------------- views


class View(Protocol):
    """Where progress goes: ``update`` after each poll with the runs that ended, ``child_output`` for a line the
    flow process printed (when ``relays``: a live display owns the terminal), ``close`` (idempotent)."""

    progress: Progress
    relays: bool

    def start(self) -> None: ...
    def update(self, ended: list[tuple[int, RunState]]) -> None: ...
    def child_output(self, line: str) -> None: ...
    def close(self) -> None: ...


class PlainView:
    """One line per ended run (CI, a pipe, ``-v``); the flow process's own output goes straight to the terminal."""

    relays = False

    def __init__(self, progress: Progress, console: Console) -> None:
        self.progress = progress
        self.console = console
        self._closed = False

    def start(self) -> None:
        pass

    def update(self, ended: list[tuple[int, RunState]]) -> None:
        for index, run in ended:
            self.child_output(_redact(self.progress.line(index, run)))

    def child_output(self, line: str) -> None:
        if not self._closed:
            self.console.print(Text(line), highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._closed = True


class LiveView:
    """A live display on a terminal, gone when it stops (the summary table follows); failed runs and whatever the
    flow process prints are printed above it and stay."""

    relays = True

    def __init__(self, progress: Progress, console: Console, title: str) -> None:
        from rich.live import Live

        self.progress = progress
        self.title = title
        self._lock = threading.Lock()
        self._closed = False
        self.spinner = Spinner("dots")
        self.live = Live(
            console=console,
            transient=True,
            refresh_per_second=4,
            redirect_stdout=False,
            redirect_stderr=False,
            get_renderable=self._render,
        )

    def _render(self) -> RenderableType:
        head, body = self.progress.renderable(self.title)
        self.spinner.update(text=head)
        return self.spinner if body is None else Group(self.spinner, body)

    def start(self) -> None:
        with self._lock:
            if not self._closed:
                self.live.start()

    def update(self, ended: list[tuple[int, RunState]]) -> None:
        for index, run in ended:
            if run.status == "failed":
                self._print(Text(_redact(self.progress.line(index, run)), style="red"))

    def child_output(self, line: str) -> None:
        self._print(Text.from_ansi(line))

    def _print(self, text: Text) -> None:
        with self._lock:
            if not self._closed:
                self.live.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            self.live.stop()


def _redact(text: str) -> str:
    from core.redact import redact_url

    return redact_url(text)


# ------------------------------------------------------------------------------------------------- polling


def command_rows(pids: set[int], since: datetime, running: set[str]) -> list[RunState]:
    """The rows of this command: opened on this host by one of ``pids`` since ``since``, and (transitively) those
    nested under ``running`` rows or under the rows found (``storage.process_runs``)."""
    from storage.process_runs import runs_of_processes

    return [
        RunState(
            id=r["id"],
            parent_id=r["parent_id"],
            flow=r["flow"],
            stage=r["stage"],
            technique=r["technique"],
            dataset=r["dataset"],
            status=r["status"],
            started=r["started_at"].timestamp(),
            duration_s=r["duration_s"],
            error=r["error"],
        )
        for r in runs_of_processes(pids, since, running)
    ]


class Monitor:
    """Polls the store (and the progress file) in a thread and feeds ``view``; ``stop`` ends it."""

    def __init__(
        self,
        progress: Progress,
        view: View,
        *,
        pids: Callable[[], set[int]],
        since: datetime,
        progress_file: Path,
        every: float = POLL_S,
    ) -> None:
        self.progress = progress
        self.view = view
        self.pids = pids
        self.since = since
        self.progress_file = progress_file
        self.every = every
        self._offset = 0
        self._stop = threading.Event()
        self._poll_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="privbench-progress", daemon=True)

    def start(self) -> None:
        self.view.start()
        self._thread.start()

    def poll(self) -> None:
        """One round: the progress file's new lines, then the rows; errors are not the command's (skipped)."""
        with self._poll_lock:
            try:
                self._read_file()
                running = {r.id for r in self.progress.runs.values() if r.status == "running"}
                ended = self.progress.update(command_rows(self.pids(), self.since, running))
            except Exception as exc:  # noqa: BLE001 -- a display must never stop the command
                if os.environ.get("PRIVBENCH_DEBUG"):
                    self.view.child_output(f"privbench: progress poll failed: {type(exc).__name__}: {exc}")
                return
            self.view.update(ended)

    def _read_file(self) -> None:
        try:
            with open(self.progress_file, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for raw in complete.splitlines():
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                event = json.loads(raw)
                if "plan" in event:
                    self.progress.set_plan({str(k): (None if v is None else int(v)) for k, v in event["plan"].items()})
                elif "run" in event and event.get("name"):
                    self.progress.name(str(event["run"]), str(event["name"]))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.poll()

    def stop(self, *, flush: bool) -> None:
        """Stop polling; ``flush``: one last round first (every run that ended is shown). Closes the view."""
        self._stop.set()
        if flush:
            if self._thread.is_alive():
                self._thread.join(timeout=5)
            self.poll()
        self.view.close()


def announce_plan(plan: dict[str, int | None]) -> None:
    """In the flow process: append the plan to the progress file (nothing without one)."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps({"plan": plan}) + "\n").encode())
        finally:
            os.close(fd)
