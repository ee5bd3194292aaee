"""The progress of ``privbench run``: counting, numbering and the estimate on a known sequence of row states, the
plain lines and the live display they make, the rows the store gives for a command, the plans of the flows, the
libraries' noise kept out by default, and a real piped run that prints one line per run of the store."""

from __future__ import annotations

import io
import json
import os
import re
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console

from privbench.progress import (
    PROGRESS_FILE_ENV,
    LiveView,
    Monitor,
    PlainView,
    Progress,
    RunState,
    command_rows,
    duration,
)
from tests.privbench_process import privbench_process

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_000.0


def row(
    id: str,
    flow: str,
    technique: str,
    status: str = "running",
    *,
    dataset: str | None = None,
    started: float = T0,
    duration_s: float | None = None,
    parent: str | None = None,
    error: str | None = None,
    name: str | None = None,
) -> RunState:
    return RunState(
        id=id,
        parent_id=parent,
        flow=flow,
        stage=flow,
        technique=technique,
        dataset=dataset,
        status=status,
        started=started,
        duration_s=duration_s,
        error=error,
        name=name,
    )


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (0.04, 3.25, 59.9, 60, 65.4, 3599, 3600, 7380)] == [
        "0.0s",
        "3.2s",
        "59.9s",
        "1m00s",
        "1m05s",
        "59m59s",
        "1h00m",
        "2h03m",
    ]


def test_a_known_sequence_of_row_states() -> None:
    p = Progress("train-dp", started=T0 - 40)
    assert p.total is None and p.counter() == "0/?"
    p.set_plan({"prepare": 2, "train-dp": 3})
    prep = row("p", "prepare", "flow", started=T0)
    data = row("d", "prepare", "seqrec-prep", dataset="ml-100k", started=T0 + 1, parent="p")
    assert p.update([prep, data]) == []
    assert p.done == 0 and p.total == 5 and p.stage == "prepare" and [r.id for r in p.running()] == ["d"]
    assert p.eta(T0 + 5) is None  # nothing ended yet: no rate

    # both end between two polls: numbered in the order they ended (the dataset first), each once
    ended = p.update(
        [
            row("p", "prepare", "flow", "finished", started=T0, duration_s=4.0),
            row(
                "d", "prepare", "seqrec-prep", "finished", dataset="ml-100k", started=T0 + 1, duration_s=2.0, parent="p"
            ),
        ]
    )
    assert [(i, r.id) for i, r in ended] == [(1, "d"), (2, "p")]
    assert [p.line(i, r) for i, r in ended] == [
        "[1/5]  prepare  seqrec-prep  ml-100k  finished  2.0s",
        "[2/5]  prepare  flow  finished  4.0s",
    ]
    assert p.update([row("p", "prepare", "flow", "finished", started=T0, duration_s=4.0)]) == []

    p.name("g", "gru:ml-100k:eps8:seed0")  # announced before the poll sees its row
    flow = row("f", "train-dp", "flow", started=T0 + 5, name="train-dp flow")
    gru = row("g", "train-dp", "gru", dataset="ml-100k", started=T0 + 6, parent="f")
    assert p.update([flow, gru]) == []
    assert p.stage == "train-dp" and p.running()[0].title == "gru  ml-100k  eps8:seed0"
    assert p.stages() == [("prepare", 2, 2), ("train-dp", 0, 3)]

    (ended,) = p.update(
        [
            flow,
            row(
                "g",
                "train-dp",
                "gru",
                "failed",
                dataset="ml-100k",
                started=T0 + 6,
                duration_s=3.5,
                parent="f",
                error="DivergedError: loss is nan\nat epoch 2",
            ),
        ]
    )
    assert p.line(*ended) == "[3/5]  train-dp  gru  ml-100k  eps8:seed0  failed  3.5s  (DivergedError: loss is nan)"
    # 3 of 5 ended 12 s after the first run started: 2 left at 4 s each
    assert p.eta(T0 + 12) == pytest.approx(8.0)
    assert p.counter() == "3/5"

    # more runs than planned (a retried task): the total is no longer claimed
    p.update([row(f"x{i}", "train-dp", "gru", started=T0 + 20) for i in range(3)])
    assert p.total is None and p.counter() == "3/?" and p.eta(T0 + 30) is None
    assert p.stages()[1] == ("train-dp", 1, None)


def test_names_that_repeat_the_technique_and_dataset_are_not_shown_twice() -> None:
    assert row("a", "stip", "stip-user_embed", dataset="gpt2", name="stip-user_embed:gpt2").detail == ""
    shard = row("a", "tangent", "taft-shard", dataset="fm", name="taft shard 3/5")
    assert shard.title == "taft-shard  fm  taft shard 3/5"
    assert row("a", "attacks", "flow", name="attacks flow").title == "flow"
    assert row("a", "attacks", "seb-coverage").title == "seb-coverage"


def test_the_plain_view_prints_one_line_per_ended_run_and_nothing_after_it_closed() -> None:
    out = io.StringIO()
    p = Progress("prepare", started=T0)
    view = PlainView(p, Console(file=out, width=60, color_system=None))
    view.update(
        p.update(
            [
                row("a", "prepare", "text-prep", dataset="kjv"),
                row("b", "prepare", "seqrec-prep", "finished", dataset="ml-100k", duration_s=75.0),
            ]
        )
    )
    view.update(
        p.update(
            [
                row(
                    "a",
                    "prepare",
                    "text-prep",
                    "failed",
                    dataset="kjv",
                    duration_s=1.0,
                    error="DataError: see postgresql://bob:hunter2@db/x",
                )
            ]
        )
    )
    view.close()
    view.update(p.update([row("c", "prepare", "flow", "finished", duration_s=80.0)]))
    assert out.getvalue().splitlines() == [
        "[1/?]  prepare  seqrec-prep  ml-100k  finished  1m15s",  # not wrapped at 60 columns either
        "[2/?]  prepare  text-prep  kjv  failed  1.0s  (DataError: see postgresql://bob:***@db/x)",
    ]


def test_the_live_view_shows_stage_counts_runs_in_progress_and_the_estimate() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, color_system=None, force_terminal=False)
    p = Progress("benchmark", started=T0 - 30)
    view = LiveView(p, console, "privbench run benchmark (profile quick)")
    head, body = p.renderable(view.title, now=T0)
    assert body is None and "starting the flow process" in head.plain
    p.set_plan({"benchmark": 1, "prepare": 2, "train-dp": 10})
    p.update(
        [
            row("b", "benchmark", "flow"),
            row("p", "prepare", "flow", "finished", duration_s=5.0, parent="b"),
            row("d", "prepare", "seqrec-prep", "finished", dataset="ml-100k", duration_s=2.0, parent="p"),
            row("f", "train-dp", "flow", started=T0 + 6, parent="b"),
            row("g", "train-dp", "gru", dataset="ml-100k", started=T0 + 7, parent="f", name="gru:ml-100k:eps8"),
        ]
    )
    head, body = p.renderable(view.title, now=T0 + 40)
    console.print(head)
    console.print(body)
    shown = out.getvalue()
    assert "privbench run benchmark (profile quick) · 1m10s · 2/13 runs · ETA ~3m40s" in shown  # 40 s per 2 runs
    assert "prepare 2/2 · train-dp 0/10" in shown
    assert "\nrunning train-dp  gru  ml-100k  eps8  33.0s\n" in shown
    assert "\nlast    prepare  flow  finished  5.0s" in shown


def test_what_the_flow_process_prints_is_relayed_line_by_line_above_a_live_display() -> None:
    from privbench.supervisor import _relay

    class Collect:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def child_output(self, line: str) -> None:
            self.lines.append(line)

    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(b"a warning of ours\n\nbar:  10%\rbar: 100%\r\n\xff odd bytes\nno newline at the end")
    view = Collect()
    with os.fdopen(read, "rb") as r:
        _relay(r, view)  # type: ignore[arg-type]
    assert view.lines == ["a warning of ours", "bar: 100%", "\ufffd odd bytes", "no newline at the end"]


def test_the_monitor_reads_whole_lines_of_the_progress_file(tmp_path: Path) -> None:
    file = tmp_path / "progress.jsonl"
    p = Progress("stip")
    monitor = Monitor(
        p, PlainView(p, Console(file=io.StringIO())), pids=set, since=datetime.now(UTC), progress_file=file
    )
    monitor._read_file()  # no file yet
    file.write_bytes(b'{"plan": {"stip": 10}}\n{"run": "r1", "name": "stip-vocab_perm: gpt2"}\nnot json\n{"run": "r2",')
    monitor._read_file()
    assert p.plan == {"stip": 10} and p.names == {"r1": "stip-vocab_perm: gpt2"}
    with file.open("ab") as f:
        f.write(b' "name": "second"}\n')
    monitor._read_file()
    assert p.names["r2"] == "second"


def test_the_rows_of_a_command_are_its_processes_and_what_nests_under_them(home: Path) -> None:
    from sqlalchemy import update

    from pbconfig.settings import get_settings
    from storage.db import session_scope
    from storage.models import Run
    from storage.recording import finish_run, record_run, start_run

    with record_run(flow="prepare", stage="data", technique="seqrec-prep", config={}, dataset="old", track=False):
        pass
    since = datetime.now(UTC)
    with session_scope(get_settings().db_url) as session:  # an older run of this same PID: not this command's
        session.execute(update(Run).values(started_at=since - timedelta(minutes=5)))
    parent = start_run(flow="train-dp", stage="train-dp", technique="flow", config={}, track=False)
    with record_run(
        flow="train-dp", stage="train-dp", technique="gru", config={}, dataset="ml-100k", parent=parent.ref, track=False
    ) as remote:
        pass
    with session_scope(get_settings().db_url) as session:  # as if a worker on another host had recorded it
        session.execute(update(Run).where(Run.id == remote.run_id).values(host="elsewhere", pid=1))
    rows = {r.id: r for r in command_rows({os.getpid()}, since, set())}
    assert set(rows) == {parent.run_id, remote.run_id}
    assert rows[remote.run_id].status == "finished" and rows[remote.run_id].duration_s is not None
    assert rows[parent.run_id].status == "running" and rows[parent.run_id].started >= since.timestamp() - 1
    assert {r.id for r in command_rows(set(), since, {parent.run_id})} == {remote.run_id}
    finish_run(parent)


# ---------------------------------------------------------------------------------------------------- plans


def test_the_plans_of_the_quick_profile() -> None:
    """Counted from real quick runs: prepare (9 rows), stip (5 rows; the quick run with an unattacked SmolLM2 design
    recorded 6, which the same count gives); train-dp and tangent from reduced ones."""
    from flows.registry import FLOWS, plan
    from pbconfig.benchmark import load_config

    cfg = load_config("quick")
    assert set(FLOWS) == {"prepare", "train-dp", "tangent", "secure-inference", "stip", "attacks", "benchmark"}
    assert plan("prepare", cfg) == {"prepare": 9}
    assert plan("stip", cfg) == {"stip": 5}
    # 1 dataset x (5 methods x 3 epsilons + 4 non-private + 2 peers) + the flow; its prepare: the dataset + flow
    assert plan("train-dp", cfg) == {"prepare": 2, "train-dp": 22}
    reduced = load_config(
        "quick",
        overrides=(
            "train_dp.methods=[gru, dpformer]",
            "train_dp.epsilons=[8]",
            "train_dp.peers=[transformer_opacus_hooks]",
            "train_dp.datasets=[{name: ml-100k}]",
        ),
    )
    assert sum(plan("train-dp", reduced).values()) == 7  # a real run recorded 7
    tangent = load_config(
        "quick",
        overrides=(
            "tangent.shards=[2]",
            "tangent.fig1_shards=2",
            "tangent.forget_request_shards=1",
            "tangent.dp.regimes=[fc]",
            "tangent.dp.epsilons=[8]",
        ),
    )
    # 17 before the forget request's 5 runs (TAFT, its subtraction, SISA retrain and drop, full retraining)
    assert plan("tangent", tangent) == {"prepare": 3, "tangent": 22}
    seeds = load_config("quick", overrides=("tangent.seeds=[0, 1]",))
    assert plan("tangent", seeds)["tangent"] == 1 + 2 * plan("tangent", cfg)["tangent"]  # a run over 2 seed passes
    whole = plan("benchmark", cfg)
    assert whole["benchmark"] == 1 and whole["prepare"] == 9
    # the quick benchmarks at bb5363e and 20af7a6 recorded these per flow (the attacks stage's 26: the unlearning
    # audit's feature cache was once left out of the count)
    assert whole == {
        "benchmark": 1,
        "prepare": 9,
        "train-dp": 22,
        "tangent": 59,
        "secure-inference": 20,
        "stip": 5,
        "attacks": 26,
    }
    assert {k: v for k, v in whole.items() if k not in ("benchmark", "prepare")} == {
        f: plan(f, cfg)[f] for f in ("train-dp", "tangent", "secure-inference", "stip", "attacks")
    }


def test_a_plan_without_its_section_is_a_config_error() -> None:
    from core.errors import ConfigError
    from flows.registry import plan
    from pbconfig.benchmark import load_config

    cfg = load_config("quick", overrides=("stip=null",))
    with pytest.raises(ConfigError, match="no stip section"):
        plan("stip", cfg)
    assert "stip" not in plan("benchmark", cfg)


# ----------------------------------------------------------------------------------------- libraries' noise

NOISE = """
import logging, warnings
from tqdm.auto import tqdm
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging
list(tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
list(hf_logging.tqdm(range(3), desc="Loading weights"))
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16, n_positions=8))
model.loss_type = None
model.loss_function
warnings.warn("SOCKS support in urllib3 requires the installation of optional dependencies", Warning)
warnings.warn("ours: a warning of our own")
print("ours: still shown")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_the_libraries_noise_is_off_unless_verbose(verbose: bool) -> None:
    from privbench.supervisor import quiet_env

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "HF_", "TRANSFORMERS_", "PYTHONWARN"))}
    done = subprocess.run(
        [sys.executable, "-c", NOISE],
        env=env | quiet_env(False, verbose),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    shown = done.stdout + done.stderr
    assert "ours: still shown" in done.stdout and "ours: a warning of our own" in done.stderr
    for noise in ("de-quantizing GGUF", "Loading weights", "`loss_type=None`", "SOCKS support in urllib3"):
        assert (noise in shown) is verbose, (noise, shown)
    assert quiet_env(True, False) == {}  # PRIVBENCH_DEBUG shows everything


# ------------------------------------------------------------------------------------------------ a real run


def test_a_piped_run_prints_one_line_per_run_of_the_store(tmp_path: Path, prefect_harness: None) -> None:
    from prefect.settings import get_current_settings

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "PRIVBENCH_"))}
    env |= {
        "PRIVBENCH_HOME": str(tmp_path / "home"),
        "PREFECT_HOME": str(tmp_path / "prefect"),
        # the session's Prefect API: the command's own temporary one is test_run_command's
        "PREFECT_API_URL": str(get_current_settings().api.url),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
    done = privbench_process(["run", "prepare", "--profile", "quick"], env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    with sqlite3.connect(tmp_path / "home" / "results.db") as conn:
        rows = conn.execute("select technique, dataset, status from runs").fetchall()
    assert len(lines) == len(rows) == 9
    pattern = re.compile(r"\[(\d+)/9\]  prepare  (\S+)(?:  (\S+))?  finished  \d+\.\ds")
    matched = [pattern.fullmatch(line) for line in lines]
    assert all(matched), lines
    assert [int(m[1]) for m in matched] == list(range(1, 10))
    assert sorted((m[2], m[3]) for m in matched) == sorted((t, d) for t, d, _ in rows)
    before_table = done.stderr.split("flow prepare")[0]
    assert before_table.strip().splitlines() == lines  # nothing else before the summary table
    assert "privbench results show" in done.stderr and done.stdout == ""
    for noise in ("it/s]", "Warning", "Traceback"):
        assert noise not in done.stderr


def test_the_recording_and_the_display_name_the_same_progress_file() -> None:
    from storage import recording

    assert recording.PROGRESS_FILE_ENV == PROGRESS_FILE_ENV
    assert json.loads(json.dumps({"plan": {"prepare": None}}))  # an unknown count travels as null
