"""Encrypted LLaMA-architecture forward and greedy generation under 2-party CrypTen MPC (SmolLM2-135M and its kin:
RMSNorm, SwiGLU, rotary positions, grouped K/V heads), with the generation modes of :mod:`core.mpc.gpt2`.

What differs from GPT-2, each on shares:

* RMSNorm (:func:`core.mpc.ops.rms_norm`, no mean, no bias) in its wide-range form: SmolLM2's residual stream
  reaches a mean square of 1e6 at its first position, far past where CrypTen's inverse square root converges, so
  each norm first brackets the mean square between powers of 4 by one batched comparison
  (:func:`core.mpc.ops.wide_rms_scale`);
* the exact softmax floors ``x - max`` at -64 before CrypTen's ``exp``, as T5's (:data:`core.mpc.ops.SOFTMAX_FLOOR`);
* rotary positions: ``q * cos + rotate_half(q) * sin`` with the cos/sin of each position public (positions are),
  taken from the Hugging Face model's own rotary module when the weights are read (so any rope scaling it applies
  is the one run here); products by public values, no communication beyond the truncation;
* grouped K/V heads: each K/V head serves ``H / H_kv`` query heads (a local copy of the shares);
* the SwiGLU MLP ``down(silu(gate x) * up x)``, ``silu(x) = x * sigmoid(x)`` with CrypTen's sigmoid (exp of -|x|,
  sound for |x| < 512; the gate's product is Activation);
* the LM head (tied to the token table in SmolLM2, or untied).

``vanilla``, ``vanilla_kv`` and ``vanilla_er`` are :meth:`core.mpc.gpt2.EncryptedGPT2.generate`'s loop on this
network (the class reuses it). Embedding resending applies to any decoder; MERGE's constant attention makes the
rotary positions of Q and K irrelevant, so the merge module applies too (:mod:`core.mpc.llama_merge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter, OpCategory
from core.mpc.crypten_compat import import_crypten
from core.mpc.gpt2 import GENERATION_MODES, EncryptedGPT2, MPCVariant, check_lengths, check_mode

CrypTensor = Any


@dataclass(frozen=True)
class LlamaLayer:
    """One block's plaintext weights, row-vector layout (``x @ W``): ``q`` (d, H D), ``k``, ``v`` (d, H_kv D), ``o``
    (H D, d), ``gate``, ``up`` (d, F), ``down`` (F, d), the two RMSNorm gains ``ln1``, ``ln2`` (d,)."""

    ln1: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class LlamaWeights:
    """Plaintext weights, picklable to the parties: ``embed`` (V, d), ``lm_head`` (V, d), ``norm`` (d,), the rotary
    ``cos``/``sin`` tables (n_positions, D), heads, K/V heads, head size and the RMSNorm epsilon."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    layers: tuple[LlamaLayer, ...]
    norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float

    def __post_init__(self) -> None:
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"{self.n_head} query heads cannot share {self.n_kv_head} K/V heads evenly")

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.cos.shape[0])


def weights_from_hf(model: Any, n_positions: int = 256) -> LlamaWeights:
    """A Hugging Face ``LlamaForCausalLM``'s weights, with the rotary tables of positions ``0..n_positions-1``."""
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={cfg.hidden_act!r} has no MPC form here; LLaMA's is silu")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ConfigError("attention_bias / mlp_bias: biased LLaMA variants are not supported")
    dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    f = lambda p: p.detach().to(dtype).cpu().clone()
    t = lambda lin: f(lin.weight).t().contiguous()  # nn.Linear stores (out, in)
    inner = model.model
    layers = tuple(
        LlamaLayer(
            ln1=f(b.input_layernorm.weight), q=t(b.self_attn.q_proj), k=t(b.self_attn.k_proj),
            v=t(b.self_attn.v_proj), o=t(b.self_attn.o_proj), ln2=f(b.post_attention_layernorm.weight),
            gate=t(b.mlp.gate_proj), up=t(b.mlp.up_proj), down=t(b.mlp.down_proj),
        )
        for b in inner.layers
    )  # fmt: skip
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    positions = torch.arange(n_positions)[None]
    probe = torch.zeros(1, n_positions, head_dim, dtype=dtype)
    with torch.no_grad():
        cos, sin = inner.rotary_emb(probe, positions)  # (1, n, D) each
    return LlamaWeights(
        embed=f(inner.embed_tokens.weight),
        lm_head=f(model.lm_head.weight),
        layers=layers,
        norm=f(inner.norm.weight),
        cos=cos[0].to(dtype),
        sin=sin[0].to(dtype),
        n_head=int(cfg.num_attention_heads),
        n_kv_head=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        head_dim=head_dim,
        eps=float(cfg.rms_norm_eps),
    )


def rotate_half(x: Any) -> Any:
    """(x1, x2) -> (-x2, x1) on the last dim (plaintext or shares: a local reordering)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    if isinstance(x, torch.Tensor):
        return torch.cat([-x2, x1], dim=-1)
    return import_crypten().cat([-x2, x1], dim=-1)


# --- plaintext reference -----------------------------------------------------------------------------------
def _plain_block(w: LlamaWeights, layer: LlamaLayer, h: torch.Tensor, v: MPCVariant, start: int) -> torch.Tensor:
    B, N, _ = h.shape
    H, Hk, D = w.n_head, w.n_kv_head, w.head_dim
    x = ops.plain_rms_norm(h, layer.ln1, eps=w.eps, kind=v.norm)
    q = (x @ layer.q).view(B, N, H, D).transpose(1, 2)
    k = (x @ layer.k).view(B, N, Hk, D).transpose(1, 2)
    val = (x @ layer.v).view(B, N, Hk, D).transpose(1, 2)
    cos, sin = w.cos[start : start + N], w.sin[start : start + N]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    rep = H // Hk
    k, val = k.repeat_interleave(rep, dim=1), val.repeat_interleave(rep, dim=1)
    probs = ops.plain_softmax(q @ k.transpose(2, 3) / math.sqrt(D), kind=v.softmax, mask=ops.causal_mask(N, N),
                              c=v.softmax_c)  # fmt: skip
    h = h + (probs @ val).transpose(1, 2).reshape(B, N, H * D) @ layer.o
    x = ops.plain_rms_norm(h, layer.ln2, eps=w.eps, kind=v.norm)
    act = "silu" if v.activation == "gelu" else v.activation  # the exact variant runs the model's own SiLU
    return h + (ops.plain_activation(x @ layer.gate, kind=act) * (x @ layer.up)) @ layer.down


def plaintext_hidden(w: LlamaWeights, v: MPCVariant, emb: torch.Tensor) -> torch.Tensor:
    """Final hidden states (after the last RMSNorm) of (B, N, d) input embeddings at positions 0..N-1."""
    h = emb
    for layer in w.layers:
        h = _plain_block(w, layer, h, v, 0)
    return ops.plain_rms_norm(h, w.norm, eps=w.eps, kind=v.norm)


def plaintext_reference(
    w: LlamaWeights, variant: MPCVariant, prefix_ids: torch.Tensor, max_new_tokens: int, *, mode: str = "vanilla"
) -> torch.Tensor:
    """Greedy tokens (B, max_new_tokens) in plaintext exactly as :meth:`EncryptedLlama.generate`."""
    check_mode(mode, GENERATION_MODES)
    check_lengths(prefix_ids.shape[1], max_new_tokens, w.n_positions)
    emb, ids, out = w.embed[prefix_ids], prefix_ids, []
    for _ in range(max_new_tokens):
        last = plaintext_hidden(w, variant, emb if mode == "vanilla_er" else w.embed[ids])[:, -1:]
        out.append((last @ w.lm_head.T).argmax(-1))
        if mode == "vanilla_er":
            emb = torch.cat([emb, last], dim=1)  # eq. 3
        else:
            ids = torch.cat([ids, out[-1]], dim=1)
    return torch.cat(out, dim=1)


# --- under MPC -------------------------------------------------------------------------------------------------
class EncryptedLlama(EncryptedGPT2):
    """A LLaMA-architecture decoder with secret-shared weights (party 0); ``generate`` is GPT-2's loop."""

    def __init__(
        self,
        weights: LlamaWeights,
        variant: MPCVariant,
        *,
        rank: int,
        device: str | torch.device = "cpu",
        meter: CostMeter | None = None,
    ) -> None:
        self.w, self.variant, self.rank, self.device = weights, variant, rank, torch.device(device)
        self.meter = meter if meter is not None else CostMeter()
        self.vocab_size, self.n_positions, self.n_head = weights.vocab_size, weights.n_positions, weights.n_head
        self.d = int(weights.embed.shape[1])
        self.act = "silu" if variant.activation == "gelu" else variant.activation
        self.cos, self.sin = weights.cos.float().to(self.device), weights.sin.float().to(self.device)
        setup = CostMeter()
        with setup.region():
            s = self._share
            self.wte = s(weights.embed)  # the name GPT-2's generate loop looks the tokens up in
            self.lm_head_t = s(weights.lm_head).t()
            self.layers = [
                {k: s(getattr(layer, k)) for k in LlamaLayer.__dataclass_fields__} for layer in weights.layers
            ]
            self.norm = s(weights.norm)
        self.setup_costs = setup.totals()

    def _rope(self, x: CrypTensor, start: int) -> CrypTensor:
        n = x.size(2)
        cos, sin = self.cos[start : start + n], self.sin[start : start + n]
        with self.meter.op(OpCategory.EMBED):  # LLaMA's positions
            return x * cos + rotate_half(x) * sin

    def _heads(self, x: CrypTensor, heads: int) -> CrypTensor:
        B, n = x.size(0), x.size(1)
        return x.view(B, n, heads, self.w.head_dim).transpose(1, 2)

    def _repeat(self, x: CrypTensor) -> CrypTensor:
        """(B, H_kv, T, D) -> (B, H, T, D): each K/V head copied for its group of query heads."""
        rep = self.w.n_head // self.w.n_kv_head
        if rep == 1:
            return x
        B, Hk, T, D = x.size(0), x.size(1), x.size(2), x.size(3)
        return import_crypten().stack([x] * rep, dim=2).reshape(B, Hk * rep, T, D)

    def _block(self, p: dict, h: CrypTensor, past: tuple | None, start: int = 0) -> tuple[CrypTensor, tuple]:
        m, v, w = self.meter, self.variant, self.w
        B, N = h.size(0), h.size(1)
        x = ops.rms_norm(h, p["ln1"], m, eps=w.eps, kind=v.norm, wide=True)
        q, k, val = (ops.linear(x, p[name], None, m) for name in ("q", "k", "v"))
        with m.op(OpCategory.LINEAR):
            q, k, val = self._heads(q, w.n_head), self._heads(k, w.n_kv_head), self._heads(val, w.n_kv_head)
        q, k = self._rope(q, start), self._rope(k, start)
        with m.op(OpCategory.LINEAR):
            q = q * (1.0 / math.sqrt(w.head_dim))
            if past is not None:
                crypten = import_crypten()
                k, val = crypten.cat([past[0], k], dim=2), crypten.cat([past[1], val], dim=2)
            kk, vv = self._repeat(k), self._repeat(val)
        T = kk.size(2)
        scores = ops.matmul(q, kk.transpose(2, 3), m)
        mask = None if N == 1 else ops.causal_mask(N, T, device=self.device)
        probs = ops.softmax(scores, m, kind=v.softmax, mask=mask, c=v.softmax_c, floor=ops.SOFTMAX_FLOOR)
        att = ops.matmul(probs, vv, m)
        with m.op(OpCategory.LINEAR):
            att = att.transpose(1, 2).reshape(B, N, w.n_head * w.head_dim)
        h = h + ops.linear(att, p["o"], None, m)
        x = ops.rms_norm(h, p["ln2"], m, eps=w.eps, kind=v.norm, wide=True)
        gate = ops.activation(ops.linear(x, p["gate"], None, m), m, kind=self.act)
        up = ops.linear(x, p["up"], None, m)
        with m.op(OpCategory.ACTIVATION):
            hidden = gate * up
        return h + ops.linear(hidden, p["down"], None, m), (k, val)

    def hidden(self, emb: CrypTensor, *, start: int = 0, past: list | None = None) -> tuple[CrypTensor, list]:
        n = emb.size(1)
        if start + n > self.n_positions:
            raise ConfigError(f"sequence length {start + n} exceeds the rotary tables' n_positions={self.n_positions}")
        h, caches = emb, []
        for i, p in enumerate(self.layers):
            h, kv = self._block(p, h, None if past is None else past[i], start)
            caches.append(kv)
        return ops.rms_norm(h, self.norm, self.meter, eps=self.w.eps, kind=self.variant.norm, wide=True), caches

    def logits(self, h: CrypTensor) -> CrypTensor:
        return ops.linear(h, self.lm_head_t, None, self.meter)
