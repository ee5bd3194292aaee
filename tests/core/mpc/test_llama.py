"""Encrypted LLaMA-architecture decoder (SmolLM2's: RMSNorm, SwiGLU, rotary positions, grouped K/V heads) against
Hugging Face and its plaintext twins, for every method that runs the model itself."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.mpc import llama as L
from core.mpc.accounting import CATEGORIES
from core.mpc.gpt2 import MPCVariant
from core.mpc.methods import generate_plain

from .conftest import require_crypten

VOCAB, PROMPT, NEW = 97, 6, 3
METHODS = ("vanilla", "vanilla_kv", "merge_er", "mpcformer_2quad", "thex")  # the gpt2-engine methods


def tiny(dtype: torch.dtype = torch.float32):
    """2 blocks of width 32, 4 query heads sharing 2 K/V heads, SwiGLU 64, randomised norms (core.stip.models);
    the LM head scaled by 20 so that the top logits are apart by more than the fixed-point error."""
    pytest.importorskip("transformers")
    from core.stip.models import tiny_llama

    model = tiny_llama(d=32, layers=2, heads=4, kv_heads=2, vocab=VOCAB, intermediate=64, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to(dtype).eval()


def prompt(n: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))


def test_plaintext_reference_equals_hf() -> None:
    model = tiny(torch.float64)
    w = L.weights_from_hf(model, n_positions=32)
    with torch.no_grad():
        ref = model(prompt()).logits
        hf = model.generate(prompt(), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)[:, PROMPT:]
    got = L.plaintext_hidden(w, MPCVariant(), w.embed[prompt()]) @ w.lm_head.T
    assert (got - ref).abs().max() / ref.abs().max() < 1e-6  # HF's rotary tables are float32 (measured 9e-8)
    assert torch.equal(L.plaintext_reference(w, MPCVariant(), prompt(), 6), hf)
    assert len(set(hf.flatten().tolist())) > 3


def test_grouped_heads_and_rotary_are_checked() -> None:
    """The reference can fail: dropping the rotary positions changes the logits."""
    model = tiny(torch.float64)
    w = L.weights_from_hf(model, n_positions=32)
    flat = L.LlamaWeights(**{**w.__dict__, "cos": torch.ones_like(w.cos), "sin": torch.zeros_like(w.sin)})
    with torch.no_grad():
        ref = model(prompt()).logits
    got = L.plaintext_hidden(flat, MPCVariant(), w.embed[prompt()]) @ w.lm_head.T
    assert (got - ref).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="share 3 K/V heads"):
        L.LlamaWeights(**{**w.__dict__, "n_kv_head": 3})


def _job(ctx, w: L.LlamaWeights, ids: torch.Tensor) -> dict:
    from core.mpc.methods import run_method_party

    return {m: run_method_party(ctx, m, w, ids, NEW, tuple(ids.shape)) for m in METHODS}


@pytest.fixture(scope="module")
def runs() -> tuple[L.LlamaWeights, list[dict]]:
    require_crypten()
    from core.mpc.parties import run_local

    w = L.weights_from_hf(tiny(), n_positions=32)
    return w, run_local(_job, (w, prompt()), timeout_s=300)


@pytest.mark.parametrize("method", METHODS)
def test_decrypted_tokens_equal_the_plaintext_twin(runs, method: str) -> None:
    w, parties = runs
    assert parties[0][method].tokens is None
    assert torch.equal(parties[1][method].tokens, generate_plain(method, w, prompt(), NEW))


def test_vanilla_and_the_cache_equal_hf_generate(runs) -> None:
    _, parties = runs
    with torch.no_grad():
        hf = tiny().generate(prompt(), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(parties[1]["vanilla"].tokens, hf[:, PROMPT:])
    assert torch.equal(parties[1]["vanilla_kv"].tokens, hf[:, PROMPT:])


@pytest.mark.parametrize("method", METHODS)
def test_per_op_rows_sum_to_the_totals(runs, method: str) -> None:
    for party in runs[1]:
        res = party[method]
        assert sum(res.costs[c]["bytes"] for c in CATEGORIES) == res.comm_bytes
        assert sum(res.costs[c]["rounds"] for c in CATEGORIES) == res.rounds
