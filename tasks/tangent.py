"""Tangent-stage tasks (TAFT): cache frozen features, train one model each (full data or one shard, TAFT or a
non-linear baseline, DP or not), then compose, ensemble and forget; each recorded as one run.

Every task receives only small, picklable things (paths, configs, ints) so that a process pool or a Dask
cluster can run it: the frozen-prefix activations are computed once (:func:`cache_features`) into a
content-addressed ``.pt`` file that workers memory-map, the backbone is loaded from the prepared model
folder, and trained deltas / shard models are written to a folder of the flow run that later tasks read.

Result groups (tag ``privbench.result_group``), the paper's analogues:

* ``table1``: TAFT-k vs NLFT-k vs FC on the full training set (techniques ``taft-<k>``, ``nlft-<k>``, ``fc``);
* ``table2``: per shard count N, TAFT composed by averaging deltas (``taft-composed``, eq. 13) vs Model Soup
  (``model-soup``) and the SISA output ensemble (``sisa``), from shard models (``taft-shard``, ``nlft-shard``);
* ``fig1``: accuracy vs shards removed by subtraction against SISA (``forget-subtraction``), one forget
  request by shard retraining vs full retraining (``forget-retrain``), and forgetting a fraction of the data
  by shard retraining (``forget-fraction``);
* ``table3``: DP fine-tuning of tangent vs original parameters per regime and epsilon (``dp-<regime>``).

The summary and Markdown report of the four groups are in :mod:`tasks.tangent_report`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.baselines import NonlinearSuffix, model_soup, train_fc, train_nonlinear
from core.tangent.compose import compose, ensemble_logits, remove_component
from core.tangent.model import TangentModel
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, train_tangent
from privbench.config import TangentConfig
from privbench.settings import get_settings
from storage.recording import Recorder, RunRef
from tasks.prepare_images import load_prepared_images, load_pretrained, to_pixels
from tasks.records import RESUMABLE, task_record

FEATURES_VERSION = "tangent-features-v1"


@dataclass(frozen=True)
class TangentInputs:
    """What every tangent task needs, by path: the prepared images and model, the cached features, and
    the flow run's folder for trained deltas and shard models."""

    images_path: str
    model_path: str
    features_path: str
    workdir: str
    n_classes: int
    n_train: int
    n_test: int


@dataclass(frozen=True)
class ShardJob:
    """Train one model on one shard: ``kind`` is ``taft`` or ``nlft``; shard ``index`` of ``n_shards``."""

    kind: str
    n_shards: int
    index: int


# ----------------------------------------------------------------------------------------------- helpers


def train_config(cfg: TangentConfig, kind: str) -> TangentTrainConfig:
    """The core training config of a method: TAFT uses the stage's loss (RSL, eq. 2) and ``lr``; NLFT and FC
    use cross-entropy with ``nlft_lr`` / ``fc_lr`` (App. A); all share epochs, batch size, ridge and seed."""
    if kind == "taft":
        return TangentTrainConfig(epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, loss=cfg.loss,
                                  alpha=cfg.alpha, kappa=cfg.kappa, ridge=cfg.ridge, ball_radius=cfg.ball_radius,
                                  seed=cfg.seed, lr_milestones=tuple(cfg.lr_milestones))
    epochs = cfg.nlft_epochs or cfg.epochs
    lr = cfg.nlft_lr if kind == "nlft" else cfg.fc_lr
    milestones = tuple(m for m in cfg.lr_milestones if m < epochs)
    return TangentTrainConfig(epochs=epochs, batch_size=cfg.batch_size, lr=lr, loss="ce", ridge=cfg.ridge,
                              seed=cfg.seed, lr_milestones=milestones)


def make_head(dim: int, n_classes: int, seed: int) -> nn.Linear:
    """The classifier every method starts from: ``N(0, 0.02^2)`` weight, zero bias, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(dim, n_classes)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n_classes, dim, generator=gen) * 0.02)
        head.bias.zero_()
    return head


@functools.lru_cache(maxsize=2)
def _backbone(model_path: str) -> nn.Module:
    return load_pretrained(model_path)


@functools.lru_cache(maxsize=2)
def _features(features_path: str) -> dict[str, Tensor]:
    return torch.load(features_path, mmap=True, weights_only=True)


def tangent_model(inputs: TangentInputs, cfg: TangentConfig, *, predict_jvp_only: bool = False) -> TangentModel:
    backbone = _backbone(inputs.model_path)
    head = make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed)
    return TangentModel(backbone, inputs.n_classes, cfg.k, reinit_last_block=cfg.reinit_last_block,
                        linearize_cls_token=cfg.linearize_cls_token, predict_jvp_only=predict_jvp_only,
                        head=head, seed=cfg.seed)


def nonlinear_model(inputs: TangentInputs, cfg: TangentConfig) -> NonlinearSuffix:
    backbone = _backbone(inputs.model_path)
    return NonlinearSuffix(backbone, make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed), cfg.k)


@torch.no_grad()
def logits_of(model: nn.Module, h: Tensor, batch_size: int = 256) -> Tensor:
    """``model.forward_from_cache`` over ``h: (n, N, D)`` in batches -> ``(n, C)``."""
    model.eval()
    return torch.cat([model.forward_from_cache(h[i : i + batch_size]) for i in range(0, h.shape[0], batch_size)])


def accuracy(logits: Tensor, labels: Tensor) -> float:
    return float((logits.argmax(dim=1) == labels).double().mean())


def shard_index(n_train: int, n_shards: int, seed: int) -> ShardIndex:
    """The seeded split shared by every task of one shard count (TAFT and NLFT shards see the same data)."""
    if n_shards > n_train:
        raise DataError(f"cannot split {n_train} training images into {n_shards} shards; lower tangent.shards "
                        f"to at most {n_train} or raise prepare.images[].n_train")
    return ShardIndex.from_split(n_train, n_shards, seed=seed)


def _set_threads(cfg: TangentConfig) -> None:
    torch.set_num_threads(cfg.threads_per_worker)


def _record_epochs(rec: Recorder, stats: Any, prefix: str = "") -> None:
    for e in stats.epochs:
        rec.metrics({f"{prefix}train_loss": e.loss, f"{prefix}delta_norm": e.delta_norm}, step=e.epoch)


def _delta_path(inputs: TangentInputs, job: ShardJob) -> Path:
    return Path(inputs.workdir) / f"{job.kind}-n{job.n_shards}-s{job.index}.pt"


# ----------------------------------------------------------------------------------------------- features


@task(name="tangent-cache-features")
def cache_features(cfg: TangentConfig, images_path: str, model_path: str, parent: RunRef) -> TangentInputs:
    """Frozen-prefix activations (embeddings + first L-k blocks) of every train and test image, computed once
    per (images, model, k) and memory-mapped by the training tasks (Sec. 5). Nothing else runs meanwhile,
    so it uses every worker's threads."""
    torch.set_num_threads(cfg.workers * cfg.threads_per_worker)
    data = load_prepared_images(images_path)
    model_manifest = json.loads((Path(model_path) / "manifest.json").read_text())
    key = hashlib.sha256(f"{FEATURES_VERSION}|{data['manifest']['content_hash']}|{model_manifest['content_hash']}|"
                         f"k={cfg.k}".encode()).hexdigest()
    home = get_settings().home
    path = home / "cache" / "tangent" / f"features-{key[:20]}.pt"
    workdir = Path(parent_workdir(parent))
    workdir.mkdir(parents=True, exist_ok=True)
    n_classes = len(data["classes"])
    spec = {"images": images_path, "model": model_path, "k": cfg.k, "key": key}
    with task_record(parent=parent, technique="feature-cache", config=spec, dataset=cfg.dataset) as rec:
        cached = path.is_file()
        if not cached:
            backbone = _backbone(model_path)
            probe = TangentModel(backbone, n_classes, cfg.k)
            t0 = time.perf_counter()
            out = {}
            for split in ("train", "test"):
                pixels = to_pixels(data[f"{split}_images"], data["mean"], data["std"])
                out[f"{split}_h"] = probe.cache_frozen(pixels, batch_size=128)  # (n, 1+P, D)
                out[f"{split}_y"] = data[f"{split}_labels"].clone()
            rec.metric("cache_s", time.perf_counter() - t0, unit="s")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # complete file or none: rename is atomic
            torch.save(out, tmp)
            os.replace(tmp, path)
        feats = _features(str(path))
        rec.metrics({"n_train": feats["train_h"].shape[0], "n_test": feats["test_h"].shape[0],
                     "tokens": feats["train_h"].shape[1], "hidden": feats["train_h"].shape[2],
                     "cache_hit": float(cached)})
    return TangentInputs(images_path=images_path, model_path=model_path, features_path=str(path),
                         workdir=str(workdir), n_classes=n_classes, n_train=int(feats["train_h"].shape[0]),
                         n_test=int(feats["test_h"].shape[0]))


def parent_workdir(parent: RunRef) -> str:
    """The flow run's folder for deltas and shard models (removed when the flow ends)."""
    return str(get_settings().home / "cache" / "tangent" / f"run-{parent.run_id}")


# ----------------------------------------------------------------------------------------------- Table 1


@task(name="tangent-table1", **RESUMABLE)
def train_full(method: str, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef) -> dict[str, Any]:
    """Table 1: one method on the whole training set; ``method`` is ``taft``, ``nlft`` or ``fc``."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    technique = {"taft": f"taft-{cfg.k}", "nlft": f"nlft-{cfg.k}", "fc": "fc"}[method]
    tcfg = train_config(cfg, method)
    with task_record(parent=parent, technique=technique, config={"method": method, **_cfg_json(tcfg), "k": cfg.k},
                     dataset=cfg.dataset) as rec:
        rec.tag("privbench.result_group", "table1")
        if method == "taft":
            model = tangent_model(inputs, cfg)
            stats = train_tangent(model, f["train_h"], f["train_y"], tcfg)
            n_params = sum(p.numel() for p in model.tangent_parameters())
        elif method == "nlft":
            model, stats = train_nonlinear(_backbone(inputs.model_path), nonlinear_model(inputs, cfg).head,
                                           f["train_h"], f["train_y"], tcfg, k=cfg.k)
            n_params = sum(p.numel() for p in model.parameters())
        else:
            base = nonlinear_model(inputs, cfg)
            z_train, z_test = _cls_features(base, f["train_h"]), _cls_features(base, f["test_h"])
            fc, stats = train_fc(base.head, z_train, f["train_y"], tcfg)
            n_params = sum(p.numel() for p in fc.parameters())
        if method == "fc":
            with torch.no_grad():
                test_acc, train_acc = accuracy(fc(z_test), f["test_y"]), accuracy(fc(z_train), f["train_y"])
        else:
            test_acc = accuracy(logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
            train_acc = accuracy(logits_of(model, f["train_h"], cfg.eval_batch_size), f["train_y"])
        _record_epochs(rec, stats)
        result = {"method": technique, "test_accuracy": test_acc, "train_accuracy": train_acc,
                  "train_s": stats.seconds, "trainable_parameters": n_params, "steps": stats.steps}
        rec.metrics({k: v for k, v in result.items() if k != "method"}, units={"train_s": "s"})
    return result


@torch.no_grad()
def _cls_features(model: NonlinearSuffix, h: Tensor, batch_size: int = 256) -> Tensor:
    """``LN(blocks(h))[:, 0]`` at the pretrained weights: the CLS features a linear probe (FC) reads."""
    outs = []
    for i in range(0, h.shape[0], batch_size):
        x = h[i : i + batch_size]
        for blk in model.blocks:
            out = blk(x)
            x = out[0] if isinstance(out, tuple) else out
        outs.append(model.layernorm(x)[:, 0])
    return torch.cat(outs)


def _cfg_json(tcfg: TangentTrainConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in tcfg.__dict__.items()}


# ----------------------------------------------------------------------------------------------- shards


@task(name="tangent-shard", **RESUMABLE)
def train_shard(job: ShardJob, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef) -> dict[str, Any]:
    """One shard model (TAFT delta or NLFT suffix) of a split into ``job.n_shards``, saved for composition."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    idx = shard_index(inputs.n_train, job.n_shards, cfg.seed).shards[job.index]
    tcfg = train_config(cfg, job.kind)
    tcfg = TangentTrainConfig(**{**tcfg.__dict__, "seed": cfg.seed + job.index})
    h, y = f["train_h"][idx], f["train_y"][idx]
    config = {"kind": job.kind, "n_shards": job.n_shards, "shard": job.index, "k": cfg.k, **_cfg_json(tcfg)}
    with task_record(parent=parent, technique=f"{job.kind}-shard", config=config, dataset=cfg.dataset,
                     run_name=f"{job.kind} shard {job.index + 1}/{job.n_shards}") as rec:
        rec.tag("privbench.result_group", "table2")
        if job.kind == "taft":
            model = tangent_model(inputs, cfg)
            stats = train_tangent(model, h, y, tcfg)
            state = model.get_delta()
        else:
            model, stats = train_nonlinear(_backbone(inputs.model_path), nonlinear_model(inputs, cfg).head, h, y,
                                           tcfg, k=cfg.k)
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, _delta_path(inputs, job))
        test_acc = accuracy(logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        result = {"kind": job.kind, "n_shards": job.n_shards, "shard": job.index, "n_train": int(idx.numel()),
                  "train_s": stats.seconds, "test_accuracy": test_acc, "path": str(_delta_path(inputs, job))}
        rec.metrics({"n_train": result["n_train"], "train_s": stats.seconds, "test_accuracy": test_acc},
                    units={"train_s": "s"})
    return result


def _load_deltas(inputs: TangentInputs, n_shards: int) -> list[dict[str, Tensor]]:
    return [torch.load(_delta_path(inputs, ShardJob("taft", n_shards, j)), weights_only=True) for j in range(n_shards)]


def _load_suffixes(inputs: TangentInputs, cfg: TangentConfig, n_shards: int) -> list[NonlinearSuffix]:
    models = []
    for j in range(n_shards):
        m = nonlinear_model(inputs, cfg)
        m.load_state_dict(torch.load(_delta_path(inputs, ShardJob("nlft", n_shards, j)), weights_only=True))
        models.append(m.eval())
    return models


# ----------------------------------------------------------------------------------------------- Table 2


@task(name="tangent-table2", **RESUMABLE)
def compose_shards(n_shards: int, shards: list[dict[str, Any]], cfg: TangentConfig, inputs: TangentInputs,
                   parent: RunRef) -> dict[str, Any]:
    """Table 2 for one shard count: TAFT composed by averaging deltas (eq. 13, one forward per input) vs
    Model Soup (weight average of the non-linear shard models) and SISA (output ensemble, N forwards)."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    h, y = f["test_h"], f["test_y"]
    bs = cfg.eval_batch_size
    mean_shard_s = {k: sum(s["train_s"] for s in shards if s["kind"] == k) / n_shards for k in ("taft", "nlft")}
    out: dict[str, Any] = {"n_shards": n_shards}
    model = tangent_model(inputs, cfg)
    deltas = _load_deltas(inputs, n_shards)
    with task_record(parent=parent, technique="taft-composed", config={"n_shards": n_shards, "k": cfg.k},
                     dataset=cfg.dataset, run_name=f"TAFT composed from {n_shards} shards") as rec:
        rec.tag("privbench.result_group", "table2")
        t0 = time.perf_counter()
        model.set_delta(compose(deltas))
        compose_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        composed = logits_of(model, h, bs)
        infer_s = time.perf_counter() - t0
        check = min(h.shape[0], 256)  # eq. 13 check: composed output == mean of component outputs
        err32 = _composition_error(model, deltas, h[:check], composed[:check], bs)
        model64 = _float64_suffix(model)
        model64.set_delta(compose([{n: t.double() for n, t in d.items()} for d in deltas]))
        h64 = h[:check].double()
        err64 = _composition_error(model64, [{n: t.double() for n, t in d.items()} for d in deltas], h64,
                                   logits_of(model64, h64, bs), bs)
        out["taft"] = {"test_accuracy": accuracy(composed, y), "compose_s": compose_s, "inference_s": infer_s,
                       "composition_max_abs_err": err64, "composition_max_abs_err_float32": err32,
                       "mean_shard_train_s": mean_shard_s["taft"],
                       "mean_component_accuracy": sum(s["test_accuracy"] for s in shards if s["kind"] == "taft") / n_shards}
        rec.metrics(out["taft"], units={"compose_s": "s", "inference_s": "s", "mean_shard_train_s": "s"})
    suffixes = _load_suffixes(inputs, cfg, n_shards)
    with task_record(parent=parent, technique="model-soup", config={"n_shards": n_shards, "k": cfg.k},
                     dataset=cfg.dataset, run_name=f"Model Soup of {n_shards} shards") as rec:
        rec.tag("privbench.result_group", "table2")
        soup = model_soup(suffixes)
        t0 = time.perf_counter()
        soup_logits = logits_of(soup, h, bs)
        out["soup"] = {"test_accuracy": accuracy(soup_logits, y), "inference_s": time.perf_counter() - t0,
                       "mean_shard_train_s": mean_shard_s["nlft"],
                       "mean_component_accuracy": sum(s["test_accuracy"] for s in shards if s["kind"] == "nlft") / n_shards}
        rec.metrics(out["soup"], units={"inference_s": "s", "mean_shard_train_s": "s"})
    with task_record(parent=parent, technique="sisa", config={"n_shards": n_shards, "k": cfg.k},
                     dataset=cfg.dataset, run_name=f"SISA ensemble of {n_shards} shards") as rec:
        rec.tag("privbench.result_group", "table2")
        t0 = time.perf_counter()
        sisa = ensemble_logits([logits_of(m, h, bs) for m in suffixes])
        out["sisa"] = {"test_accuracy": accuracy(sisa, y), "inference_s": time.perf_counter() - t0,
                       "mean_shard_train_s": mean_shard_s["nlft"]}
        rec.metrics(out["sisa"], units={"inference_s": "s", "mean_shard_train_s": "s"})
    return out


def _composition_error(model: TangentModel, deltas: list[dict[str, Tensor]], h: Tensor, composed: Tensor,
                       bs: int) -> float:
    """max |f(x; mean_k dw_k) - mean_k f(x; dw_k)| over ``h`` (eq. 13); restores nothing (callers reset)."""
    parts = []
    for d in deltas:
        model.set_delta(d)
        parts.append(logits_of(model, h, bs))
    return float((composed - ensemble_logits(parts)).abs().max())


def _float64_suffix(model: TangentModel) -> TangentModel:
    """A float64 copy of the linearised suffix (the frozen prefix is shared, not copied or converted): the
    composition identity is checked there, free of float32 rounding on logits of size ~kappa."""
    import copy

    memo = {id(model.embeddings): model.embeddings, id(model.frozen_blocks): model.frozen_blocks}
    m64 = copy.deepcopy(model, memo)
    for part in (m64.blocks, m64.layernorm, m64.head):
        part.double()
    if m64.linearize_cls_token:
        m64.d_cls.data = m64.d_cls.data.double()
    return m64


# ----------------------------------------------------------------------------------------------- Fig. 1


@task(name="tangent-fig1-subtraction", **RESUMABLE)
def forget_by_subtraction_curve(n_shards: int, cfg: TangentConfig, inputs: TangentInputs,
                                parent: RunRef) -> dict[str, Any]:
    """Fig. 1(a, b): test accuracy after removing r = 0 .. N-1 shards, TAFT by subtracting components from the
    composition (free) vs SISA by dropping ensemble members; mean over ``fig1_trials`` random removal orders.
    Every TAFT step is checked against composing the remaining shards from scratch (exact unlearning)."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    h, y, bs = f["test_h"], f["test_y"], cfg.eval_batch_size
    model = tangent_model(inputs, cfg)
    deltas = _load_deltas(inputs, n_shards)
    sisa_parts = [logits_of(m, h, bs) for m in _load_suffixes(inputs, cfg, n_shards)]
    taft_acc = [[] for _ in range(n_shards)]
    sisa_acc = [[] for _ in range(n_shards)]
    max_err, sub_s = 0.0, []
    rng = random.Random(cfg.seed)
    with task_record(parent=parent, technique="forget-subtraction",
                     config={"n_shards": n_shards, "trials": cfg.fig1_trials, "k": cfg.k}, dataset=cfg.dataset,
                     run_name=f"forget by subtraction, {n_shards} shards") as rec:
        rec.tag("privbench.result_group", "fig1")
        for _ in range(cfg.fig1_trials):
            order = list(range(n_shards))
            rng.shuffle(order)
            composed, live = compose(deltas), list(range(n_shards))
            for r in range(n_shards):
                if r:
                    j = order[r - 1]
                    t0 = time.perf_counter()
                    composed = remove_component(composed, deltas[j], len(live))
                    sub_s.append(time.perf_counter() - t0)
                    live.remove(j)
                    direct = compose([deltas[i] for i in live])
                    max_err = max(max_err, max(float((composed[n] - direct[n]).abs().max()) for n in composed))
                model.set_delta(composed)
                taft_acc[r].append(accuracy(logits_of(model, h, bs), y))
                sisa_acc[r].append(accuracy(ensemble_logits([sisa_parts[i] for i in live]), y))
        curve = {"removed": list(range(n_shards)),
                 "taft_accuracy": [sum(a) / len(a) for a in taft_acc],
                 "sisa_accuracy": [sum(a) / len(a) for a in sisa_acc]}
        for r in range(n_shards):
            rec.metrics({"taft_accuracy": curve["taft_accuracy"][r], "sisa_accuracy": curve["sisa_accuracy"][r]},
                        step=r)
        half = n_shards // 2
        summary = {"taft_accuracy_half_removed": curve["taft_accuracy"][half],
                   "sisa_accuracy_half_removed": curve["sisa_accuracy"][half],
                   "taft_drop_half_removed": curve["taft_accuracy"][0] - curve["taft_accuracy"][half],
                   "mean_taft_minus_sisa": sum(a - b for a, b in zip(curve["taft_accuracy"], curve["sisa_accuracy"],
                                                                     strict=True)) / n_shards,
                   "unlearning_max_abs_err": max_err,
                   "subtraction_s": sum(sub_s) / max(len(sub_s), 1)}
        rec.metrics(summary, units={"subtraction_s": "s"})
        rec.artifact_json("curve.json", curve)
    return {"n_shards": n_shards, **curve, **summary}


@task(name="tangent-fig1-retrain", **RESUMABLE)
def forget_one_by_retraining(n_shards: int, cfg: TangentConfig, inputs: TangentInputs,
                             parent: RunRef) -> dict[str, Any]:
    """Fig. 1(c), one request: forget a random training image by retraining its shard without it, next to the
    paragon (retraining TAFT from scratch on the other n-1 images); both timed in this task, side by side."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    index = shard_index(inputs.n_train, n_shards, cfg.seed)
    sample = random.Random(cfg.seed + 1).randrange(inputs.n_train)
    tcfg = train_config(cfg, "taft")
    with task_record(parent=parent, technique="forget-retrain",
                     config={"n_shards": n_shards, "sample": sample, "k": cfg.k, **_cfg_json(tcfg)},
                     dataset=cfg.dataset, run_name=f"forget one sample: shard vs full retraining ({n_shards} shards)") as rec:
        rec.tag("privbench.result_group", "fig1")
        k = index.shard_of(sample)
        rest = index.without(sample)
        deltas = _load_deltas(inputs, n_shards)
        model = tangent_model(inputs, cfg)
        t0 = time.perf_counter()
        train_tangent(model, f["train_h"][rest], f["train_y"][rest],
                      TangentTrainConfig(**{**tcfg.__dict__, "seed": cfg.seed + k}))
        shard_s = time.perf_counter() - t0
        deltas[k] = model.get_delta()
        model.set_delta(compose(deltas))
        shard_acc = accuracy(logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        keep = torch.cat([torch.arange(0, sample), torch.arange(sample + 1, inputs.n_train)])
        full = tangent_model(inputs, cfg)
        t0 = time.perf_counter()
        train_tangent(full, f["train_h"][keep], f["train_y"][keep], tcfg)
        full_s = time.perf_counter() - t0
        full_acc = accuracy(logits_of(full, f["test_h"], cfg.eval_batch_size), f["test_y"])
        result = {"shard_retrain_s": shard_s, "full_retrain_s": full_s, "full_over_shard_retrain_time": full_s / shard_s,
                  "shard_retrain_accuracy": shard_acc, "full_retrain_accuracy": full_acc,
                  "shard_size": int(index.shards[k].numel())}
        rec.metrics(result, units={"shard_retrain_s": "s", "full_retrain_s": "s"})
    return {"n_shards": n_shards, "sample": sample, **result}


@task(name="tangent-fig1-fraction", **RESUMABLE)
def forget_fraction(n_shards: int, fraction: float, cfg: TangentConfig, inputs: TangentInputs,
                    parent: RunRef) -> dict[str, Any]:
    """Fig. 1(c), many requests: forget a random ``fraction`` of the training images by retraining every shard
    that held one on its remaining images, then recompose; accuracy before and after."""
    _set_threads(cfg)
    f = _features(inputs.features_path)
    index = shard_index(inputs.n_train, n_shards, cfg.seed)
    n_forget = max(1, round(fraction * inputs.n_train))
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    forget = set(torch.randperm(inputs.n_train, generator=gen)[:n_forget].tolist())
    tcfg = train_config(cfg, "taft")
    with task_record(parent=parent, technique="forget-fraction",
                     config={"n_shards": n_shards, "fraction": fraction, "n_forget": n_forget, "k": cfg.k},
                     dataset=cfg.dataset, run_name=f"forget {fraction:.0%} by shard retraining") as rec:
        rec.tag("privbench.result_group", "fig1")
        deltas = _load_deltas(inputs, n_shards)
        model = tangent_model(inputs, cfg)
        model.set_delta(compose(deltas))
        before = accuracy(logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        live: list[dict[str, Tensor]] = []
        retrained, t0 = 0, time.perf_counter()
        for k, shard in enumerate(index.shards):
            keep = torch.tensor([i for i in shard.tolist() if i not in forget], dtype=torch.long)
            if keep.numel() == shard.numel():
                live.append(deltas[k])
                continue
            retrained += 1
            if keep.numel() == 0:  # the whole shard is forgotten: drop its component
                continue
            m = tangent_model(inputs, cfg)
            train_tangent(m, f["train_h"][keep], f["train_y"][keep],
                          TangentTrainConfig(**{**tcfg.__dict__, "seed": cfg.seed + k}))
            live.append(m.get_delta())
        retrain_s = time.perf_counter() - t0
        if not live:
            raise DataError(f"forgetting {fraction:.0%} of the data emptied every shard; lower forget_fractions")
        model.set_delta(compose(live))
        after = accuracy(logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        result = {"accuracy_before": before, "accuracy_after": after, "accuracy_drop": before - after,
                  "shards_retrained": retrained, "retrain_s": retrain_s, "n_forgotten": n_forget}
        rec.metrics(result, units={"retrain_s": "s"})
    return {"n_shards": n_shards, "fraction": fraction, **result}


# ----------------------------------------------------------------------------------------------- Table 3


@task(name="tangent-table3", **RESUMABLE)
def train_dp_regime(regime: str, tangent: bool, epsilon: float, cfg: TangentConfig, inputs: TangentInputs,
                    parent: RunRef) -> dict[str, Any]:
    """Table 3: DP-SGD fine-tuning of one regime's tangent ("Ours") or original ("Reg") parameters at
    ``epsilon``, with the privacy ledger recorded."""
    from core.tangent.regimes import train_regime_dp

    if cfg.dp is None:
        raise ConfigError("tangent.dp is not set; add a dp section to run Table 3")
    _set_threads(cfg)
    dp = cfg.dp
    f = _features(inputs.features_path)
    n = inputs.n_train if dp.n_train is None else min(dp.n_train, inputs.n_train)
    h, y = f["train_h"][:n], f["train_y"][:n]
    tcfg = TangentTrainConfig(epochs=dp.epochs, batch_size=dp.batch_size, lr=dp.lr, loss="ce", seed=cfg.seed)
    kind = "ours" if tangent else "reg"
    config = {"regime": regime, "parameters": kind, "target_epsilon": epsilon, "n_train": n, "k": cfg.k,
              "clip_norm": dp.clip_norm, "accountant": dp.accountant, "delta": dp.delta, **_cfg_json(tcfg)}
    with task_record(parent=parent, technique=f"dp-{regime}", config=config, dataset=cfg.dataset,
                     run_name=f"DP {regime} {kind} eps={epsilon:g}") as rec:
        rec.tag("privbench.result_group", "table3")
        rec.tag("privbench.parameters", kind)
        backbone = _backbone(inputs.model_path)
        head = make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed)
        res = train_regime_dp(backbone, head, h, y, regime=regime, tangent=tangent, cfg=tcfg, target_epsilon=epsilon,
                              clip_norm=dp.clip_norm, k=cfg.k, delta=dp.delta, accountant=dp.accountant,
                              seed=cfg.seed)
        led = res.ledger
        rec.privacy(epsilon=led.epsilon, delta=led.delta, noise_multiplier=led.noise_multiplier,
                    sample_rate=led.sample_rate, steps=led.steps, accountant=led.accountant,
                    clip_norm=dp.clip_norm, target_epsilon=epsilon, unit="example")
        test_acc = accuracy(logits_of(res.model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        _record_epochs(rec, res.stats)
        result = {"regime": regime, "parameters": kind, "target_epsilon": epsilon, "test_accuracy": test_acc,
                  "epsilon": led.epsilon, "noise_multiplier": led.noise_multiplier, "train_s": res.stats.seconds,
                  "trainable_parameters": res.trainable}
        rec.metrics({k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)},
                    units={"train_s": "s"})
    if not math.isfinite(test_acc):
        raise DataError(f"DP {regime} {kind} eps={epsilon}: accuracy is not finite")
    return result


# ----------------------------------------------------------------------------------------------- checks


def check_shard_counts(cfg: TangentConfig, inputs: TangentInputs) -> None:
    """Refuse shard counts the training set cannot fill before anything trains (one image per shard at least)."""
    for n in cfg.shards:
        shard_index(inputs.n_train, n, cfg.seed)
    if cfg.dp is not None and cfg.dp.n_train is not None and cfg.dp.n_train > inputs.n_train:
        raise DataError(f"tangent.dp.n_train={cfg.dp.n_train} exceeds the {inputs.n_train} training images; lower it "
                        "or leave it null for all")
