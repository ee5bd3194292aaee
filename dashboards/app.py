"""privbench dashboard (Streamlit): which method wins per stage, then the results store's result groups as
tables and Plotly charts.

Run it with ``privbench dashboard`` (or ``streamlit run dashboards/app.py``). It reads the store configured by
``PRIVBENCH_DB_URL`` / ``PRIVBENCH_HOME`` only through ``storage.views`` and ``storage.leaderboard``; queries are
cached for ``TTL_S`` seconds per (view, store, filters). The overview leads with a leaderboard per stage (mean
over seeds with a 95% t-interval, the best method marked); run links and compare links open the MLflow UI at
``PRIVBENCH_MLFLOW_UI_URL`` (default ``http://127.0.0.1:5000``, where ``privbench ui`` serves it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from core.errors import PrivbenchError
from dashboards import plots, tables
from pbconfig.claims import Verdict
from pbconfig.settings import get_settings
from storage import claims as claim_verdicts
from storage import leaderboard as ranking
from storage import views

TTL_S = 30
MLFLOW_UI_ENV = "PRIVBENCH_MLFLOW_UI_URL"
DEFAULT_MLFLOW_UI = tables.DEFAULT_MLFLOW_UI
PROJECT_DIR = Path(__file__).resolve().parents[1]
ALL = "(all)"

Filters = tuple[tuple[str, Any], ...]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def load(view: str, db_url: str, filters: Filters) -> pd.DataFrame:
    """``storage.views.<view>`` for ``db_url`` and ``filters`` (cached, keyed on all three)."""
    return getattr(views, view)(db_url, **dict(filters))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def load_leaderboard(db_url: str, filters: Filters) -> pd.DataFrame:
    """``storage.leaderboard.leaderboard`` for ``db_url`` and ``filters`` (cached, keyed on both)."""
    return ranking.leaderboard(db_url, **dict(filters))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def load_claims(db_url: str, filters: Filters) -> pd.DataFrame:
    """The verdict table of ``storage.claims`` (the same as ``privbench report``) for the filtered runs."""
    given = dict(filters)
    return claim_verdicts.claims_table(claim_verdicts.evaluate_claims(db_url, **given), given.get("profile"))


@st.cache_data(ttl=TTL_S, show_spinner=False)
def options(db_url: str) -> dict[str, Any]:
    return views.filter_options(db_url)


def mlflow_ui() -> str:
    return os.environ.get(MLFLOW_UI_ENV) or DEFAULT_MLFLOW_UI


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
    commit = st.sidebar.selectbox(
        "git commit", [ALL, *opts["commits"]], key="commit", format_func=lambda c: c if c == ALL else c[:12]
    )
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
    root = st.sidebar.text_input(
        "run subtree (run id)", key="root", help="only this run and the runs below it (parent_id)"
    ).strip()
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


def section(
    title: str, view: str, message: str, db_url: str, filters: Filters, draw: Callable[[pd.DataFrame], None]
) -> None:
    """A titled section over the rows of ``storage.views.<view>``: ``draw`` them, or the empty-state ``message``."""
    st.subheader(title)
    frame = load(view, db_url, filters)
    if frame.empty:
        empty(message, filters)
    else:
        draw(frame)


def chart(plot: Callable[[pd.DataFrame], Any]) -> Callable[[pd.DataFrame], None]:
    """A section's ``draw`` that shows the Plotly figure ``plot`` makes of the rows."""
    return lambda frame: st.plotly_chart(plot(frame), width="stretch")


def chart_tab(
    stage: str, *parts: tuple[str, str, str, Callable[[pd.DataFrame], Any]]
) -> Callable[[str, Filters], None]:
    """A tab of one chart section per (title, view, what the view's rows are, plot) of ``parts``; an empty one says
    to run ``stage``'s flow."""

    def render(db_url: str, filters: Filters) -> None:
        for title, view, rows, plot in parts:
            message = f"No {rows} yet: run `privbench run {stage} --profile quick`"
            section(title, view, message, db_url, filters, chart(plot))

    return render


def leaderboards(db_url: str, filters: Filters) -> None:
    """Per stage, the methods ranked on the stage's key metric (a radio picks another of its metrics)."""
    st.subheader("Which method wins")
    st.caption(
        "Mean over seeds and its 95% Student-t interval (n = seeds; a seed run again counts once, the "
        "newest run). ★ marks the best mean of a setting, higher or lower as the metric wants; "
        "*clear win*: its interval clears every other method's. The MLflow links open the runs side "
        "by side in MLflow's compare view."
    )
    frame = load_leaderboard(db_url, filters)
    base = mlflow_ui()
    missing = []
    for board in ranking.BOARDS:
        rows = frame[frame["board"] == board.name]
        if rows.empty:
            missing.append(f"{board.title} ({board.empty})")
            continue
        labels = {
            m.name: f"{m.label} ({'higher' if m.higher_is_better else 'lower'} is better)"
            for m in board.metrics
            if m.name in set(rows["metric"])
        }
        st.markdown(f"**{board.title}**")
        metric = st.radio(
            f"{board.title}: metric",
            list(labels),
            format_func=labels.__getitem__,
            horizontal=True,
            key=f"leaderboard_{board.name}",
            label_visibility="collapsed",
        )
        shown = tables.leaderboard_table(rows[rows["metric"] == metric], base)
        st.dataframe(
            shown,
            hide_index=True,
            width="stretch",
            height=35 * (len(shown) + 1) + 3,
            column_config={
                "mlflow": st.column_config.LinkColumn("MLflow", display_text="compare"),
                "n": st.column_config.NumberColumn("n", help="seeds"),
                "mean ± 95% CI": st.column_config.TextColumn(labels[metric]),
            },
        )
        links = tables.context_compare_links(rows[rows["metric"] == metric], base)
        if links:
            st.caption("All methods side by side in MLflow: " + " · ".join(f"[{c}]({u})" for c, u in links))
    if missing:
        st.caption(
            "Not ranked yet (no results" + (" with these filters" if filters else "") + "): " + "; ".join(missing)
        )


def overview(db_url: str, filters: Filters) -> None:
    frame = load("runs", db_url, filters)
    if frame.empty:
        empty("No runs yet: run `privbench run benchmark --profile quick`", filters)
        return
    leaderboards(db_url, filters)
    st.subheader("Recent runs")
    counts = frame["status"].value_counts()
    cols = st.columns(4)
    cols[0].metric("runs shown", len(frame))
    for col, status in zip(cols[1:], ("finished", "failed", "running"), strict=True):
        col.metric(status, int(counts.get(status, 0)))
    base = mlflow_ui()
    shown = table(frame).assign(
        mlflow=[
            tables.mlflow_link(base, e, r)
            for e, r in zip(frame["mlflow_experiment_id"], frame["mlflow_run_id"], strict=True)
        ]
    )
    st.dataframe(
        shown[
            [
                "started_at",
                "status",
                "flow",
                "stage",
                "technique",
                "dataset",
                "profile",
                "duration_s",
                "git_commit",
                "error",
                "mlflow",
                "id",
            ]
        ],
        hide_index=True,
        width="stretch",
        column_config={
            "mlflow": st.column_config.LinkColumn("MLflow run", display_text="open"),
            "duration_s": st.column_config.NumberColumn("duration (s)", format="%.1f"),
            "started_at": st.column_config.DatetimeColumn("started (UTC)"),
        },
    )


def training(db_url: str, filters: Filters) -> None:
    def draw_pu(frame: pd.DataFrame) -> None:
        for dataset, group in frame.groupby("dataset", sort=True):
            fig = plots.privacy_utility(group).update_layout(
                title=f"NDCG@10 vs epsilon: {dataset} (mean over seeds, 95% interval)"
            )
            st.plotly_chart(fig, width="stretch")
        st.plotly_chart(plots.train_time(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section(
        "Privacy-utility (DPFormer)",
        "privacy_utility",
        "No private-training runs yet: run `privbench run train-dp --profile quick`",
        db_url,
        filters,
        draw_pu,
    )
    section(
        "Clipping speed and memory",
        "clipping_bench",
        "No clipping benchmark yet: run `privbench bench dp-clipping`",
        db_url,
        filters,
        chart(plots.clipping_speed_memory),
    )


tangent = chart_tab(
    "tangent",
    ("Accuracy vs number of shards", "tangent_accuracy", "tangent runs", plots.tangent_accuracy),
    ("Unlearning (forgetting shards)", "unlearning", "unlearning curves", plots.unlearning),
)


def secure_inference(db_url: str, filters: Filters) -> None:
    def draw(frame: pd.DataFrame) -> None:
        st.plotly_chart(plots.mpc_costs(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section(
        "MPC cost per operation",
        "mpc_costs",
        "No secure-inference runs yet: run `privbench run secure-inference --profile quick`",
        db_url,
        filters,
        draw,
    )


stip = chart_tab(
    "stip",
    ("Protocol overhead", "stip_overhead", "STIP runs", plots.stip_overhead),
    ("Permutation-recovery attacks", "stip_attacks", "STIP attack results", plots.stip_attacks),
)


def attacks(db_url: str, filters: Filters) -> None:
    def draw_film(frame: pd.DataFrame) -> None:
        metric = st.radio("metric", ["rougeL", "rouge1", "rouge2", "recall"], horizontal=True, key="film_metric")
        st.plotly_chart(plots.film(frame, metric), width="stretch")

    section(
        "FILM text recovery vs SEB",
        "film",
        "No FILM attack runs yet: run `privbench run attacks --profile quick`",
        db_url,
        filters,
        draw_film,
    )

    def draw_mia(frame: pd.DataFrame) -> None:
        roc = load("membership_roc", db_url, filters)
        if roc.empty:
            st.caption(
                "No ROC points found (they are the MLflow artifacts `roc.json` of the audit runs, read from "
                "the local artifact root or MLFLOW_TRACKING_URI); showing AUC and TPR at low FPR instead."
            )
            st.plotly_chart(plots.membership_auc(frame), width="stretch")
        else:
            st.plotly_chart(plots.membership_roc(roc), width="stretch")
        if (frame["audit"] == "dp").any():
            st.plotly_chart(plots.membership_epsilon(frame), width="stretch")
        st.dataframe(table(frame), hide_index=True, width="stretch")

    section(
        "Membership-inference audit",
        "membership",
        "No membership-inference audits yet: run `privbench run attacks --profile quick` "
        "(with an `attacks.audit` section)",
        db_url,
        filters,
        draw_mia,
    )


VERDICT_ICONS = {
    Verdict.REPRODUCED: "✅",
    Verdict.NOT_REPRODUCED: "❌",
    Verdict.INCONCLUSIVE: "❔",
    Verdict.UNDERPOWERED: "🔋",
    Verdict.PROJECTED: "📈",
    Verdict.EXPLORATORY: "🔎",
    Verdict.NOT_APPLICABLE: "↔",
    Verdict.NOT_RUN: "⏸",
}


def claims(db_url: str, filters: Filters) -> None:
    """Per paper, each headline claim with the paper's value, ours (95% interval, n), the verdict and its rule:
    the table of ``privbench report``, computed from the filtered runs."""
    frame = load_claims(db_url, filters)
    if frame.empty or (frame["verdict"] == "not run").all():
        empty("No claim can be judged yet: run `privbench run benchmark --profile quick` (or `make run`)", filters)
        return
    counts = frame["verdict"].value_counts()
    st.caption(
        "Verdicts computed from the store by the rule beside each (registry: `configs/claims/*.yaml`): "
        + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICT_ICONS)
        + ". Pick a profile in the sidebar to judge one profile's runs."
    )
    for paper, rows in frame.groupby("paper", sort=False):
        st.subheader(str(paper))
        shown = rows.assign(verdict=[f"{VERDICT_ICONS.get(v, '')} {v}" for v in rows["verdict"]])
        st.dataframe(
            shown[["claim", "source", "statement", "paper_value", "ours", "n", "scale", "verdict", "rule", "reason"]],
            hide_index=True,
            width="stretch",
        )


TABS: dict[str, Callable[[str, Filters], None]] = {
    "Overview": overview,
    "Claims": claims,
    "Private training": training,
    "Tangent": tangent,
    "Secure inference": secure_inference,
    "STIP": stip,
    "Attacks": attacks,
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
    st.sidebar.caption(f"store: `{tables.store_label(db_url, (PROJECT_DIR,))}`  \ncached for {TTL_S} s")
    for tab, render in zip(st.tabs(list(TABS)), TABS.values(), strict=True):
        with tab:
            render(db_url, filters)


main()
