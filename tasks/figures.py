"""PNG figures of a flow's result groups, logged to the flow's parent MLflow run (``figures/<group>.png``).

Each stage's figures are drawn from ``storage.views`` restricted to the flow run's subtree (``root=``), so they
show exactly what that run measured: the same groups the dashboard shows across runs. Matplotlib (Agg backend)
draws them; a group with no rows gets no figure.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from storage import views

Draw = Callable[[Any, pd.DataFrame], None]


def _lines(x: str, y: str, by: str, *, panel: str | None = None, logx: bool = False) -> Draw:
    def draw(fig: Any, frame: pd.DataFrame) -> None:
        panels = sorted(frame[panel].dropna().unique()) if panel else [None]
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, value in zip(axes, panels, strict=True):
            part = frame if value is None else frame[frame[panel] == value]
            for name, group in part.groupby(by, dropna=False):
                group = group.sort_values(x)
                ax.plot(group[x], group[y], marker="o", label=str(name))
            ax.set(xlabel=x, ylabel=y, title=str(value) if value is not None else None)
            if logx:
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)

    return draw


def _bars(x: str, ys: tuple[str, ...], *, stack: str | None = None) -> Draw:
    """One panel per column of ``ys``: bars by ``x``, stacked by ``stack`` when given."""

    def draw(fig: Any, frame: pd.DataFrame) -> None:
        axes = fig.subplots(1, len(ys), squeeze=False)[0]
        for ax, y in zip(axes, ys, strict=True):
            if stack:
                table = frame.pivot_table(index=x, columns=stack, values=y, aggfunc="sum").fillna(0)
                table.plot.bar(ax=ax, stacked=True, legend=ax is axes[-1], rot=30)
            else:
                frame.groupby(x)[y].mean().plot.bar(ax=ax, rot=30)
            ax.set(ylabel=y, xlabel="")
            ax.grid(alpha=0.3, axis="y")

    return draw


def _privacy_utility(fig: Any, frame: pd.DataFrame) -> None:
    private = frame[frame["private"]]
    datasets = sorted(frame["dataset"].dropna().unique())
    axes = fig.subplots(1, len(datasets), squeeze=False)[0]
    for ax, dataset in zip(axes, datasets, strict=True):
        for method, group in private[private["dataset"] == dataset].groupby("method"):
            group = group.groupby("epsilon", as_index=False)["ndcg_at_10"].mean()
            ax.plot(group["epsilon"], group["ndcg_at_10"], marker="o", label=method)
        for _, row in frame[(~frame["private"]) & (frame["dataset"] == dataset)].iterrows():
            ax.axhline(row["ndcg_at_10"], linestyle="--", linewidth=0.8, color="grey")
            ax.annotate(
                f"{row['method']} (non-private)",
                (0.01, row["ndcg_at_10"]),
                xycoords=("axes fraction", "data"),
                fontsize=6,
                color="grey",
            )
        floor = (
            frame.loc[frame["dataset"] == dataset, "popularity_ndcg_at_10"]
            if "popularity_ndcg_at_10" in frame
            else None
        )
        if floor is not None and floor.notna().any():  # the most-popular-items ranking of the same users
            ax.axhline(float(floor.mean()), linestyle=":", linewidth=0.8, color="black")
            ax.annotate(
                "most popular items", (0.01, float(floor.mean())), xycoords=("axes fraction", "data"), fontsize=6
            )
        ax.set(xlabel="epsilon", ylabel="test NDCG@10", title=dataset)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def _mpc_projection(fig: Any, frame: pd.DataFrame) -> None:
    per_method = frame.groupby("method")[["total_s", "lan_projected_s", "wan_projected_s"]].first()
    ax = fig.subplots()
    per_method.plot.bar(ax=ax, rot=30)
    ax.set(ylabel="seconds (measured, LAN and WAN projections)", xlabel="", yscale="log")
    ax.grid(alpha=0.3, axis="y")


def _film(fig: Any, frame: pd.DataFrame) -> None:
    frame = frame.assign(victim=frame["embedding"].astype(str) + " / " + frame["attacker"].astype(str))
    frame = frame.groupby(["victim", "batch_size"], as_index=False)[["rougeL", "recall"]].mean()
    _lines("batch_size", "rougeL", "victim", logx=True)(fig, frame)


def _membership(fig: Any, frame: pd.DataFrame) -> None:
    setting = frame["setting"].fillna("").astype(str).str.replace(r",?shadows=\d+", "", regex=True)
    frame = frame.assign(target=frame["method"].astype(str) + " " + setting)
    axes = fig.subplots(1, 2, sharey=True)
    frame.pivot_table(index="target", columns="attack", values="auc").plot.barh(ax=axes[0])
    axes[0].set(xlabel="AUC", ylabel="")
    axes[0].axvline(0.5, linestyle="--", color="grey", linewidth=0.8)
    # same targets in the same (sorted) order on both panels; a target with no bound gets no bar
    eps = frame.pivot_table(index="target", columns="attack", values="empirical_epsilon", dropna=False)
    eps.plot.barh(ax=axes[1], legend=False)
    for value in frame["accountant_epsilon"].dropna().unique():
        axes[1].axvline(value, linestyle="--", color="red", linewidth=0.8)
    axes[1].set(xlabel="empirical eps lower bound (red: accountant)")


# stage -> [(group name, view, draw)]
GROUPS: dict[str, list[tuple[str, Callable[..., pd.DataFrame], Draw]]] = {
    "train-dp": [("privacy_utility", views.privacy_utility, _privacy_utility)],
    "tangent": [
        ("tangent_accuracy", views.tangent_accuracy, _lines("n_shards", "test_accuracy", "method")),
        ("unlearning", views.unlearning, _lines("shards_removed", "accuracy", "method", panel="n_shards")),
    ],
    "secure-inference": [
        ("mpc_costs", views.mpc_costs, _bars("method", ("seconds", "bytes"), stack="op_category")),
        ("mpc_lan_wan", views.mpc_costs, _mpc_projection),
    ],
    "stip": [
        (
            "stip_overhead",
            views.stip_overhead,
            _bars("design", ("server_over_plaintext_time", "user_overhead_fraction"), stack="model"),
        ),
        ("stip_attacks", views.stip_attacks, _bars("attack", ("recovery_rate",), stack="model")),
    ],
    "attacks": [
        ("film_rouge", views.film, _film),
        ("membership", views.membership, _membership),
    ],
}


def render_figures(stage: str, root: str, out_dir: Path, db_url: str | None = None) -> list[Path]:
    """Draw ``stage``'s result groups for the runs under ``root`` into ``out_dir``; returns the PNGs written."""
    groups = GROUPS.get(stage, [])
    if not groups:
        return []
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    written = []
    for name, view, draw in groups:
        frame = view(db_url, root=root)
        if frame.empty:
            continue
        fig = Figure(figsize=(11, 5 if name == "membership" else 4.2), layout="constrained")
        draw(fig, frame)
        fig.suptitle(f"{stage}: {name.replace('_', ' ')}")
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written
