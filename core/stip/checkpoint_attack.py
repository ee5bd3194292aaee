"""The public-checkpoint attack on STIP at full strength: what P2 recovers from the state it really holds.

P1 (``core.stip.parties.Developer``) hands P2 the blocks transformed by ``pi`` (d,) *and* by a secret ``rho_l``
(m,) per layer on the MLP hidden dimension, plus, in ``vocab_perm``, ``E' = E[inv_sigma][:, pi]`` and
``H' = H[inv_sigma][:, pi]`` (``core.stip.transform``). P2 also knows the public base checkpoint that the deployed
model was fine-tuned from. Three steps, each a linear assignment (Hungarian or nearest neighbour):

1. :func:`match_pi`: every tensor with a model-dimension axis gives each coordinate ``i`` a feature vector. For a
   tensor that ``rho`` does not touch (norms, attention, biases, GPT-2 ``wpe``) it is the slice at ``i``; for an
   MLP weight, whose other axis ``rho`` scrambles, it is the slice *sorted* along the MLP axis, a statistic that
   ``rho`` leaves unchanged. Coordinates are matched to the base's by squared distance (each tensor scaled by its
   RMS) with the Hungarian algorithm.
2. :func:`match_rho`: with ``pi`` undone, each MLP unit ``j`` of layer ``l`` (its input column(s), bias and output
   row) is matched to the base's units.
3. :func:`match_sigma`: with ``pi`` undone, every row of ``E'`` (and ``H'`` when untied) is matched to the base
   table's rows: candidates by brute force on the top principal components, exact distance on the candidates,
   one-to-one by greedy assignment in order of distance, the rest by Hungarian (or, to save time, only some rows,
   each to its nearest base row).

A recovered permutation follows the transform's convention: deployed index ``i`` came from base index
``recovered[i]`` (``x' = x[recovered]``); for ``sigma`` the attack returns ``decode[o]``, the token of observed id
``o`` (the inverse of ``sigma``).
Only torch, numpy and scipy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from core.errors import ConfigError
from core.stip.attacks import as_permutation, hungarian, model_dim_axes, recovery_rate

__all__ = [
    "PiMatch",
    "SigmaMatch",
    "deployed_axes",
    "match_pi",
    "match_rho",
    "match_sigma",
    "nearest_rows",
]

# (pattern, axis of rho) for the MLP weights Developer permutes on both d (pi) and m (rho)
_RHO_RULES = {
    "gpt2": ((r"(^|\.)mlp\.c_fc\.weight$", 1), (r"(^|\.)mlp\.c_fc\.bias$", 0), (r"(^|\.)mlp\.c_proj\.weight$", 0)),
    "llama": (
        (r"(^|\.)mlp\.(gate_proj|up_proj)\.weight$", 0),
        (r"(^|\.)mlp\.(gate_proj|up_proj)\.bias$", 0),
        (r"(^|\.)mlp\.down_proj\.weight$", 1),
    ),
}
_LAYER = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


def deployed_axes(state: Mapping[str, torch.Tensor], arch: str) -> dict[str, tuple[int | None, int | None]]:
    """``{name: (pi_axis, rho_axis)}`` of every tensor of ``state`` that a secret permutation touches (either axis
    may be None: ``c_fc.bias`` has only ``rho``, a norm weight only ``pi``)."""
    if arch not in _RHO_RULES:
        raise ConfigError(f"deployed_axes: unknown arch={arch!r}; use one of {sorted(_RHO_RULES)}")
    out: dict[str, tuple[int | None, int | None]] = {n: (a, None) for n, a in model_dim_axes(state, arch).items()}
    rules = [(re.compile(p), ax) for p, ax in _RHO_RULES[arch]]
    for name, tensor in state.items():
        for pat, ax in rules:
            if pat.search(name) and tensor.dim() > ax:
                out[name] = (out.get(name, (None, None))[0], ax)
                break
    return out


def _coordinate_features(t: torch.Tensor, pi_axis: int, rho_axis: int | None) -> torch.Tensor:
    """(d, L) per-coordinate features of ``t``: its slices along ``pi_axis``, sorted along ``rho_axis`` if any
    (a multiset of values that ``rho`` does not change)."""
    x = t.detach().to(torch.float32)
    if rho_axis is not None:
        x = x.sort(dim=rho_axis).values
    return x.movedim(pi_axis, 0).reshape(x.shape[pi_axis], -1)


@dataclass
class PiMatch:
    """Outcome of :func:`match_pi` (``recovered`` is the estimate of ``pi``)."""

    recovered: np.ndarray
    recovery_rate: float | None
    n_tensors: int
    n_sorted: int  # MLP tensors used through their rho-invariant sorted slices


def _common(deployed: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], names: list[str]) -> list[str]:
    out = []
    for n in names:
        if n in deployed and n in base:
            if tuple(deployed[n].shape) != tuple(base[n].shape):
                raise ConfigError(
                    f"tensor {n!r} has shape {tuple(deployed[n].shape)} deployed but {tuple(base[n].shape)} in the "
                    "base checkpoint; sizes must match"
                )
            out.append(n)
    return out


@torch.no_grad()
def match_pi(
    deployed: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    arch: str,
    *,
    true_pi: object | None = None,
    use_mlp: bool = True,
    layers: int | None = None,
) -> PiMatch:
    """Recover ``pi`` from P2's deployed block state and the public base state (step 1 of the module docstring).

    ``use_mlp=False`` leaves the MLP weights out (attention, norms and biases alone); ``layers`` uses only the
    first ``layers`` blocks (and the tensors outside the blocks), to bound the cost on deep models."""
    axes = deployed_axes(base, arch)

    def wanted(name: str, pi_axis: int | None, rho_axis: int | None) -> bool:
        found = _LAYER.search(name)
        in_range = layers is None or found is None or int(found.group(1)) < layers
        return pi_axis is not None and (use_mlp or rho_axis is None) and in_range

    names = _common(deployed, base, [n for n, (p, r) in axes.items() if wanted(n, p, r)])
    if not names:
        raise ConfigError("match_pi: no tensor with a model-dimension axis is in both the deployed and the base state")
    d = int(base[names[0]].shape[axes[names[0]][0]])
    gram = torch.zeros(d, d, dtype=torch.float64)
    na = torch.zeros(d, dtype=torch.float64)
    nb = torch.zeros(d, dtype=torch.float64)
    for n in names:
        p_ax, r_ax = axes[n]
        a = _coordinate_features(deployed[n], p_ax, r_ax)
        b = _coordinate_features(base[n], p_ax, r_ax)
        if a.shape[0] != d:
            raise ConfigError(f"tensor {n!r} has size {a.shape[0]} on its model axis but d={d}; sizes must match")
        rms = float(b.double().pow(2).mean().sqrt())
        if rms > 0:
            a, b = a / rms, b / rms
        gram += (a @ b.T).double()
        na += a.double().pow(2).sum(1)
        nb += b.double().pow(2).sum(1)
    rec, _ = hungarian((na[:, None] + nb[None, :] - 2 * gram).numpy())
    rate = None if true_pi is None else recovery_rate(rec, as_permutation(true_pi, d, "true_pi"))
    return PiMatch(rec, rate, len(names), sum(axes[n][1] is not None for n in names))


@torch.no_grad()
def match_rho(
    deployed: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    arch: str,
    pi: object,
    layer: int,
    *,
    true_rho: object | None = None,
) -> tuple[np.ndarray, float | None]:
    """Recover layer ``layer``'s ``rho`` given (an estimate of) ``pi`` (step 2): returns (estimate, rate)."""
    axes = deployed_axes(base, arch)
    names = [n for n, (_, r) in axes.items() if r is not None and (m := _LAYER.search(n)) and int(m.group(1)) == layer]
    names = _common(deployed, base, names)
    if not names:
        raise ConfigError(f"match_rho: layer {layer} has no MLP tensor in both states")
    m_size = int(base[names[0]].shape[axes[names[0]][1]])
    with_pi = next((n for n in names if axes[n][0] is not None), None)
    if with_pi is None:
        raise ConfigError(f"match_rho: layer {layer} has no MLP weight on the model dimension")
    pi_arr = as_permutation(pi, int(base[with_pi].shape[axes[with_pi][0]]), "pi")
    inv = torch.empty(pi_arr.shape[0], dtype=torch.int64)
    inv[torch.as_tensor(pi_arr)] = torch.arange(pi_arr.shape[0])
    cost = torch.zeros(m_size, m_size, dtype=torch.float64)
    for n in names:
        p_ax, r_ax = axes[n]
        a = deployed[n].detach().to(torch.float32)
        b = base[n].detach().to(torch.float32)
        if p_ax is not None:
            a = a.index_select(p_ax, inv)  # undo pi: x[:, pi][:, inv] = x
        a = a.movedim(r_ax, 0).reshape(m_size, -1)
        b = b.movedim(r_ax, 0).reshape(m_size, -1)
        rms = float(b.double().pow(2).mean().sqrt())
        if rms > 0:
            a, b = a / rms, b / rms
        cost += (a.pow(2).sum(1)[:, None] + b.pow(2).sum(1)[None, :] - 2 * a @ b.T).double()
    rec, _ = hungarian(cost.numpy())
    rate = None if true_rho is None else recovery_rate(rec, as_permutation(true_rho, m_size, "true_rho"))
    return rec, rate


@dataclass
class SigmaMatch:
    """Outcome of :func:`match_sigma`: ``decode[o]`` the guessed token of observed id ``o`` (-1: not decoded),
    ``recovery_rate`` the fraction of decoded ids decoded right (with ``true_sigma``): over the whole vocabulary, or
    an estimate of it from the ``rows`` decoded."""

    decode: np.ndarray
    recovery_rate: float | None
    n_decoded: int


def _features(tables: list[torch.Tensor], scale: list[float], inv_pi: torch.Tensor | None) -> torch.Tensor:
    out = []
    for t, s in zip(tables, scale, strict=True):
        x = t.detach().to(torch.float32) / s
        out.append(x if inv_pi is None else x.index_select(1, inv_pi))
    return torch.cat(out, dim=1)


def nearest_rows(
    queries: torch.Tensor, table: torch.Tensor, *, components: int = 24, candidates: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """For each query row ``(n, D)``, its ``candidates`` nearest rows of ``table`` ``(V, D)`` and their squared
    distances, both ``(n, candidates)``, nearest first: candidates by brute force on the top ``components``
    principal directions of ``table``, exact distances on them (float32, in chunks)."""
    v = table.shape[0]
    mean = table.mean(0)
    k = min(components, table.shape[1])
    _, _, vt = torch.linalg.svd(table[:: max(1, v // 8192)] - mean, full_matrices=False)
    proj = vt[:k].T  # (D, k)
    pb = (table - mean) @ proj  # (V, k)
    nb = pb.pow(2).sum(1)
    kc = min(candidates, v)
    cand = torch.empty(queries.shape[0], kc, dtype=torch.int64)
    dist = torch.empty(queries.shape[0], kc, dtype=torch.float64)
    for s in range(0, queries.shape[0], 1024):
        q = queries[s : s + 1024]
        approx = torch.addmm(nb[None, :], (q - mean) @ proj, pb.T, alpha=-2.0)  # (chunk, V), up to a constant
        c = approx.topk(kc, dim=1, largest=False).indices
        exact = (table[c] - q[:, None, :]).pow(2).sum(-1).double()  # (chunk, kc)
        order = exact.argsort(dim=1)
        cand[s : s + 1024] = c.gather(1, order)
        dist[s : s + 1024] = exact.gather(1, order)
    return cand.numpy(), dist.numpy()


def _one_to_one(cand: np.ndarray, dist: np.ndarray, fa: torch.Tensor, fb: torch.Tensor) -> np.ndarray:
    """Greedy one-to-one assignment of every row of ``fa`` to a row of ``fb`` in order of candidate distance; rows
    left over are matched to the rows left over by Hungarian on their exact distances (paired in order past 4000)."""
    order = np.argsort(dist, axis=None, kind="stable")
    rows, cols = np.unravel_index(order, dist.shape)
    match = np.full(fa.shape[0], -1, dtype=np.int64)
    taken = np.zeros(fb.shape[0], dtype=bool)
    for r, c in zip(rows.tolist(), cand[rows, cols].tolist(), strict=True):
        if match[r] < 0 and not taken[c]:
            match[r] = c
            taken[c] = True
    left_a, left_b = np.nonzero(match < 0)[0], np.nonzero(~taken)[0]
    if 0 < left_a.size <= 4000:
        a, b = fa[torch.as_tensor(left_a)], fb[torch.as_tensor(left_b)]
        cost = (a.pow(2).sum(1)[:, None] + b.pow(2).sum(1)[None, :] - 2 * a @ b.T).double().numpy()
        r, c = linear_sum_assignment(cost)
        match[left_a[r]] = left_b[c]
    elif left_a.size:
        match[left_a] = left_b[: left_a.size]
    return match


@torch.no_grad()
def match_sigma(
    deployed_tables: list[torch.Tensor],
    base_tables: list[torch.Tensor],
    pi: object | None,
    *,
    true_sigma: object | None = None,
    rows: object | None = None,
) -> SigmaMatch:
    """Recover ``sigma`` from P2's substituted tables (``E'``, and ``H'`` when not tied to ``E``), each ``(V, d)``,
    and the base tables in the same order, given (an estimate of) ``pi`` (None: not permuted on ``d``); step 3 of
    the module docstring. ``rows`` (observed ids) decodes only those, each to its nearest base row (no one-to-one
    constraint): an estimate of the whole-vocabulary rate that costs ``len(rows) / V`` of the full match."""
    if len(deployed_tables) != len(base_tables) or not base_tables:
        raise ConfigError(
            f"match_sigma needs one base table per deployed table, got {len(deployed_tables)} and {len(base_tables)}"
        )
    v, d = base_tables[0].shape
    inv = None
    if pi is not None:
        p = torch.as_tensor(as_permutation(pi, d, "pi"))
        inv = torch.empty_like(p)
        inv[p] = torch.arange(d)
    scale = [float(b.double().pow(2).mean().sqrt()) or 1.0 for b in base_tables]
    fb = _features(base_tables, scale, None)  # (V, D) base rows
    decode = np.full(v, -1, dtype=np.int64)
    if rows is None:
        fa = _features(deployed_tables, scale, inv)  # (V, D) observed rows, pi undone
        cand, dist = nearest_rows(fa, fb)
        decode[:] = _one_to_one(cand, dist, fa, fb)
    else:
        ids = np.unique(np.asarray(rows, dtype=np.int64))
        fa = _features([t[torch.as_tensor(ids)] for t in deployed_tables], scale, inv)
        cand, _ = nearest_rows(fa, fb)
        decode[ids] = cand[:, 0]
    rate = None
    if true_sigma is not None:
        sig = as_permutation(true_sigma, v, "true_sigma")
        truth = np.empty(v, dtype=np.int64)
        truth[sig] = np.arange(v)  # observed id -> token
        done = decode >= 0
        rate = float(np.mean(decode[done] == truth[done]))
    return SigmaMatch(decode, rate, int((decode >= 0).sum()))
