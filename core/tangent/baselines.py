"""Sharded TAFT (composition, forgetting; Sec. 3.2-3.3) and the paper's non-linear baselines.

Sharding: one delta ``dw_k`` per disjoint shard (:func:`train_shards`), composed by averaging,
``f_lin(x; mean_k dw_k) = mean_k f_lin(x; dw_k)`` (eq. 13, O(1) inference,
:func:`composed_accuracy`). A sample is forgotten either by subtracting its shard's component
(:func:`forget_by_subtraction`, free) or by retraining its shard without it
(:func:`forget_by_retraining`).

Baselines (Tables 1-2, Fig. 1): NLFT-k, FC, SISA and Model Soup.

* NLFT-k: fine-tune the last ``k`` blocks, the final LayerNorm and the head of the original
  (non-linear) network with cross-entropy. The first ``L - k`` blocks are frozen, so training reads
  the same cached activations ``h = prefix(x)`` as TAFT (``TangentModel.cache_frozen``).
* FC: train only the linear classifier on cached CLS features ``z = LN(f(x))[:, 0]`` (linear probe).
* SISA (Bourtoule et al.): one non-linear model per shard, outputs averaged,
  ``f(x) = 1/N sum_k f(x; w_k)`` -- O(N) inference.
* Model Soup (Wortsman et al.): weight average ``w = 1/N sum_k w_k`` -- O(1) inference, but no
  guarantee on the outputs (unlike eq. 13 for tangent models).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.compose import Delta, compose, ensemble_logits, remove_component
from core.tangent.model import TangentModel, reinit_block_
from core.tangent.shards import ShardIndex
from core.tangent.train import TangentTrainConfig, TrainStats, check_data, evaluate, fit, train_tangent

__all__ = [
    "NonlinearSuffix",
    "composed_accuracy",
    "forget_by_retraining",
    "forget_by_subtraction",
    "frozen_copy",
    "model_soup",
    "sisa_logits",
    "train_fc",
    "train_nonlinear",
    "train_nonlinear_shards",
    "train_shards",
]


# ------------------------------------------------------------------------------ sharded TAFT
def _shard_cfg(cfg: TangentTrainConfig, k: int) -> TangentTrainConfig:
    """Per-shard config: seed ``cfg.seed + k`` (the retraining of shard k reuses it)."""
    return replace(cfg, seed=cfg.seed + k)


def _fresh(make_model: Callable[[], TangentModel]) -> TangentModel:
    model = make_model()
    if not isinstance(model, TangentModel):
        raise ConfigError(f"make_model() must return a TangentModel, got {type(model).__name__}")
    return model


def train_shards(
    make_model: Callable[[], TangentModel],
    cached: Tensor,
    labels: Tensor,
    shard_index: ShardIndex,
    cfg: TangentTrainConfig,
) -> list[dict[str, Tensor]]:
    """Train one delta per shard, sequentially (the flow parallelises): shard ``k`` trains a fresh
    ``make_model()`` on ``cached[shards[k]]`` with seed ``cfg.seed + k``.

    ``make_model`` must linearise the *same* backbone weights ``w`` each time (e.g. share one
    backbone), otherwise the deltas do not compose (eq. 13 holds for one linearisation point).
    Returns the ``n_shards`` delta dicts in shard order.
    """
    if not isinstance(shard_index, ShardIndex):
        raise ConfigError(f"shard_index must be a ShardIndex, got {type(shard_index).__name__}")
    check_data(cached, labels)
    n = cached.shape[0]
    deltas = []
    for k, shard in enumerate(shard_index.shards):
        if int(shard.max()) >= n:
            raise DataError(f"shard {k} holds sample {int(shard.max())} but cached has only n={n} samples")
        model = _fresh(make_model)
        train_tangent(model, cached[shard], labels[shard], _shard_cfg(cfg, k))
        deltas.append(model.get_delta())
    return deltas


@torch.no_grad()
def composed_accuracy(
    model: TangentModel,
    deltas: Sequence[Delta],
    cached: Tensor,
    labels: Tensor,
    weights: Sequence[float] | Tensor | None = None,
) -> float:
    """Accuracy of the composed model ``f_lin(x; sum_k lambda_k dw_k)`` (eq. 13; uniform by default).

    One forward per example regardless of the number of shards (O(1) inference). ``model``'s own
    delta is restored afterwards.
    """
    saved = model.get_delta()
    try:
        model.set_delta(compose(list(deltas), weights))
        return evaluate(model, cached, labels)
    finally:
        model.set_delta(saved)


def forget_by_subtraction(
    composed: Delta, deltas: Sequence[Delta | None], shard_index: ShardIndex, sample: int
) -> tuple[Delta, int]:
    """Forget ``sample`` for free (Sec. 3.3): drop its shard's component from the uniform average,

        ``dw' = (N dw_bar - dw_k) / (N - 1)``,   ``N`` = number of components still in ``composed``.

    Args:
        composed: the uniform average of the non-``None`` entries of ``deltas``.
        deltas: per-shard deltas; already removed shards are ``None``.
        shard_index: the shard split (unknown samples raise :class:`DataError` from it).
        sample: training index to forget.
    Returns:
        ``(new composed delta, k)``; the caller sets ``deltas[k] = None``.
    """
    k = shard_index.shard_of(sample)
    if len(deltas) != shard_index.n_shards:
        raise ConfigError(f"got {len(deltas)} deltas for {shard_index.n_shards} shards")
    if deltas[k] is None:
        raise DataError(f"shard {k} holding sample {sample} was already removed; nothing to forget")
    n_live = sum(d is not None for d in deltas)
    return remove_component(composed, deltas[k], n_live), k


def forget_by_retraining(
    make_model: Callable[[], TangentModel],
    cached: Tensor,
    labels: Tensor,
    shard_index: ShardIndex,
    sample: int,
    cfg: TangentTrainConfig,
) -> tuple[dict[str, Tensor], int, Tensor]:
    """Forget ``sample`` by retraining its shard ``k`` from scratch without it (Sec. 3.3, Fig. 1(c)).

    Only ``cached[shard_k \\ {sample}]`` is read, with the seed of :func:`train_shards`, so the result
    does not depend on the forgotten sample's content. Returns ``(new delta of shard k, k,
    remaining indices)``; recompose with ``compose`` after replacing ``deltas[k]``. A shard that held
    only ``sample`` becomes empty: :class:`DataError` (drop it with :func:`forget_by_subtraction`).
    """
    k = shard_index.shard_of(sample)
    rest = shard_index.without(sample)
    if rest.numel() == 0:
        raise DataError(f"shard {k} is empty after forgetting sample {sample}; remove it with forget_by_subtraction")
    model = _fresh(make_model)
    train_tangent(model, cached[rest], labels[rest], _shard_cfg(cfg, k))
    return model.get_delta(), k, rest


# ------------------------------------------------------------------------------ baselines
def frozen_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters are buffers: it moves with ``.to()`` and is saved with the state dict,
    but no optimiser, regime or ``functional_call`` over ``named_parameters()`` sees it."""
    out = copy.deepcopy(module)
    for sub in out.modules():
        for name, p in list(sub._parameters.items()):
            del sub._parameters[name]
            if p is not None:
                sub.register_buffer(name, p.detach().clone())
    return out.eval()


class NonlinearSuffix(nn.Module):
    """The last ``k`` HF blocks (copied, trainable), the final LayerNorm and a linear head on CLS:
    ``logits = head(LN(blocks(h))[:, 0])`` for cached prefix activations ``h: (B, N, D)``.

    ``centered=True`` predicts ``f(h; w) - f(h; w_0)``, the suffix's change from its weights at construction
    (held as buffers in ``initial``): it starts from the zero function, as a tangent model that predicts with its
    JVP only does (App. A), so that the two kinds of fine-tuning compared in Table 3 start from the same function.
    Its trainable parameters and their gradients are the uncentered suffix's (``f(h; w_0)`` is a constant).

    ``reinit_last_block=True`` re-initialises the copied last block (PT=F, Sec. 3.5) by
    :func:`~core.tangent.model.reinit_block_` with ``seed``, the same weights a ``TangentModel(...,
    reinit_last_block=True, seed=seed)`` linearises around; the backbone is not modified."""

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Linear,
        k: int = 1,
        *,
        centered: bool = False,
        reinit_last_block: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        kind = type(backbone).__name__
        if kind == "Dinov2Model":
            layers = backbone.encoder.layer
        elif kind == "ViTModel":
            layers = backbone.layers if hasattr(backbone, "layers") else backbone.encoder.layer
        else:
            raise ConfigError(f"unsupported backbone {kind}; supported: Dinov2Model, ViTModel")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(layers):
            raise ConfigError(f"k must be an int in [1, {len(layers)}], got k={k!r}")
        if not isinstance(head, nn.Linear) or head.in_features != backbone.config.hidden_size:
            raise ConfigError(f"head must be nn.Linear({backbone.config.hidden_size}, C), got {head!r}")
        self.k = k
        self.blocks = copy.deepcopy(nn.ModuleList(layers[len(layers) - k :]))
        if reinit_last_block:
            reinit_block_(self.blocks[-1], seed=seed)
        self.layernorm = copy.deepcopy(backbone.layernorm)
        self.head = copy.deepcopy(head)
        for p in self.parameters():
            p.requires_grad_(True)
        self.centered = bool(centered)
        self.initial = (
            frozen_copy(nn.ModuleDict({"blocks": self.blocks, "layernorm": self.layernorm, "head": self.head}))
            if centered
            else None
        )

    @staticmethod
    def _suffix(blocks: nn.ModuleList, layernorm: nn.Module, head: nn.Module, h: Tensor) -> Tensor:
        for blk in blocks:
            out = blk(h)
            h = out[0] if isinstance(out, tuple) else out
        return head(layernorm(h)[:, 0])

    def forward_from_cache(self, h: Tensor) -> Tensor:
        """``(B, N, D) -> (B, C)``."""
        logits = self._suffix(self.blocks, self.layernorm, self.head, h)
        if self.initial is None:
            return logits
        with torch.no_grad():
            offset = self._suffix(self.initial["blocks"], self.initial["layernorm"], self.initial["head"], h)
        return logits - offset

    def forward(self, h: Tensor) -> Tensor:
        return self.forward_from_cache(h)


def _distance_penalty(model: nn.Module) -> Callable[[], Tensor]:
    """``||w - w_0||^2`` from the weights at the start of training (ridge around the initial point)."""
    init = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: torch.stack([(p - q).pow(2).sum() for p, q in zip(params, init, strict=True)]).sum()


def train_nonlinear(
    backbone: nn.Module,
    head: nn.Linear,
    cached: Tensor,
    labels: Tensor,
    cfg: TangentTrainConfig,
    *,
    k: int = 1,
) -> tuple[NonlinearSuffix, TrainStats]:
    """NLFT-k: fine-tune a copy of the last ``k`` blocks, final LN and ``head`` non-linearly.

    ``cached`` must be the frozen-prefix activations of the first ``L - k`` blocks, ``(n, N, D)``
    (e.g. ``TangentModel(backbone, C, k).cache_frozen(x)``); use ``cfg.loss="ce"`` as the paper.
    ``ridge`` penalises ``||w - w_0||^2``; ``backbone`` and ``head`` are not modified.
    """
    check_data(cached, labels)
    model = NonlinearSuffix(backbone, head, k).to(cached.dtype)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    stats = fit(model.forward_from_cache, params, cached, labels, cfg, penalty=_distance_penalty(model))
    model.eval()
    return model, stats


def train_fc(
    head: nn.Linear, features: Tensor, labels: Tensor, cfg: TangentTrainConfig
) -> tuple[nn.Linear, TrainStats]:
    """FC baseline: train a copy of the linear classifier on cached CLS features ``(n, D)``
    (``backbone(x).last_hidden_state[:, 0]``). ``ridge`` penalises ``||W - W_0||^2``."""
    if not isinstance(features, Tensor) or features.dim() != 2:
        desc = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
        raise DataError(f"train_fc needs CLS features of shape (n, D), got {desc}")
    check_data(features, labels, "features")
    fc = copy.deepcopy(head).to(features.dtype)
    for p in fc.parameters():
        p.requires_grad_(True)
    stats = fit(fc, list(fc.parameters()), features, labels, cfg, penalty=_distance_penalty(fc))
    return fc, stats


def train_nonlinear_shards(
    backbone: nn.Module,
    head: nn.Linear,
    cached: Tensor,
    labels: Tensor,
    shard_index: ShardIndex,
    cfg: TangentTrainConfig,
    *,
    k: int = 1,
) -> list[NonlinearSuffix]:
    """One NLFT-k model per shard (seed ``cfg.seed + shard``), all from the same initial weights."""
    if not isinstance(shard_index, ShardIndex):
        raise ConfigError(f"shard_index must be a ShardIndex, got {type(shard_index).__name__}")
    check_data(cached, labels)
    models = []
    for j, shard in enumerate(shard_index.shards):
        if int(shard.max()) >= cached.shape[0]:
            raise DataError(f"shard {j} holds sample {int(shard.max())} but cached has n={cached.shape[0]}")
        m, _ = train_nonlinear(backbone, head, cached[shard], labels[shard], _shard_cfg(cfg, j), k=k)
        models.append(m)
    return models


@torch.no_grad()
def sisa_logits(models: Sequence[NonlinearSuffix], cached: Tensor) -> Tensor:
    """SISA output ensemble ``1/N sum_k f(h; w_k)``: ``(B, N, D) -> (B, C)``, N forwards per input."""
    if not models:
        raise ConfigError("sisa_logits needs at least one shard model, got 0 (all shards removed?)")
    return ensemble_logits([m.forward_from_cache(cached) for m in models])


@torch.no_grad()
def model_soup(models: Sequence[NonlinearSuffix]) -> NonlinearSuffix:
    """Uniform Model Soup: a copy of ``models[0]`` with every parameter/buffer averaged over models."""
    if not models:
        raise ConfigError("model_soup needs at least one model, got 0")
    soup = copy.deepcopy(models[0])
    states = [m.state_dict() for m in models]
    avg = {}
    for name, t in states[0].items():
        if t.is_floating_point():
            avg[name] = torch.stack([s[name] for s in states]).mean(dim=0)
        else:
            avg[name] = t.clone()
    soup.load_state_dict(avg)
    return soup
