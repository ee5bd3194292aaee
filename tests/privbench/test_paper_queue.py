"""``privbench paper-queue``: a tiny queue of toy benches run by stand-in processes (each item's call is a small
Python process that prints a ``--no-record`` result, sleeps past its limit or fails), checking the budget, the
time limit (nothing half-written), resume after a cut, skip when done, the listing, and the folder import."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from pbconfig.paper_queue import PaperQueue, QueueItem, load_queue
from privbench import paper_queue as pq
from privbench.bench import harness
from privbench.cli import app

runner = CliRunner()

# the stand-in for `privbench bench ... --no-record --json`: its mode file says what this call does
STAND_IN = """
import json, pathlib, sys, time
result, mode, calls = (pathlib.Path(a) for a in sys.argv[1:4])
with calls.open("a") as f:
    f.write(sys.argv[4] + "\\n")
what = mode.read_text().strip() if mode.exists() else "ok"
print(f"stand-in {sys.argv[4]} started", file=sys.stderr, flush=True)
if what == "slow":
    time.sleep(60)
if what == "fail":
    sys.exit("the bench failed: out of memory")
if what == "garbage":
    print("not json")
    sys.exit(0)
print(result.read_text())
"""


def _toy(profile: str, progress: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    return {"setting": {"n": 3}, "ratios": {"b_over_a": 4.0}}


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> str:
    spec = harness.BenchmarkSpec("toy", "a toy benchmark", _toy, setting=lambda profile, options: {"n": 3})
    monkeypatch.setitem(harness.BENCHMARKS, "toy", spec)
    return "toy"


def _queue(*names: str, limit: float = 5.0) -> PaperQueue:
    return PaperQueue(
        items=tuple(QueueItem(name=n, bench="toy", time_limit_s=limit, why=f"the toy item {n}") for n in names)
    )


class StandIn:
    """Per item: a mode file (ok, slow, fail, garbage) and a log of the calls made."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.calls = tmp / "calls.txt"
        self.result = tmp / "result.json"
        self.result.write_text(json.dumps(harness.run_benchmark("toy", profile="paper", record=False)))

    def mode(self, item: str, what: str) -> None:
        (self.tmp / f"{item}.mode").write_text(what)

    def __call__(self, item: QueueItem, device: str) -> list[str]:
        mode = self.tmp / f"{item.name}.mode"
        return [sys.executable, "-c", STAND_IN, str(self.result), str(mode), str(self.calls), item.name]

    def called(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []


def _run(queue: PaperQueue, stand_in: StandIn, root: Path, budget: float = 60.0) -> dict[str, str]:
    outcomes = pq.run_queue(queue, budget_s=budget, device="cpu", root=root, kind="cpu-test", command=stand_in)
    return {o.item: o.status for o in outcomes}


def test_items_run_in_order_a_cut_leaves_nothing_and_the_next_call_resumes(toy: str, tmp_path: Path) -> None:
    queue, stand_in, root = _queue("a", "b", "c", limit=1.5), StandIn(tmp_path), tmp_path / "raw"
    stand_in.mode("b", "slow")  # b runs past its limit
    assert _run(queue, stand_in, root) == {"a": "measured", "b": "cut", "c": "measured"}
    files = sorted(p.name for p in (root / "cpu-test").iterdir() if p.is_file())
    key = pq.item_key(queue.items[0])[:12]
    assert files == [f"a-{key}.json", f"c-{key}.json"]  # b: no result, not even a temporary file
    logs = root / "cpu-test" / pq.LOG_DIR
    assert sorted(p.name for p in logs.iterdir()) == [f"{n}-{key}.log" for n in "abc"]
    assert "stand-in b started" in (logs / f"b-{key}.log").read_text()  # the cut item shows how far it got
    written = json.loads((root / "cpu-test" / files[0]).read_text())
    assert written["benchmark"] == "toy" and written["run_id"] is None and "machine" in written
    assert stand_in.called() == ["a", "b", "c"]

    stand_in.mode("b", "ok")
    assert _run(queue, stand_in, root) == {"a": "done", "b": "measured", "c": "done"}  # only b runs again
    assert stand_in.called() == ["a", "b", "c", "b"]
    assert _run(queue, stand_in, root) == {"a": "done", "b": "done", "c": "done"}
    assert stand_in.called() == ["a", "b", "c", "b"]  # nothing left: nothing runs
    # writing to a fresh folder that is sent back: what the committed folder holds counts as done
    outcomes = pq.run_queue(
        queue, budget_s=60.0, device="cpu", root=tmp_path / "out", kind="cpu-test", seen=[root], command=stand_in
    )
    assert {o.status for o in outcomes} == {"done"} and not (tmp_path / "out").exists()


def test_the_budget_stops_before_an_item_that_cannot_finish(toy: str, tmp_path: Path) -> None:
    queue, stand_in, root = _queue("a", "b", limit=30.0), StandIn(tmp_path), tmp_path / "raw"
    outcomes = pq.run_queue(queue, budget_s=40.0, device="cpu", root=root, kind="k", command=stand_in)
    assert [(o.item, o.status) for o in outcomes] == [("a", "stopped")]  # 40 s - 20 s kept back < its 30 s limit
    assert "needs 30 s (its limit), 20 s left" in outcomes[0].detail and stand_in.called() == []
    fast = QueueItem(name="a", bench="toy", time_limit_s=30.0, expected_s={"cpu": 2.0}, why="the toy item a")
    measured = PaperQueue(items=(fast,))
    outcomes = pq.run_queue(measured, budget_s=40.0, device="cpu", root=root, kind="k", command=stand_in)
    assert [(o.item, o.status) for o in outcomes] == [("a", "measured")]  # its measured 2 s fit
    with pytest.raises(ConfigError, match="budget_s must be positive"):
        pq.run_queue(queue, budget_s=0, device="cpu", root=root, command=stand_in)


@pytest.mark.parametrize(
    ("mode", "detail"), [("fail", "exit 1: stand-in a started the bench failed"), ("garbage", "output unreadable")]
)
def test_a_failed_item_writes_nothing_and_is_retried(toy: str, tmp_path: Path, mode: str, detail: str) -> None:
    queue, stand_in, root = _queue("a", "b"), StandIn(tmp_path), tmp_path / "raw"
    stand_in.mode("a", mode)
    outcomes = pq.run_queue(queue, budget_s=60.0, device="cpu", root=root, kind="k", command=stand_in)
    assert [(o.item, o.status) for o in outcomes] == [("a", "failed"), ("b", "measured")]
    assert detail in outcomes[0].detail
    assert sorted(p.name.split("-")[0] for p in (root / "k").iterdir() if p.is_file()) == ["b"]


def test_the_listing_says_what_is_measured_where_and_what_is_left(toy: str, tmp_path: Path) -> None:
    queue, stand_in, root = _queue("a", "b"), StandIn(tmp_path), tmp_path / "raw"
    stand_in.mode("b", "fail")
    _run(queue, stand_in, root)
    rows = {r["item"]: r for r in pq.queue_status(queue, root=root)}
    assert [d["device_kind"] for d in rows["a"]["done"]] == ["cpu-test"] and rows["b"]["done"] == []
    assert rows["a"]["expected_s"] is None and rows["a"]["time_limit_s"] == 5.0


def test_a_changed_setting_queues_the_item_again(toy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    item = _queue("a").items[0]
    before = pq.item_key(item)
    spec = harness.BenchmarkSpec("toy", "a toy benchmark", _toy, ("methods",), lambda profile, options: {"n": 4})
    monkeypatch.setitem(harness.BENCHMARKS, "toy", spec)
    assert pq.item_key(item) != before
    assert pq.item_key(item.model_copy(update={"methods": ("x",)})) != pq.item_key(item)


def test_the_key_is_the_same_on_every_machine(toy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device kind is the results' folder: a key computed on the lent GPU is found by `--list` and by the next
    call on another machine, so the machine (device, its name, threads, worker env) is not part of it."""
    item = _queue("a").items[0]
    keys = set()
    for device, threads in (("cuda", 16), ("cpu", 2)):
        setting = {"n": 3, "device": device, "device_name": f"{device} model", "threads": threads,
                   "settings": {"s": {"n": 3, "device": device, "worker_env": {"X": device}}}}  # fmt: skip
        spec = harness.BenchmarkSpec("toy", "a toy benchmark", _toy, setting=lambda p, o, s=setting: s)
        monkeypatch.setitem(harness.BENCHMARKS, "toy", spec)
        keys.add(pq.item_key(item))
    assert len(keys) == 1


def test_the_bench_command_is_the_no_record_call() -> None:
    item = QueueItem(
        name="m", bench="mpc-generation", methods=("vanilla", "merge"), sets=("a.b=1",), time_limit_s=9, why="x" * 10
    )
    command = pq.bench_command(item, "cuda")
    assert command[1:] == [
        "-m",
        "privbench",
        "bench",
        "mpc-generation",
        "--profile",
        "paper",
        "--no-record",
        "--json",
        "--methods",
        "vanilla,merge",
        "--set",
        "a.b=1",
    ]


def test_the_committed_queue_resolves_against_the_paper_profile() -> None:
    queue = load_queue()
    keys = [pq.item_key(item) for item in queue.items]  # every bench, method and --set is valid at `paper`
    assert len(set(keys)) == len(keys) and all(item.time_limit_s <= 600 for item in queue.items)
    # the peer check first (no CPU fallback); two of its seeds fit one 540 s call at their measured times
    assert [item.bench for item in queue.items[:3]] == ["recbole-sasrec"] * 3
    assert sum(item.expected_s["cuda"] for item in queue.items[:2]) <= 540 - pq.MARGIN_S


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("items: []", "at least 1 item"),
        ("items: [{name: a, bench: toy, time_limit_s: 900, why: 'ten chars!'}]", "less than or equal to 600"),
        ("items: [{name: A b, bench: toy, time_limit_s: 9, why: 'ten chars!'}]", "should match pattern"),
        ("items: [{name: a, bench: toy, time_limit_s: 9, sets: [x], why: 'ten chars!'}]", "KEY=VALUE"),
    ],
)
def test_a_bad_queue_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_queue(path)


def test_the_cli_lists_and_import_bench_skips_a_folders_imported_files(home: Path, toy: str, tmp_path: Path) -> None:
    queue_file = tmp_path / "q.yaml"
    queue_file.write_text("items: [{name: a, bench: toy, time_limit_s: 9, why: 'the toy item'}]\n")
    root = tmp_path / "raw"
    _run(load_queue(queue_file), StandIn(tmp_path), root)
    listed = runner.invoke(app, ["paper-queue", "--list", "--queue", str(queue_file), "--out", str(root), "--json"])
    assert listed.exit_code == 0, listed.output
    assert [d["device_kind"] for d in json.loads(listed.stdout)[0]["done"]] == ["cpu-test"]

    first = runner.invoke(app, ["results", "import-bench", str(root / "cpu-test"), "--json"])
    assert first.exit_code == 0, first.output and len(json.loads(first.stdout)) == 1
    again = runner.invoke(app, ["results", "import-bench", str(root / "cpu-test"), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout) == [] and "already in the store; skipped" in again.output
    (named,) = (root / "cpu-test").glob("*.json")
    refused = runner.invoke(app, ["results", "import-bench", str(named)])  # a file named on its own: refused
    assert refused.exit_code == 2 and "already in the store as run" in refused.output
