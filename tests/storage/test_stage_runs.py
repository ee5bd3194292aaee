"""The stage flow runs behind a report: a stage's passes (tangent's one per seed) are parts of it, and a stage run
under a benchmark chain still counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from storage.recording import record_run
from storage.stage_runs import stage_runs


def test_stage_runs_take_a_stage_not_its_passes(home: Path) -> None:
    """The tangent stage runs one pass per seed as flow runs under its own flow run: the stage's wall time is the
    parent's, and a stage run under a benchmark chain still counts."""

    def flow(name: str, parent: Any = None) -> Any:
        with record_run(
            flow=name, stage=name, technique="flow", dataset=None, profile="tiny", config={}, parent=parent,
            track=False,
        ) as rec:  # fmt: skip
            return rec

    with record_run(
        flow="tangent", stage="tangent", technique="flow", dataset=None, profile="tiny", config={}, track=False
    ) as stage:
        flow("tangent", stage.ref)
        flow("tangent", stage.ref)
    chain = flow("benchmark")
    stip = flow("stip", chain.ref)
    runs = stage_runs(profile="tiny")
    assert dict(zip(runs["flow"], runs["run_id"], strict=True)) == {
        "tangent": stage.ref.run_id,
        "stip": stip.ref.run_id,
        "benchmark": chain.ref.run_id,
    }
