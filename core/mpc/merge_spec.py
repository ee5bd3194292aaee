"""The exported parameters of a MERGE model and their plaintext reference forward (MERGE, Liang et al. 2024).

This module is the contract between MERGE training (:mod:`core.mpc.merge`) and the encrypted executor:
the executor runs exactly :func:`merged_forward` / :func:`merge_generate_plain` on secret shares. Only
torch matmul, add, elementwise ops, one real LayerNorm per block (eq. 11 keeps ``f_ln``) and the MLP
activation remain; no softmax, no embedding-table query during generation.

Notation (row-vector convention, as HF GPT-2's ``Conv1D``: ``y = x @ W + b``)::

    B  batch, N  current sequence length (N <= N_max), d  hidden size, H  heads, D = d / H  head dim,
    d_I  MLP width, V  vocabulary size, N_max  length of the constant attention matrices.

One merged block (eq. 10-11 made exact for GPT-2, whose blocks are pre-LN, multi-head and have two residuals)::

    g   = LN(h; ln_gamma, ln_beta, ln_eps)                      # (B, N, d)  the kept real f_ln of eq. 11
    v   = g @ W_V                                               # (B, N, d)  values, split (B, H, N, D)
    o_k = C[k, :N, :N] @ v_k                                    # (B, N, D)  head k's constant attention
    x   = h + concat_k(o_k) @ W_d + b_a                         # (B, N, d)  attention + residual
    u   = x @ M_u + b_u                                         # (B, N, d_I) eq. 10's M_u (d x d_I), b_Mu
    out = x + act(u) @ W_O + b_O                                # (B, N, d)

Why this order: eq. 10 writes ``M_u = (W_V W_d + 1) * gamma . W_I`` with one attention matrix C applied to the
whole input. With H heads each head k mixes positions with its own ``C_k`` between ``W_V`` and ``W_d``, so
``W_V W_d`` cannot be multiplied out without one d x d copy per head (H d^2), and GPT-2's residual adds the
un-attended ``h``. Applying ``C_k`` to head k's slice of ``g W_V`` (Theorem 1 of App. B: the position mixing
and the feature map commute) keeps every weight at its original size. What eq. 10 folds is folded: ``f'_ln``
(eq. 9) into the MLP's first layer, ``M_u = diag(gamma_2) W_I`` (d x d_I, eq. 10's shape), ``b_u = beta_2 W_I +
b_I``; the value bias into ``b_a = b_V W_d + b_d`` (exact because every row of ``C_k`` sums to 1). ``W_d`` is not
folded into ``M_u``: the residual needs ``x`` itself, so the fold would add a d x d_I matrix instead of saving
one. Weights per block: ``2 d^2 + 2 d d_I + 4 d + d_I`` (10 d^2 + 8 d at d_I = 4d) against GPT-2's
``4 d^2 + 2 d d_I + 9 d + d_I`` (12 d^2 + 13 d), plus ``C`` (H, N_max, N_max).

Incremental evaluation (App. C.1: MERGE is linear in the generated length). Because ``C`` is constant, the
attention can be pushed forward instead of pulled: a per-layer running sum ``S`` (B, H, N_max, D) holds, for
every position i, ``S[:, k, i] = sum_{j seen} C[k, i, j] v_k[j]``. New positions ``s..s+n-1`` add
``C[:, :, s:s+n] @ v_new`` to ``S`` and read their outputs ``o = S[:, :, s:s+n]`` (complete: ``C`` is causal, so
every j <= i was seen). One generation step thus processes one position and touches one column of ``C``
(H x N_max) whatever the prefix length (:func:`merged_block_step`, :class:`MergeState`);
``recompute=True`` runs the whole sequence every step (:func:`merged_forward`), the reference.

The model (embedding resending, eq. 3)::

    h^0 = E + wpe[:N]                                           # E: (B, N, d) token embeddings
    h^n = block_n(h^{n-1})                                      # n = 1..n_layers
    H_out = LN(h^L; lnf_gamma, lnf_beta, lnf_eps)               # (B, N, d) output hidden states
    logits = H_out @ lm_head.T                                  # (B, N, V) only to read tokens (f_cls)

Generation never looks tokens up: the next input embedding is the last output hidden state,
``E_{t+1} = [E_t; H_out[:, -1]]`` (eq. 3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from core.errors import ConfigError

Activation = Literal["gelu_new", "gelu", "relu", "quad"]
ACTIVATIONS: tuple[str, ...] = ("gelu_new", "gelu", "relu", "quad")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP nonlinearity ``act`` of eq. 11.

    ``gelu_new``: GPT-2's tanh GELU ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``; ``gelu``: exact erf
    GELU; ``relu``; ``quad``: MPCFormer's ``0.125 x^2 + 0.25 x + 0.5``.
    """
    if name == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return torch.relu(x)
    if name == "quad":
        return 0.125 * x * x + 0.25 * x + 0.5
    raise ConfigError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")


def layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    """Eq. 2 over the last dimension: ``(x - E[x]) / sqrt(Var[x] + eps) * gamma + beta`` (biased variance)."""
    mu = x.mean(dim=-1, keepdim=True)
    var = (x - mu).pow(2).mean(dim=-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * gamma + beta


WEIGHT_KEYS: tuple[str, ...] = ("ln_gamma", "ln_beta", "W_V", "W_d", "b_a", "M_u", "b_u", "W_O", "b_O")
"""The tensors of a :class:`MergedLayerSpec` besides the constant attention ``C``."""


@dataclass(frozen=True, kw_only=True)
class MergedLayerSpec:
    """One merged Transformer block (eq. 10-11). All tensors share one dtype.

    Attributes:
        C: (H, N_max, N_max) constant attention of eq. 8, one matrix per head: lower-triangular (causal,
            ``C[k, i, j] = 0`` for ``j > i``) and row-stochastic (each row sums to 1, hence every top-left
            ``C[k, :N, :N]`` is too). Initialised as the training-set average attention map, then trained.
        ln_gamma, ln_beta: (d,) the real LayerNorm at the block input (GPT-2's ``ln_1``, eq. 11's f_ln).
        ln_eps: its epsilon.
        W_V: (d, d) value projection (GPT-2's ``c_attn`` value columns); head k owns columns ``k*D:(k+1)*D``.
        W_d: (d, d) attention output projection (GPT-2's ``attn.c_proj``).
        b_a: (d,) merged attention bias ``b_V W_d + b_d``.
        M_u: (d, d_I) eq. 10's merged matrix ``diag(gamma_2) W_I`` (``f'_ln`` folded into the MLP's first layer).
        b_u: (d_I,) eq. 10's merged bias ``beta_2 W_I + b_I``.
        W_O: (d_I, d) second MLP matrix of eq. 11.
        b_O: (d,) its bias.
        act: the MLP nonlinearity (see :func:`activation`).
    """

    C: torch.Tensor
    ln_gamma: torch.Tensor
    ln_beta: torch.Tensor
    ln_eps: float
    W_V: torch.Tensor
    W_d: torch.Tensor
    b_a: torch.Tensor
    M_u: torch.Tensor
    b_u: torch.Tensor
    W_O: torch.Tensor
    b_O: torch.Tensor
    act: Activation = "gelu_new"

    def __post_init__(self) -> None:
        if self.C.dim() != 3 or self.C.shape[1] != self.C.shape[2]:
            raise ConfigError(f"C must have shape (H, N_max, N_max), got {tuple(self.C.shape)}")
        heads, d, d_i = self.C.shape[0], self.ln_gamma.shape[0], self.W_O.shape[0]
        if d % heads:
            raise ConfigError(f"hidden size d={d} must be divisible by the number of heads H={heads}")
        expected = {
            "ln_beta": (d,),
            "W_V": (d, d),
            "W_d": (d, d),
            "b_a": (d,),
            "M_u": (d, d_i),
            "b_u": (d_i,),
            "W_O": (d_i, d),
            "b_O": (d,),
        }
        for name, shape in expected.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ConfigError(
                    f"MergedLayerSpec.{name} must have shape {shape} (H={heads}, d={d}, d_I={d_i}), got {got}"
                )
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"unknown activation {self.act!r}; known: {', '.join(ACTIVATIONS)}")

    @property
    def n_heads(self) -> int:
        return int(self.C.shape[0])

    @property
    def n_max(self) -> int:
        return int(self.C.shape[1])

    @property
    def n_weights(self) -> int:
        """Weights the block multiplies per position (all but ``C``): 10 d^2 + 8 d at d_I = 4 d."""
        return sum(int(getattr(self, k).numel()) for k in WEIGHT_KEYS)


@dataclass(frozen=True, kw_only=True)
class MergeSpec:
    """A whole exported MERGE model (embedding resending + merge modules).

    Attributes:
        layers: the merged blocks, input to output.
        wpe: (N_pos, d) learned positional embeddings added to the input embeddings (``E'`` of Sec. 3.1).
        lnf_gamma, lnf_beta: (d,) final LayerNorm (GPT-2's ``ln_f``); its output is the resent hidden state.
        lnf_eps: its epsilon.
        lm_head: (V, d) token classifier ``f_cls`` (tied to GPT-2's token embeddings): ``logits = H @ lm_head.T``;
            also the embedding table for the prefix (``E_0 = lm_head[prefix_ids]``).
    """

    layers: tuple[MergedLayerSpec, ...]
    wpe: torch.Tensor
    lnf_gamma: torch.Tensor
    lnf_beta: torch.Tensor
    lnf_eps: float
    lm_head: torch.Tensor

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("MergeSpec.layers must hold at least one merged block, got 0")
        d = self.lm_head.shape[1]
        if self.wpe.shape[1] != d or self.lnf_gamma.shape != (d,) or self.layers[0].ln_gamma.shape != (d,):
            raise ConfigError(
                f"MergeSpec hidden sizes disagree: lm_head d={d}, wpe {tuple(self.wpe.shape)}, "
                f"lnf_gamma {tuple(self.lnf_gamma.shape)}"
            )

    @property
    def n_max(self) -> int:
        """Longest sequence the spec can run: min of the constant attention size and the positions."""
        return min(min(layer.n_max for layer in self.layers), int(self.wpe.shape[0]))

    @property
    def d_model(self) -> int:
        return int(self.lm_head.shape[1])


def check_length(n: int, n_max: int) -> None:
    """Raise :class:`ConfigError` naming both numbers when a sequence is longer than the constant attention."""
    if n > n_max:
        raise ConfigError(
            f"sequence length {n} exceeds the constant attention size N_max={n_max}; "
            f"export the model with a larger max length or shorten the input"
        )
    if n < 1:
        raise ConfigError(f"sequence length must be >= 1, got {n}")


def _values(layer: MergedLayerSpec, h: torch.Tensor) -> torch.Tensor:
    """``LN(h) @ W_V`` split into heads: (B, n, d) -> (B, H, n, D)."""
    B, n, d = h.shape
    g = layer_norm(h, layer.ln_gamma, layer.ln_beta, layer.ln_eps)  # (B, n, d)
    return (g @ layer.W_V).view(B, n, layer.n_heads, d // layer.n_heads).transpose(1, 2)  # (B, H, n, D)


def _after_attention(layer: MergedLayerSpec, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of the block from the attended values o (B, H, n, D) and its input h (B, n, d)."""
    B, n, d = h.shape
    x = h + o.transpose(1, 2).reshape(B, n, d) @ layer.W_d + layer.b_a  # (B, n, d)  attention + residual
    u = x @ layer.M_u + layer.b_u  # (B, n, d_I)  eq. 10
    return x + activation(layer.act, u) @ layer.W_O + layer.b_O


def merged_block(layer: MergedLayerSpec, h: torch.Tensor) -> torch.Tensor:
    """Eq. 11 for one block on the whole sequence: (B, N, d) -> (B, N, d) (module docstring)."""
    n = h.shape[-2]
    check_length(n, layer.n_max)
    o = layer.C[:, :n, :n] @ _values(layer, h)  # (B, H, N, D)  head k mixed by C_k
    return _after_attention(layer, h, o)


def merged_block_step(
    layer: MergedLayerSpec, h: torch.Tensor, sums: torch.Tensor | None, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on the new positions ``start..start+n-1`` only, given the earlier positions' running sums.

    Args:
        h: (B, n, d) the block's input at the new positions.
        sums: (B, H, N_max, D) running sums ``S[:, k, i] = sum_{j < start} C[k, i, j] v_k[j]``; None at start 0.
        start: the first new position.

    Returns:
        (out (B, n, d), sums advanced by the new positions). Equals ``merged_block`` on the whole sequence at
        those positions.
    """
    n = h.shape[-2]
    check_length(start + n, layer.n_max)
    new = layer.C[:, :, start : start + n] @ _values(layer, h)  # (B, H, N_max, D)  pushed to every later row
    sums = new if sums is None else sums + new
    return _after_attention(layer, h, sums[:, :, start : start + n]), sums


@dataclass
class MergeState:
    """What incremental generation keeps between steps: each layer's running sums (B, H, N_max, D) of the
    constant attention (empty before the first step) and the number of positions processed."""

    sums: list = field(default_factory=list)
    length: int = 0


def merged_forward(spec: MergeSpec, E: torch.Tensor) -> torch.Tensor:
    """Output hidden states of the merged model for input token embeddings E.

    Args:
        spec: the exported model.
        E: (B, N, d) or (N, d) input embeddings *without* positions: prefix token embeddings followed by
            resent hidden states (eq. 3). N <= ``spec.n_max`` (else :class:`ConfigError`).

    Returns:
        (B, N, d) (or (N, d)) hidden states after the final LayerNorm; row i depends on rows <= i only.
    """
    squeeze = E.dim() == 2
    h = E.unsqueeze(0) if squeeze else E
    check_length(h.shape[-2], spec.n_max)
    h = h + spec.wpe[: h.shape[-2]]
    for layer in spec.layers:
        h = merged_block(layer, h)
    out = layer_norm(h, spec.lnf_gamma, spec.lnf_beta, spec.lnf_eps)
    return out.squeeze(0) if squeeze else out


def merged_forward_step(spec: MergeSpec, E: torch.Tensor, state: MergeState) -> torch.Tensor:
    """Output hidden states (B, n, d) of n new input embeddings E (B, n, d) at positions ``state.length`` on;
    advances ``state``. Equals the last n rows of :func:`merged_forward` on the whole sequence."""
    start, n = state.length, E.shape[-2]
    check_length(start + n, spec.n_max)
    h = E + spec.wpe[start : start + n]
    sums = state.sums or [None] * len(spec.layers)
    for i, layer in enumerate(spec.layers):
        h, sums[i] = merged_block_step(layer, h, sums[i], start)
    state.sums, state.length = sums, start + n
    return layer_norm(h, spec.lnf_gamma, spec.lnf_beta, spec.lnf_eps)


def merged_logits(spec: MergeSpec, hidden: torch.Tensor) -> torch.Tensor:
    """Token scores ``f_cls(h) = h @ lm_head.T``: (..., d) -> (..., V)."""
    return hidden @ spec.lm_head.T


def merge_generate_plain(
    spec: MergeSpec, prefix_embeds: torch.Tensor, n_new: int, *, recompute: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation by embedding resending (eq. 3), no embedding-table query.

    Args:
        spec: the exported model.
        prefix_embeds: (B, N_p, d) token embeddings of the prefix ``E_0`` (e.g. ``spec.lm_head[prefix_ids]``).
        n_new: number of new tokens, >= 1; needs ``N_p + n_new - 1 <= spec.n_max``.
        recompute: run the whole sequence every step (the reference) instead of the one new position.

    Returns:
        (tokens, hidden): tokens (B, n_new) the greedy tokens ``argmax(hidden @ lm_head.T)`` (decoding is separate
        from resending: tokens never feed back), hidden (B, n_new, d) the resent hidden states ``H_out[:, -1]``
        of each step. Same order as :func:`core.mpc.merge.merge_generate`.
    """
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    check_length(prefix_embeds.shape[-2] + n_new - 1, spec.n_max)
    E, state, outs = prefix_embeds, MergeState(), []
    for step in range(n_new):
        if recompute:
            last = merged_forward(spec, E)[:, -1]  # (B, d)
        else:
            last = merged_forward_step(spec, E, state)[:, -1]
        outs.append(last)
        if step + 1 < n_new:  # eq. 3: E_{t+1} = [E_t; h_t[N_t]]
            E = torch.cat([E, last.unsqueeze(1)], dim=1) if recompute else last.unsqueeze(1)
    hidden = torch.stack(outs, dim=1)  # (B, n_new, d)
    return merged_logits(spec, hidden).argmax(dim=-1), hidden


def mm_generate_plain(
    spec: MergeSpec, prefix_ids: torch.Tensor, n_new: int, *, recompute: bool = False
) -> torch.Tensor:
    """Greedy generation with the merge module only (MM, no ER): every step decodes a token with the LM head and
    feeds its embedding ``lm_head[token]`` back, like vanilla generation. ``prefix_ids`` (B, N_p) -> (B, n_new);
    ``recompute`` as :func:`merge_generate_plain`."""
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    check_length(prefix_ids.shape[-1] + n_new - 1, spec.n_max)
    E, state, tokens = spec.lm_head[prefix_ids], MergeState(), []  # E: (B, N_p, d)
    for step in range(n_new):
        hid = merged_forward(spec, E) if recompute else merged_forward_step(spec, E, state)
        tok = merged_logits(spec, hid[:, -1]).argmax(dim=-1)  # (B,)
        tokens.append(tok)
        if step + 1 < n_new:
            nxt = spec.lm_head[tok].unsqueeze(1)  # (B, 1, d)
            E = torch.cat([E, nxt], dim=1) if recompute else nxt
    return torch.stack(tokens, dim=1)
