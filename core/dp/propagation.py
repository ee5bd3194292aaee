r"""Re-Attention in every block: the DP noise's logit variance, propagated block by block (Sec. 5.2.2).

DPFormer tracks the *effective error* of every parameter (Claims 5.3-5.4: ``(sigma C / B)^2`` for
a block weight, ``(sigma C / (B p_i))^2`` for item ``i``'s embedding row) through the network by
moment matching (eq. 5.4-5.7) "with the goal of obtaining sigma_i for each attention calculation",
then de-biases every attention: ``S_ij <- S_ij / exp(v_ij / 2)`` with ``v_ij`` the variance of
logit ``z_ij`` (eq. 5.2: ``E[exp z] = exp(E z + v / 2)`` for Gaussian ``z``). :func:`propagate`
does this for :class:`core.models.TransformerSeqRec`, pre-LN and post-LN, with the primitives of
:mod:`core.dp.moments`; :class:`BlockReAttention` turns it into one correction per block.

**What is propagated.** Every activation is a per-coordinate mean and variance
(:class:`~core.dp.moments.GaussianMoments`), both carried forward (eq. 5.7). The parameters'
means are their current noisy values ("the noisy parameter can serve as an estimate of its mean",
Sec. 5.2.2); the activations' means are moment-matched expectations (ReLU's ``E[ReLU(X)]``,
LayerNorm's mean shrunk by the noise's share of the feature variance), which equal the model's own
forward values when there is no noise. Eval mode (no dropout); each block's correction is applied to
the means before the next block, as in the corrected model. Per block ``l`` (``(B, L, d)``, ``H``
heads of ``d_h``, ``tau = d_h^-1/2``)::

    x_0 = (E[ids] + P[pos]) * valid                 Var = (v_item[ids] + v_pos[pos]) * valid
    pre-LN:  f = LN_a,  x' = x + Attn(f(x)),  x_{l+1} = x' + FFN(LN_f(x'))
    post-LN: f = id,    x' = LN_a(x + Attn(x)),  x_{l+1} = LN_f(x' + FFN(x'))

* Projections ``Q, K, V = W f(x) + b`` (eq. 5.5, through LN's composed Jacobian for pre-LN), with
  the noise ``v_block`` (Claim 5.3) of every weight, bias and LayerNorm parameter.
* **Logit variance** ``v_ij = Var[tau <Q_i, K_j>]``, first order in the noise, in three parts:
  the key's noise with the query fixed (eq. 5.2's ``C sigma_j^2``), computed by pulling the query
  back through ``W_K``, ``tau <q_i, W_K f(X_j)> = r_i . f(X_j)`` with ``r_i = tau W_K^T q_i``
  (:func:`~core.dp.moments.projected_variance`), which keeps the correlation ``W_K`` gives the key's
  coordinates; the same for the query's noise with the key fixed; and the product of the two. For
  ``i = j`` the query and the key read the same noisy token, and the covariance of the two read-outs
  is added. The paper fixes the query; the argument ``E[exp z] = exp(E z + v/2)`` holds for the
  whole logit, so we de-bias the whole ``v_ij``.
* **Correction** (Re-Attention): ``z_ij <- z_ij - v_ij / 2``, then the causal/padding mask, softmax.
* Attention mixing, ``W_o``, residual sums, ReLU (eq. 5.6 in its correct form; GELU: the model's
  own mean with ReLU's variance, Remark D.3) and LayerNorm by the rules of :mod:`core.dp.moments`.

**What is ignored** (the paper's layer-wise scheme): the correlations between the coordinates of a
token after the first attention, between positions (shared weight noise, one value mixed into
several positions), between a residual branch and its input, and the correction's own dependence on
the noise. The first block's logit variance is exact for post-LN (linear in the noise up to the
product term) and first order through pre-LN's LayerNorm; the later blocks' carry these omissions.
The tests compare every block with Monte Carlo (the DP noise sampled into every parameter of the
real model, the logits' variance measured) and state the bands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from core.dp.moments import (
    GaussianMoments,
    _check_nonnegative,
    _check_variance_tensor,
    add_moments,
    attention_moments,
    layer_norm_moments,
    linear_moments,
    projected_variance,
    relu_moments,
)
from core.errors import ConfigError, DataError
from core.models import PADDING_ID, TransformerSeqRec
from core.models.attention import attention_mask

__all__ = [
    "AttentionErrors",
    "BlockReAttention",
    "CorrectionSizes",
    "EffectiveErrors",
    "LogitPenalty",
    "propagate",
]

LayerNormParams = tuple[Tensor, Tensor, float]


@dataclass(frozen=True, eq=False)
class EffectiveErrors:
    """Per-coordinate effective error variances of a :class:`TransformerSeqRec`'s parameters.

    ``item (M+1,)``: Claim 5.4 per item row; ``position (P,)``: per position row (Claim 5.4 with the
    fraction of sequences reaching the position); ``block``: Claim 5.3, every weight, bias and LayerNorm
    parameter inside the blocks.
    """

    item: Tensor
    position: Tensor
    block: float

    def __post_init__(self) -> None:
        for name in ("item", "position"):
            value = getattr(self, name)
            if value.dim() != 1 or not value.is_floating_point():
                raise ConfigError(f"{name} must be a float tensor (rows,), got shape {tuple(value.shape)}")
            _check_variance_tensor(name, value)
        _check_nonnegative("block", self.block)


@dataclass(frozen=True, eq=False)
class AttentionErrors:
    """One block's attention: propagated mean logits ``(B, H, L, L)`` before the correction, their
    variance ``logit_var`` (the correction is ``logit_var / 2``), and the scalar (mean per-coordinate)
    query and key variances ``(B, H, L)``, the paper's ``sigma_j^2``."""

    logits: Tensor
    logit_var: Tensor
    query_var: Tensor
    key_var: Tensor

    @property
    def penalty(self) -> Tensor:
        """The Re-Attention correction ``v_ij / 2`` in nats, ``(B, H, L, L)``."""
        return self.logit_var / 2


@dataclass(frozen=True, eq=False)
class LogitPenalty:
    """A precomputed correction of one block, ``logits - penalty``; a model ``score_correction``."""

    penalty: Tensor

    def __call__(self, logits: Tensor) -> Tensor:
        if logits.shape != self.penalty.shape:
            raise DataError(
                f"logits of shape {tuple(logits.shape)} do not match the penalty's {tuple(self.penalty.shape)}"
            )
        return logits - self.penalty.to(logits.dtype)


# ==================================================================================================
# propagation
# ==================================================================================================


def _embedding_moments(model: TransformerSeqRec, ids: Tensor, errors: EffectiveErrors) -> GaussianMoments:
    """``x_0 = (E[ids] + P[pos]) * valid`` (right-aligned positions, as the model) and its variance."""
    L = ids.shape[1]
    start = model.cfg.max_len - L
    valid = (ids != PADDING_ID).unsqueeze(-1)  # (B, L, 1)
    weight, table = model.item_emb.weight.detach(), model.pos_emb.weight.detach()
    mean = (weight[ids] + table[start:]) * valid
    var = (errors.item.to(weight)[ids] + errors.position.to(weight)[start:]) * valid.squeeze(-1)  # (B, L)
    return GaussianMoments(mean, var.unsqueeze(-1).expand_as(mean))


def _layer_norm(module: torch.nn.LayerNorm) -> LayerNormParams:
    return module.weight.detach(), module.bias.detach(), module.eps


def _normed(x: GaussianMoments, ln: LayerNormParams, v_block: float) -> GaussianMoments:
    weight, bias, eps = ln
    return layer_norm_moments(x, weight=weight, bias=bias, eps=eps, weight_var=v_block, bias_var=v_block)


def _project(x: GaussianMoments, linear: torch.nn.Linear, v_block: float, ln: LayerNormParams | None):
    """``Linear(f(x))``, ``f`` = the LayerNorm ``ln`` or identity: per-coordinate moments ``(..., out)``."""
    weight, bias = linear.weight.detach(), linear.bias.detach()
    if ln is None:
        return linear_moments(x, weight, weight_var=v_block, bias=bias, bias_var=v_block)
    normed = _normed(x, ln, v_block)
    from_input = projected_variance(x, weight, layer_norm=ln, layer_norm_var=v_block).transpose(-1, -2)
    second_moment = (normed.full_var() + normed.mean.pow(2)).sum(dim=-1, keepdim=True)  # (..., 1)
    return GaussianMoments(normed.mean @ weight.T + bias, from_input + v_block * (second_moment + 1))


def _split(t: Tensor, heads: int) -> Tensor:
    B, L, d = t.shape
    return t.view(B, L, heads, d // heads).transpose(1, 2)  # (B, heads, L, head_dim)


def _merge(t: Tensor) -> Tensor:
    B, H, L, D = t.shape
    return t.transpose(1, 2).reshape(B, L, H * D)  # (B, L, d)


def _logit_variance(x: GaussianMoments, attn, q: GaussianMoments, k: GaussianMoments, v_block: float, ln):
    """``Var[tau <Q_i, K_j>]`` ``(B, H, L, L)`` from the attention input ``x (B, L, d)`` (module docstring).

    ``q``/``k``: the projections' per-head moments ``(B, H, L, d_h)``; ``ln``: the LayerNorm before the
    projections (pre-LN) or None.
    """
    H, D = attn.n_heads, attn.head_dim
    tau = 1.0 / math.sqrt(D)
    w_q = attn.q_proj.weight.detach().view(H, D, -1)  # (heads, head_dim, d)
    w_k = attn.k_proj.weight.detach().view(H, D, -1)
    tokens = GaussianMoments(x.mean.unsqueeze(1), x.full_var().unsqueeze(1))  # (B, 1, L, d)
    pull_q = tau * torch.einsum("bhic,hcm->bhim", q.mean, w_k)  # r_i = tau W_K^T q_i, (B, H, L, d)
    pull_k = tau * torch.einsum("bhjc,hcm->bhjm", k.mean, w_q)  # s_j = tau W_Q^T k_j
    kw = {"layer_norm": ln, "layer_norm_var": v_block}
    key_noise = projected_variance(tokens, pull_q, **kw)  # (B, H, Lq, Lk)
    query_noise = projected_variance(tokens, pull_k, **kw).transpose(-1, -2)
    # the projections' weight and bias noise: tau^2 |q_i|^2 v_block (sum_m E[f(x_j)_m^2] + 1), and the same for k
    f_x = x if ln is None else _normed(x, ln, v_block)
    second = (f_x.full_var() + f_x.mean.pow(2)).sum(dim=-1).unsqueeze(1) + 1  # (B, 1, L)
    q_norm2, k_norm2 = q.mean.pow(2).sum(-1), k.mean.pow(2).sum(-1)  # (B, H, L)
    weight_noise = q_norm2.unsqueeze(-1) * second.unsqueeze(-2) + second.unsqueeze(-1) * k_norm2.unsqueeze(-2)
    weight_noise = tau**2 * v_block * weight_noise  # (B, H, Lq, Lk)
    # both noises: tau^2 tr(Cov Q_i Cov K_j); the input parts are W diag(v) W^T, so their product's trace is
    # v_i^T (W_Q^T W_K)^2 v_j, and the weight/bias noise is isotropic per coordinate (v_block * second)
    v_in = f_x.full_var().unsqueeze(1)  # (B, 1, L, d)
    overlap = torch.einsum("hcm,hcn->hmn", w_q, w_k).pow(2)  # (heads, d, d)
    w_noise = v_block * second  # (B, 1, L), per coordinate
    q_in = q.full_var().sum(-1) - D * w_noise  # (B, H, L), tr Cov of the input part
    k_in = k.full_var().sum(-1) - D * w_noise
    both = (v_in @ overlap) @ v_in.transpose(-1, -2)  # (B, H, L, L)
    both = both + q_in.unsqueeze(-1) * w_noise.unsqueeze(-2) + w_noise.unsqueeze(-1) * k_in.unsqueeze(-2)
    both = tau**2 * (both + D * w_noise.unsqueeze(-1) * w_noise.unsqueeze(-2))
    # i = j: Q_i and K_i read the same noisy token; add 2 Cov = Var[(r + s) . f] - Var[r . f] - Var[s . f]
    paired = {**kw, "pairwise": False}
    cov2 = (
        projected_variance(tokens, pull_q + pull_k, **paired)
        - projected_variance(tokens, pull_q, **paired)
        - projected_variance(tokens, pull_k, **paired)
    )  # (B, H, L)
    return (key_noise + query_noise + weight_noise + both + torch.diag_embed(cov2)).clamp_min(0)


def _attention(x: GaussianMoments, attn, valid: Tensor, v_block: float, ln, correct: bool):
    """``W_o softmax(z - v/2 + mask) V``: the sub-layer's output moments and its :class:`AttentionErrors`."""
    H = attn.n_heads
    q, k, v = (_project(x, proj, v_block, ln) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k, v = (GaussianMoments(_split(m.mean, H), _split(m.full_var(), H)) for m in (q, k, v))
    logits = q.mean @ k.mean.transpose(-1, -2) / math.sqrt(attn.head_dim)  # (B, heads, L, L)
    logit_var = _logit_variance(x, attn, q, k, v_block, ln)
    errors = AttentionErrors(logits, logit_var, q.full_var().mean(-1), k.full_var().mean(-1))
    corrected = logits - errors.penalty if correct else logits
    probs = F.softmax(corrected.masked_fill(~attention_mask(valid), float("-inf")), dim=-1)
    mixed = attention_moments(probs, logit_var, v)  # (B, heads, L, head_dim)
    out = GaussianMoments(_merge(mixed.mean), _merge(mixed.full_var()))
    return _project(out, attn.out_proj, v_block, None), errors


def _feed_forward(x: GaussianMoments, ff, v_block: float, ln: LayerNormParams | None) -> GaussianMoments:
    """``fc2(act(fc1(f(x))))``, the activation by eq. 5.6 (GELU: its own mean, ReLU's variance)."""
    hidden = _project(x, ff.fc1, v_block, ln)
    act = relu_moments(hidden)
    if not isinstance(ff.act, torch.nn.ReLU):
        act = GaussianMoments(ff.act(hidden.mean), act.var)
    return _project(act, ff.fc2, v_block, None)


@torch.no_grad()
def propagate(
    model: TransformerSeqRec, input_ids: Tensor, errors: EffectiveErrors, *, correct: bool = True
) -> list[AttentionErrors]:
    """Propagate ``errors`` through every block of ``model`` for ``input_ids (B, L)``: one
    :class:`AttentionErrors` per block, first block first (module docstring).

    ``correct``: apply each block's Re-Attention correction to the means before the next block, as the
    corrected model does; False propagates through the uncorrected model.
    """
    if not isinstance(model, TransformerSeqRec):
        raise ConfigError(f"error propagation needs a TransformerSeqRec (attention), got {type(model).__name__}")
    model.check_input(input_ids)
    if errors.item.shape != (model.cfg.vocab_size,) or errors.position.shape != (model.cfg.max_len,):
        raise ConfigError(
            f"errors must have item ({model.cfg.vocab_size},) and position ({model.cfg.max_len},) variances, "
            f"got {tuple(errors.item.shape)} and {tuple(errors.position.shape)}"
        )
    valid = input_ids != PADDING_ID
    vb = float(errors.block)
    x = _embedding_moments(model, input_ids, errors)
    out: list[AttentionErrors] = []
    for k, block in enumerate(model.blocks):
        ln = _layer_norm(block.ln_attn) if block.norm_first else None
        attended, errs = _attention(x, block.attn, valid, vb, ln, correct)
        out.append(errs)
        if k == len(model.blocks) - 1:  # no attention after the last block's feed-forward
            break
        if block.norm_first:
            x = add_moments(x, attended)
            x = add_moments(x, _feed_forward(x, block.ff, vb, _layer_norm(block.ln_ff)))
        else:
            x = _normed(add_moments(x, attended), _layer_norm(block.ln_attn), vb)
            x = _normed(add_moments(x, _feed_forward(x, block.ff, vb, None)), _layer_norm(block.ln_ff), vb)
    return out


# ==================================================================================================
# the correction of every block, and its size
# ==================================================================================================


class BlockReAttention:
    """Re-Attention in every block of ``model``; :meth:`for_batch` gives one :class:`LogitPenalty` per block.

    The parameters are read from ``model`` at every call, so the corrections follow training.
    ``chunk_size`` sequences are propagated at a time (the propagation holds several ``(B, H, L, L)``
    tensors).
    """

    def __init__(self, model: TransformerSeqRec, errors: EffectiveErrors, *, chunk_size: int = 256) -> None:
        if not isinstance(model, TransformerSeqRec):
            raise ConfigError(f"Re-Attention needs a TransformerSeqRec (attention), got {type(model).__name__}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive int, got chunk_size={chunk_size!r}")
        self.model = model
        self.errors = errors
        self.chunk_size = chunk_size

    def propagate(self, input_ids: Tensor) -> list[AttentionErrors]:
        """:func:`propagate` (corrected) for this model, ``chunk_size`` sequences at a time."""
        chunks = [propagate(self.model, ids, self.errors) for ids in input_ids.split(self.chunk_size)]
        if len(chunks) == 1:
            return chunks[0]
        names = [f.name for f in fields(AttentionErrors)]
        return [
            AttentionErrors(**{n: torch.cat([getattr(c[k], n) for c in chunks]) for n in names})
            for k in range(len(chunks[0]))
        ]

    @staticmethod
    def corrections(errors: list[AttentionErrors]) -> tuple[LogitPenalty, ...]:
        """The model's ``score_correction`` (one per block) from :meth:`propagate`'s output."""
        return tuple(LogitPenalty(e.penalty) for e in errors)

    def for_batch(self, input_ids: Tensor) -> tuple[LogitPenalty, ...]:
        """The per-block corrections for ``input_ids (B, L)``."""
        return self.corrections(self.propagate(input_ids))


def _sizes(errors: AttentionErrors, valid: Tensor) -> tuple[float, float, float] | None:
    """``(median, max)`` of the penalty over the logits that count (a real query, a real key at or before
    it) and the mean total-variation distance between the corrected and uncorrected attention of the
    real queries; None without a real query."""
    allowed = attention_mask(valid)  # (B, 1, L, L)
    counted = allowed & valid[:, None, :, None]
    penalty = errors.penalty[counted.expand_as(errors.penalty)]
    if penalty.numel() == 0:
        return None
    plain = F.softmax(errors.logits.masked_fill(~allowed, float("-inf")), dim=-1)
    fixed = F.softmax((errors.logits - errors.penalty).masked_fill(~allowed, float("-inf")), dim=-1)
    tv = (plain - fixed).abs().sum(dim=-1) / 2  # (B, H, L)
    tv = tv[valid[:, None, :].expand_as(tv)]
    return float(penalty.median()), float(penalty.max()), float(tv.mean())


class CorrectionSizes:
    """How large each block's Re-Attention correction is, over one epoch's batches.

    :meth:`add` a batch's :class:`AttentionErrors` with its epoch; a new epoch starts a new tally.
    :meth:`metrics`: per block ``k`` (1 = first), over the latest epoch's batches, ``reattention.block<k>.``
    ``correction_median`` (mean of the batches' medians) and ``correction_max`` (their maximum), in nats,
    over the logits that count, and ``attention_tv`` (mean over the batches of the real queries' mean
    total-variation distance between corrected and uncorrected attention, in the propagated means).
    """

    def __init__(self) -> None:
        self.epoch: int | None = None
        self._batches: list[list[tuple[float, float, float]]] = []

    def add(self, epoch: int, errors: list[AttentionErrors], input_ids: Tensor) -> None:
        if epoch != self.epoch:
            self.epoch, self._batches = epoch, []
        sizes = [_sizes(e, input_ids != PADDING_ID) for e in errors]
        if all(s is not None for s in sizes):
            self._batches.append(sizes)

    def metrics(self) -> dict[str, float]:
        if not self._batches:
            return {}
        out: dict[str, float] = {}
        for k in range(len(self._batches[0])):
            medians, maxima, tvs = zip(*(batch[k] for batch in self._batches), strict=True)
            prefix = f"reattention.block{k + 1}."
            out[prefix + "correction_median"] = sum(medians) / len(medians)
            out[prefix + "correction_max"] = max(maxima)
            out[prefix + "attention_tv"] = sum(tvs) / len(tvs)
        return out
