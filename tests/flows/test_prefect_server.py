"""The deployments for real: a Prefect server on 127.0.0.1, ``privbench deploy``, a process worker on the ``cpu``
pool, tiny train-dp runs triggered through ``run_deployment``; the concurrency limit; a worker's flow process killed
mid-run together with its worker, as when the host dies (the zombie automation crashes the run once its heartbeats
stop; its store rows end failed) and the retried run finishing with the completed tasks reused. Workers stop on
SIGINT, before the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.system  # real servers / signals to real process trees: minutes

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = [
    "train_dp.datasets=[{name: ml-100k}]",
    "train_dp.methods=[transformer]",
    "train_dp.nonprivate=false",
    "train_dp.peers=[]",
    "train_dp.workers=1",
    "train_dp.max_len=20",
    "train_dp.d_model=32",
]
HEARTBEAT_S, ZOMBIE_AFTER_S = 30, 90  # Prefect's shortest heartbeat period; 3 missed heartbeats crash a run (its docs)


@dataclass
class Server:
    url: str
    env: dict[str, str]
    tmp: Path

    def sqlite(self, sql: str) -> list[tuple]:
        import sqlite3

        if not (self.tmp / "pb" / "results.db").exists():
            return []
        with sqlite3.connect(self.tmp / "pb" / "results.db", timeout=30) as conn:
            return conn.execute(sql).fetchall()


def _deploy(server: Server, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``privbench deploy ARGS`` against ``server``, from its folder, the output captured (``check``: raise on a
    failure)."""
    return subprocess.run(
        [str(BIN / "privbench"), "deploy", *args],
        env=server.env,
        cwd=server.tmp,
        capture_output=True,
        text=True,
        check=check,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args[:4]} did not stop on {signal.Signals(sig).name}") from None
    return proc.returncode


@pytest.fixture(scope="module", autouse=True)
def sigint_not_ignored() -> Iterator[None]:
    """These tests stop the worker and ``privbench serve`` with SIGINT. A test run started as a shell's background
    job (``cmd &`` without job control) has SIGINT ignored, and every process it starts would inherit that and never
    stop; with a Python handler here the children start with SIGINT's default action (exec resets handlers)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("prefect-server")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PRIVBENCH_", "MLFLOW_"))}
    env |= {
        "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOCAL_STORAGE_PATH": str(tmp / "results"),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PRIVBENCH_HOME": str(tmp / "pb"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    log = open(tmp / "server.log", "w")  # noqa: SIM115 -- the server writes to it until the fixture ends
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            return False

    try:
        _wait(healthy, 180, "the Prefect server")
        started = Server(url, env, tmp)
        done = _deploy(started, "--zombie-after", str(ZOMBIE_AFTER_S))
        assert done.returncode == 0, done.stderr
        yield started
    finally:
        _stop(proc, signal.SIGINT, timeout=60)
        log.close()


@contextmanager
def worker(server: Server, pool: str = "cpu") -> Iterator[subprocess.Popen]:
    """A process worker started outside the checkout: the deployments' pull step finds the code."""
    log = open(server.tmp / f"worker-{pool}.log", "a")  # noqa: SIM115 -- open while the worker runs
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"],
        env=server.env,
        cwd=server.tmp,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        assert _stop(proc, signal.SIGINT, timeout=90) is not None
        log.close()
        _settle(server)


def _settle(server: Server) -> None:
    """Leave no flow run holding a deployment's concurrency slot for the next test: a run a failed test left
    behind is cancelled and the limits are emptied (otherwise CANCEL_NEW cancels the next test's run)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
    from prefect.states import Cancelled

    with api(server) as client:
        for run in client.read_flow_runs():
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Cancelled(message="left behind by a test"), force=True)
        for limit in client.read_global_concurrency_limits(limit=200):
            if limit.name.startswith("deployment:") and limit.active_slots:
                client.update_global_concurrency_limit(limit.name, GlobalConcurrencyLimitUpdate(active_slots=0))


@contextmanager
def api(server: Server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.url}):
        from prefect import get_client

        with get_client(sync_client=True) as client:
            yield client


def _trigger(server: Server, overrides: list[str]) -> str:
    from prefect.deployments import run_deployment

    with api(server):
        run = run_deployment(
            "train-dp-profile/train-dp", parameters={"profile": "quick", "overrides": overrides}, timeout=0
        )
    return str(run.id)


def _state(server: Server, flow_run_id: str) -> str | None:
    with api(server) as client:
        state = client.read_flow_run(flow_run_id).state
    return None if state is None else state.type.value


def _final_state(server: Server, flow_run_id: str, timeout: float = 240) -> str:
    def final() -> str | None:
        with api(server) as client:
            state = client.read_flow_run(flow_run_id).state
        return state.type.value if state is not None and state.is_final() else None

    return _wait(final, timeout, f"flow run {flow_run_id} to end", step=1)


def _retry(server: Server, run_id: str) -> None:
    """``prefect flow-run retry``, repeated if the worker's late crash report overwrites the rescheduling."""
    with api(server) as client:
        runs_before = client.read_flow_run(run_id).run_count
    for _ in range(3):
        done = subprocess.run(
            [str(BIN / "prefect"), "flow-run", "retry", run_id],
            env=server.env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

        def started() -> bool | None:
            with api(server) as client:
                fr = client.read_flow_run(run_id)
            return fr.run_count > runs_before or None

        try:
            _wait(started, 30, "the retried run to start", step=1)
            return
        except AssertionError:
            continue
    raise AssertionError(f"flow run {run_id} did not start again after 3 retries")


def test_deploy_registers_every_deployment_with_schedules_pools_and_limits(server: Server) -> None:
    spec = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())
    with api(server) as client:
        deployments = {d.name: d for d in client.read_deployments()}
        pools = {p.name: p.type for p in client.read_work_pools()}
    assert set(deployments) == {d["name"] for d in spec["deployments"]}
    assert pools["cpu"] == "process" and pools["gpu"] == "process"
    for dep in spec["deployments"]:
        got = deployments[dep["name"]]
        assert got.work_pool_name == dep["work_pool"]["name"], dep["name"]
        assert got.parameters == dep["parameters"], dep["name"]
        assert got.concurrency_options.collision_strategy == "CANCEL_NEW", dep["name"]
        assert got.global_concurrency_limit.limit == 1, dep["name"]
        assert got.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(ROOT)
    crons = {name: [s.schedule.cron for s in d.schedules] for name, d in deployments.items() if d.schedules}
    assert crons == {"benchmark-quick": ["0 2 * * *"], "benchmark-paper": ["0 4 * * 6"]}
    assert {n for n, d in deployments.items() if d.work_pool_name == "gpu"} == {
        "benchmark-paper",
        "secure-inference-gpu",
        "stip-gpu",
    }
    with api(server) as client:
        (zombie,) = client.read_automations_by_name("privbench: crash flow runs that stopped heartbeating")
    assert zombie.enabled and zombie.trigger.within.total_seconds() == ZOMBIE_AFTER_S
    assert zombie.trigger.after == {"prefect.flow-run.heartbeat"} and zombie.trigger.posture == "Proactive"
    assert [(a.type, a.state.value) for a in zombie.actions] == [("change-flow-run-state", "CRASHED")]
    # deploying again updates the one automation instead of adding a second
    done = _deploy(server, "--only", "prepare", "--zombie-after", "600")
    assert done.returncode == 0 and "updated automation" in done.stderr, done.stderr
    with api(server) as client:
        (zombie,) = client.read_automations_by_name("privbench: crash flow runs that stopped heartbeating")
    assert zombie.trigger.within.total_seconds() == 600
    done = _deploy(server, "--only", "prepare", "--zombie-after", "10")
    assert done.returncode == 2 and "--zombie-after 10 s is shorter than the heartbeat period" in done.stderr
    assert "deployed" not in done.stderr  # refused before anything was registered
    _deploy(server, "--only", "prepare", "--zombie-after", str(ZOMBIE_AFTER_S), check=True)


def test_worker_runs_a_deployment_and_the_limit_cancels_a_second_run(server: Server) -> None:
    with worker(server):
        first = _trigger(server, [*TINY, "train_dp.epsilons=[8]", "train_dp.epochs=2"])
        # the second run comes while the first runs (triggered together, the worker may submit either first)
        assert (
            _wait(
                lambda: _state(server, first) in {"RUNNING", "COMPLETED", "FAILED", "CRASHED"},
                120,
                "the first run to start",
            )
            and _state(server, first) == "RUNNING"
        )
        second = _trigger(server, [*TINY, "train_dp.epsilons=[8]", "train_dp.epochs=1"])
        assert _final_state(server, first) == "COMPLETED"
        assert _final_state(server, second) == "CANCELLED"
    rows = server.sqlite("select technique, status, prefect_flow_run_id from runs where stage = 'train-dp'")
    assert sorted((t, s) for t, s, _ in rows) == [("flow", "finished"), ("transformer", "finished")]
    with api(server) as client:
        sub = client.read_flow_run(rows[0][2])
        parent_task = client.read_task_run(sub.parent_task_run_id)
    assert str(parent_task.flow_run_id) == first  # recorded under the deployment's flow run


def test_killed_worker_host_leaves_a_crashed_run_and_the_retry_reuses_completed_tasks(server: Server) -> None:
    before = {r[0] for r in server.sqlite("select id from runs")}
    with worker(server) as proc:
        run_id = _trigger(server, [*TINY, "train_dp.epsilons=[1, 2, 4, 8]", "train_dp.epochs=3"])

        def one_point_done() -> bool:
            rows = server.sqlite("select id, status from runs where technique = 'transformer'")
            return any(s == "finished" and i not in before for i, s in rows)

        _wait(one_point_done, 240, "the first grid point to finish")
        # the host dies: worker and flow process at once, so nobody is left to report the crash
        victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(victims) >= 2, "the flow-run process was not found under the worker"
        for p in victims:
            p.kill()
        psutil.wait_procs(victims, timeout=30)
        assert _state(server, run_id) == "RUNNING"  # as Prefect sees it, until the heartbeats are missed
        # crashed by the zombie automation `privbench deploy` set up
        assert _final_state(server, run_id, timeout=ZOMBIE_AFTER_S + HEARTBEAT_S + 60) == "CRASHED"
        with api(server) as client:
            assert "no heartbeat" in (client.read_flow_run(run_id).state.message or "")

    new = [r for r in server.sqlite("select id, technique, status from runs") if r[0] not in before]
    assert ("flow", "running") in {(t, s) for _, t, s in new}  # the train-dp flow was killed mid-grid
    assert {s for _, t, s in new if t == "transformer"} <= {"finished", "running"}
    finished_points = {i for i, t, s in new if t == "transformer" and s == "finished"}

    with worker(server):  # another host takes the retried run
        _retry(server, run_id)
        assert _final_state(server, run_id) == "COMPLETED"

    after = {i: (t, s) for i, t, s in server.sqlite("select id, technique, status from runs") if i not in before}
    points = {i for i, (t, s) in after.items() if t == "transformer" and s == "finished"}
    failed_points = {i for i, (t, s) in after.items() if t == "transformer" and s == "failed"}
    # 4 grid points finished in all: the ones of the killed attempt reused, not trained again
    assert finished_points <= points and len(points) == 4 and len(failed_points) <= 1
    assert [t for t, s in after.values() if s == "failed"].count("flow") == 1
    assert "running" not in {s for _, s in after.values()}
    errors = server.sqlite("select error from runs where status = 'failed'")
    assert errors and all("restarted while this run was open" in e for (e,) in errors)


def test_privbench_serve_runs_a_triggered_deployment_from_outside_the_checkout(server: Server) -> None:
    """``privbench serve`` (the one-machine way) takes over the train-dp deployment and runs a triggered run in a
    subprocess; the last test of the module, since serving replaces the registered deployment (re-registered at
    the end)."""
    before = {r[0] for r in server.sqlite("select id from runs")}
    log_path = server.tmp / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "privbench"), "serve", "--only", "train-dp", "--no-schedules"],
            env=server.env,
            cwd=server.tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait(lambda: "being served" in log_path.read_text() or proc.poll() is not None, 120, "privbench serve")
            assert proc.poll() is None, log_path.read_text()[-3000:]
            with api(server) as client:
                served = client.read_deployment_by_name("train-dp-profile/train-dp")
            assert served.global_concurrency_limit.limit == 1
            run_id = _trigger(server, [*TINY, "train_dp.epsilons=[8]", "train_dp.epochs=1"])
            # no worker polls here: the run executes in a subprocess of `privbench serve`
            _wait(lambda: _state(server, run_id) == "RUNNING", 120, "the served run to start")
            assert psutil.Process(proc.pid).children(recursive=True)
            assert _final_state(server, run_id) == "COMPLETED", log_path.read_text()[-3000:]
        finally:
            assert _stop(proc, signal.SIGINT, timeout=90) is not None
            _settle(server)
            _deploy(server, "--only", "train-dp", "--zombie-after", str(ZOMBIE_AFTER_S), check=True)
    new = [
        (st, t, s) for i, st, t, s in server.sqlite("select id, stage, technique, status from runs") if i not in before
    ]
    assert {(t, s) for st, t, s in new if st == "train-dp"} == {("flow", "finished"), ("transformer", "finished")}
    assert {s for _, _, s in new} == {"finished"}
