"""Attack-stage tasks, part 2: the membership-inference audit of the private-training stage's sequential
recommenders (one recorded run per target: technique ``mia-<method>``, tag ``privbench.result_group`` =
``audit``), with a row in ``attack_results`` per attack holding ``auc``, ``tpr_at_0.1pct_fpr``,
``tpr_at_1pct_fpr``, ``empirical_epsilon`` with its Clopper-Pearson interval, the ``accountant_epsilon`` and
the largest lower bound the audit could certify at its size (``certifiable_epsilon_max``, in ``extra_json``),
the target's privacy ledger, and ``roc.json`` (the ROC curves)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from prefect import task

from core.attacks.audit import AuditTarget, audit, seqrec_user_stats, subset_users
from core.attacks.membership import split_halves
from core.data.sequential import SequentialDataset
from core.dp.accounting import default_delta
from core.dp.trainer import NEIGHBOURING, PRIVACY_UNIT, TrainResult, method_config, train_seqrec
from core.errors import ConfigError
from pbconfig.attacks import AuditConfig
from pbconfig.tangent import TangentConfig
from pbconfig.train_dp import TrainDPConfig
from storage.recording import RunRef
from storage.views import train_search
from tasks.prepare import load_prepared
from tasks.records import RESUMABLE, task_record
from tasks.train_dp import PEER_BASE, GridPoint, Recipes, at_recipe, recipe_key, select_recipes, train_overrides


@dataclass(frozen=True)
class AuditJob:
    """One audited target: ``method`` trained on ``dataset`` at ``epsilon`` (None: non-private) under ``config``,
    the audit's config at one seed (its target, shadows and halves of the users); one recorded run."""

    dataset: str
    method: str
    epsilon: float | None
    config: AuditConfig

    @property
    def technique(self) -> str:
        return f"mia-{self.method}"


def audit_targets(cfg: AuditConfig) -> list[AuditJob]:
    """Every audited target: methods x epsilons, plus the non-private ones (DPFormer without noise would repeat
    the Transformer, as in the training grid), once per seed of ``cfg.seed_configs()``."""
    points: list[tuple[str, float | None]] = [(m, e) for m in cfg.methods for e in cfg.epsilons]
    if cfg.nonprivate:
        points += [(m, None) for m in cfg.methods if m != "dpformer"]
    return [AuditJob(d, m, e, c) for c in cfg.seed_configs() for d in cfg.datasets for m, e in points]


def epsilon_family(cfg: AuditConfig) -> int:
    """How many lower bounds ``empirical-epsilon-below-accountant`` takes the strongest of: every attack of every
    audited DP target (each seed, dataset, method and epsilon). Each bound is computed at alpha / this
    (Bonferroni), so the strongest of them is a 1 - alpha statement."""
    return len(cfg.attacks) * max(1, sum(t.epsilon is not None for t in audit_targets(cfg)))


def searched_recipes(train: TrainDPConfig, cfg: AuditConfig, profile: str | None, db_url: str | None = None) -> Recipes:
    """The DP recipe of each audited (dataset, method) that ``train_dp.tuning`` searched: the point train-dp's search
    on validation chose for the method under DP (:func:`tasks.train_dp.select_recipes`), read from the store's search
    runs of ``profile`` that match the current search (its learning rates, batch sizes, epsilon and seed; the latest
    run of each point), so the audit attacks models trained as the stage's DP models are rather than at the grid's
    first point. Both arms of an audit train at it (:func:`audit_seqrec`). Without ``tuning`` the grid has one recipe
    and this is empty. A searched key with no recorded search is a ConfigError that says to run train-dp first."""
    t = train.tuning
    if t is None:
        return {}
    searched = set(t.methods or train.methods)
    wanted = list(
        dict.fromkeys(
            recipe_key(t.dataset, PEER_BASE.get(t.method, t.method), True)
            for t in audit_targets(cfg)
            if PEER_BASE.get(t.method, t.method) in searched
        )
    )
    if not wanted:
        return {}
    frame = train_search(db_url, profile=profile)
    rows = []
    for r in frame.sort_values("started_at").to_dict("records"):
        private = r["epsilon"] is not None and r["epsilon"] == r["epsilon"]  # NaN: non-private
        if (
            r["seed"] == t.seed
            and (not private or float(r["epsilon"]) == t.epsilon)
            and float(r["lr"]) in train.lrs
            and int(r["batch_size"]) in train.batch_sizes
        ):
            rows.append(
                {
                    **r,
                    "epsilon": float(r["epsilon"]) if private else None,
                    "lr": float(r["lr"]),
                    "batch_size": int(r["batch_size"]),
                    "status": "finished",
                }
            )
    latest = {(r["dataset"], r["method"], r["epsilon"], r["lr"], r["batch_size"]): r for r in rows}  # time order
    chosen = select_recipes(train, list(latest.values()))
    missing = sorted(set(wanted) - set(chosen))
    if missing:
        raise ConfigError(
            f"attacks.audit trains each model at the recipe train-dp's search chose on validation, and the store has "
            f"no finished search run for {missing} (profile {profile!r}, tuning seed {t.seed}, epsilon {t.epsilon:g}, "
            f"lrs {list(train.lrs)} x batch sizes {list(train.batch_sizes)}): run `privbench run train-dp --profile "
            f"{profile}` first (the benchmark chain does), or set train_dp.tuning: null to audit the grid's one recipe"
        )
    return {k: chosen[k] for k in wanted}


def matched_delta(overrides: dict[str, Any], n_members: int) -> float:
    """The delta the DP trainer takes for ``n_members`` users at the training ``overrides`` (their ``delta``, else
    ``default_delta``: 1 / (10 N)): what a DP target trained on those members accounts at, and so the delta at
    which its non-private twin is audited."""
    return overrides.get("delta") or default_delta(n_members)


MATCHED_EPSILON = 1.0  # any epsilon: it only marks a point private so that at_recipe gives it the DP recipe


def audited_point(
    dataset: str,
    path: str,
    method: str,
    epsilon: float | None,
    cfg: AuditConfig,
    train: TrainDPConfig,
    recipes: Recipes,
) -> GridPoint:
    """The training point of an audited model: ``method`` at the DP recipe of the train-dp grid
    (:func:`tasks.train_dp.at_recipe` of its private point, with ``recipes``' choice where the search made one) and at
    ``epsilon``; a non-private target (``epsilon`` None) keeps that recipe, so it differs from the DP ones by the DP
    step alone."""
    spec = next(d for d in train.datasets if d.name == dataset)
    first = GridPoint(dataset, path, spec.dropout, method, epsilon, cfg.seed, train.lrs[0], train.batch_sizes[0])
    as_dp = at_recipe(replace(first, epsilon=MATCHED_EPSILON if epsilon is None else epsilon), train, recipes)
    return replace(as_dp, epsilon=epsilon)


@task(name="mia-audit-recipes")
def audit_recipes(train: TrainDPConfig, cfg: AuditConfig, profile: str | None) -> Recipes:
    """:func:`searched_recipes` as a task (the attacks flow runs it once, before the audits)."""
    return searched_recipes(train, cfg, profile)


@dataclass(frozen=True)
class SeqrecAudit:
    """One audited (dataset, method, epsilon): the target's training outcome, each attack's result
    (``core.attacks.audit.audit``), the ``delta`` of the bound, the shadow count and the training time."""

    target: TrainResult
    results: dict[str, dict]
    delta: float
    n_users: int
    train_s: float


def audit_point(
    data: SequentialDataset,
    method: str,
    epsilon: float | None,
    cfg: AuditConfig,
    overrides: dict[str, Any],
    family: int | None = None,
) -> SeqrecAudit:
    """Train the target (a random half of the users, recorded) and ``cfg.shadows`` shadow models (each user in
    half of them) of ``method`` at ``epsilon`` on ``data`` with the training ``overrides``
    (``train_overrides``), and audit the target with ``cfg.attacks`` (the task's logic, without recording)."""
    n = data.n_users
    target_in = split_halves(n, 2, seed=cfg.seed)[0]  # a random half of the users, recorded
    shadow_in = split_halves(n, cfg.shadows, seed=cfg.seed + 1)  # (k, n): each user in half of them

    def fit(mask: np.ndarray, seed: int) -> TrainResult:
        users = np.flatnonzero(mask)
        return train_seqrec(subset_users(data, users), method_config(method, **(overrides | {"seed": seed})))

    t0 = time.perf_counter()
    target = fit(target_in, cfg.seed)
    scoring = {"max_len": overrides["max_len"], "train_targets": overrides.get("train_targets", "every")}
    stats = seqrec_user_stats(target.model, data, **scoring)
    shadows = np.stack(
        [seqrec_user_stats(fit(m, cfg.seed + 1 + i).model, data, **scoring) for i, m in enumerate(shadow_in)]
    )  # (k, n)
    train_s = time.perf_counter() - t0
    ledger = target.ledger
    label = "nonprivate" if epsilon is None else f"eps={epsilon:g}"
    # a non-private control is bounded at the delta its DP twins are (same members, so the trainer's delta for them):
    # a larger delta lowers a bound, and the control says how much this audit can show at the DP targets' delta
    delta = cfg.delta or (ledger.delta if ledger is not None else matched_delta(overrides, int(target_in.sum())))
    results = audit(
        AuditTarget(
            name=f"{method}:{label}",
            stats=stats,
            members=target_in,
            accountant_epsilon=ledger.epsilon if ledger is not None else None,
            delta=delta,
        ),
        attacks=cfg.attacks,
        shadow_stats=shadows,
        shadow_in=shadow_in,
        delta=delta,
        alpha=cfg.alpha,
        family=family,
    )
    return SeqrecAudit(target=target, results=results, delta=delta, n_users=n, train_s=train_s)


def _attack_columns(r: dict[str, Any]) -> dict[str, Any]:
    """The ``attack_results`` columns of one attack's audit result ``r`` (``core.attacks.audit``)."""
    lo, hi = r["empirical_epsilon_ci"]
    return {
        "auc": r["auc"],
        "tpr_at_0_1pct_fpr": r["tpr_at_0.1pct_fpr"],
        "tpr_at_1pct_fpr": r["tpr_at_1pct_fpr"],
        "empirical_epsilon": r["empirical_epsilon"],
        "empirical_epsilon_lo": lo,
        "empirical_epsilon_hi": hi,
    }


@task(name="mia-audit", **RESUMABLE)
def audit_seqrec(
    dataset: str,
    method: str,
    epsilon: float | None,
    cfg: AuditConfig,
    train: TrainDPConfig,
    path: str,
    parent: RunRef,
    threads: int = 1,
    recipes: Recipes | None = None,
    family: int | None = None,
) -> dict[str, Any]:
    """Train the target and the shadow models of one (dataset, method, epsilon) and audit the target
    (``audit_point``); record one attack row per attack with the audit's power, ``certifiable_epsilon_max``, and
    the bounds at the family confidence of ``family`` (:func:`epsilon_family`; None: this audit's attacks).

    Every model of an audit trains at the method's DP recipe (:func:`tasks.train_dp.at_recipe` of the private
    point: the (lr, batch size) of ``recipes`` (:func:`searched_recipes`) where the search chose one, else the
    grid's first, and ``train_dp.epochs``), the non-private one included: the two arms differ by the DP step alone
    (clipping and noise), a matched control. ``config.recipe`` records it. The attacked model is the one at the end
    of training, in both arms."""
    torch.set_num_threads(threads)
    point = audited_point(dataset, path, method, epsilon, cfg, train, recipes or {})
    overrides = train_overrides(point, train) | ({"epochs": cfg.epochs} if cfg.epochs else {})
    label = "nonprivate" if epsilon is None else f"eps={epsilon:g}"
    config = {
        "dataset": dataset,
        "method": method,
        "epsilon": epsilon,
        "audit": cfg.model_dump(mode="json"),
        "train": overrides,
        "recipe": {
            "arms": "matched: every arm at the method's DP recipe",
            "source": "search" if point.tuned is not None else "grid",
            "lr": point.lr,
            "batch_size": point.batch_size,
            "tuning_run_id": point.tuned.run_id if point.tuned is not None else None,
        },
    }
    with task_record(
        parent=parent,
        technique=f"mia-{method}",
        config=config,
        dataset=dataset,
        run_name=f"membership audit of {method} ({label}) on {dataset}",
    ) as rec:
        rec.tag("privbench.result_group", "audit")
        rec.tag("privbench.dp", label)
        done = audit_point(load_prepared(path), method, epsilon, cfg, overrides, family=family)
        target, results, delta, ledger = done.target, done.results, done.delta, done.target.ledger
        if ledger is not None:
            rec.ledger(ledger, unit=PRIVACY_UNIT, neighbouring=NEIGHBOURING)  # the train-dp trainer's user-level DP
        for name, r in results.items():
            rec.attack(
                attack=name,
                target=f"{dataset}:{method}",
                setting=f"{label},shadows={cfg.shadows}",
                **_attack_columns(r),
                accountant_epsilon=r["accountant_epsilon"],
                extra={
                    **{
                        k: r[k]
                        for k in (
                            "delta",
                            "alpha",
                            "n_members",
                            "n_nonmembers",
                            "threshold_tpr",
                            "threshold_fpr",
                            "certifiable_epsilon_max",
                            "empirical_epsilon_lo_family",
                            "certifiable_epsilon_max_family",
                            "alpha_family",
                            # the one-run bound (Steinke, Nasr and Jagielski 2023), at both confidences
                            "one_run_epsilon_lo",
                            "one_run_epsilon_lo_family",
                            "one_run_certifiable_epsilon_max",
                            "one_run_certifiable_epsilon_max_family",
                            "one_run_k_plus",
                            "one_run_k_minus",
                            "one_run_k_plus_family",
                            "one_run_k_minus_family",
                        )
                    },
                    "auc_lo": r["auc_ci"][0],
                    "auc_hi": r["auc_ci"][1],
                    # the attack chosen on one half of the audited users, judged on the other
                    "selected": r["selected"],
                    "auc_selection": r["auc_selection"],
                    "auc_heldout": r["auc_heldout"],
                    "auc_heldout_lo": r["auc_heldout_ci"][0],
                    "auc_heldout_hi": r["auc_heldout_ci"][1],
                },
            )
            rec.metrics(
                {
                    f"{name}.auc": r["auc"],
                    f"{name}.auc_lo": r["auc_ci"][0],
                    f"{name}.auc_hi": r["auc_ci"][1],
                    f"{name}.tpr_at_0.1pct_fpr": r["tpr_at_0.1pct_fpr"],
                    f"{name}.tpr_at_1pct_fpr": r["tpr_at_1pct_fpr"],
                    f"{name}.empirical_epsilon": r["empirical_epsilon"],
                    f"{name}.empirical_epsilon_lo": r["empirical_epsilon_ci"][0],
                    f"{name}.certifiable_epsilon_max": r["certifiable_epsilon_max"],
                }
            )
        rec.metrics(
            {
                "target_test_ndcg_at_10": target.test_ndcg10,
                "n_users": done.n_users,
                "shadows": cfg.shadows,
                "train_s": done.train_s,
                "delta": delta,
            },
            units={"train_s": "s"},
        )
        if ledger is not None:
            rec.metric("accountant_epsilon", ledger.epsilon)
        rec.artifact_json("roc.json", {name: r["roc"] for name, r in results.items()})
    return {
        "dataset": dataset,
        "method": method,
        "epsilon": epsilon,
        "accountant_epsilon": ledger.epsilon if ledger is not None else None,
        "delta": delta,
        "target_test_ndcg_at_10": target.test_ndcg10,
        "attacks": {name: {k: v for k, v in r.items() if k != "roc"} for name, r in results.items()},
    }


@task(name="mia-audit-unlearning", **RESUMABLE)
def audit_unlearning(
    tangent: TangentConfig, cfg: AuditConfig, images_path: str, model_path: str, parent: RunRef
) -> dict[str, Any]:
    """The composed TAFT model (eq. 13) of ``tangent.fig1_n_shards`` shards before and after forgetting half of
    them by subtraction (Sect. 3.3), attacked by the loss threshold: members (the training images) against
    non-members (the test images) before, and the forgotten images against non-members after, with a
    two-sample test (Kolmogorov-Smirnov and Mann-Whitney) of their statistics."""

    from core.attacks.audit import audit_groups
    from core.attacks.membership import two_sample_test
    from core.tangent.baselines import train_shards
    from core.tangent.compose import compose, remove_component
    from core.tangent.experiments import logits_of, shard_index
    from tasks.tangent import cache_features, load_features, tangent_model, train_config
    from tasks.tangent_inputs import shortened

    torch.set_num_threads(tangent.threads_per_worker)
    n_shards = tangent.fig1_n_shards
    config = {
        "n_shards": n_shards,
        "removed": n_shards // 2,
        "tangent": tangent.model_dump(mode="json"),
        "epochs": cfg.unlearning_epochs or tangent.epochs,
        "alpha": cfg.alpha,
    }
    with task_record(
        parent=parent,
        technique="mia-unlearning",
        config=config,
        dataset=tangent.dataset,
        run_name=f"membership audit of TAFT unlearning ({n_shards} shards)",
    ) as rec:
        rec.tag("privbench.result_group", "audit")
        inputs = cache_features.fn(tangent, images_path, model_path, parent)
        f = load_features(inputs.features_path)
        split = shard_index(inputs.n_train, n_shards, tangent.seed)
        model = tangent_model(inputs, tangent)
        tcfg = shortened(train_config(tangent, "taft"), cfg.unlearning_epochs or tangent.epochs)
        t0 = time.perf_counter()  # the tangent stage's shard training (shard j: seed + j), shard by shard
        deltas = train_shards(lambda: tangent_model(inputs, tangent), f["train_h"], f["train_y"], split, tcfg)
        train_s = time.perf_counter() - t0

        def stats(delta: Any, h: torch.Tensor, y: torch.Tensor) -> np.ndarray:
            model.set_delta(delta)
            logits = logits_of(model, h, tangent.eval_batch_size)
            return -torch.nn.functional.cross_entropy(logits, y, reduction="none").double().numpy()

        removed = sorted(np.random.default_rng(cfg.seed).choice(n_shards, n_shards // 2, replace=False).tolist())
        composed = compose(deltas)
        before_train, test_before = (
            stats(composed, f["train_h"], f["train_y"]),
            stats(composed, f["test_h"], f["test_y"]),
        )
        after = composed
        for r, j in enumerate(removed):
            after = remove_component(after, deltas[j], n_shards - r)
        after_train, test_after = stats(after, f["train_h"], f["train_y"]), stats(after, f["test_h"], f["test_y"])
        gone = np.zeros(inputs.n_train, dtype=bool)
        for j in removed:
            gone[split.shards[j].numpy()] = True
        delta = cfg.delta or 1.0 / inputs.n_train
        groups = {  # (setting, member statistics, non-member statistics)
            "before: members vs non-members": (before_train, test_before),
            "before: to-be-forgotten vs non-members": (before_train[gone], test_before),
            "after: forgotten vs non-members": (after_train[gone], test_after),
            "after: kept vs non-members": (after_train[~gone], test_after),
        }
        results = audit_groups(groups, delta=delta, alpha=cfg.alpha)
        forgotten_test = two_sample_test(after_train[gone], test_after)
        for setting, r in results.items():
            extra = {k: r[k] for k in ("delta", "alpha", "n_members", "n_nonmembers", "certifiable_epsilon_max")}
            extra |= {"auc_lo": r["auc_ci"][0], "auc_hi": r["auc_ci"][1]}
            if setting.startswith("after: forgotten"):
                extra |= {"two_sample": forgotten_test}
            rec.attack(
                attack="loss",
                target=f"{tangent.dataset}:taft-composed",
                setting=setting,
                **_attack_columns(r),
                extra=extra,
            )
        short = {
            "before: members vs non-members": "before",
            "before: to-be-forgotten vs non-members": "before_forgotten",
            "after: forgotten vs non-members": "after_forgotten",
            "after: kept vs non-members": "after_kept",
        }
        rec.metrics({f"{short[s]}.auc": r["auc"] for s, r in results.items()})
        rec.metrics(
            {
                "forgotten_vs_nonmembers.ks_pvalue": forgotten_test["ks_pvalue"],
                "forgotten_vs_nonmembers.mw_pvalue": forgotten_test["mw_pvalue"],
                "train_s": train_s,
                "n_forgotten": int(gone.sum()),
            },
            units={"train_s": "s"},
        )
        rec.artifact_json("roc.json", {s: r["roc"] for s, r in results.items()})
    return {
        "n_shards": n_shards,
        "removed": removed,
        "n_forgotten": int(gone.sum()),
        "two_sample": forgotten_test,
        "settings": {s: {k: v for k, v in r.items() if k != "roc"} for s, r in results.items()},
    }
