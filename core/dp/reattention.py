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

2. **Error propagation** (Sec. 5.2.2, eq. 5.4-5.7, App. D): moment matching. Each activation is
   summarised by a per-coordinate mean (the noisy forward value -- "the noisy parameter can serve as
   an estimate of its mean") and variance (:class:`GaussianMoments`); noise in different coordinates
   and in different factors is treated as independent (the isotropic DP noise of eq. 5.4).

   * Linear ``Y = X W^T + b`` (eq. 5.5 / D.2, summed over the input dimension)::

         Var[Y_k] = sum_j Var[X_j] (Var[W_kj] + W_kj^2) + Var[W_kj] E[X_j]^2  (+ Var[b_k])

     Exact for independent X, W; output coordinates become correlated, which later layers ignore.
   * ReLU (eq. 5.6, from Lemma D.2). For ``X ~ N(c, d)``, ``a = c / sqrt d``::

         E[Y] = c Phi(a) + sqrt(d) phi(a)
         Var[Y] = d [Phi(a) + a^2 Phi(a) Phi(-a) + a phi(a) (1 - 2 Phi(a)) - phi(a)^2]

     which is ``E[Y^2] - E[Y]^2`` written without cancellation. (Eq. 5.6 as printed subtracts
     ``c^2`` instead of ``E[Y]^2``, a typo: it gives ``d/2`` at ``c = 0`` while App. D's Table 3
     reports the correct ``(1/2 - 1/(2 pi)) d = 0.3408 d``.) GELU: use the ReLU moments, as in
     Remark D.3 (Table 3: 0.3467 vs 0.3408 at N(0, 1)).
   * LayerNorm ``y = gamma (x - m(x)) / sqrt(v(x) + eps) + beta`` (our derivation, first-order delta
     method). With ``xhat = (mu - m(mu)) / s``, ``s = sqrt(v(mu) + eps)``, the Jacobian is
     ``J_kj = (gamma_k / s)(delta_kj - (1 + xhat_k xhat_j) / d)``, so with ``a_kj = (1 + xhat_k xhat_j)/d``::

         Var[y_k] ~= (gamma_k^2 / s'^2) [ v_k (1 - 2 a_kk) + (S0 + 2 xhat_k S1 + xhat_k^2 S2) / d^2 ]

     with ``S0 = sum_j v_j``, ``S1 = sum_j xhat_j v_j``, ``S2 = sum_j xhat_j^2 v_j``, and mean
     ``~= LN(mu)``. The plain delta method has ``s'^2 = s^2``; we evaluate the prefactor at the
     *expected* feature variance of the noisy input, ``s'^2 = s^2 + mean_j(v_j) (d - 1)/d``. Both
     agree to first order in ``v``; ours stays bounded as the noise grows (Monte Carlo: within a
     few % for ``v << v(mu)`` and within ~10% even at ``v = v(mu)``, where the plain delta method
     is off by 2-10x). For isotropic noise it reads ``gamma_k^2 v / s'^2 (1 - (1 + xhat_k^2)/d)``:
     LN rescales the noise by the token's inverse feature std. LN also makes its output
     coordinates correlated (it projects out the ``1`` and ``xhat`` directions); for LN followed by
     a linear layer (e.g. a pre-LN key projection) :func:`layer_norm_linear_moments` propagates
     through the composed Jacobian ``W diag(gamma) J`` so that this correlation is kept.
   * Softmax ``A = softmax(z)`` with independent ``z_k ~ N(mu_k, v_k)`` (first-order delta method,
     ``dA_j / dz_k = A_j (delta_jk - A_k)``)::

         E[A_j] ~= softmax(mu)_j,   Var[A_j] ~= A_j^2 [ (1 - 2 A_j) v_j + sum_k A_k^2 v_k ]

   * Attention mixing ``O_i = sum_j A_ij V_j`` (first order in the logit and value noise, taken as
     independent)::

         Var[O_ic] ~= sum_j A_ij^2 Var[V_jc] + sum_j A_ij^2 v_ij (E[V_jc] - E[O_ic])^2

   * Residual sums add means and variances (the correlation between a branch and its input is
     ignored, as in the paper's layer-wise scheme).

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

The same first-layer key variance is used by every layer; deeper layers would need the block
outputs' moments, which the primitives above can propagate inside the model's forward pass.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from core.errors import ConfigError, DataError

__all__ = [
    "GaussianMoments",
    "KeyPropagation",
    "LogitCorrection",
    "PositionAlignment",
    "ReAttention",
    "ScoreCorrection",
    "add_moments",
    "attention_moments",
    "block_error_variance",
    "embedding_error_variance",
    "embedding_moments",
    "layer_norm_linear_moments",
    "layer_norm_moments",
    "linear_moments",
    "logit_variance",
    "reattention_correction",
    "relu_moments",
    "softmax_moments",
    "token_presence_frequency",
]

#: ``ScoreCorrection`` satisfies this: the model's ``score_correction`` hook on (B, H, L, L) logits.
LogitCorrection = Callable[[torch.Tensor], torch.Tensor]


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {name}={value!r}")


def _check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {name}={value!r}")


def _check_variance_tensor(name: str, var: torch.Tensor) -> None:
    if var.numel() == 0:
        return
    if not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise DataError(f"{name} must be finite and >= 0, got min={float(var.min())}, max={float(var.max())}")


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
            "sequences must be a LongTensor (N, L), "
            f"got shape {tuple(sequences.shape)}, dtype {sequences.dtype}"
        )
    if (
        isinstance(num_embeddings, bool)
        or not isinstance(num_embeddings, numbers.Integral)
        or num_embeddings < 1
    ):
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
        raise DataError(
            "frequencies must be probabilities in [0, 1] (fraction of sequences containing the token)"
        )
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
# 2. error propagation (Sec. 5.2.2, eq. 5.4-5.7, App. D)
# ==================================================================================================


@dataclass(frozen=True, eq=False)
class GaussianMoments:
    """Per-coordinate mean and variance of an activation ``(..., d)``; ``var`` broadcasts to ``mean``."""

    mean: torch.Tensor
    var: torch.Tensor

    def __post_init__(self) -> None:
        try:
            torch.broadcast_shapes(self.var.shape, self.mean.shape)
        except RuntimeError as err:
            raise ConfigError(
                f"var shape {tuple(self.var.shape)} does not broadcast to mean shape {tuple(self.mean.shape)}"
            ) from err

    def full_var(self) -> torch.Tensor:
        """``var`` expanded to ``mean``'s shape."""
        return self.var.expand_as(self.mean)

    def scalar_var(self) -> torch.Tensor:
        """The paper's scalar effective error: mean variance over the last (feature) dim, ``(...)``."""
        return self.full_var().mean(dim=-1)


def embedding_moments(
    input_ids: torch.Tensor, weight: torch.Tensor, row_var: torch.Tensor, *, scale: float = 1.0
) -> GaussianMoments:
    """Lookup ``scale * E[ids]``: mean ``(B, L, d)``, isotropic var ``(B, L, 1) = scale^2 row_var[ids]``."""
    if row_var.shape != (weight.shape[0],):
        raise ConfigError(
            f"row_var must have shape ({weight.shape[0]},) (one variance per embedding row), "
            f"got {tuple(row_var.shape)}"
        )
    mean = weight[input_ids] * scale
    var = row_var.to(device=weight.device, dtype=weight.dtype)[input_ids].unsqueeze(-1) * scale**2
    return GaussianMoments(mean, var)


def add_moments(a: GaussianMoments, b: GaussianMoments) -> GaussianMoments:
    """``X + Y`` for independent X, Y (residual connections, token + position embeddings)."""
    return GaussianMoments(a.mean + b.mean, a.var + b.var)


def linear_moments(
    x: GaussianMoments,
    weight: torch.Tensor,
    *,
    weight_var: float | torch.Tensor,
    bias: torch.Tensor | None = None,
    bias_var: float | torch.Tensor = 0.0,
) -> GaussianMoments:
    """Eq. 5.5 / D.2 for ``Y = X W^T + b`` with ``W (out, in)`` (``nn.Linear`` layout), summed over ``in``.

    ``weight_var`` is a scalar (e.g. :func:`block_error_variance`) or an ``(out, in)`` tensor.
    Returns per-coordinate moments ``(..., out)``.
    """
    w_var = torch.as_tensor(weight_var, dtype=weight.dtype, device=weight.device).expand_as(weight)
    var_in = x.full_var()
    mean = x.mean @ weight.T
    var = var_in @ (weight.pow(2) + w_var).T + x.mean.pow(2) @ w_var.T
    if bias is not None:
        mean = mean + bias
    var = var + torch.as_tensor(bias_var, dtype=var.dtype, device=var.device)
    return GaussianMoments(mean, var)


def relu_moments(x: GaussianMoments) -> GaussianMoments:
    """Eq. 5.6 (correct form, Lemma D.2): moments of ``ReLU(X)``, ``X ~ N(mean, var)`` coordinate-wise.

    Evaluated in float64 and cast back; zero-variance coordinates give ``relu(mean)`` exactly.
    Use for GELU too (Remark D.3).
    """
    c = x.mean.to(torch.float64)
    d = x.full_var().to(torch.float64)
    sd = d.sqrt()
    noisy = sd > 0
    a = torch.where(noisy, c / torch.where(noisy, sd, torch.ones_like(sd)), torch.zeros_like(c))
    cdf, cdf_neg = torch.special.ndtr(a), torch.special.ndtr(-a)
    pdf = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    mean = torch.where(noisy, c * cdf + sd * pdf, c.clamp_min(0))
    unit_var = cdf + a * a * cdf * cdf_neg + a * pdf * (cdf_neg - cdf) - pdf * pdf
    var = torch.where(noisy, d * unit_var.clamp_min(0), torch.zeros_like(d))
    return GaussianMoments(mean.to(x.mean.dtype), var.to(x.mean.dtype))


@dataclass(frozen=True, eq=False)
class _LayerNormLinearisation:
    """First-order expansion of LayerNorm (without affine) around the input mean, see module docstring."""

    xhat: torch.Tensor  # (..., d) normalised mean
    inv_var: torch.Tensor  # (..., 1) 1 / s'^2
    v: torch.Tensor  # (..., d) input variance
    s0: torch.Tensor  # (..., 1) sum_j v_j
    s1: torch.Tensor  # (..., 1) sum_j xhat_j v_j
    s2: torch.Tensor  # (..., 1) sum_j xhat_j^2 v_j

    @classmethod
    def of(cls, x: GaussianMoments, eps: float) -> _LayerNormLinearisation:
        _check_nonnegative("eps", eps)
        v = x.full_var()
        d = x.mean.shape[-1]
        centred = x.mean - x.mean.mean(dim=-1, keepdim=True)
        feature_var = centred.pow(2).mean(dim=-1, keepdim=True) + eps
        xhat = centred * torch.rsqrt(feature_var)
        # 1/s^2 at the expected feature variance of the noisy input, E[v(x)] = v(mu) + mean(v)(d-1)/d
        inv_var = 1.0 / (feature_var + v.mean(dim=-1, keepdim=True) * (d - 1) / d)
        return cls(
            xhat=xhat,
            inv_var=inv_var,
            v=v,
            s0=v.sum(dim=-1, keepdim=True),
            s1=(xhat * v).sum(dim=-1, keepdim=True),
            s2=(xhat.pow(2) * v).sum(dim=-1, keepdim=True),
        )


def layer_norm_moments(
    x: GaussianMoments,
    *,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> GaussianMoments:
    """First-order (delta-method) moments of ``LayerNorm`` over the last dim (module docstring, item 2).

    Per-coordinate variances only: LN makes its output coordinates (negatively) correlated, which a
    following linear layer would see; use :func:`layer_norm_linear_moments` for LN -> Linear.
    """
    lin = _LayerNormLinearisation.of(x, eps)
    d = x.mean.shape[-1]
    xhat = lin.xhat
    a_diag = (1 + xhat.pow(2)) / d
    var = lin.inv_var * (
        lin.v * (1 - 2 * a_diag) + (lin.s0 + 2 * xhat * lin.s1 + xhat.pow(2) * lin.s2) / d**2
    )
    mean = xhat
    if weight is not None:
        mean = mean * weight
        var = var * weight.pow(2)
    if bias is not None:
        mean = mean + bias
    return GaussianMoments(mean, var.clamp_min(0))


def layer_norm_linear_moments(
    x: GaussianMoments,
    weight: torch.Tensor,
    *,
    weight_var: float | torch.Tensor,
    bias: torch.Tensor | None = None,
    bias_var: float | torch.Tensor = 0.0,
    ln_weight: torch.Tensor | None = None,
    ln_bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> GaussianMoments:
    """``Linear(LayerNorm(X))`` keeping the cross-coordinate correlation that LN induces (first order).

    With ``U = W diag(gamma)`` the composed Jacobian is ``(U_kj - a_k/d - b_k xhat_j/d) / s'``,
    ``a = U 1``, ``b = U xhat``, so ``Var[Y_k] = sum_j (U_kj - a_k/d - b_k xhat_j/d)^2 v_j / s'^2``
    (expanded into matmuls; no ``(..., d_out, d)`` tensor) plus the weight-noise term
    ``sum_j Var[W_kj] E[LN_j^2]`` and ``Var[b_k]``. Treating LN's output coordinates as independent
    instead (:func:`layer_norm_moments` then :func:`linear_moments`) is off by ~5% in our tests.
    """
    lin = _LayerNormLinearisation.of(x, eps)
    d = x.mean.shape[-1]
    u = weight if ln_weight is None else weight * ln_weight
    a = u.sum(dim=-1)  # (out,)
    b = lin.xhat @ u.T  # (..., out)
    var = (
        lin.v @ u.pow(2).T
        - (2 / d) * a * (lin.v @ u.T)
        - (2 / d) * b * ((lin.xhat * lin.v) @ u.T)
        + (a.pow(2) * lin.s0 + 2 * a * b * lin.s1 + b.pow(2) * lin.s2) / d**2
    )
    var = (lin.inv_var * var).clamp_min(0)
    normed = layer_norm_moments(x, weight=ln_weight, bias=ln_bias, eps=eps)
    w_var = torch.as_tensor(weight_var, dtype=weight.dtype, device=weight.device).expand_as(weight)
    var = var + (normed.var + normed.mean.pow(2)) @ w_var.T
    var = var + torch.as_tensor(bias_var, dtype=var.dtype, device=var.device)
    mean = normed.mean @ weight.T
    if bias is not None:
        mean = mean + bias
    return GaussianMoments(mean, var)


def softmax_moments(logits: torch.Tensor, logit_var: torch.Tensor, *, dim: int = -1) -> GaussianMoments:
    """First-order moments of ``softmax(z)``, ``z ~ N(logits, logit_var)`` independent along ``dim``.

    ``Var[A_j] ~= A_j^2 [(1 - 2 A_j) v_j + sum_k A_k^2 v_k]``; masked (``-inf``) logits get ``A = 0``.
    """
    _check_variance_tensor("logit_var", logit_var)
    probs = torch.softmax(logits, dim=dim)
    v = logit_var.expand_as(probs)
    spread = (probs.pow(2) * v).sum(dim=dim, keepdim=True)
    var = probs.pow(2) * ((1 - 2 * probs) * v + spread)
    return GaussianMoments(probs, var.clamp_min(0))


def attention_moments(
    weights: torch.Tensor, logit_var: torch.Tensor, value: GaussianMoments
) -> GaussianMoments:
    """First-order moments of ``O = A V``: ``weights (..., Lq, Lk)`` = softmax of the logit means,
    ``logit_var (..., Lq, Lk)``, ``value`` moments ``(..., Lk, dv)`` -> ``(..., Lq, dv)``.
    """
    _check_variance_tensor("logit_var", logit_var)
    mean = weights @ value.mean
    w2 = weights.pow(2)
    w2v = w2 * logit_var.expand_as(weights)
    value_term = w2 @ value.full_var()
    # sum_j w2v_ij (V_jc - O_ic)^2, expanded so no (..., Lq, Lk, dv) tensor is formed
    logit_term = (
        w2v @ value.mean.pow(2) - 2 * mean * (w2v @ value.mean) + mean.pow(2) * w2v.sum(-1, keepdim=True)
    )
    return GaussianMoments(mean, (value_term + logit_term.clamp_min(0)))


def logit_variance(
    query: torch.Tensor, key_var: torch.Tensor, *, logit_scale: float | None = None
) -> torch.Tensor:
    """``Var[tau <q_i, K_j>] = tau^2 |q_i|^2 sigma_j^2`` (eq. 5.2 with ``tau = 1/sqrt(d_h)`` by default).

    ``query (..., Lq, d_h)``, ``key_var (..., Lk)`` (per-coordinate key variance) -> ``(..., Lq, Lk)``.
    """
    tau = 1.0 / math.sqrt(query.shape[-1]) if logit_scale is None else float(logit_scale)
    return (tau**2) * query.pow(2).sum(dim=-1, keepdim=True) * key_var.unsqueeze(-2)


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
                f"key_weight must be (d_k, d_model={self.item_embedding.shape[1]}), "
                f"got {tuple(self.key_weight.shape)}"
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


def reattention_correction(
    logits: torch.Tensor, key_var: torch.Tensor, *, scale: float | torch.Tensor
) -> torch.Tensor:
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
    are set to 0 (those keys are masked). The same key variance is used at every layer unless the
    model tracks moments layer by layer with the primitives above.
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
            raise ConfigError(
                f"item_error_var must be a float tensor (M+1,), got shape {tuple(item_error_var.shape)}"
            )
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
                "input_ids must be a LongTensor (B, L), "
                f"got shape {tuple(input_ids.shape)}, dtype {input_ids.dtype}"
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
