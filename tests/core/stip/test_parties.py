"""STIP three-party protocol (Algorithm 1) against the plaintext model."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError, DataError
from core.stip.models import tiny_llama
from core.stip.parties import PartyError, run_stip, run_stip_inprocess
from core.stip.wire import decode_body, encode_frame
from tests.core.stip.tiny import stip_gpt2

PROMPT = [5, 17, 42, 3, 9]
N_NEW = 5
DESIGNS = ["user_embed", "vocab_perm"]


@pytest.fixture(scope="module")
def models():
    return {"gpt2": stip_gpt2(), "llama": tiny_llama()}


def _check(result, d: int, vocab: int, design: str):
    assert len(result.tokens) == N_NEW
    assert result.tokens_match, (result.tokens, result.plain_tokens)
    assert result.max_abs_logit_error < 1e-5
    assert result.p2_seconds > 0 and result.p3_seconds > 0 and result.wall_seconds > 0
    down = 4 * (d if design == "user_embed" else vocab)  # float32 payload per token
    assert down < result.bytes_down_per_token < down + 200
    assert result.bytes_p3_to_p2 > 0 and result.setup_bytes_p1_to_p2 > result.setup_bytes_p1_to_p3 > 0


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("design", DESIGNS)
def test_inprocess_matches_plaintext(models, arch, design):
    model = models[arch]
    r = run_stip_inprocess(model, PROMPT, N_NEW, design=design, seed=1)
    _check(r, model.config.hidden_size, model.config.vocab_size, design)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("design", DESIGNS)
def test_three_processes_match_plaintext(models, arch, design):
    model = models[arch]
    r = run_stip(model, PROMPT, N_NEW, design=design, seed=2, timeout_s=30)
    _check(r, model.config.hidden_size, model.config.vocab_size, design)
    # same protocol in one process gives the same tokens and byte counts
    r_in = run_stip_inprocess(model, PROMPT, N_NEW, design=design, seed=2)
    assert r.tokens == r_in.tokens
    assert (r.bytes_p3_to_p2, r.bytes_p2_to_p3) == (r_in.bytes_p3_to_p2, r_in.bytes_p2_to_p3)


@pytest.mark.parametrize("party", ["P1", "P2", "P3"])
def test_dead_party_is_named(models, party):
    with pytest.raises(PartyError, match=party) as info:
        run_stip(models["gpt2"], PROMPT, N_NEW, timeout_s=10, _crash=party)
    assert info.value.party == party


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"design": "bogus"}, "design"), ({"n_new": 0}, "n_new"), ({"prompt_ids": []}, "empty")],
)
def test_bad_arguments(models, kwargs, match):
    args = {"prompt_ids": PROMPT, "n_new": 2} | kwargs
    with pytest.raises(ConfigError, match=match):
        run_stip_inprocess(models["gpt2"], **args)


def test_frame_round_trip():
    for payload in (
        torch.randn(1, 3, 4),
        torch.tensor([[1, 2]]),
        torch.randn(2, 2, dtype=torch.float64),
        b"abc",
        None,
    ):
        kind, back = decode_body(encode_frame("k", payload)[8:])
        assert kind == "k"
        if isinstance(payload, torch.Tensor):
            assert torch.equal(back, payload) and back.dtype == payload.dtype
        else:
            assert back == payload


def _smollm2():
    from core.stip.models import load_smollm2

    try:
        return load_smollm2()
    except DataError as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
def test_smollm2_real_weights_user_embed():
    model = _smollm2()
    r = run_stip_inprocess(model, torch.arange(1, 9) * 100, 4, design="user_embed")
    assert r.tokens_match
    assert r.max_abs_logit_error < 1e-3
