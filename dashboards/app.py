"""privbench dashboard (Streamlit): the results store's result groups as tables and Plotly charts.

Run it with ``privbench dashboard`` (or ``streamlit run dashboards/app.py``). It reads the store configured by
``PRIVBENCH_DB_URL`` / ``PRIVBENCH_HOME`` only through ``storage.views``; queries are cached for ``TTL_S``
seconds per (view, store, filters). Run links open the MLflow UI at ``PRIVBENCH_MLFLOW_UI_URL`` (default
``http://127.0.0.1:5000``, where ``privbench ui`` serves it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, date, datetime, time
from typing import Any

import pandas as pd
import streamlit as st

from core.errors import PrivbenchError
from dashboards import plots
from privbench.settings import get_settings
from storage import views
from storage.db import redact

TTL_S = 30
MLFLOW_UI_ENV = "PRIVBENCH_MLFLOW_UI_URL"
DEFAULT_MLFLOW_UI = "http://127.0.0.1:5000"
ALL = "(all)"

Filters = tuple[tuple[str, Any], ...]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def load(view: str, db_url: str, filters: Filters) -> pd.DataFrame:
    """``storage.views.<view>`` for ``db_url`` and ``filters`` (cached, keyed on all three)."""
    return getattr(views, view)(db_url, **dict(filters))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def options(db_url: str) -> dict[str, Any]:
    return views.filter_options(db_url)


def mlflow_link(base: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI address of a run, or None when the run was not tracked."""
    if not experiment_id or not run_id:
        return None
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def sidebar(opts: dict[str, Any]) -> Filters:
    """The filter widgets; returns the chosen filters as a hashable tuple of (name, value)."""
    st.sidebar.header("Filters")
    chosen: dict[str, Any] = {}
    dataset = st.sidebar.selectbox("dataset", [ALL, *opts["datasets"]], key="dataset")
    if dataset != ALL:
        chosen["dataset"] = dataset
    profile = st.sidebar.selectbox("profile", [ALL, *opts["profiles"]], key="profile")
    if profile != ALL:
        chosen["profile"] = profile
    commit = st.sidebar.selectbox("git commit", [ALL, *opts["commits"]], key="commit",
                                  format_func=lambda c: c if c == ALL else c[:12])
    if commit != ALL:
        chosen["commit"] = commit
    if opts["first"] is not None:
        first: date = opts["first"].date()
        last: date = opts["last"].date()
        picked = st.sidebar.date_input("started between", (first, last), key="dates")
        days = list(picked) if isinstance(picked, tuple | list) else [picked]
        if days and days[0] > first:
            chosen["since"] = datetime.combine(days[0], time.min, tzinfo=UTC)
        if len(days) > 1 and days[-1] < last:
            chosen["until"] = datetime.combine(days[-1], time.max, tzinfo=UTC)
    root = st.sidebar.text_input("run subtree (run id)", key="root",
                                 help="only this run and the runs below it (parent_id)").strip()
    if root:
        chosen["root"] = root
    return tuple(sorted(chosen.items()))


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` for ``st.dataframe``: timestamps as naive UTC, as the store writes them."""
    out = frame.copy()
    for name in out.columns:
        if isinstance(out[name].dtype, pd.DatetimeTZDtype):
            out[name] = out[name].dt.tz_convert(None)
    return out


def empty(message: str, filters: Filters) -> None:
    """The empty-state message: what to run, and a hint when filters may hide results."""
    st.info(message + ("  (Or widen the filters in the sidebar.)" if filters else ""))


def section(title: str, frame: pd.DataFrame, message: str, filters: Filters,
            draw: Callable[[pd.DataFrame], None]) -> None:
    st.subheader(title)
    if frame.empty:
        empty(message, filters)
    else:
        draw(frame)


def overview(db_url: str, filters: Filters) -> None:
    frame = load("runs", db_url, filters)
    if frame.empty:
        empty("No runs yet: run `privbench run benchmark --profile quick`", filters)
        return
    counts = frame["status"].value_counts()
    cols = st.columns(4)
    cols[0].metric("runs shown", len(frame))
    for col, status in zip(cols[1:], ("finished", "failed", "running"), strict=True):
        col.metric(status, int(counts.get(status, 0)))
    base = os.environ.get(MLFLOW_UI_ENV, DEFAULT_MLFLOW_UI)
    shown = table(frame).assign(mlflow=[mlflow_link(base, e, r) for e, r in
                                        zip(frame["mlflow_experiment_id"], frame["mlflow_run_id"], strict=True)])
    st.dataframe(
        shown[["started_at", "status", "flow", "stage", "technique", "dataset", "profile", "duration_s", "git_commit",
               "error", "mlflow", "id"]],
        hide_index=True, width="stretch",
        column_config={"mlflow": st.column_config.LinkColumn("MLflow run", display_text="open"),
                       "duration_s": st.column_config.NumberColumn("duration (s)", format="%.1f"),
                       "started_at": st.column_config.DatetimeColumn("started (UTC)")})


def training(db_url: str, filters: Filters) -> None:
    pu = load("privacy_utility", db_url, filters)

    def draw_pu(frame: pd.DataFrame) -> None:
        for dataset, group in frame.groupby("dataset", sort=True):
            st.plotly_chart(plots.privacy_utility(group).update_layout(title=f"NDCG@10 vs epsilon: {dataset}"),
                            width="stretch")
        st.plotly_chart(plots.train_time(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section("Privacy-utility (DPFormer)", pu,
            "No private-training runs yet: run `privbench run train-dp --profile quick`", filters, draw_pu)
    section("Clipping speed and memory", load("clipping_bench", db_url, filters),
            "No clipping benchmark yet: run `privbench bench dp-clipping`", filters,
            lambda f: st.plotly_chart(plots.clipping_speed_memory(f), width="stretch"))


def tangent(db_url: str, filters: Filters) -> None:
    section("Accuracy vs number of shards", load("tangent_accuracy", db_url, filters),
            "No tangent runs yet: run `privbench run tangent --profile quick`", filters,
            lambda f: st.plotly_chart(plots.tangent_accuracy(f), width="stretch"))
    section("Unlearning (forgetting shards)", load("unlearning", db_url, filters),
            "No unlearning curves yet: run `privbench run tangent --profile quick`", filters,
            lambda f: st.plotly_chart(plots.unlearning(f), width="stretch"))


def secure_inference(db_url: str, filters: Filters) -> None:
    def draw(frame: pd.DataFrame) -> None:
        st.plotly_chart(plots.mpc_costs(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section("MPC cost per operation", load("mpc_costs", db_url, filters),
            "No secure-inference runs yet: run `privbench run secure-inference --profile quick`", filters, draw)


def stip(db_url: str, filters: Filters) -> None:
    section("Protocol overhead", load("stip_overhead", db_url, filters),
            "No STIP runs yet: run `privbench run stip --profile quick`", filters,
            lambda f: st.plotly_chart(plots.stip_overhead(f), width="stretch"))
    section("Permutation-recovery attacks", load("stip_attacks", db_url, filters),
            "No STIP attack results yet: run `privbench run stip --profile quick`", filters,
            lambda f: st.plotly_chart(plots.stip_attacks(f), width="stretch"))


def attacks(db_url: str, filters: Filters) -> None:
    def draw_film(frame: pd.DataFrame) -> None:
        metric = st.radio("metric", ["rougeL", "rouge1", "rouge2", "recall"], horizontal=True, key="film_metric")
        st.plotly_chart(plots.film(frame, metric), width="stretch")

    section("FILM text recovery vs SEB", load("film", db_url, filters),
            "No FILM attack runs yet: run `privbench run attacks --profile quick`", filters, draw_film)

    def draw_mia(frame: pd.DataFrame) -> None:
        roc = load("membership_roc", db_url, filters)
        if roc.empty:
            st.caption("No ROC points found (they are the MLflow artifacts `roc.json` of the audit runs, read from "
                       "the local artifact root or MLFLOW_TRACKING_URI); showing AUC and TPR at low FPR instead.")
            st.plotly_chart(plots.membership_auc(frame), width="stretch")
        else:
            st.plotly_chart(plots.membership_roc(roc), width="stretch")
        if (frame["audit"] == "dp").any():
            st.plotly_chart(plots.membership_epsilon(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section("Membership-inference audit", load("membership", db_url, filters),
            "No membership-inference audits yet: run `privbench run attacks --profile quick` "
            "(with an `attacks.audit` section)", filters, draw_mia)


TABS: dict[str, Callable[[str, Filters], None]] = {
    "Overview": overview, "Private training": training, "Tangent": tangent, "Secure inference": secure_inference,
    "STIP": stip, "Attacks": attacks,
}


def main() -> None:
    st.set_page_config(page_title="privbench", layout="wide")
    st.title("privbench results")
    db_url = get_settings().db_url
    try:
        opts = options(db_url)
    except PrivbenchError as exc:
        st.error(f"Cannot read the results store: {exc}")
        st.stop()
    filters = sidebar(opts)
    st.sidebar.caption(f"store: {redact(db_url)}  \ncached for {TTL_S} s")
    for tab, render in zip(st.tabs(list(TABS)), TABS.values(), strict=True):
        with tab:
            render(db_url, filters)


main()
