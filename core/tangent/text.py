"""Tangent (linearised) GPT-2 style decoder blocks for text classification (TAFT, Sec. 3.1).

The text counterpart of :mod:`core.tangent.model`: a ``transformers.GPT2Model`` whose embeddings
and first ``L - k`` blocks run normally at the frozen pretrained weights ``w`` (cached once by
:meth:`TangentTextModel.cache_frozen`), while the last ``k`` blocks, ``ln_f`` and a linear
classification head are linearised around ``w``:

    ``f_lin(x) = f(x; w) + J_w f(x; w) Delta-w``          (eq. 5, composed over layers)

Each tangent layer maps ``(x, jvp_x) -> (y, jvp_y)`` as in :mod:`core.tangent.layers`
(``jvp_x=None`` = zero input tangent). What GPT-2 adds to the vision layers:

* :class:`TangentConv1D` -- HF ``Conv1D`` (``y = x W + b`` with ``W: (in, out)``, eq. 11). The
  pretrained weight and its delta are stored in the HF ``(in, out)`` layout, so every exported
  delta (``get_delta`` / :meth:`TangentTextModel.hf_delta`) adds directly onto the HF weight.
* :class:`TangentTanhGELU` -- the tanh-approximate GELU (``"gelu_new"``, ``"gelu_pytorch_tanh"``,
  ``"gelu_fast"``) with its exact derivative (the analogue of eq. 12).
* :class:`TangentCausalSelfAttention` -- fused ``c_attn`` qkv projection, causal + key-padding
  mask; the masked softmax JVP (eq. 6) is exact: masked keys get probability 0 and tangent 0.

Padding: ``attention_mask`` is ``(B, N)`` of 1 (token) / 0 (padding), any pattern (left, right or
both). Padding keys are masked out and position ids count only the real tokens
(``cumsum(mask) - 1``), so the logits of a left- or right-padded sequence equal those of the
unpadded one. (For right padding and unpadded inputs these are also HF's default position ids.)

Tensor shapes: ``B`` batch, ``N`` tokens, ``D`` hidden size, ``H`` heads, ``Dh = D / H``,
``C`` classes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.layers import Pair, TangentGELU, TangentLayerNorm, TangentLinear, TangentModule, tangent_add
from core.tangent.model import TangentModel

__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "TangentCausalSelfAttention",
    "TangentConv1D",
    "TangentGPT2Block",
    "TangentGPT2MLP",
    "TangentTanhGELU",
    "TangentTextModel",
    "attention_allowed",
    "gelu_tanh_derivative",
    "linearize_gpt2_block",
    "position_ids",
    "tangent_masked_softmax",
]

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# HF activation class -> the config.activation_function names that build it (see _tangent_activation).
SUPPORTED_ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "NewGELUActivation": ("gelu_new",),
    "GELUTanh": ("gelu_pytorch_tanh", "gelu_python_tanh"),
    "FastGELUActivation": ("gelu_fast",),
    "GELUActivation": ("gelu", "gelu_python"),
}
SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
Pooling = Literal["last", "mean"]


# ---------------------------------------------------------------------------------------- layers
class TangentConv1D(TangentModule):
    """Linearised HF ``Conv1D`` (a linear layer with a transposed weight), eq. 11.

    ``y = x W + b``; ``jvp = jvp_x W + x dW + db`` with ``W, dW: (in, out)`` -- the HF layout, so
    the delta ``d_weight`` is directly a delta for ``Conv1D.weight``. Fused as one GEMM
    ``[jvp_x, x] @ [W; dW]`` like :class:`TangentLinear`.

    Shapes: ``x, jvp_x: (..., in)`` -> ``y, jvp: (..., out)``.
    """

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        super().__init__()
        self._pretrained("weight", weight)  # (in, out)
        self._pretrained("bias", bias)  # (out,)

    @classmethod
    def from_module(cls, module: nn.Module) -> TangentConv1D:
        """Linearise an HF ``Conv1D`` around its current weights."""
        return cls(module.weight, module.bias)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        y = torch.matmul(x, self.weight) + self.bias
        if jvp_x is None:
            return y, torch.matmul(x, self.d_weight) + self.d_bias
        xx = torch.cat([jvp_x, x], dim=-1)  # (..., 2*in)
        ww = torch.cat([self.weight, self.d_weight], dim=0)  # (2*in, out)
        return y, torch.matmul(xx, ww) + self.d_bias


def gelu_tanh_derivative(x: Tensor, c: float = SQRT_2_OVER_PI, a: float = 0.044715) -> Tensor:
    """Exact derivative of ``g(x) = x/2 (1 + tanh(u))``, ``u = c (x + a x^3)``:
    ``g'(x) = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3 a x^2)`` with ``t = tanh(u)``."""
    t = torch.tanh(c * (x + a * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x)


class TangentTanhGELU(nn.Module):
    """Linearised tanh-approximate GELU: ``jvp_y = g'(x) * jvp_x`` (eq. 12 for the tanh form). No
    weights. ``c`` is ``sqrt(2/pi)`` (``gelu_new``, ``gelu_pytorch_tanh``) or HF's rounded
    ``0.7978845608`` (``gelu_fast``), so the forward matches the HF module exactly."""

    def __init__(self, c: float = SQRT_2_OVER_PI) -> None:
        super().__init__()
        self.c = float(c)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        y = 0.5 * x * (1.0 + torch.tanh(self.c * (x + 0.044715 * x * x * x)))
        if jvp_x is None:
            return y, torch.zeros_like(y)
        return y, gelu_tanh_derivative(x, self.c) * jvp_x


def attention_allowed(attention_mask: Tensor | None, n: int, device: torch.device | None = None) -> Tensor:
    """Boolean ``(B, 1, N, N)`` (or ``(1, 1, N, N)`` without a mask): query ``i`` may attend key
    ``j`` iff ``j <= i`` (causal) and key ``j`` is not padding (``attention_mask[b, j] == 1``)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # (N, N)
    if attention_mask is None:
        return causal[None, None]
    return causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, N, N)


def position_ids(attention_mask: Tensor | None, batch: int, n: int, device: torch.device | None) -> Tensor:
    """Position of each token among the real tokens of its row: ``cumsum(mask) - 1`` (padding
    before the first token gets 0); ``arange(N)`` without a mask. Shape ``(B, N)`` or ``(1, N)``."""
    if attention_mask is None:
        return torch.arange(n, device=device)[None]
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def tangent_masked_softmax(s: Tensor, js: Tensor, allowed: Tensor) -> Pair:
    """Masked softmax over the last axis and its exact JVP (eq. 6):

    ``A = softmax(S)`` over allowed entries, 0 elsewhere; ``jvp_A = A * (jvp_S - sum_j A jvp_S)``,
    which is 0 wherever ``A`` is 0, whatever ``jvp_S`` holds there. A row with no allowed entry
    (a padding query before the first token) gets ``A = 0`` and ``jvp_A = 0`` (no NaN).

    Shapes: ``s, js: (B, H, N, N)``; ``allowed`` bool, broadcastable to them.
    """
    s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    a = torch.softmax(s, dim=-1).masked_fill(~allowed, 0.0)
    ja = a * (js - (a * js).sum(dim=-1, keepdim=True))
    return a, ja


class TangentCausalSelfAttention(nn.Module):
    """Linearised GPT-2 self-attention (eq. 6-8) with a causal + key-padding mask, no dropout.

    ``[Q, K, V] = c_attn(x)`` (fused Conv1D, each ``(B, N, D)``) with JVPs; per head
    ``S = Q K^T * scale``, ``jvp_S = [jvp_Q, Q] @ [K, jvp_K]^T * scale`` (eq. 7);
    ``A, jvp_A`` from :func:`tangent_masked_softmax`; ``O = A V``,
    ``jvp_O = [jvp_A, A] @ [V; jvp_V]``; then ``c_proj``. Shapes: ``(B, N, D)`` -> ``(B, N, D)``.
    """

    def __init__(self, c_attn: TangentConv1D, c_proj: TangentConv1D, num_heads: int, scale: float) -> None:
        super().__init__()
        self.c_attn, self.c_proj = c_attn, c_proj
        self.num_heads = int(num_heads)
        self.embed_dim = c_proj.weight.shape[1]
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = float(scale)

    def _heads(self, t: Tensor) -> Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, N, D) -> (B, H, N, Dh)

    def forward(self, x: Tensor, jvp_x: Tensor | None, allowed: Tensor | None = None) -> Pair:
        b, n, d = x.shape
        qkv, jqkv = self.c_attn(x, jvp_x)  # (B, N, 3D) each
        q, k, v = (self._heads(t) for t in qkv.split(d, dim=-1))  # (B, H, N, Dh) each
        jq, jk, jv = (self._heads(t) for t in jqkv.split(d, dim=-1))
        if allowed is None:
            allowed = attention_allowed(None, n, x.device)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, H, N, N)
        js = torch.matmul(torch.cat([jq, q], -1), torch.cat([k, jk], -1).transpose(-1, -2)) * self.scale
        a, ja = tangent_masked_softmax(s, js, allowed)
        o = torch.matmul(a, v)  # (B, H, N, Dh)
        jo = torch.matmul(torch.cat([ja, a], -1), torch.cat([v, jv], -2))  # (B,H,N,2N) @ (B,H,2N,Dh)
        o = o.transpose(1, 2).reshape(b, n, d)  # (B, H, N, Dh) -> (B, N, D)
        jo = jo.transpose(1, 2).reshape(b, n, d)  # (B, H, N, Dh) -> (B, N, D)
        return self.c_proj(o, jo)


class TangentGPT2MLP(nn.Module):
    """Linearised GPT-2 MLP: ``c_proj(act(c_fc(x)))``. Shapes: ``(B, N, D)`` -> ``(B, N, D)``."""

    def __init__(self, c_fc: TangentConv1D, act: nn.Module, c_proj: TangentConv1D) -> None:
        super().__init__()
        self.c_fc, self.act, self.c_proj = c_fc, act, c_proj

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        return self.c_proj(*self.act(*self.c_fc(x, jvp_x)))


class TangentGPT2Block(nn.Module):
    """Linearised pre-norm GPT-2 block (submodule names mirror ``GPT2Block``):

    ``h = x + attn(ln_1(x))``; ``out = h + mlp(ln_2(h))``, residual adds by :func:`tangent_add`.
    ``allowed``: boolean attention mask from :func:`attention_allowed` (None = causal only).
    Shapes: ``(B, N, D)`` -> ``(B, N, D)``.
    """

    def __init__(
        self,
        ln_1: TangentLayerNorm,
        attn: TangentCausalSelfAttention,
        ln_2: TangentLayerNorm,
        mlp: TangentGPT2MLP,
    ) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    def forward(self, x: Tensor, jvp_x: Tensor | None, allowed: Tensor | None = None) -> Pair:
        a = self.attn(*self.ln_1(x, jvp_x), allowed)
        h = tangent_add(a, (x, jvp_x if jvp_x is not None else torch.zeros_like(x)))
        return tangent_add(self.mlp(*self.ln_2(*h)), h)


# ---------------------------------------------------------------------------------------- builders
def _supported_text() -> str:
    acts = ", ".join(f"{n!r}" for names in SUPPORTED_ACTIVATIONS.values() for n in names)
    return f"supported: GPT2Block (self-attention only) with activation_function in {{{acts}}}"


def _tangent_activation(act: nn.Module, where: str) -> nn.Module:
    name = type(act).__name__
    if name in ("NewGELUActivation", "GELUTanh"):
        return TangentTanhGELU()
    if name == "FastGELUActivation":
        return TangentTanhGELU(c=0.7978845608)  # HF's rounded constant
    if name == "GELUActivation":
        return TangentGELU()  # erf GELU (F.gelu or the python erf formula)
    raise ConfigError(f"cannot linearise activation {where} ({name}); {_supported_text()}")


def _attention_scale(attn: nn.Module, where: str) -> float:
    """``head_dim**-0.5`` (if ``scale_attn_weights``) divided by ``layer_idx + 1`` (if
    ``scale_attn_by_inverse_layer_idx``), as ``GPT2Attention`` computes it."""
    if getattr(attn, "reorder_and_upcast_attn", False):
        raise ConfigError(
            f"{where}: reorder_and_upcast_attn=True (float32 upcast of the scores) is not supported; "
            "set config.reorder_and_upcast_attn=False"
        )
    if getattr(attn, "is_cross_attention", False):
        raise ConfigError(f"{where} is a cross-attention; only self-attention is supported")
    scale = attn.head_dim**-0.5 if attn.scale_attn_weights else 1.0
    if attn.scale_attn_by_inverse_layer_idx:
        if attn.layer_idx is None:
            raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx=True needs a layer_idx, got None")
        scale /= float(attn.layer_idx + 1)
    hf_scale = getattr(attn, "scaling", scale)
    if abs(hf_scale - scale) > 1e-12 * max(1.0, abs(scale)):
        raise ConfigError(f"{where}: attention scaling {hf_scale} does not match the GPT-2 flags ({scale})")
    return scale


def linearize_gpt2_block(block: nn.Module) -> tuple[TangentGPT2Block, dict[str, str]]:
    """Build the tangent version of an HF ``GPT2Block`` around its current weights.

    Returns the block and ``{delta name in the tangent block: parameter name in the HF block}``
    (e.g. ``"attn.c_attn.d_weight" -> "attn.c_attn.weight"``; Conv1D deltas are ``(in, out)`` like
    the HF weight). Raises :class:`ConfigError` naming the module for an unsupported block,
    activation, cross-attention or attention flag.
    """
    kind = type(block).__name__
    if kind != "GPT2Block":
        raise ConfigError(f"cannot linearise module {kind}; {_supported_text()}")
    if hasattr(block, "crossattention"):
        raise ConfigError(
            f"cannot linearise {kind} with cross-attention (config.add_cross_attention=True); {_supported_text()}"
        )
    at, mlp = block.attn, block.mlp
    tb = TangentGPT2Block(
        TangentLayerNorm.from_module(block.ln_1),
        TangentCausalSelfAttention(
            TangentConv1D.from_module(at.c_attn),
            TangentConv1D.from_module(at.c_proj),
            num_heads=at.num_heads,
            scale=_attention_scale(at, f"{kind}.attn"),
        ),
        TangentLayerNorm.from_module(block.ln_2),
        TangentGPT2MLP(
            TangentConv1D.from_module(mlp.c_fc),
            _tangent_activation(mlp.act, f"{kind}.mlp.act"),
            TangentConv1D.from_module(mlp.c_proj),
        ),
    )
    mapping: dict[str, str] = {}
    for sub_name, sub in tb.named_modules():
        if isinstance(sub, TangentModule):
            for d_name, src in sub.source_names.items():
                mapping[f"{sub_name}.{d_name}"] = f"{sub_name}.{src}"
    return tb, mapping


# ---------------------------------------------------------------------------------------- model
class TangentTextModel(nn.Module):
    """A HF ``GPT2Model`` with its last ``k`` blocks, ``ln_f`` and a linear classification head
    linearised (TAFT). Logits: ``(B, num_classes)``, pooled at the last real token (``"last"``)
    or averaged over the real tokens (``"mean"``).

    Args:
        gpt2_model: a ``transformers.GPT2Model`` (for ``GPT2LMHeadModel`` /
            ``GPT2ForSequenceClassification`` pass ``.transformer``); its weights are ``w``. The
            embeddings and first ``L-k`` blocks are shared (not copied) and get ``requires_grad=False``.
        num_classes: classifier outputs.
        k: number of last blocks to linearise, ``1 <= k <= n_layer``.
        predict_jvp_only: return only ``J Delta-w`` (Sec. 3.4).
        head: the classifier's pretrained weights (``nn.Linear(D, num_classes)``); default a random
            ``N(0, 0.02^2)`` weight and zero bias from ``seed``.
        seed: seed for the default head.
        pooling: ``"last"`` (last non-padding token, GPT-2 style) or ``"mean"``.

    The delta API (``tangent_parameters``, ``get_delta``, ``set_delta``, ``source_names``) is that
    of :class:`~core.tangent.model.TangentModel`, so :mod:`core.tangent.compose` works unchanged;
    ``source_names`` values are ``GPT2Model.named_parameters()`` names (plus ``head.weight`` /
    ``head.bias``) and every delta has the HF shape (Conv1D: ``(in, out)``), see :meth:`hf_delta`.
    """

    def __init__(
        self,
        gpt2_model: nn.Module,
        num_classes: int,
        k: int = 1,
        *,
        predict_jvp_only: bool = False,
        head: nn.Linear | None = None,
        seed: int = 0,
        pooling: Pooling = "last",
    ) -> None:
        super().__init__()
        kind = type(gpt2_model).__name__
        if kind != "GPT2Model":
            raise ConfigError(
                f"cannot linearise model {kind}; supported: GPT2Model (for GPT2LMHeadModel or "
                "GPT2ForSequenceClassification pass its .transformer)"
            )
        n_layers = len(gpt2_model.h)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_layers:
            raise ConfigError(f"k must be an int in [1, {n_layers}] (n_layer), got k={k!r}")
        if num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got num_classes={num_classes}")
        if pooling not in ("last", "mean"):
            raise ConfigError(f"pooling must be 'last' or 'mean', got pooling={pooling!r}")
        impl = gpt2_model.config._attn_implementation
        if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
            raise ConfigError(
                f"frozen GPT-2 blocks need attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS} "
                f"(a 4-D additive mask), got {impl!r}"
            )
        self.k, self.num_classes, self.predict_jvp_only = k, num_classes, predict_jvp_only
        self.pooling: Pooling = pooling
        dim = gpt2_model.config.hidden_size
        param = next(gpt2_model.parameters())
        dtype, device = param.dtype, param.device

        # Frozen prefix: the HF modules themselves (shared, eval mode, no grad).
        self.wte, self.wpe = gpt2_model.wte, gpt2_model.wpe
        self.frozen_blocks = nn.ModuleList(gpt2_model.h[: n_layers - k])
        for p in [*self.wte.parameters(), *self.wpe.parameters(), *self.frozen_blocks.parameters()]:
            p.requires_grad_(False)

        # Linearised suffix; source_names: delta name -> GPT2Model parameter name (or head.*).
        self.source_names: dict[str, str] = {}
        blocks = []
        for i in range(n_layers - k, n_layers):
            tb, mapping = linearize_gpt2_block(gpt2_model.h[i])
            j = len(blocks)
            blocks.append(tb)
            self.source_names.update({f"blocks.{j}.{a}": f"h.{i}.{b}" for a, b in mapping.items()})
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = TangentLayerNorm.from_module(gpt2_model.ln_f)
        self.source_names.update({"ln_f.d_weight": "ln_f.weight", "ln_f.d_bias": "ln_f.bias"})
        self.head = TangentLinear.from_module(self._head(head, dim, num_classes, seed))
        self.source_names.update({"head.d_weight": "head.weight", "head.d_bias": "head.bias"})
        self.to(dtype=dtype, device=device)

    @staticmethod
    def _head(head: nn.Linear | None, dim: int, num_classes: int, seed: int) -> nn.Linear:
        if head is None:
            gen = torch.Generator().manual_seed(seed)
            head = nn.Linear(dim, num_classes)
            with torch.no_grad():
                head.weight.copy_(torch.randn(num_classes, dim, generator=gen) * 0.02)
                head.bias.zero_()
        if tuple(head.weight.shape) != (num_classes, dim) or head.bias is None:
            raise ConfigError(
                f"head must be nn.Linear({dim}, {num_classes}) with bias, got weight {tuple(head.weight.shape)}"
            )
        return head

    # ------------------------------------------------------------------ inputs
    @staticmethod
    def _check_mask(attention_mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != shape:
            raise DataError(
                f"attention_mask must have shape {shape} (B, N), got {tuple(attention_mask.shape)}"
            )
        m = attention_mask.long()
        if not bool(((m == 0) | (m == 1)).all()):
            raise DataError("attention_mask must hold only 1 (token) and 0 (padding)")
        if not bool((m.sum(-1) > 0).all()):
            raise DataError("every row of attention_mask needs at least one real token (a 1)")
        return m

    # ------------------------------------------------------------------ frozen prefix / cache
    @torch.no_grad()
    def features(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Frozen prefix (token + position embeddings, first ``L-k`` blocks) at ``w``:
        ``input_ids (B, N)`` -> hidden states ``(B, N, D)``."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise DataError(
                f"input_ids must be an integer (B, N) tensor, got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        b, n = input_ids.shape
        mask = self._check_mask(attention_mask, (b, n))
        self.frozen_blocks.eval()
        h = self.wte(input_ids) + self.wpe(position_ids(mask, b, n, input_ids.device))  # (B, N, D)
        if len(self.frozen_blocks):
            allowed = attention_allowed(mask, n, h.device)  # (B|1, 1, N, N)
            additive = torch.zeros(allowed.shape, dtype=h.dtype, device=h.device)
            additive = additive.masked_fill(~allowed, torch.finfo(h.dtype).min)
            for blk in self.frozen_blocks:
                h = blk(h, attention_mask=additive)
        return h

    @torch.no_grad()
    def cache_frozen(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, batch_size: int = 64
    ) -> Tensor:
        """Frozen activations for every sequence, in batches: ``(n, N) -> (n, N, D)``. Keep the
        same ``attention_mask`` for :meth:`forward_from_cache`."""
        if input_ids.dim() != 2 or input_ids.shape[0] == 0:
            raise DataError(
                f"cache_frozen needs a non-empty (n, N) input_ids tensor, got {tuple(input_ids.shape)}"
            )
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got batch_size={batch_size}")
        masks = [None] * math.ceil(input_ids.shape[0] / batch_size)
        if attention_mask is not None:
            self._check_mask(attention_mask, tuple(input_ids.shape))
            masks = list(attention_mask.split(batch_size))
        chunks = input_ids.split(batch_size)
        return torch.cat([self.features(x, m) for x, m in zip(chunks, masks, strict=True)], dim=0)

    # ------------------------------------------------------------------ linearised suffix
    def _pool(self, t: Tensor, mask: Tensor | None) -> Tensor:
        """``(B, N, D) -> (B, D)``: last real token, or the mean over real tokens."""
        b, n, _ = t.shape
        if self.pooling == "mean":
            if mask is None:
                return t.mean(dim=1)
            w = mask.to(t.dtype)[..., None]  # (B, N, 1)
            return (t * w).sum(dim=1) / w.sum(dim=1)
        if mask is None:
            return t[:, -1]
        last = n - 1 - mask.flip(-1).argmax(dim=-1)  # (B,) index of the last 1
        return t[torch.arange(b, device=t.device), last]

    def forward_from_cache(self, h: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Linearised suffix on frozen activations ``h: (B, N, D)`` -> logits ``(B, C)``:
        ``f(w) + J Delta-w`` (or ``J Delta-w`` with ``predict_jvp_only``)."""
        if h.dim() != 3:
            raise DataError(f"h must be (B, N, D) hidden states, got shape {tuple(h.shape)}")
        b, n, _ = h.shape
        mask = self._check_mask(attention_mask, (b, n))
        allowed = attention_allowed(mask, n, h.device)  # (B|1, 1, N, N)
        pair: tuple[Tensor, Tensor | None] = (h, None)
        for blk in self.blocks:
            pair = blk(*pair, allowed)
        y, j = self.ln_f(*pair)  # (B, N, D)
        y, j = self.head(self._pool(y, mask), self._pool(j, mask))  # (B, D) -> (B, C)
        return j if self.predict_jvp_only else y + j

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``(B, C)`` for ``input_ids: (B, N)`` with optional ``attention_mask: (B, N)``."""
        return self.forward_from_cache(self.features(input_ids, attention_mask), attention_mask)

    # ------------------------------------------------------------------ deltas (composition)
    # Shared verbatim with TangentModel: they only use named_parameters() and source_names.
    tangent_parameters = TangentModel.tangent_parameters
    get_delta = TangentModel.get_delta
    set_delta = TangentModel.set_delta

    def hf_delta(self) -> dict[str, Tensor]:
        """``Delta-w`` keyed by HF name (``"h.1.attn.c_attn.weight"``, ``"ln_f.bias"``,
        ``"head.weight"``, ...); each tensor has the HF parameter's shape (Conv1D ``(in, out)``),
        so ``w_hf + delta`` is the fine-tuned weight."""
        return {self.source_names[n]: t for n, t in self.get_delta().items()}

    def load_hf_delta(self, delta: Mapping[str, Tensor]) -> None:
        """Inverse of :meth:`hf_delta`: load ``Delta-w`` keyed by HF name."""
        by_hf = {v: n for n, v in self.source_names.items()}
        unknown = sorted(set(delta) - set(by_hf))
        if unknown:
            raise ConfigError(f"unknown HF delta names {unknown}; expected {sorted(by_hf)}")
        self.set_delta({by_hf[h]: t for h, t in delta.items()})
