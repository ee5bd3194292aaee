"""Tangent-stage tasks (TAFT): cache frozen features, train one model each (full data or one shard, TAFT or a
non-linear baseline, DP or not), then compose, ensemble and forget; each recorded as one run.

Every task receives only small, picklable things (paths, configs, ints) so that a process pool or a Dask
cluster can run it: the frozen-prefix activations are computed once (:func:`cache_features`) into a
content-addressed ``.pt`` file that workers memory-map, the backbone is loaded from the prepared model
folder, and trained deltas / shard models are written to a folder of the flow run that later tasks read.

Result groups (tag ``privbench.result_group``), the paper's analogues:

* ``table1``: TAFT-k vs NLFT-k vs FC on the full training set (techniques ``taft-<k>``, ``nlft-<k>``, ``fc``), each
  method's recipe chosen on a validation part of the training images where ``tangent.search`` gives it a grid;
* ``table2``: per shard count N, TAFT composed by averaging deltas (``taft-composed``, eq. 13) vs Model Soup
  (``model-soup``) and the SISA output ensemble (``sisa``), from shard models (``taft-shard``, ``nlft-shard``)
  trained at the point Table 1's search chose for TAFT and NLFT (:func:`tune_table2`);
* ``fig1``: forgetting (its tasks are in :mod:`tasks.tangent_unlearning`);
* ``table3``: DP fine-tuning of tangent vs original parameters per regime and epsilon (``dp-<regime>``; its task
  is in :mod:`tasks.tangent_dp`).

What each task computes is a procedure of :mod:`core.tangent.experiments`; a task loads its inputs, runs it and
records the result. The summary and Markdown report of the four groups are in :mod:`tasks.tangent_report`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from prefect import task
from torch import Tensor, nn

from core.errors import PrivbenchError
from core.registry import lookup
from core.tangent import experiments as X
from core.tangent.baselines import NonlinearSuffix, train_nonlinear
from core.tangent.model import TangentModel
from core.tangent.search import FTPoint, Selection, fine_tune_grid, search_table1, validation_split
from core.tangent.train import TangentTrainConfig, train_tangent
from pbconfig.settings import get_settings
from pbconfig.tangent import TABLE2_METHODS, TangentConfig
from storage.recording import Recorder, RunRef
from tasks.prepare_images import load_prepared_images, load_pretrained, to_pixels
from tasks.records import RESUMABLE, task_record
from tasks.tangent_inputs import ShardJob, TangentInputs, train_config

FEATURES_VERSION = "tangent-features-v1"


@functools.lru_cache(maxsize=2)
def load_backbone(model_path: str) -> nn.Module:
    return load_pretrained(model_path)


@functools.lru_cache(maxsize=2)
def load_features(features_path: str) -> dict[str, Tensor]:
    return torch.load(features_path, mmap=True, weights_only=True)


def tangent_model(inputs: TangentInputs, cfg: TangentConfig, *, predict_jvp_only: bool = False) -> TangentModel:
    backbone = load_backbone(inputs.model_path)
    head = X.make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed)
    return TangentModel(
        backbone,
        inputs.n_classes,
        cfg.k,
        reinit_last_block=cfg.reinit_last_block,
        linearize_cls_token=cfg.linearize_cls_token,
        predict_jvp_only=predict_jvp_only,
        head=head,
        seed=cfg.seed,
    )


def nonlinear_model(inputs: TangentInputs, cfg: TangentConfig) -> NonlinearSuffix:
    backbone = load_backbone(inputs.model_path)
    return NonlinearSuffix(backbone, X.make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed), cfg.k)


def set_threads(cfg: TangentConfig) -> None:
    torch.set_num_threads(cfg.threads_per_worker)


def record_epochs(rec: Recorder, stats: Any, prefix: str = "") -> None:
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
    key = hashlib.sha256(
        f"{FEATURES_VERSION}|{data['manifest']['content_hash']}|{model_manifest['content_hash']}|k={cfg.k}".encode()
    ).hexdigest()
    home = get_settings().home
    path = home / "cache" / "tangent" / f"features-{key[:20]}.pt"
    workdir = Path(parent_workdir(parent))
    workdir.mkdir(parents=True, exist_ok=True)
    n_classes = len(data["classes"])
    spec = {"images": images_path, "model": model_path, "k": cfg.k, "key": key}
    with task_record(parent=parent, technique="feature-cache", config=spec, dataset=cfg.dataset) as rec:
        cached = path.is_file()
        if not cached:
            backbone = load_backbone(model_path)
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
        feats = load_features(str(path))
        rec.metrics(
            {
                "n_train": feats["train_h"].shape[0],
                "n_test": feats["test_h"].shape[0],
                "tokens": feats["train_h"].shape[1],
                "hidden": feats["train_h"].shape[2],
                "cache_hit": float(cached),
            }
        )
    return TangentInputs(
        images_path=images_path,
        model_path=model_path,
        features_path=str(path),
        workdir=str(workdir),
        n_classes=n_classes,
        n_train=int(feats["train_h"].shape[0]),
        n_test=int(feats["test_h"].shape[0]),
    )


def parent_workdir(parent: RunRef) -> str:
    """The flow run's folder for deltas and shard models (removed when the flow ends)."""
    return str(get_settings().home / "cache" / "tangent" / f"run-{parent.run_id}")


# ----------------------------------------------------------------------------------------------- Table 1

# method -> its technique name (given k); what each method trains is core's (core.tangent.experiments.table1_cell)
TABLE1: dict[str, str] = {"taft": "taft-{k}", "nlft": "nlft-{k}", "fc": "fc"}


def method_grid(cfg: TangentConfig, method: str) -> tuple[FTPoint, ...]:
    """The grid ``method`` searches (``cfg.search``'s knobs, the stage's values where null): one point is no search."""
    g = cfg.method_grid(method)
    return fine_tune_grid(g.lrs, g.pts, g.cls)


def _split(cfg: TangentConfig, n_train: int) -> tuple[Tensor, Tensor]:
    return validation_split(
        n_train,
        cfg.search.val_fraction,
        cfg.seed,
        what="training images",
        fix="raise prepare.images[].n_train or change tangent.search.val_fraction",
    )


def check_search(cfg: TangentConfig, inputs: TangentInputs) -> None:
    """Refuse a Table 1 search whose validation part would leave either side of the training images empty, before
    anything trains."""
    if any(len(method_grid(cfg, m)) > 1 for m in TABLE1):
        _split(cfg, inputs.n_train)


def grid_config(method: str, grid: tuple[FTPoint, ...], val_fraction: float) -> dict[str, Any]:
    """The params of a searched method's grid: ``search_grid`` (TAFT: ``[lr, PT, CLS]`` per point, in grid order;
    the others: the lr) and ``val_fraction``."""
    taft = method == "taft"
    return {"search_grid": [[p.lr, p.pretrained, p.cls] if taft else p.lr for p in grid], "val_fraction": val_fraction}


def chosen_config(method: str, point: FTPoint) -> dict[str, Any]:
    """The chosen point's knobs: ``lr``, and TAFT's ``pretrained`` (PT) and ``cls`` (CLS)."""
    return {"lr": point.lr} | ({"pretrained": point.pretrained, "cls": point.cls} if method == "taft" else {})


def search_config(method: str, search: Selection, val_fraction: float) -> dict[str, Any]:
    """The params of a run whose recipe a search chose: its grid and the chosen point."""
    return grid_config(method, search.grid, val_fraction) | chosen_config(method, search.point)


def record_search(
    rec: Recorder, search: Selection, *, ran_here: bool, extra: dict[str, float] | None = None
) -> dict[str, Any]:
    """The search behind a run (Tables 1-2's :class:`Selection` or Table 3's DP search): its size, each point's
    validation accuracy (series ``tuning.valid_accuracy_by_point``, step = the point's index in
    ``config.search_grid``; also the artifact ``tuning.json``), the chosen one's, the sizes of the two parts, any
    ``extra`` metrics, and its wall seconds in the run whose task ran it (``ran_here``)."""
    for j, v in enumerate(search.valid_accuracy):
        if math.isfinite(v):
            rec.metric("tuning.valid_accuracy_by_point", v, step=j)
    out = {
        "tuning.points": search.points,
        "tuning.valid_accuracy": search.valid_accuracy[search.chosen],
        "tuning.n_fit": search.n_fit,
        "tuning.n_val": search.n_val,
        "tuning.diverged": sum(not math.isfinite(v) for v in search.valid_accuracy),
    } | (extra or {})
    rec.metrics(out)
    if ran_here:
        rec.metric("tuning.search_s", search.seconds, unit="s")
    rec.artifact_json(
        "tuning.json",
        [
            {"lr": p.lr, "pt": p.pretrained}
            | ({"cls": p.cls} if hasattr(p, "cls") else {})
            | {"valid_accuracy": v, "chosen": j == search.chosen}
            for j, (p, v) in enumerate(zip(search.grid, search.valid_accuracy, strict=True))
        ],
    )
    return out


@task(name="tangent-table1", **RESUMABLE)
def train_full(method: str, cfg: TangentConfig, inputs: TangentInputs, parent: RunRef) -> dict[str, Any]:
    """Table 1: one method on the whole training set; ``method`` is one of :data:`TABLE1` (``taft``, ``nlft``,
    ``fc``). When ``cfg.search`` gives the method more than one point, the point is first chosen on a validation
    part of the training images (:func:`core.tangent.search.search_table1`; the test set is not read) and then
    retrained on all of them; the run records the search (``search_grid``, ``tuning.*``) and the result carries it
    (``search``) for Table 2. One point trains once, on all the images, as it always did."""
    name = lookup("Table 1 method", TABLE1, method)
    set_threads(cfg)
    f = load_features(inputs.features_path)
    technique = name.format(k=cfg.k)
    grid = method_grid(cfg, method)
    backbone = load_backbone(inputs.model_path)
    head = X.make_head(backbone.config.hidden_size, inputs.n_classes, cfg.seed)
    record = {"parent": parent, "technique": technique, "dataset": cfg.dataset}
    config = {"method": method, **config_json(train_config(cfg, method)), "k": cfg.k}
    search: Selection | None = None
    if len(grid) > 1:
        config |= grid_config(method, grid, cfg.search.val_fraction)
        try:
            fit, val = _split(cfg, inputs.n_train)
            search = search_table1(
                method,
                backbone,
                head,
                (f["train_h"][fit], f["train_y"][fit]),
                (f["train_h"][val], f["train_y"][val]),
                grid,
                train_config(cfg, method),
                k=cfg.k,
                seed=cfg.seed,
                batch_size=cfg.eval_batch_size,
            )
        except PrivbenchError:
            with task_record(**record, config=config):  # the run that needed the search fails with it
                raise
    point = search.point if search is not None else grid[0]
    tcfg = replace(train_config(cfg, method), lr=point.lr)
    config |= config_json(tcfg) | (chosen_config(method, point) if search is not None else {})
    with task_record(**record, config=config) as rec:
        rec.tag("privbench.result_group", "table1")
        cell = X.table1_cell(
            method,
            backbone,
            head,
            f["train_h"],
            f["train_y"],
            f["test_h"],
            f["test_y"],
            tcfg,
            k=cfg.k,
            pretrained=point.pretrained,
            cls=point.cls,
            seed=cfg.seed,
            batch_size=cfg.eval_batch_size,
        )
        record_epochs(rec, cell.stats)
        result: dict[str, Any] = {
            "method": technique,
            "test_accuracy": cell.eval_accuracy,
            "train_accuracy": cell.train_accuracy,
            "train_s": cell.stats.seconds,
            "trainable_parameters": cell.trainable,
            "steps": cell.stats.steps,
        }
        rec.metrics({k: v for k, v in result.items() if k != "method"}, units={"train_s": "s"})
        if search is not None:
            chosen = chosen_config(method, point)
            rec.metrics({k: float(v) for k, v in chosen.items()})
            result |= chosen | record_search(rec, search, ran_here=True) | {"search": search.as_dict()}
    return result


def tune_table2(cfg: TangentConfig, table1: dict[str, dict[str, Any]]) -> tuple[TangentConfig, dict[str, Selection]]:
    """Table 2's recipe from Table 1's choices: ``cfg`` with each searched method of Table 2 (TAFT; NLFT, whose
    shards Model Soup averages and SISA ensembles) fixed at the point its Table 1 search chose, and those searches
    (for the Table 2 runs to record). ``table1`` maps a method to its :func:`train_full` result; a method not
    searched keeps its one point."""
    tuning: dict[str, Selection] = {}
    for method in TABLE2_METHODS:
        row = table1.get(method, {})
        if "search" not in row:
            continue
        search = Selection.from_dict(row["search"])
        p = search.point
        cfg = cfg.with_point(method, lr=p.lr, pretrained=p.pretrained, cls=p.cls)
        tuning[method] = search
    return cfg, tuning


def config_json(tcfg: TangentTrainConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in tcfg.__dict__.items()}


# ----------------------------------------------------------------------------------------------- shards


@task(name="tangent-shard", **RESUMABLE)
def train_shard(
    job: ShardJob,
    cfg: TangentConfig,
    inputs: TangentInputs,
    parent: RunRef,
    tuning: dict[str, Selection] | None = None,
) -> dict[str, Any]:
    """One shard model (TAFT delta or NLFT suffix) of a split into ``job.n_shards``, saved for composition. ``cfg``
    carries the recipe (after a Table 1 search, :func:`tune_table2`'s: the chosen point); ``tuning`` holds the
    searches that chose it, recorded with the run."""
    search = (tuning or {}).get(job.kind)
    set_threads(cfg)
    f = load_features(inputs.features_path)
    idx = X.shard_index(inputs.n_train, job.n_shards, cfg.seed).shards[job.index]
    tcfg = replace(train_config(cfg, job.kind), seed=cfg.seed + job.index)
    h, y = f["train_h"][idx], f["train_y"][idx]
    config = {"kind": job.kind, "n_shards": job.n_shards, "shard": job.index, "k": cfg.k, **config_json(tcfg)}
    if search is not None:
        config |= search_config(job.kind, search, cfg.search.val_fraction)
    with task_record(
        parent=parent,
        technique=f"{job.kind}-shard",
        config=config,
        dataset=cfg.dataset,
        run_name=f"{job.kind} shard {job.index + 1}/{job.n_shards}",
    ) as rec:
        rec.tag("privbench.result_group", "table2")
        if job.kind == "taft":
            model = tangent_model(inputs, cfg)
            stats = train_tangent(model, h, y, tcfg)
            state = model.get_delta()
        else:
            model, stats = train_nonlinear(
                load_backbone(inputs.model_path), nonlinear_model(inputs, cfg).head, h, y, tcfg, k=cfg.k
            )
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(state, _delta_path(inputs, job))
        test_acc = X.accuracy(X.logits_of(model, f["test_h"], cfg.eval_batch_size), f["test_y"])
        result = {
            "kind": job.kind,
            "n_shards": job.n_shards,
            "shard": job.index,
            "n_train": int(idx.numel()),
            "train_s": stats.seconds,
            "test_accuracy": test_acc,
            "path": str(_delta_path(inputs, job)),
        }
        rec.metrics(
            {"n_train": result["n_train"], "train_s": stats.seconds, "test_accuracy": test_acc}, units={"train_s": "s"}
        )
        if search is not None:
            record_search(rec, search, ran_here=False)
    return result


def load_deltas(inputs: TangentInputs, n_shards: int) -> list[dict[str, Tensor]]:
    return [torch.load(_delta_path(inputs, ShardJob("taft", n_shards, j)), weights_only=True) for j in range(n_shards)]


def load_suffixes(inputs: TangentInputs, cfg: TangentConfig, n_shards: int) -> list[NonlinearSuffix]:
    models = []
    for j in range(n_shards):
        m = nonlinear_model(inputs, cfg)
        m.load_state_dict(torch.load(_delta_path(inputs, ShardJob("nlft", n_shards, j)), weights_only=True))
        models.append(m.eval())
    return models


# ----------------------------------------------------------------------------------------------- Table 2


@task(name="tangent-table2", **RESUMABLE)
def compose_shards(
    n_shards: int,
    shards: list[dict[str, Any]],
    cfg: TangentConfig,
    inputs: TangentInputs,
    parent: RunRef,
    tuning: dict[str, Selection] | None = None,
) -> dict[str, Any]:
    """Table 2 for one shard count: TAFT composed by averaging deltas (eq. 13, one forward per input) vs
    Model Soup (weight average of the non-linear shard models) and SISA (output ensemble, N forwards). With
    ``tuning`` (Table 1's searches, :func:`tune_table2`) the TAFT run records TAFT's search and the Model Soup and
    SISA runs NLFT's, whose chosen points their shards trained at."""
    tuning = tuning or {}
    set_threads(cfg)
    f = load_features(inputs.features_path)
    h, y, bs = f["test_h"], f["test_y"], cfg.eval_batch_size
    mean_shard_s = {k: sum(s["train_s"] for s in shards if s["kind"] == k) / n_shards for k in ("taft", "nlft")}
    mean_acc = {k: sum(s["test_accuracy"] for s in shards if s["kind"] == k) / n_shards for k in ("taft", "nlft")}
    out: dict[str, Any] = {"n_shards": n_shards}
    config = {"n_shards": n_shards, "k": cfg.k}
    searched = {k: config | search_config(k, v, cfg.search.val_fraction) for k, v in tuning.items()}

    def row(technique: str, method: str, run_name: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """One Table 2 run: ``compute()`` under its record, with the search of ``method`` (TAFT or NLFT) whose
        chosen point the shards trained at."""
        recorded = {"config": searched.get(method, config), "dataset": cfg.dataset, "run_name": run_name}
        with task_record(parent=parent, technique=technique, **recorded) as rec:
            rec.tag("privbench.result_group", "table2")
            result = compute()
            rec.metrics(result, units={k: "s" for k in result if k.endswith("_s")})
            if method in tuning:
                record_search(rec, tuning[method], ran_here=False)
        return result

    out["taft"] = row(
        "taft-composed",
        "taft",
        f"TAFT composed from {n_shards} shards",
        lambda: {
            **X.compose_and_check(tangent_model(inputs, cfg), load_deltas(inputs, n_shards), h, y, batch_size=bs),
            "mean_shard_train_s": mean_shard_s["taft"],
            "mean_component_accuracy": mean_acc["taft"],
        },
    )
    suffixes = load_suffixes(inputs, cfg, n_shards)
    out["soup"] = row(
        "model-soup",
        "nlft",
        f"Model Soup of {n_shards} shards",
        lambda: {
            **X.soup_accuracy(suffixes, h, y, batch_size=bs),
            "mean_shard_train_s": mean_shard_s["nlft"],
            "mean_component_accuracy": mean_acc["nlft"],
        },
    )
    out["sisa"] = row(
        "sisa",
        "nlft",
        f"SISA ensemble of {n_shards} shards",
        lambda: {**X.sisa_accuracy(suffixes, h, y, batch_size=bs), "mean_shard_train_s": mean_shard_s["nlft"]},
    )
    return out


# ----------------------------------------------------------------------------------------------- checks


def check_shard_counts(cfg: TangentConfig, inputs: TangentInputs) -> None:
    """Refuse shard counts the training set cannot fill before anything trains (one image per shard at least)."""
    for n in cfg.shards:
        X.shard_index(inputs.n_train, n, cfg.seed)
