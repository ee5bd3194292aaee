"""The stage flow runs behind a report: which run of each stage a profile's numbers come from, when it started and
how long it took (``privbench report``'s "Where these numbers come from")."""

from __future__ import annotations

import pandas as pd

from pbconfig.stages import FLOW_NAMES
from storage import view_query as vq

STAGE_FLOWS = FLOW_NAMES  # the chain's flows in its order (pbconfig.stages)


def stage_runs(db_url: str | None = None, *, profile: str | None = None, root: str | None = None) -> pd.DataFrame:
    """The newest finished flow run of each stage flow (``STAGE_FLOWS``, the benchmark chain last) of ``profile``
    (under ``root`` when given): ``flow, run_id, stage, started_at, duration_s, git_commit, device, profile``. Flow
    runs under a flow run of the same flow (the tangent stage's pass per seed) are parts of it, not stage runs."""
    from sqlalchemy import select

    from storage.models import Run

    columns = ["flow", "run_id", "stage", "started_at", "duration_s", "git_commit", "device", "profile"]
    f = vq.filters({"profile": profile, "root": root})
    stmt = select(
        Run.parent_id,
        Run.flow,
        Run.id.label("run_id"),
        Run.stage,
        Run.started_at,
        Run.duration_s,
        Run.git_commit,
        Run.device,
        Run.profile,
    ).where(Run.status == "finished", Run.technique == "flow", Run.flow.in_(STAGE_FLOWS))
    frame = vq.timestamps(vq.read(vq.engine(db_url), f.apply(stmt), ["parent_id", *columns]), "started_at")
    # a pass of a stage under that stage's own flow run (tangent's one pass per seed) is part of it, not the stage
    own = set(zip(frame["flow"], frame["run_id"], strict=True))
    frame = frame[[(fl, p) not in own for fl, p in zip(frame["flow"], frame["parent_id"], strict=True)]]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame = frame.sort_values("started_at", kind="stable").drop_duplicates("flow", keep="last")
    frame["order"] = frame["flow"].map(STAGE_FLOWS.index)
    return frame.sort_values("order").drop(columns="order").reset_index(drop=True)[columns]


def unfinished_runs(db_url: str | None = None, *, profile: str | None = None, root: str | None = None) -> pd.DataFrame:
    """Stage flow runs of ``profile`` (under ``root`` when given) that did not finish (failed, stopped or still
    running), top-level and per-seed passes alike, oldest first: ``flow, run_id, parent_id, status, error,
    started_at, duration_s, git_commit``. A report lists them beside the finished ones, so that a stage that was
    stopped (and the seeds it did not run) is visible, not silently missing."""
    from sqlalchemy import select

    from storage.models import Run

    columns = ["flow", "run_id", "parent_id", "status", "error", "started_at", "duration_s", "git_commit"]
    f = vq.filters({"profile": profile, "root": root})
    stmt = select(
        Run.flow,
        Run.id.label("run_id"),
        Run.parent_id,
        Run.status,
        Run.error,
        Run.started_at,
        Run.duration_s,
        Run.git_commit,
    ).where(Run.status != "finished", Run.technique == "flow", Run.flow.in_(STAGE_FLOWS))
    frame = vq.timestamps(vq.read(vq.engine(db_url), f.apply(stmt), columns), "started_at")
    if frame.empty:
        return pd.DataFrame(columns=columns)
    return frame.sort_values("started_at", kind="stable").reset_index(drop=True)[columns]


__all__ = ["STAGE_FLOWS", "stage_runs", "unfinished_runs"]
