"""Tangent-stage tasks of Fig. 1 (TAFT): forgetting. Accuracy as shards are removed by subtraction against SISA
(``forget-subtraction``), one forget request by shard retraining against full retraining (``forget-retrain``),
forgetting a fraction of the data by shard retraining (``forget-fraction``), and one forget request served by TAFT,
SISA and full retraining with its forgetting and inference costs (``forget-taft``, ``forget-taft-subtract``,
``forget-sisa``, ``forget-sisa-drop``, ``forget-full-retrain``). They read the shard models that
:mod:`tasks.tangent` trained; what each computes is a procedure of :mod:`core.tangent.experiments` and
:mod:`core.tangent.unlearning`.
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import task
from torch import Tensor, nn

from core.tangent import experiments as X
from core.tangent import unlearning as U
from core.tangent.baselines import NonlinearSuffix
from core.tangent.compose import compose
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig
from pbconfig.tangent import TangentConfig
from storage.recording import RunRef
from tasks.records import RESUMABLE, task_record
from tasks.tangent import (
    config_json,
    load_backbone,
    load_deltas,
    load_features,
    load_suffixes,
    nonlinear_model,
    set_threads,
    tangent_model,
)
from tasks.tangent_inputs import TangentInputs, train_config


@task(name="tangent-fig1-subtraction", **RESUMABLE)
def forget_by_subtraction_curve(
    n_shards: int, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef
) -> dict[str, Any]:
    """Fig. 1(a, b): test accuracy after removing r = 0 .. N-1 shards, TAFT by subtraction vs SISA by dropping
    ensemble members (:func:`core.tangent.experiments.forget_by_subtraction_curve`). The run records, beside the
    curve, ``unlearning_max_abs_err`` (the subtracted delta against the remaining deltas composed from scratch)
    and ``forget_output_max_abs_err`` (in float64 on the first 256 test images: the subtracted model's logits
    against the mean of the remaining shard models' logits, each shard model evaluated on its own; the claim
    ``forgetting-exact`` reads it)."""
    set_threads(cfg)
    f = load_features(inputs.features_path)
    h, y, bs = f["test_h"], f["test_y"], cfg.eval_batch_size
    with task_record(
        parent=parent,
        technique="forget-subtraction",
        config={"n_shards": n_shards, "trials": cfg.fig1_trials, "k": cfg.k},
        dataset=cfg.dataset,
        run_name=f"forget by subtraction, {n_shards} shards",
    ) as rec:
        rec.tag("privbench.result_group", "fig1")
        sisa_parts = [X.logits_of(m, h, bs) for m in load_suffixes(inputs, cfg, n_shards)]
        curve, summary = X.forget_by_subtraction_curve(
            tangent_model(inputs, cfg),
            load_deltas(inputs, n_shards),
            sisa_parts,
            h,
            y,
            trials=cfg.fig1_trials,
            seed=cfg.seed,
            batch_size=bs,
        )
        for r in range(n_shards):
            rec.metrics(
                {"taft_accuracy": curve["taft_accuracy"][r], "sisa_accuracy": curve["sisa_accuracy"][r]}, step=r
            )
        rec.metrics(summary, units={"subtraction_s": "s"})
        rec.artifact_json("curve.json", curve)
    return {"n_shards": n_shards, **curve, **summary}


@task(name="tangent-fig1-retrain", **RESUMABLE)
def forget_one_by_retraining(
    n_shards: int, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef
) -> dict[str, Any]:
    """Fig. 1(c), one request: forget a random training image by retraining its shard without it, next to the
    paragon (retraining TAFT from scratch on the other n-1 images); both timed in this task, side by side."""
    set_threads(cfg)
    f = load_features(inputs.features_path)
    index = X.shard_index(inputs.n_train, n_shards, cfg.seed)
    sample = X.forget_sample(inputs.n_train, cfg.seed)
    tcfg = train_config(cfg, "taft")
    with task_record(
        parent=parent,
        technique="forget-retrain",
        config={"n_shards": n_shards, "sample": sample, "k": cfg.k, **config_json(tcfg)},
        dataset=cfg.dataset,
        run_name=f"forget one sample: shard vs full retraining ({n_shards} shards)",
    ) as rec:
        rec.tag("privbench.result_group", "fig1")
        result = X.forget_one_by_retraining(
            lambda: tangent_model(inputs, cfg),
            load_deltas(inputs, n_shards),
            index,
            sample,
            f["train_h"],
            f["train_y"],
            f["test_h"],
            f["test_y"],
            tcfg,
            batch_size=cfg.eval_batch_size,
        )
        rec.metrics(result, units={"shard_retrain_s": "s", "full_retrain_s": "s"})
    return {"n_shards": n_shards, "sample": sample, **result}


@task(name="tangent-fig1-fraction", **RESUMABLE)
def forget_fraction(
    n_shards: int, fraction: float, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef
) -> dict[str, Any]:
    """Fig. 1(c), many requests: forget a random ``fraction`` of the training images by retraining every shard
    that held one on its remaining images, then recompose; accuracy before and after."""
    set_threads(cfg)
    f = load_features(inputs.features_path)
    index = X.shard_index(inputs.n_train, n_shards, cfg.seed)
    forget = X.forget_set(inputs.n_train, fraction, cfg.seed)
    with task_record(
        parent=parent,
        technique="forget-fraction",
        config={"n_shards": n_shards, "fraction": fraction, "n_forget": len(forget), "k": cfg.k},
        dataset=cfg.dataset,
        run_name=f"forget {fraction:.0%} by shard retraining",
    ) as rec:
        rec.tag("privbench.result_group", "fig1")
        result = X.forget_fraction(
            lambda: tangent_model(inputs, cfg),
            load_deltas(inputs, n_shards),
            index,
            forget,
            f["train_h"],
            f["train_y"],
            f["test_h"],
            f["test_y"],
            train_config(cfg, "taft"),
            batch_size=cfg.eval_batch_size,
        )
        rec.metrics(result, units={"retrain_s": "s"})
    return {"n_shards": n_shards, "fraction": fraction, **result}


# method -> (TAFT or SISA or the paragon, retrain the affected shards); the only list of the request's methods
FORGET_METHODS: dict[str, tuple[str, bool]] = {
    "forget-taft": ("taft", True),
    "forget-taft-subtract": ("taft", False),
    "forget-sisa": ("sisa", True),
    "forget-sisa-drop": ("sisa", False),
    "forget-full-retrain": ("full", True),
}


@task(name="tangent-forget-request", **RESUMABLE)
def forget_request_costs(n_shards: int, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef) -> dict[str, Any]:
    """Sec. 3.3 / 4.4: one forget request (``cfg.forget_request_examples`` images in ``cfg.forget_request_shards``
    of the ``n_shards`` shards) served by each of :data:`FORGET_METHODS`, one run each, one after the other in
    this task: TAFT (subtract the affected shards' deltas, then retrain them and add back, or not), SISA (retrain
    the affected shard models, or drop them from the ensemble) and full retraining of TAFT; each run records the
    forgetting cost (``forget_s``, ``forget_steps``, ``forget_sample_gradients``), ``accuracy_after_forget`` and
    the inference cost after forgetting (``inference_forwards`` and ``inference_s_per_batch`` per test batch of
    ``eval_batch_size``, and ``inference_over_plain_forward``: that time over one plain forward of the pretrained
    non-linear suffix on the same batches, timed just before each pass). Inference reads the cached prefix,
    common to every method."""
    set_threads(cfg)
    f = load_features(inputs.features_path)
    h, y, bs = f["test_h"], f["test_y"], cfg.eval_batch_size
    index = X.shard_index(inputs.n_train, n_shards, cfg.seed)
    request = U.forget_request(index, cfg.forget_request_examples, cfg.forget_request_shards, cfg.seed)
    deltas, suffixes = load_deltas(inputs, n_shards), load_suffixes(inputs, cfg, n_shards)
    plain = nonlinear_model(inputs, cfg)  # one plain forward of the pretrained suffix: the unit of inference cost
    composed = tangent_model(inputs, cfg)
    composed.set_delta(compose(deltas))
    before = {
        "taft": X.accuracy(X.logits_of(composed, h, bs), y),
        "sisa": X.accuracy(U.measure_inference(suffixes, h, batch_size=bs, repeats=1)[0], y),
    }
    out: dict[str, Any] = {"n_shards": n_shards, "examples": list(request.examples), "shards": list(request.shards)}
    for method, (kind, retrain) in FORGET_METHODS.items():
        tcfg = train_config(cfg, "nlft" if kind == "sisa" else "taft")
        config = {
            "n_shards": n_shards,
            "request_examples": len(request.examples),
            "request_shards": len(request.shards),
            "retrain": retrain,
            "k": cfg.k,
            "eval_batch_size": bs,
            **config_json(tcfg),
        }
        with task_record(
            parent=parent,
            technique=method,
            config=config,
            dataset=cfg.dataset,
            run_name=f"{method}: {len(request.examples)} images in {len(request.shards)} of {n_shards} shards",
        ) as rec:
            rec.tag("privbench.result_group", "fig1")
            members, cost, extra = _serve_request(kind, retrain, request, index, deltas, suffixes, tcfg, cfg, inputs)
            if kind in before:
                extra["accuracy_before_forget"] = before[kind]
            logits, infer = U.measure_inference(members, h, batch_size=bs, reference=plain)
            result = {
                "forget_s": cost.seconds,
                "forget_cpu_s": cost.cpu_seconds,
                "forget_steps": cost.steps,
                "forget_sample_gradients": cost.sample_gradients,
                "models_retrained": cost.models_trained,
                "accuracy_after_forget": X.accuracy(logits, y),
                "inference_forwards": infer.forwards,
                "inference_s_per_batch": infer.seconds_per_batch,
                "inference_over_plain_forward": infer.over_reference,
                "n_forgotten": len(request.examples),
                **extra,
            }
            rec.metrics(result, units={"forget_s": "s", "forget_cpu_s": "s", "inference_s_per_batch": "s"})
        out[method] = result
    return out


def _serve_request(
    kind: str,
    retrain: bool,
    request: U.ForgetRequest,
    index: ShardIndex,
    deltas: list[dict[str, Tensor]],
    suffixes: list[NonlinearSuffix],
    tcfg: TangentTrainConfig,
    cfg: TangentConfig,
    inputs: TangentInputs,
) -> tuple[list[nn.Module], U.ForgetCost, dict[str, float]]:
    """One method of :data:`FORGET_METHODS` on the request: the models that answer queries afterwards (one
    composed tangent model, SISA's ensemble members, or the retrained model), its cost, and method-specific
    metrics (TAFT: ``components_after_forget`` and ``forget_max_abs_err``, the largest difference between the
    forgotten composition and the remaining components composed from scratch)."""
    f = load_features(inputs.features_path)
    new_model = functools.partial(tangent_model, inputs, cfg)
    if kind == "taft":
        delta, parts, cost = U.forget_taft(
            new_model, deltas, index, request, f["train_h"], f["train_y"], tcfg, retrain=retrain
        )
        model = new_model()
        model.set_delta(delta)
        direct = compose(parts)
        err = max(float((delta[n] - direct[n]).abs().max()) for n in direct)
        return [model], cost, {"components_after_forget": len(parts), "forget_max_abs_err": err}
    if kind == "sisa":
        head = nonlinear_model(inputs, cfg).head
        backbone = load_backbone(inputs.model_path)
        members, cost = U.forget_sisa(
            backbone, head, suffixes, index, request, f["train_h"], f["train_y"], tcfg, k=cfg.k, retrain=retrain
        )
        return list(members), cost, {"components_after_forget": len(members)}
    model, cost = U.full_retrain(new_model, f["train_h"], f["train_y"], request, tcfg)
    return [model], cost, {"components_after_forget": 1}
