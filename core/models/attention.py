"""Causal multi-head self-attention built from plain ``nn.Linear`` layers.

The attention is written out by hand (no ``nn.MultiheadAttention``) so that every trainable
parameter lives in an ``nn.Linear``: the per-sample gradient-norm machinery of
:mod:`core.dp.phantom` and of Opacus only has to understand Linear / LayerNorm / Embedding.

The module exposes one extension point, :attr:`CausalSelfAttention.score_correction`: a callable
applied to the scaled pre-softmax logits ``q k^T / sqrt(head_dim)`` of shape (B, H, L, L), before
the causal / padding mask. The Re-Attention mechanism of DPFormer (Sec. 5.2: ``S_i <- S_i /
exp(C sigma_i^2 / 2)``, i.e. subtracting ``C sigma_i^2 / 2`` from the logit of key ``i``) plugs in
here. ``None`` (the default) is standard scaled dot-product attention (Vaswani et al., 2017).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import ConfigError, DataError

ScoreCorrection = Callable[[Tensor], Tensor]
"""Maps pre-softmax attention logits (B, H, L, L) to corrected logits of the same shape."""


def attention_mask(key_valid: Tensor) -> Tensor:
    """Boolean mask (B, 1, L, L) of the key positions each query may attend to.

    Query ``i`` sees key ``j`` iff ``j <= i`` (causal) and ``j`` is a real item. A query always sees
    itself, so that a padding query (which has no valid key under left padding) gets a
    well-defined softmax instead of NaN; its output is never used by a real position.

    Args:
        key_valid: (B, L) bool, True at real (non-padding) positions.
    """
    L = key_valid.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=key_valid.device).tril()  # (L, L)
    diagonal = torch.eye(L, dtype=torch.bool, device=key_valid.device)  # (L, L)
    return causal & (key_valid[:, None, None, :] | diagonal)  # (B, 1, L, L)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention ``softmax(corr(q k^T / sqrt(D)) + mask) v`` then ``W_o``.

    Shapes: input (B, L, d_model) -> output (B, L, d_model); H heads of size D = d_model / H.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        score_correction: ScoreCorrection | None = None,
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ConfigError(
                f"d_model must be divisible by n_heads, got {d_model=} and {n_heads=}; "
                "pick n_heads among the divisors of d_model"
            )
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.o = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.score_correction = score_correction

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        x = x.view(B, L, self.n_heads, self.head_dim)  # (B, L, heads, head_dim)
        return x.transpose(1, 2)  # (B, heads, L, head_dim)

    def forward(self, x: Tensor, key_valid: Tensor) -> Tensor:
        """Args: x (B, L, d_model); key_valid (B, L) bool, True at real items. Returns (B, L, d_model)."""
        B, L, d_model = x.shape
        q, k, v = (self._split_heads(proj(x)) for proj in (self.q, self.k, self.v))
        logits = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, heads, L, L)
        if self.score_correction is not None:
            corrected = self.score_correction(logits)
            if corrected.shape != logits.shape:
                raise DataError(
                    f"score_correction must return the logits' shape {tuple(logits.shape)}, "
                    f"got {tuple(corrected.shape)}; return a (B, H, L, L) tensor"
                )
            logits = corrected
        logits = logits.masked_fill(~attention_mask(key_valid), float("-inf"))
        probs = self.attn_dropout(F.softmax(logits, dim=-1))  # (B, heads, L, L)
        out = (probs @ v).transpose(1, 2)  # (B, L, heads, head_dim)
        return self.o(out.reshape(B, L, d_model))  # (B, L, d_model)
