"""Read-side views of the results store: one pandas DataFrame per "result group" the dashboard shows.

Every view takes ``db_url`` (None: the configured ``PRIVBENCH_DB_URL``) and the same keyword filters:

* ``dataset``: the run's dataset (``runs.dataset``); runs without one (flow runs, benchmarks) drop out;
* ``profile``: the run's profile (``quick``, ``paper``, ...);
* ``since`` / ``until``: bounds on ``runs.started_at`` (naive datetimes are taken as UTC);
* ``commit``: a prefix of ``runs.git_commit``;
* ``root``: a run id; only that run and its descendants (``parent_id``, recursively) are kept.

Views work on SQLite and PostgreSQL (SQLAlchemy Core only) and return an empty frame with the documented
columns on an empty store. Result views keep finished runs only; ``runs`` lists every status.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import Select, func, select
from sqlalchemy.engine import Engine

from core.errors import ConfigError
from pbconfig.settings import get_settings
from storage.db import get_engine
from storage.models import AttackResult, Metric, MpcCost, PrivacyLedger, Run
from storage.view_columns import (
    CLIPPING_COLUMNS,
    FILM_COLUMNS,
    MEMBERSHIP_COLUMNS,
    MPC_COSTS_COLUMNS,
    PRIVACY_UTILITY_COLUMNS,
    REATTENTION_COLUMNS,
    ROC_COLUMNS,
    RUNS_COLUMNS,
    STIP_ATTACKS_COLUMNS,
    STIP_OVERHEAD_COLUMNS,
    TANGENT_ACCURACY_COLUMNS,
    TRAIN_SEARCH_COLUMNS,
    UNLEARNING_COLUMNS,
)

MIA_ATTACKS = ("loss", "lira_online", "lira_offline")
_NOT_TRAINED_MODELS = ("flow", "feature-cache")
_CHUNK = 500


@dataclass(frozen=True, kw_only=True)
class Filters:
    """The dashboard's filters (see the module docstring); ``None`` means no restriction."""

    dataset: str | None = None
    profile: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    commit: str | None = None
    root: str | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and _utc(self.since) > _utc(self.until):
            raise ConfigError(
                f"since must not be after until, got since={self.since!r}, until={self.until!r}; swap them"
            )

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        """``stmt`` (which selects from ``runs``) restricted to the filtered runs."""
        if self.dataset is not None:
            stmt = stmt.where(Run.dataset == self.dataset)
        if self.profile is not None:
            stmt = stmt.where(Run.profile == self.profile)
        if self.since is not None:
            stmt = stmt.where(Run.started_at >= _utc(self.since))
        if self.until is not None:
            stmt = stmt.where(Run.started_at <= _utc(self.until))
        if self.commit:
            stmt = stmt.where(Run.git_commit.startswith(self.commit, autoescape=True))
        if self.root is not None:
            tree = select(Run.id).where(Run.id == self.root).cte("subtree", recursive=True)
            tree = tree.union_all(select(Run.id).where(Run.parent_id == tree.c.id))
            stmt = stmt.where(Run.id.in_(select(tree.c.id)))
        return stmt


def _filters(given: dict[str, Any]) -> Filters:
    known = [f.name for f in fields(Filters)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"unknown filter(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return Filters(**given)


def _utc(moment: datetime) -> datetime:
    """Naive datetimes are UTC (the store writes UTC); SQLite compares the stored text without an offset."""
    aware = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return aware.replace(tzinfo=None)


def _engine(db_url: str | None) -> Engine:
    return get_engine(db_url or get_settings().db_url)


def _read(engine: Engine, stmt: Select[Any], columns: list[str] | None = None) -> pd.DataFrame:
    with engine.connect() as conn:
        result = conn.execute(stmt)
        frame = pd.DataFrame(result.fetchall(), columns=list(result.keys()))
    if columns is not None and frame.empty:
        return pd.DataFrame(columns=columns)
    return frame


def _timestamps(frame: pd.DataFrame, *names: str) -> pd.DataFrame:
    for name in names:
        if name in frame:
            frame[name] = pd.to_datetime(frame[name], utc=True)
    return frame


def _result_runs(engine: Engine, f: Filters, *conditions: Any) -> pd.DataFrame:
    """Finished runs matching ``f`` and ``conditions``: id, technique, dataset, config_json, started_at, ..."""
    stmt = select(
        Run.id.label("run_id"),
        Run.technique,
        Run.dataset,
        Run.config_json,
        Run.started_at,
        Run.git_commit,
        Run.mlflow_run_id,
        Run.device,
    ).where(Run.status == "finished", *conditions)
    frame = _read(engine, f.apply(stmt).order_by(Run.started_at, Run.id))
    return _timestamps(frame, "started_at")


def _metrics_wide(
    engine: Engine, run_ids: list[str], names: list[str] | None = None, like: str | None = None
) -> pd.DataFrame:
    """Scalar metrics (no step) of ``run_ids`` as one row per run, one column per metric name."""
    parts = []
    for start in range(0, len(run_ids), _CHUNK):
        stmt = select(Metric.run_id, Metric.name, Metric.value).where(
            Metric.run_id.in_(run_ids[start : start + _CHUNK]), Metric.step.is_(None)
        )
        if names is not None:
            stmt = stmt.where(Metric.name.in_(names))
        if like is not None:
            stmt = stmt.where(Metric.name.like(like))
        parts.append(_read(engine, stmt, ["run_id", "name", "value"]))
    long = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run_id", "name", "value"])
    wide = long.pivot_table(index="run_id", columns="name", values="value", aggfunc="last") if len(long) else None
    out = pd.DataFrame({"run_id": run_ids})
    if wide is not None:
        out = out.merge(wide.reset_index(), on="run_id", how="left")
    for name in names or ():
        if name not in out:
            out[name] = math.nan
    return out


def _finish(frame: pd.DataFrame, columns: list[str], sort: list[str]) -> pd.DataFrame:
    if frame.empty:
        return pd.DataFrame(columns=columns)
    return frame[columns].sort_values(sort, kind="stable").reset_index(drop=True)


def _config(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def runs(
    db_url: str | None = None, *, limit: int | None = 200, status: str | None = None, **filters: Any
) -> pd.DataFrame:
    """Runs, newest first (``RUNS_COLUMNS``), of every status unless ``status`` is given."""
    f = _filters(filters)
    stmt = select(*(getattr(Run, c) for c in RUNS_COLUMNS))
    if status is not None:
        stmt = stmt.where(Run.status == status)
    stmt = f.apply(stmt).order_by(Run.started_at.desc(), Run.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return _timestamps(_read(_engine(db_url), stmt, RUNS_COLUMNS), "started_at", "finished_at")


def privacy_utility(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Train-dp grid points (``PRIVACY_UTILITY_COLUMNS``): ``epsilon`` is the target epsilon (NaN for the
    non-private baselines, ``private`` False), ``epsilon_spent`` the accountant's, ``ndcg_at_10`` /
    ``hit_at_10`` the test metrics at the best validation epoch, ``final_*`` at the last epoch (full ranking, the
    user's history ranked); ``*_masked`` the same with the history masked (RecBole's protocol), at the best epoch on
    masked validation (NaN for runs recorded before both protocols were); ``popularity_*`` the most-popular-items
    ranking's test NDCG@10 on the same data (the floor a trained model must clear; NaN for runs recorded before
    it was)."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "train-dp", Run.technique.not_in(_NOT_TRAINED_MODELS))
    if base.empty:
        return pd.DataFrame(columns=PRIVACY_UTILITY_COLUMNS)
    names = [
        "test_ndcg_at_10",
        "test_hit_at_10",
        "test_ndcg_at_10_masked",
        "test_hit_at_10_masked",
        "final_test_ndcg_at_10",
        "final_test_hit_at_10",
        "popularity.test_ndcg_at_10",
        "popularity.test_ndcg_at_10_masked",
        "train_wall_s",
        "steps",
        "epsilon_with_tuning",
        "delta_with_tuning",
        "tuning.points",
    ]
    frame = base.merge(_metrics_wide(engine, base["run_id"].tolist(), names), on="run_id")
    for column in names:  # a metric no run recorded (e.g. epsilon_with_tuning without a search) is NaN
        if column not in frame:
            frame[column] = math.nan
    configs = [_config(c) for c in frame["config_json"]]
    points = [c.get("point", {}) for c in configs]
    frame["lr"] = [p.get("lr", math.nan) for p in points]
    frame["batch_size"] = [p.get("batch_size", math.nan) for p in points]
    # the epochs the run trained for: its training config's (a non-private baseline's own schedule included)
    frame["epochs"] = [(c.get("train") or {}).get("epochs", math.nan) for c in configs]
    frame["tuning_run_id"] = [(p.get("tuned") or {}).get("run_id") for p in points]
    ledger = _read(
        engine,
        select(
            PrivacyLedger.run_id,
            PrivacyLedger.epsilon.label("epsilon_spent"),
            PrivacyLedger.target_epsilon,
            PrivacyLedger.delta,
            PrivacyLedger.noise_multiplier,
        ).where(PrivacyLedger.run_id.in_(select(Run.id).where(Run.stage == "train-dp"))),
        ["run_id", "epsilon_spent", "target_epsilon", "delta", "noise_multiplier"],
    )
    frame = frame.merge(ledger.drop_duplicates("run_id", keep="last"), on="run_id", how="left")
    frame["private"] = frame["epsilon_spent"].notna()
    frame["epsilon"] = pd.to_numeric(frame["target_epsilon"], errors="coerce").astype(float)
    frame = frame.rename(
        columns={
            "technique": "method",
            "test_ndcg_at_10": "ndcg_at_10",
            "test_hit_at_10": "hit_at_10",
            "test_ndcg_at_10_masked": "ndcg_at_10_masked",
            "test_hit_at_10_masked": "hit_at_10_masked",
            "final_test_ndcg_at_10": "final_ndcg_at_10",
            "final_test_hit_at_10": "final_hit_at_10",
            "popularity.test_ndcg_at_10": "popularity_ndcg_at_10",
            "popularity.test_ndcg_at_10_masked": "popularity_ndcg_at_10_masked",
            "tuning.points": "tuning_points",
        }
    )
    return _finish(frame, PRIVACY_UTILITY_COLUMNS, ["dataset", "method", "epsilon"])


def _keyed_rows(
    engine: Engine,
    run_ids: list[str],
    prefix: str,
    key: str,
    columns: Sequence[str],
    parse: Callable[[str], Any] = str,
) -> list[dict[str, Any]]:
    """The metrics named ``<prefix><k>.<field>`` as rows: one per run and ``k`` (column ``key``, ``parse``d, in
    sorted order) with each of ``columns`` (NaN where the run did not record it)."""
    wide = _metrics_wide(engine, run_ids, like=f"{prefix}%")
    rows = []
    for record in wide.to_dict("records"):
        for k in sorted({parse(name[len(prefix) :].split(".")[0]) for name in record if name.startswith(prefix)}):
            rows.append(
                {"run_id": record["run_id"], key: k}
                | {column: record.get(f"{prefix}{k}.{column}", math.nan) for column in columns}
            )
    return rows


def reattention_sizes(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """How far DPFormer's Re-Attention moves attention (``REATTENTION_COLUMNS``): per train-dp run and block (1 =
    first), over the last epoch's training batches, the correction's median and maximum in nats and
    ``attention_tv``, the mean total-variation distance between the corrected and uncorrected attention of a real
    query (``core.dp.propagation.CorrectionSizes``)."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "train-dp", Run.technique == "dpformer")
    if base.empty:
        return pd.DataFrame(columns=REATTENTION_COLUMNS)
    rows = _keyed_rows(engine, base["run_id"].tolist(), "reattention.block", "block", REATTENTION_COLUMNS[4:7], int)
    if not rows:
        return pd.DataFrame(columns=REATTENTION_COLUMNS)
    frame = pd.DataFrame(rows).merge(base, on="run_id")
    frame["epsilon"] = [_config(c).get("point", {}).get("epsilon", math.nan) for c in frame["config_json"]]
    return _finish(frame, REATTENTION_COLUMNS, ["dataset", "epsilon", "block"])


def train_search(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """The train-dp recipe search on validation (``TRAIN_SEARCH_COLUMNS``, stage ``train-dp-tuning``): one row
    per search run with its learning rate, batch size and best validation NDCG@10 under both protocols;
    ``chosen``: a final train-dp run names this run as the search point it was trained at."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "train-dp-tuning", Run.technique != "flow")
    if base.empty:
        return pd.DataFrame(columns=TRAIN_SEARCH_COLUMNS)
    names = ["valid_ndcg_at_10", "valid_ndcg_at_10_masked"]
    frame = base.merge(_metrics_wide(engine, base["run_id"].tolist(), names), on="run_id")
    points = [_config(c).get("point", {}) for c in frame["config_json"]]
    for key in ("epsilon", "seed", "lr", "batch_size"):
        frame[key] = [p.get(key) for p in points]
    frame["private"] = frame["epsilon"].notna()
    picked = set(privacy_utility(db_url, **filters)["tuning_run_id"].dropna())
    frame["chosen"] = frame["run_id"].isin(picked)
    frame = frame.rename(columns={"technique": "method"})
    return _finish(frame, TRAIN_SEARCH_COLUMNS, ["dataset", "method", "private", "lr", "batch_size"])


def clipping_bench(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """``privbench bench dp-clipping`` records (``CLIPPING_COLUMNS``): per method, the median time of one
    DP-SGD step (``step_s``) and the peak memory above the set-up (``peak_mem_mb``), one row per run x method."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.flow == "bench", Run.technique == "dp-clipping")
    if base.empty:
        return pd.DataFrame(columns=CLIPPING_COLUMNS)
    measures = ("step_s", "peak_mem_mb", "n_params", "d_model")
    rows = _keyed_rows(engine, base["run_id"].tolist(), "methods.", "method", measures)
    frame = pd.DataFrame(rows, columns=["run_id", "method", *measures])
    frame = frame.dropna(subset=["step_s", "peak_mem_mb"], how="all")
    frame = frame.merge(base[["run_id", "started_at", "git_commit", "device"]], on="run_id")
    return _finish(frame, CLIPPING_COLUMNS, ["started_at", "method"])


_TANGENT_METHODS = {
    "taft-1": ("taft", 1),
    "nlft-1": ("nlft", 1),
    "fc": ("fc", 1),
    "taft-composed": ("taft", None),
    "model-soup": ("soup", None),
    "sisa": ("sisa", None),
}


def tangent_accuracy(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Test accuracy by method and number of shards (``TANGENT_ACCURACY_COLUMNS``): one model (``taft``,
    ``nlft``, ``fc``; 1 shard) and the compositions of n shard models (``taft`` = composed tangent models,
    ``soup`` = Model Soup of the non-linear shards, ``sisa`` = their output ensemble)."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "tangent", Run.technique.in_(list(_TANGENT_METHODS)))
    if base.empty:
        return pd.DataFrame(columns=TANGENT_ACCURACY_COLUMNS)
    frame = base.merge(
        _metrics_wide(engine, base["run_id"].tolist(), ["test_accuracy", "mean_component_accuracy"]), on="run_id"
    )
    frame["method"] = frame["technique"].map(lambda t: _TANGENT_METHODS[t][0])
    frame["n_shards"] = [
        _TANGENT_METHODS[t][1] or _config(c).get("n_shards") for t, c in zip(frame["technique"], frame["config_json"])
    ]
    frame = frame.dropna(subset=["n_shards", "test_accuracy"])
    frame["n_shards"] = frame["n_shards"].astype(int)
    return _finish(frame, TANGENT_ACCURACY_COLUMNS, ["method", "n_shards", "started_at"])


def unlearning(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """The Fig. 1 curves (``UNLEARNING_COLUMNS``): test accuracy of the composed TAFT model after forgetting
    shards by subtraction, and of SISA, against the number (and fraction) of the ``n_shards`` removed."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "tangent", Run.technique == "forget-subtraction")
    if base.empty:
        return pd.DataFrame(columns=UNLEARNING_COLUMNS)
    curves = _read(
        engine,
        select(Metric.run_id, Metric.name, Metric.step, Metric.value).where(
            Metric.run_id.in_(base["run_id"].tolist()),
            Metric.name.in_(["taft_accuracy", "sisa_accuracy"]),
            Metric.step.is_not(None),
        ),
        ["run_id", "name", "step", "value"],
    )
    frame = curves.merge(base, on="run_id")
    frame["method"] = frame["name"].str.removesuffix("_accuracy")
    frame["n_shards"] = [_config(c).get("n_shards", math.nan) for c in frame["config_json"]]
    frame = frame.rename(columns={"step": "shards_removed", "value": "accuracy"})
    frame["fraction_removed"] = frame["shards_removed"] / frame["n_shards"]
    return _finish(frame, UNLEARNING_COLUMNS, ["run_id", "method", "shards_removed"])


def mpc_costs(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Per-operation MPC costs of each secure-inference method run (``MPC_COSTS_COLUMNS``; the generation-length
    scaling runs ``scaling-*`` are left out), one row per run x op category: the slower party's seconds, bytes and
    rounds (summed over phases, then max over parties),
    with the run's totals and its LAN/WAN projections (``lan_projected_s``, ``wan_projected_s``)."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(
        engine,
        f,
        Run.stage == "secure-inference",
        Run.technique.not_like("scaling-%"),
        Run.id.in_(select(MpcCost.run_id).distinct()),
    )
    if base.empty:
        return pd.DataFrame(columns=MPC_COSTS_COLUMNS)
    costs = _read(
        engine,
        select(
            MpcCost.run_id,
            MpcCost.op_category,
            MpcCost.party,
            func.sum(MpcCost.seconds).label("seconds"),
            func.sum(MpcCost.bytes).label("bytes"),
            func.sum(MpcCost.rounds).label("rounds"),
        )
        .where(MpcCost.run_id.in_(base["run_id"].tolist()))
        .group_by(MpcCost.run_id, MpcCost.op_category, MpcCost.party),
    )
    per_op = costs.groupby(["run_id", "op_category"], as_index=False).agg(
        seconds=("seconds", "max"), bytes=("bytes", "max"), rounds=("rounds", "max"), parties=("party", "nunique")
    )
    totals = _metrics_wide(
        engine,
        base["run_id"].tolist(),
        ["total_s", "comm_bytes", "lan.projected_s", "wan.projected_s", "quality.rouge_l"],
    )
    totals = totals.rename(
        columns={
            "lan.projected_s": "lan_projected_s",
            "wan.projected_s": "wan_projected_s",
            "quality.rouge_l": "quality_rouge_l",
        }
    )
    frame = per_op.merge(base.rename(columns={"technique": "method"}), on="run_id").merge(totals, on="run_id")
    for name in ("seconds", "bytes", "rounds"):
        frame[name] = pd.to_numeric(frame[name])
    return _finish(frame, MPC_COSTS_COLUMNS, ["started_at", "method", "op_category"])


_STIP_METRICS = STIP_OVERHEAD_COLUMNS[3:-1]


def stip_overhead(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """STIP protocol runs (``STIP_OVERHEAD_COLUMNS``) per model and design (``user_embed``, ``vocab_perm``):
    server time over plaintext, the user's share of the time, bytes per generated token, correctness."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "stip", Run.technique.startswith("stip-"))
    if base.empty:
        return pd.DataFrame(columns=STIP_OVERHEAD_COLUMNS)
    frame = base.merge(_metrics_wide(engine, base["run_id"].tolist(), _STIP_METRICS), on="run_id")
    frame["design"] = frame["technique"].str.removeprefix("stip-")
    frame = frame.rename(columns={"dataset": "model"})
    return _finish(frame, STIP_OVERHEAD_COLUMNS, ["model", "design", "started_at"])


def config_seed(config: dict[str, Any]) -> int | None:
    """The shallowest integer ``seed`` of a run's config (breadth first, keys in order), None if it has none."""
    level: list[dict[str, Any]] = [config]
    while level:
        for node in level:
            seed = node.get("seed")
            if isinstance(seed, int) and not isinstance(seed, bool):
                return seed
        level = [v for node in level for v in node.values() if isinstance(v, dict)]
    return None


def _attacks(engine: Engine, f: Filters, *conditions: Any) -> pd.DataFrame:
    stmt = (
        select(
            AttackResult, Run.dataset, Run.technique, Run.started_at, Run.mlflow_run_id, Run.parent_id, Run.config_json
        )
        .join(Run, Run.id == AttackResult.run_id)
        .where(Run.status == "finished", *conditions)
    )
    with engine.connect() as conn:
        rows = conn.execute(f.apply(stmt).order_by(Run.started_at, AttackResult.id)).mappings().all()
    return _timestamps(pd.DataFrame([dict(r) for r in rows]), "started_at")


def stip_attacks(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Permutation-recovery attacks on STIP (``STIP_ATTACKS_COLUMNS``): the fraction of the secret permutation
    recovered (``recovery_rate``) and of the input tokens, by attack and model."""
    engine, f = _engine(db_url), _filters(filters)
    frame = _attacks(engine, f, Run.stage == "stip")
    if frame.empty:
        return pd.DataFrame(columns=STIP_ATTACKS_COLUMNS)
    extra = [_config(e) for e in frame["extra_json"]]
    frame["model"] = frame["target"].str.removeprefix("stip:")
    frame["attack"] = frame["attack"].str.removeprefix("stip_")
    frame["recovery_rate"] = frame["recovered_fraction"].fillna(pd.Series([e.get("recovery_rate") for e in extra]))
    frame["input_tokens_recovered"] = [e.get("input_tokens_recovered", math.nan) for e in extra]
    return _finish(frame, STIP_ATTACKS_COLUMNS, ["model", "attack", "started_at"])


_BATCH = re.compile(r"batch=(\d+)")


def film(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """FILM text recovery from FedSGD embedding gradients (``FILM_COLUMNS``): ROUGE-1/2/L of the recovered
    sentences (``rouge_min``: the lowest of the three) and the recall of their tokens, by victim embedding
    (``subword``, ``seb_*``), attacker setting (``subwords``; against SEB ``bytes``, ``positional``, ``relaxed``),
    the attacker's prior (``film.priors``' name; NaN for runs recorded before priors were named) and batch size."""
    engine, f = _engine(db_url), _filters(filters)
    frame = _attacks(engine, f, Run.stage == "attacks", AttackResult.attack == "film")
    if frame.empty:
        return pd.DataFrame(columns=FILM_COLUMNS)
    extra = [_config(e) for e in frame["extra_json"]]
    frame["embedding"] = frame["target"]
    frame["attacker"] = frame["setting"].fillna("").str.split(",").str[0]
    frame["prior"] = frame["setting"].fillna("").str.extract(r"prior=([^,]+)", expand=False)  # NaN: one prior
    frame["batch_size"] = [_batch_size(e, s) for e, s in zip(extra, frame["setting"], strict=True)]
    frame["precision"] = [e.get("precision", math.nan) for e in extra]
    frame["n_candidates"] = [e.get("n_candidates", math.nan) for e in extra]
    frame["rouge_min"] = frame[["rouge1", "rouge2", "rougeL"]].min(axis=1, skipna=False)
    return _finish(frame, FILM_COLUMNS, ["embedding", "attacker", "prior", "batch_size", "started_at"])


def _batch_size(extra: dict[str, Any], setting: str | None) -> float:
    if extra.get("batch_size") is not None:
        return float(extra["batch_size"])
    found = _BATCH.search(setting or "")
    return float(found.group(1)) if found else math.nan


_EPS = re.compile(r"eps=([0-9.eE+-]+)")


def membership(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Membership-inference audits (``MEMBERSHIP_COLUMNS``), with the AUC's 95% interval over the audited users
    (``auc_lo``, ``auc_hi``: DeLong), the attack chosen on one half of the users (``selected``) with every
    attack's AUC on the other half (``auc_heldout``, ``auc_heldout_lo``, ``auc_heldout_hi``), and the audit's power
    ``certifiable_epsilon_max`` (the largest ``empirical_epsilon_lo`` the audit could report at its sample sizes, a
    perfect attack's; a run where it does not exceed ``accountant_epsilon`` cannot show the guarantee broken) and
    the attacks' reach ``nonprivate_epsilon_lo`` (what they certified on the same audit's non-private model).
    ``audit`` is ``dp`` for the DP-trained recommenders (``method`` and target ``epsilon``; NaN and ``private``
    False for non-private targets) and ``unlearning`` for TAFT's forgetting audit (``setting`` says before/after
    and which users)."""
    engine, f = _engine(db_url), _filters(filters)
    frame = _attacks(engine, f, Run.stage == "attacks", AttackResult.attack.in_(MIA_ATTACKS))
    if frame.empty:
        return pd.DataFrame(columns=MEMBERSHIP_COLUMNS)
    target = frame["target"].str.split(":", n=1)
    frame["dataset"] = target.str[0]
    frame["method"] = target.str[1]
    frame["audit"] = ["unlearning" if t == "mia-unlearning" else "dp" for t in frame["technique"]]
    eps = [(float(m.group(1)) if (m := _EPS.search(s or "")) else math.nan) for s in frame["setting"]]
    frame["epsilon"] = pd.Series(eps, dtype=float)
    frame["private"] = frame["epsilon"].notna() | frame["accountant_epsilon"].notna()
    extra = [_config(e) for e in frame["extra_json"]]
    for bound in ("auc_lo", "auc_hi"):  # DeLong's 95% interval over the audited users (NaN before it was recorded)
        frame[bound] = pd.Series([e.get(bound, math.nan) for e in extra], index=frame.index, dtype=float)
    # the attack the audit chose on one half of its users, and every attack's AUC on the other half with its DeLong
    # interval (``core.attacks.audit``; NaN, and selected False, before it was recorded)
    frame["selected"] = pd.Series([bool(e.get("selected", False)) for e in extra], index=frame.index, dtype=bool)
    for column in ("auc_heldout", "auc_heldout_lo", "auc_heldout_hi"):
        frame[column] = pd.Series([e.get(column, math.nan) for e in extra], index=frame.index, dtype=float)
    # the audit's power: the largest empirical_epsilon_lo it could certify at its size (NaN before it was recorded)
    # the audited models' recipe (config.train: NaN for the unlearning audit)
    train = [_config(c).get("train") or {} for c in frame["config_json"]]
    for column in ("lr", "batch_size", "epochs"):
        frame[column] = pd.Series([t.get(column, math.nan) for t in train], index=frame.index, dtype=float)
    # and both at the audit's family confidence, 1 - alpha / family (Bonferroni; NaN before it was recorded)
    for column in ("certifiable_epsilon_max", "empirical_epsilon_lo_family", "certifiable_epsilon_max_family"):
        frame[column] = pd.Series([e.get(column, math.nan) for e in extra], index=frame.index, dtype=float)
    # the attacks' own reach: the strongest empirical_epsilon_lo the same audit (same attacks run, same dataset)
    # certified on its non-private model, which no noise protects; a DP model audited at an accountant epsilon
    # above it could not have been caught over-spending by these attacks (NaN: the audit had no such model)
    # (same seed: with several audit seeds under one parent, each DP model against its own seed's control, not the
    # strongest of them)
    dp = frame["audit"] == "dp"
    seeds = [config_seed(_config(c)) for c in frame["config_json"]]
    frame["_seed"] = [-1 if seed is None else seed for seed in seeds]  # a run without a seed: one group, not NaN
    control = frame[dp & ~frame["private"]].groupby(["parent_id", "dataset", "_seed"])
    for column in ("empirical_epsilon_lo", "empirical_epsilon_lo_family"):
        best = control[column].max()
        frame[column.replace("empirical", "nonprivate")] = [
            float(best.get((parent, ds, seed), math.nan)) if is_dp else math.nan
            for parent, ds, seed, is_dp in zip(frame["parent_id"], frame["dataset"], frame["_seed"], dp, strict=True)
        ]
    return _finish(frame, MEMBERSHIP_COLUMNS, ["audit", "dataset", "method", "epsilon", "attack"])


def membership_roc(db_url: str | None = None, artifact_root: Path | None = None, **filters: Any) -> pd.DataFrame:
    """ROC curve points of the DP audits (``ROC_COLUMNS``), one row per point. The store keeps the audits'
    AUC and TPR at low FPR; the curves are each audited run's MLflow artifact ``roc.json``. It is read from the
    local artifact root (``artifact_root``, default ``<PRIVBENCH_HOME>/mlartifacts``) when it is there, and
    otherwise fetched from the configured MLflow tracking store (``MLFLOW_TRACKING_URI``: an MLflow server with
    served artifacts, object storage); runs whose artifact cannot be had are left out."""
    audits = membership(db_url, **filters)
    audits = audits[audits["audit"] == "dp"].drop_duplicates("run_id")
    root = artifact_root or get_settings().artifact_root
    tracker = None
    rows: list[dict[str, Any]] = []
    for audit in audits.to_dict("records"):
        if not audit["mlflow_run_id"]:
            continue
        local = sorted(root.glob(f"*/{audit['mlflow_run_id']}/artifacts/roc.json")) if root.is_dir() else []
        if local:
            curves = _config(local[0].read_text())
        else:
            if tracker is None:
                from storage.tracking import Tracker

                tracker = Tracker(get_settings().tracking_uri)
            curves = tracker.load_json(audit["mlflow_run_id"], "roc.json") or {}
        for attack, curve in curves.items():
            for fpr, tpr in zip(curve.get("fpr", ()), curve.get("tpr", ()), strict=False):
                rows.append(
                    {
                        **{k: audit[k] for k in ("run_id", "dataset", "method", "setting")},
                        "attack": attack,
                        "fpr": fpr,
                        "tpr": tpr,
                    }
                )
    return pd.DataFrame(rows, columns=ROC_COLUMNS)


def filter_options(db_url: str | None = None) -> dict[str, Any]:
    """What the filters can take: ``datasets``, ``profiles``, ``commits`` (newest first), ``first`` and
    ``last`` run start (UTC timestamps, None on an empty store)."""
    engine = _engine(db_url)
    with engine.connect() as conn:
        datasets = conn.scalars(select(Run.dataset).where(Run.dataset.is_not(None)).distinct()).all()
        profiles = conn.scalars(select(Run.profile).where(Run.profile.is_not(None)).distinct()).all()
        commits = conn.execute(
            select(Run.git_commit, func.max(Run.started_at).label("last"))
            .where(Run.git_commit.is_not(None))
            .group_by(Run.git_commit)
        ).all()
        first, last = conn.execute(select(func.min(Run.started_at), func.max(Run.started_at))).one()
    return {
        "datasets": sorted(datasets),
        "profiles": sorted(profiles),
        "commits": [c for c, _ in sorted(commits, key=lambda r: str(r[1]), reverse=True)],
        "first": _stamp(first),
        "last": _stamp(last),
    }


def _stamp(value: datetime | str | None) -> pd.Timestamp | None:
    if value is None:
        return None
    stamp = pd.Timestamp(value)
    return stamp.tz_localize(UTC) if stamp.tzinfo is None else stamp.tz_convert(UTC)


__all__ = [
    "Filters",
    "clipping_bench",
    "film",
    "filter_options",
    "membership",
    "membership_roc",
    "mpc_costs",
    "privacy_utility",
    "reattention_sizes",
    "runs",
    "stip_attacks",
    "stip_overhead",
    "tangent_accuracy",
    "train_search",
    "unlearning",
]
