"""The benchmark runs of a profile as the report lists them (``privbench report``'s "Benchmark runs" table)."""

from __future__ import annotations

import pandas as pd

from storage import view_query as vq


def bench_runs(db_url: str | None = None, *, profile: str | None = None, root: str | None = None) -> pd.DataFrame:
    """Every finished benchmark run (``privbench bench``, recorded or imported) of ``profile``, oldest first:
    ``benchmark, run_id, started_at, duration_s, git_commit, host, device, ratios, shape`` (``ratios``: the run's
    top-level ``ratios.*`` metrics as ``{name: value}``; ``shape``: what its setting says of the model it measured,
    :func:`shape_of`)."""
    import json

    from sqlalchemy import select

    from storage.models import Metric, Run

    columns = ["benchmark", "run_id", "started_at", "duration_s", "git_commit", "host", "device"]
    f = vq.filters({"profile": profile, "root": root})
    stmt = select(
        Run.technique.label("benchmark"),
        Run.id.label("run_id"),
        Run.started_at,
        Run.duration_s,
        Run.git_commit,
        Run.host,
        Run.device,
        Run.config_json,
    ).where(Run.status == "finished", Run.flow == "bench")
    engine = vq.engine(db_url)
    frame = vq.timestamps(vq.read(engine, f.apply(stmt), [*columns, "config_json"]), "started_at")
    if frame.empty:
        return pd.DataFrame(columns=[*columns, "ratios", "shape"])
    frame["shape"] = [shape_of(json.loads(c or "{}")) for c in frame.pop("config_json")]
    ratios = vq.read(
        engine,
        select(Metric.run_id, Metric.name, Metric.value).where(
            Metric.run_id.in_(list(frame["run_id"])), Metric.name.like("ratios.%")
        ),
        ["run_id", "name", "value"],
    )
    top = ratios[ratios["name"].str.count(r"\.") == 1]
    by_run = {r: dict(zip(g["name"].str[len("ratios.") :], g["value"], strict=True)) for r, g in top.groupby("run_id")}
    frame["ratios"] = [by_run.get(r, {}) for r in frame["run_id"]]
    return frame.sort_values("started_at", kind="stable").reset_index(drop=True)


SHAPE_KEYS = ("arch", "n_layer", "n_embd", "n_head", "vocab")


def shape_of(config: dict) -> str:
    """The model a bench run measured, from its recorded setting: ``arch=t5 n_layer=6 n_embd=768 ...`` (the keys of
    :data:`SHAPE_KEYS` it has, an older run's missing ``arch`` left out); "" for a bench without them."""
    setting = config.get("setting") if isinstance(config, dict) else None
    if not isinstance(setting, dict):
        return ""
    return " ".join(f"{k}={setting[k]}" for k in SHAPE_KEYS if k in setting)


__all__ = ["bench_runs", "shape_of"]
