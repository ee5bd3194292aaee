"""Training objective of TAFT: Rescaled Square Loss (eq. 2), ridge penalty, and the App. B PGD projection.

The tangent model ``f_lin(x) = f_w(x) + J_w(x) dw`` is linear in ``dw``, so the Rescaled Square
Loss (RSL, Hui & Belkin 2020, the paper's ref. [22]) plus the ridge penalty ``||dw||_2^2`` is a convex
(ridge-regression) objective (Sect. 3, text after eq. 2). App. B replaces the soft penalty by a hard
constraint: projected gradient descent onto the ball ``{dw : ||dw||_2 <= R}``.

Hyperparameter defaults (from the paper):

* ``kappa = 15``: App. A, "we train with the RSL loss using kappa=15" for Tables 1-2 and Fig. 1.
  App. B (Table 7, PGD) uses ``kappa = 5`` instead (:data:`RSL_KAPPA_PGD`).
* ``alpha = 1``: the paper does **not** report the alpha it used; ``alpha = 1`` makes eq. 2 an
  ordinary square loss against the target ``kappa * onehot(y)`` and is the neutral choice. Set it
  explicitly when reproducing a configuration that states one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from core.errors import ConfigError, DataError

__all__ = [
    "RSL_ALPHA",
    "RSL_KAPPA",
    "RSL_KAPPA_PGD",
    "Reduction",
    "RescaledSquareLoss",
    "global_norm",
    "l2_penalty",
    "project_to_ball_",
    "rescaled_square_loss",
]

RSL_ALPHA: float = 1.0
"""Default alpha of eq. 2 (not reported in the paper; 1 = plain square loss to target ``kappa * e_y``)."""
RSL_KAPPA: float = 15.0
"""Default kappa of eq. 2 (App. A: the main experiments use kappa = 15)."""
RSL_KAPPA_PGD: float = 5.0
"""kappa used with projected gradient descent in App. B (Table 7)."""

Reduction = Literal["none", "mean"]

ParamsLike = Tensor | Iterable[Tensor] | Mapping[str, Tensor]


def _check_hyper(alpha: float, kappa: float) -> None:
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"RSL alpha must be a finite number > 0, got alpha={alpha!r}; the paper's default is 1.0")
    if not (isinstance(kappa, int | float) and math.isfinite(kappa)):
        raise ConfigError(f"RSL kappa must be a finite number, got kappa={kappa!r}; the paper uses 15 (App. A)")


def rescaled_square_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    alpha: float = RSL_ALPHA,
    kappa: float = RSL_KAPPA,
    reduction: Reduction = "mean",
) -> Tensor:
    """Rescaled Square Loss, eq. 2.

    ``L(x, y) = 1/K * ( alpha * (f_y - kappa)^2 + sum_{i != y} f_i^2 )`` with ``f = f_lin(x)`` the
    K class scores of one sample.

    Args:
        logits: (B, K) floating scores ``f_lin(x)``.
        labels: (B,) integer class indices in ``[0, K)``.
        alpha: weight of the true-class term (> 0).
        kappa: target value of the true-class score.
        reduction: ``"none"`` -> (B,) per-sample losses; ``"mean"`` -> scalar mean over the batch.
    Returns:
        (B,) or () tensor in the dtype of ``logits``; differentiable w.r.t. ``logits``.
    """
    _check_hyper(alpha, kappa)
    if reduction not in get_args(Reduction):
        raise ConfigError(f"unknown reduction={reduction!r}; known: {', '.join(get_args(Reduction))}")
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise DataError(f"logits must be a floating (B, K) tensor, got {shape}; reshape to (batch, classes)")
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise DataError(f"labels must be a (B,) tensor with B={logits.shape[0]} matching logits, got {shape}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise DataError(f"labels must be integer class indices, got dtype {labels.dtype}; pass a LongTensor")
    B, K = logits.shape
    if B == 0:
        raise DataError("logits has an empty batch (B=0); pass at least one sample")
    labels = labels.long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= K):
        raise DataError(
            f"labels must lie in [0, {K}) for K={K} classes, got range "
            f"[{int(labels.min())}, {int(labels.max())}]; remap the labels"
        )
    onehot = torch.nn.functional.one_hot(labels, K).to(logits.dtype)  # (B, K)
    target = kappa * onehot  # (B, K): kappa at y, 0 elsewhere
    weight = 1.0 + (alpha - 1.0) * onehot  # (B, K): alpha at y, 1 elsewhere
    per_sample = (weight * (logits - target) ** 2).sum(dim=1) / K  # (B,)
    if reduction == "mean":
        return per_sample.mean()
    return per_sample


@dataclass(frozen=True)
class RescaledSquareLoss:
    """Callable eq. 2 with fixed hyperparameters (validated at construction).

    ``RescaledSquareLoss(kappa=5.0)(logits (B, K), labels (B,)) -> ()``.
    """

    alpha: float = RSL_ALPHA
    kappa: float = RSL_KAPPA
    reduction: Reduction = "mean"

    def __post_init__(self) -> None:
        _check_hyper(self.alpha, self.kappa)
        if self.reduction not in get_args(Reduction):
            raise ConfigError(f"unknown reduction={self.reduction!r}; known: {', '.join(get_args(Reduction))}")

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        return rescaled_square_loss(logits, labels, alpha=self.alpha, kappa=self.kappa, reduction=self.reduction)


def _as_list(params: ParamsLike, what: str) -> list[Tensor]:
    if isinstance(params, Tensor):
        items = [params]
    elif isinstance(params, Mapping):
        items = list(params.values())
    else:
        items = list(params)
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            raise DataError(f"{what}: item {i} is a {type(p).__name__}, not a tensor; pass tensors/parameters")
        if not p.is_floating_point():
            raise DataError(f"{what}: item {i} has dtype {p.dtype}; parameters must be floating point")
    return items


def l2_penalty(params: ParamsLike) -> Tensor:
    """Ridge penalty ``||dw||_2^2 = sum_p sum(p^2)`` over all tensors (Sect. 3, after eq. 2).

    Args:
        params: one tensor, an iterable of tensors (e.g. ``model.parameters()``) or a name->tensor dict;
            any shapes. Pass the *deltas* ``dw`` (not ``w + dw``) to regularize the distance moved.
    Returns:
        () differentiable scalar; ``0.0`` for an empty collection.
    """
    items = _as_list(params, "l2_penalty")
    if not items:
        return torch.zeros(())
    return torch.stack([p.pow(2).sum() for p in items]).sum()


def global_norm(params: ParamsLike) -> Tensor:
    """Joint L2 norm ``sqrt(sum_p ||p||^2)`` of all tensors, computed without gradient; () scalar."""
    with torch.no_grad():
        return l2_penalty(_as_list(params, "global_norm")).sqrt()


@torch.no_grad()
def project_to_ball_(params: ParamsLike, radius: float) -> float:
    """In-place Euclidean projection onto ``{dw : ||dw||_2 <= R}`` (App. B, PGD step).

    The norm is taken jointly over all tensors (the whole ``dw`` vector); when it exceeds ``R`` every
    tensor is scaled by ``R / ||dw||``, else nothing changes. Call after each optimizer step.

    Args:
        params: tensor / iterable / dict of the delta tensors (any shapes); modified in place.
        radius: R > 0 (App. B, Table 7 uses R = 1 and R = 10).
    Returns:
        the norm before projection (a Python float).
    """
    if not (isinstance(radius, int | float) and math.isfinite(radius) and radius > 0):
        raise ConfigError(f"projection radius must be a finite number > 0, got radius={radius!r}; App. B uses 1 or 10")
    items = _as_list(params, "project_to_ball_")
    if not items:
        return 0.0
    norm = float(torch.stack([p.double().pow(2).sum() for p in items]).sum().sqrt())
    if norm > radius:
        scale = radius / norm
        for p in items:
            p.mul_(scale)
    return norm
