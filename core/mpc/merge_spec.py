"""The exported parameters of a MERGE model and their plaintext reference forward (MERGE, Liang et al. 2024).

This module is the contract between MERGE training (:mod:`core.mpc.merge`) and the encrypted executor:
the executor runs exactly :func:`merged_forward` / :func:`merge_generate_plain` on secret shares. Only
torch matmul, add, elementwise ops, one real LayerNorm per block (eq. 11 keeps ``f_ln``) and the MLP
activation remain; no softmax, no embedding-table query during generation.

Notation (row-vector convention, as HF GPT-2's ``Conv1D``: ``y = x @ W + b``)::

    B  batch, N  current sequence length (N <= N_max), d  hidden size, H  heads, D = d / H  head dim,
    d_I  MLP width, V  vocabulary size, N_max  length of the constant attention matrices.

One merged block (eq. 10-11 made exact for GPT-2, whose blocks are pre-LN and have two residuals)::

    g   = LN(h; ln_gamma, ln_beta, ln_eps)                      # (B, N, d)  the kept real f_ln of eq. 11
    Z_k = C[k, :N, :N] @ g                                      # (B, N, d)  k = 0..H-1, product 1 (eq. 11 "C^n h")
    Z   = concat(Z_0, ..., Z_{H-1}, h)                          # (B, N, (H+1) d)
    u   = Z @ M_u + b_u                                         # (B, N, d_I) product 2, eq. 10's M_u, b_Mu
    a   = Z[..., :H d] @ M_a + b_a                              # (B, N, d)  attention branch (same product 2)
    out = h + a + act(u) @ W_O + b_O                            # (B, N, d)  product 3

Why the stacked ``M_u``: eq. 10 writes ``M_u = (W_V W_d + 1) * gamma . W_I`` with one attention matrix C. With
H heads each head k has its own ``C_k``, so the attention part of ``M_u`` is split by head,
``M_u[k] = W_V[:, k] W_d[k, :] diag(gamma_2) W_I`` (d x d_I), and the "+1" (residual) part,
``M_u[H] = diag(gamma_2) W_I``, multiplies the un-attended ``h`` (the residual is not mixed by C).
``b_u = (b_V W_d + b_d) diag(gamma_2) W_I + beta_2 W_I + b_I`` is eq. 10's ``b_Mu`` (plus the value bias
``b_V``, exact because every row of ``C_k`` sums to 1). ``M_a``/``b_a`` carry the attention output along the
residual stream (eq. 11 as printed drops GPT-2's residuals; keeping them makes the merge exact); an
executor may concatenate ``[M_u | M_a (zero-padded)]`` into one matmul.

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
from dataclasses import dataclass
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


@dataclass(frozen=True, kw_only=True)
class MergedLayerSpec:
    """One merged Transformer block (eq. 10-11). All tensors share one dtype.

    Attributes:
        C: (H, N_max, N_max) constant attention of eq. 8, one matrix per head: lower-triangular (causal,
            ``C[k, i, j] = 0`` for ``j > i``) and row-stochastic (each row sums to 1, hence every top-left
            ``C[k, :N, :N]`` is too). Initialised as the training-set average attention map, then trained.
        ln_gamma, ln_beta: (d,) the real LayerNorm at the block input (GPT-2's ``ln_1``, eq. 11's f_ln).
        ln_eps: its epsilon.
        M_u: ((H + 1) * d, d_I) merged ``W_V . W_d . f'_ln . W_I`` of eq. 10; row block k (rows
            ``k*d:(k+1)*d``) multiplies ``C_k @ g`` for head k < H, the last block multiplies the residual h.
        b_u: (d_I,) merged bias ``b_Mu`` of eq. 10.
        M_a: (H * d, d) merged ``W_V . W_d`` per head block: the attention output added to the residual.
        b_a: (d,) its bias ``b_V W_d + b_d``.
        W_O: (d_I, d) second MLP matrix of eq. 11.
        b_O: (d,) its bias.
        act: the MLP nonlinearity (see :func:`activation`).
    """

    C: torch.Tensor
    ln_gamma: torch.Tensor
    ln_beta: torch.Tensor
    ln_eps: float
    M_u: torch.Tensor
    b_u: torch.Tensor
    M_a: torch.Tensor
    b_a: torch.Tensor
    W_O: torch.Tensor
    b_O: torch.Tensor
    act: Activation = "gelu_new"

    def __post_init__(self) -> None:
        if self.C.dim() != 3 or self.C.shape[1] != self.C.shape[2]:
            raise ConfigError(f"C must have shape (H, N_max, N_max), got {tuple(self.C.shape)}")
        heads, d, d_i = self.C.shape[0], self.ln_gamma.shape[0], self.W_O.shape[0]
        expected = {
            "ln_beta": (d,),
            "M_u": ((heads + 1) * d, d_i),
            "b_u": (d_i,),
            "M_a": (heads * d, d),
            "b_a": (d,),
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


def merged_block(layer: MergedLayerSpec, h: torch.Tensor) -> torch.Tensor:
    """Eq. 11 for one block: (B, N, d) -> (B, N, d), see the module docstring for the formula."""
    n = h.shape[-2]
    check_length(n, layer.n_max)
    g = layer_norm(h, layer.ln_gamma, layer.ln_beta, layer.ln_eps)  # (B, N, d)
    c = layer.C[:, :n, :n]  # (H, N, N)
    z_heads = torch.matmul(c, g.unsqueeze(-3))  # (B, H, N, d)  product 1: C_k @ g
    z_heads = z_heads.transpose(-3, -2).flatten(-2)  # (B, N, H*d)  head blocks side by side
    z = torch.cat([z_heads, h], dim=-1)  # (B, N, (H+1)*d)
    u = z @ layer.M_u + layer.b_u  # (B, N, d_I)  product 2 (eq. 10)
    a = z_heads @ layer.M_a + layer.b_a  # (B, N, d)
    return h + a + activation(layer.act, u) @ layer.W_O + layer.b_O  # product 3


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


def merged_logits(spec: MergeSpec, hidden: torch.Tensor) -> torch.Tensor:
    """Token scores ``f_cls(h) = h @ lm_head.T``: (..., d) -> (..., V)."""
    return hidden @ spec.lm_head.T


def merge_generate_plain(spec: MergeSpec, prefix_embeds: torch.Tensor, n_new: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation by embedding resending (eq. 3), no embedding-table query.

    Args:
        spec: the exported model.
        prefix_embeds: (B, N_p, d) token embeddings of the prefix ``E_0`` (e.g. ``spec.lm_head[prefix_ids]``).
        n_new: number of new tokens, >= 1; needs ``N_p + n_new - 1 <= spec.n_max``.

    Returns:
        (tokens, hidden): tokens (B, n_new) the greedy tokens ``argmax(hidden @ lm_head.T)`` (decoding is separate
        from resending: tokens never feed back), hidden (B, n_new, d) the resent hidden states ``H_out[:, -1]``
        of each step. Same order as :func:`core.mpc.merge.merge_generate`.
    """
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    check_length(prefix_embeds.shape[-2] + n_new - 1, spec.n_max)
    E = prefix_embeds
    outs = []
    for step in range(n_new):
        last = merged_forward(spec, E)[:, -1]  # (B, d)
        outs.append(last)
        if step + 1 < n_new:
            E = torch.cat([E, last.unsqueeze(1)], dim=1)  # eq. 3: E_{t+1} = [E_t; h_t[N_t]]
    hidden = torch.stack(outs, dim=1)  # (B, n_new, d)
    return merged_logits(spec, hidden).argmax(dim=-1), hidden


def mm_generate_plain(spec: MergeSpec, prefix_ids: torch.Tensor, n_new: int) -> torch.Tensor:
    """Greedy generation with the merge module only (MM, no ER): every step decodes a token with the LM head and
    feeds its embedding ``lm_head[token]`` back, like vanilla generation. ``prefix_ids`` (B, N_p) -> (B, n_new)."""
    if n_new < 1:
        raise ConfigError(f"n_new must be >= 1, got {n_new=}")
    check_length(prefix_ids.shape[-1] + n_new - 1, spec.n_max)
    E = spec.lm_head[prefix_ids]  # (B, N_p, d)
    tokens = []
    for step in range(n_new):
        tok = merged_logits(spec, merged_forward(spec, E)[:, -1]).argmax(dim=-1)  # (B,)
        tokens.append(tok)
        if step + 1 < n_new:
            E = torch.cat([E, spec.lm_head[tok].unsqueeze(1)], dim=1)
    return torch.stack(tokens, dim=1)
