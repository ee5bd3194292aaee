"""Per-sequence next-item loss for DP-SGD with user-level privacy (one sequence per user, App. E.1)."""

from __future__ import annotations

from typing import Literal, get_args

import torch.nn.functional as F
from torch import Tensor

from core.errors import ConfigError, DataError
from core.models.seqrec import PADDING_ID

Reduction = Literal["none", "sum", "mean"]
PositionReduction = Literal["sum", "mean"]


def sequence_loss(
    logits: Tensor,
    targets: Tensor,
    reduction: Reduction = "none",
    *,
    position_reduction: PositionReduction = "sum",
    ignore_index: int = PADDING_ID,
) -> Tensor:
    """Cross-entropy of each sequence over its non-padding positions.

    ``loss_i = sum_t [y_it != pad] CE(logits_it, y_it)`` (``position_reduction="sum"``, the default:
    every target position contributes, which is the natural unit for user-level DP where the
    per-sequence gradient is clipped as a whole), or the mean over the valid positions
    (``"mean"``; a sequence without valid position then has loss 0).

    Args:
        logits: (B, L, V) scores, V = num_items + 1.
        targets: (B, L) next-item ids, ``ignore_index`` (0) at padding positions.
        reduction: over the batch: "none" -> (B,), "sum" / "mean" -> scalar.
    Returns:
        (B,) per-sequence losses (the input of a clipper's ``backward``), or their sum / mean.
    """
    if reduction not in get_args(Reduction):
        raise ConfigError(f"unknown reduction={reduction!r}; known: {', '.join(get_args(Reduction))}")
    if position_reduction not in get_args(PositionReduction):
        raise ConfigError(
            f"unknown position_reduction={position_reduction!r}; known: {', '.join(get_args(PositionReduction))}"
        )
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise DataError(
            f"need logits (B, L, V) and targets (B, L), got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    B, L, V = logits.shape
    token_loss = F.cross_entropy(
        logits.reshape(B * L, V), targets.reshape(B * L), ignore_index=ignore_index, reduction="none"
    ).view(B, L)  # (B, L), 0 at ignored positions
    per_sequence = token_loss.sum(dim=1)  # (B,)
    if position_reduction == "mean":
        n_valid = (targets != ignore_index).sum(dim=1).clamp(min=1)  # (B,)
        per_sequence = per_sequence / n_valid
    if reduction == "sum":
        return per_sequence.sum()
    if reduction == "mean":
        return per_sequence.mean()
    return per_sequence
