"""``privbench run`` as a supervisor: the flow runs in a child process, this process owns its lifetime.

Why a supervisor: inside a Prefect flow the engine replaces the SIGTERM handler, a KeyboardInterrupt lands in
whichever task-runner thread is waiting, and the process-pool workers each wait on the API; a Ctrl-C handled in
the flow's own process could hang for minutes. Here the parent runs no flow, so its signal handlers stay its own:

1. it checks that the results store is reachable before anything starts (seconds, not Prefect's start-up);
2. without ``PREFECT_API_URL`` it starts one temporary Prefect API server, in its own session (a Ctrl-C to the
   terminal's process group does not reach it) and bound to this process's life, and gives its URL to the flow
   process, whose workers inherit it: one server per command, not one per worker;
3. it starts the flow process with SIGINT ignored (inherited by every worker it spawns), so that one Ctrl-C is
   handled once, here, and tracks the flow process's descendants while it runs;
4. on the first SIGINT or SIGTERM it marks ``failed`` ("interrupted (SIGINT)", MLflow ``KILLED``) every row held
   by the flow process tree, kills the tree, marks again (a row opened in between), ends any MLflow run a killed
   process left ``RUNNING`` after marking its row, sets the Prefect flow runs
   Cancelled, stops the API server and exits 130, within seconds; a second signal exits at once;
5. when the flow process dies by itself (OOM killer, SIGKILL), its rows and orphaned workers are handled the same
   way, marked ``failed`` with the signal that killed it (MLflow ``FAILED``);
6. when this process is SIGKILLed, the API server gets SIGTERM (Linux parent-death signal) and the flow process,
   which watches its parent, kills its workers and exits: nothing runs on unsupervised, and the rows left
   ``running`` are reaped by the next flow start or ``privbench results reap``;
7. while the flow runs, a thread polls the store for the rows of the tree and shows progress
   (``privbench.progress``); the display is stopped before anything else is printed. Unless ``verbose`` (or
   ``PRIVBENCH_DEBUG``), the flow process runs with the libraries' warnings and progress bars off (``quiet_env``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Self

from core.errors import PrivbenchError, StoreError
from pbconfig.benchmark import BenchmarkConfig
from privbench.progress import PROGRESS_FILE_ENV, Monitor, View, announce_plan

CHILD_MODULE = "privbench.runner"
GRACE_S = 20.0  # the most an interrupted command spends cleaning up before it exits anyway
DEBUG_ENV = "PRIVBENCH_DEBUG"


class FlowFailed(PrivbenchError):
    """The flow process ended with an error (its message, as the flow process reported it)."""

    def __init__(self, message: str, *, kind: str | None) -> None:
        super().__init__(message)
        self.kind = kind


class PrefectUnavailable(PrivbenchError):
    """No Prefect API: the temporary server would not start."""


class Interrupted(Exception):
    """The command was stopped by a signal and cleaned up; exit 130."""

    def __init__(self, signame: str, failed: int) -> None:
        super().__init__(signame)
        self.signame = signame
        self.failed = failed


def check_store() -> None:
    """Open (and migrate) the results store now: an unreachable database is reported before anything starts."""
    from pbconfig.settings import get_settings
    from storage.db import get_engine

    get_engine(get_settings().db_url)


# the libraries' output that is not the command's: progress bars (tqdm: GGUF conversion; Hugging Face: "Loading
# weights", "Writing model shards") and advisory warnings (transformers' `loss_type=None` notice); through the
# environment, so that every worker process the flow starts inherits it
THIRD_PARTY_QUIET = {
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
# Python warnings of the libraries (``-W`` syntax: action:message start), in every process of the command:
# urllib3's PySocks notice, shown when urllib3.contrib.socks is imported before requests (which hides it)
THIRD_PARTY_WARNINGS = ("ignore:SOCKS support in urllib3",)


def hide_third_party_warnings() -> None:
    """In this process: the filters of ``THIRD_PARTY_WARNINGS``."""
    import warnings

    for spec in THIRD_PARTY_WARNINGS:
        action, message = spec.split(":", 1)
        warnings.filterwarnings(action, message=message)  # type: ignore[arg-type]


def quiet_env(debug: bool, verbose: bool = False) -> dict[str, str]:
    """Environment for the flow process: Prefect's console tracebacks of a failed task or flow only when debugging
    (the command prints one clean message; the Prefect API still gets the full log); the libraries' warnings and
    progress bars only when ``verbose`` or debugging."""
    if debug:
        return {}
    env = {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL"}
    if not verbose:
        own = os.environ.get("PYTHONWARNINGS")  # the user's filters come last: they win
        env |= THIRD_PARTY_QUIET | {"PYTHONWARNINGS": ",".join((*THIRD_PARTY_WARNINGS, *([own] if own else [])))}
    return env


@contextlib.contextmanager
def prefect_api() -> Iterator[Any]:
    """The Prefect API for this command: ``PREFECT_API_URL`` when set (yields None), else one temporary server
    (yielded; stopped after)."""
    if os.environ.get("PREFECT_API_URL"):
        yield None
        return
    from prefect.server.api.server import SubprocessASGIServer

    class _OwnSessionServer(SubprocessASGIServer):
        """The temporary server, out of the terminal's process group and killed if this process dies.

        Always a new instance, never registered in Prefect's per-port instance table: Prefect's own servers in this
        process (a test harness, say) are neither reused nor stopped by this command."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Self:
            return object.__new__(cls)

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            """Prefect's own server command (``SubprocessASGIServer._run_uvicorn_command`` in Prefect 3), started
            in a session of its own that dies with this process: passed to this one ``Popen``, never patched into
            the ``subprocess`` module, where another thread's ``Popen`` would get it too."""
            import prefect
            from prefect.settings import get_current_settings

            # its output is not the command's: a server that outlived the command must not hold its pipes open
            quiet = {} if os.environ.get(DEBUG_ENV) else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect.__module_path__.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env={
                    **os.environ,
                    **server_env,
                    **get_current_settings().to_environment_variables(exclude_unset=True),
                },
                start_new_session=True,
                # only a prctl call, before exec: no lock another thread could hold (as Prefect's own start did)
                preexec_fn=_die_with_parent,  # noqa: PLW1509
                **quiet,  # type: ignore[arg-type]
            )

        def stop(self) -> None:
            """Terminate, and kill after 2 s (its SQLite database survives that), not Prefect's 5 s wait."""
            proc = self.server_process
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self._instance_key = object()  # never the key of a server in Prefect's table: leave that entry alone
            super().stop()

    server = _OwnSessionServer()
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 -- any start-up failure is reported the same way
        server.stop()
        raise PrefectUnavailable(
            f"could not start a temporary Prefect API server: {type(exc).__name__}: {exc}; start one "
            "(`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api"
        ) from None
    try:
        yield server
    finally:
        server.stop()


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM it when this process dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Tree:
    """The flow process and every process it started, remembered after they are orphaned or gone."""

    def __init__(self, root: subprocess.Popen[bytes], exclude: set[int]) -> None:
        import psutil

        self.root = psutil.Process(root.pid)
        self.exclude = exclude
        self.seen: dict[int, Any] = {root.pid: self.root}
        self._lock = threading.Lock()

    def refresh(self) -> None:
        import psutil

        found = []
        for proc in list(self.seen.values()):
            try:
                found.extend(proc.children(recursive=True))
            except psutil.Error:
                continue
        with self._lock:
            for proc in found:
                if proc.pid not in self.exclude:
                    self.seen.setdefault(proc.pid, proc)

    @property
    def pids(self) -> set[int]:
        with self._lock:
            return set(self.seen)

    def kill(self) -> None:
        """SIGKILL every remembered process that is still the same process (psutil checks its start time)."""
        import psutil

        self.refresh()
        alive = []
        for proc in list(self.seen.values()):
            try:
                proc.kill()
                alive.append(proc)
            except psutil.Error:
                continue
        psutil.wait_procs(alive, timeout=5)


def run_supervised(
    flow: str, cfg: BenchmarkConfig, *, echo: Callable[[str], None], view: View | None = None, verbose: bool = False
) -> dict[str, Any]:
    """Run ``flow`` on ``cfg`` in a child process; its summary, or ``FlowFailed`` / ``Interrupted``. ``view``
    shows the progress (``privbench.progress``); ``verbose``: the libraries' warnings and progress bars too."""
    since = datetime.now(UTC) - timedelta(seconds=2)  # the rows of this command started after this
    check_store()
    # what an interrupt needs, imported while the flow starts (importing MLflow takes seconds)
    threading.Thread(target=_warm_imports, name="privbench-warm-imports", daemon=True).start()
    debug = bool(os.environ.get(DEBUG_ENV))
    signals: list[int] = []
    wake = threading.Event()
    live = view is not None and view.relays

    def on_signal(signum: int, _frame: Any) -> None:
        if signals:
            if live:
                with contextlib.suppress(OSError):
                    os.write(2, b"\r\n\x1b[?25h")  # the live display hid the cursor
            os._exit(130)  # a second Ctrl-C: no more waiting
        signals.append(signum)
        wake.set()

    with tempfile.TemporaryDirectory(prefix="privbench-run-") as tmp, prefect_api() as server:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        progress_file = Path(tmp) / "progress.jsonl"
        cfg_path.write_text(json.dumps(cfg.model_dump(mode="json")))
        api_url = server.api_url if server else os.environ["PREFECT_API_URL"]
        env = (
            os.environ | quiet_env(debug, verbose) | {"PREFECT_API_URL": api_url, PROGRESS_FILE_ENV: str(progress_file)}
        )
        # a live display owns the terminal: what the flow process prints is printed above it
        relay = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} if live else {}
        if live:
            env["PYTHONUNBUFFERED"] = "1"
        server_pid = server.server_process.pid if server and server.server_process else None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        # the child and all it spawns inherit SIGINT ignored: one Ctrl-C, handled here only
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, flow, str(cfg_path), str(out_path), str(os.getpid())],
                env=env,
                **relay,
            )
        finally:
            for s in previous:
                signal.signal(s, on_signal)
        monitor = relayer = None
        try:
            tree = _Tree(child, exclude={server_pid} if server_pid else set())
            if view is not None:
                monitor = Monitor(view.progress, view, pids=lambda: tree.pids, since=since, progress_file=progress_file)
                monitor.start()
                if child.stdout is not None:
                    relayer = threading.Thread(
                        target=_relay, args=(child.stdout, view), name="privbench-relay", daemon=True
                    )
                    relayer.start()
            while child.poll() is None and not wake.wait(0.5):
                tree.refresh()
            if signals:
                if monitor is not None:
                    monitor.stop(flush=False)  # the display goes before the interrupt's messages
                raise _stop(tree, signals[0], api_url, echo)
            try:
                return _outcome(child, tree, out_path, api_url)
            finally:
                if relayer is not None:
                    relayer.join(timeout=2)  # the flow process's last lines
                if monitor is not None:
                    monitor.stop(flush=True)  # every run that ended is shown, failed ones included
        finally:
            if monitor is not None:
                monitor.stop(flush=False)  # no-op when stopped already
            if child.stdout is not None and (relayer is None or not relayer.is_alive()):
                with contextlib.suppress(OSError):  # (closing it under a blocked reader would wait on it)
                    child.stdout.close()
            for s, handler in previous.items():
                signal.signal(s, handler)


def _relay(stream: Any, view: View) -> None:
    """Print each line the flow process writes through ``view`` (a progress bar's last state only)."""
    with contextlib.suppress(Exception):
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
            if line.strip():
                view.child_output(line)


def _warm_imports() -> None:
    with contextlib.suppress(Exception):
        import tasks.records  # noqa: F401
        from storage.recording import get_tracker

        get_tracker()  # opening the MLflow store checks its schema: seconds


def _outcome(child: subprocess.Popen[bytes], tree: _Tree, out_path: Path, api_url: str) -> dict[str, Any]:
    result = json.loads(out_path.read_text()) if out_path.exists() and out_path.stat().st_size else None
    if child.returncode == 0 and result is not None and result.get("ok"):
        return result["summary"]
    if result is not None and not result.get("ok"):
        raise FlowFailed(result["error"], kind=result.get("kind"))
    # killed from outside (OOM killer, SIGKILL): nothing reported; its workers may live on as orphans
    code = child.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    tree.kill()
    from storage.recovery import end_mlflow_runs_of_processes, fail_runs_of_processes

    failed = fail_runs_of_processes(tree.pids, f"the flow process {how}", interrupted=False)
    end_mlflow_runs_of_processes(tree.pids, interrupted=False)
    _end_prefect_runs({fr for _, fr in failed if fr}, f"the flow process {how}", api_url, cancelled=False)
    raise FlowFailed(
        f"the flow process {how} before it reported a result; {len(failed)} run(s) it held were marked failed",
        kind=None,
    )


def _stop(tree: _Tree, signum: int, api_url: str, echo: Callable[[str], None]) -> Interrupted:
    """Mark the tree's rows failed, kill the tree, mark again, cancel the Prefect flow runs; within GRACE_S."""
    from storage.recovery import end_mlflow_runs_of_processes, fail_runs_of_processes

    name = signal.Signals(signum).name
    watchdog = threading.Timer(GRACE_S, lambda: os._exit(130))
    watchdog.daemon = True
    watchdog.start()
    echo(f"interrupted ({name}): stopping the flow and its workers ...")
    tree.refresh()
    reason = f"interrupted ({name})"
    failed = fail_runs_of_processes(tree.pids, reason)
    tree.kill()
    failed += fail_runs_of_processes(tree.pids, reason)
    end_mlflow_runs_of_processes(tree.pids)  # rows a killed process marked failed before it ended their MLflow run
    flow_runs = {fr for _, fr in failed if fr} | _flow_runs_of(tree.pids)
    cancelled = _end_prefect_runs(flow_runs, reason, api_url, cancelled=True)
    echo(f"interrupted ({name}): marked {len(failed)} run(s) failed, cancelled {cancelled} Prefect flow run(s)")
    return Interrupted(name, len(failed))


def _flow_runs_of(pids: set[int]) -> set[str]:
    """The Prefect flow runs of every row the tree opened (any status): a killed flow process leaves them Running."""
    from storage.process_runs import prefect_flow_runs_of_processes

    return prefect_flow_runs_of_processes(pids)


def _end_prefect_runs(flow_runs: set[str], reason: str, api_url: str, *, cancelled: bool) -> int:
    """Cancel (or crash) the flow runs in Prefect at ``api_url`` (this command's API, never an ephemeral server
    started for the call: that one would outlive an ``os._exit``), giving up after a few seconds."""
    if not flow_runs:
        return 0
    from tasks.records import end_prefect_flow_runs

    done: list[int] = []

    def work() -> None:
        with contextlib.suppress(Exception):
            done.append(end_prefect_flow_runs(flow_runs, reason, cancelled=cancelled, api_url=api_url))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=8)
    return done[0] if done else 0


def _orphan_watchdog(supervisor_pid: int) -> None:
    """In the flow process: when the supervisor is gone (SIGKILLed), kill this process's workers and exit, so that
    nothing runs on unsupervised; the rows left ``running`` are reaped by the next flow start (their PIDs gone)."""
    import psutil

    while True:
        time.sleep(1.0)
        if os.getppid() != supervisor_pid:
            with contextlib.suppress(psutil.Error):
                for proc in psutil.Process().children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
            os._exit(137)


def child_main(argv: list[str]) -> int:
    """The flow process: run the flow, write ``{"ok": true, "summary": ...}`` or the error to the result file."""
    flow, cfg_path, out_path, supervisor = argv
    threading.Thread(
        target=_orphan_watchdog, args=(int(supervisor),), name="privbench-orphan-watchdog", daemon=True
    ).start()
    from flows.registry import plan, run_flow
    from pbconfig.benchmark import validate

    out = Path(out_path)
    try:
        cfg = validate(BenchmarkConfig, json.loads(Path(cfg_path).read_text()), origin=cfg_path)
        with contextlib.suppress(Exception):  # a plan it cannot tell is shown as unknown; the flow says why
            announce_plan(plan(flow, cfg))
        summary = run_flow(flow, cfg)
    except Exception as exc:  # noqa: BLE001 -- reported to the supervisor, which prints one clean message
        if os.environ.get(DEBUG_ENV):
            import traceback

            traceback.print_exc()
        kind = None if isinstance(exc, PrivbenchError) else type(exc).__name__
        _write(out, {"ok": False, "error": str(exc), "kind": kind})
        return 1
    _write(out, {"ok": True, "summary": summary})
    return 0


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, default=str))
    tmp.replace(path)


__all__ = ["FlowFailed", "Interrupted", "StoreError", "check_store", "child_main", "run_supervised"]
