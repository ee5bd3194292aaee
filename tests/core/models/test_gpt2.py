"""The one tiny GPT-2 builder (``core.models.gpt2.tiny_gpt2``) every stage uses."""

from __future__ import annotations

import pytest
import torch

from core.models.gpt2 import GPT2_EOS, GPT2_VOCAB, tiny_gpt2


def test_shape_and_config_follow_the_arguments() -> None:
    model = tiny_gpt2(
        50,
        n_layer=1,
        n_embd=16,
        n_head=2,
        n_positions=12,
        dropout=0.0,
        eos_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        seed=0,
    )
    cfg = model.config
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (50, 1, 16, 2, 12)
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0 and cfg.bos_token_id == cfg.eos_token_id == 0
    assert cfg._attn_implementation == "sdpa" and model.lm_head.weight is not model.transformer.wte.weight
    default = tiny_gpt2(n_layer=1, n_embd=8, n_head=1, seed=0).config
    assert default.vocab_size == GPT2_VOCAB and default.eos_token_id == GPT2_EOS
    assert default._attn_implementation == "eager" and default.resid_pdrop == 0.1


def test_a_seed_fixes_the_weights_and_leaves_the_global_rng() -> None:
    state = torch.random.get_rng_state()
    a = tiny_gpt2(30, n_layer=1, n_embd=8, n_head=2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = tiny_gpt2(30, n_layer=1, n_embd=8, n_head=2, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    torch.manual_seed(3)  # seed=None draws from the global RNG as it stands: the same weights here
    c = tiny_gpt2(30, n_layer=1, n_embd=8, n_head=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


def test_the_head_is_tied_even_while_transformers_has_tying_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import PreTrainedModel

    # what from_pretrained does to the class while it loads (another thread may be building a model meanwhile)
    monkeypatch.setattr(PreTrainedModel, "tie_weights", lambda self, *a, **k: None)
    tied = tiny_gpt2(50, n_layer=1, n_embd=8, n_head=2, n_positions=8, seed=0)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert sum(p.numel() for p in tied.parameters()) < sum(
        p.numel()
        for p in tiny_gpt2(50, n_layer=1, n_embd=8, n_head=2, n_positions=8, tie_word_embeddings=False).parameters()
    )
