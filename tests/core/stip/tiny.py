"""The tiny GPT-2 the STIP tests transform: :func:`core.models.gpt2.tiny_gpt2` with randomised norms."""

from __future__ import annotations

import torch
from torch import nn

from core.models.gpt2 import tiny_gpt2
from core.stip.models import randomize_norms


def stip_gpt2(seed: int = 0) -> nn.Module:
    """d 32, 2 layers, 4 heads, vocabulary 97, no dropout, eval mode, every norm weight and bias random; the
    global RNG is seeded with ``seed`` first (the tests draw their inputs from it)."""
    torch.manual_seed(seed)
    model = tiny_gpt2(97, n_layer=2, n_embd=32, n_head=4, dropout=0.0, eos_token_id=0, attn_implementation="sdpa")
    return randomize_norms(model, seed).eval()
