"""Which method wins: per stage, each method's key metric as a mean over seeds with a 95% t-interval.

``leaderboard(db_url, **filters)`` ranks the methods of every stage (a "board", see ``BOARDS``) on that stage's
metrics, the key metric first. It reads the rows of the stage's ``storage.views`` view (same filters) and:

1. puts each row in a *context*: the setting methods are compared in (the dataset, the privacy budget, the
   number of shards, the batch size of the attack...; plus any hyperparameter of ``Board.variants`` that takes
   more than one value among the rows, e.g. two learning rates of a train-dp grid are two contexts);
2. reduces the rows of one run in one context to one value per metric: for the attack boards the row of the
   strongest attacker (worst case for the defence), otherwise their mean;
3. keeps one run per (context, method, seed), the newest: a seed run again is a repeat, not a new sample. The
   seed is the run's config ``seed`` (the shallowest one), else its parent's (a flow's ``seed``); a run
   without one counts on its own;
4. aggregates over the seeds: ``n``, ``mean``, the sample standard deviation and the two-sided 95% Student-t
   interval ``mean +- t(0.975, n-1) * std / sqrt(n)`` (``seed_interval``; NaN for n = 1: no interval);
5. marks ``best`` the method(s) with the best mean of a context (the metric says whether higher or lower is
   better) when the context has two ranked methods or more and they do not all tie (a board's ``references``,
   such as the non-private baseline of the clipping bench, are shown but never ranked), and ``clear_win``
   when a single best one's interval lies entirely on the better side of every other method's interval
   (each with n >= 2).

Each row carries the store run ids and the MLflow run and experiment ids of the runs it averages, for the
MLflow compare view.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from scipy import stats
from sqlalchemy import select

from core.errors import ConfigError
from storage import view_query as vq
from storage import views
from storage.models import Run

LEADERBOARD_COLUMNS = [
    "board",
    "stage",
    "title",
    "metric",
    "label",
    "higher_is_better",
    "context",
    "method",
    "reference",
    "n",
    "mean",
    "std",
    "ci_low",
    "ci_high",
    "half_width",
    "best",
    "clear_win",
    "run_ids",
    "mlflow_run_ids",
    "mlflow_experiment_ids",
]
CONFIDENCE = 0.95


@dataclass(frozen=True)
class SeedInterval:
    """Mean over ``n`` seeds with its two-sided Student-t interval (``low``/``high`` NaN when n < 2)."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def seed_interval(values: Iterable[float], confidence: float = CONFIDENCE) -> SeedInterval:
    """Mean and t-interval of ``values`` (one per seed; NaN ignored). Three seeds 1, 2, 3: mean 2, sample std 1,
    half-width t(0.975, 2) / sqrt(3) = 4.303 / 1.732 = 2.484."""
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return SeedInterval(0, math.nan, math.nan, math.nan, math.nan)
    mean = math.fsum(xs) / n
    if n == 1:
        return SeedInterval(1, mean, math.nan, math.nan, math.nan)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * std / math.sqrt(n)
    return SeedInterval(n, mean, std, mean - half, mean + half)


@dataclass(frozen=True)
class RankedMetric:
    name: str
    label: str
    higher_is_better: bool


@dataclass(frozen=True)
class Board:
    """One stage's leaderboard: ``metrics`` (the first is the key metric) of the rows ``rows`` returns, with
    columns ``run_id``, ``method``, ``context`` and one per metric."""

    name: str
    stage: str
    title: str
    metrics: tuple[RankedMetric, ...]
    rows: Callable[..., pd.DataFrame]
    variants: tuple[str, ...] = ()  # dotted config paths: part of the context where they vary
    worst_case: bool = False  # several rows per run and context (attack settings): the strongest attack counts
    references: tuple[str, ...] = ()  # methods shown for reference, never ranked best (the non-private baseline)
    empty: str = ""  # what to run to fill it


def _eps(value: float) -> str:
    return "non-private" if pd.isna(value) else f"ε={value:g}"


def _train_dp(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.privacy_utility(db_url, **filters)
    frame["context"] = frame["dataset"].astype(str) + ", " + frame["epsilon"].map(_eps)
    return frame


def _tangent(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.tangent_accuracy(db_url, **filters)
    frame["context"] = [
        f"{d}, {n} shard{'s' if n != 1 else ''}" for d, n in zip(frame["dataset"], frame["n_shards"], strict=True)
    ]
    return frame


def _secure_inference(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.mpc_costs(db_url, **filters).drop_duplicates("run_id")
    frame["context"] = frame["dataset"].astype(str)
    return frame


def _stip(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.stip_overhead(db_url, **filters)
    frame["method"] = frame["design"]
    frame["context"] = frame["model"].astype(str)
    return frame


def _film(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.film(db_url, **filters)
    frame["method"] = frame["embedding"]
    frame["context"] = [f"batch {b:g}" if pd.notna(b) else "batch ?" for b in frame["batch_size"]]
    return frame


def _membership(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.membership(db_url, **filters)
    frame = frame[frame["audit"] == "dp"].copy()
    frame["method"] = frame["method"].astype(str) + " (" + frame["epsilon"].map(_eps) + ")"
    frame["context"] = frame["dataset"].astype(str)
    return frame


def _clipping(db_url: str | None, **filters: Any) -> pd.DataFrame:
    frame = views.clipping_bench(db_url, **filters)
    frame["context"] = frame["device"].fillna("device ?").astype(str)
    return frame


_LOWER, _HIGHER = False, True
BOARDS: tuple[Board, ...] = (
    Board(
        "train-dp",
        "train-dp",
        "Private training (DPFormer)",
        (
            RankedMetric("ndcg_at_10", "test NDCG@10", _HIGHER),
            RankedMetric("hit_at_10", "test HIT@10", _HIGHER),
            RankedMetric("train_wall_s", "training wall time (s)", _LOWER),
        ),
        _train_dp,
        variants=("point.lr", "point.batch_size"),
        empty="run `privbench run train-dp --profile quick`",
    ),
    Board(
        "tangent",
        "tangent",
        "Tangent (TAFT)",
        (RankedMetric("test_accuracy", "test accuracy", _HIGHER),),
        _tangent,
        variants=("epochs",),
        empty="run `privbench run tangent --profile quick`",
    ),
    Board(
        "secure-inference",
        "secure-inference",
        "Secure inference (MPC)",
        (
            RankedMetric("total_s", "MPC generation time (s)", _LOWER),
            RankedMetric("comm_bytes", "communication (bytes)", _LOWER),
            RankedMetric("wan_projected_s", "WAN projected time (s)", _LOWER),
            RankedMetric("quality_rouge_l", "generation ROUGE-L", _HIGHER),
        ),
        _secure_inference,
        variants=("gen_len", "prefix_len"),
        empty="run `privbench run secure-inference --profile quick`",
    ),
    Board(
        "stip",
        "stip",
        "STIP",
        (
            RankedMetric("server_over_plaintext_time", "server time / plaintext", _LOWER),
            RankedMetric("user_overhead_fraction", "user share of the time", _LOWER),
            RankedMetric("bytes_up_per_token", "bytes up per token", _LOWER),
        ),
        _stip,
        variants=("gen_len", "prompt_len"),
        empty="run `privbench run stip --profile quick`",
    ),
    Board(
        "film",
        "attacks",
        "FILM text recovery (strongest attacker)",
        (RankedMetric("rougeL", "recovered ROUGE-L", _LOWER), RankedMetric("recall", "token recall", _LOWER)),
        _film,
        worst_case=True,
        empty="run `privbench run attacks --profile quick`",
    ),
    Board(
        "membership",
        "attacks",
        "Membership inference (strongest attack)",
        (
            RankedMetric("auc", "attack AUC", _LOWER),
            RankedMetric("tpr_at_1pct_fpr", "TPR at 1% FPR", _LOWER),
            RankedMetric("empirical_epsilon", "empirical epsilon", _LOWER),
        ),
        _membership,
        worst_case=True,
        empty="run `privbench run attacks --profile quick` (with an `attacks.audit` section)",
    ),
    Board(
        "dp-clipping",
        "bench",
        "DP clipping (bench)",
        (
            RankedMetric("step_s", "time per DP-SGD step (s)", _LOWER),
            RankedMetric("peak_mem_mb", "peak memory (MB)", _LOWER),
        ),
        _clipping,
        variants=("setting.d_model", "setting.batch", "setting.seq_len"),
        references=("nonprivate",),
        empty="run `privbench bench dp-clipping`",
    ),
)
BOARD_BY_NAME = {b.name: b for b in BOARDS}


def _lookup(config: dict[str, Any], path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


config_seed = vq.config_seed  # a run's seed from its config (storage.view_query, which the membership view uses too)


def run_meta(db_url: str | None, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run: started_at, git commit, MLflow ids, config (parsed) and seed (its own, else the nearest ancestor's)."""
    engine = vq.engine(db_url)
    columns = [
        "run_id",
        "parent_id",
        "started_at",
        "git_commit",
        "mlflow_run_id",
        "mlflow_experiment_id",
        "config_json",
    ]
    parts = [
        vq.read(
            engine,
            select(
                Run.id.label("run_id"),
                Run.parent_id,
                Run.started_at,
                Run.git_commit,
                Run.mlflow_run_id,
                Run.mlflow_experiment_id,
                Run.config_json,
            ).where(Run.id.in_(list(run_ids[i : i + vq.CHUNK]))),
            columns,
        )
        for i in range(0, len(run_ids), vq.CHUNK)
    ]
    meta = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=columns)
    meta["config"] = [vq.parse_config(c) for c in meta["config_json"]]
    seeds = {r: config_seed(c) for r, c in zip(meta["run_id"], meta["config"], strict=True)}
    parent_of = dict(zip(meta["run_id"], meta["parent_id"], strict=True))
    pending = {r: parent_of[r] for r, s in seeds.items() if s is None and parent_of[r]}
    for _ in range(8):  # flow > task > sub-task: a few levels at most
        if not pending:
            break
        ancestors = vq.read(
            engine,
            select(Run.id, Run.parent_id, Run.config_json).where(Run.id.in_(sorted(set(pending.values())))),
            ["id", "parent_id", "config_json"],
        )
        found = {
            a: (config_seed(vq.parse_config(c)), p)
            for a, p, c in zip(ancestors["id"], ancestors["parent_id"], ancestors["config_json"], strict=True)
        }
        nxt = {}
        for run, ancestor in pending.items():
            seed, parent = found.get(ancestor, (None, None))
            if seed is not None:
                seeds[run] = seed
            elif parent:
                nxt[run] = parent
        pending = nxt
    meta["seed"] = meta["run_id"].map(seeds)
    meta["started_at"] = pd.to_datetime(meta["started_at"], utc=True)
    return meta.drop(columns=["config_json"])


def _with_variants(frame: pd.DataFrame, board: Board) -> pd.DataFrame:
    for path in board.variants:
        values = [_lookup(c, path) for c in frame["config"]]
        if len({repr(v) for v in values if v is not None}) > 1:
            name = path.rsplit(".", 1)[-1]
            frame["context"] = [
                ctx if v is None else f"{ctx}, {name}={v:g}" if isinstance(v, float) else f"{ctx}, {name}={v}"
                for ctx, v in zip(frame["context"], values, strict=True)
            ]
    return frame


def _reduce(frame: pd.DataFrame, board: Board) -> pd.DataFrame:
    """One row per (run, context, method): the worst case over the attack rows, or the mean."""
    keys = ["run_id", "context", "method"]
    aggs = {m.name: ("min" if m.higher_is_better else "max") if board.worst_case else "mean" for m in board.metrics}
    for metric in board.metrics:
        frame[metric.name] = pd.to_numeric(frame[metric.name], errors="coerce").astype(float)
    return frame.groupby(keys, as_index=False, sort=False).agg(aggs)


def _rank(board: Board, per_seed: pd.DataFrame) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for metric in board.metrics:
        for context, in_context in per_seed.groupby("context", sort=True):
            ranked = []
            for method, runs in in_context.groupby("method", sort=True):
                runs = runs[runs[metric.name].notna()]
                if runs.empty:
                    continue
                ci = seed_interval(runs[metric.name])
                ranked.append(
                    {
                        "board": board.name,
                        "stage": board.stage,
                        "title": board.title,
                        "metric": metric.name,
                        "label": metric.label,
                        "higher_is_better": metric.higher_is_better,
                        "context": context,
                        "method": str(method),
                        "reference": str(method) in board.references,
                        "n": ci.n,
                        "mean": ci.mean,
                        "std": ci.std,
                        "ci_low": ci.low,
                        "ci_high": ci.high,
                        "half_width": ci.half_width,
                        "best": False,
                        "clear_win": False,
                        "run_ids": runs["run_id"].tolist(),
                        "mlflow_run_ids": [r for r in runs["mlflow_run_id"] if isinstance(r, str) and r],
                        "mlflow_experiment_ids": sorted(
                            {e for e in runs["mlflow_experiment_id"] if isinstance(e, str) and e}
                        ),
                    }
                )
            sign = 1 if metric.higher_is_better else -1
            ranked.sort(key=lambda r: (r["reference"], -sign * r["mean"], r["method"]))
            _mark_best(ranked, metric.higher_is_better)
            rows += ranked
    return rows


def _mark_best(ranked: list[dict[str, Any]], higher_is_better: bool) -> None:
    """``best``: the best mean among two or more ranked (non-reference) methods, unless they all tie;
    ``clear_win``: a single best whose interval clears every other ranked method's (all with n >= 2)."""
    ranked = [r for r in ranked if not r["reference"]]
    means = {r["mean"] for r in ranked}
    if len(ranked) < 2 or len(means) < 2:
        return
    top = max(means) if higher_is_better else min(means)
    for row in ranked:
        row["best"] = row["mean"] == top
    winners = [r for r in ranked if r["best"]]
    if len(winners) == 1 and all(r["n"] >= 2 for r in ranked):
        (winner,) = winners
        others = [r for r in ranked if r is not winner]
        winner["clear_win"] = all(
            winner["ci_low"] > o["ci_high"] if higher_is_better else winner["ci_high"] < o["ci_low"] for o in others
        )


def leaderboard(db_url: str | None = None, *, boards: Sequence[str] | None = None, **filters: Any) -> pd.DataFrame:
    """The ranked methods of every board (``LEADERBOARD_COLUMNS``), one row per board x metric x context x
    method, best first within a context; ``boards`` restricts to those board names. See the module docstring."""
    chosen = [BOARD_BY_NAME[b] for b in boards] if boards is not None else list(BOARDS)
    out: list[dict[str, Any]] = []
    for board in chosen:
        frame = board.rows(db_url, **filters)
        if frame.empty:
            continue
        meta = run_meta(db_url, frame["run_id"].drop_duplicates().tolist())
        frame = frame.drop(columns=[c for c in meta.columns if c != "run_id" and c in frame.columns])
        frame = frame.merge(meta, on="run_id", how="left")
        frame = _with_variants(frame, board)
        meta = frame.drop_duplicates("run_id").set_index("run_id")
        reduced = _reduce(frame, board)
        reduced = reduced.join(meta[["seed", "started_at", "mlflow_run_id", "mlflow_experiment_id"]], on="run_id")
        # one run per (context, method, seed): the newest; a run without a seed is its own replicate
        reduced["replicate"] = [
            f"seed:{int(s)}" if pd.notna(s) else f"run:{r}"
            for s, r in zip(reduced["seed"], reduced["run_id"], strict=True)
        ]
        reduced = reduced.sort_values("started_at", kind="stable").drop_duplicates(
            ["context", "method", "replicate"], keep="last"
        )
        out += _rank(board, reduced)
    return pd.DataFrame(out, columns=LEADERBOARD_COLUMNS)


__all__ = [
    "BOARDS",
    "BOARD_BY_NAME",
    "CONFIDENCE",
    "LEADERBOARD_COLUMNS",
    "Board",
    "RankedMetric",
    "SeedInterval",
    "config_seed",
    "leaderboard",
    "seed_interval",
]
