r"""Phantom Clipping (DPFormer, Sec. 4.2, Claim 4.1, App. B): exact per-sample gradient norms and
weighted sums of per-sample gradients, without instantiating per-sample gradients.

Notation, per sample i (index dropped), for a layer applied at T positions (tokens, or time steps
of a recurrent cell, which are concatenated along T):

* ``nn.Linear`` y = x W^T + b, A = inputs (T, d_in), G = dL_i/dy (T, d_out):
  ``g_W = G^T A`` and ``||g_W||^2 = <A A^T, G G^T>`` (ghost norm, O(T^2 (d_in + d_out)), Li et
  al. 2022) or ``||G^T A||^2`` materialised (O(T d_in d_out)); the cheaper of the two is used per
  layer, as in fastDP's hybrid. ``g_b = sum_t G[t]`` (direct).
* ``nn.Embedding`` E (V, d) looked up at ids x (T,), G = dL_i/de (T, d): ``g_E = a^T G`` with ``a``
  the (T, V) one-hot matrix, ``||g_E||^2 = <a a^T, G G^T> = sum_{t,u} [x_t = x_u] <G[t], G[u]>``,
  or materialised by a scatter when V is small (positional embeddings). Rows at ``padding_idx``
  get no gradient from ``nn.Embedding``, so their G rows are dropped.
* ``nn.LayerNorm``: per-sample gradients ``sum_t G[t] * xhat[t]`` and ``sum_t G[t]`` (direct, cheap).
* **Shared embedding** (Claim 4.1): E is both looked up (ids x, grads ``Ge = grad e_s`` (L, d)) and
  used as the output layer ``logits = H E^T`` (H (L, d), G = dL/dlogits (L, M)), so
  ``g_E = a^T Ge + G^T H`` and

  .. math:: ||g_E||^2 = <a a^T, Ge Ge^T> + <H H^T, G G^T> + 2 \sum_{t,u} G[u, x_t] <Ge[t], H[u]>.

  The printed eq. 4.1 / App. B contain typos: the first term is not squared, ``||grad e_c||^2``
  (M x d per sample, ``grad e_c = G^T H``) is itself a ghost norm, and the cross term is
  ``<grad e_s, a grad e_c>`` (``a`` is (L, M), so ``a grad e_c`` gathers rows x_t of
  ``grad e_c``), evaluated above as a gather of G's columns at the input ids times the (L, L)
  Gram matrix of Ge with H. Extra memory O(B L^2); nothing of size O(B M d) is formed.

  Mixed choice (Bu et al.'s mixed ghost clipping, applied to Claim 4.1): the ghost form of
  ``||grad e_c||^2`` and of the cross term costs about ``L^2 (M + 2 d)`` per sample, materialising
  ``grad e_c = G^T H`` (M, d) costs ``L d M``; when the latter is cheaper (L > d M / (M + 2 d), e.g.
  L = 200, d = 64) eq. 4.1 is evaluated with ``grad e_c`` materialised, a chunk of samples at a time
  (at most about an eighth of G's memory): ``||grad e_c||^2`` directly and the cross term
  ``<grad e_s, a grad e_c>`` as the paper writes it, a gather of rows x_t of ``grad e_c``
  (O(L d)). The first term stays the ghost norm; the weighted sum stays factored either way.

Algorithm ("book-keeping", Bu et al. 2023). Forward hooks record each supported module's input
and output. :meth:`PhantomClipping.per_sample_norms` runs **one** backward,
``torch.autograd.grad(sum_i L_i, module outputs)``: since no parameter is requested, autograd skips
every weight-gradient product and returns the output gradients G, i.e. half of a regular backward.
:meth:`PhantomClipping.accumulate_grad` then forms ``sum_i c_i g_i`` directly from the stored
(A, G) pairs (``G^T (c * A)``, an ``index_add`` for embeddings), the other half. Clipping therefore
costs one ordinary forward + backward plus the norms, whereas the ghost-clipping second backward
of ``sum_i c_i L_i`` would recompute all output gradients. Both are exact.

Requirements: every trainable parameter belongs to an ``nn.Linear``, ``nn.Embedding`` or
``nn.LayerNorm`` (or a subclass that keeps its ``forward``, e.g. Opacus' ``RNNLinear``) and is
used only through those modules' calls (a parameter also used functionally, e.g.
``F.linear(h, emb.weight)``, would be missed; tie by sharing the Parameter between modules
instead); samples interact only through the loss sum (no BatchNorm); module inputs are not
modified in place after the call (outputs may be: their gradient is taken at the autograd edge
where the module produced them, and the output tensors are not kept, so the logits are freed as
in a regular step); dimension 0 of every hooked input is the batch.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Self, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from core.errors import ConfigError, PrivacyError

Strategy = Literal["auto", "ghost", "direct"]
SUPPORTED_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.LayerNorm)


@dataclass
class _LinearUse:
    """Factored per-sample gradient ``G_i^T A_i`` (d_out, d_in) of a Linear weight."""

    acts: Tensor  # (B, T, d_in)
    grads: Tensor  # (B, T, d_out)


@dataclass
class _EmbeddingUse:
    """Factored per-sample gradient ``onehot(ids_i)^T G_i`` (V, d) of an embedding table."""

    ids: Tensor  # (B, T) int64
    grads: Tensor  # (B, T, d), zero at padding_idx
    num_embeddings: int


_Use = _LinearUse | _EmbeddingUse | Tensor  # a Tensor is a materialised per-sample gradient (B, *p.shape)


@dataclass
class _Call:
    module: nn.Module
    input: Tensor
    output: GradientEdge | Tensor  # an edge where possible: a large output (the logits) is not kept alive
    output_shape: torch.Size
    input_version: int
    output_version: int | None  # None for an edge (see _output_handle)


def _output_handle(output: Tensor) -> GradientEdge | Tensor:
    """What to differentiate the loss against for a module output, without keeping the output alive.

    The autograd edge of the output, or of its base when the output is a reshaping view of it (a Linear
    on 3-D inputs returns ``addmm(...).view(...)``): the gradient reaching that edge is the gradient of
    the value the module produced, even if the output is modified in place later (the in-place op
    re-routes the graph through the base's original node). Other views keep the tensor itself, whose
    in-place modification is then detected.
    """
    base = output._base if output._is_view() else output
    reshaped = base.numel() == output.numel() and base.is_contiguous() and output.is_contiguous()
    if (base is output or reshaped) and base.grad_fn is not None:
        return get_gradient_edge(base)
    return output


def _is_supported(module: nn.Module) -> bool:
    return any(isinstance(module, cls) and type(module).forward is cls.forward for cls in SUPPORTED_MODULES)


def _supported_names() -> str:
    return ", ".join(f"nn.{cls.__name__}" for cls in SUPPORTED_MODULES)


def hooked_modules(model: nn.Module) -> list[nn.Module]:
    """Supported modules owning trainable parameters; raises ConfigError if any parameter is uncovered."""
    hooked, covered = [], set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and _is_supported(module):
            _check_module_options(module)
            hooked.append(module)
            covered.update(id(p) for p in own)
    uncovered = sorted(
        {
            f"{name or '<root>'} ({type(module).__name__})"
            for name, module in model.named_modules()
            for p in module.parameters(recurse=False)
            if p.requires_grad and id(p) not in covered
        }
    )
    if uncovered:
        raise ConfigError(
            f"phantom clipping cannot compute per-sample norms for trainable parameters of "
            f"{', '.join(uncovered)}; supported modules: {_supported_names()} (subclasses must not "
            "override forward); freeze those parameters, rewrite the layer from supported modules, "
            "or use the opacus_hooks clipper"
        )
    return hooked


def _check_module_options(module: nn.Module) -> None:
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
        raise ConfigError(
            f"nn.Embedding with max_norm={module.max_norm} / scale_grad_by_freq={module.scale_grad_by_freq} "
            "changes its weights or gradient in ways per-sample norms do not model; use the defaults"
        )


# ----------------------------------------------------------------- per-call factored gradients


def _uses_of(call: _Call, grad: Tensor) -> list[tuple[nn.Parameter, _Use]]:
    """Per-parameter factored per-sample gradients of one module call, given its output grad."""
    module, B = call.module, grad.shape[0]
    uses: list[tuple[nn.Parameter, _Use]] = []
    if isinstance(module, nn.Linear):
        G = grad.reshape(B, -1, module.out_features)  # (B, T, d_out)
        if module.weight.requires_grad:
            A = call.input.reshape(B, -1, module.in_features).to(G.dtype)  # (B, T, d_in)
            uses.append((module.weight, _LinearUse(A, G)))
        if module.bias is not None and module.bias.requires_grad:
            uses.append((module.bias, G.sum(dim=1)))  # (B, d_out)
    elif isinstance(module, nn.Embedding):
        ids = call.input.reshape(B, -1)  # (B, T)
        G = grad.reshape(B, -1, module.embedding_dim)  # (B, T, d)
        if module.padding_idx is not None:
            G = G.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0.0)
        uses.append((module.weight, _EmbeddingUse(ids, G, module.num_embeddings)))
    else:  # nn.LayerNorm
        shape = module.normalized_shape
        n = int(torch.Size(shape).numel())
        G = grad.reshape(B, -1, n)  # (B, T, n)
        if module.weight is not None and module.weight.requires_grad:
            xhat = F.layer_norm(call.input.to(G.dtype), shape, eps=module.eps).reshape(B, -1, n)  # (B, T, n)
            uses.append((module.weight, (G * xhat).sum(dim=1).view(B, *shape)))
        if module.bias is not None and module.bias.requires_grad:
            uses.append((module.bias, G.sum(dim=1).view(B, *shape)))
    return uses


# ----------------------------------------------------------------- inner products of factored forms


def _linear_sq_norm(u: _LinearUse) -> Tensor:
    """``<A A^T, G G^T>`` per sample: (B,)."""
    aat = torch.bmm(u.acts, u.acts.transpose(1, 2))  # (B, T, T)
    ggt = torch.bmm(u.grads, u.grads.transpose(1, 2))  # (B, T, T)
    return (aat * ggt).sum(dim=(1, 2))


def _embedding_sq_norm(u: _EmbeddingUse) -> Tensor:
    """``sum_{t,u} [x_t = x_u] <G[t], G[u]>`` per sample: (B,)."""
    same = u.ids.unsqueeze(2) == u.ids.unsqueeze(1)  # (B, T, T)
    ggt = torch.bmm(u.grads, u.grads.transpose(1, 2))  # (B, T, T)
    return (ggt * same).sum(dim=(1, 2))


def _embedding_linear_dot(e: _EmbeddingUse, lin: _LinearUse) -> Tensor:
    """``<onehot(x)^T Ge, G^T H> = sum_{t,u} G[u, x_t] <Ge[t], H[u]>`` per sample: (B,)."""
    B, Tl, _ = lin.grads.shape
    Te = e.ids.shape[1]
    index = e.ids.unsqueeze(1).expand(B, Tl, Te)  # (B, Tl, Te)
    g_at_ids = torch.gather(lin.grads, 2, index)  # (B, Tl, Te): G[u, x_t]
    gram = torch.bmm(lin.acts, e.grads.transpose(1, 2))  # (B, Tl, Te): <H[u], Ge[t]>
    return (g_at_ids * gram).sum(dim=(1, 2))


def _materialise(use: _Use) -> Tensor:
    """Per-sample gradients (B, *param.shape) of one factored use."""
    if isinstance(use, _LinearUse):
        return torch.bmm(use.grads.transpose(1, 2), use.acts)  # (B, d_out, d_in)
    if isinstance(use, _EmbeddingUse):
        B, T, d = use.grads.shape
        out = use.grads.new_zeros(B, use.num_embeddings, d)  # (B, V, d)
        return out.scatter_add_(1, use.ids.unsqueeze(-1).expand(B, T, d), use.grads)
    return use


def _weighted_sum(use: _Use, coef: Tensor) -> Tensor:
    """``sum_i coef_i g_i`` (param shape) of one use, coef (B,), without per-sample gradients."""
    if isinstance(use, _LinearUse):
        A, G, c = use.acts, use.grads, coef.view(-1, 1, 1)
        if G.shape[2] <= A.shape[2]:  # scale the smaller factor
            G = G * c
        else:
            A = A * c
        # (d_in, B*T) @ (B*T, d_out), transposed: the layout autograd uses, ~2x faster than G^T A
        # on CPU when d_out >> d_in (the output layer)
        return (A.flatten(0, 1).T @ G.flatten(0, 1)).T.contiguous()
    if isinstance(use, _EmbeddingUse):
        B, T, d = use.grads.shape
        weighted = (use.grads * coef.view(B, 1, 1)).reshape(B * T, d)  # (B*T, d)
        out = use.grads.new_zeros(use.num_embeddings, d)
        return out.index_add_(0, use.ids.reshape(B * T), weighted)  # (V, d)
    return torch.tensordot(coef, use, dims=1)


class _ParamGrads:
    """All per-sample gradient contributions to one parameter, merged into the cheapest exact form.

    Uses of one kind are concatenated along T (a Linear called at every RNN step is one Linear on
    the whole sequence). Linear + Embedding uses (a tied embedding) stay factored and are combined
    with the cross term of Claim 4.1 (ghost or with ``grad e_c`` materialised, whichever is cheaper,
    for the norm; always factored for the weighted sum); any materialised part forces materialising
    the rest.
    """

    def __init__(self, uses: list[_Use], strategy: Strategy, tied_sq_norm: TiedSqNorm | None = None) -> None:
        self.strategy, self.tied_sq_norm = strategy, tied_sq_norm
        self.grad_ec: Tensor | None = None  # (B, M, d), kept by the materialised branch of eq. 4.1 if small
        linear = [u for u in uses if isinstance(u, _LinearUse)]
        embedding = [u for u in uses if isinstance(u, _EmbeddingUse)]
        direct = [u for u in uses if isinstance(u, Tensor)]
        self.linear = _concat_linear(linear)
        self.embedding = _concat_embedding(embedding)
        self.direct = sum(direct[1:], direct[0]) if direct else None
        if self._should_materialise(strategy):
            parts = [_materialise(u) for u in (self.linear, self.embedding, self.direct) if u is not None]
            self.direct = sum(parts[1:], parts[0])
            self.linear = self.embedding = None

    def _should_materialise(self, strategy: Strategy) -> bool:
        factored = [u for u in (self.linear, self.embedding) if u is not None]
        if not factored:
            return False
        if self.direct is not None:  # no factored form for the cross terms with a dense part
            return True
        if strategy != "auto":
            return strategy == "direct"
        if len(factored) == 2:  # tied embedding: the phantom formula never materialises
            return False
        return not _ghost_is_cheaper(factored[0])

    def sq_norms(self) -> Tensor:
        """Squared per-sample gradient norms (B,)."""
        if self.direct is not None:
            return self.direct.flatten(1).pow(2).sum(dim=1)
        if self.embedding is not None and self.linear is not None:  # shared embedding (Claim 4.1)
            if self.tied_sq_norm is not None:
                return self.tied_sq_norm(self.embedding, self.linear)
            if self.strategy == "auto" and not _tied_ghost_is_cheaper(self.linear):
                terms, self.grad_ec = _tied_output_terms(self.embedding, self.linear)
                return _embedding_sq_norm(self.embedding) + terms
        sq = 0.0
        if self.linear is not None:
            sq = sq + _linear_sq_norm(self.linear)
        if self.embedding is not None:
            sq = sq + _embedding_sq_norm(self.embedding)
            if self.linear is not None:
                sq = sq + 2.0 * _embedding_linear_dot(self.embedding, self.linear)
        return sq

    def weighted_sum(self, coef: Tensor) -> Tensor:
        if self.grad_ec is not None:  # the tied output part, kept from the norm: sum_i c_i grad e_c,i
            return torch.tensordot(coef, self.grad_ec, dims=1) + _weighted_sum(self.embedding, coef)
        parts = [u for u in (self.linear, self.embedding, self.direct) if u is not None]
        return sum((_weighted_sum(u, coef) for u in parts[1:]), _weighted_sum(parts[0], coef))


def _concat_linear(uses: list[_LinearUse]) -> _LinearUse | None:
    if len(uses) <= 1:  # torch.cat would copy even a single tensor
        return uses[0] if uses else None
    return _LinearUse(torch.cat([u.acts for u in uses], 1), torch.cat([u.grads for u in uses], 1))


def _concat_embedding(uses: list[_EmbeddingUse]) -> _EmbeddingUse | None:
    if len(uses) <= 1:
        return uses[0] if uses else None
    ids = torch.cat([u.ids for u in uses], 1)  # (B, sum T)
    return _EmbeddingUse(ids, torch.cat([u.grads for u in uses], 1), uses[0].num_embeddings)


def _ghost_is_cheaper(use: _LinearUse | _EmbeddingUse) -> bool:
    """Linear: flops of the ghost norm T^2 (d_in + d_out) vs materialising T d_in d_out.
    Embedding: ghost (T^2 d flops, T^2 memory) unless the table has at most T rows (positional
    embeddings), where the materialised B V d gradient is no bigger than the output grads."""
    if isinstance(use, _LinearUse):
        T, d_in, d_out = use.acts.shape[1], use.acts.shape[2], use.grads.shape[2]
        return T * (d_in + d_out) < d_in * d_out
    return use.ids.shape[1] < use.num_embeddings


def _tied_ghost_is_cheaper(lin: _LinearUse) -> bool:
    """Tied output layer: ghost ``||G^T H||^2`` + cross term, ~T^2 (M + 2 d) flops per sample, against
    materialising ``grad e_c = G^T H``, T d M flops."""
    T, d, M = lin.acts.shape[1], lin.acts.shape[2], lin.grads.shape[2]
    return T * (M + 2 * d) <= d * M


def _tied_output_terms(e: _EmbeddingUse, lin: _LinearUse) -> tuple[Tensor, Tensor | None]:
    """``||grad e_c||^2 + 2 <grad e_s, a grad e_c>`` of eq. 4.1 with ``grad e_c = G^T H`` materialised (B,),
    and ``grad e_c`` (B, M, d) itself when it takes at most half the memory of the output grads G (B, T, M),
    i.e. d <= T / 2: the weighted sum then reuses it (``sum_i c_i grad e_c,i``, B M d flops) instead of
    recomputing ``G^T (c H)`` (B T M d). Otherwise samples are taken in chunks so that ``grad e_c`` of a
    chunk, (b, M, d), holds at most about an eighth of the memory of G, and None is returned.
    """
    B, T, d = lin.acts.shape
    if 2 * d <= T:
        grad_ec = torch.bmm(lin.grads.transpose(1, 2), lin.acts)  # (B, M, d)
        rows = torch.gather(grad_ec, 1, e.ids.unsqueeze(-1).expand(-1, -1, d))  # (B, Te, d)
        return grad_ec.flatten(1).pow(2).sum(dim=1) + 2.0 * (rows * e.grads).sum(dim=(1, 2)), grad_ec
    chunk = max(1, min(B, (B * T) // (8 * d)))
    out = []
    for s in range(0, B, chunk):
        G, H = lin.grads[s : s + chunk], lin.acts[s : s + chunk]  # (b, T, M), (b, T, d)
        grad_ec = torch.bmm(G.transpose(1, 2), H)  # (b, M, d)
        ids = e.ids[s : s + chunk]  # (b, Te)
        rows = torch.gather(grad_ec, 1, ids.unsqueeze(-1).expand(-1, -1, d))  # (b, Te, d): grad e_c at x_t
        sq = grad_ec.flatten(1).pow(2).sum(dim=1)
        out.append(sq + 2.0 * (rows * e.grads[s : s + chunk]).sum(dim=(1, 2)))
        del grad_ec, rows
    return torch.cat(out), None


TiedSqNorm = Callable[[_EmbeddingUse, _LinearUse], Tensor]
"""A replacement for Claim 4.1's squared norm of a shared embedding (used by the ghost-clipping baseline)."""


# ----------------------------------------------------------------- public object


class PhantomClipping:
    """Hooks a model to compute exact per-sample gradient norms and clipped gradient sums.

    Usage (one DP-SGD step; ``clip_coefficients`` from :mod:`core.dp.clipping`)::

        with PhantomClipping(model) as phantom:
            loss = per_sample_loss_fn(model(x), y)           # (B,)
            norms = phantom.per_sample_norms(loss)           # (B,), one partial backward
            phantom.accumulate_grad(clip_coefficients(norms, clip_norm=1.0, normalize=False))

    After ``accumulate_grad`` each trainable ``p.grad`` has been increased by
    ``sum_i c_i g_{i,p}`` (a zero tensor is created for unused parameters). Leaving the ``with``
    block (or :meth:`remove`) detaches every hook.

    Args:
        model: the network; see the module docstring for what is supported.
        strategy: "auto" picks ghost or materialised norms per layer by flop count (for the shared
            embedding: ghost or materialised ``grad e_c`` in eq. 4.1); "ghost" / "direct" force one
            (for tests and benchmarks). All three are exact.
        profile: record in ``timings`` the seconds spent in the output-grad backward, each
            parameter's norm and each weighted sum (summed over calls).
    """

    tied_sq_norm: TiedSqNorm | None = None  # None: Claim 4.1 (subclasses may swap in another exact formula)

    def __init__(self, model: nn.Module, *, strategy: Strategy = "auto", profile: bool = False) -> None:
        if strategy not in get_args(Strategy):
            raise ConfigError(f"unknown strategy={strategy!r}; known: {', '.join(get_args(Strategy))}")
        self.model = model
        self.strategy: Strategy = strategy
        # profile=True: seconds spent per phase and parameter, summed over steps (where the time goes)
        self.timings: dict[str, float] | None = {} if profile else None
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._calls: list[_Call] = []
        self._pending: dict[int, _ParamGrads] | None = None
        self._handles = [m.register_forward_hook(self._capture, with_kwargs=True) for m in hooked_modules(model)]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or not output.requires_grad:
            return
        x = args[0] if args else kwargs["input"]  # the single input of Linear / Embedding / LayerNorm
        handle = _output_handle(output)
        version = output._version if isinstance(handle, Tensor) else None
        self._calls.append(_Call(module, x.detach(), handle, output.shape, x._version, version))

    def clear(self) -> None:
        """Forget recorded forward passes and pending gradients (e.g. after an evaluation forward)."""
        self._calls = []
        self._pending = None

    def remove(self) -> None:
        """Detach all hooks and drop state; idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def per_sample_norms(self, per_sample_loss: Tensor) -> Tensor:
        """Exact norms ``||grad_theta L_i||`` (B,) of the full per-sample gradients, in the loss dtype.

        Consumes the forward passes recorded since the last call (one partial backward).
        """
        calls, self._calls, self._pending = self._calls, [], None
        self._check_ready(calls, per_sample_loss)
        B = per_sample_loss.shape[0]
        uses: dict[int, list[_Use]] = defaultdict(list)  # keyed by id(param)
        with self._timed("output_grads"):
            output_grads = self._output_grads(calls, per_sample_loss)
        for call, grad in zip(calls, output_grads, strict=True):
            if grad is None:  # this call does not reach the loss (e.g. an evaluation forward)
                continue
            if grad.shape[0] != B:
                raise PrivacyError(
                    f"{type(call.module).__name__} saw batch size {grad.shape[0]} but per_sample_loss "
                    f"has {B} samples; dimension 0 must be the batch in every layer"
                )
            for param, use in _uses_of(call, grad):
                uses[id(param)].append(use)
        tied = type(self).tied_sq_norm
        self._pending = {p: _ParamGrads(u, self.strategy, tied) for p, u in uses.items()}
        sq = per_sample_loss.new_zeros(B)
        for key, param_grads in self._pending.items():
            with self._timed(f"norm:{self._names.get(key, '?')}"):
                sq = sq + param_grads.sq_norms().to(sq.dtype)
        return sq.clamp(min=0.0).sqrt()

    @contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        if self.timings is None:
            yield
            return
        t0 = time.perf_counter()
        yield
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0

    def _check_ready(self, calls: list[_Call], per_sample_loss: Tensor) -> None:
        if not self._handles:
            raise PrivacyError("PhantomClipping hooks were removed; create a new PhantomClipping")
        if not calls:
            raise PrivacyError(
                "no forward pass was recorded since the last backward; run the model forward "
                "with gradients enabled after creating PhantomClipping"
            )
        if not per_sample_loss.requires_grad:
            raise PrivacyError("per_sample_loss does not require grad; compute it from the model output")
        for call in calls:
            if call.input._version != call.input_version or (
                isinstance(call.output, Tensor) and call.output._version != call.output_version
            ):
                raise PrivacyError(
                    f"the input or output of {type(call.module).__name__} was modified in place after "
                    "its forward; phantom clipping needs them unchanged (use out-of-place ops)"
                )

    def _output_grads(self, calls: list[_Call], per_sample_loss: Tensor) -> tuple[Tensor | None, ...]:
        """dL/d(output) of every call, by one backward that computes no parameter gradient.

        Trainable parameters without a recorded call are appended to the requested inputs: they
        must get no gradient (None, free); one that does is used outside its module's forward
        (e.g. functionally), which would make the norms wrong, so it raises.
        """
        seen = {id(p) for call in calls for p in call.module.parameters(recurse=False)}
        unseen = [p for p in self._params if id(p) not in seen]
        grads = torch.autograd.grad(per_sample_loss.sum(), [c.output for c in calls] + unseen, allow_unused=True)
        leaked = [tuple(p.shape) for p, g in zip(unseen, grads[len(calls) :], strict=True) if g is not None]
        if leaked:
            raise PrivacyError(
                f"trainable parameters of shapes {leaked} receive gradient without a recorded call of "
                f"their module; use them only through module calls ({_supported_names()})"
            )
        return tuple(g if g is None else g.view(c.output_shape) for g, c in zip(grads, calls, strict=False))

    def accumulate_grad(self, coefficients: Tensor) -> None:
        """Add ``sum_i coefficients_i g_i`` to every trainable ``p.grad`` (coefficients (B,))."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise PrivacyError("accumulate_grad needs per_sample_norms first (once per forward pass)")
        coefficients = coefficients.detach()
        for p in self._params:
            if id(p) in pending:
                with self._timed(f"weighted_sum:{self._names.get(id(p), '?')}"):
                    grad = pending[id(p)].weighted_sum(coefficients.to(p.dtype)).to(p.dtype).view_as(p)
            else:
                grad = torch.zeros_like(p)
            p.grad = grad if p.grad is None else p.grad + grad
