"""Signals sent to a real ``privbench run train-dp`` while its process-pool workers train, as a terminal, an
orchestrator or the OOM killer sends them: SIGINT to the process group (Ctrl-C), SIGINT to the main process
alone, SIGTERM to the group, SIGKILL to the group (then a rerun reaps).

The four commands start together (module fixture) so that their start-ups overlap; each test then signals its
own once a grid point is training in a worker, and checks the exit code, that it exited rather than hung, the
rows (none left ``running``, the reason), MLflow's run states, Prefect's flow-run states and that no process of
the command's tree survives."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.privbench_process import privbench_process

pytestmark = pytest.mark.system  # real servers / signals to real process trees: minutes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
profile: tiny
prepare:
  datasets:
    - {name: ml-1m-tiny, source: synthetic, synthetic: {preset: ml-1m, scale: 0.05, seed: 3}}
train_dp:
  datasets: [{name: ml-1m-tiny}]
  methods: [transformer]
  epsilons: [8]
  nonprivate: true
  epochs: 400
  lrs: [0.005]
  batch_sizes: [64]
  max_len: 16
  d_model: 16
  eval_every: 1
  workers: 2
"""
PREPARE_ONLY = """
profile: tiny
prepare:
  datasets:
    - {name: ml-1m-tiny, source: synthetic, synthetic: {preset: ml-1m, scale: 0.05, seed: 3}}
"""
READY_TIMEOUT_S = 600  # four commands start at once on a 2-core machine
HANG_S = 60  # an interrupted command that has not exited by then hangs


@dataclass
class Command:
    name: str
    home: Path
    proc: subprocess.Popen[str]
    env: dict[str, str]
    tree: list[psutil.Process] = field(default_factory=list)
    exit_s: float | None = None

    def rows(self) -> list[dict]:
        """The store's runs, read around privbench (SQLite file, or the PostgreSQL of ``PRIVBENCH_DB_URL``)."""
        url = self.env.get("PRIVBENCH_DB_URL")
        if url:
            from sqlalchemy import create_engine, text
            from sqlalchemy.exc import ProgrammingError

            engine = create_engine(url)
            try:
                with engine.connect() as conn:
                    return [dict(r._mapping) for r in conn.execute(text("select * from runs order by started_at"))]
            except ProgrammingError:  # not migrated yet
                return []
            finally:
                engine.dispose()
        db = self.home / "results.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        con.row_factory = sqlite3.Row
        try:
            return [dict(r) for r in con.execute("select * from runs order by started_at")]
        except sqlite3.OperationalError:  # not migrated yet
            return []
        finally:
            con.close()

    def wait_until_training(self) -> None:
        """Until a grid point runs in a worker process (not the flow process): then the tree is complete."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited early:\n{self.output()}"
            points = [
                r
                for r in self.rows()
                if r["technique"] != "flow"
                and r["stage"] == "train-dp"
                and r["status"] == "running"
                and r["mlflow_run_id"]
            ]
            if points:
                self.tree = psutil.Process(self.proc.pid).children(recursive=True)
                assert any(p.pid == points[0]["pid"] for p in self.tree)
                return
            time.sleep(1)
        pytest.fail(f"{self.name}: no grid point started within {READY_TIMEOUT_S} s")

    def signal_and_wait(self, signum: int, *, group: bool) -> int:
        t0 = time.monotonic()
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"{self.name}: still running {HANG_S} s after the signal:\n{self.output()}")
        self.exit_s = time.monotonic() - t0
        return code

    def survivors(self, within: float = 15.0) -> list[str]:
        _gone, alive = psutil.wait_procs(self.tree, timeout=within)
        return [" ".join(p.cmdline()[:4]) for p in alive if p.is_running()]

    def output(self) -> str:
        return (self.home / "out.txt").read_text(errors="replace")[-4000:]

    def mlflow_status(self, run_id: str) -> str:
        con = sqlite3.connect(f"file:{self.home / 'mlflow.db'}?mode=ro", uri=True, timeout=30)
        try:
            return con.execute("select status from runs where run_uuid = ?", (run_id,)).fetchone()[0]
        finally:
            con.close()

    def prefect_states(self) -> dict[str, str]:
        """flow name -> state type of each flow run in this command's own Prefect database."""
        con = sqlite3.connect(f"file:{self.home / 'prefect' / 'prefect.db'}?mode=ro", uri=True, timeout=30)
        try:
            return dict(
                con.execute(
                    "select f.name, r.state_type from flow_run r join flow f on f.id = r.flow_id order by r.created"
                )
            )
        finally:
            con.close()


def start(
    name: str, base: Path, config: str = CONFIG, home: Path | None = None, extra_env: dict[str, str] | None = None
) -> Command:
    home = home or base / name
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / f"{name}.yaml"
    cfg.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "PRIVBENCH_"))}
    env |= {
        "PRIVBENCH_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
        "PRIVBENCH_HEARTBEAT_SECONDS": "2",
    } | (extra_env or {})
    out = open(home / "out.txt", "a")  # noqa: SIM115 -- closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "privbench", "run", "train-dp" if config is CONFIG else "prepare", "-c", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # its own process group, as under a terminal
    return Command(name, home, proc, env)


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("signals")
    started = {
        name: start(name, base)
        for name in ("group-sigint", "main-sigint", "group-sigterm", "group-sigkill", "main-sigkill")
    }
    yield started
    for c in started.values():
        if c.proc.poll() is None:
            os.killpg(c.proc.pid, signal.SIGKILL)


def check_interrupted(c: Command, signame: str) -> list[dict]:
    rows = c.rows()
    assert not [r for r in rows if r["status"] == "running"], f"rows left running:\n{c.output()}"
    failed = [r for r in rows if r["status"] == "failed"]
    assert failed, c.output()
    assert any(r["technique"] == "flow" for r in failed)  # the train-dp flow row
    assert any(r["technique"] != "flow" and r["mlflow_run_id"] for r in failed)  # the point that was training
    for r in failed:
        assert f"interrupted ({signame})" in r["error"] or "termination signal" in r["error"], r["error"]
        if r["mlflow_run_id"]:  # None: killed between its row and its MLflow run
            assert c.mlflow_status(r["mlflow_run_id"]) == "KILLED", r
        assert r["finished_at"] is not None
    assert not c.survivors(), f"processes of the command outlived it: {c.survivors()}"
    states = c.prefect_states()
    assert states.get("train-dp") in {"CANCELLED", "CRASHED"}, states
    assert "RUNNING" not in states.values(), states
    return rows


def test_one_ctrl_c_to_the_process_group_stops_everything_and_exits_130(commands: dict[str, Command]) -> None:
    c = commands["group-sigint"]
    c.wait_until_training()
    # one temporary Prefect API server for the command, shared by the flow process and its workers
    servers = [p for p in c.tree if "prefect.server.api.server:create_app" in " ".join(p.cmdline())]
    assert len(servers) == 1, [" ".join(p.cmdline()[:6]) for p in servers]
    assert c.signal_and_wait(signal.SIGINT, group=True) == 130, c.output()
    check_interrupted(c, "SIGINT")
    assert "interrupted (SIGINT): marked" in c.output()
    assert "Traceback" not in c.output()


def test_sigint_to_the_main_process_stops_the_children_before_failing_the_parent(commands: dict[str, Command]) -> None:
    c = commands["main-sigint"]
    c.wait_until_training()
    assert c.signal_and_wait(signal.SIGINT, group=False) == 130, c.output()
    rows = check_interrupted(c, "SIGINT")
    parents = {r["id"]: r for r in rows if r["technique"] == "flow" and r["status"] == "failed"}
    late = [
        r
        for r in rows
        if r["parent_id"] in parents
        and r["status"] == "finished"
        and r["finished_at"] > parents[r["parent_id"]]["finished_at"]
    ]
    assert not late, f"children finished after their parent was failed: {late}"


def test_sigterm_to_the_process_group_ends_killed_not_failed(commands: dict[str, Command]) -> None:
    c = commands["group-sigterm"]
    c.wait_until_training()
    assert c.signal_and_wait(signal.SIGTERM, group=True) == 143, c.output()
    check_interrupted(c, "SIGTERM")


def test_sigkill_of_the_process_group_is_reaped_by_the_next_flow_start(commands: dict[str, Command]) -> None:
    c = commands["group-sigkill"]
    c.wait_until_training()
    held = {p.pid for p in c.tree}
    assert c.signal_and_wait(signal.SIGKILL, group=True) == -signal.SIGKILL
    # the temporary Prefect API server runs in a session of its own; it must die with the command
    assert not c.survivors(), f"processes outlived a SIGKILL of their command: {c.survivors()}"
    left = [r for r in c.rows() if r["status"] == "running"]
    assert left and {r["pid"] for r in left} <= held | {c.proc.pid}
    assert c.prefect_states().get("train-dp") == "RUNNING"  # nothing could tell Prefect
    rerun = start("rerun", c.home.parent, PREPARE_ONLY, home=c.home)
    assert rerun.proc.wait(timeout=READY_TIMEOUT_S) == 0, rerun.output()
    by_id = {r["id"]: r for r in c.rows()}
    for r in left:
        done = by_id[r["id"]]
        assert done["status"] == "failed" and "is gone" in done["error"], done
        if done["mlflow_run_id"]:
            assert c.mlflow_status(done["mlflow_run_id"]) == "FAILED"
    states = c.prefect_states()
    assert "RUNNING" not in states.values(), states


def test_sigkill_of_the_main_process_takes_its_tree_down_and_results_reap_closes_the_rows(
    commands: dict[str, Command],
) -> None:
    """Only the supervisor is killed: the flow process notices, kills its workers and exits; nothing trains on
    unsupervised, and ``privbench results reap`` marks the rows they held."""
    c = commands["main-sigkill"]
    c.wait_until_training()
    assert c.signal_and_wait(signal.SIGKILL, group=False) == -signal.SIGKILL
    assert not c.survivors(within=30), f"processes outlived their supervisor: {c.survivors()}"
    left = [r for r in c.rows() if r["status"] == "running"]
    assert left
    out = privbench_process(["results", "reap", "--json"], c.env)
    assert out.returncode == 0, out.stderr
    assert {r["run_id"] for r in json.loads(out.stdout)} == {r["id"] for r in left}
    assert not [r for r in c.rows() if r["status"] == "running"]
