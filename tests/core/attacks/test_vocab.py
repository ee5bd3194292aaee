"""Compact vocabularies and the compact prior (core.attacks.priors): a proper distribution over the full vocabulary,
and a sequence
score equal to the sum of its next-token log-probabilities (the slow, obviously correct reference)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from core.attacks.priors import CompactPrior
from core.attacks.vocab import LM_VOCABS, CompactVocab, FullVocab, lm_vocabulary, pack
from core.errors import ConfigError, DataError

FULL = 100


def _prior(seed: int = 0) -> CompactPrior:
    vocab = CompactVocab([3, 7, 10, 42, 99], full_size=FULL, unk_full=99)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab.size, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    return CompactPrior(model, vocab, bos_id=99)


def test_encode_decode_round_trip_and_unk():
    vocab = CompactVocab([10, 3, 7, 3], full_size=FULL, unk_full=99)
    assert vocab.size == 4 and vocab.unk == 3 and vocab.n_unseen == FULL - 3
    assert vocab.encode(torch.tensor([3, 7, 10, 50])).tolist() == [0, 1, 2, 3]
    assert vocab.decode(torch.tensor([0, 1, 2, 3])).tolist() == [3, 7, 10, 99]
    assert CompactVocab.from_state(vocab.state()).encode(torch.tensor([10])).item() == 2


def test_bad_vocabularies_are_refused():
    with pytest.raises(DataError, match="empty"):
        CompactVocab([], full_size=FULL)
    with pytest.raises(DataError, match="does not match"):
        CompactVocab([5, 100], full_size=FULL)


def test_lm_vocabularies_compact_folds_unseen_ids_and_full_keeps_every_id():
    seqs = [[3, 7], [10, 7]]
    compact = lm_vocabulary("compact", seqs)  # over GPT-2's ids
    assert isinstance(compact, CompactVocab) and compact.size == 4 + 1  # 3, 7, 10, the always-kept EOS, <unk>
    ids = torch.tensor([3, 7, 50, 60])
    assert compact.unk_rate(compact.encode(ids)) == 0.5  # 50 and 60 were never seen
    full = lm_vocabulary("full", seqs, full_size=FULL)
    assert isinstance(full, FullVocab) and full.size == FULL and full.unk is None and full.n_unseen == 0
    assert full.encode(ids).tolist() == [3, 7, 50, 60] and full.decode(ids).tolist() == [3, 7, 50, 60]
    assert full.unk_rate(full.encode(ids)) == 0.0
    assert lm_vocabulary("full", []).size == 50257  # GPT-2's by default
    assert LM_VOCABS == ("compact", "full")


def test_bad_lm_vocabularies_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown LM vocabulary 'whole'.*'compact'.*'full'"):
        lm_vocabulary("whole", [[1]])
    with pytest.raises(DataError, match=r"\[0, 100\), got min 0 max 100"):
        FullVocab(FULL).encode(torch.tensor([0, 100]))
    with pytest.raises(ConfigError, match="full_size=0"):
        FullVocab(0)


def test_prior_is_a_distribution_over_the_full_vocabulary():
    prior = _prior()
    logp = prior.next_log_probs(torch.tensor([[99, 3, 7], [99, 55, 10]]))
    assert logp.shape == (2, FULL)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2), atol=1e-5, rtol=0)
    unseen = [v for v in range(FULL) if v not in (3, 7, 10, 42, 99)]
    assert torch.allclose(logp[:, unseen], logp[:, unseen[:1]].expand(-1, len(unseen)))  # equal shares of <unk>


def test_sequence_score_equals_sum_of_next_token_log_probs():
    prior = _prior(1)
    seq = torch.tensor([[99, 3, 55, 10, 42], [99, 42, 42, 7, 60]])
    ref = torch.zeros(2)
    for t in range(1, seq.shape[1]):  # slow reference: one next-token call per position
        ref += prior.next_log_probs(seq[:, :t]).gather(1, seq[:, t : t + 1]).squeeze(1)
    torch.testing.assert_close(prior.sequence_log_prob(seq), ref, atol=1e-4, rtol=1e-5)


def test_prior_refuses_a_model_of_another_vocabulary():
    vocab = CompactVocab([1, 2, 3], full_size=FULL)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    with pytest.raises(ConfigError, match="differs"):
        CompactPrior(model, vocab)


def test_pack_pads_right_and_refuses_empty_input():
    ids, mask = pack([[1, 2, 3], [4]], max_len=8, pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.sum().item() == 4
    with pytest.raises(DataError, match="empty batch"):
        pack([], max_len=4)
    with pytest.raises(DataError, match="empty"):
        pack([[1], []], max_len=4)
