"""The one builder of the small randomly initialised GPT-2 language models every stage trains or measures.

Used by the secure-inference stage (the fine-tuned model, its students, the random models of the scaling sweep
and of ``privbench bench mpc-generation``), STIP (the spec models and the tests' tiny ones) and the attack
stage's small LMs (``core.attacks.lm.build_causal_lm``, which installs SEB on it).
"""

from __future__ import annotations

import torch
from torch import nn

from core.models import hf

__all__ = ["GPT2_EOS", "GPT2_VOCAB", "tiny_gpt2"]

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary
GPT2_EOS = 50256  # its end-of-text token (also BOS)


def tiny_gpt2(
    vocab_size: int = GPT2_VOCAB,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_positions: int = 64,
    dropout: float = 0.1,
    eos_token_id: int = GPT2_EOS,
    tie_word_embeddings: bool = True,
    attn_implementation: str = "eager",
    seed: int | None = None,
) -> nn.Module:
    """A randomly initialised ``transformers.GPT2LMHeadModel`` of this shape (train mode, float32).

    ``dropout`` is the residual, embedding and attention dropout (GPT-2's default 0.1); ``eos_token_id`` is
    the BOS/EOS token; ``attn_implementation`` ``"eager"`` (plain matmul + softmax) or ``"sdpa"``. With a
    ``seed`` the weights are drawn from it without touching the global RNG; ``None`` draws them from the
    global RNG as it stands (for callers that seed it themselves).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
        loss_type="ForCausalLM",  # named: left None, transformers warns on every forward with labels
    )
    cfg._attn_implementation = attn_implementation
    if seed is None:
        return _tied(hf.build(GPT2LMHeadModel, cfg), tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _tied(hf.build(GPT2LMHeadModel, cfg), tie_word_embeddings)


def _tied(model: nn.Module, tie: bool) -> nn.Module:
    """``model`` with its LM head sharing the input embedding's weight when ``tie``. Done here, not left to
    ``post_init``: transformers' ``from_pretrained`` swaps ``PreTrainedModel.tie_weights`` for a no-op on the
    class while it loads, so a model built in another thread meanwhile came out untied (twice the embedding
    parameters, seen once in the attacks flow test)."""
    if tie:
        model.lm_head.weight = model.transformer.wte.weight
    return model
