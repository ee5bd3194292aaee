"""FILM end to end against real (tiny) victims: every attacker setting keeps every true subword, the positional
attacker on SEB_co is far sharper than the bag of bytes, and a prior that knows the sentence recovers it exactly
through candidates, beam search and reordering (the plumbing carries the signal, nothing is lost)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from core.attacks.evaluate import attack_batches, build_victim, candidates, settings_for, summarize, warm_up
from core.attacks.seb import build_byte_mapping
from core.attacks.vocab import GPT2_EOS, GPT2_VOCAB
from core.errors import ConfigError

SENTENCES = [
    [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13],  # "The quick brown fox jumps over..."
    [40, 1842, 2003, 1110, 287, 262, 3329, 6766, 13],
]


@pytest.fixture(scope="module")
def mapping() -> torch.Tensor:
    return build_byte_mapping(GPT2_VOCAB, n_bytes=8, byte_vocab=256, seed=0)


def _victim(kind: str, mapping: torch.Tensor) -> torch.nn.Module:
    return build_victim(
        kind, mapping=mapping, n_layer=1, n_embd=16, n_head=2, n_positions=16, byte_dim=8, hidden=16, seed=0
    )


class UniformPrior:
    vocab_size, bos_id = GPT2_VOCAB, GPT2_EOS

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((ids.shape[0], self.vocab_size), -math.log(self.vocab_size))

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((ids.shape[0],), -math.log(self.vocab_size) * (ids.shape[1] - 1))


class OraclePrior(UniformPrior):
    """Knows the sentences: the next true token (after a true prefix) is near-certain."""

    def __init__(self, sentences: list[list[int]]):
        self.sentences = sentences

    def _logp(self, prefix: list[int]) -> torch.Tensor:
        out = torch.full((self.vocab_size,), -30.0)
        for s in self.sentences:
            if prefix == s[: len(prefix)] and len(prefix) < len(s):
                out[s[len(prefix)]] = 0.0
        return out

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([self._logp(row[1:].tolist()) for row in ids])

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [sum(self._logp(row[1:t].tolist())[row[t]] for t in range(1, len(row))) for row in ids]
        ).float()


def test_settings_apply_by_victim() -> None:
    assert settings_for("subword", ("subwords", "bytes", "positional", "relaxed")) == ["subwords"]
    assert settings_for("seb_co", ("subwords", "bytes", "positional", "relaxed")) == ["bytes", "positional", "relaxed"]
    assert settings_for("seb_ar", ("positional", "bytes")) == ["bytes"]


@pytest.mark.parametrize("kind", ["subword", "seb_ar", "seb_co"])
def test_candidates_keep_every_true_subword(kind: str, mapping: torch.Tensor) -> None:
    model = _victim(kind, mapping)
    results = attack_batches(
        model,
        [SENTENCES],
        victim=kind,
        settings=("subwords", "bytes", "positional", "relaxed"),
        mapping=mapping,
        byte_vocab=256,
        prior=UniformPrior(),
        decode=lambda s: " ".join(map(str, s)),
        beam_width=2,
        reorder_passes=0,
        relaxed_random=100,
        seed=0,
    )
    true = {t for s in SENTENCES for t in s}
    by = {r.setting: r for r in results}
    assert set(by) == set(settings_for(kind, ("subwords", "bytes", "positional", "relaxed")))
    for r in results:
        assert r.recall == 1.0 and r.n_unique_subwords == len(true)
        assert all(len(s.split()) == max(map(len, SENTENCES)) for s in r.recovered)  # length from the positions
    if kind == "subword":
        assert by["subwords"].n_candidates == len(true) and by["subwords"].precision == 1.0
    else:
        assert by["relaxed"].n_candidates <= 100 + len(true)
        assert by["bytes"].n_candidates > len(true)  # a bag of ~80 bytes admits other subwords
    if kind == "seb_co":
        assert by["positional"].n_candidates < by["bytes"].n_candidates / 2  # (position, byte) rows leak more


def test_an_oracle_prior_recovers_the_sentence_exactly(mapping: torch.Tensor) -> None:
    model = _victim("subword", mapping)
    sentence = SENTENCES[0]
    [r] = attack_batches(
        model,
        [[sentence]],
        victim="subword",
        settings=("subwords",),
        mapping=mapping,
        byte_vocab=256,
        prior=OraclePrior([sentence]),
        decode=lambda s: " ".join(map(str, s)),
        beam_width=4,
        reorder_passes=1,
        relaxed_random=0,
        seed=0,
        reorder_moves=16,
    )
    assert r.recovered == [" ".join(map(str, sentence))]
    assert r.rouge1 == r.rouge2 == r.rougeL == 1.0


def test_candidates_refuse_settings_the_victim_cannot_support(mapping: torch.Tensor) -> None:
    grad = torch.zeros(256, 8)
    with pytest.raises(ConfigError, match="positional"):
        candidates("positional", grad, mapping=mapping, byte_vocab=256, true_ids=[1], relaxed_random=0, seed=0)
    with pytest.raises(ConfigError, match="SEB victim"):
        candidates("bytes", grad, mapping=None, byte_vocab=256, true_ids=[1], relaxed_random=0, seed=0)


def test_warm_up_lowers_the_loss_and_summary_averages(mapping: torch.Tensor) -> None:
    model = _victim("seb_co", mapping)
    clients = [SENTENCES * 4, SENTENCES[::-1] * 4]
    losses = warm_up(model, clients, rounds=4, batch_size=4, lr=0.05, seed=0)
    assert len(losses) == 4 and losses[-1] < losses[0]
    results = attack_batches(
        model,
        [SENTENCES[:1], SENTENCES[1:]],
        victim="seb_co",
        settings=("bytes",),
        mapping=mapping,
        byte_vocab=256,
        prior=UniformPrior(),
        decode=lambda s: str(s),
        beam_width=2,
        reorder_passes=0,
        relaxed_random=0,
        seed=0,
    )
    summary = summarize(results)
    assert summary["bytes"]["n_batches"] == 2.0
    assert summary["bytes"]["n_candidates"] == pytest.approx(sum(r.n_candidates for r in results) / 2)


def test_a_prior_that_prefers_another_order_is_a_prior_error_not_a_search_error(mapping: torch.Tensor) -> None:
    """The oracle recovers the sentence (equal log-probs, no search error); a prior that knows the sentence
    backwards recovers it backwards, with a higher log-prob than the original: the prior is at fault."""
    sentence = SENTENCES[0]
    kw = {
        "victim": "subword",
        "settings": ("subwords",),
        "mapping": mapping,
        "byte_vocab": 256,
        "decode": lambda s: " ".join(map(str, s)),
        "beam_width": 4,
        "reorder_passes": 1,
        "relaxed_random": 0,
        "seed": 0,
        "reorder_moves": 16,
    }
    model = _victim("subword", mapping)
    [exact] = attack_batches(model, [[sentence]], prior=OraclePrior([sentence]), **kw)
    assert exact.logp_recovered == exact.logp_original and exact.search_error == 0.0
    [backwards] = attack_batches(model, [[sentence]], prior=OraclePrior([sentence[::-1]]), **kw)
    assert backwards.recovered == [" ".join(map(str, sentence[::-1]))]
    assert backwards.logp_recovered > backwards.logp_original and backwards.search_error == 0.0
    summary = summarize([exact, backwards])["subwords"]
    assert summary["search_error"] == 0.0 and summary["logp_gap"] < 0
    missed = dataclasses.replace(backwards, logp_recovered=backwards.logp_original - 1.0)
    assert missed.search_error == 1.0 and summarize([missed])["subwords"]["search_error"] == 1.0
    # a batch of two sentences is not judged (the recovered and original lengths differ in general)
    [pair] = attack_batches(model, [SENTENCES], prior=UniformPrior(), **kw)
    assert math.isnan(pair.search_error) and math.isnan(summarize([pair])["subwords"]["search_error"])
