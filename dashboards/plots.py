"""Plotly figure builders for the dashboard: pure functions from a ``storage.views`` DataFrame to a figure.

Each builder takes the frame its view returns (same columns) and returns a ``go.Figure``; an empty frame gives
an empty figure (the app shows an empty-state message instead of calling them).
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from storage.leaderboard import seed_interval

_LAYOUT = {"template": "plotly_white", "margin": {"l": 50, "r": 20, "t": 50, "b": 40}, "legend_title_text": ""}


def _figure(title: str, x: str, y: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, **_LAYOUT)
    return fig


def privacy_utility(frame: pd.DataFrame, metric: str = "ndcg_at_10") -> go.Figure:
    """``metric`` (``ndcg_at_10`` or ``hit_at_10``) against the target epsilon, one line per method and dataset
    through the mean over the runs (seeds) at each epsilon, with their 95% t-interval as error bars (none for a
    single run); the non-private runs are dashed horizontal references (their mean), and the most-popular-items
    ranking of the same users (``popularity_<metric>``, where the runs recorded it) a dotted one: the floor."""
    label = {"ndcg_at_10": "NDCG@10", "hit_at_10": "HIT@10"}.get(metric, metric)
    fig = _figure(
        f"Privacy-utility: test {label} vs epsilon (mean over seeds, 95% interval)", "target epsilon", f"test {label}"
    )
    private = frame[frame["private"]].sort_values("epsilon")
    many = frame["dataset"].nunique() > 1
    for (method, dataset), group in private.groupby(["method", "dataset"], sort=True):
        name = f"{method} ({dataset})" if many else str(method)
        points = [(eps, seed_interval(at[metric])) for eps, at in group.groupby("epsilon", sort=True)]
        fig.add_trace(
            go.Scatter(
                x=[eps for eps, _ in points],
                y=[ci.mean for _, ci in points],
                mode="lines+markers",
                name=name,
                legendgroup=name,
                customdata=[ci.n for _, ci in points],
                hovertemplate="epsilon %{x}: %{y:.4g} (n = %{customdata})",
                error_y={
                    "type": "data",
                    "array": [0.0 if math.isnan(ci.half_width) else ci.half_width for _, ci in points],
                    "visible": True,
                },
            )
        )
    for (method, dataset), group in frame[~frame["private"]].groupby(["method", "dataset"], sort=True):
        name = f"{method} ({dataset}) non-private" if many else f"{method} non-private"
        fig.add_hline(
            y=float(group[metric].mean()),
            line_dash="dash",
            opacity=0.6,
            annotation_text=name,
            annotation_position="top left",
        )
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"dash": "dash"}, name=name))
    floor = f"popularity_{metric}"  # the most-popular-items ranking on the same users: the floor to clear
    if floor in frame:
        for dataset, value in frame.groupby("dataset", sort=True)[floor].mean().dropna().items():
            name = f"most popular items ({dataset})" if many else "most popular items"
            fig.add_hline(y=float(value), line_dash="dot", opacity=0.6, annotation_text=name)
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", line={"dash": "dot"}, name=name))
    return fig


def clipping_speed_memory(frame: pd.DataFrame) -> go.Figure:
    """Bars per clipping method of the time of one DP-SGD step (ms) and of the peak memory (MB), the newest
    bench run per method."""
    latest = frame.sort_values("started_at").groupby("method", as_index=False).last()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time per step (ms)", "peak memory (MB)"))
    fig.add_trace(go.Bar(x=latest["method"], y=latest["step_s"] * 1e3, name="step time (ms)"), row=1, col=1)
    fig.add_trace(go.Bar(x=latest["method"], y=latest["peak_mem_mb"], name="peak memory (MB)"), row=1, col=2)
    fig.update_layout(title="DP clipping: speed and memory (privbench bench dp-clipping)", showlegend=False, **_LAYOUT)
    return fig


def train_time(frame: pd.DataFrame) -> go.Figure:
    """Median wall time of a train-dp run per method (private runs only), from the privacy-utility frame."""
    private = frame[frame["private"]].groupby("method", as_index=False)["train_wall_s"].median()
    fig = _figure("Training wall time per run (private grid points, median)", "method", "seconds")
    fig.add_trace(go.Bar(x=private["method"], y=private["train_wall_s"], name="train_wall_s"))
    return fig


def tangent_accuracy(frame: pd.DataFrame) -> go.Figure:
    """Test accuracy against the number of shards, one line per method (taft, soup, sisa; nlft/fc at 1)."""
    fig = _figure("Tangent: test accuracy vs number of shards", "shards", "test accuracy")
    mean = frame.groupby(["method", "n_shards"], as_index=False)["test_accuracy"].mean()
    for method, group in mean.groupby("method", sort=True):
        fig.add_trace(go.Scatter(x=group["n_shards"], y=group["test_accuracy"], mode="lines+markers", name=str(method)))
    fig.update_xaxes(type="log" if mean["n_shards"].max(skipna=True) > 10 else "linear", dtick=1)
    return fig


def unlearning(frame: pd.DataFrame) -> go.Figure:
    """Accuracy against the fraction of shards forgotten (TAFT by subtraction vs SISA), newest run."""
    fig = _figure("Unlearning: accuracy vs fraction of shards removed", "fraction of shards removed", "test accuracy")
    if frame.empty:
        return fig
    newest = frame[frame["run_id"] == frame.sort_values("started_at")["run_id"].iloc[-1]]
    for method, group in newest.groupby("method", sort=True):
        group = group.sort_values("fraction_removed")
        fig.add_trace(
            go.Scatter(
                x=group["fraction_removed"],
                y=group["accuracy"],
                mode="lines+markers",
                name=str(method),
                customdata=group["shards_removed"],
                hovertemplate="%{customdata} shards removed: %{y:.3f}",
            )
        )
    return fig


def mpc_costs(frame: pd.DataFrame) -> go.Figure:
    """Stacked bars per method of time (s) and communication (MB) by op category, plus the LAN and WAN
    projections of the whole run (markers on the time panel)."""
    latest = frame.sort_values("started_at").groupby(["method", "op_category"], as_index=False).last()
    methods = sorted(latest["method"].unique(), key=lambda m: latest.loc[latest["method"] == m, "total_s"].max())
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time (s)", "communication (MB)"))
    for op, group in latest.groupby("op_category", sort=True):
        group = group.set_index("method").reindex(methods)
        fig.add_trace(go.Bar(x=methods, y=group["seconds"], name=str(op), legendgroup=str(op)), row=1, col=1)
        fig.add_trace(
            go.Bar(x=methods, y=group["bytes"] / 1e6, name=str(op), legendgroup=str(op), showlegend=False), row=1, col=2
        )
    runs = latest.groupby("method").last().reindex(methods)
    for column, label, symbol in (
        ("lan_projected_s", "LAN projection", "diamond"),
        ("wan_projected_s", "WAN projection", "x"),
    ):
        fig.add_trace(
            go.Scatter(x=methods, y=runs[column], mode="markers", name=label, marker={"symbol": symbol, "size": 11}),
            row=1,
            col=1,
        )
    fig.update_layout(barmode="stack", title="Secure inference: per-operation cost (slower party)", **_LAYOUT)
    fig.update_yaxes(type="log", row=1, col=1)
    return fig


def stip_overhead(frame: pd.DataFrame) -> go.Figure:
    """Per model and design: server time over plaintext and the user's share of the time (left), bytes per
    generated token up and down (right, log scale)."""
    labels = frame["model"] + " / " + frame["design"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time ratios", "bytes per token"))
    fig.add_trace(go.Bar(x=labels, y=frame["server_over_plaintext_time"], name="server / plaintext time"), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=frame["user_overhead_fraction"], name="user share of time"), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=frame["bytes_up_per_token"], name="bytes up / token"), row=1, col=2)
    fig.add_trace(go.Bar(x=labels, y=frame["bytes_down_per_token"], name="bytes down / token"), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=2)
    fig.update_layout(barmode="group", title="STIP: overhead of the three-party protocol", **_LAYOUT)
    return fig


def stip_attacks(frame: pd.DataFrame) -> go.Figure:
    """Fraction of the secret permutation recovered, grouped bars by attack and model."""
    fig = _figure("STIP: permutation recovery by attack", "attack", "recovery rate")
    for model, group in frame.groupby("model", sort=True):
        fig.add_trace(go.Bar(x=group["attack"], y=group["recovery_rate"], name=str(model)))
    fig.update_layout(barmode="group", yaxis_range=[0, 1.05])
    return fig


def film(frame: pd.DataFrame, metric: str = "rougeL") -> go.Figure:
    """``metric`` (``rouge1``, ``rouge2``, ``rougeL``, ``recall``) of FILM's recovered text against the batch
    size, one line per victim embedding and attacker setting."""
    fig = _figure(f"FILM text recovery: {metric} vs batch size", "batch size", metric)
    mean = frame.groupby(["embedding", "attacker", "batch_size"], as_index=False)[metric].mean()
    for (embedding, attacker), group in mean.groupby(["embedding", "attacker"], sort=True):
        fig.add_trace(
            go.Scatter(x=group["batch_size"], y=group[metric], mode="lines+markers", name=f"{embedding} / {attacker}")
        )
    fig.update_xaxes(type="log", dtick=math.log10(2))
    return fig


def membership_roc(frame: pd.DataFrame) -> go.Figure:
    """ROC curves of the membership attacks (log-log, where low false-positive rates matter), one per
    audited target, setting and attack, with the chance diagonal."""
    fig = _figure("Membership inference: ROC", "false positive rate", "true positive rate")
    for (method, setting, attack), group in frame.groupby(["method", "setting", "attack"], sort=True):
        fig.add_trace(go.Scatter(x=group["fpr"], y=group["tpr"], mode="lines", name=f"{method} {setting} {attack}"))
    fig.add_trace(
        go.Scatter(x=[1e-3, 1], y=[1e-3, 1], mode="lines", line={"dash": "dot", "color": "grey"}, name="chance")
    )
    fig.update_xaxes(type="log", range=[-3, 0])
    fig.update_yaxes(type="log", range=[-3, 0])
    return fig


def membership_epsilon(frame: pd.DataFrame) -> go.Figure:
    """Empirical epsilon lower bound (with its Clopper-Pearson interval) next to the accountant's epsilon, per
    audited target and attack; an infinite upper bound is drawn up to the top of the axis."""
    fig = _figure("Membership inference: empirical vs accountant epsilon", "target / attack", "epsilon")
    dp = frame[frame["audit"] == "dp"]
    labels = dp["method"] + " " + dp["setting"].str.split(",").str[0] + " / " + dp["attack"]
    finite_top = pd.concat([dp["empirical_epsilon_hi"], dp["accountant_epsilon"]]).replace(math.inf, math.nan).max()
    top = (finite_top if pd.notna(finite_top) else 1.0) * 1.2 + 0.1
    hi = dp["empirical_epsilon_hi"].clip(upper=top)
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=dp["empirical_epsilon"],
            mode="markers",
            name="empirical epsilon",
            error_y={
                "type": "data",
                "symmetric": False,
                "array": (hi - dp["empirical_epsilon"]).fillna(0),
                "arrayminus": (dp["empirical_epsilon"] - dp["empirical_epsilon_lo"]).fillna(0),
            },
        )
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=dp["accountant_epsilon"],
            mode="markers",
            name="accountant epsilon",
            marker={"symbol": "line-ew-open", "size": 18, "line": {"width": 3}},
        )
    )
    fig.update_yaxes(range=[0, top])
    return fig


def membership_auc(frame: pd.DataFrame) -> go.Figure:
    """AUC and TPR at 1% / 0.1% FPR per audited target and attack (the summary when no ROC points exist)."""
    labels = frame["method"] + " " + frame["setting"].str.split(",").str[0] + " / " + frame["attack"]
    fig = _figure("Membership inference: AUC and TPR at low FPR", "target / attack", "value")
    for column, name in (("auc", "AUC"), ("tpr_at_1pct_fpr", "TPR @ 1% FPR"), ("tpr_at_0_1pct_fpr", "TPR @ 0.1% FPR")):
        fig.add_trace(go.Bar(x=labels, y=frame[column], name=name))
    fig.update_layout(barmode="group")
    return fig
