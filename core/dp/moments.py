r"""Gaussian moment propagation (paper Sec. 5.2.2, eq. 5.4-5.7, App. D): DP-noise variance through layers.

The effective errors of :mod:`core.dp.reattention` (Claims 5.3-5.4) are per-parameter variances; the
primitives here carry them through a network by moment matching, e.g. to the attention keys that
Re-Attention de-biases (:class:`core.dp.reattention.KeyPropagation`).

Moment matching: each activation is summarised by a per-coordinate mean (the noisy forward value --
"the noisy parameter can serve as an estimate of its mean") and variance (:class:`GaussianMoments`);
noise in different coordinates and in different factors is treated as independent (the isotropic DP
noise of eq. 5.4).

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

  with ``S0 = sum_j v_j``, ``S1 = sum_j xhat_j v_j``, ``S2 = sum_j xhat_j^2 v_j``. The plain delta
  method has ``s'^2 = s^2``; we evaluate the prefactor at the *expected* feature variance of the
  noisy input, ``s'^2 = s^2 + mean_j(v_j) (d - 1)/d``. Both agree to first order in ``v``; ours
  stays bounded as the noise grows (Monte Carlo: within a few % for ``v << v(mu)`` and within
  ~10% even at ``v = v(mu)``, where the plain delta method is off by 2-10x). The mean, likewise,
  is ``gamma (mu - m(mu)) / s' + beta``: ``LN(mu)`` to first order, and shrinking towards ``beta``
  as the noise takes over the feature variance, as ``E[LN(X)]`` does (the noise's direction is
  random). Downstream products of means need this: with ``LN(mu)`` itself, the pre-LN attention
  logits' variance came out up to 2x too large for items whose noise exceeds their embedding.
  For isotropic noise the variance reads ``gamma_k^2 v / s'^2 (1 - (1 + xhat_k^2)/d)``: LN
  rescales the noise by the token's inverse feature std. LN also makes its output
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
* A linear read-out ``r . f(X)`` of a token, ``f`` = identity or LayerNorm
  (:func:`projected_variance`): ``Var = sum_j r_j^2 v_j`` without LN; through LN the composed
  Jacobian as in :func:`layer_norm_linear_moments`, for many read-outs ``r`` against many tokens at
  once (all pairs) or one read-out per token (paired). An attention logit with its query held fixed,
  ``tau <q_i, W_K f(X_j) + b>``, is such a read-out with ``r = tau W_K^T q_i``; pulling the query back
  through ``W_K`` keeps the correlation that ``W_K`` gives the key's coordinates, which per-coordinate
  key variances lose.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from core.errors import ConfigError, DataError

__all__ = [
    "GaussianMoments",
    "add_moments",
    "attention_moments",
    "embedding_moments",
    "layer_norm_linear_moments",
    "layer_norm_moments",
    "linear_moments",
    "logit_variance",
    "projected_variance",
    "relu_moments",
    "softmax_moments",
]


def _check_nonnegative(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {name}={value!r}")


def _check_variance_tensor(name: str, var: torch.Tensor) -> None:
    if var.numel() == 0:
        return
    if not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise DataError(f"{name} must be finite and >= 0, got min={float(var.min())}, max={float(var.max())}")


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
            f"row_var must have shape ({weight.shape[0]},) (one variance per embedding row), got {tuple(row_var.shape)}"
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

    ``weight_var`` is a scalar (e.g. :func:`core.dp.reattention.block_error_variance`) or an
    ``(out, in)`` tensor. Returns per-coordinate moments ``(..., out)``.
    """
    w_var = torch.as_tensor(weight_var, dtype=weight.dtype, device=weight.device)
    var_in = x.full_var()
    mean = x.mean @ weight.T
    if w_var.dim() == 0:  # one variance for every weight: sum_in mean^2 w_var without a matmul
        var = var_in @ (weight.pow(2) + w_var).T + x.mean.pow(2).sum(dim=-1, keepdim=True) * w_var
    else:
        w_var = w_var.expand_as(weight)
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
    everywhere = bool(noisy.all())  # DP noise reaches every coordinate: no masking
    a = c / sd if everywhere else (c / sd.masked_fill(~noisy, 1.0)).masked_fill_(~noisy, 0.0)
    cdf = torch.special.ndtr(a)
    cdf_neg = 1.0 - cdf  # = ndtr(-a) to within 1e-16: exact where cdf is small, negligible where it is near 1
    a2 = a * a
    pdf = a2.mul(-0.5).exp_().mul_(1.0 / math.sqrt(2 * math.pi))
    mean = torch.addcmul(c * cdf, sd, pdf)
    # cdf + a^2 cdf cdf_neg + a pdf (cdf_neg - cdf) - pdf^2, the unit-variance form of Lemma D.2
    unit_var = a2.mul_(cdf_neg).add_(1.0).mul_(cdf)
    unit_var.add_(pdf * (a * (cdf_neg - cdf) - pdf))
    var = d * unit_var.clamp_min_(0)
    if not everywhere:
        mean = torch.where(noisy, mean, c.clamp_min(0))
        var = var.masked_fill_(~noisy, 0.0)
    return GaussianMoments(mean.to(x.mean.dtype), var.to(x.mean.dtype))


@dataclass(frozen=True, eq=False)
class _LayerNormLinearisation:
    """First-order expansion of LayerNorm (without affine) around the input mean, see module docstring."""

    xhat: torch.Tensor  # (..., d) normalised mean
    feature_var: torch.Tensor  # (..., 1) s^2 = v(mu) + eps
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
            feature_var=feature_var,
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
    weight_var: float = 0.0,
    bias_var: float = 0.0,
) -> GaussianMoments:
    """First-order (delta-method) moments of ``LayerNorm`` over the last dim (module docstring).

    ``weight_var``/``bias_var``: noise variance of the LN's own affine parameters (e.g. Claim 5.3),
    adding ``weight_var (xhat^2 + Var[xhat]) + bias_var``.
    Per-coordinate variances only: LN makes its output coordinates (negatively) correlated, which a
    following linear layer would see; use :func:`layer_norm_linear_moments` for LN -> Linear.
    """
    _check_nonnegative("weight_var", weight_var)
    _check_nonnegative("bias_var", bias_var)
    lin = _LayerNormLinearisation.of(x, eps)
    d = x.mean.shape[-1]
    xhat = lin.xhat
    a_diag = (1 + xhat.pow(2)) / d
    var = lin.inv_var * (lin.v * (1 - 2 * a_diag) + (lin.s0 + 2 * xhat * lin.s1 + xhat.pow(2) * lin.s2) / d**2)
    var = var.clamp_min(0)
    param_var = weight_var * (xhat.pow(2) + var) + bias_var
    mean = xhat * (lin.inv_var * lin.feature_var).sqrt()  # (mu - m(mu)) / s', LN(mu) to first order
    if weight is not None:
        mean = mean * weight
        var = var * weight.pow(2)
    if bias is not None:
        mean = mean + bias
    return GaussianMoments(mean, var + param_var)


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


def attention_moments(weights: torch.Tensor, logit_var: torch.Tensor, value: GaussianMoments) -> GaussianMoments:
    """First-order moments of ``O = A V``: ``weights (..., Lq, Lk)`` = softmax of the logit means,
    ``logit_var (..., Lq, Lk)``, ``value`` moments ``(..., Lk, dv)`` -> ``(..., Lq, dv)``.
    """
    _check_variance_tensor("logit_var", logit_var)
    mean = weights @ value.mean
    w2 = weights.pow(2)
    w2v = w2 * logit_var.expand_as(weights)
    value_term = w2 @ value.full_var()
    # sum_j w2v_ij (V_jc - O_ic)^2, expanded so no (..., Lq, Lk, dv) tensor is formed
    logit_term = w2v @ value.mean.pow(2) - 2 * mean * (w2v @ value.mean) + mean.pow(2) * w2v.sum(-1, keepdim=True)
    return GaussianMoments(mean, (value_term + logit_term.clamp_min(0)))


def logit_variance(query: torch.Tensor, key_var: torch.Tensor, *, logit_scale: float | None = None) -> torch.Tensor:
    """``Var[tau <q_i, K_j>] = tau^2 |q_i|^2 sigma_j^2`` (eq. 5.2 with ``tau = 1/sqrt(d_h)`` by default).

    ``query (..., Lq, d_h)``, ``key_var (..., Lk)`` (per-coordinate key variance) -> ``(..., Lq, Lk)``.
    """
    tau = 1.0 / math.sqrt(query.shape[-1]) if logit_scale is None else float(logit_scale)
    return (tau**2) * query.pow(2).sum(dim=-1, keepdim=True) * key_var.unsqueeze(-2)


def projected_variance(
    x: GaussianMoments,
    rows: torch.Tensor,
    *,
    layer_norm: tuple[torch.Tensor | None, torch.Tensor | None, float] | None = None,
    layer_norm_var: float = 0.0,
    pairwise: bool = True,
) -> torch.Tensor:
    """First-order ``Var[r . f(X)]`` of read-outs ``r`` of tokens ``X``, ``f`` = identity or LayerNorm.

    ``x``: per-coordinate moments of the tokens ``(..., N, d)``; ``rows``: read-outs ``(..., R, d)``
    (leading dims broadcast). ``pairwise=True``: every read-out against every token, ``(..., R, N)``;
    ``pairwise=False``: read-out ``n`` against token ``n`` (``R == N``), ``(..., N)``. ``layer_norm``:
    ``(weight, bias, eps)`` of a LayerNorm applied to each token first, with the composed Jacobian of
    :func:`layer_norm_linear_moments` (``U = r * gamma``, ``a = U 1``, ``b = U xhat``)::

        Var = [sum_j U_j^2 v_j - (2 a / d) sum_j U_j v_j - (2 b / d) sum_j U_j xhat_j v_j
               + (a^2 S0 + 2 a b S1 + b^2 S2) / d^2] / s'^2  +  sum_j r_j^2 (xhat_j^2 + 1) layer_norm_var

    the last term being the noise of the LN's own weight and bias (variance ``layer_norm_var`` each).
    Without LN: ``sum_j r_j^2 v_j``, exact for independent coordinates.
    """
    _check_nonnegative("layer_norm_var", layer_norm_var)
    v = x.full_var()
    if layer_norm is None:
        return _readout(rows.pow(2), v, pairwise)
    ln_weight, _, eps = layer_norm
    lin = _LayerNormLinearisation.of(x, eps)
    d = x.mean.shape[-1]
    u = rows if ln_weight is None else rows * ln_weight
    a = u.sum(dim=-1)  # (..., R)
    b = _readout(u, lin.xhat, pairwise)  # (..., R, N) or (..., N)
    s0, s1, s2, inv_var = (t.squeeze(-1) for t in (lin.s0, lin.s1, lin.s2, lin.inv_var))  # (..., N)
    if pairwise:
        a = a.unsqueeze(-1)  # (..., R, 1)
        s0, s1, s2, inv_var = (t.unsqueeze(-2) for t in (s0, s1, s2, inv_var))  # (..., 1, N)
    var = (
        _readout(u.pow(2), v, pairwise)
        - (2 / d) * a * _readout(u, v, pairwise)
        - (2 / d) * b * _readout(u, lin.xhat * v, pairwise)
        + (a.pow(2) * s0 + 2 * a * b * s1 + b.pow(2) * s2) / d**2
    )
    var = (inv_var * var).clamp_min(0)
    if layer_norm_var:
        var = var + layer_norm_var * _readout(rows.pow(2), lin.xhat.pow(2) + 1, pairwise)
    return var


def _readout(rows: torch.Tensor, tokens: torch.Tensor, pairwise: bool) -> torch.Tensor:
    """``rows (..., R, d) . tokens (..., N, d)``: all pairs ``(..., R, N)`` or paired ``(..., N)``."""
    if pairwise:
        return rows @ tokens.transpose(-1, -2)
    return (rows * tokens).sum(dim=-1)
