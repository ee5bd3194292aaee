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

import math
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from storage.attack_views import film, membership, membership_roc, stip_attacks
from storage.models import Metric, MpcCost, PrivacyLedger, Run
from storage.view_columns import (
    CLIPPING_COLUMNS,
    GENERATION_QUALITY_COLUMNS,
    MPC_COSTS_COLUMNS,
    PRIVACY_UTILITY_COLUMNS,
    REATTENTION_COLUMNS,
    RUNS_COLUMNS,
    SEB_UTILITY_COLUMNS,
    STIP_OVERHEAD_COLUMNS,
    TANGENT_ACCURACY_COLUMNS,
    TRAIN_SEARCH_COLUMNS,
    UNLEARNING_COLUMNS,
)
from storage.view_query import Filters
from storage.view_query import engine as _engine
from storage.view_query import filters as _filters
from storage.view_query import finish as _finish
from storage.view_query import metrics_wide as _metrics_wide
from storage.view_query import parse_config as _config
from storage.view_query import read as _read
from storage.view_query import result_runs as _result_runs
from storage.view_query import timestamps as _timestamps

_NOT_TRAINED_MODELS = ("flow", "feature-cache")


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
    # the one model's recipe (a search's chosen point where the stage searched; NaN for compositions, whose run
    # records no learning rate of its own)
    configs = [_config(c) for c in frame["config_json"]]
    for key in ("lr", "epochs"):
        frame[key] = pd.Series([c.get(key, math.nan) for c in configs], index=frame.index, dtype=float)
    # the schedule (the epochs after which the learning rate is divided, "none": constant) and the learning rates
    # the method's search chose among (None where it trained at one rate without a search)
    frame["lr_milestones"] = [_joined(c["lr_milestones"]) if "lr_milestones" in c else None for c in configs]
    frame["searched_lrs"] = [_searched_lrs(c.get("search_grid")) for c in configs]
    return _finish(frame, TANGENT_ACCURACY_COLUMNS, ["method", "n_shards", "started_at"])


def _joined(values: list[Any]) -> str:
    return "/".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values) or "none"


def _searched_lrs(grid: list[Any] | None) -> str | None:
    """The learning rates of a Table 1 search grid (points ``[lr, PT, CLS]`` for TAFT, ``lr`` for the others)."""
    if not grid or len(grid) < 2:
        return None
    return _joined(list(dict.fromkeys(p[0] if isinstance(p, list) else p for p in grid)))


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
    with the run's totals and its LAN/WAN projections (``lan_projected_s``, ``wan_projected_s``) and the model
    family it ran (``base``: ``gpt2`` or ``smollm2``, the stage's ``secure_inference.base``; None for runs recorded
    before the stage had the setting, all GPT-2)."""
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
    base["base"] = [_config(c).get("base") for c in base["config_json"]]
    frame = per_op.merge(base.rename(columns={"technique": "method"}), on="run_id").merge(totals, on="run_id")
    for name in ("seconds", "bytes", "rounds"):
        frame[name] = pd.to_numeric(frame[name])
    return _finish(frame, MPC_COSTS_COLUMNS, ["started_at", "method", "op_category"])


_QUALITY_METRICS = {
    "base_quality.rouge_l": "base_rouge_l",
    "quality_drop.rouge_l": "rouge_l_drop",
    "quality_drop.chrf": "chrf_drop",
    "quality_drop.embedding_f1": "embedding_f1_drop",
    "mpc_plain_token_agreement": "agreement",
    "mpc_prompts": "mpc_prompts",
}


def generation_quality(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """The quality of each secure-inference method's text (``GENERATION_QUALITY_COLUMNS``), one row per generation
    run: the fine-tuned model's plaintext ROUGE-L on the quality prompts (``base_rouge_l``), the method's drop from
    it in ROUGE-L and chrF (positive: worse), the share of decrypted tokens equal to the plaintext twin's, and the
    model it ran (``base``: gpt2 or smollm2, None for runs before the setting; ``model``: SmolLM2's file, ``lm`` in
    the run's config, or ``GPT-2`` with its layers and width where recorded), its seed and step counts (None where
    the run did not record them). The SmolLM2 runs of 76e5346 recorded the file under ``model``, over the method's
    model kind."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "secure-inference", Run.technique.not_like("scaling-%"))
    if base.empty:
        return pd.DataFrame(columns=GENERATION_QUALITY_COLUMNS)
    frame = base.merge(_metrics_wide(engine, base["run_id"].tolist(), list(_QUALITY_METRICS)), on="run_id")
    frame = frame.rename(columns={**_QUALITY_METRICS, "technique": "method"})
    frame = frame[frame["rouge_l_drop"].notna()].copy() if "rouge_l_drop" in frame else frame.iloc[0:0]
    if frame.empty:
        return pd.DataFrame(columns=GENERATION_QUALITY_COLUMNS)
    from storage.claim_rows import run_configs  # a value the run lacks: its seed pass's (its stage config)
    from storage.leaderboard import run_meta  # the seed: the run's own, else its seed pass's

    configs = [_config(c) for c in frame["config_json"]]
    inherited = run_configs(db_url, frame["run_id"].tolist())
    frame["base"] = [c.get("base") for c in configs]
    frame["model"] = [_lm_of(c, inherited[r]) for c, r in zip(configs, frame["run_id"], strict=True)]
    for key, kinds in _STEPS_OF.items():
        frame[key] = [_steps(c, inherited[r], key, kinds) for c, r in zip(configs, frame["run_id"], strict=True)]

    seeds = run_meta(db_url, frame["run_id"].tolist()).set_index("run_id")["seed"]
    frame["seed"] = frame["run_id"].map(seeds)
    return _finish(frame, GENERATION_QUALITY_COLUMNS, ["dataset", "base", "method", "seed", "started_at"])


def _lm_of(config: dict[str, Any], inherited: dict[str, Any]) -> str:
    """The language model a secure-inference generation run names (:func:`generation_quality`); ``inherited``: its
    flattened config with its ancestors' values (``storage.claim_rows.run_configs``)."""
    if config.get("base") == "smollm2":
        return str(config.get("lm") or config.get("model"))
    shape = (inherited.get("config.n_layer"), inherited.get("config.n_embd"))
    return "GPT-2" if None in shape else f"GPT-2 {shape[0]} x {shape[1]}"


# the step counts a generation run's text depends on, and the kinds of trained model (a run's ``model``) each
# applies to (``train_steps``: every model descends from the fine-tuned one)
_STEPS_OF: dict[str, tuple[str, ...] | None] = {
    "train_steps": None,
    "er_steps": ("er", "merge"),
    "mm_steps": ("mm", "merge"),
}


def _steps(config: dict[str, Any], inherited: dict[str, Any], key: str, kinds: tuple[str, ...] | None) -> Any:
    """A run's ``key`` step count: its own where it records the key (None: its model did not train that way);
    else, for a run whose model kind trains that way, its seed pass's (runs before the key was recorded)."""
    if key in config:
        return config[key]
    if kinds is not None and config.get("model") not in kinds:
        return None
    return inherited.get(f"config.{key}")


_SEB_UTILITY_METRICS = SEB_UTILITY_COLUMNS[7:-2]  # perplexity .. plateaued: what the runs record as metrics


def seb_utility(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """SEB's utility language models (``SEB_UTILITY_COLUMNS``, attacks stage, techniques ``seb-lm-*``): one row per
    run with its test perplexity and embedding parameters, the vocabulary it trained at (``lm_vocab``; ``compact``
    for runs before the setting), whether its SEB FFN was narrowed to the subword table's size (``matched``, with
    that table's count in ``subword_embedding_params``), its FFN width (``seb_hidden``: the run's, else the
    ``seb.hidden`` it trained with; None for subword), and its training steps."""
    engine, f = _engine(db_url), _filters(filters)
    base = _result_runs(engine, f, Run.stage == "attacks", Run.technique.like("seb-lm-%"))
    if base.empty:
        return pd.DataFrame(columns=SEB_UTILITY_COLUMNS)
    frame = base.merge(_metrics_wide(engine, base["run_id"].tolist(), list(_SEB_UTILITY_METRICS)), on="run_id")
    frame = frame.rename(columns={"technique": "method"})
    configs = [_config(c) for c in frame["config_json"]]
    utility = [c.get("utility", {}) for c in configs]
    frame["embedding"] = [c.get("embedding") for c in configs]
    frame["seed"] = [c.get("seed") for c in configs]
    frame["lm_vocab"] = [u.get("lm_vocab", "compact") for u in utility]
    frame["matched"] = [bool(u.get("matched_params", False)) for u in utility]
    for column in _SEB_UTILITY_METRICS:
        if column not in frame:
            frame[column] = math.nan
    recorded = [c.get("seb", {}).get("hidden") if e != "subword" else None for c, e in zip(configs, frame["embedding"])]
    frame["seb_hidden"] = frame["seb_hidden"].where(frame["seb_hidden"].notna(), pd.Series(recorded, index=frame.index))
    return _finish(frame, SEB_UTILITY_COLUMNS, ["dataset", "lm_vocab", "method", "seed"])


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
