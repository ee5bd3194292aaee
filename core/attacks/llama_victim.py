"""FedSGD victims of the SmolLM2 architecture for FILM (SEB paper Sec. 3.3, 5.1, with a LLaMA-family model).

``smollm2_victim`` cuts the pretrained SmolLM2-135M (``core.stip.models.load_smollm2``: LLaMA architecture,
d = 576, 30 layers, 49,152 subwords) to its first ``n_layer`` blocks, keeping its subword embedding and final
norm, and unties the output layer (a copy of the embedding), so the input embedding's gradient is non-zero
exactly on the rows of the batch's subwords (FILM's signal). For SEB victims, :func:`core.attacks.seb.install_seb`
replaces both the input embedding and the output layer (``output="seb"``): no parameter is indexed by subword.

Rotary positions leave no position-embedding gradient, so the attacker cannot read the sentence length from one
as it does for GPT-2 (``core.attacks.film.sequence_length_from_positions``); the attack is then given the length
the GPT-2 position gradient would reveal (the batch's longest sentence, in tokens).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

from core.attacks.seb import install_seb
from core.errors import ConfigError
from core.models import hf

__all__ = ["SMOLLM2_EOS", "SMOLLM2_VOCAB", "smollm2_tokenizer", "smollm2_victim"]


def smollm2_victim(
    victim: str,
    pretrained: nn.Module,
    *,
    n_layer: int,
    mapping: torch.Tensor | None,
    byte_dim: int,
    hidden: int,
    seed: int,
) -> nn.Module:
    """A ``LlamaForCausalLM`` with the first ``n_layer`` pretrained blocks of ``pretrained`` (left untouched) and
    an untied subword head (``victim="subword"``) or SEB in and out (``"seb_ar" | "seb_cr" | "seb_co"``, with
    ``mapping (49152, n_bytes)``; SEB's weights are seeded without touching the global RNG)."""
    from transformers import LlamaForCausalLM

    total = int(pretrained.config.num_hidden_layers)
    if not 1 <= n_layer <= total:
        raise ConfigError(f"n_layer must be in [1, {total}] (the pretrained model's blocks), got {n_layer=}")
    if victim != "subword" and mapping is None:
        raise ConfigError(f"victim {victim!r} needs the SEB subword->bytes mapping")
    cfg = copy.deepcopy(pretrained.config)
    cfg.num_hidden_layers, cfg.tie_word_embeddings = n_layer, False
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = cfg.layer_types[:n_layer]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.build(LlamaForCausalLM, cfg)
        src = pretrained.state_dict()
        state = {k: v.clone() for k, v in src.items() if k in model.state_dict()}
        state["lm_head.weight"] = src["model.embed_tokens.weight"].clone()  # untied copy of the embedding
        model.load_state_dict(state, strict=True)
        if victim != "subword":
            install_seb(
                model, mapping, variant=victim.removeprefix("seb_"), byte_dim=byte_dim, hidden=hidden, output="seb"
            )
    return model.train()


SMOLLM2_VOCAB = 49152
SMOLLM2_EOS = 0  # <|endoftext|>: ends every private sentence and starts every prior sequence


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """SmolLM2's own tokenizer (49,152 subwords), read from the offline GGUF file (``core.stip.models``)."""
    from transformers import AutoTokenizer

    from core.stip.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
