r"""Re-Attention (paper Sec. 5): track the DP-noise variance of attention keys and de-bias the scores.

**Why (eq. 5.1-5.2).** DP-SGD makes every parameter a noisy estimate, so an attention key is a
random vector ``K_j ~ N(k_j, sigma_j^2 I)`` and, for a fixed query ``q``, the logit
``<q, K_j> ~ N(<q, k_j>, C sigma_j^2)`` with ``C = <q, q>``. Since ``E[exp X] = exp(mu + s^2/2)``
for Gaussian ``X``, the expected unnormalised score of key ``j`` is inflated by the multiplicative
error ``exp(C sigma_j^2 / 2)``: attention drifts towards the *noisiest* keys -- the embeddings of
rare (long-tail) tokens -- regardless of relevance ("attention distraction").

**Fix.** ``S_j <- S_j / exp(C sigma_j^2 / 2)`` and renormalise (Sec. 5.2, "Re-Attention"). In log
space this subtracts ``C sigma_j^2 / 2`` from the logit of key ``j``; the softmax renormalises. With
scaled dot-product logits ``tau <q, K_j>`` (``tau = 1/sqrt(d_h)``; the paper omits it, footnote 7)
the logit variance is ``tau^2 |q|^2 sigma_j^2``, i.e. ``C = tau^2 <q, q>``.

This module provides the three stages of the paper's error tracking:

1. **Error instantiation** (Sec. 5.2.1, Def. 5.1, Claims 5.3-5.4, App. C). The *effective error*
   of a parameter ``theta`` is ``sigma_eff = sigma_dp / B_eff`` where ``B_eff = E[# batch sequences
   relevant to theta]``. For a Transformer-block weight every sequence is relevant, ``B_eff = B``
   (Claim 5.3); for the embedding row of token ``i``, ``B_eff = B p_i`` with ``p_i`` the probability
   that a sequence contains token ``i`` (Claim 5.4, eq. C.3) -- rare tokens receive the same noise
   but few useful gradient contributions. ``sigma_dp`` in eq. 3.1 is the noise std of the summed
   clipped gradient; the paper normalises gradients so that ``C_clip = 1`` (Sec. 6). For a general
   clip norm the noise std is ``sigma * C_clip`` (Opacus convention), so we use
   ``sigma_eff = sigma * C_clip / B_eff`` and report its square, the per-coordinate variance.
   ``p_i`` is treated as public (Remark C.1).
   The paper's effective error is a per-step, gradient-scale quantity: it involves neither the
   learning rate nor the number of steps, and neither do we.

2. **Error propagation** (Sec. 5.2.2, eq. 5.4-5.7, App. D): moment matching, in
   :mod:`core.dp.moments` (:class:`GaussianMoments` and the per-layer rules, with their derivations:
   linear eq. 5.5 / D.2, ReLU eq. 5.6 / Lemma D.2, LayerNorm, softmax, attention mixing, residual
   sums); :class:`KeyPropagation` applies them to the first attention layer's keys.

   Keys are then summarised by one scalar per position, the mean of their per-coordinate
   variances (the paper's "effective error can be represented in scalar").

3. **Correction**: :func:`reattention_correction` / :class:`ScoreCorrection`, a pre-softmax logit
   correction. Only *differences* between the keys' variances matter (the softmax is shift
   invariant): a variance common to all keys cancels, so e.g. the weight noise of ``W_K``
   (``Var[W] |x|^2``) matters only through differences in the tokens' input norms.

Wiring (trainer + model; ``core.models.attention`` calls a correction that accepts ``query=`` as
``fn(logits, query=q)``, so ``C = |q|^2 / d_h`` is exact per query)::

    n_sequences = len(train_ids)
    item_var = embedding_error_variance(
        noise_multiplier=sigma, clip_norm=C_clip, batch_size=q * n_sequences,
        frequencies=token_presence_frequency(train_ids, num_embeddings=M + 1))
    v_block = block_error_variance(noise_multiplier=sigma, clip_norm=C_clip, batch_size=q * n_sequences)
    re_attention = ReAttention(item_var, propagation=KeyPropagation(...))  # see KeyPropagation
    for input_ids in batches:
        logits = model(input_ids, score_correction=re_attention.for_batch(input_ids))

    # inside the attention module, on the scaled pre-softmax logits (B, H, L, L):
    logits = score_correction(logits, query=q)   # per-query C = tau^2 |q|^2, or
    logits = score_correction(logits)            # constant C from ReAttention(..., scale=C)

:class:`ReAttention` uses the same first-layer key variance at every layer. The trainer instead
corrects every block by its own propagated logit variance: :mod:`core.dp.propagation`
(:class:`~core.dp.propagation.BlockReAttention`, built by :func:`core.dp.methods.build_reattention`),
which carries the effective errors through every block, pre-LN and post-LN.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from core.dp import moments
from core.dp.moments import (
    GaussianMoments,
    _check_nonnegative,
    _check_variance_tensor,
    add_moments,
    embedding_moments,
    layer_norm_linear_moments,
    linear_moments,
)
from core.errors import ConfigError, DataError

__all__ = [
    "KeyPropagation",
    "LogitCorrection",
    "PositionAlignment",
    "ReAttention",
    "ScoreCorrection",
    "block_error_variance",
    "embedding_error_variance",
    "reattention_correction",
    "token_presence_frequency",
]
__all__ += moments.__all__  # re-exported, see __getattr__


def __getattr__(name: str) -> object:
    """The moment primitives lived here before :mod:`core.dp.moments` existed: the old import path still gives
    them (``from core.dp.reattention import linear_moments``)."""
    if name in moments.__all__:
        return getattr(moments, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: ``ScoreCorrection`` satisfies this: the model's ``score_correction`` hook on (B, H, L, L) logits.
LogitCorrection = Callable[[torch.Tensor], torch.Tensor]


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {name}={value!r}")


# ==================================================================================================
# 1. error instantiation (Sec. 5.2.1, Claims 5.3 and 5.4, App. C)
# ==================================================================================================


def token_presence_frequency(
    sequences: torch.Tensor, *, num_embeddings: int, padding_idx: int | None = 0
) -> torch.Tensor:
    """``p_i`` of Claim 5.4: the fraction of sequences that contain token ``i`` (eq. C.3).

    ``sequences (N, L)`` long -> ``(num_embeddings,)`` float32. A token repeated within a sequence
    counts once (``R_{E_i}(B_j) = 1[token i in B_j]``); the padding entry is 0. The paper treats
    these statistics as public (Remark C.1); computed from the private training set they are not
    covered by the DP-SGD guarantee.
    """
    if sequences.dim() != 2 or sequences.dtype != torch.long:
        raise DataError(
            f"sequences must be a LongTensor (N, L), got shape {tuple(sequences.shape)}, dtype {sequences.dtype}"
        )
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, numbers.Integral) or num_embeddings < 1:
        raise ConfigError(f"num_embeddings must be an integer >= 1, got num_embeddings={num_embeddings!r}")
    n = sequences.shape[0]
    if n == 0:
        raise DataError("sequences is empty (N = 0); token frequencies need at least one sequence")
    if sequences.numel() and (int(sequences.min()) < 0 or int(sequences.max()) >= num_embeddings):
        raise DataError(
            f"token ids must lie in [0, {num_embeddings - 1}], "
            f"got min={int(sequences.min())}, max={int(sequences.max())}"
        )
    ordered, _ = sequences.sort(dim=1)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = torch.bincount(ordered[first], minlength=num_embeddings).to(torch.float32)
    if padding_idx is not None:
        counts[padding_idx] = 0.0
    return counts / n


def block_error_variance(*, noise_multiplier: float, clip_norm: float, batch_size: float) -> float:
    """Claim 5.3: ``(sigma C_clip / B)^2``, the per-coordinate effective error variance of a block weight.

    ``batch_size`` is the (expected, ``q N`` under Poisson sampling) batch size ``B``.
    """
    _check_nonnegative("noise_multiplier", noise_multiplier)
    _check_positive("clip_norm", clip_norm)
    _check_positive("batch_size", batch_size)
    return (float(noise_multiplier) * float(clip_norm) / float(batch_size)) ** 2


def embedding_error_variance(
    *,
    noise_multiplier: float,
    clip_norm: float,
    batch_size: float,
    frequencies: torch.Tensor,
    padding_idx: int | None = 0,
    min_frequency: float | None = None,
) -> torch.Tensor:
    """Claim 5.4: ``(sigma C_clip / (B p_i))^2`` per embedding row, ``frequencies (M+1,)`` -> ``(M+1,)``.

    The padding row gets variance 0 (its keys are masked). A non-padding token with ``p_i = 0`` has
    unbounded effective error: pass ``min_frequency`` (e.g. ``1 / N``) to floor the frequencies, or
    drop such tokens from the vocabulary.
    """
    _check_nonnegative("noise_multiplier", noise_multiplier)
    _check_positive("clip_norm", clip_norm)
    _check_positive("batch_size", batch_size)
    if frequencies.dim() != 1 or not frequencies.is_floating_point():
        raise DataError(f"frequencies must be a float tensor (M+1,), got shape {tuple(frequencies.shape)}")
    if not bool(torch.isfinite(frequencies).all()) or bool((frequencies < 0).any() | (frequencies > 1).any()):
        raise DataError("frequencies must be probabilities in [0, 1] (fraction of sequences containing the token)")
    p = frequencies.clone()
    if min_frequency is not None:
        if not (isinstance(min_frequency, numbers.Real) and 0 < min_frequency <= 1):
            raise ConfigError(f"min_frequency must be in (0, 1], got min_frequency={min_frequency!r}")
        p = p.clamp_min(float(min_frequency))
    real = torch.ones_like(p, dtype=torch.bool)
    if padding_idx is not None:
        real[padding_idx] = False
    unseen = real & (p == 0)
    if bool(unseen.any()):
        ids = unseen.nonzero().flatten()[:10].tolist()
        raise DataError(
            f"{int(unseen.sum())} token(s) have frequency 0 (e.g. ids {ids}): infinite effective error; "
            "pass min_frequency=1/N or remove them from the vocabulary"
        )
    std = float(noise_multiplier) * float(clip_norm) / (float(batch_size) * p.where(real, torch.ones_like(p)))
    return (std * real).pow(2)


# ==================================================================================================
# 2. error propagation to the keys (Sec. 5.2.2; the moment primitives are in core.dp.moments)
# ==================================================================================================


class PositionAlignment(str, Enum):
    """Which rows of a learned positional table a length-``L`` sequence uses."""

    LEFT = "left"  # rows [0, L)
    RIGHT = "right"  # rows [P - L, P): right-aligned, as core.models.seqrec.TransformerSeqRec

    @classmethod
    def _missing_(cls, value: object) -> PositionAlignment:
        known = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"unknown position alignment {value!r}; known alignments: {known}")


@dataclass(frozen=True, eq=False)
class KeyPropagation:
    """Model tensors needed to carry item-embedding variance to the first attention layer's keys.

    Path: ``scale * E[ids] (+ P[pos]) -> [LayerNorm] -> W_K`` (dropout is ignored, as at eval time).
    Pass ``param.detach()`` views: they share storage with the live parameters, so the noisy
    parameters (used as the means, Sec. 5.2.2) stay current as the optimizer updates them.

    ``key_weight (d_k, d_model)`` in ``nn.Linear`` layout (for a fused ``in_proj``, its key rows);
    ``key_weight_var``/``key_bias_var``: :func:`block_error_variance` (Claim 5.3);
    ``position_error_var``: a scalar (Claim 5.3) or a ``(P,)`` tensor per position row (e.g.
    :func:`embedding_error_variance` of the fraction of sequences that reach each position, since a
    padded position gets no gradient); ``position_alignment``: :class:`PositionAlignment`;
    ``layer_norm``: ``(weight, bias, eps)`` of a pre-LN block applied to the key input, or None
    (post-LN, as in the standard encoder of E.2).

    For :class:`core.models.seqrec.TransformerSeqRec` (pre-LN, right-aligned positions)::

        block = model.blocks[0]
        KeyPropagation(
            item_embedding=model.item_emb.weight.detach(),
            key_weight=block.attn.k_proj.weight.detach(), key_bias=block.attn.k_proj.bias.detach(),
            key_weight_var=v_block, key_bias_var=v_block,
            position_embedding=model.pos_emb.weight.detach(), position_error_var=v_block,
            position_alignment="right",
            layer_norm=(block.ln_attn.weight.detach(), block.ln_attn.bias.detach(), block.ln_attn.eps),
        )
    """

    item_embedding: torch.Tensor
    key_weight: torch.Tensor
    key_weight_var: float
    key_bias: torch.Tensor | None = None
    key_bias_var: float = 0.0
    embedding_scale: float = 1.0
    position_embedding: torch.Tensor | None = None
    position_error_var: float | torch.Tensor = 0.0
    position_alignment: PositionAlignment | str = PositionAlignment.LEFT
    layer_norm: tuple[torch.Tensor | None, torch.Tensor | None, float] | None = None

    def __post_init__(self) -> None:
        _check_nonnegative("key_weight_var", self.key_weight_var)
        _check_nonnegative("key_bias_var", self.key_bias_var)
        _check_positive("embedding_scale", self.embedding_scale)
        object.__setattr__(self, "position_alignment", PositionAlignment(self.position_alignment))
        if isinstance(self.position_error_var, torch.Tensor):
            rows = None if self.position_embedding is None else self.position_embedding.shape[0]
            if self.position_error_var.shape != (rows,):
                raise ConfigError(
                    f"position_error_var must be a scalar or have shape ({rows},) (one per position row), "
                    f"got {tuple(self.position_error_var.shape)}"
                )
            _check_variance_tensor("position_error_var", self.position_error_var)
        else:
            _check_nonnegative("position_error_var", self.position_error_var)
        if self.key_weight.dim() != 2 or self.key_weight.shape[1] != self.item_embedding.shape[1]:
            raise ConfigError(
                f"key_weight must be (d_k, d_model={self.item_embedding.shape[1]}), got {tuple(self.key_weight.shape)}"
            )

    def _position_moments(self, length: int, like: torch.Tensor) -> GaussianMoments:
        table = self.position_embedding
        if length > table.shape[0]:
            raise DataError(f"sequence length {length} exceeds the {table.shape[0]} positional embeddings")
        start = 0 if self.position_alignment is PositionAlignment.LEFT else table.shape[0] - length
        rows = slice(start, start + length)
        if isinstance(self.position_error_var, torch.Tensor):
            var = self.position_error_var[rows].to(like).unsqueeze(-1)  # (L, 1)
        else:
            var = torch.tensor(float(self.position_error_var)).to(like)
        return GaussianMoments(table[rows], var)

    @torch.no_grad()
    def key_moments(self, input_ids: torch.Tensor, item_error_var: torch.Tensor) -> GaussianMoments:
        """Per-coordinate key moments ``(B, L, d_k)`` for ``input_ids (B, L)``."""
        x = embedding_moments(input_ids, self.item_embedding, item_error_var, scale=self.embedding_scale)
        if self.position_embedding is not None:
            x = add_moments(x, self._position_moments(input_ids.shape[-1], x.var))
        if self.layer_norm is None:
            return linear_moments(
                x,
                self.key_weight,
                weight_var=self.key_weight_var,
                bias=self.key_bias,
                bias_var=self.key_bias_var,
            )
        ln_weight, ln_bias, ln_eps = self.layer_norm
        return layer_norm_linear_moments(
            x,
            self.key_weight,
            weight_var=self.key_weight_var,
            bias=self.key_bias,
            bias_var=self.key_bias_var,
            ln_weight=ln_weight,
            ln_bias=ln_bias,
            eps=ln_eps,
        )

    def key_variance(self, input_ids: torch.Tensor, item_error_var: torch.Tensor) -> torch.Tensor:
        """Scalar key variance per position, ``(B, L)``."""
        return self.key_moments(input_ids, item_error_var).scalar_var()


# ==================================================================================================
# 3. the correction (eq. 5.2, Sec. 5.2 "Re-Attention", E.3)
# ==================================================================================================


def reattention_correction(logits: torch.Tensor, key_var: torch.Tensor, *, scale: float | torch.Tensor) -> torch.Tensor:
    """``S_j <- S_j / exp(C sigma_j^2 / 2)`` in log space: ``logits - scale * key_var_j / 2``.

    ``logits (B, [H,] Lq, Lk)`` pre-softmax; ``key_var (B, Lk)`` per-coordinate key variance;
    ``scale`` = ``C`` of eq. 5.2 (``tau^2 <q, q>``), a float or a tensor broadcastable to
    ``(B, [H,] Lq, 1)``. Masked (``-inf``) logits stay masked; the softmax renormalises.
    """
    if logits.dim() < 3 or key_var.shape != (logits.shape[0], logits.shape[-1]):
        raise ConfigError(
            f"key_var must be (B, Lk) = ({logits.shape[0]}, {logits.shape[-1]}) for logits of shape "
            f"{tuple(logits.shape)} (B, [H,] Lq, Lk), got {tuple(key_var.shape)}"
        )
    if isinstance(scale, numbers.Real):
        _check_nonnegative("scale", scale)
    key_shape = (key_var.shape[0],) + (1,) * (logits.dim() - 2) + (key_var.shape[1],)
    penalty = scale * key_var.reshape(key_shape).to(logits.device) / 2
    return logits - penalty.to(logits.dtype)


@dataclass(frozen=True, eq=False)
class ScoreCorrection:
    """A batch's Re-Attention logit correction; pass it as the model's ``score_correction``.

    ``key_var (B, L)``: per-position key variance. ``scale``: constant ``C`` of eq. 5.2 used when
    no query is given. Called with ``query (B, [H,] Lq, d_h)``, ``C = tau^2 |q_i|^2`` is computed per
    query from ``query.detach()`` (the correction is a fixed de-biasing term, not trained through),
    with ``tau = logit_scale`` or ``1/sqrt(d_h)``.
    """

    key_var: torch.Tensor
    scale: float | None = None
    logit_scale: float | None = None

    def __call__(self, logits: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        if query is not None:
            tau = 1.0 / math.sqrt(query.shape[-1]) if self.logit_scale is None else self.logit_scale
            scale = tau**2 * query.detach().pow(2).sum(dim=-1, keepdim=True)
        elif self.scale is not None:
            scale = self.scale
        else:
            raise ConfigError(
                "ScoreCorrection has scale=None and was called without query=; pass the attention queries "
                "(score_correction(logits, query=q)) or build ReAttention(..., scale=C)"
            )
        return reattention_correction(logits, self.key_var, scale=scale)


class ReAttention:
    """Per-item effective error variance -> per-batch :class:`ScoreCorrection` (module docstring).

    ``item_error_var (M+1,)``: :func:`embedding_error_variance`. ``propagation``: carries it to the
    keys (:class:`KeyPropagation`); ``None`` uses the embedding variance itself as the key variance
    (keys = embeddings, or a variance-preserving ``W_K``). Key variances at ``padding_idx`` positions
    are set to 0 (those keys are masked). The same key variance is used at every layer; for one
    correction per block see :class:`core.dp.propagation.BlockReAttention`.
    """

    def __init__(
        self,
        item_error_var: torch.Tensor,
        *,
        scale: float | None = None,
        logit_scale: float | None = None,
        propagation: KeyPropagation | None = None,
        padding_idx: int | None = 0,
    ) -> None:
        if item_error_var.dim() != 1 or not item_error_var.is_floating_point():
            raise ConfigError(f"item_error_var must be a float tensor (M+1,), got shape {tuple(item_error_var.shape)}")
        _check_variance_tensor("item_error_var", item_error_var)
        if scale is not None:
            _check_nonnegative("scale", scale)
        if logit_scale is not None:
            _check_positive("logit_scale", logit_scale)
        self.item_error_var = item_error_var
        self.scale = scale
        self.logit_scale = logit_scale
        self.propagation = propagation
        self.padding_idx = padding_idx

    @torch.no_grad()
    def key_variance(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Per-position key variance ``(B, L)`` for ``input_ids (B, L)``."""
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise DataError(
                f"input_ids must be a LongTensor (B, L), got shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
            )
        item_var = self.item_error_var.to(input_ids.device)
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= item_var.shape[0]):
            raise DataError(
                f"input_ids must lie in [0, {item_var.shape[0] - 1}], "
                f"got min={int(input_ids.min())}, max={int(input_ids.max())}"
            )
        if self.propagation is None:
            key_var = item_var[input_ids]
        else:
            key_var = self.propagation.key_variance(input_ids, item_var)
        if self.padding_idx is not None:
            key_var = key_var.masked_fill(input_ids == self.padding_idx, 0.0)
        return key_var

    def for_batch(self, input_ids: torch.Tensor) -> ScoreCorrection:
        """The :class:`ScoreCorrection` for this batch of sequences ``(B, L)``."""
        return ScoreCorrection(self.key_variance(input_ids), scale=self.scale, logit_scale=self.logit_scale)
