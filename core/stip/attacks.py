"""Attacks on STIP's permutation secrecy (what the cloud party P2 can learn).

STIP (Yuan et al., "Secure Transformer Inference Protocol") hides the model
dimension ``d`` of a transformer behind a secret permutation ``pi``: P2 holds
weights whose model-dimension axis is permuted and sees permuted activations.
Its security argument is that P2 guesses ``pi`` with probability ``1/d!``.
That argument ignores side information P2 realistically has:

* :func:`weight_matching_attack` -- the deployed model was fine-tuned from a
  public checkpoint, so the permuted weights are a noisy copy of public
  weights; matching per-coordinate weight profiles with the Hungarian
  algorithm recovers ``pi``.
* :func:`activation_statistics_attack` -- per-coordinate statistics of the
  hidden states (mean, scale, tails, outlier dimensions) are characteristic
  of a model and can be matched against reference activations of the public
  model on public text.
* :func:`core.stip.vocab_attack.token_frequency_attack` -- if the vocabulary
  is permuted instead, frequency analysis (plus optional bigram context) of
  the observed token stream undoes a substitution cipher.
* :func:`what_it_reveals` -- turns a recovered ``pi`` into recovered user
  tokens by nearest-neighbour decoding against the public embedding table.

Conventions. For a vector ``v`` of size ``d`` the permuted vector is
``v[pi]`` (``v'[i] = v[pi[i]]``); a tensor with a model-dimension axis is
permuted with ``index_select(axis, pi)``. A recovered ``pi_hat`` is scored by
``mean(pi_hat == pi)``. For the vocabulary design, P2 observes
``sigma[t]`` for a true token ``t``.

Only torch, numpy and :func:`scipy.optimize.linear_sum_assignment` are used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from core.errors import ConfigError

__all__ = [
    "ActivationAttackResult",
    "RevealResult",
    "WeightMatchingResult",
    "activation_statistics_attack",
    "as_permutation",
    "coordinate_statistics",
    "guess_probability",
    "hungarian",
    "model_dim_axes",
    "permute_state",
    "recovery_rate",
    "weight_matching_attack",
    "what_it_reveals",
]

AxesSpec = str | Mapping[str, int] | Callable[[str, torch.Tensor], "int | None"]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def guess_probability(d: int) -> float:
    """``log10`` of the paper's success probability ``1/d!`` of guessing ``pi``."""
    if int(d) != d or d < 1:
        raise ConfigError(f"guess_probability needs an integer d >= 1, got d={d!r}")
    return -math.lgamma(int(d) + 1) / math.log(10.0)


def as_permutation(perm: object, d: int, what: str, allow_unknown: bool = False) -> np.ndarray:
    """``perm`` (tensor or array) as an int64 permutation of ``range(d)`` (``-1``: unknown, with
    ``allow_unknown``); ConfigError naming ``what`` otherwise."""
    arr = perm.detach().cpu().numpy() if isinstance(perm, torch.Tensor) else np.asarray(perm)
    arr = arr.astype(np.int64).reshape(-1)
    if arr.shape[0] != d:
        raise ConfigError(f"{what} has size {arr.shape[0]} but the model dimension is d={d}; sizes must match")
    known = arr[arr >= 0] if allow_unknown else arr
    if (not allow_unknown and arr.min(initial=0) < 0) or known.max(initial=-1) >= d:
        raise ConfigError(f"{what} must hold indices in [0, {d}), got min={arr.min()} max={arr.max()}")
    if np.unique(known).shape[0] != known.shape[0]:
        raise ConfigError(f"{what} repeats an index; it must be a (partial) permutation of range({d})")
    return arr


def recovery_rate(recovered: object, truth: object) -> float:
    """Fraction of coordinates ``i`` with ``recovered[i] == truth[i]``."""
    t = np.asarray(truth.cpu() if isinstance(truth, torch.Tensor) else truth).reshape(-1)
    r = np.asarray(recovered.cpu() if isinstance(recovered, torch.Tensor) else recovered).reshape(-1)
    if r.shape != t.shape:
        raise ConfigError(f"recovered has size {r.shape[0]} but truth has size {t.shape[0]}; sizes must match")
    return float(np.mean(r == t)) if t.size else 0.0


def hungarian(cost: np.ndarray) -> tuple[np.ndarray, float]:
    """Row i -> column assignment minimising total cost; returns (cols, mean cost)."""
    cost = np.nan_to_num(np.asarray(cost, dtype=np.float64), nan=1e30, posinf=1e30, neginf=-1e30)
    rows, cols = linear_sum_assignment(cost)
    out = np.empty(cost.shape[0], dtype=np.int64)
    out[rows] = cols
    return out, float(cost[rows, cols].mean())


def _margin(cost: np.ndarray, assignment: np.ndarray) -> float:
    """Mean relative gap between the assigned cost and the best other column (confidence)."""
    d = cost.shape[0]
    if d < 2:
        return 0.0
    chosen = cost[np.arange(d), assignment]
    masked = cost.copy()
    masked[np.arange(d), assignment] = np.inf
    second = masked.min(axis=1)
    scale = np.abs(cost).mean() + 1e-30
    return float(np.mean((second - chosen) / scale))


# ---------------------------------------------------------------------------
# (a) weight matching against the public base checkpoint
# ---------------------------------------------------------------------------

_GPT2_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|\.)wte\.weight$", 1),
    (r"(^|\.)wpe\.weight$", 1),
    (r"(^|\.)lm_head\.weight$", 1),
    (r"(^|\.)ln_(1|2|f|cross_attn)\.(weight|bias)$", 0),
    (r"(^|\.)attn\.c_attn\.weight$", 0),  # Conv1D weight is (in=d, out=3d)
    (r"(^|\.)crossattention\.q_attn\.weight$", 0),
    (r"(^|\.)(attn|crossattention)\.c_proj\.weight$", 1),  # (d, d): output axis is the residual stream
    (r"(^|\.)(attn|crossattention)\.c_proj\.bias$", 0),
    (r"(^|\.)mlp\.c_fc\.weight$", 0),
    (r"(^|\.)mlp\.c_proj\.weight$", 1),
    (r"(^|\.)mlp\.c_proj\.bias$", 0),
)

_LLAMA_RULES: tuple[tuple[str, int], ...] = (
    (r"(^|\.)embed_tokens\.weight$", 1),
    (r"(^|\.)lm_head\.weight$", 1),
    (r"(^|\.)(input_layernorm|post_attention_layernorm|norm)\.(weight|bias)$", 0),
    (r"(^|\.)self_attn\.(q_proj|k_proj|v_proj)\.weight$", 1),  # nn.Linear weight is (out, in=d)
    (r"(^|\.)self_attn\.o_proj\.weight$", 0),
    (r"(^|\.)self_attn\.o_proj\.bias$", 0),
    (r"(^|\.)mlp\.(gate_proj|up_proj)\.weight$", 1),
    (r"(^|\.)mlp\.down_proj\.weight$", 0),
    (r"(^|\.)mlp\.down_proj\.bias$", 0),
)

_ARCH_RULES = {"gpt2": _GPT2_RULES, "llama": _LLAMA_RULES}


def model_dim_axes(state_dict: Mapping[str, torch.Tensor], arch: str) -> dict[str, int]:
    """``{name: axis}`` of every tensor in ``state_dict`` that has a model-dimension axis.

    ``arch`` is ``"gpt2"`` (HF ``GPT2*``: Conv1D weights are ``(in, out)``) or
    ``"llama"`` (HF ``Llama*``/Mistral-style: ``nn.Linear`` weights are
    ``(out, in)``). Buffers such as ``attn.bias`` masks and q/k/v biases
    (size ``3d`` or head space) are left out.
    """
    key = arch.lower().replace("-", "").replace("_", "")
    if key not in _ARCH_RULES:
        raise ConfigError(f"model_dim_axes: unknown arch={arch!r}; use one of {sorted(_ARCH_RULES)}")
    rules = [(re.compile(p), ax) for p, ax in _ARCH_RULES[key]]
    out: dict[str, int] = {}
    for name, tensor in state_dict.items():
        for pat, ax in rules:
            if pat.search(name) and tensor.dim() > ax:
                out[name] = ax
                break
    return out


def _resolve_axes(axes: AxesSpec, state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    if isinstance(axes, str):
        return model_dim_axes(state, axes)
    if isinstance(axes, Mapping):
        return {k: int(v) for k, v in axes.items() if k in state}
    if callable(axes):
        out = {}
        for name, t in state.items():
            ax = axes(name, t)
            if ax is not None:
                out[name] = int(ax)
        return out
    raise ConfigError(f"axes must be an arch name, a {{name: axis}} mapping or a callable, got {type(axes)}")


def permute_state(state: Mapping[str, torch.Tensor], perm: object, axes: AxesSpec) -> dict[str, torch.Tensor]:
    """Apply STIP's transform to a plain state dict: every model-dim axis indexed by ``perm``."""
    ax = _resolve_axes(axes, state)
    if not ax:
        raise ConfigError("permute_state: no tensor has a model-dimension axis under the given axes")
    d = state[next(iter(ax))].shape[next(iter(ax.values()))]
    p = torch.as_tensor(as_permutation(perm, d, "perm"))
    out = {}
    for name, t in state.items():
        out[name] = t.index_select(ax[name], p) if name in ax else t
    return out


@dataclass
class WeightMatchingResult:
    """Outcome of :func:`weight_matching_attack`."""

    recovered: np.ndarray  # estimated pi: permuted coordinate i came from base coordinate recovered[i]
    recovery_rate: float | None  # fraction right, when the true pi was given
    d: int
    n_tensors: int  # tensors used as per-coordinate features
    feature_length: int  # length of each coordinate's concatenated feature vector
    mean_cost: float  # mean assigned cost
    margin: float  # mean (second-best - assigned) cost gap, relative to the mean cost; > 0 = confident
    tensors: list[str] = field(default_factory=list)


def weight_matching_attack(
    transformed_state: Mapping[str, torch.Tensor],
    base_state: Mapping[str, torch.Tensor],
    axes: AxesSpec = "gpt2",
    *,
    true_perm: object | None = None,
    metric: str = "l2",
    balance: bool = True,
    max_dtype: torch.dtype = torch.float32,
) -> WeightMatchingResult:
    """Recover ``pi`` from permuted fine-tuned weights and the public base weights.

    Every tensor with a model-dimension axis (given by ``axes``: an arch name
    for :func:`model_dim_axes`, a ``{name: axis}`` mapping, or a callable
    ``(name, tensor) -> axis | None``) contributes, for each coordinate, the
    slice of that tensor at that coordinate (a scalar for norm weights and
    biases, a row/column for matrices). The d x d cost between permuted and
    base coordinates is the distance between the concatenated slices
    (``metric="l2"``: squared L2; ``"cosine"``: negative cosine similarity;
    ``"corr"``: negative Pearson correlation), accumulated tensor by tensor
    so the concatenation is never materialised, and is solved with the
    Hungarian algorithm. With ``balance`` every tensor is divided by the RMS
    of its base copy so that large matrices do not drown the norm vectors.
    Only tensors present in both states with equal shapes are used;
    tensors whose model axis is not of size d are rejected.
    """
    if metric not in ("l2", "cosine", "corr"):
        raise ConfigError(f"metric must be 'l2', 'cosine' or 'corr', got metric={metric!r}")
    ax = _resolve_axes(axes, base_state)
    names = [n for n in ax if n in transformed_state]
    if not names:
        raise ConfigError(
            "weight_matching_attack: no tensor with a model-dimension axis is present in both states "
            f"(base has {len(base_state)} tensors, transformed has {len(transformed_state)})"
        )
    d = None
    for n in names:
        a, b = transformed_state[n], base_state[n]
        if tuple(a.shape) != tuple(b.shape):
            raise ConfigError(
                f"tensor {n!r} has shape {tuple(a.shape)} in transformed_state but {tuple(b.shape)} in "
                "base_state; sizes must match"
            )
        size = a.shape[ax[n]]
        if d is None:
            d = int(size)
        elif size != d:
            raise ConfigError(
                f"tensor {n!r} has size {size} on its model axis {ax[n]} but other tensors have d={d}; "
                "sizes must match (check the axes mapping)"
            )
    assert d is not None
    gram = torch.zeros(d, d, dtype=torch.float64)
    na = torch.zeros(d, dtype=torch.float64)
    nb = torch.zeros(d, dtype=torch.float64)
    sa = torch.zeros(d, dtype=torch.float64)
    sb = torch.zeros(d, dtype=torch.float64)
    length = 0
    with torch.no_grad():
        for n in names:
            a = transformed_state[n].detach().to(max_dtype).movedim(ax[n], 0).reshape(d, -1)
            b = base_state[n].detach().to(max_dtype).movedim(ax[n], 0).reshape(d, -1)
            if balance:
                rms = b.double().pow(2).mean().sqrt().item()
                if rms > 0:
                    a, b = a / rms, b / rms
            gram += (a @ b.T).double()
            na += a.double().pow(2).sum(1)
            nb += b.double().pow(2).sum(1)
            sa += a.double().sum(1)
            sb += b.double().sum(1)
            length += a.shape[1]
    if metric == "l2":
        cost = na[:, None] + nb[None, :] - 2 * gram
    elif metric == "cosine":
        cost = -gram / (na.sqrt()[:, None] * nb.sqrt()[None, :] + 1e-30)
    else:
        cov = gram - sa[:, None] * sb[None, :] / length
        va = (na - sa**2 / length).clamp_min(0)
        vb = (nb - sb**2 / length).clamp_min(0)
        cost = -cov / (va.sqrt()[:, None] * vb.sqrt()[None, :] + 1e-30)
    cost_np = cost.numpy()
    rec, mean_cost = hungarian(cost_np)
    rate = None if true_perm is None else recovery_rate(rec, as_permutation(true_perm, d, "true_perm"))
    return WeightMatchingResult(
        recovered=rec,
        recovery_rate=rate,
        d=d,
        n_tensors=len(names),
        feature_length=length,
        mean_cost=mean_cost,
        margin=_margin(cost_np, rec),
        tensors=names,
    )


# ---------------------------------------------------------------------------
# (b) activation statistics
# ---------------------------------------------------------------------------

DEFAULT_FEATURES: tuple[str, ...] = (
    "mean",
    "std",
    "skew",
    "kurtosis",
    "absmax",
    "outlier_frac",
    "quantiles",
)
_QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def _flatten_acts(x: object, what: str, min_rows: int = 2) -> torch.Tensor:
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dim() < 2:
        raise ConfigError(f"{what} must be (n, d) or (..., d), got shape {tuple(t.shape)}")
    t = t.reshape(-1, t.shape[-1]).to(torch.float64)
    if t.shape[0] < min_rows:
        raise ConfigError(f"{what} needs at least {min_rows} rows (queries/tokens), got {t.shape[0]}")
    return t


def coordinate_statistics(
    acts: object,
    features: Sequence[str] = DEFAULT_FEATURES,
    outlier_sigma: float = 6.0,
) -> np.ndarray:
    """Per-coordinate feature matrix ``(d, k)`` of activations ``(n, d)``.

    Every feature is invariant to a permutation of coordinates except for
    moving with its coordinate: ``mean``, ``std``, ``skew``, ``kurtosis``
    (excess), ``absmax`` (log max |x|), ``outlier_frac`` (fraction of entries
    with |x - global median| > ``outlier_sigma`` x the global std, global
    over all coordinates so the threshold is permutation invariant) and
    ``quantiles`` (7 marginal quantiles).
    """
    x = _flatten_acts(acts, "acts")
    mean = x.mean(0)
    centred = x - mean
    var = centred.pow(2).mean(0)
    std = var.sqrt()
    safe = std.clamp_min(1e-12)
    cols: list[torch.Tensor] = []
    for f in features:
        if f == "mean":
            cols.append(mean)
        elif f == "std":
            cols.append(std.clamp_min(1e-12).log())
        elif f == "skew":
            cols.append((centred.pow(3).mean(0) / safe**3).clamp(-50, 50))
        elif f == "kurtosis":
            k = centred.pow(4).mean(0) / safe**4 - 3.0
            cols.append(torch.sign(k) * torch.log1p(k.abs()))
        elif f == "absmax":
            cols.append(x.abs().max(0).values.clamp_min(1e-12).log())
        elif f == "outlier_frac":
            g_med = x.median()
            g_std = x.std().clamp_min(1e-12)
            cols.append(((x - g_med).abs() > outlier_sigma * g_std).double().mean(0))
        elif f == "quantiles":
            q = torch.quantile(x.float(), torch.tensor(_QUANTILES), dim=0).double().T
            cols.extend(q.unbind(1))
        else:
            raise ConfigError(f"unknown activation feature {f!r}; use some of {list(DEFAULT_FEATURES)}")
    return torch.stack(cols, dim=1).numpy()


@dataclass
class ActivationAttackResult:
    """Outcome of :func:`activation_statistics_attack`."""

    recovered: np.ndarray  # estimated pi
    recovery_rate: float | None
    d: int
    n_queries: int  # rows of permuted activations used
    features: list[str]
    margin: float
    recovery_by_queries: dict[int, float] = field(default_factory=dict)  # n rows -> recovery rate


def _match_stats(fp: np.ndarray, fr: np.ndarray) -> tuple[np.ndarray, float]:
    # standardise each feature by its spread over the reference coordinates
    mu = fr.mean(0)
    sd = fr.std(0)
    sd = np.where(sd > 1e-12, sd, 1.0)
    a = (fp - mu) / sd
    b = (fr - mu) / sd
    cost = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    rec, _ = hungarian(cost)
    return rec, _margin(cost, rec)


def activation_statistics_attack(
    permuted_acts: object,
    reference_acts: object,
    *,
    true_perm: object | None = None,
    features: Sequence[str] = DEFAULT_FEATURES,
    outlier_sigma: float = 6.0,
    query_counts: Iterable[int] | None = None,
) -> ActivationAttackResult:
    """Recover ``pi`` from permuted activations ``(n, d)`` and reference activations ``(m, d)``.

    ``permuted_acts`` are hidden states P2 sees (``X[:, pi]``), any leading
    shape flattened into rows; ``reference_acts`` are hidden states of the
    public base model at the same layer on public text. Each coordinate gets
    a vector of statistics (see :func:`coordinate_statistics`), features
    are standardised across coordinates, and coordinates are matched by
    squared distance with the Hungarian algorithm. ``query_counts`` (with
    ``true_perm``) also runs the attack on the first n rows for each n and
    reports ``recovery_by_queries``.
    """
    xp = _flatten_acts(permuted_acts, "permuted_acts")
    xr = _flatten_acts(reference_acts, "reference_acts")
    if xp.shape[1] != xr.shape[1]:
        raise ConfigError(
            f"permuted_acts has d={xp.shape[1]} coordinates but reference_acts has d={xr.shape[1]}; "
            "sizes must match (same layer of the same architecture)"
        )
    d = xp.shape[1]
    truth = None if true_perm is None else as_permutation(true_perm, d, "true_perm")
    fr = coordinate_statistics(xr, features, outlier_sigma)
    fp = coordinate_statistics(xp, features, outlier_sigma)
    rec, margin = _match_stats(fp, fr)
    curve: dict[int, float] = {}
    if query_counts is not None:
        if truth is None:
            raise ConfigError("query_counts needs true_perm to score the recovery at each count")
        for n in sorted({int(c) for c in query_counts}):
            if n < 2 or n > xp.shape[0]:
                raise ConfigError(f"query count {n} out of range [2, {xp.shape[0]}] (rows of permuted_acts)")
            r_n, _ = _match_stats(coordinate_statistics(xp[:n], features, outlier_sigma), fr)
            curve[n] = recovery_rate(r_n, truth)
    return ActivationAttackResult(
        recovered=rec,
        recovery_rate=None if truth is None else recovery_rate(rec, truth),
        d=d,
        n_queries=int(xp.shape[0]),
        features=list(features),
        margin=margin,
        recovery_by_queries=curve,
    )


# ---------------------------------------------------------------------------
# what a recovered permutation reveals of the user's input
# ---------------------------------------------------------------------------


@dataclass
class RevealResult:
    """Outcome of :func:`what_it_reveals`."""

    decoded: np.ndarray  # nearest-neighbour token id per input position
    token_recovery_rate: float | None  # fraction of input tokens decoded right (when truth given)
    n_tokens: int
    n_coordinates_used: int  # coordinates of pi that were known (>= 0) and used for decoding


def what_it_reveals(
    recovered_perm: object,
    permuted_embeddings: object,
    embedding_table: object,
    true_tokens: object | None = None,
    *,
    offset: object | None = None,
) -> RevealResult:
    """Decode the user's tokens from permuted input embeddings with a recovered ``pi``.

    ``permuted_embeddings`` ``(n, d)`` are what P2 receives (``x[:, pi]``);
    ``recovered_perm`` is the attacker's estimate of ``pi``, with ``-1`` for
    coordinates it could not place (partial recovery: only the placed
    coordinates are used). The embeddings are un-permuted
    (``x_hat[:, pi_hat[i]] = x'[:, i]``), ``offset`` ``(n, d)`` or ``(d,)`` in
    original coordinates (e.g. public position embeddings) is subtracted,
    and each row is decoded to the nearest row (L2) of the public
    ``embedding_table`` ``(V, d)`` restricted to the placed coordinates.
    """
    x = _flatten_acts(permuted_embeddings, "permuted_embeddings", min_rows=1)
    table = (
        embedding_table.detach()
        if isinstance(embedding_table, torch.Tensor)
        else torch.as_tensor(np.asarray(embedding_table))
    )
    table = table.to(torch.float64)
    if table.dim() != 2:
        raise ConfigError(f"embedding_table must be (V, d), got shape {tuple(table.shape)}")
    d = x.shape[1]
    if table.shape[1] != d:
        raise ConfigError(
            f"permuted_embeddings has d={d} coordinates but embedding_table has d={table.shape[1]}; sizes must match"
        )
    perm = as_permutation(recovered_perm, d, "recovered_perm", allow_unknown=True)
    known = np.nonzero(perm >= 0)[0]
    if known.size == 0:
        raise ConfigError("recovered_perm places no coordinate (all -1); nothing to decode with")
    # x_hat restricted to placed original coordinates perm[known]
    orig_cols = torch.as_tensor(perm[known])
    xh = x[:, torch.as_tensor(known)]
    if offset is not None:
        off = offset.detach() if isinstance(offset, torch.Tensor) else torch.as_tensor(np.asarray(offset))
        off = off.to(torch.float64)
        if off.shape[-1] != d:
            raise ConfigError(f"offset has last size {off.shape[-1]} but d={d}; sizes must match")
        off = off.reshape(-1, d)
        if off.shape[0] not in (1, x.shape[0]):
            raise ConfigError(f"offset has {off.shape[0]} rows but permuted_embeddings has {x.shape[0]}")
        xh = xh - off[:, orig_cols]
    tab = table[:, orig_cols]
    dist = (xh * xh).sum(1, keepdim=True) + (tab * tab).sum(1)[None, :] - 2 * xh @ tab.T
    decoded = dist.argmin(1).numpy()
    rate = None
    if true_tokens is not None:
        tt = np.asarray(true_tokens.cpu() if isinstance(true_tokens, torch.Tensor) else true_tokens).reshape(-1)
        if tt.shape[0] != decoded.shape[0]:
            raise ConfigError(
                f"true_tokens has {tt.shape[0]} tokens but permuted_embeddings has {decoded.shape[0]} rows; "
                "sizes must match"
            )
        rate = float(np.mean(decoded == tt))
    return RevealResult(
        decoded=decoded,
        token_recovery_rate=rate,
        n_tokens=int(decoded.shape[0]),
        n_coordinates_used=int(known.size),
    )
