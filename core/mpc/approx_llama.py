"""MPC-friendly approximations (MPCFormer, THE-X) of a LLaMA-architecture decoder (SmolLM2) in plaintext.

:class:`ApproxLlama` re-runs a Hugging Face ``LlamaForCausalLM``'s own modules (copied) with a hand-written forward
whose nonlinearities are :class:`core.mpc.approx.Approximation`'s, the same registry the GPT-2 students use:

* softmax over the causal attention scores: ``exact``, ``2relu``, ``2quad`` or ``thex``
  (:func:`core.mpc.approx.approx_softmax`);
* the SwiGLU gate's SiLU (``silu(gate x) * up x``): kept by the exact form (GPT-2's ``gelu_new`` names "the model's
  own" here), replaced by MPCFormer's ``quad`` or THE-X's ``relu`` as GPT-2's GELU is;
* RMSNorm: ``exact`` (``x / rms(x) * g``) or THE-X's ``affine``, on RMSNorm ``x * g`` (it has no bias; the MPC
  side's ``approx`` norm, :func:`core.mpc.ops.rms_norm`), applied to every norm including the final one.

Rotary positions and grouped K/V heads are the model's own. Its output is :class:`core.mpc.approx.ApproxOutput`,
so :func:`core.mpc.approx.distill` trains it; ``hf`` holds the (trained) modules in their Hugging Face model, which
:func:`core.mpc.llama.weights_from_hf` reads for the encrypted run with the matching ``MPCVariant``.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.approx import Approximation, ApproxOutput, approx_softmax, get_approximation

__all__ = ["ApproxLlama", "is_llama"]


def is_llama(model: nn.Module) -> bool:
    """A Hugging Face LLaMA-architecture causal LM (``model.model.layers`` of LLaMA blocks)."""
    return getattr(getattr(model, "config", None), "model_type", None) == "llama"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class ApproxLlama(nn.Module):
    """A LLaMA LM with MPC-friendly nonlinearities, initialised from a HF ``LlamaForCausalLM``.

    Args:
        hf_model: the (fine-tuned) teacher; deep-copied unless ``share=True``.
        approx: an :class:`~core.mpc.approx.Approximation` or a registry name.
        share: reuse the teacher's modules (to run the teacher itself through this forward).
    """

    def __init__(self, hf_model: nn.Module, approx: Approximation | str = "exact", *, share: bool = False) -> None:
        super().__init__()
        if not is_llama(hf_model):
            raise ConfigError(f"ApproxLlama needs a LLaMA-architecture model, got {type(hf_model).__name__}")
        self.approx = get_approximation(approx) if isinstance(approx, str) else approx
        self.hf = hf_model if share else copy.deepcopy(hf_model)
        cfg = self.hf.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={cfg.hidden_act!r}: ApproxLlama replaces LLaMA's silu gate only")
        self.n_head = int(cfg.num_attention_heads)
        self.n_kv_head = int(getattr(cfg, "num_key_value_heads", None) or self.n_head)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_head)
        self.eps = float(cfg.rms_norm_eps)
        self.act = "silu" if self.approx.act == "gelu_new" else self.approx.act

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kind = "approx" if self.approx.layernorm == "affine" else "exact"
        return ops.plain_rms_norm(x, norm.weight, eps=self.eps, kind=kind)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        B, N, _ = x.shape
        return x.view(B, N, heads, self.head_dim).transpose(1, 2)  # (B, heads, N, D)

    def _attn(
        self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        att = layer.self_attn
        B, N, _ = x.shape
        q = self._heads(att.q_proj(x), self.n_head)
        k = self._heads(att.k_proj(x), self.n_kv_head)
        v = self._heads(att.v_proj(x), self.n_kv_head)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rep = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, N, N)
        probs = approx_softmax(scores, self.approx.softmax, self.approx.c)
        out = (probs @ v).transpose(1, 2).reshape(B, N, self.n_head * self.head_dim)
        return att.o_proj(out), probs

    def forward(
        self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None
    ) -> ApproxOutput:
        """Either ``input_ids`` (B, N) or token ``inputs_embeds`` (B, N, d), at positions 0..N-1."""
        inner = self.hf.model
        if inputs_embeds is None:
            if input_ids is None:
                raise ConfigError("pass input_ids or inputs_embeds")
            inputs_embeds = inner.embed_tokens(input_ids)
        x = inputs_embeds
        positions = torch.arange(x.shape[1], device=x.device)[None]
        cos, sin = inner.rotary_emb(x, positions)  # (1, N, D) each
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # (1, 1, N, D): over the heads
        hidden, attns = [x], []
        for layer in inner.layers:
            a, probs = self._attn(layer, self._norm(layer.input_layernorm, x), cos, sin)
            x = x + a
            m = self._norm(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            x = x + mlp.down_proj(ops.plain_activation(mlp.gate_proj(m), kind=self.act) * mlp.up_proj(m))
            hidden.append(x)
            attns.append(probs)
        hidden[-1] = self._norm(inner.norm, x)
        return ApproxOutput(logits=self.hf.lm_head(hidden[-1]), hidden=hidden, attentions=attns)
