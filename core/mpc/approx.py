"""MPC-friendly approximations of GPT-2 (MPCFormer, THE-X) in plaintext, and MPCFormer's distillation.

:class:`ApproxGPT2` re-runs a Hugging Face ``GPT2LMHeadModel``'s own weights (copied) with a hand-written
forward whose three nonlinearities are pluggable (:class:`Approximation`):

* softmax over causal attention scores ``s`` (B, H, N, N), with ``mask`` the causal mask and ``n`` a query's number
  of unmasked keys; every form but ``exact`` is :func:`core.mpc.ops.plain_softmax`, the plaintext twin of the
  encrypted one, so the model distilled is the model run under MPC:
  ``exact``: ``softmax(s)`` over unmasked keys;
  ``2relu`` (MPCFormer, Li et al. 2022; MERGE Sec. 2): ``relu(s + c) * mask / (sum(relu(s + c) * mask) + eps n)``
  with ``eps = ops.RELU_EPS`` (1e-3 a key: the encrypted reciprocal's floor);
  ``2quad`` (MPCFormer): ``(s + c)^2 * mask / sum((s + c)^2 * mask)``, c = 5 as in MPCFormer;
  ``thex`` (our reading of THE-X, Chen et al. 2022): ``exp`` replaced by ``relu(s + c)`` (c = 3) so the
  score stays non-negative without a max, normalised by the masked sum (THE-X estimates the reciprocal
  with a small trained network under HE; in plaintext/MPC we divide exactly).
  Masked (future) keys contribute exactly 0, so causality is kept.
* MLP activation: ``gelu_new`` (GPT-2), ``quad`` = ``0.125 x^2 + 0.25 x + 0.5`` (MPCFormer), ``relu`` (THE-X).
* LayerNorm: ``exact`` or ``affine`` = ``x * gamma + beta`` (THE-X's LayerNorm replacement, learned by
  distillation; MERGE's ``f'_ln``), applied to every LN including the final one.

Registry :data:`APPROXIMATIONS`: ``mpcformer_2relu`` (2ReLU + Quad), ``mpcformer_2quad`` (2Quad + Quad),
``thex`` (ReLU-softmax + ReLU + affine LN), ``exact`` (reference, equals the HF model).

:func:`distill` is MPCFormer's two-stage distillation: layer-wise (MSE of every hidden state and attention
map, student vs teacher), then prediction layer (KL of the token distributions at temperature T).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from core.divergence import DivergenceGuard
from core.errors import ConfigError
from core.mpc.merge_spec import activation
from core.registry import lookup

SoftmaxKind = Literal["exact", "2relu", "2quad", "thex"]
ActKind = Literal["gelu_new", "quad", "relu"]
LNKind = Literal["exact", "affine"]


@dataclass(frozen=True, kw_only=True)
class Approximation:
    """Which nonlinearity replaces which (see the module docstring); ``c`` is the softmax offset."""

    softmax: SoftmaxKind = "exact"
    act: ActKind = "gelu_new"
    layernorm: LNKind = "exact"
    c: float = 0.0

    def __post_init__(self) -> None:
        for field, allowed in (
            ("softmax", ("exact", "2relu", "2quad", "thex")),
            ("act", ("gelu_new", "quad", "relu")),
            ("layernorm", ("exact", "affine")),
        ):
            if getattr(self, field) not in allowed:
                raise ConfigError(f"Approximation.{field} must be one of {allowed}, got {getattr(self, field)!r}")


APPROXIMATIONS: dict[str, Approximation] = {
    "exact": Approximation(),
    "mpcformer_2relu": Approximation(softmax="2relu", act="quad", c=0.0),
    "mpcformer_2quad": Approximation(softmax="2quad", act="quad", c=5.0),
    "thex": Approximation(softmax="thex", act="relu", layernorm="affine", c=3.0),
}


def get_approximation(name: str) -> Approximation:
    """The registered :class:`Approximation` ``name``; unknown -> :class:`ConfigError` listing the known ones."""
    return lookup("MPC approximation", APPROXIMATIONS, name)


def causal_mask(n: int, device=None) -> torch.Tensor:
    """(N, N) bool, True where key j <= query i."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def approx_softmax(scores: torch.Tensor, kind: str, c: float = 0.0) -> torch.Tensor:
    """Causal attention probabilities from scores (..., N, N) with the given approximation (module docstring):
    the approximations are :func:`core.mpc.ops.plain_softmax` (THE-X's is its ``2relu`` at ``c``), masked keys
    contributing exactly 0."""
    from core.mpc import ops  # the encrypted forms' plaintext twins

    mask = causal_mask(scores.shape[-1], scores.device)
    if kind == "exact":
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    if kind not in ("2relu", "2quad", "thex"):
        raise ConfigError(f"unknown softmax approximation {kind!r}; known: exact, 2relu, 2quad, thex")
    n = scores.shape[-1]
    keep = ops.causal_mask(n, n, scores.device).to(scores.dtype)
    return ops.plain_softmax(scores, kind="2relu" if kind == "thex" else kind, mask=keep, c=c)


def _norm(ln: nn.LayerNorm, x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "affine":
        return x * ln.weight + ln.bias  # f'_ln(x) = x * gamma + beta
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


@dataclass
class ApproxOutput:
    """logits (B, N, V); hidden: n_layer + 1 tensors (B, N, d) (embeddings, then each block's output, the
    last one after the final LN, like HF's ``hidden_states``); attentions: n_layer tensors (B, H, N, N)."""

    logits: torch.Tensor
    hidden: list[torch.Tensor]
    attentions: list[torch.Tensor]


class ApproxGPT2(nn.Module):
    """A GPT-2 LM with MPC-friendly nonlinearities, initialised from a HF ``GPT2LMHeadModel``.

    Args:
        hf_model: the (fine-tuned) teacher; its modules are deep-copied unless ``share=True``.
        approx: an :class:`Approximation` or a registry name.
        share: reuse the teacher's modules (for running the teacher itself through this forward).
    """

    def __init__(self, hf_model: nn.Module, approx: Approximation | str = "exact", *, share: bool = False):
        super().__init__()
        self.approx = get_approximation(approx) if isinstance(approx, str) else approx
        src = hf_model if share else copy.deepcopy(hf_model)
        cfg = src.config
        self.n_head, self.d = cfg.n_head, cfg.n_embd
        self.wte, self.wpe, self.h, self.ln_f = (
            src.transformer.wte,
            src.transformer.wpe,
            src.transformer.h,
            src.transformer.ln_f,
        )
        self.lm_head = src.lm_head
        self.scale = bool(getattr(cfg, "scale_attn_weights", True))

    @property
    def n_positions(self) -> int:
        return int(self.wpe.weight.shape[0])

    def _attn(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, N, _ = x.shape
        q, k, v = block.attn.c_attn(x).split(self.d, dim=-1)  # each (B, N, d)
        q, k, v = (t.view(B, N, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
        scores = q @ k.transpose(-1, -2)  # (B, H, N, N)
        if self.scale:
            scores = scores / math.sqrt(q.shape[-1])
        probs = approx_softmax(scores, self.approx.softmax, self.approx.c)
        out = (probs @ v).transpose(1, 2).reshape(B, N, self.d)  # (B, N, d)
        return block.attn.resid_dropout(block.attn.c_proj(block.attn.attn_dropout(out))), probs

    def forward(
        self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None
    ) -> ApproxOutput:
        """Either ``input_ids`` (B, N) or token ``inputs_embeds`` (B, N, d) (positions are added here)."""
        if inputs_embeds is None:
            if input_ids is None:
                raise ConfigError("pass input_ids or inputs_embeds")
            inputs_embeds = self.wte(input_ids)
        n = inputs_embeds.shape[1]
        if n > self.n_positions:
            raise ConfigError(f"sequence length {n} exceeds n_positions={self.n_positions}")
        x = inputs_embeds + self.wpe.weight[:n]
        hidden, attns = [x], []
        ln = self.approx.layernorm
        for block in self.h:
            a, probs = self._attn(block, _norm(block.ln_1, x, ln))
            x = x + a
            m = block.mlp.c_fc(_norm(block.ln_2, x, ln))
            x = x + block.mlp.dropout(block.mlp.c_proj(activation(self.approx.act, m)))
            hidden.append(x)
            attns.append(probs)
        hidden[-1] = _norm(self.ln_f, x, ln)
        return ApproxOutput(logits=self.lm_head(hidden[-1]), hidden=hidden, attentions=attns)


def _as_approx(model: nn.Module) -> nn.Module:
    """``model`` run through the exact approximated forward of its architecture (GPT-2, or LLaMA:
    :class:`core.mpc.approx_llama.ApproxLlama`), its modules shared."""
    from core.mpc.approx_llama import ApproxLlama, is_llama

    if isinstance(model, ApproxGPT2 | ApproxLlama):
        return model
    return ApproxLlama(model, "exact", share=True) if is_llama(model) else ApproxGPT2(model, "exact", share=True)


def _mean(se: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Mean of (B, N, d) ``se`` over the real positions (``w`` (B, N, 1) weights; None: all)."""
    return se.mean() if w is None else (se * w).sum() / (w.sum() * se.shape[-1])


def layerwise_loss(
    student: ApproxOutput, teacher: ApproxOutput, mask: torch.Tensor | None = None, *, relative: bool = False
) -> torch.Tensor:
    """MPCFormer stage 1: sum over layers of MSE(hidden) + MSE(attention), averaged over real positions.

    ``relative``: each layer's hidden MSE divided by the teacher's mean square of that layer (detached), as
    :class:`core.mpc.merge.MMConfig`'s ``relative_hidden`` (SmolLM2's attention-sink position has a mean square
    near 1e6 and would otherwise be the whole loss)."""
    w = None if mask is None else mask.to(student.logits.dtype)[..., None]  # (B, N, 1)
    loss = student.logits.new_zeros(())
    for hs, ht in zip(student.hidden, teacher.hidden, strict=True):
        mse = _mean((hs - ht).pow(2), w)
        if relative:
            mse = mse / (_mean(ht.pow(2), w).detach() + 1e-12)
        loss = loss + mse
    for a_s, a_t in zip(student.attentions, teacher.attentions, strict=True):
        loss = loss + F.mse_loss(a_s, a_t)
    return loss


def logits_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """MPCFormer stage 2: ``T^2 * KL(softmax(t/T) || softmax(s/T))`` per position, averaged over real positions."""
    t = temperature
    kl = F.kl_div(
        F.log_softmax(student_logits / t, -1), F.log_softmax(teacher_logits / t, -1), log_target=True, reduction="none"
    ).sum(-1)  # (B, N)
    if mask is not None:
        return (kl * mask).sum() / mask.sum().clamp_min(1) * t * t
    return kl.mean() * t * t


def _unpack(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None
    ids, mask = batch
    return ids, mask


def distill(
    teacher: nn.Module,
    student: nn.Module,
    batches: Sequence | Iterable,
    steps: int,
    lr: float,
    *,
    layerwise_fraction: float = 0.5,
    temperature: float = 1.0,
    relative: bool = False,
) -> list[float]:
    """MPCFormer distillation of ``student`` from the frozen fine-tuned ``teacher``.

    Args:
        teacher: a HF ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (run through the exact approximated forward of its
            architecture), or such a forward.
        student: the approximated model, usually ``ApproxGPT2(teacher, name)`` or ``ApproxLlama(teacher, name)``.
        batches: cycled; each an ids tensor (B, N) or (ids, mask) with mask (B, N) bool.
        steps: optimizer steps; the first ``round(layerwise_fraction * steps)`` minimise
            :func:`layerwise_loss`, the rest :func:`logits_kd_loss`.
        lr: AdamW learning rate.
        relative: the layer-wise stage's hidden MSE per layer relative to the teacher's scale
            (:func:`layerwise_loss`).

    Returns:
        the loss of every step.
    """
    if steps < 1 or lr <= 0 or not 0 <= layerwise_fraction <= 1:
        raise ConfigError(
            f"distill needs steps >= 1, lr > 0, 0 <= layerwise_fraction <= 1; got {steps=}, "
            f"{lr=}, {layerwise_fraction=}"
        )
    batches = list(batches)
    if not batches:
        raise ConfigError("distill needs at least one batch, got none")
    teacher_fwd = _as_approx(teacher).eval()
    opt = torch.optim.AdamW(student.parameters(), lr=lr)
    student.train()
    n_layerwise = round(layerwise_fraction * steps)
    hint = f"lower the distillation learning rate (lr={lr:g})"
    guard = DivergenceGuard(hint=hint)
    losses = []
    for step in range(steps):
        if step == n_layerwise:  # the logits stage is judged against its own start, not the layer-wise loss's
            guard = DivergenceGuard(hint=hint)
        ids, mask = _unpack(batches[step % len(batches)])
        with torch.no_grad():
            t_out = teacher_fwd(ids)
        s_out = student(ids)
        if step < n_layerwise:
            loss = layerwise_loss(s_out, t_out, mask, relative=relative)
        else:
            loss = logits_kd_loss(s_out.logits, t_out.logits, mask, temperature)
        losses.append(guard.check(loss, step=step + 1))  # DivergedError: NaN/inf or exploding
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses
