"""What the dashboard shows besides charts, as pure functions (testable without Streamlit): MLflow links, the
results store's label, and the leaderboard of ``storage.leaderboard`` as a table to display."""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path

import pandas as pd

from core.redact import redact_url

DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
NO_INTERVAL = "n = 1: no interval"
LEADERBOARD_TABLE_COLUMNS = ["setting", "method", "mean ± 95% CI", "95% interval", "n", "best", "mlflow"]
_SQLITE = re.compile(r"^(?P<scheme>sqlite(?:\+\w+)?:///)(?P<path>[^?]*)(?P<query>\?.*)?$")


def mlflow_link(base: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI address of a run, or None when the run was not tracked."""
    if not experiment_id or not run_id:
        return None
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_compare_url(base: str, run_ids: Iterable[str], experiment_ids: Iterable[str]) -> str | None:
    """MLflow's compare view of ``run_ids`` (MLflow 3: ``#/compare-runs?runs=[...]&experiments=[...]``, both JSON
    lists, as the UI's own "Compare" button builds it), or None when no run was tracked."""
    runs = list(dict.fromkeys(r for r in run_ids if r))
    if not runs:
        return None
    experiments = sorted({e for e in experiment_ids if e})
    query = urllib.parse.urlencode(
        {"runs": json.dumps(runs, separators=(",", ":")), "experiments": json.dumps(experiments, separators=(",", ":"))}
    )
    return f"{base.rstrip('/')}/#/compare-runs?{query}"


def store_label(db_url: str, roots: Sequence[Path] = ()) -> str:
    """``db_url`` as the dashboard shows it: passwords redacted; a SQLite file under the current directory
    relative to it (``sqlite:///.privbench/results.db``, the same file for a process started there), under
    another of ``roots`` (the project directory) as ``…/<root name>/<relative path>``, under the home directory
    as ``~/...``; otherwise as given."""
    found = _SQLITE.match(db_url)
    if not found or not found.group("path") or found.group("path") == ":memory:":
        return redact_url(db_url)
    path = Path(found.group("path"))
    shown = str(path)
    if path.is_absolute():
        cwd = Path.cwd().resolve()
        resolved = path.resolve()
        for base in (cwd, *(Path(r).resolve() for r in roots)):
            if resolved.is_relative_to(base):
                rel = resolved.relative_to(base).as_posix()
                shown = rel if base == cwd else f"…/{base.name}/{rel}"
                break
        else:
            home = Path.home().resolve()
            if resolved.is_relative_to(home) and home != Path("/"):
                shown = f"~/{resolved.relative_to(home).as_posix()}"
    return redact_url(found.group("scheme") + shown + (found.group("query") or ""))


def fmt(value: float) -> str:
    """4 significant digits (``0.1237``, ``2.669e+08``); NaN as an empty string."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.4g}"


def leaderboard_table(frame: pd.DataFrame, base: str = DEFAULT_MLFLOW_UI) -> pd.DataFrame:
    """One board and metric of ``storage.leaderboard.leaderboard`` (rows already ranked) as the displayed
    table (``LEADERBOARD_TABLE_COLUMNS``): the mean with the half-width of its 95% interval, the interval, n,
    ``★`` for the best method (``★ clear win`` when its interval clears the others'), the MLflow compare view
    of the method's runs in that setting."""
    rows = []
    for row in frame.to_dict("records"):
        interval = row["n"] >= 2 and not math.isnan(row["half_width"])
        rows.append(
            {
                "setting": row["context"],
                "method": f"{row['method']} (reference)" if row.get("reference") else row["method"],
                "mean ± 95% CI": f"{fmt(row['mean'])} ± {fmt(row['half_width'])}" if interval else fmt(row["mean"]),
                "95% interval": f"[{fmt(row['ci_low'])}, {fmt(row['ci_high'])}]" if interval else NO_INTERVAL,
                "n": int(row["n"]),
                "best": ("★ clear win" if row["clear_win"] else "★") if row["best"] else "",
                "mlflow": mlflow_compare_url(base, row["mlflow_run_ids"], row["mlflow_experiment_ids"]),
            }
        )
    return pd.DataFrame(rows, columns=LEADERBOARD_TABLE_COLUMNS)


def context_compare_links(frame: pd.DataFrame, base: str = DEFAULT_MLFLOW_UI) -> list[tuple[str, str]]:
    """Per setting of one board and metric: (setting, the MLflow compare view of every method's runs in it)."""
    links = []
    for context, group in frame.groupby("context", sort=True):
        url = mlflow_compare_url(
            base,
            [r for ids in group["mlflow_run_ids"] for r in ids],
            [e for ids in group["mlflow_experiment_ids"] for e in ids],
        )
        if url:
            links.append((str(context), url))
    return links
