"""Linearised ("tangent") transformer layers computed by ONE modified forward pass (TAFT, Sec. 3.1).

Every layer ``L`` with pretrained weights ``w`` (frozen buffers) and trainable offsets ``Delta-w``
(``nn.Parameter``, initialised at zero) maps ``(x, jvp_x) -> (y, jvp_y)`` where

* ``y = L(x; w)`` is the plain output at the pretrained weights, and
* ``jvp_y = d/dr L(x + r jvp_x; w + r Delta-w) |_{r=0}`` is the Jacobian-vector product with respect
  to (weights, input) in the direction (Delta-w, jvp_x) (eq. 5).

The linearised output is ``y + jvp_y`` (the JVP part alone is what DP training needs, Sec. 3.4).
``jvp_x=None`` means a zero input tangent (the input comes from frozen layers) and skips work.

Tensor shapes: ``B`` batch, ``N`` tokens, ``D`` hidden size, ``H`` heads, ``Dh = D / H``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import ConfigError, DataError

__all__ = [
    "TangentAttention",
    "TangentEmbeddings",
    "TangentGELU",
    "TangentLayerNorm",
    "TangentLayerScale",
    "TangentLinear",
    "TangentModule",
    "TangentPatchEmbedding",
    "gelu_derivative",
    "tangent_add",
]

Pair = tuple[Tensor, Tensor]


class TangentModule(nn.Module):
    """Base class: helpers to register a frozen pretrained tensor and its zero-initialised delta.

    ``source_names`` maps each delta parameter's local name to the local name of the pretrained
    parameter it perturbs (e.g. ``{"d_weight": "weight"}``), so callers can line deltas up with
    the original module's ``named_parameters``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.source_names: dict[str, str] = {}

    def _pretrained(self, name: str, value: Tensor) -> None:
        """Register ``w`` as a frozen buffer ``name`` and ``Delta-w`` as parameter ``d_<name>`` = 0."""
        w = value.detach().clone()
        self.register_buffer(name, w)
        setattr(self, f"d_{name}", nn.Parameter(torch.zeros_like(w)))
        self.source_names[f"d_{name}"] = name


def tangent_add(a: Pair, b: Pair) -> Pair:
    """Residual add: ``(a + b, jvp_a + jvp_b)`` (the JVP of a sum is the sum of JVPs)."""
    return a[0] + b[0], a[1] + b[1]


class TangentLinear(TangentModule):
    """Linearised fully-connected layer, eq. 11.

    ``y = x W^T + b``; ``jvp = jvp_x W^T + x dW^T + db``. The second product is accumulated into the
    first by the GEMM itself (``addmm`` with ``beta = 1``): no concatenated copies of the activations or
    of ``[W, dW]`` and no separate add pass, which on a CPU costs as much as the products at ViT-S sizes.
    With ``jvp_x=None`` only ``x dW^T + db`` is computed.

    Shapes: ``x, jvp_x: (..., in)`` -> ``y, jvp: (..., out)``.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self._pretrained("weight", weight)  # (out, in)
        self.has_bias = bias is not None
        if bias is not None:
            self._pretrained("bias", bias)  # (out,)

    @classmethod
    def from_module(cls, module: nn.Linear) -> TangentLinear:
        """Linearise an ``nn.Linear`` around its current weights."""
        return cls(module.weight, module.bias)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        b = self.bias if self.has_bias else None
        db = self.d_bias if self.has_bias else None
        y = F.linear(x, self.weight, b)
        jvp = F.linear(x, self.d_weight, db)  # (..., out)
        if jvp_x is None:
            return y, jvp
        lead, out = jvp.shape[:-1], jvp.shape[-1]
        acc = torch.addmm(jvp.reshape(-1, out), jvp_x.reshape(-1, jvp_x.shape[-1]), self.weight.t())
        return y, acc.view(*lead, out)  # (M, out) -> (..., out)


class TangentLayerNorm(TangentModule):
    """Linearised LayerNorm over the last axis, eq. 9-10 (exact, including through mean/variance).

    With ``mu = E[x]``, ``s = sqrt(Var[x] + eps)`` (biased variance, as ``nn.LayerNorm``),
    ``xh = (x - mu) / s`` and ``c = jvp_x - E[jvp_x]``:
    ``jvp_xh = (c - xh * E[xh * c]) / s`` and ``jvp_y = jvp_xh * gamma + xh * dgamma + dbeta``.
    (Eq. 10 writes ``Var[x]`` for ``s^2``; we keep ``eps`` so the JVP is exact for ``nn.LayerNorm``.)

    Shapes: ``x, jvp_x: (..., D)`` -> ``(..., D)``.
    """

    def __init__(self, weight: Tensor, bias: Tensor, eps: float) -> None:
        super().__init__()
        self._pretrained("weight", weight)  # (D,)
        self._pretrained("bias", bias)  # (D,)
        self.eps = float(eps)

    @classmethod
    def from_module(cls, module: nn.LayerNorm) -> TangentLayerNorm:
        """Linearise an ``nn.LayerNorm`` (with elementwise affine) around its current weights."""
        return cls(module.weight, module.bias, module.eps)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        d = x.shape[-1]
        xh, _, rstd = torch.native_layer_norm(x, (d,), None, None, self.eps)  # xh (..., D), rstd (..., 1)
        y = torch.addcmul(self.bias, xh, self.weight)
        jvp = torch.addcmul(self.d_bias, xh, self.d_weight)
        if jvp_x is not None:
            c = jvp_x - jvp_x.mean(dim=-1, keepdim=True)
            jxh = (c - xh * (xh * c).mean(dim=-1, keepdim=True)) * rstd
            jvp = torch.addcmul(jvp, jxh, self.weight)
        return y, jvp


def gelu_derivative(x: Tensor) -> Tensor:
    """Exact derivative of erf-GELU ``x Phi(x)``: ``Phi(x) + x phi(x)`` (eq. 12 with
    ``GELU(x)/x = Phi(x)``, written without the division so ``x = 0`` is safe)."""
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf


class TangentGELU(nn.Module):
    """Linearised exact (erf) GELU, eq. 12: ``jvp_y = GELU'(x) * jvp_x``. No weights."""

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        if jvp_x is None:
            y = F.gelu(x)
            return y, torch.zeros_like(y)
        cdf = torch.erf(x * (1.0 / math.sqrt(2.0))).add_(1.0).mul_(0.5)  # Phi(x), shared by y and y'
        pdf = torch.exp(x * x * -0.5).mul_(1.0 / math.sqrt(2.0 * math.pi))
        return x * cdf, torch.addcmul(cdf, x, pdf).mul_(jvp_x)


class TangentLayerScale(TangentModule):
    """Linearised Dinov2 layer-scale ``y = x * lambda1``: ``jvp = jvp_x * lambda1 + x * dlambda1``.

    Shapes: ``(..., D)`` -> ``(..., D)``.
    """

    def __init__(self, lambda1: Tensor) -> None:
        super().__init__()
        self._pretrained("lambda1", lambda1)  # (D,)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        jvp = x * self.d_lambda1
        if jvp_x is not None:
            jvp = jvp + jvp_x * self.lambda1
        return x * self.lambda1, jvp


class TangentAttention(nn.Module):
    """Linearised multi-head softmax self-attention, eq. 6-8 (no mask, no dropout).

    Per head: ``Q, K, V`` and their JVPs from :class:`TangentLinear` (eq. 8, incl. ``W jvp_in``);
    ``S = Q K^T * scale``, ``jvp_S = (jvp_Q K^T + Q jvp_K^T) * scale`` (eq. 7, the second product
    accumulated into the first by ``baddbmm``); ``A = softmax(S)``,
    ``jvp_A = A * (jvp_S - sum_j A * jvp_S)`` (eq. 6, the softmax JVP);
    ``O = A V``, ``jvp_O = jvp_A V + A jvp_V`` (likewise accumulated); then the output projection. Shapes: ``x: (B,
    N, D)`` -> ``(B, N, D)``.
    """

    def __init__(self, q: TangentLinear, k: TangentLinear, v: TangentLinear, o: TangentLinear, num_heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        self.num_heads = int(num_heads)
        self.head_dim = q.weight.shape[0] // self.num_heads
        self.scale = self.head_dim**-0.5

    def _heads(self, t: Tensor) -> Tensor:
        b, n, _ = t.shape
        return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, N, D) -> (B, H, N, Dh)

    def forward(self, x: Tensor, jvp_x: Tensor | None) -> Pair:
        b, n, _ = x.shape
        q, jq = (self._heads(t) for t in self.q(x, jvp_x))  # (B, H, N, Dh) each
        k, jk = (self._heads(t) for t in self.k(x, jvp_x))
        v, jv = (self._heads(t) for t in self.v(x, jvp_x))
        h, dh = self.num_heads, self.head_dim
        q, jq, v, jv = (t.reshape(b * h, n, dh) for t in (q, jq, v, jv))  # (B*H, N, Dh)
        kt, jkt = (t.reshape(b * h, n, dh).transpose(1, 2) for t in (k, jk))  # (B*H, Dh, N)
        s = torch.bmm(q, kt).mul_(self.scale)  # (B*H, N, N)
        # eq. 7: (jq K^T + Q jk^T) * scale, the second product accumulated into the first by the GEMM
        js = torch.baddbmm(torch.bmm(jq, kt), q, jkt).mul_(self.scale)
        a = torch.softmax(s, dim=-1)  # (B*H, N, N)
        ja = a * (js - (a * js).sum(dim=-1, keepdim=True))  # eq. 6
        o = torch.bmm(a, v)  # (B*H, N, Dh)
        jo = torch.baddbmm(torch.bmm(ja, v), a, jv)  # eq. 8: jA V + A jV
        o = o.view(b, h, n, dh).transpose(1, 2).reshape(b, n, -1)  # (B*H, N, Dh) -> (B, N, D)
        jo = jo.view(b, h, n, dh).transpose(1, 2).reshape(b, n, -1)
        return self.o(o, jo)


class TangentPatchEmbedding(nn.Module):
    """Linearised patch embedding: a stride-``p`` ``Conv2d`` with kernel ``p`` is a linear map on
    non-overlapping patches. Pixels carry no tangent, so ``jvp = patches dW^T + db``.

    Shapes: ``pixel_values: (B, C, Hi, Wi)`` -> ``(B, (Hi/p)*(Wi/p), D)``.
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        p = conv.kernel_size
        if tuple(conv.stride) != tuple(p) or conv.padding not in ((0, 0), 0, "valid"):
            raise ConfigError(f"patch conv must have stride == kernel_size and no padding, got {conv}")
        self.patch = tuple(p)
        w = conv.weight.reshape(conv.out_channels, -1)  # (D, C, p, p) -> (D, C*p*p)
        self.linear = TangentLinear(w, conv.bias)
        self.source_names = {"linear.d_weight": "weight", "linear.d_bias": "bias"}

    def patches(self, pixel_values: Tensor) -> Tensor:
        """Unfold non-overlapping patches, ordered like ``conv(...).flatten(2).transpose(1, 2)``."""
        cols = F.unfold(pixel_values, kernel_size=self.patch, stride=self.patch)  # (B, C*p*p, P)
        return cols.transpose(1, 2)  # (B, C*p*p, P) -> (B, P, C*p*p)

    def forward(self, pixel_values: Tensor) -> Pair:
        return self.linear(self.patches(pixel_values.to(self.linear.weight.dtype)), None)


class TangentEmbeddings(TangentModule):
    """Linearised ViT/Dinov2 embeddings: ``[cls; patch_embed(x)] + pos`` with deltas on the CLS
    token, the position embeddings and the patch projection (no position interpolation: the
    input must have the pretrained image size). Shapes: ``(B, C, Hi, Wi)`` -> ``(B, 1+P, D)``.
    """

    def __init__(self, patch: TangentPatchEmbedding, cls_token: Tensor, position_embeddings: Tensor) -> None:
        super().__init__()
        self.patch = patch
        self._pretrained("cls_token", cls_token)  # (1, 1, D)
        self._pretrained("position_embeddings", position_embeddings)  # (1, 1+P, D)

    def forward(self, pixel_values: Tensor) -> Pair:
        e, je = self.patch(pixel_values)  # (B, P, D)
        b = e.shape[0]
        y = torch.cat([self.cls_token.expand(b, -1, -1), e], dim=1)  # (B, 1+P, D)
        j = torch.cat([self.d_cls_token.expand(b, -1, -1), je], dim=1)  # (B, 1+P, D)
        if y.shape[1] != self.position_embeddings.shape[1]:
            raise DataError(
                f"got {y.shape[1] - 1} patches, the position embeddings hold "
                f"{self.position_embeddings.shape[1] - 1}; resize images to the pretrained size"
            )
        return y + self.position_embeddings, j + self.d_position_embeddings
