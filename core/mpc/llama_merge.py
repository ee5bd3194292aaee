"""MERGE's merge module (Liang et al. 2024, Sec. 4.3, eq. 8-11) on the LLaMA architecture (SmolLM2-135M and its
kin: RMSNorm, SwiGLU, rotary positions, grouped K/V heads), in plaintext and on two-party CrypTen shares.

What the merge module does to a LLaMA block (the GPT-2 form is :mod:`core.mpc.merge`, the T5 form
:mod:`core.mpc.t5_merge`):

* every attention's ``softmax(Q K^T / sqrt(D))`` becomes a learned constant, causal, row-stochastic ``C`` (H, N_max,
  N_max) initialised as the training-set average attention map (eq. 8, :func:`average_attention_llama`). Q and K are
  then unused, and with them the rotary positions: the merged model has no positional input at all (the positions
  live in ``C``'s rows);
* grouped K/V heads: query head h reads K/V head ``h // (H / H_kv)`` (Hugging Face's ``repeat_kv``), so the values
  keep their ``H_kv`` heads and each is mixed by the ``H / H_kv`` matrices of its group;
* the RMSNorm before the MLP becomes eq. 9's ``f'_ln(x) = x * g_2`` (RMSNorm has no bias: no ``beta``) and is folded
  into the gated MLP's two first matrices (eq. 10): ``M_gate = diag(g_2) W_gate``, ``M_up = diag(g_2) W_up``;
* the block's first RMSNorm and the final one are kept (eq. 11 keeps ``f_ln``); LLaMA has no biases, so eq. 10's
  merged biases are zero and left out. ``W_V`` and ``W_d`` keep their sizes (why: :mod:`core.mpc.merge_spec`).

One merged block (row-vector layout ``x @ W``; B batch, N positions, d hidden, H heads, H_kv K/V heads, D head size,
F MLP width)::

    g   = RMS(h; ln, eps)                                        # (B, N, d)  the kept f_ln of eq. 11
    v   = g @ W_V                                                # (B, N, H_kv D), split (B, H_kv, N, D)
    o_h = C[h, :N, :N] @ v_{h // (H / H_kv)}                     # (B, N, D)  head h's constant attention
    x   = h + concat_h(o_h) @ W_d                                # (B, N, d)  attention + residual
    out = x + (silu(x @ M_gate) * (x @ M_up)) @ W_down           # (B, N, d)  eq. 10-11, f'_ln folded

and the model ``h^0 = E`` (token embeddings, no positions), ``h^n = block_n(h^{n-1})``, ``H_out = RMS(h^L; norm,
eps)``, ``logits = H_out @ lm_head.T``. Generation by embedding resending (eq. 3, ``merge``) resends ``H_out``'s
last row as the next input embedding and never looks a token up after the prompt; ``mm`` selects a token every step
and looks its embedding up, like vanilla. Each step processes one position against per-layer running sums of the
constant attention (:class:`~core.mpc.merge_spec.MergeState`): its work does not depend on the prefix length.

:class:`LlamaMergeBlock` / :class:`LlamaMergeModel` are the unmerged, trainable form (``f'_ln`` as a gain, ``C`` as
logits; :func:`core.mpc.merge.train_mm` distils it from the Hugging Face model); :func:`export_llama_spec` folds it
into a :class:`LlamaMergeSpec`, which :func:`merged_forward` / :func:`merge_generate_plain` run in plaintext and
:class:`EncryptedLlamaMerge` on shares. On shares every RMSNorm runs in its wide-range form
(:func:`core.mpc.ops.rms_norm` with ``wide=True``: SmolLM2's residual stream reaches a mean square of 1e6).

Measured on the pretrained SmolLM2-135M: eq. 9's form is not usable there. Without the MLP's normalisation the
SwiGLU grows with the square of its input; at the eq. 8 start, on 32 dialogue sequences, the residual's mean square
passes 1e6 within 4 blocks and leaves float32's range by block 7, where the model's own stays below 1,000
(``tests/core/mpc/test_llama_merge.py``, slow); scaling ``g_2`` by the average inverse RMS (overall, or per position
over the training sequences) did not prevent it. So SmolLM2's merge module keeps the normalisation
(``mlp_norm="rms"``, :data:`MLP_NORMS`): the block above with ``x / rms(x)`` before ``M_gate`` and ``M_up``, one
wide-range RMSNorm per block more under MPC. It is distilled with each layer's error relative to its scale
(:class:`~core.mpc.merge.MMConfig`). The tiny models of the tests run both forms.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core.errors import ConfigError
from core.mpc import ops
from core.mpc.accounting import CostMeter, OpCategory
from core.mpc.crypten_compat import import_crypten
from core.mpc.gpt2 import GenerationResult, check_mode
from core.mpc.gpt2_merge import MergeLoop
from core.mpc.merge import ConstantAttention, MergeOutput, mean_attention_maps
from core.mpc.merge_spec import MergeState, check_length

CrypTensor = Any
MERGE_MODES: tuple[str, ...] = ("merge", "mm")

__all__ = [
    "MERGE_MODES",
    "EncryptedLlamaMerge",
    "LlamaMergeBlock",
    "LlamaMergeModel",
    "LlamaMergeSpec",
    "LlamaMergedLayer",
    "RMSNorm",
    "average_attention_llama",
    "build_llama_merge_model",
    "check_generation",
    "check_llama_config",
    "export_llama_block",
    "export_llama_spec",
    "merge_generate_plain",
    "merged_block",
    "merged_block_step",
    "merged_forward",
    "merged_forward_step",
    "merged_logits",
]


# What replaces the RMSNorm before the MLP. "gain": eq. 9's f'_ln(x) = x * g_2, as the paper does (GPT-2, T5);
# "rms": the normalisation x / rms(x) is kept and only its gain folded (eq. 10), one norm per block more under MPC.
# On the pretrained SmolLM2-135M eq. 9 diverges (module docstring: the residual's mean square leaves float32's range
# by block 7 at the eq. 8 start), so its merge module keeps the normalisation: a departure from the paper, named
# where it runs.
MLP_NORMS: tuple[str, ...] = ("gain", "rms")


def check_mlp_norm(value: str) -> str:
    """``value`` if it is one of :data:`MLP_NORMS`; ConfigError naming it otherwise."""
    if value not in MLP_NORMS:
        raise ConfigError(f"mlp_norm must be one of {', '.join(MLP_NORMS)}, got {value!r}")
    return value


def check_llama_config(cfg: Any) -> None:
    """ConfigError naming the value when a Hugging Face ``LlamaConfig`` has no merge-module form here: an MLP
    activation other than silu (LLaMA's and SmolLM2's) or biased projections."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(
            f"unsupported LLaMA hidden_act={act!r}: the merge module's gated MLP runs silu (LLaMA's and SmolLM2's) "
            f"only; use a model with hidden_act='silu'"
        )
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ConfigError(
            f"attention_bias={getattr(cfg, 'attention_bias', False)}, mlp_bias={getattr(cfg, 'mlp_bias', False)}: "
            f"biased LLaMA variants are not supported by the merge module"
        )


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone())


def _repeat_kv(v: torch.Tensor, rep: int) -> torch.Tensor:
    """(B, H_kv, n, D) -> (B, H_kv * rep, n, D): query head h reads K/V head h // rep (HF's ``repeat_kv``)."""
    return v if rep == 1 else v.repeat_interleave(rep, dim=1)


# --- the unmerged, trainable model (eq. 9) ------------------------------------------------------------------
class RMSNorm(nn.Module):
    """LLaMA's RMSNorm ``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in the input's dtype (Hugging Face's
    ``LlamaRMSNorm`` squares in float32; this one keeps float64 exact for the tests)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = _param(weight)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.plain_rms_norm(x, self.weight, eps=self.eps)


class LlamaMergeBlock(nn.Module):
    """One unmerged constant-attention LLaMA block (eq. 9 on a pre-norm SwiGLU block), the reference for eq. 10-11::

        g = RMS_1(h);  v = g W_V                      # (B, N, H_kv D), split (B, H_kv, N, D)
        o_h = C_h[:N, :N] v_{h // (H / H_kv)}         # (B, N, D)  each K/V head serves H / H_kv query heads
        x = h + concat_h(o_h) W_o                     # constant attention + residual
        u = x * g_2                                   # f'_ln for RMSNorm: the gain only
        out = x + down(silu(u W_gate) * (u W_up))

    Args:
        layer: a Hugging Face ``LlamaDecoderLayer`` (weights are copied, nn.Linear's (out, in) transposed).
        c0: (H, N_max, N_max) initial constant attention (causal, row-stochastic).
        config: the model's ``LlamaConfig`` (hidden_act, K/V heads, rms_norm_eps).
    """

    def __init__(self, layer: nn.Module, c0: torch.Tensor, config: Any, *, mlp_norm: str = "gain"):
        super().__init__()
        check_llama_config(config)
        self.mlp_norm = check_mlp_norm(mlp_norm)
        heads = int(config.num_attention_heads)
        if c0.dim() != 3 or c0.shape[0] != heads or c0.shape[1] != c0.shape[2]:
            raise ConfigError(f"c0 must have shape (n_head={heads}, N_max, N_max), got {tuple(c0.shape)}")
        attn, mlp = layer.self_attn, layer.mlp
        self.n_head = heads
        self.n_kv_head = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % self.n_kv_head:
            raise ConfigError(f"{heads} query heads cannot share {self.n_kv_head} K/V heads evenly")
        self.head_dim = int(attn.head_dim)
        self.ln_1 = RMSNorm(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.att = ConstantAttention(c0.to(self.ln_1.weight.dtype))
        self.W_V = _param(attn.v_proj.weight.T)  # (d, H_kv D)
        self.W_d = _param(attn.o_proj.weight.T)  # (H D, d)
        self.g_2 = _param(layer.post_attention_layernorm.weight)  # (d,) f'_ln's gain
        self.W_gate, self.W_up = _param(mlp.gate_proj.weight.T), _param(mlp.up_proj.weight.T)  # (d, F)
        self.W_down = _param(mlp.down_proj.weight.T)  # (F, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, N, _ = h.shape
        check_length(N, self.att.n_max)
        v = (self.ln_1(h) @ self.W_V).view(B, N, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, H_kv, N, D)
        v = _repeat_kv(v, self.n_head // self.n_kv_head)  # (B, H, N, D)
        o = (self.att.probs()[:, :N, :N] @ v).transpose(1, 2).reshape(B, N, self.n_head * self.head_dim)
        x = h + o @ self.W_d  # (B, N, d)
        # eq. 9's f'_ln (the gain only), or the kept normalisation x / rms(x) with the gain (see MLP_NORMS)
        u = x * self.g_2 if self.mlp_norm == "gain" else ops.plain_rms_norm(x, self.g_2, eps=self.ln_1.eps)
        return x + (torch.nn.functional.silu(u @ self.W_gate) * (u @ self.W_up)) @ self.W_down


class LlamaMergeModel(nn.Module):
    """MERGE's model on LLaMA (merge-module blocks; generation by ER), built from a Hugging Face
    ``LlamaForCausalLM``: its token table, :class:`LlamaMergeBlock` s, the kept final RMSNorm and the LM head (tied to
    the token table when the config ties them, else a copy of its own). No positions: Q, K and the rotary tables are
    dropped with the dynamic attention.

    Args:
        hf_model: the source LLaMA (weights are copied).
        c0: (L, H, N_max, N_max) initial constant attention, usually :func:`average_attention_llama`.
    """

    returns_merge_output = True  # core.mpc.merge.forward_embeds reads MergeOutput from it

    def __init__(self, hf_model: nn.Module, c0: torch.Tensor, *, mlp_norm: str = "gain"):
        super().__init__()
        cfg = hf_model.config
        check_llama_config(cfg)
        n_layer, n_head = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
        if c0.dim() != 4 or tuple(c0.shape[:2]) != (n_layer, n_head) or c0.shape[2] != c0.shape[3]:
            raise ConfigError(
                f"c0 must have shape (n_layer={n_layer}, n_head={n_head}, N_max, N_max), got {tuple(c0.shape)}"
            )
        inner = hf_model.model
        self.embed_tokens = copy.deepcopy(inner.embed_tokens)
        self.blocks = nn.ModuleList(
            LlamaMergeBlock(b, c0[i], cfg, mlp_norm=mlp_norm) for i, b in enumerate(inner.layers)
        )
        self.norm = RMSNorm(inner.norm.weight, inner.norm.variance_epsilon)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else copy.deepcopy(hf_model.lm_head)

    @property
    def n_max(self) -> int:
        return self.blocks[0].att.n_max

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def head_weight(self) -> torch.Tensor:
        """The LM head (V, d): the token table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None
    ) -> MergeOutput:
        """Token ids (B, N) or token embeddings (B, N, d) -> hidden states (n_layer + 1 tensors, the last after the
        final norm) and logits (B, N, V)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        check_length(h.shape[1], self.n_max)
        hidden = [h]
        for block in self.blocks:
            h = block(h)
            hidden.append(h)
        hidden[-1] = self.norm(h)
        return MergeOutput(hidden=hidden, logits=hidden[-1] @ self.head_weight().T)


# --- eq. 8 --------------------------------------------------------------------------------------------------
@contextmanager
def _eager_attention(model: nn.Module) -> Iterator[None]:
    """The model's attention implementation set to ``eager`` (the only one returning probabilities), then restored."""
    prev = getattr(model.config, "_attn_implementation", None)
    if prev == "eager":
        yield
        return

    def use(impl: str | None) -> None:
        if hasattr(model, "set_attn_implementation") and impl is not None:
            model.set_attn_implementation(impl)
        else:
            model.config._attn_implementation = impl

    use("eager")
    try:
        yield
    finally:
        use(prev)


@torch.no_grad()
def average_attention_llama(model: nn.Module, batches: Sequence | Iterable, n_max: int) -> torch.Tensor:
    """Eq. 8 on a Hugging Face ``LlamaForCausalLM``: its attention probabilities (run with eager attention, restored
    afterwards) averaged over ``batches`` (ids (B, N) or (ids, mask) with right padding), (L, H, n_max, n_max),
    causal and row-stochastic. Row i is averaged over the sequences whose token i is real; rows no sequence
    reaches are uniform over keys 0..i (:func:`core.mpc.merge.mean_attention_maps`)."""
    was_training = model.training
    model.eval()

    def maps() -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        for batch in batches:
            ids, mask = (batch, None) if isinstance(batch, torch.Tensor) else (batch[0], batch[1])
            check_length(ids.shape[1], n_max)
            out = model(ids, output_attentions=True)
            if not out.attentions:
                raise ConfigError("the LLaMA returned no attention maps; it needs attn_implementation='eager'")
            yield torch.stack(out.attentions, dim=1), mask  # (B, L, H, N, N)

    try:
        with _eager_attention(model):
            return mean_attention_maps(maps(), n_max, what="average_attention_llama")
    finally:
        model.train(was_training)


def build_llama_merge_model(
    source: nn.Module, batches: Sequence | Iterable, n_max: int, *, mlp_norm: str = "gain"
) -> LlamaMergeModel:
    """Eq. 8 then MM: average the LLaMA's attention over ``batches`` and build the constant-attention model
    (``mlp_norm``: :data:`MLP_NORMS`)."""
    return LlamaMergeModel(source, average_attention_llama(source, batches, n_max), mlp_norm=mlp_norm)


# --- export (eq. 10) ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LlamaMergedLayer:
    """One merged LLaMA block (module docstring). All tensors share one dtype.

    Attributes:
        C: (H, N_max, N_max) constant attention, causal and row-stochastic, one matrix per query head.
        ln: (d,) the kept RMSNorm's gain at the block input.
        W_V: (d, H_kv D) value projection; K/V head k owns columns ``k*D:(k+1)*D``.
        W_d: (H D, d) attention output projection (``o_proj``).
        M_gate, M_up: (d, F) eq. 10's ``diag(g_2) W_gate`` and ``diag(g_2) W_up`` (``f'_ln`` folded).
        W_down: (F, d) the MLP's last matrix.
        n_kv_heads: H_kv; query head h reads K/V head ``h // (H / H_kv)``.
        mlp_norm: True where the block keeps the MLP's normalisation ``x / rms(x)`` before ``M_gate``/``M_up``
            (``mlp_norm="rms"``; the gain is folded either way), False for eq. 9's gain-only ``f'_ln``.
    """

    C: torch.Tensor
    ln: torch.Tensor
    W_V: torch.Tensor
    W_d: torch.Tensor
    M_gate: torch.Tensor
    M_up: torch.Tensor
    W_down: torch.Tensor
    n_kv_heads: int
    mlp_norm: bool = False

    def __post_init__(self) -> None:
        if self.C.dim() != 3 or self.C.shape[1] != self.C.shape[2]:
            raise ConfigError(f"C must have shape (H, N_max, N_max), got {tuple(self.C.shape)}")
        H, Hk, d, F = self.n_heads, self.n_kv_heads, int(self.ln.shape[0]), int(self.W_down.shape[0])
        if Hk < 1 or H % Hk or self.W_d.shape[0] % H:
            raise ConfigError(f"{H} query heads (W_d rows {self.W_d.shape[0]}) cannot share {Hk} K/V heads evenly")
        D = self.head_dim
        expected = {"ln": (d,), "W_V": (d, Hk * D), "W_d": (H * D, d), "M_gate": (d, F), "M_up": (d, F)}
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ConfigError(
                    f"LlamaMergedLayer.{name} must have shape {shape} (H={H}, H_kv={Hk}, D={D}, d={d}, F={F}), "
                    f"got {got}"
                )

    @property
    def n_heads(self) -> int:
        return int(self.C.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.W_d.shape[0]) // self.n_heads

    @property
    def n_max(self) -> int:
        return int(self.C.shape[1])


@dataclass(frozen=True, kw_only=True)
class LlamaMergeSpec:
    """A whole merged LLaMA: ``embed`` (V, d) the token table (prompt lookups; MM's token lookups), ``lm_head`` (V, d)
    (equal to ``embed`` when the model ties them), the merged ``layers``, the kept final RMSNorm gain ``norm`` (d,)
    and the RMSNorm epsilon ``eps``."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    layers: tuple[LlamaMergedLayer, ...]
    norm: torch.Tensor
    eps: float

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("LlamaMergeSpec.layers must hold at least one merged block, got 0")
        d = int(self.embed.shape[1])
        if self.lm_head.shape != self.embed.shape or self.norm.shape != (d,) or self.layers[0].ln.shape != (d,):
            raise ConfigError(
                f"LlamaMergeSpec sizes disagree: embed {tuple(self.embed.shape)}, lm_head {tuple(self.lm_head.shape)}, "
                f"norm {tuple(self.norm.shape)}, first layer's ln {tuple(self.layers[0].ln.shape)}"
            )

    @property
    def n_max(self) -> int:
        """Longest sequence the constant attention covers."""
        return min(layer.n_max for layer in self.layers)

    @property
    def d_model(self) -> int:
        return int(self.embed.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.embed.shape[0])


@torch.no_grad()
def export_llama_block(block: LlamaMergeBlock) -> LlamaMergedLayer:
    """Eq. 10 for one block: ``f'_ln``'s gain folded into both gated-MLP matrices; ``C`` read as probabilities."""
    f = lambda t: t.detach().clone()
    return LlamaMergedLayer(
        C=f(block.att.probs()),
        ln=f(block.ln_1.weight),
        W_V=f(block.W_V),
        W_d=f(block.W_d),
        M_gate=block.g_2[:, None] * block.W_gate,  # (d, F)  diag(g_2) W_gate
        M_up=block.g_2[:, None] * block.W_up,  # (d, F)  diag(g_2) W_up
        W_down=f(block.W_down),
        n_kv_heads=block.n_kv_head,
        mlp_norm=block.mlp_norm == "rms",
    )


@torch.no_grad()
def export_llama_spec(model: LlamaMergeModel) -> LlamaMergeSpec:
    """The :class:`LlamaMergeSpec` the plaintext and encrypted executors run (plaintext tensors)."""
    eps = {model.norm.eps, *(b.ln_1.eps for b in model.blocks)}
    if len(eps) != 1:
        raise ConfigError(f"the RMSNorms' epsilons differ ({sorted(eps)}); the spec holds one")
    return LlamaMergeSpec(
        embed=model.embed_tokens.weight.detach().clone(),
        lm_head=model.head_weight().detach().clone(),
        layers=tuple(export_llama_block(b) for b in model.blocks),
        norm=model.norm.weight.detach().clone(),
        eps=eps.pop(),
    )


# --- the merged forward, plaintext --------------------------------------------------------------------------
def _values(layer: LlamaMergedLayer, h: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMS(h) @ W_V`` split into K/V heads and repeated for their query heads: (B, n, d) -> (B, H, n, D)."""
    B, n, _ = h.shape
    v = (ops.plain_rms_norm(h, layer.ln, eps=eps) @ layer.W_V).view(B, n, layer.n_kv_heads, layer.head_dim)
    return _repeat_kv(v.transpose(1, 2), layer.n_heads // layer.n_kv_heads)


def _after_attention(layer: LlamaMergedLayer, h: torch.Tensor, o: torch.Tensor, eps: float) -> torch.Tensor:
    """The rest of the block from the attended values o (B, H, n, D) and its input h (B, n, d)."""
    B, H, n, D = o.shape
    x = h + o.transpose(1, 2).reshape(B, n, H * D) @ layer.W_d  # (B, n, d)  attention + residual
    u = ops.plain_rms_norm(x, torch.ones_like(layer.ln), eps=eps) if layer.mlp_norm else x  # the gain is in M_*
    return x + (torch.nn.functional.silu(u @ layer.M_gate) * (u @ layer.M_up)) @ layer.W_down  # eq. 10-11


def merged_block(layer: LlamaMergedLayer, h: torch.Tensor, eps: float) -> torch.Tensor:
    """One merged block on the whole sequence: (B, N, d) -> (B, N, d) (module docstring)."""
    n = h.shape[-2]
    check_length(n, layer.n_max)
    return _after_attention(layer, h, layer.C[:, :n, :n] @ _values(layer, h, eps), eps)


def merged_block_step(
    layer: LlamaMergedLayer, h: torch.Tensor, sums: torch.Tensor | None, start: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the new positions ``start..start+n-1`` only, given the earlier positions' running sums.

    Args:
        h: (B, n, d) the block's input at the new positions.
        sums: (B, H, N_max, D) running sums ``S[:, h, i] = sum_{j < start} C[h, i, j] v_h[j]``; None at start 0.
        start: the first new position.
        eps: the RMSNorm epsilon.

    Returns:
        (out (B, n, d), sums advanced by the new positions). Equals :func:`merged_block` on the whole sequence at
        those positions.
    """
    n = h.shape[-2]
    check_length(start + n, layer.n_max)
    new = layer.C[:, :, start : start + n] @ _values(layer, h, eps)  # (B, H, N_max, D)  pushed to every later row
    sums = new if sums is None else sums + new
    return _after_attention(layer, h, sums[:, :, start : start + n], eps), sums


def merged_forward(spec: LlamaMergeSpec, E: torch.Tensor) -> torch.Tensor:
    """Output hidden states (after the final RMSNorm) of the merged model for input embeddings E (B, N, d) or (N, d)
    (prompt token embeddings followed by resent hidden states; no positions); row i depends on rows <= i only."""
    squeeze = E.dim() == 2
    h = E.unsqueeze(0) if squeeze else E
    check_length(h.shape[-2], spec.n_max)
    for layer in spec.layers:
        h = merged_block(layer, h, spec.eps)
    out = ops.plain_rms_norm(h, spec.norm, eps=spec.eps)
    return out.squeeze(0) if squeeze else out


def merged_forward_step(spec: LlamaMergeSpec, E: torch.Tensor, state: MergeState) -> torch.Tensor:
    """Output hidden states (B, n, d) of n new input embeddings E (B, n, d) at positions ``state.length`` on;
    advances ``state``. Equals the last n rows of :func:`merged_forward` on the whole sequence."""
    start, n = state.length, E.shape[-2]
    check_length(start + n, spec.n_max)
    h, sums = E, state.sums or [None] * len(spec.layers)
    for i, layer in enumerate(spec.layers):
        h, sums[i] = merged_block_step(layer, h, sums[i], start, spec.eps)
    state.sums, state.length = sums, start + n
    return ops.plain_rms_norm(h, spec.norm, eps=spec.eps)


def merged_logits(spec: LlamaMergeSpec, hidden: torch.Tensor) -> torch.Tensor:
    """Token scores ``hidden @ lm_head.T``: (..., d) -> (..., V)."""
    return hidden @ spec.lm_head.T


def check_generation(prefix_len: int, n_new: int, n_max: int) -> None:
    """ConfigError naming the numbers when there is no new token or the prefix plus the new tokens but the last
    (which is never fed back) pass the constant attention's N_max (:func:`core.mpc.merge_spec.check_length`)."""
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    check_length(prefix_len, n_max)
    check_length(prefix_len + n_new - 1, n_max)


def merge_generate_plain(
    spec: LlamaMergeSpec, prefix_ids: torch.Tensor, n_new: int, *, mode: str = "merge", recompute: bool = False
) -> torch.Tensor:
    """Greedy tokens (B, n_new) of the merged LLaMA for prefix ids (B, N_p), as
    :func:`core.mpc.merge_spec.merge_generate_plain` (``merge``) and :func:`~core.mpc.merge_spec.mm_generate_plain`
    (``mm``): the prompt's embeddings ``embed[prefix_ids]`` are the only table lookups of ``merge``, which resends
    the last output hidden state as the next input embedding (eq. 3) and decodes every token at the end (tokens
    never feed back); ``mm`` selects a token every step and feeds ``embed[token]``. Step 0 processes the prompt,
    every later step one position (``recompute=True``: the whole sequence every step, the reference)."""
    check_mode(mode, MERGE_MODES)
    check_generation(prefix_ids.shape[-1], n_new, spec.n_max)
    E, state, outs = spec.embed[prefix_ids], MergeState(), []  # E: (B, N_p, d)
    for step in range(n_new):
        last = (merged_forward(spec, E) if recompute else merged_forward_step(spec, E, state))[:, -1:]  # (B, 1, d)
        outs.append(merged_logits(spec, last).argmax(dim=-1) if mode == "mm" else last)
        if step + 1 < n_new:
            nxt = spec.embed[outs[-1]] if mode == "mm" else last  # (B, 1, d)  mm: lookup; merge: eq. 3
            E = torch.cat([E, nxt], dim=1) if recompute else nxt
    out = torch.cat(outs, dim=1)  # (B, n_new) tokens or (B, n_new, d) resent hidden states
    return out if mode == "mm" else merged_logits(spec, out).argmax(dim=-1)


# --- on shares ----------------------------------------------------------------------------------------------
class EncryptedLlamaMerge(MergeLoop):
    """A :class:`LlamaMergeSpec` with shared weights (party 0, ``C`` included: the constant attention is the model
    owner's weight; its shape is public); runs :func:`merge_generate_plain` on shares (``generate``).

    Costs, in :class:`~core.mpc.gpt2_merge.EncryptedMerge`'s categories: ``C @ v`` and the products by ``W_V``, ``W_d``,
    ``M_gate``, ``M_up``, ``W_down`` are Linear, the kept RMSNorms (wide-range) Norm, silu and the gate's product
    Activation, the prompt lookup (and ``mm``'s token lookups) Embed, the LM head Linear and the argmax Generation.
    No softmax; ``merge`` has no lookup and no token selection per step. Each step processes one new position
    against per-layer running sums (B, H, N_max, D) and opens one column of each ``C`` (H x N_max), whatever the
    prefix length.
    """

    def __init__(self, spec: LlamaMergeSpec, *, rank: int, device: str | torch.device = "cpu") -> None:
        self.spec, self.rank, self.device = spec, rank, torch.device(device)
        self.n_max, self.vocab_size, self.eps = spec.n_max, spec.vocab_size, float(spec.eps)
        setup = CostMeter()
        with setup.region():
            s = self._share
            self.embed = s(spec.embed)  # (V, d) prompt (and mm) lookups
            self.lm_head_t = s(spec.lm_head).t()  # (d, V); shared apart even when tied (both are the owner's)
            self.norm = s(spec.norm)
            # the kept MLP normalisation's gain is folded into M_*: a public one, no product of shares
            self.unit = torch.ones_like(spec.norm).to(self.device)
            self.layers = [
                (
                    {k: s(getattr(layer, k)) for k in ("C", "ln", "W_V", "W_d", "M_gate", "M_up", "W_down")},
                    layer.n_heads,
                    layer.n_kv_heads,
                    layer.head_dim,
                    layer.mlp_norm,
                )
                for layer in spec.layers
            ]
        self.setup_costs = setup.totals()
        self.meter = CostMeter()

    def _rms(self, h: CrypTensor, gain: CrypTensor) -> CrypTensor:
        return ops.rms_norm(h, gain, self.meter, eps=self.eps, wide=True)

    def _block(self, layer: tuple, h: CrypTensor, sums: CrypTensor | None, start: int) -> tuple:
        """One block on the new positions ``start..start+n-1`` of h (B, n, d) given the running sums
        (:func:`merged_block_step`). Returns (out, sums)."""
        (p, H, Hk, D, mlp_norm), m = layer, self.meter
        B, n = h.size(0), h.size(1)
        v = ops.linear(self._rms(h, p["ln"]), p["W_V"], None, m)  # (B, n, H_kv D)
        with m.op(OpCategory.LINEAR):
            v = v.view(B, n, Hk, D).transpose(1, 2)  # (B, H_kv, n, D)
            if H != Hk:  # each K/V head copied for its group of query heads (a local copy of the shares)
                v = import_crypten().stack([v] * (H // Hk), dim=2).reshape(B, H, n, D)
            new = p["C"][:, :, start : start + n].matmul(v)  # (B, H, N_max, D)  pushed to every later row
            sums = new if sums is None else sums + new
            o = sums[:, :, start : start + n].transpose(1, 2).reshape(B, n, H * D)  # (B, n, H D)
        x = h + ops.linear(o, p["W_d"], None, m)  # attention + residual
        u = self._rms(x, self.unit) if mlp_norm else x  # the kept MLP normalisation (its gain is in M_*)
        gate = ops.activation(ops.linear(u, p["M_gate"], None, m), m, kind="silu")  # (B, n, F)
        up = ops.linear(u, p["M_up"], None, m)
        with m.op(OpCategory.ACTIVATION):
            hid = gate * up
        return x + ops.linear(hid, p["W_down"], None, m), sums

    def hidden_step(self, emb: CrypTensor, state: MergeState) -> CrypTensor:
        """The last output hidden state (B, 1, d) after n new input embeddings (B, n, d) at positions
        ``state.length`` on; advances ``state`` (:func:`merged_forward_step`)."""
        start, n = state.length, emb.size(1)
        check_length(start + n, self.n_max)
        h, sums = emb, state.sums or [None] * len(self.layers)
        for i, layer in enumerate(self.layers):
            h, sums[i] = self._block(layer, h, sums[i], start)
        state.sums, state.length = sums, start + n
        return self._rms(h[:, -1:], self.norm)

    def generate(
        self,
        prefix_ids: torch.Tensor | None,
        max_new_tokens: int,
        *,
        mode: str = "merge",
        shape: tuple[int, int] | None = None,
    ) -> GenerationResult:
        """Greedy generation as :func:`merge_generate_plain`; ``prefix_ids`` (B, N) on the client (the model owner
        passes None with ``shape``). ``merge``: the last hidden state is resent as the next input embedding and the
        tokens are decoded once at the end; ``mm``: every step selects a token (LM head + argmax) and looks its
        embedding up privately."""
        check_mode(mode, MERGE_MODES)
        shape = tuple(prefix_ids.shape) if prefix_ids is not None else shape
        if shape is None:
            raise ConfigError("pass prefix_ids (client) or shape=(B, N) (model owner)")
        check_generation(int(shape[1]), max_new_tokens, self.n_max)
        return self.merge_loop(prefix_ids, max_new_tokens, mode, shape, self.embed)
