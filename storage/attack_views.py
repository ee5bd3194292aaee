"""Read-side views of the attack results (``attack_results`` joined to their runs): STIP's permutation recovery,
FILM's text recovery and the membership audits with their ROC curves. ``storage.views`` re-exports them, so every
result group is one ``views.<name>``; the filters are the same (``storage.views``' docstring)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import select
from sqlalchemy.engine import Engine

from pbconfig.settings import get_settings
from storage import view_query as vq
from storage.models import AttackResult, Run
from storage.view_columns import FILM_COLUMNS, MEMBERSHIP_COLUMNS, ROC_COLUMNS, STIP_ATTACKS_COLUMNS
from storage.view_query import Filters, config_seed, finish, parse_config, timestamps

MIA_ATTACKS = ("loss", "lira_online", "lira_offline")


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
    return timestamps(pd.DataFrame([dict(r) for r in rows]), "started_at")


def stip_attacks(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Permutation-recovery attacks on STIP (``STIP_ATTACKS_COLUMNS``): the fraction of the secret permutation
    recovered (``recovery_rate``) and of the input tokens, by attack and model."""
    engine, f = vq.engine(db_url), vq.filters(filters)
    frame = _attacks(engine, f, Run.stage == "stip")
    if frame.empty:
        return pd.DataFrame(columns=STIP_ATTACKS_COLUMNS)
    extra = [parse_config(e) for e in frame["extra_json"]]
    frame["model"] = frame["target"].str.removeprefix("stip:")
    frame["attack"] = frame["attack"].str.removeprefix("stip_")
    frame["recovery_rate"] = frame["recovered_fraction"].fillna(pd.Series([e.get("recovery_rate") for e in extra]))
    frame["input_tokens_recovered"] = [e.get("input_tokens_recovered", math.nan) for e in extra]
    return finish(frame, STIP_ATTACKS_COLUMNS, ["model", "attack", "started_at"])


_BATCH = re.compile(r"batch=(\d+)")


def film(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """FILM text recovery from FedSGD embedding gradients (``FILM_COLUMNS``): ROUGE-1/2/L of the recovered
    sentences (``rouge_min``: the lowest of the three) and the recall of their tokens, by victim embedding
    (``subword``, ``seb_*``), attacker setting (``subwords``; against SEB ``bytes``, ``positional``, ``relaxed``),
    the attacker's prior (``film.priors``' name; NaN for runs recorded before priors were named) and batch size."""
    engine, f = vq.engine(db_url), vq.filters(filters)
    frame = _attacks(engine, f, Run.stage == "attacks", AttackResult.attack == "film")
    if frame.empty:
        return pd.DataFrame(columns=FILM_COLUMNS)
    extra = [parse_config(e) for e in frame["extra_json"]]
    frame["embedding"] = frame["target"]
    frame["attacker"] = frame["setting"].fillna("").str.split(",").str[0]
    frame["prior"] = frame["setting"].fillna("").str.extract(r"prior=([^,]+)", expand=False)  # NaN: one prior
    frame["batch_size"] = [_batch_size(e, s) for e, s in zip(extra, frame["setting"], strict=True)]
    frame["precision"] = [e.get("precision", math.nan) for e in extra]
    frame["n_candidates"] = [e.get("n_candidates", math.nan) for e in extra]
    frame["rouge_min"] = frame[["rouge1", "rouge2", "rougeL"]].min(axis=1, skipna=False)
    return finish(frame, FILM_COLUMNS, ["embedding", "attacker", "prior", "batch_size", "started_at"])


def _batch_size(extra: dict[str, Any], setting: str | None) -> float:
    if extra.get("batch_size") is not None:
        return float(extra["batch_size"])
    found = _BATCH.search(setting or "")
    return float(found.group(1)) if found else math.nan


_EPS = re.compile(r"eps=([0-9.eE+-]+)")


def membership(db_url: str | None = None, **filters: Any) -> pd.DataFrame:
    """Membership-inference audits (``MEMBERSHIP_COLUMNS``), with the AUC's 95% interval over the audited users
    (``auc_lo``, ``auc_hi``: DeLong), the attack chosen on one half of the users (``selected``) with every
    attack's AUC on the first half (``auc_selection``) and on the other half (``auc_heldout``, ``auc_heldout_lo``,
    ``auc_heldout_hi``), and the audit's power
    ``certifiable_epsilon_max`` (the largest ``empirical_epsilon_lo`` the audit could report at its sample sizes, a
    perfect attack's; a run where it does not exceed ``accountant_epsilon`` cannot show the guarantee broken) and
    the attacks' reach ``nonprivate_epsilon_lo`` (what they certified on the same audit's non-private model).
    ``audit`` is ``dp`` for the DP-trained recommenders (``method`` and target ``epsilon``; NaN and ``private``
    False for non-private targets) and ``unlearning`` for TAFT's forgetting audit (``setting`` says before/after
    and which users)."""
    engine, f = vq.engine(db_url), vq.filters(filters)
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
    extra = [parse_config(e) for e in frame["extra_json"]]
    for bound in ("auc_lo", "auc_hi"):  # DeLong's 95% interval over the audited users (NaN before it was recorded)
        frame[bound] = pd.Series([e.get(bound, math.nan) for e in extra], index=frame.index, dtype=float)
    # the attack the audit chose on one half of its users, and every attack's AUC on the other half with its DeLong
    # interval (``core.attacks.audit``; NaN, and selected False, before it was recorded)
    frame["selected"] = pd.Series([bool(e.get("selected", False)) for e in extra], index=frame.index, dtype=bool)
    for column in ("auc_selection", "auc_heldout", "auc_heldout_lo", "auc_heldout_hi"):
        frame[column] = pd.Series([e.get(column, math.nan) for e in extra], index=frame.index, dtype=float)
    # the audit's power: the largest empirical_epsilon_lo it could certify at its size (NaN before it was recorded)
    # the audited models' recipe (config.train: NaN for the unlearning audit)
    train = [parse_config(c).get("train") or {} for c in frame["config_json"]]
    for column in ("lr", "batch_size", "epochs"):
        frame[column] = pd.Series([t.get(column, math.nan) for t in train], index=frame.index, dtype=float)
    # and both at the audit's family confidence, 1 - alpha / family (Bonferroni; NaN before it was recorded)
    for column in ("certifiable_epsilon_max", "empirical_epsilon_lo_family", "certifiable_epsilon_max_family"):
        frame[column] = pd.Series([e.get(column, math.nan) for e in extra], index=frame.index, dtype=float)
    # the share of the family's alpha each bound was computed at, and the one-run bound (Steinke, Nasr and Jagielski
    # 2023: valid for the audit's single training run) with a perfect attack's reach, at both confidences (NaN
    # before they were recorded)
    for column in (
        "alpha_family",
        "one_run_epsilon_lo",
        "one_run_epsilon_lo_family",
        "one_run_certifiable_epsilon_max",
        "one_run_certifiable_epsilon_max_family",
    ):
        frame[column] = pd.Series([e.get(column, math.nan) for e in extra], index=frame.index, dtype=float)
    # the attacks' own reach: the strongest empirical_epsilon_lo the same audit (same attacks run, same dataset)
    # certified on its non-private model, which no noise protects; a DP model audited at an accountant epsilon
    # above it could not have been caught over-spending by these attacks (NaN: the audit had no such model)
    # (same seed: with several audit seeds under one parent, each DP model against its own seed's control, not the
    # strongest of them; same method: a DP model whose method has no non-private model, DPFormer, has no control)
    dp = frame["audit"] == "dp"
    seeds = [config_seed(parse_config(c)) for c in frame["config_json"]]
    frame["_seed"] = [-1 if seed is None else seed for seed in seeds]  # a run without a seed: one group, not NaN
    control = frame[dp & ~frame["private"]].groupby(["parent_id", "dataset", "_seed", "method"])
    for column in ("empirical_epsilon_lo", "empirical_epsilon_lo_family", "one_run_epsilon_lo_family"):
        best = control[column].max()
        name = (
            "nonprivate_one_run_epsilon_lo_family"
            if column.startswith("one_run")
            else column.replace("empirical", "nonprivate")
        )
        keys = zip(frame["parent_id"], frame["dataset"], frame["_seed"], frame["method"], dp, strict=True)
        frame[name] = [float(best.get(tuple(key), math.nan)) if is_dp else math.nan for *key, is_dp in keys]
    # the one-run audit's power on a DP run: what these attacks reach (its control's bound), capped by what the run's
    # own guess counts let even a perfect attack certify (its control chose its counts on its own shadows, so its
    # bound can exceed the run's ceiling); NaN where either is missing
    frame["one_run_power_family"] = np.fmin(
        frame["nonprivate_one_run_epsilon_lo_family"], frame["one_run_certifiable_epsilon_max_family"]
    ).where(
        frame["nonprivate_one_run_epsilon_lo_family"].notna() & frame["one_run_certifiable_epsilon_max_family"].notna()
    )
    return finish(frame, MEMBERSHIP_COLUMNS, ["audit", "dataset", "method", "epsilon", "attack"])


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
            curves = parse_config(local[0].read_text())
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


__all__ = ["MIA_ATTACKS", "film", "membership", "membership_roc", "stip_attacks"]
