"""Weight-space composition of tangent models and unlearning by subtraction (eq. 13, Sect. 3.2-3.3).

A tangent model ``f_lin(x; dw) = f_w(x) + J_w(x) dw`` is linear in ``dw``, so for weights ``lambda_i``

    sum_i lambda_i f_lin(x; dw_i) = f_w(x) + J_w(x) sum_i lambda_i dw_i          (eq. 13)

when ``sum_i lambda_i = 1``: the ensemble of N component models equals one model whose delta is the
weighted average of the component deltas (O(1) instead of O(N) inference). Because the composed delta
is an average, one component can be removed exactly (Sect. 3.3, "forgetting for free"):

    (N * mean_N - dw_j) / (N - 1) = mean of the other N - 1 deltas.

A *delta* is either a sequence of tensors (e.g. ``[p.detach() for p in deltas]``) or a ``dict``
name -> tensor (e.g. a state dict of the delta parameters); all deltas in one call must have the same
structure (same length / keys, same shapes). Results have the structure of the inputs (a list for a
sequence, a dict with the keys in the order of the first delta for a mapping) and are new, detached
tensors (composition is a post-training weight operation, not part of the autograd graph).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from core.errors import ConfigError, DataError

__all__ = ["Delta", "add_component", "compose", "ensemble_logits", "remove_component"]

Delta = Sequence[Tensor] | Mapping[str, Tensor]
WeightsLike = Sequence[float] | Tensor | None


def _flatten(delta: Delta, what: str) -> tuple[list[str] | None, list[Tensor]]:
    """Keys (None for a sequence) and tensors of one delta."""
    if isinstance(delta, Tensor):
        raise DataError(f"{what} is a bare tensor; wrap it in a list ([t]) or a dict ({{'name': t}})")
    if isinstance(delta, Mapping):
        keys = list(delta.keys())
        tensors = [delta[k] for k in keys]
        names = [repr(k) for k in keys]
    elif isinstance(delta, Sequence) and not isinstance(delta, str | bytes):
        keys = None
        tensors = list(delta)
        names = [str(i) for i in range(len(tensors))]
    else:
        raise DataError(f"{what} must be a list of tensors or a dict name->tensor, got {type(delta).__name__}")
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            desc = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise DataError(f"{what}[{name}] must be a floating tensor, got {desc}")
    return keys, tensors


def _rebuild(keys: list[str] | None, tensors: list[Tensor]) -> Delta:
    if keys is None:
        return tensors
    return dict(zip(keys, tensors, strict=True))


def _match(
    ref_keys: list[str] | None, ref: list[Tensor], keys: list[str] | None, ts: list[Tensor], what: str
) -> list[Tensor]:
    """Tensors of ``ts`` in the order of ``ref``, checking same structure and shapes."""
    if (ref_keys is None) != (keys is None):
        raise DataError(f"{what} mixes list and dict deltas; pass all deltas as lists or all as dicts")
    if ref_keys is not None and keys is not None:
        if set(keys) != set(ref_keys):
            missing, extra = (
                sorted(map(str, set(ref_keys) - set(keys))),
                sorted(map(str, set(keys) - set(ref_keys))),
            )
            raise DataError(f"{what} has different keys: missing {missing}, extra {extra}; deltas must share names")
        by_key = dict(zip(keys, ts, strict=True))
        ts = [by_key[k] for k in ref_keys]
        names = [repr(k) for k in ref_keys]
    else:
        if len(ts) != len(ref):
            raise DataError(f"{what} has {len(ts)} tensors, expected {len(ref)}; deltas must have the same structure")
        names = [str(i) for i in range(len(ts))]
    for name, a, b in zip(names, ref, ts, strict=True):
        if a.shape != b.shape:
            raise DataError(f"{what}[{name}] has shape {tuple(b.shape)}, expected {tuple(a.shape)}")
    return ts


def _weights(weights: WeightsLike, n: int, normalize: bool) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    w = weights.detach().flatten().tolist() if isinstance(weights, Tensor) else list(weights)
    if len(w) != n:
        raise ConfigError(f"got {len(w)} weights for {n} components; pass one weight per component")
    for i, x in enumerate(w):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ConfigError(f"weight {i} must be a finite number, got {x!r}")
    w = [float(x) for x in w]
    if normalize:
        if any(x < 0 for x in w):
            raise ConfigError(
                f"weights must be >= 0 to average, got {w}; pass normalize=False for a signed combination"
            )
        total = math.fsum(w)
        if total <= 0:
            raise ConfigError(f"weights sum to {total}; need a positive sum to normalize them")
        w = [x / total for x in w]
    return w


def compose(deltas: Sequence[Delta], weights: WeightsLike = None, *, normalize: bool = True) -> Delta:
    """Composed delta ``sum_i lambda_i dw_i`` (eq. 13).

    Args:
        deltas: N >= 1 deltas of identical structure; each a list of tensors or a dict name->tensor,
            any shapes (shape of tensor p: S_p).
        weights: None -> uniform average ``lambda_i = 1/N``; else N finite numbers (list or (N,) tensor),
            e.g. shard sizes for a sample-weighted average.
        normalize: with ``weights``, divide them by their sum (a weighted average: the composed model
            then equals the output ensemble, eq. 13). ``False`` uses them as given (any signs).
    Returns:
        delta of the same structure (list / dict), tensors of shape S_p in the first delta's dtype.
    """
    if isinstance(deltas, Mapping | Tensor) or not isinstance(deltas, Sequence) or len(deltas) == 0:
        raise ConfigError("compose needs a non-empty list of deltas (one per component model)")
    ref_keys, ref = _flatten(deltas[0], "deltas[0]")
    columns = [ref]
    for i in range(1, len(deltas)):
        keys, ts = _flatten(deltas[i], f"deltas[{i}]")
        columns.append(_match(ref_keys, ref, keys, ts, f"deltas[{i}]"))
    lam = _weights(weights, len(deltas), normalize)
    out: list[Tensor] = []
    for p in range(len(ref)):
        acc = torch.zeros_like(ref[p])
        for i, col in enumerate(columns):
            acc.add_(col[p].detach().to(ref[p].dtype), alpha=lam[i])
        out.append(acc)
    return _rebuild(ref_keys, out)


def _check_n(n_components: int) -> int:
    if isinstance(n_components, bool) or not isinstance(n_components, int):
        raise ConfigError(f"n_components must be an int, got n_components={n_components!r}")
    return n_components


def remove_component(composed: Delta, component: Delta, n_components: int) -> Delta:
    """Unlearn one shard: ``(N * composed - dw_j) / (N - 1)`` (Sect. 3.3).

    If ``composed`` is the uniform average of N deltas including ``dw_j`` the result is the uniform
    average of the other N - 1, i.e. the model that never saw shard j (up to float rounding; exact
    to ~1e-15 relative in float64).

    Args:
        composed: the uniform average of ``n_components`` deltas (list / dict, shapes S_p).
        component: the delta ``dw_j`` of the shard to forget (same structure).
        n_components: N, the number of components averaged in ``composed`` (>= 2).
    Returns:
        delta of the same structure: the average of the remaining N - 1 components.
    """
    n = _check_n(n_components)
    if n < 2:
        raise ConfigError(
            f"cannot remove a component from n_components={n}; need >= 2 (removing the last one leaves the "
            "pre-trained model: use a zero delta)"
        )
    keys, comp = _flatten(composed, "composed")
    ckeys, cts = _flatten(component, "component")
    cts = _match(keys, comp, ckeys, cts, "component")
    out = [(n * a.detach() - b.detach().to(a.dtype)) / (n - 1) for a, b in zip(comp, cts, strict=True)]
    return _rebuild(keys, out)


def add_component(composed: Delta, component: Delta, n_components: int) -> Delta:
    """Add one component to a uniform average of ``n_components`` (>= 1): ``(N * composed + dw) / (N + 1)``."""
    n = _check_n(n_components)
    if n < 1:
        raise ConfigError(f"n_components must be >= 1 for an existing average, got n_components={n}")
    keys, comp = _flatten(composed, "composed")
    ckeys, cts = _flatten(component, "component")
    cts = _match(keys, comp, ckeys, cts, "component")
    out = [(n * a.detach() + b.detach().to(a.dtype)) / (n + 1) for a, b in zip(comp, cts, strict=True)]
    return _rebuild(keys, out)


def ensemble_logits(logits: Sequence[Tensor], weights: WeightsLike = None, *, normalize: bool = True) -> Tensor:
    """Output ensemble ``sum_i lambda_i f_lin^i(x)`` (left-hand side of eq. 13).

    For tangent models this equals the logits of the model with delta ``compose(deltas, weights)``.

    Args:
        logits: N >= 1 tensors of one shape, e.g. (B, C) per component model.
        weights / normalize: as in :func:`compose`.
    Returns:
        tensor of the common shape, e.g. (B, C).
    """
    if isinstance(logits, Tensor) or not isinstance(logits, Sequence) or len(logits) == 0:
        raise ConfigError("ensemble_logits needs a non-empty list of logit tensors (one per component model)")
    for i, t in enumerate(logits):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise DataError(f"logits[{i}] must be a floating tensor, got {type(t).__name__}")
        if t.shape != logits[0].shape:
            raise DataError(f"logits[{i}] has shape {tuple(t.shape)}, expected {tuple(logits[0].shape)}")
    lam = _weights(weights, len(logits), normalize)
    out = torch.zeros_like(logits[0])
    for w, t in zip(lam, logits, strict=True):
        out = out + w * t.to(out.dtype)
    return out
