"""Encrypted GPT-2 vs Hugging Face / plaintext references, generation modes, MERGE, accounting, errors."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.mpc import gpt2 as G
from core.mpc.accounting import CATEGORIES
from core.mpc.merge_spec import merge_generate_plain, mm_generate_plain

from .conftest import N_POS, NEW, PREFIX, long_prefix, require_crypten, tiny_merge_spec

require_crypten()

LOGIT_TOL = 2e-2  # measured max |encrypted - HF| ~4e-3 on the tiny model (exact variant)


def test_plaintext_reference_equals_hf(hf_model, weights, prefix) -> None:
    with torch.no_grad():
        ref = hf_model(prefix).logits
    assert torch.allclose(G.plaintext_logits(weights, G.MPCVariant(), prefix), ref, atol=1e-5)


def test_encrypted_forward_matches_hf(two_party, hf_model, prefix) -> None:
    with torch.no_grad():
        ref = hf_model(prefix).logits
    enc = two_party[1]["logits"]
    assert enc.shape == ref.shape == (2, PREFIX, 64)
    assert (enc - ref).abs().max().item() < LOGIT_TOL
    assert torch.equal(enc.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("mode", G.GENERATION_MODES)
def test_generation_equals_plaintext_greedy(two_party, weights, prefix, mode) -> None:
    res = two_party[1][mode]
    assert res.tokens is not None and two_party[0][mode].tokens is None  # only the client sees tokens
    assert torch.equal(res.tokens, G.plaintext_reference(weights, G.MPCVariant(), prefix, NEW, mode=mode))


def test_vanilla_matches_hf_generate_and_kv_cache(two_party, hf_model, prefix) -> None:
    hf = hf_model.generate(prefix, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, PREFIX:]
    assert torch.equal(two_party[1]["vanilla"].tokens, hf)
    assert torch.equal(two_party[1]["vanilla_kv"].tokens, two_party[1]["vanilla"].tokens)


def test_merge_generation_equals_plain_spec(two_party, prefix) -> None:
    spec = tiny_merge_spec()
    out = merge_generate_plain(spec, spec.lm_head[prefix], NEW)
    tokens = next(t for t in out if not t.is_floating_point())  # (tokens, hidden) in either order
    res = two_party[1]["merge"]
    assert torch.equal(res.tokens, tokens)
    assert res.costs["Softmax"]["s"] == 0 and res.costs["Softmax"]["bytes"] == 0
    assert res.costs["Embed"]["calls"] == NEW + 1  # prefix lookup + the positions add per step; no token lookup


def test_merge_module_alone_selects_tokens_every_step(two_party, prefix) -> None:
    spec = tiny_merge_spec()
    res = two_party[1]["mm"]
    assert torch.equal(res.tokens, mm_generate_plain(spec, prefix, NEW))
    assert res.costs["Softmax"]["bytes"] == 0 and res.costs["Generation"]["calls"] == NEW


def _plain_merge_tokens(ids: torch.Tensor) -> torch.Tensor:
    spec = tiny_merge_spec()
    return merge_generate_plain(spec, spec.lm_head[ids], NEW)[0]


def test_incremental_merge_equals_recomputed_reference(two_party, prefix) -> None:
    inc, ref = two_party[1]["merge"], two_party[1]["merge_recompute"]
    assert torch.equal(inc.tokens, ref.tokens)
    long_ids = long_prefix()
    assert torch.equal(two_party[1]["merge_long"].tokens, _plain_merge_tokens(long_ids))
    for party in two_party:  # one new position per step instead of the whole sequence
        assert all(a < b for a, b in zip(party["merge"].step_bytes[1:], party["merge_recompute"].step_bytes[1:]))


def test_merge_step_bytes_do_not_depend_on_prefix_length(two_party) -> None:
    for party in two_party:
        short, long = party["merge"], party["merge_long"]
        assert len(short.step_bytes) == len(short.step_rounds) == NEW
        assert sum(short.step_bytes) <= short.comm_bytes
        assert short.step_bytes[1:] == long.step_bytes[1:]  # prefix 4 vs 12, same model (N_max)
        assert short.step_rounds[1:] == long.step_rounds[1:]
        assert short.step_bytes[1] == short.step_bytes[2]  # nor on the position
        assert long.step_bytes[0] > short.step_bytes[0]  # only the first step reads the whole prefix
        vanilla = party["vanilla"].step_bytes  # recomputation: every step costs more than the one before
        assert vanilla[0] < vanilla[1] < vanilla[2]


@pytest.mark.parametrize("mode", [*G.GENERATION_MODES, "merge", "mm"])
def test_per_op_costs_sum_to_totals(two_party, mode) -> None:
    for party in two_party:
        res = party[mode]
        assert set(res.costs) == set(CATEGORIES)
        assert sum(c["bytes"] for c in res.costs.values()) == res.comm_bytes > 0
        assert sum(c["rounds"] for c in res.costs.values()) == res.rounds > 0
        assert sum(c["s"] for c in res.costs.values()) == pytest.approx(res.total_s, rel=1e-9, abs=1e-9)


def test_kv_cache_cuts_communication(two_party) -> None:
    van, kv = two_party[1]["vanilla"], two_party[1]["vanilla_kv"]
    assert kv.comm_bytes < van.comm_bytes
    assert kv.costs["Embed"]["bytes"] < van.costs["Embed"]["bytes"]
    assert two_party[1]["vanilla_er"].costs["Generation"]["calls"] == 1  # one batched argmax at the end


@pytest.mark.parametrize(("field", "value"), [("softmax", "3relu"), ("activation", "swish"), ("norm", "rms")])
def test_unknown_variant_lists_known(field, value) -> None:
    with pytest.raises(ConfigError, match="known: ") as err:
        G.MPCVariant(**{field: value})
    assert value in str(err.value)


def test_unknown_mode_lists_known(weights, prefix) -> None:
    with pytest.raises(ConfigError, match="vanilla_kv"):
        G.plaintext_reference(weights, G.MPCVariant(), prefix, 2, mode="beam")


def test_prefix_longer_than_positions_names_both_numbers(weights) -> None:
    ids = torch.zeros(1, N_POS + 5, dtype=torch.long)
    with pytest.raises(ConfigError, match=rf"{N_POS + 5}.*{N_POS}"):
        G.plaintext_reference(weights, G.MPCVariant(), ids, 1)
    with pytest.raises(ConfigError, match=rf"30.*5.*{N_POS}"):
        G.check_lengths(30, 5, N_POS)


@pytest.mark.parametrize("mode", [*G.GENERATION_MODES, "merge", "mm"])
def test_prefix_steps_and_decode_make_up_the_run(two_party, mode) -> None:
    """The length fit of the paper-shape bench reads these phases: together they are the whole run."""
    for party in two_party:
        res = party[mode]
        assert set(res.phases) == {"prefix", "decode"}
        assert len(res.step_s) == len(res.step_bytes) == NEW and min(res.step_s) > 0
        pre, dec = res.phases["prefix"], res.phases["decode"]
        assert pre["bytes"] + sum(res.step_bytes) + dec["bytes"] == res.comm_bytes
        assert pre["rounds"] + sum(res.step_rounds) + dec["rounds"] == res.rounds
        assert pre["s"] + sum(res.step_s) + dec["s"] == pytest.approx(res.total_s, rel=1e-3, abs=1e-3)
        assert pre["bytes"] > 0 and dec["bytes"] > 0  # the prompt is shared, the tokens revealed


def test_every_step_after_the_first_does_the_same_work(two_party) -> None:
    """The next token's lookup opens each step (the last step is not cheaper), so a step's cost is a function of
    the sequence length alone, which the length fit assumes."""
    for party in two_party:
        mm, kv = party["mm"].step_bytes, party["vanilla_kv"].step_bytes
        assert mm[1] == mm[2] > 0  # one new position, no attention to the past (constant attention)
        assert kv[1] <= kv[2] < 1.1 * kv[1]  # one new position attending to a cache one longer
