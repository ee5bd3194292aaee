"""Tangent (linearised) Hugging Face vision transformers for TAFT (Sec. 3.1, 3.5; Discussion, Sec. 5).

:class:`TangentModel` wraps a ``transformers.Dinov2Model`` or ``ViTModel``: the first ``L - k``
blocks (and the embeddings) run normally at the frozen pretrained weights; the last ``k`` blocks,
the final LayerNorm and a linear classifier head on the CLS token are linearised around their
weights ``w`` (:mod:`core.tangent.layers`), so the logits are

    ``f_lin(x) = f(x; w) + J_w f(x; w) Delta-w``          (eq. 5 composed over layers)

or only ``J_w f(x; w) Delta-w`` with ``predict_jvp_only`` (DP training, Sec. 3.4). The output is
exactly linear in ``Delta-w``, so averaging deltas trained on shards equals ensembling (eq. 13).

Because the frozen prefix does not depend on ``Delta-w``, its output can be cached once per
training example (Sec. 5): ``cache_frozen(dataset)`` then ``forward_from_cache(h)``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError
from core.tangent.layers import (
    Pair,
    TangentAttention,
    TangentGELU,
    TangentLayerNorm,
    TangentLayerScale,
    TangentLinear,
    TangentModule,
    tangent_add,
)

__all__ = [
    "SUPPORTED_BLOCKS",
    "TangentBlock",
    "TangentModel",
    "force_eager_attention_",
    "linearize_block",
    "reinit_block_",
]

SUPPORTED_BLOCKS = ("Dinov2Layer (MLP with erf GELU, no SwiGLU)", "ViTLayer (erf GELU)")
SUPPORTED_MODELS = ("Dinov2Model", "ViTModel")
# TangentAttention projection -> the HF attention submodule it linearises
_ATTN_PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


class TangentBlock(nn.Module):
    """Linearised pre-norm transformer block (Dinov2 with layer-scale, or ViT without):

    ``h = x + ls1(attn(ln1(x)))``; ``out = h + ls2(fc2(gelu(fc1(ln2(h)))))``, each op replaced by
    its tangent layer and the residual adds by :func:`tangent_add`. Shapes: ``(B, N, D)``.
    """

    def __init__(
        self,
        ln1: TangentLayerNorm,
        attn: TangentAttention,
        ln2: TangentLayerNorm,
        fc1: TangentLinear,
        fc2: TangentLinear,
        ls1: TangentLayerScale | None = None,
        ls2: TangentLayerScale | None = None,
    ) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.fc1, self.fc2 = ln1, attn, ln2, fc1, fc2
        self.act = TangentGELU()
        self.ls1, self.ls2 = ls1, ls2

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        a = self.attn(*self.ln1(x, jvp_x))
        if self.ls1 is not None:
            a = self.ls1(*a)
        h = tangent_add(a, (x, jvp_x if jvp_x is not None else torch.zeros_like(x)))
        m = self.fc2(*self.act(*self.fc1(*self.ln2(*h))))
        if self.ls2 is not None:
            m = self.ls2(*m)
        return tangent_add(m, h)


def _check_gelu(act: nn.Module, where: str) -> None:
    name = type(act).__name__
    if name != "GELUActivation" or getattr(act, "act", None) is not nn.functional.gelu:
        raise ConfigError(
            f"cannot linearise activation {where} ({name}); supported: exact erf GELU "
            f"(hidden_act='gelu'). Supported blocks: {', '.join(SUPPORTED_BLOCKS)}"
        )


def linearize_block(block: nn.Module) -> tuple[TangentBlock, dict[str, str]]:
    """Build the tangent version of an HF block around its current weights.

    Returns the block and ``{delta name in the tangent block: parameter name in the HF block}``.
    Raises :class:`ConfigError` naming the module when it is not a supported type.
    """
    kind = type(block).__name__
    if kind == "Dinov2Layer":
        mlp = block.mlp
        if type(mlp).__name__ != "Dinov2MLP":
            raise ConfigError(
                f"cannot linearise {type(mlp).__name__} in {kind}; supported: {', '.join(SUPPORTED_BLOCKS)}"
            )
        names = {
            "ln1": "norm1",
            "ln2": "norm2",
            "attn": "attention",
            "fc1": "mlp.fc1",
            "fc2": "mlp.fc2",
            "ls1": "layer_scale1",
            "ls2": "layer_scale2",
        }
        ln1, ln2 = block.norm1, block.norm2
    elif kind == "ViTLayer":
        mlp = block.mlp
        names = {
            "ln1": "layernorm_before",
            "ln2": "layernorm_after",
            "attn": "attention",
            "fc1": "mlp.fc1",
            "fc2": "mlp.fc2",
        }
        ln1, ln2 = block.layernorm_before, block.layernorm_after
    else:
        raise ConfigError(f"cannot linearise module {kind}; supported blocks: {', '.join(SUPPORTED_BLOCKS)}")
    _check_gelu(mlp.activation_fn, f"{kind}.mlp.activation_fn")
    at = block.attention
    attn = TangentAttention(
        *(TangentLinear.from_module(getattr(at, p)) for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        num_heads=at.num_attention_heads,
    )
    if abs(attn.scale - at.scaling) > 1e-12:
        raise ConfigError(f"{kind}.attention scaling {at.scaling} != head_dim**-0.5; not supported")
    ls = {}
    if kind == "Dinov2Layer":
        ls = {
            "ls1": TangentLayerScale(block.layer_scale1.lambda1),
            "ls2": TangentLayerScale(block.layer_scale2.lambda1),
        }
    tb = TangentBlock(
        TangentLayerNorm.from_module(ln1),
        attn,
        TangentLayerNorm.from_module(ln2),
        TangentLinear.from_module(mlp.fc1),
        TangentLinear.from_module(mlp.fc2),
        **ls,
    )
    mapping: dict[str, str] = {}
    for sub_name, sub in tb.named_modules():
        if not isinstance(sub, TangentModule):
            continue
        top, _, rest = sub_name.partition(".")
        hf_prefix = names[top] + (
            "." + _ATTN_PROJ[rest] if rest else ""  # rest: one of TangentAttention's own four projections
        )
        for d_name, src in sub.source_names.items():
            mapping[f"{sub_name}.{d_name}"] = f"{hf_prefix}.{src}"
    return tb, mapping


@torch.no_grad()
def reinit_block_(block: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Re-initialise an HF block in place (PT=F, Sec. 3.5): Linear weights ~ N(0, std^2) truncated
    at 2 std, biases 0, LayerNorm (1, 0), layer-scale kept at its current (config) value.
    Deterministic given ``seed``. Returns ``block``."""
    gen = torch.Generator().manual_seed(seed)
    for m in block.modules():
        if isinstance(m, nn.Linear):
            w = torch.randn(m.weight.shape, generator=gen, dtype=torch.float64).clamp_(-2, 2) * std
            m.weight.copy_(w.to(m.weight.dtype))
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.LayerNorm):
            m.weight.fill_(1.0)
            m.bias.zero_()
    return block


class TangentModel(nn.Module):
    """A HF ``Dinov2Model``/``ViTModel`` with its last ``k`` blocks, final LayerNorm and a linear
    CLS-token classifier head linearised (TAFT). Logits: ``(B, num_classes)``.

    Args:
        backbone: a ``Dinov2Model`` or ``ViTModel`` (its weights are the linearisation point ``w``).
            Its embeddings and first ``L-k`` blocks are shared (not copied) and get
            ``requires_grad=False``; the linearised part copies its weights into buffers.
        num_classes: classifier outputs.
        k: number of last blocks to linearise, ``1 <= k <= num_hidden_layers``.
        reinit_last_block: linearise the last block around a random re-initialisation instead
            of the pretrained weights (Sec. 3.5), via :func:`reinit_block_` with ``seed``.
        linearize_cls_token: add a trainable delta to the CLS-position hidden state entering the
            first linearised block (for ``k = L`` this is exactly a delta on ``cls_token``).
        predict_jvp_only: return only ``J Delta-w`` (Sec. 3.4).
        head: the classifier's pretrained weights (an ``nn.Linear(D, num_classes)``); default a
            random ``N(0, 0.02^2)`` weight and zero bias from ``seed`` (a zero head weight would
            make every block's JVP vanish).
        seed: seed for the head and the re-initialisation.
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int,
        k: int = 1,
        *,
        reinit_last_block: bool = False,
        linearize_cls_token: bool = False,
        predict_jvp_only: bool = False,
        head: nn.Linear | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        kind = type(backbone).__name__
        if kind not in SUPPORTED_MODELS:
            raise ConfigError(f"cannot linearise model {kind}; supported: {', '.join(SUPPORTED_MODELS)}")
        layers = backbone.encoder.layer if kind == "Dinov2Model" else backbone.layers
        n_layers = len(layers)
        if not 1 <= k <= n_layers:
            raise ConfigError(f"k must be in [1, {n_layers}] (num_hidden_layers), got k={k}")
        if num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got num_classes={num_classes}")
        self.k, self.num_classes, self.predict_jvp_only = k, num_classes, predict_jvp_only
        self.linearize_cls_token = linearize_cls_token
        dim = backbone.config.hidden_size
        param = next(backbone.parameters())
        dtype, device = param.dtype, param.device

        # Frozen prefix: the HF modules themselves (shared, eval mode, no grad).
        self.embeddings = backbone.embeddings
        self.frozen_blocks = nn.ModuleList(layers[: n_layers - k])
        for p in list(self.embeddings.parameters()) + list(self.frozen_blocks.parameters()):
            p.requires_grad_(False)
        hf_prefix = "encoder.layer" if kind == "Dinov2Model" else "layers"

        # Linearised suffix. ``source_names``: delta name -> name of the perturbed weight in
        # ``backbone.named_parameters()`` (or ``head.weight``/``head.bias``/``cls_shift``).
        self.source_names: dict[str, str] = {}
        blocks = []
        for i in range(n_layers - k, n_layers):
            blk = layers[i]
            if reinit_last_block and i == n_layers - 1:
                blk = reinit_block_(copy.deepcopy(blk), seed=seed)
            tb, mapping = linearize_block(blk)
            j = len(blocks)
            blocks.append(tb)
            self.source_names.update({f"blocks.{j}.{a}": f"{hf_prefix}.{i}.{b}" for a, b in mapping.items()})
        self.blocks = nn.ModuleList(blocks)
        self.layernorm = TangentLayerNorm.from_module(backbone.layernorm)
        self.source_names.update({"layernorm.d_weight": "layernorm.weight", "layernorm.d_bias": "layernorm.bias"})
        if head is None:
            gen = torch.Generator().manual_seed(seed)
            head = nn.Linear(dim, num_classes)
            with torch.no_grad():
                head.weight.copy_(torch.randn(num_classes, dim, generator=gen) * 0.02)
                head.bias.zero_()
        if tuple(head.weight.shape) != (num_classes, dim):
            raise ConfigError(f"head weight must be ({num_classes}, {dim}), got {tuple(head.weight.shape)}")
        self.head = TangentLinear.from_module(head)
        self.source_names.update({"head.d_weight": "head.weight", "head.d_bias": "head.bias"})
        if linearize_cls_token:
            self.d_cls = nn.Parameter(torch.zeros(dim))
            self.source_names["d_cls"] = "cls_shift"
        self.to(dtype=dtype, device=device)

    # ------------------------------------------------------------------ frozen prefix / cache
    @torch.no_grad()
    def features(self, pixel_values: Tensor) -> Tensor:
        """Frozen prefix (embeddings + first ``L-k`` blocks) at ``w``: ``(B, C, H, W) -> (B, N, D)``."""
        self.embeddings.eval()
        self.frozen_blocks.eval()
        h = self.embeddings(pixel_values.to(self.head.weight.dtype))
        for blk in self.frozen_blocks:
            h = blk(h)
        return h

    @torch.no_grad()
    def cache_frozen(self, dataset: Tensor | Iterable, batch_size: int = 64) -> Tensor:
        """Frozen activations for every example: ``(n, N, D)``, in dataset order.

        ``dataset`` is a pixel tensor ``(n, C, H, W)`` or an indexable/iterable of examples, each a
        pixel tensor ``(C, H, W)`` or a tuple whose first item is one.
        """
        if isinstance(dataset, Tensor):
            xs = list(dataset.split(batch_size))
        else:
            items = [ex[0] if isinstance(ex, (tuple, list)) else ex for ex in dataset]
            if not items or not all(isinstance(t, Tensor) for t in items):
                raise DataError("cache_frozen needs a non-empty dataset of pixel tensors (C, H, W)")
            xs = [torch.stack(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]
        if not xs:
            raise DataError("cache_frozen got an empty dataset")
        return torch.cat([self.features(x) for x in xs], dim=0)

    # ------------------------------------------------------------------ linearised suffix
    def forward_from_cache(self, h: Tensor) -> Tensor:
        """Linearised suffix on frozen activations ``h: (B, N, D)`` -> logits ``(B, num_classes)``:
        ``f(w) + J Delta-w`` (or ``J Delta-w`` with ``predict_jvp_only``)."""
        jvp: Tensor | None = None
        if self.linearize_cls_token:
            jvp = torch.zeros_like(h)
            jvp[:, 0] = self.d_cls  # tangent of the CLS-position hidden state
        pair: Pair = (h, jvp)
        for blk in self.blocks:
            pair = blk(*pair)
        y, j = self.layernorm(*pair)  # (B, N, D)
        y, j = self.head(y[:, 0], j[:, 0])  # CLS pooling: (B, D) -> (B, num_classes)
        return j if self.predict_jvp_only else y + j

    def forward(self, pixel_values: Tensor) -> Tensor:
        """Logits ``(B, num_classes)`` for ``pixel_values: (B, C, H, W)``."""
        return self.forward_from_cache(self.features(pixel_values))

    # ------------------------------------------------------------------ deltas (composition)
    def tangent_parameters(self) -> list[nn.Parameter]:
        """The trainable ``Delta-w`` parameters (in ``get_delta`` order)."""
        return [p for n, p in self.named_parameters() if n in self.source_names]

    def get_delta(self) -> dict[str, Tensor]:
        """Detached copies of ``Delta-w`` by name (keys of ``source_names``)."""
        return {n: p.detach().clone() for n, p in self.named_parameters() if n in self.source_names}

    @torch.no_grad()
    def set_delta(self, delta: Tensor | Mapping[str, Tensor]) -> None:
        """Load ``Delta-w`` from a dict (all names of :meth:`get_delta`) or a flat vector (the
        concatenation of the flattened deltas in :meth:`get_delta` order)."""
        params = {n: p for n, p in self.named_parameters() if n in self.source_names}
        if isinstance(delta, Tensor):
            total = sum(p.numel() for p in params.values())
            if delta.dim() != 1 or delta.numel() != total:
                raise ConfigError(f"flat delta must be 1-D with {total} entries, got shape {tuple(delta.shape)}")
            off = 0
            for p in params.values():
                p.copy_(delta[off : off + p.numel()].view_as(p))  # (numel,) -> param shape
                off += p.numel()
            return
        missing, extra = set(params) - set(delta), set(delta) - set(params)
        if missing or extra:
            raise ConfigError(f"delta keys mismatch: missing={sorted(missing)}, unexpected={sorted(extra)}")
        for n, p in params.items():
            if tuple(delta[n].shape) != tuple(p.shape):
                raise ConfigError(f"delta[{n!r}] must have shape {tuple(p.shape)}, got {tuple(delta[n].shape)}")
            p.copy_(delta[n])


def force_eager_attention_(module: nn.Module) -> nn.Module:
    """Switch every HF attention in ``module`` to the eager implementation, in place.

    ``torch.func.vmap`` has no batching rule for the fused SDPA kernels and falls back to a slow
    per-example loop (with a warning); eager attention is plain matmul + softmax, the same function.
    Only the configs held by ``module``'s submodules are changed (a ``NonlinearSuffix`` holds deep
    copies, so the backbone is untouched). Returns ``module``.
    """
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", "eager") != "eager":
            cfg._attn_implementation = "eager"
    return module
