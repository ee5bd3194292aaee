"""One forgetting request served three ways, with what each costs to forget and to serve afterwards (Sec. 3.3,
Sec. 4.4, Fig. 1).

The paper's claims: a tangent model composed from N shard models forgets a shard exactly by subtracting its
weights (no training), or, to keep its accuracy, subtracts the shard and retrains it on its remaining examples
(only a shard, not the whole set: "up to 50x faster" than full retraining); the composed model answers a query
with ONE (linearised, JVP) forward whatever N is (eq. 13), where SISA's output ensemble costs N forwards. So a
request to forget the examples ``request.examples``, held by the shards ``request.shards``, is served by

* TAFT (:func:`forget_taft`): ``dw' = (N dw_bar - dw_k) / (N - 1)`` per affected shard k, then (``retrain``)
  shard k trained afresh on its remaining examples and added back, ``(M dw' + dw_k') / (M + 1)``;
* SISA (:func:`forget_sisa`): each affected shard's non-linear model retrained on its remaining examples
  (``retrain``) or dropped from the ensemble;
* full retraining (:func:`full_retrain`): the paragon, one model trained afresh on every remaining example.

Each returns its :class:`ForgetCost` (wall seconds, optimizer steps and per-example gradients actually executed);
:func:`measure_inference` then counts the forward passes a test batch costs (:class:`ForwardCounter`) and times
them. All three start from the same place: shard ``k`` trains with seed ``cfg.seed + k`` (as the shards were
first trained), full retraining with ``cfg.seed``, and every method with the epochs of its ``cfg``, so each
remaining example gets the same budget (``cfg.epochs`` passes) under every method.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.baselines import train_nonlinear
from core.tangent.compose import Delta, add_component, compose, ensemble_logits, remove_component
from core.tangent.model import TangentModel
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, TrainStats, train_tangent

__all__ = [
    "ForgetCost",
    "ForgetRequest",
    "ForwardCounter",
    "InferenceCost",
    "forget_request",
    "forget_sisa",
    "forget_taft",
    "full_retrain",
    "measure_inference",
    "remaining",
]


@dataclass(frozen=True)
class ForgetRequest:
    """Training indices to forget (``examples``, sorted) and the shards that hold them (``shards``, sorted)."""

    examples: tuple[int, ...]
    shards: tuple[int, ...]


@dataclass(frozen=True)
class ForgetCost:
    """What serving a request executed: wall ``seconds`` (from the first subtraction or fresh model to the
    forgotten model), optimizer ``steps``, ``sample_gradients`` (per-example gradients: examples x epochs of every
    model trained), the number of models trained (``models_trained``) and this process's CPU seconds meanwhile
    (``cpu_seconds``: less sensitive than wall seconds to other work on a shared machine)."""

    seconds: float
    steps: int
    sample_gradients: int
    models_trained: int
    cpu_seconds: float = 0.0


@dataclass(frozen=True)
class InferenceCost:
    """Cost of answering the test set: ``forwards`` per batch (counted calls of the models' forwards),
    ``seconds_per_batch`` (median over the timed passes), the number of ``batches``, and, when a reference model
    was timed alongside, ``over_reference``: the median over the passes of this pass's time over the reference's
    pass just before it (NaN without one)."""

    forwards: float
    seconds_per_batch: float
    batches: int
    over_reference: float = math.nan


def _check_count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {name}={value!r}")
    return value


def forget_request(index: ShardIndex, n_examples: int, n_shards: int, seed: int) -> ForgetRequest:
    """``n_examples`` training images spread over exactly ``n_shards`` shards: the shards drawn from ``seed + 3``,
    then the examples dealt to them in turn (each shard's drawn uniformly without replacement), so every chosen
    shard loses at least one. Deterministic in ``(index, n_examples, n_shards, seed)``."""
    n_examples = _check_count("n_examples", n_examples, 1)
    n_shards = _check_count("n_shards", n_shards, 1)
    if n_shards > index.n_shards or n_shards > n_examples:
        raise ConfigError(
            f"a request of {n_examples} examples cannot fall in {n_shards} of {index.n_shards} shards; "
            f"use 1 <= request shards <= min(examples, shards) = {min(n_examples, index.n_shards)}"
        )
    gen = torch.Generator().manual_seed(seed + 3)
    shards = sorted(torch.randperm(index.n_shards, generator=gen)[:n_shards].tolist())
    quota = [n_examples // n_shards + (1 if j < n_examples % n_shards else 0) for j in range(n_shards)]
    examples: list[int] = []
    for k, q in zip(shards, quota, strict=True):
        members = index.shards[k]
        if q > members.numel():
            raise DataError(
                f"shard {k} holds {members.numel()} examples, fewer than the {q} the request forgets from it; "
                "forget fewer examples or spread them over more shards"
            )
        examples += members[torch.randperm(members.numel(), generator=gen)[:q]].tolist()
    return ForgetRequest(tuple(sorted(examples)), tuple(shards))


def remaining(index: ShardIndex, request: ForgetRequest) -> dict[int, Tensor]:
    """Each affected shard's examples without the forgotten ones, ``{k: (n_k - m_k,) int64}`` (empty when the
    request forgets the whole shard); a forgotten example outside the training set raises :class:`DataError`."""
    owners = {index.shard_of(i) for i in request.examples}
    if owners != set(request.shards):
        raise DataError(
            f"the request's shards {sorted(request.shards)} are not the ones holding its examples ({sorted(owners)}); "
            "build it with forget_request"
        )
    forget = torch.tensor(request.examples, dtype=torch.long)
    return {k: index.shards[k][~torch.isin(index.shards[k], forget)] for k in request.shards}


def _seeded(cfg: TangentTrainConfig, k: int) -> TangentTrainConfig:
    """Shard ``k``'s config: seed ``cfg.seed + k``, the seed it was first trained with."""
    return replace(cfg, seed=cfg.seed + k)


def _add(a: ForgetCost, stats: TrainStats, n: int, cfg: TangentTrainConfig) -> ForgetCost:
    return replace(
        a,
        steps=a.steps + stats.steps,
        sample_gradients=a.sample_gradients + n * cfg.epochs,
        models_trained=a.models_trained + 1,
    )


def forget_taft(
    new_model: Callable[[], TangentModel],
    deltas: Sequence[Delta],
    index: ShardIndex,
    request: ForgetRequest,
    train_h: Tensor,
    train_y: Tensor,
    cfg: TangentTrainConfig,
    *,
    retrain: bool = True,
) -> tuple[Delta, list[Delta], ForgetCost]:
    """TAFT: subtract each affected shard's delta from the composed (uniform average) delta; with ``retrain``,
    train that shard afresh (``new_model()``, seed ``cfg.seed + k``) on its remaining examples and add it back
    (a shard forgotten whole stays out). Only the remaining examples are read.

    Returns ``(composed delta, components, cost)``: ``components`` are the deltas left in the composition (the
    unaffected shards' and the retrained ones, shard order) and the composed delta equals ``compose(components)``
    up to float rounding: the composition of shard models none of which saw a forgotten example. The composition
    before the request is the deployed model, not timed."""
    if len(deltas) != index.n_shards:
        raise ConfigError(f"got {len(deltas)} deltas for {index.n_shards} shards; pass one delta per shard")
    if len(request.shards) == index.n_shards and not retrain:
        raise DataError(f"forgetting by subtraction alone would remove every one of the {index.n_shards} shards")
    rest = remaining(index, request)
    components: list[Delta | None] = list(deltas)
    composed, live = compose(list(deltas)), len(deltas)
    cost = ForgetCost(0.0, 0, 0, 0)
    t0, c0 = time.perf_counter(), time.process_time()
    for k in request.shards:
        if live > 1:  # subtracting the last component leaves the pre-trained model; a retrained one replaces it
            composed = remove_component(composed, deltas[k], live)
        components[k], live = None, live - 1
    for k in request.shards:
        keep = rest[k]
        if not retrain or keep.numel() == 0:
            continue
        model = new_model()
        stats = train_tangent(model, train_h[keep], train_y[keep], _seeded(cfg, k))
        cost = _add(cost, stats, int(keep.numel()), cfg)
        components[k] = model.get_delta()
        composed = add_component(composed, components[k], live) if live else components[k]
        live += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if not live:
        raise DataError(f"forgetting {len(request.examples)} examples emptied every one of the {len(deltas)} shards")
    return composed, [d for d in components if d is not None], replace(cost, seconds=seconds, cpu_seconds=cpu)


def forget_sisa(
    backbone: nn.Module,
    head: nn.Linear,
    members: Sequence[nn.Module],
    index: ShardIndex,
    request: ForgetRequest,
    train_h: Tensor,
    train_y: Tensor,
    cfg: TangentTrainConfig,
    *,
    k: int = 1,
    retrain: bool = True,
) -> tuple[list[nn.Module], ForgetCost]:
    """SISA (Bourtoule et al.): with ``retrain``, each affected shard's non-linear model (NLFT-``k`` from
    ``backbone`` and ``head``, seed ``cfg.seed + shard``) is retrained on its remaining examples; without, or when
    the request forgets the whole shard, it is dropped from the ensemble. Returns the ensemble's members (shard
    order) and the cost; ``members`` is not modified."""
    if len(members) != index.n_shards:
        raise ConfigError(f"got {len(members)} shard models for {index.n_shards} shards; pass one per shard")
    rest = remaining(index, request)
    out: list[nn.Module | None] = list(members)
    cost = ForgetCost(0.0, 0, 0, 0)
    t0, c0 = time.perf_counter(), time.process_time()
    for j in request.shards:
        out[j] = None
        keep = rest[j]
        if not retrain or keep.numel() == 0:
            continue
        model, stats = train_nonlinear(backbone, head, train_h[keep], train_y[keep], _seeded(cfg, j), k=k)
        cost = _add(cost, stats, int(keep.numel()), cfg)
        out[j] = model
    cost = replace(cost, seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)
    live = [m for m in out if m is not None]
    if not live:
        raise DataError(f"forgetting {len(request.examples)} examples dropped every one of the {len(out)} shards")
    return live, cost


def full_retrain(
    new_model: Callable[[], TangentModel],
    train_h: Tensor,
    train_y: Tensor,
    request: ForgetRequest,
    cfg: TangentTrainConfig,
) -> tuple[TangentModel, ForgetCost]:
    """The paragon: a fresh ``new_model()`` trained with ``cfg`` on every training example but the forgotten."""
    n = train_h.shape[0]
    bad = [i for i in request.examples if not 0 <= i < n]
    if bad:
        raise DataError(f"forget request names examples {bad} outside the {n} training images")
    keep = torch.ones(n, dtype=torch.bool)
    keep[list(request.examples)] = False
    idx = keep.nonzero().squeeze(1)
    if idx.numel() == 0:
        raise DataError(f"forgetting all {n} training images leaves nothing to retrain on")
    t0, c0 = time.perf_counter(), time.process_time()
    model = new_model()
    stats = train_tangent(model, train_h[idx], train_y[idx], cfg)
    cost = _add(ForgetCost(0.0, 0, 0, 0), stats, int(idx.numel()), cfg)
    return model, replace(cost, seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0)


class ForwardCounter(nn.Module):
    """``model`` with its ``forward_from_cache`` calls counted (``calls``), to count what inference runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not hasattr(model, "forward_from_cache"):
            raise ConfigError(f"{type(model).__name__} has no forward_from_cache; pass a TangentModel or suffix")
        self.model = model
        self.calls = 0

    def forward_from_cache(self, h: Tensor) -> Tensor:
        self.calls += 1
        return self.model.forward_from_cache(h)


@torch.no_grad()
def measure_inference(
    members: Sequence[nn.Module],
    h: Tensor,
    *,
    batch_size: int = 256,
    repeats: int = 3,
    reference: nn.Module | None = None,
) -> tuple[Tensor, InferenceCost]:
    """Answer ``h: (n, N, D)`` batch by batch with the uniform output ensemble of ``members`` (one member: that
    model alone; a composed tangent model is one member), ``repeats`` times. With ``reference`` (e.g. one plain
    forward of the pretrained model), each pass is preceded by a pass of the reference over the same batches, so
    that the ratio of the two is measured under the same machine load. Returns the logits ``(n, C)`` and the
    :class:`InferenceCost`: counted forwards per batch, median seconds per batch, median ratio to the reference."""
    if not members:
        raise ConfigError("measure_inference needs at least one model, got 0")
    repeats = _check_count("repeats", repeats, 1)
    counters = [ForwardCounter(m.eval()) for m in members]
    starts = range(0, h.shape[0], batch_size)

    def one_pass(models: Sequence[nn.Module]) -> tuple[Tensor, float]:
        t0 = time.perf_counter()
        out = torch.cat(
            [ensemble_logits([m.forward_from_cache(h[i : i + batch_size]) for m in models]) for i in starts]
        )
        return out, (time.perf_counter() - t0) / len(starts)

    seconds: list[float] = []
    ratios: list[float] = []
    logits = torch.empty(0)
    for _ in range(repeats):
        ref_s = one_pass([reference.eval()])[1] if reference is not None else math.nan
        logits, sec = one_pass(counters)
        seconds.append(sec)
        ratios.append(sec / ref_s)
    calls = sum(c.calls for c in counters)
    return logits, InferenceCost(
        calls / (repeats * len(starts)), statistics.median(seconds), len(starts), statistics.median(ratios)
    )
