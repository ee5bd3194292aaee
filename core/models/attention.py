"""Causal multi-head self-attention built from plain ``nn.Linear`` layers.

The attention is written out by hand (no ``nn.MultiheadAttention``) so that every trainable
parameter lives in an ``nn.Linear``: the per-sample gradient-norm machinery of
:mod:`core.dp.phantom` and of Opacus only has to understand Linear / LayerNorm / Embedding.

The module has one extension point, a *score correction*: a callable applied to the scaled
pre-softmax logits ``q k^T / sqrt(head_dim)`` of shape (B, H, L, L), before the causal / padding
mask. The Re-Attention mechanism of DPFormer (Sec. 5.2: ``S_i <- S_i / exp(C sigma_i^2 / 2)``, i.e.
subtracting ``C sigma_i^2 / 2`` from the logit of key ``i``) plugs in here, either persistently
(:attr:`CausalSelfAttention.score_correction`) or per forward call (the ``score_correction``
argument, which wins). If the callable has a ``query`` parameter it is called as
``fn(logits, query=q)`` with the queries q (B, H, L, head_dim), so that ``C = |q|^2 / head_dim``
can be exact per query; otherwise as ``fn(logits)``. ``None`` (the default) is standard scaled
dot-product attention (Vaswani et al., 2017).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import ConfigError, DataError

ScoreCorrection = Callable[..., Tensor]
"""Maps pre-softmax attention logits (B, H, L, L) (and optionally ``query=`` (B, H, L, head_dim))
to corrected logits of the same shape."""


def apply_score_correction(fn: ScoreCorrection, logits: Tensor, query: Tensor) -> Tensor:
    """``fn(logits, query=query)`` if ``fn`` takes a ``query`` argument, else ``fn(logits)``; checks the shape."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature
        params = {}
    takes_query = "query" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    corrected = fn(logits, query=query) if takes_query else fn(logits)
    if not isinstance(corrected, Tensor) or corrected.shape != logits.shape:
        shape = tuple(corrected.shape) if isinstance(corrected, Tensor) else type(corrected).__name__
        raise DataError(
            f"score_correction must return the logits' shape {tuple(logits.shape)} (B, H, L, L), got {shape}"
        )
    return corrected


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
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.score_correction = score_correction

    def _split_heads(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        x = x.view(B, L, self.n_heads, self.head_dim)  # (B, L, heads, head_dim)
        return x.transpose(1, 2)  # (B, heads, L, head_dim)

    def forward(
        self,
        x: Tensor,
        key_valid: Tensor,
        score_correction: ScoreCorrection | None = None,
        window: int | None = None,
    ) -> Tensor:
        """Args: x (B, T, d_model); key_valid (B, T) bool, True at real items; score_correction
        overrides :attr:`score_correction` for this call; ``window``: attend only within consecutive
        windows of ``window`` positions (T must be a multiple of it; the logits, the score correction's
        input and the mask are then (B * T / window, heads, window, window)). Returns (B, T, d_model).

        The projections are applied to the whole (B, T) row, so a row stays one sample for the per-sample
        gradient machinery (:mod:`core.dp.phantom`, Opacus) however many windows it holds."""
        B, T, d_model = x.shape
        q, k, v = (proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, T, d_model)
        if window is not None and window != T:
            if window < 1 or T % window:
                raise DataError(f"sequence length T={T} is not a multiple of window={window}")
            q, k, v = (t.reshape(B * (T // window), window, d_model) for t in (q, k, v))
            key_valid = key_valid.reshape(B * (T // window), window)
        q, k, v = (self._split_heads(t) for t in (q, k, v))  # (B', heads, L, head_dim)
        logits = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B', heads, L, L)
        correction = score_correction if score_correction is not None else self.score_correction
        if correction is not None:
            logits = apply_score_correction(correction, logits, q)
        logits = logits.masked_fill(~attention_mask(key_valid), float("-inf"))
        probs = self.attn_dropout(F.softmax(logits, dim=-1))  # (B', heads, L, L)
        out = (probs @ v).transpose(1, 2)  # (B', L, heads, head_dim)
        return self.out_proj(out.reshape(B, T, d_model))  # (B, T, d_model)
