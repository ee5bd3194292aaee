"""The experiment procedures of the tangent stage on cached frozen features: what one cell of the TAFT paper's
Tables 1-3 and Fig. 1 computes, free of recording and caching (``tasks.tangent`` wraps each in a task).

* Table 1: :func:`make_head` (the classifier every method starts from), :func:`cls_features` (what FC reads),
  :func:`table1_cell` (one of :data:`TABLE1_METHODS` trained and evaluated; :mod:`core.tangent.search` scores it
  on validation data to choose each method's point);
* Table 2: :func:`compose_and_check` (TAFT composed by averaging deltas, eq. 13, with the composition identity
  checked in float32 and float64), :func:`soup_accuracy` and :func:`sisa_accuracy` (the non-linear baselines);
* Fig. 1: :func:`forget_by_subtraction_curve` (accuracy vs shards removed, TAFT by subtraction vs SISA, with
  exact forgetting checked on the outputs in float64 by :func:`forget_output_error`),
  :func:`forget_one_by_retraining` (one request: shard vs full retraining) and :func:`forget_fraction` (many
  requests: every shard that held one retrained);
* Table 3: :func:`dp_regime_cell` (DP-SGD of one regime's tangent or original parameters at one epsilon).

Models are built by the caller (``new_model()``: a fresh :class:`TangentModel` linearised at the same backbone
weights every time, so that deltas compose); ``h``/``y`` are cached prefix activations ``(n, N, D)`` and labels
``(n,)``. Timings are wall-clock seconds.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from core.dp.accounting import PrivacyLedger
from core.errors import ConfigError, DataError
from core.registry import lookup
from core.tangent.baselines import NonlinearSuffix, forget_by_retraining, model_soup, train_fc, train_nonlinear
from core.tangent.compose import compose, ensemble_logits, remove_component
from core.tangent.model import TangentModel
from core.tangent.regimes import build_regime_model, regime_parameter_names
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, TrainStats, train_dp, train_tangent

__all__ = [
    "TABLE1_METHODS",
    "DPCell",
    "Table1Cell",
    "accuracy",
    "cls_features",
    "compose_and_check",
    "composition_error",
    "dp_regime_cell",
    "float64_suffix",
    "forget_by_subtraction_curve",
    "forget_fraction",
    "forget_one_by_retraining",
    "forget_output_error",
    "forget_sample",
    "forget_set",
    "logits_of",
    "make_head",
    "shard_index",
    "sisa_accuracy",
    "soup_accuracy",
    "table1_cell",
]

Deltas = Sequence[dict[str, Tensor]]
Data = tuple[Tensor, Tensor]  # cached prefix activations (n, N, D) and labels (n,)


# ----------------------------------------------------------------------------------------------- basics


def make_head(dim: int, n_classes: int, seed: int) -> nn.Linear:
    """The classifier every method starts from: ``N(0, 0.02^2)`` weight, zero bias, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(dim, n_classes)
    with torch.no_grad():
        head.weight.copy_(torch.randn(n_classes, dim, generator=gen) * 0.02)
        head.bias.zero_()
    return head


@torch.no_grad()
def logits_of(model: nn.Module, h: Tensor, batch_size: int = 256) -> Tensor:
    """``model.forward_from_cache`` over ``h: (n, N, D)`` in batches -> ``(n, C)`` (eval mode)."""
    model.eval()
    return torch.cat([model.forward_from_cache(h[i : i + batch_size]) for i in range(0, h.shape[0], batch_size)])


def accuracy(logits: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy of ``logits: (n, C)`` against ``labels: (n,)``."""
    return float((logits.argmax(dim=1) == labels).double().mean())


def shard_index(n_train: int, n_shards: int, seed: int) -> ShardIndex:
    """The seeded split shared by every task of one shard count (TAFT and NLFT shards see the same data)."""
    if n_shards > n_train:
        raise DataError(
            f"cannot split {n_train} training images into {n_shards} shards; lower tangent.shards "
            f"to at most {n_train} or raise prepare.images[].n_train"
        )
    return ShardIndex.from_split(n_train, n_shards, seed=seed)


@torch.no_grad()
def cls_features(model: NonlinearSuffix, h: Tensor, batch_size: int = 256) -> Tensor:
    """``LN(blocks(h))[:, 0]`` at the pretrained weights: the CLS features a linear probe (FC) reads."""
    outs = []
    for i in range(0, h.shape[0], batch_size):
        x = h[i : i + batch_size]
        for blk in model.blocks:
            out = blk(x)
            x = out[0] if isinstance(out, tuple) else out
        outs.append(model.layernorm(x)[:, 0])
    return torch.cat(outs)


def _seeded(cfg: TangentTrainConfig, k: int) -> TangentTrainConfig:
    """Shard ``k``'s config: seed ``cfg.seed + k`` (its retraining reuses it)."""
    return replace(cfg, seed=cfg.seed + k)


# ----------------------------------------------------------------------------------------------- Table 1


@dataclass(frozen=True)
class Table1Cell:
    """One Table 1 method trained on ``(h, y)``: its accuracy on the evaluation set (the test set, or the validation
    part when :mod:`core.tangent.search` scores a point), its accuracy on its own training set, its training stats
    and the number of trained scalars."""

    eval_accuracy: float
    train_accuracy: float
    stats: TrainStats
    trainable: int


@dataclass(frozen=True)
class _Recipe:
    """What a Table 1 cell trains from: the model's knobs (TAFT's PT and CLS; the reset's seed) and the batch size
    of its evaluation."""

    k: int
    pretrained: bool
    cls: bool
    seed: int
    batch_size: int


def _suffix_cell(model: nn.Module, stats: TrainStats, trainable: int, train: Data, evals: Data, bs: int) -> Table1Cell:
    """A trained suffix model's accuracies, read from the cached features."""
    return Table1Cell(
        accuracy(logits_of(model, evals[0], bs), evals[1]),
        accuracy(logits_of(model, train[0], bs), train[1]),
        stats,
        trainable,
    )


def _taft_cell(
    backbone: nn.Module, head: nn.Linear, train: Data, evals: Data, cfg: TangentTrainConfig, r: _Recipe
) -> Table1Cell:
    """TAFT-k: a tangent model at PT/CLS, its delta trained with ``cfg`` (the stage's loss: RSL, eq. 2)."""
    model = TangentModel(
        backbone,
        head.out_features,
        r.k,
        reinit_last_block=not r.pretrained,
        linearize_cls_token=r.cls,
        head=head,
        seed=r.seed,
    )
    stats = train_tangent(model, *train, cfg)
    trainable = sum(p.numel() for p in model.tangent_parameters())
    return _suffix_cell(model, stats, trainable, train, evals, r.batch_size)


def _nlft_cell(
    backbone: nn.Module, head: nn.Linear, train: Data, evals: Data, cfg: TangentTrainConfig, r: _Recipe
) -> Table1Cell:
    """NLFT-k: the last k blocks, final LN and head fine-tuned non-linearly (cross-entropy)."""
    model, stats = train_nonlinear(backbone, head, *train, cfg, k=r.k)
    trainable = sum(p.numel() for p in model.parameters())
    return _suffix_cell(model, stats, trainable, train, evals, r.batch_size)


def _fc_cell(
    backbone: nn.Module, head: nn.Linear, train: Data, evals: Data, cfg: TangentTrainConfig, r: _Recipe
) -> Table1Cell:
    """FC: the linear probe on the pretrained model's CLS features."""
    base = NonlinearSuffix(backbone, head, r.k)
    z_train, z_eval = cls_features(base, train[0]), cls_features(base, evals[0])
    fc, stats = train_fc(base.head, z_train, train[1], cfg)
    with torch.no_grad():
        eval_acc, train_acc = accuracy(fc(z_eval), evals[1]), accuracy(fc(z_train), train[1])
    return Table1Cell(eval_acc, train_acc, stats, sum(p.numel() for p in fc.parameters()))


# method -> how it trains and evaluates; the only list of Table 1's methods
_TABLE1: dict[str, Callable[[nn.Module, nn.Linear, Data, Data, TangentTrainConfig, _Recipe], Table1Cell]] = {
    "taft": _taft_cell,
    "nlft": _nlft_cell,
    "fc": _fc_cell,
}
TABLE1_METHODS: tuple[str, ...] = tuple(_TABLE1)


def table1_cell(
    method: str,
    backbone: nn.Module,
    head: nn.Linear,
    h: Tensor,
    y: Tensor,
    eval_h: Tensor,
    eval_y: Tensor,
    cfg: TangentTrainConfig,
    *,
    k: int = 1,
    pretrained: bool = True,
    cls: bool = False,
    seed: int = 0,
    batch_size: int = 256,
) -> Table1Cell:
    """Table 1: ``method`` (``taft``: TAFT-k; ``nlft``: NLFT-k; ``fc``: the linear probe) trained with ``cfg`` on the
    cached prefix activations ``(h, y)`` from ``head`` (neither it nor ``backbone`` is modified) and evaluated on
    ``(eval_h, eval_y)``. ``pretrained`` and ``cls`` are TAFT's PT and CLS (App. A; the last block reset from
    ``seed`` where ``pretrained=False``); the other methods have neither and refuse PT=F or CLS=T."""
    train = lookup("Table 1 method", _TABLE1, method)
    if method != "taft" and (not pretrained or cls):
        raise ConfigError(
            f"PT and CLS are TAFT's knobs (App. A); {method} has neither, got pretrained={pretrained}, cls={cls}"
        )
    return train(backbone, head, (h, y), (eval_h, eval_y), cfg, _Recipe(k, pretrained, cls, seed, batch_size))


# ----------------------------------------------------------------------------------------------- Table 2


def composition_error(model: TangentModel, deltas: Deltas, h: Tensor, composed: Tensor, batch_size: int) -> float:
    """``max |f(x; mean_k dw_k) - mean_k f(x; dw_k)|`` over ``h`` (eq. 13), ``composed`` being the left side's
    logits; leaves ``model`` holding the last component's delta (callers reset it)."""
    parts = []
    for d in deltas:
        model.set_delta(d)
        parts.append(logits_of(model, h, batch_size))
    return float((composed - ensemble_logits(parts)).abs().max())


def float64_suffix(model: TangentModel) -> TangentModel:
    """A float64 copy of the linearised suffix (the frozen prefix is shared, not copied or converted): the
    composition identity is checked there, free of float32 rounding on logits of size ~kappa."""
    memo = {id(model.embeddings): model.embeddings, id(model.frozen_blocks): model.frozen_blocks}
    m64 = copy.deepcopy(model, memo)
    for part in (m64.blocks, m64.layernorm, m64.head):
        part.double()
    if m64.linearize_cls_token:
        m64.d_cls.data = m64.d_cls.data.double()
    return m64


def compose_and_check(
    model: TangentModel, deltas: Deltas, h: Tensor, y: Tensor, *, batch_size: int = 256, check: int = 256
) -> dict[str, float]:
    """Table 2, TAFT: set ``model``'s delta to the average of ``deltas`` (eq. 13, one forward per input) and
    measure its accuracy on ``(h, y)``; the composition identity (composed output == mean of the component
    outputs) is checked on the first ``check`` inputs, in float32 and in float64. Leaves ``model`` composed.

    Returns ``test_accuracy``, ``compose_s``, ``inference_s``, ``composition_max_abs_err`` (float64) and
    ``composition_max_abs_err_float32``."""
    t0 = time.perf_counter()
    model.set_delta(compose(list(deltas)))
    compose_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    composed = logits_of(model, h, batch_size)
    infer_s = time.perf_counter() - t0
    check = min(h.shape[0], check)
    err32 = composition_error(model, deltas, h[:check], composed[:check], batch_size)
    model.set_delta(compose(list(deltas)))
    deltas64 = [{n: t.double() for n, t in d.items()} for d in deltas]
    model64 = float64_suffix(model)
    model64.set_delta(compose(deltas64))
    h64 = h[:check].double()
    err64 = composition_error(model64, deltas64, h64, logits_of(model64, h64, batch_size), batch_size)
    return {
        "test_accuracy": accuracy(composed, y),
        "compose_s": compose_s,
        "inference_s": infer_s,
        "composition_max_abs_err": err64,
        "composition_max_abs_err_float32": err32,
    }


def soup_accuracy(
    suffixes: Sequence[NonlinearSuffix], h: Tensor, y: Tensor, *, batch_size: int = 256
) -> dict[str, float]:
    """Table 2, Model Soup: the weight average of the non-linear shard models (O(1) inference, no guarantee on
    the outputs): ``test_accuracy`` and ``inference_s``."""
    soup = model_soup(suffixes)
    t0 = time.perf_counter()
    logits = logits_of(soup, h, batch_size)
    return {"test_accuracy": accuracy(logits, y), "inference_s": time.perf_counter() - t0}


def sisa_accuracy(
    suffixes: Sequence[NonlinearSuffix], h: Tensor, y: Tensor, *, batch_size: int = 256
) -> dict[str, float]:
    """Table 2, SISA: the output ensemble of the non-linear shard models (N forwards per input):
    ``test_accuracy`` and ``inference_s``."""
    t0 = time.perf_counter()
    logits = ensemble_logits([logits_of(m, h, batch_size) for m in suffixes])
    return {"test_accuracy": accuracy(logits, y), "inference_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------- Fig. 1


def forget_output_error(forgotten: nn.Module, parts: Sequence[Tensor], h: Tensor, batch_size: int = 256) -> float:
    """``max |f(x; forgotten) - mean_k f_k(x)|`` over ``h``, the difference taken in float64: the logits of the
    model left after forgetting (its weights subtracted, any kind of model) against the output ensemble of the
    remaining shard models, ``parts`` being each one's logits on ``h`` computed on its own.

    For a tangent model composed and subtracted in float64 this is float64 rounding (eq. 13: the subtracted
    composition is the composition of the rest, which is their ensemble); for a non-linear model whose weights
    were averaged and then subtracted it is not (a Model Soup is no ensemble), nor when the wrong component is
    subtracted. Pass a float64 model and float64 ``parts`` for the exact check (float32 logits carry their own
    rounding)."""
    out = logits_of(forgotten, h, batch_size).double()
    return float((out - ensemble_logits([p.double() for p in parts])).abs().max())


def forget_by_subtraction_curve(
    model: TangentModel,
    deltas: Deltas,
    sisa_parts: Sequence[Tensor],
    h: Tensor,
    y: Tensor,
    *,
    trials: int,
    seed: int,
    batch_size: int = 256,
    check: int = 256,
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Fig. 1(a, b): test accuracy after removing r = 0 .. N-1 of the N shards, TAFT by subtracting components
    from the composition (free, Sec. 3.3) vs SISA by dropping ensemble members (``sisa_parts``: each shard
    model's logits on ``h``); mean over ``trials`` random removal orders drawn from ``seed``. Every TAFT step
    is checked twice: its delta against composing the remaining shards' deltas from scratch (weight arithmetic,
    ``unlearning_max_abs_err``), and its function (``forget_output_max_abs_err``): the same subtractions repeated
    in float64 on a float64 copy of the linearised suffix (:func:`float64_suffix`), whose logits on the first
    ``check`` inputs must equal the mean of the remaining shard models' logits, each shard model evaluated on
    its own (:func:`forget_output_error`).

    Returns the curve (``removed``, ``taft_accuracy``, ``sisa_accuracy``, one entry per r) and its summary
    (accuracies and TAFT's drop at half removed, mean TAFT - SISA gap, ``unlearning_max_abs_err``,
    ``forget_output_max_abs_err``, mean ``subtraction_s``)."""
    n_shards = len(deltas)
    taft_acc: list[list[float]] = [[] for _ in range(n_shards)]
    sisa_acc: list[list[float]] = [[] for _ in range(n_shards)]
    max_err, out_err, sub_s = 0.0, 0.0, []
    deltas64 = [{n: t.double() for n, t in d.items()} for d in deltas]
    model64 = float64_suffix(model)
    h64 = h[: min(h.shape[0], check)].double()
    parts64 = []  # each shard model on its own, in float64
    for d in deltas64:
        model64.set_delta(d)
        parts64.append(logits_of(model64, h64, batch_size))
    rng = random.Random(seed)
    for _ in range(trials):
        order = list(range(n_shards))
        rng.shuffle(order)
        composed, live = compose(list(deltas)), list(range(n_shards))
        composed64 = compose(deltas64)
        for r in range(n_shards):
            if r:
                j = order[r - 1]
                t0 = time.perf_counter()
                composed = remove_component(composed, deltas[j], len(live))
                sub_s.append(time.perf_counter() - t0)
                composed64 = remove_component(composed64, deltas64[j], len(live))
                live.remove(j)
                direct = compose([deltas[i] for i in live])
                max_err = max(max_err, max(float((composed[n] - direct[n]).abs().max()) for n in composed))
                model64.set_delta(composed64)
                out_err = max(out_err, forget_output_error(model64, [parts64[i] for i in live], h64, batch_size))
            model.set_delta(composed)
            taft_acc[r].append(accuracy(logits_of(model, h, batch_size), y))
            sisa_acc[r].append(accuracy(ensemble_logits([sisa_parts[i] for i in live]), y))
    curve = {
        "removed": list(range(n_shards)),
        "taft_accuracy": [sum(a) / len(a) for a in taft_acc],
        "sisa_accuracy": [sum(a) / len(a) for a in sisa_acc],
    }
    half = n_shards // 2
    summary = {
        "taft_accuracy_half_removed": curve["taft_accuracy"][half],
        "sisa_accuracy_half_removed": curve["sisa_accuracy"][half],
        "taft_drop_half_removed": curve["taft_accuracy"][0] - curve["taft_accuracy"][half],
        "mean_taft_minus_sisa": sum(a - b for a, b in zip(curve["taft_accuracy"], curve["sisa_accuracy"], strict=True))
        / n_shards,
        "unlearning_max_abs_err": max_err,
        "forget_output_max_abs_err": out_err,
        "subtraction_s": sum(sub_s) / max(len(sub_s), 1),
    }
    return curve, summary


def forget_sample(n_train: int, seed: int) -> int:
    """The training image one forget request of Fig. 1(c) names (drawn from ``seed + 1``)."""
    return random.Random(seed + 1).randrange(n_train)


def forget_set(n_train: int, fraction: float, seed: int) -> set[int]:
    """A random ``fraction`` of the ``n_train`` training images (at least one, drawn from ``seed + 2``)."""
    n_forget = max(1, round(fraction * n_train))
    gen = torch.Generator().manual_seed(seed + 2)
    return set(torch.randperm(n_train, generator=gen)[:n_forget].tolist())


def forget_one_by_retraining(
    new_model: Callable[[], TangentModel],
    deltas: Deltas,
    index: ShardIndex,
    sample: int,
    train_h: Tensor,
    train_y: Tensor,
    test_h: Tensor,
    test_y: Tensor,
    cfg: TangentTrainConfig,
    *,
    batch_size: int = 256,
) -> dict[str, float]:
    """Fig. 1(c), one request: forget training image ``sample`` by retraining its shard without it (seed
    ``cfg.seed + k``, :func:`core.tangent.baselines.forget_by_retraining`) and recomposing, next to the paragon
    (TAFT retrained from scratch on the other n-1 images with ``cfg``); both timed side by side, each from
    building its fresh model to the end of its training.

    Returns both times, their ratio, both test accuracies and the retrained shard's size."""
    deltas = list(deltas)
    t0 = time.perf_counter()
    new_delta, k, _ = forget_by_retraining(new_model, train_h, train_y, index, sample, cfg)
    shard_s = time.perf_counter() - t0
    deltas[k] = new_delta
    model = new_model()
    model.set_delta(compose(deltas))
    shard_acc = accuracy(logits_of(model, test_h, batch_size), test_y)
    n = train_h.shape[0]
    keep = torch.cat([torch.arange(0, sample), torch.arange(sample + 1, n)])
    t0 = time.perf_counter()
    full = new_model()
    train_tangent(full, train_h[keep], train_y[keep], cfg)
    full_s = time.perf_counter() - t0
    full_acc = accuracy(logits_of(full, test_h, batch_size), test_y)
    return {
        "shard_retrain_s": shard_s,
        "full_retrain_s": full_s,
        "full_over_shard_retrain_time": full_s / shard_s,
        "shard_retrain_accuracy": shard_acc,
        "full_retrain_accuracy": full_acc,
        "shard_size": int(index.shards[k].numel()),
    }


def forget_fraction(
    new_model: Callable[[], TangentModel],
    deltas: Deltas,
    index: ShardIndex,
    forget: set[int],
    train_h: Tensor,
    train_y: Tensor,
    test_h: Tensor,
    test_y: Tensor,
    cfg: TangentTrainConfig,
    *,
    batch_size: int = 256,
) -> dict[str, float]:
    """Fig. 1(c), many requests: forget the training images ``forget`` by retraining every shard that held one
    on its remaining images (shard ``k`` with seed ``cfg.seed + k``; a shard forgotten whole is dropped), then
    recompose; test accuracy before and after.

    Returns ``accuracy_before``, ``accuracy_after``, ``accuracy_drop``, ``shards_retrained``, ``retrain_s``
    and ``n_forgotten``. Raises :class:`DataError` when nothing is left to compose."""
    model = new_model()
    model.set_delta(compose(list(deltas)))
    before = accuracy(logits_of(model, test_h, batch_size), test_y)
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
        m = new_model()
        train_tangent(m, train_h[keep], train_y[keep], _seeded(cfg, k))
        live.append(m.get_delta())
    retrain_s = time.perf_counter() - t0
    if not live:
        raise DataError(
            f"forgetting {len(forget)} of {train_h.shape[0]} images emptied every shard; lower forget_fractions"
        )
    model.set_delta(compose(live))
    after = accuracy(logits_of(model, test_h, batch_size), test_y)
    return {
        "accuracy_before": before,
        "accuracy_after": after,
        "accuracy_drop": before - after,
        "shards_retrained": retrained,
        "retrain_s": retrain_s,
        "n_forgotten": len(forget),
    }


# ----------------------------------------------------------------------------------------------- Table 3


@dataclass(frozen=True)
class DPCell:
    """One Table 3 cell: the trained model's test accuracy, its training stats and privacy ledger, and the
    number of trained scalars."""

    test_accuracy: float
    stats: TrainStats
    ledger: PrivacyLedger
    trainable: int


def dp_regime_cell(
    backbone: nn.Module,
    head: nn.Linear,
    h: Tensor,
    y: Tensor,
    test_h: Tensor,
    test_y: Tensor,
    *,
    regime: str,
    tangent: bool,
    cfg: TangentTrainConfig,
    target_epsilon: float,
    clip_norm: float,
    k: int = 1,
    delta: float | None = None,
    accountant: str = "rdp",
    batch_size: int = 256,
    reg_start: str = "zero",
    pretrained: bool = True,
    init_seed: int | None = None,
) -> DPCell:
    """Table 3: DP-SGD fine-tuning (:func:`core.tangent.train.train_dp`, sampling and noise from ``cfg.seed``) of
    ``regime``'s tangent ("Ours", ``tangent=True``) or original ("Reg") parameters of the model
    :func:`~core.tangent.regimes.build_regime_model` builds from ``backbone`` and ``head`` (neither modified),
    trained on ``(h, y)`` at ``target_epsilon`` and evaluated on ``(test_h, test_y)`` (the test set, or a validation
    set when :mod:`core.tangent.dp_search` scores a point); ``reg_start`` is where "Reg" starts
    (:func:`~core.tangent.regimes.build_regime_model`: ``"zero"``, the function "Ours" starts from), ``pretrained``
    App. A's PT (``False``: the last block reset from ``init_seed``, default ``cfg.seed``, before training)."""
    model = build_regime_model(
        backbone,
        head,
        tangent=tangent,
        k=k,
        seed=cfg.seed if init_seed is None else init_seed,
        dtype=h.dtype,
        reg_start=reg_start,
        pretrained=pretrained,
    )
    names = regime_parameter_names(model, regime)
    named = dict(model.named_parameters())
    stats, ledger = train_dp(
        model,
        h,
        y,
        cfg,
        names=names,
        target_epsilon=target_epsilon,
        clip_norm=clip_norm,
        delta=delta,
        accountant=accountant,
    )
    test_acc = accuracy(logits_of(model, test_h, batch_size), test_y)
    return DPCell(test_acc, stats, ledger, sum(named[n].numel() for n in names))
