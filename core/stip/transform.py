"""STIP parameter transform (Yuan et al., "Secure Transformer Inference", Sec. 3, Theorem 1).

Notation. ``pi`` is a permutation of the model dimension ``d`` stored as an index vector, so the
paper's ``x pi`` (right-multiplication by a permutation matrix) is ``x[..., pi]`` here. With

    W'_q = pi^T W_q, W'_k = pi^T W_k, W'_v = pi^T W_v, W'_1 = pi^T W_1          (input side)
    W'_o = W_o pi,   W'_2 = W_2 pi,   gamma' = gamma pi, beta' = beta pi         (output side)

Theorem 1 states ``f_theta'(x pi) = f_theta(x) pi`` for every block. In index form, for an
``nn.Linear`` (weight ``(out, in)``, ``y = x W^T + b``) the input side is ``W[:, pi]`` and the output
side ``W[pi, :]``, ``b[pi]``; for a GPT-2 ``Conv1D`` (weight ``(in, out)``, ``y = x W + b``) it is
``W[pi, :]`` and ``W[:, pi]``, ``b[pi]``. Norm weights *and biases* are permuted (an untouched
LayerNorm/RMSNorm silently breaks the theorem).

Only the model dimension ``d`` is permuted: per-head dimensions, hence rotary position embeddings
(applied to ``q``/``k`` of size ``head_dim`` after the projection), are untouched, because
``q' = x pi pi^T W_q = q``. The MLP hidden dimension ``m`` may additionally be permuted by a secret
per-layer permutation ``rho`` (``permute_model(..., rho=...)``); the activation is element-wise so it commutes.

Where the secrets come from is ``core.stip.keys`` (the OS CSPRNG, never a recorded seed); this module only
applies permutations it is given. ``random_permutation`` is seeded and reproducible: for tests and public
randomness only, never for a secret.

What is transformed (``permute_model``): every decoder block, the final norm, and for GPT-2 the
learned position table ``wpe`` (columns), which the base model adds to ``inputs_embeds`` inside its
forward. What is *not* transformed: the token embedding table and the LM head; ``permute_vocab``
builds their permuted (``pi`` on ``d``, secret substitution ``sigma`` on the vocabulary) versions for
the ``vocab_perm`` design of ``core.stip.parties``.

Masks: the theorem holds for any additive mask ``M`` (``n x n``, independent of ``d``), so both the
decoder (causal) and an encoder-style bidirectional mask work; tests check both at block level.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from core.errors import ConfigError

__all__ = [
    "base_model_of",
    "check_permutation",
    "inverse_permutation",
    "mlp_hidden_sizes",
    "permute_model",
    "permute_vocab",
    "random_permutation",
]


def random_permutation(d: int, seed: int) -> torch.Tensor:
    """A uniformly random permutation of ``range(d)`` as an int64 index vector, shape ``(d,)``, drawn from
    ``seed``: reproducible, so anyone who knows ``seed`` regenerates it. Tests and public randomness only; a
    secret comes from ``core.stip.keys.secure_permutation``."""
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ConfigError(f"permutation size must be a positive int, got {d=!r}")
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randperm(d, generator=gen)


def check_permutation(pi: torch.Tensor, d: int) -> torch.Tensor:
    """Validate ``pi`` as a permutation of ``range(d)``; returns it as a CPU int64 tensor.

    Raises ``ConfigError`` naming the problem (not a tensor, wrong shape/size, not integer,
    out-of-range or repeated entries). Never prints the permutation itself (it is a secret).
    """
    if not isinstance(pi, torch.Tensor):
        raise ConfigError(f"pi must be a torch.Tensor of indices, got {type(pi).__name__}")
    if pi.dim() != 1:
        raise ConfigError(f"pi must be 1-D, got shape {tuple(pi.shape)}")
    if pi.numel() != d:
        raise ConfigError(f"pi has wrong size: {pi.numel()} entries for model dimension d={d}")
    if pi.dtype.is_floating_point or pi.dtype.is_complex or pi.dtype == torch.bool:
        raise ConfigError(f"pi must hold integer indices, got dtype {pi.dtype}")
    pi = pi.detach().to("cpu", torch.int64)
    counts = torch.bincount(pi.clamp(0, d - 1), minlength=d)
    if bool((pi < 0).any() or (pi >= d).any()) or bool((counts != 1).any()):
        n_bad = int((pi < 0).sum() + (pi >= d).sum() + (counts == 0).sum())
        raise ConfigError(f"pi is not a permutation of range({d}): {n_bad} missing or out-of-range entries")
    return pi


def inverse_permutation(pi: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``x[..., pi][..., inv] == x``."""
    inv = torch.empty_like(pi)
    inv[pi] = torch.arange(pi.numel(), dtype=pi.dtype)
    return inv


def arch_of(model: nn.Module) -> str:
    from transformers import GPT2LMHeadModel, GPT2Model, LlamaForCausalLM, LlamaModel

    if isinstance(model, (GPT2LMHeadModel, GPT2Model)):
        return "gpt2"
    if isinstance(model, (LlamaForCausalLM, LlamaModel)):
        return "llama"
    raise ConfigError(
        f"unsupported model type {type(model).__name__}; STIP transform supports "
        "GPT2LMHeadModel, GPT2Model, LlamaForCausalLM, LlamaModel"
    )


def base_model_of(model: nn.Module) -> nn.Module:
    """The ``GPT2Model``/``LlamaModel`` inside ``model`` (or ``model`` itself)."""
    arch = arch_of(model)
    if arch == "gpt2":
        return getattr(model, "transformer", model)
    return model.model if hasattr(model, "lm_head") else model


# ---------------------------------------------------------------- allowed modules


def _allowed_activations() -> tuple[type, ...]:
    """Element-wise activation classes (they commute with any permutation)."""
    from transformers import activations

    classes = {nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Mish}
    for value in activations.ACT2CLS.values():
        cls = value[0] if isinstance(value, tuple) else value
        if isinstance(cls, type) and cls is not nn.PReLU:  # PReLU may be per-channel
            classes.add(cls)
    return tuple(classes)


def _check_block_modules(block: nn.Module, allowed: tuple[type, ...], where: str) -> None:
    for name, mod in block.named_modules():
        if type(mod) not in allowed and not isinstance(mod, _allowed_activations()):
            raise ConfigError(
                f"unsupported module {type(mod).__name__} at {where}.{name or '<block>'}; "
                "STIP only knows how to permute LayerNorm/RMSNorm, attention, MLP, dropout "
                "and element-wise activations"
            )


# ---------------------------------------------------------------- primitive ops


@torch.no_grad()
def _perm_(param: torch.Tensor, dim: int, idx: torch.Tensor, done: set[int]) -> None:
    param.copy_(param.index_select(dim, idx.to(param.device)))
    done.add(id(param))


def _norm(norm: nn.Module, pi: torch.Tensor, done: set[int]) -> None:
    for p in (getattr(norm, "weight", None), getattr(norm, "bias", None)):
        if p is not None:
            _perm_(p, 0, pi, done)


def _linear_in(lin: nn.Linear, pi: torch.Tensor, done: set[int]) -> None:
    _perm_(lin.weight, 1, pi, done)  # (out, in): x pi pi^T W -> columns
    if lin.bias is not None:
        done.add(id(lin.bias))


def _linear_out(lin: nn.Linear, pi: torch.Tensor, done: set[int]) -> None:
    _perm_(lin.weight, 0, pi, done)  # (out, in): rows
    if lin.bias is not None:
        _perm_(lin.bias, 0, pi, done)


def _conv_in(conv: nn.Module, pi: torch.Tensor, done: set[int]) -> None:
    _perm_(conv.weight, 0, pi, done)  # Conv1D weight (in, out)
    if conv.bias is not None:
        done.add(id(conv.bias))


def _conv_out(conv: nn.Module, pi: torch.Tensor, done: set[int]) -> None:
    _perm_(conv.weight, 1, pi, done)
    _perm_(conv.bias, 0, pi, done)


# ---------------------------------------------------------------- blocks


def _gpt2_block(block: nn.Module, pi: torch.Tensor, rho: torch.Tensor | None, done: set[int]) -> None:
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Block
    from transformers.pytorch_utils import Conv1D

    allowed = (GPT2Block, GPT2Attention, GPT2MLP, Conv1D, nn.LayerNorm, nn.Dropout)
    _check_block_modules(block, allowed, "GPT2Block")
    if getattr(block.attn, "is_cross_attention", False) or hasattr(block, "crossattention"):
        raise ConfigError("unsupported module GPT2Block.crossattention (cross-attention)")
    _norm(block.ln_1, pi, done)
    _conv_in(block.attn.c_attn, pi, done)  # (d, 3d): q, k, v all read x
    _conv_out(block.attn.c_proj, pi, done)  # (d, d)
    _norm(block.ln_2, pi, done)
    _conv_in(block.mlp.c_fc, pi, done)  # (d, m)
    _conv_out(block.mlp.c_proj, pi, done)  # (m, d)
    if rho is not None:  # secret permutation of the MLP hidden dim m
        _perm_(block.mlp.c_fc.weight, 1, rho, done)
        _perm_(block.mlp.c_fc.bias, 0, rho, done)
        _perm_(block.mlp.c_proj.weight, 0, rho, done)


def _llama_layer(layer: nn.Module, pi: torch.Tensor, rho: torch.Tensor | None, done: set[int]) -> None:
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaMLP,
        LlamaRMSNorm,
    )

    allowed = (LlamaDecoderLayer, LlamaAttention, LlamaMLP, LlamaRMSNorm, nn.Linear, nn.Dropout)
    _check_block_modules(layer, allowed, "LlamaDecoderLayer")
    attn, mlp = layer.self_attn, layer.mlp
    _norm(layer.input_layernorm, pi, done)
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj):  # (heads*head_dim, d): only d permuted
        _linear_in(lin, pi, done)
    _linear_out(attn.o_proj, pi, done)  # (d, heads*head_dim)
    _norm(layer.post_attention_layernorm, pi, done)
    _linear_in(mlp.gate_proj, pi, done)  # (m, d)
    _linear_in(mlp.up_proj, pi, done)
    _linear_out(mlp.down_proj, pi, done)  # (d, m)
    if rho is not None:  # silu(gate) * up is element-wise in m
        for lin in (mlp.gate_proj, mlp.up_proj):
            _perm_(lin.weight, 0, rho, done)
            if lin.bias is not None:
                _perm_(lin.bias, 0, rho, done)
        _perm_(mlp.down_proj.weight, 1, rho, done)


def _check_all_done(module: nn.Module, done: set[int], where: str) -> None:
    for name, p in module.named_parameters():
        if id(p) not in done:
            raise ConfigError(f"parameter {where}.{name} was not transformed; refusing a silent wrong output")


def mlp_hidden_sizes(model: nn.Module) -> list[int]:
    """The MLP hidden size ``m`` of every block, in order (one ``rho`` of this size per block)."""
    base = base_model_of(model)
    if arch_of(model) == "gpt2":
        return [int(block.mlp.c_fc.weight.shape[1]) for block in base.h]  # Conv1D (d, m)
    return [int(layer.mlp.gate_proj.weight.shape[0]) for layer in base.layers]  # Linear (m, d)


def _check_rho(rho: Sequence[torch.Tensor] | None, model: nn.Module) -> list[torch.Tensor] | None:
    if rho is None:
        return None
    sizes = mlp_hidden_sizes(model)
    if len(rho) != len(sizes):
        raise ConfigError(f"rho has {len(rho)} permutations for a model with {len(sizes)} blocks")
    return [check_permutation(r, m) for r, m in zip(rho, sizes, strict=True)]


def permute_model(model: nn.Module, pi: torch.Tensor, *, rho: Sequence[torch.Tensor] | None = None) -> nn.Module:
    """Return a transformed deep copy ``f_theta'`` of ``model`` (Theorem 1); ``model`` is untouched.

    ``model``: ``GPT2LMHeadModel``/``GPT2Model``/``LlamaForCausalLM``/``LlamaModel``.
    ``pi``: permutation of the model dimension ``d`` (``config.hidden_size``/``n_embd``).
    ``rho``: if given, one permutation of the MLP hidden dimension per block (``mlp_hidden_sizes``), applied
    to that block's MLP (the output is unchanged; it only hides ``m``'s order).

    With ``X`` the token embeddings ``(B, T, d)``, the copy's base model satisfies
    ``base'(inputs_embeds=X[..., pi]).last_hidden_state == base(inputs_embeds=X).last_hidden_state[..., pi]``.
    The token embedding table and LM head are left as in ``model`` (see ``permute_vocab``).
    Raises ``ConfigError`` for another model type, a bad ``pi`` or ``rho``, or an unknown module in a block.
    """
    arch = arch_of(model)
    d = model.config.hidden_size
    pi = check_permutation(pi, d)
    rhos = _check_rho(rho, model)
    new = copy.deepcopy(model).eval()
    base = base_model_of(new)
    done: set[int] = set()
    if arch == "gpt2":
        for i, block in enumerate(base.h):
            _gpt2_block(block, pi, None if rhos is None else rhos[i], done)
            _check_all_done(block, done, f"h.{i}")
        _norm(base.ln_f, pi, done)
        _perm_(base.wpe.weight, 1, pi, done)  # (n_positions, d): added to inputs_embeds
    else:
        for i, layer in enumerate(base.layers):
            _llama_layer(layer, pi, None if rhos is None else rhos[i], done)
            _check_all_done(layer, done, f"layers.{i}")
        _norm(base.norm, pi, done)
    return new


def permute_vocab(
    embed: torch.Tensor, head: torch.Tensor, pi: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding and head for the ``vocab_perm`` design, shapes ``(V, d)`` each.

    ``sigma`` substitutes token ``t`` by ``sigma[t]``. Returns ``(E', H')`` with
    ``E'[sigma[t]] = E[t][pi]`` and ``H'[sigma[t]] = H[t][pi]``, so
    ``h' @ H'.T == (h @ H.T)[inv_sigma]`` for ``h' = h[pi]``: the logits come out in substituted
    vocabulary order and ``logits = logits'[sigma]``. Copies; inputs are untouched.
    """
    V, d = embed.shape
    if head.shape != (V, d):
        raise ConfigError(f"head shape {tuple(head.shape)} must equal embedding shape {(V, d)}")
    pi = check_permutation(pi, d)
    sigma = check_permutation(sigma, V)
    inv_sigma = inverse_permutation(sigma)
    with torch.no_grad():
        e = embed.detach()[inv_sigma][:, pi].clone()
        h = head.detach()[inv_sigma][:, pi].clone()
    return e, h
