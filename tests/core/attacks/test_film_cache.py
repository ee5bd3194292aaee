"""The KV-cached prior paths of FILM (beam search and reordering) against the uncached references."""

from __future__ import annotations

import pytest
import torch

from core.attacks.film import _score, _span_moves, beam_search, reorder
from core.attacks.priors import CachedPrior, CompactPrior, HFPrior
from core.attacks.vocab import CompactVocab
from core.stip.models import tiny_llama
from tests.core.attacks.test_federated import EOS, V, tiny_gpt2


def make_prior(name: str) -> HFPrior | CompactPrior:
    """A tiny GPT-2, a tiny Llama (rotary positions, grouped-query attention) or a Llama over a compact vocabulary."""
    if name == "gpt2":
        return HFPrior(tiny_gpt2(seed=2))
    if name == "llama":
        return HFPrior(tiny_llama(vocab=V, seed=3), bos_id=EOS)
    compact = CompactVocab(list(range(0, V, 3)), full_size=V, unk_full=EOS)
    return CompactPrior(tiny_llama(vocab=compact.size, seed=4), compact, bos_id=EOS)


@pytest.mark.parametrize("name", ["gpt2", "llama", "compact"])
def test_cached_beam_search_equals_the_uncached_reference(name: str) -> None:
    prior = make_prior(name)
    assert isinstance(prior, CachedPrior)
    cand = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:40]
    kw = {"length": 9, "beam_width": 6, "n_return": 6, "repeat_penalty": 1.5, "max_uses": 2}
    fast = beam_search(prior, cand, use_cache=True, **kw)
    slow = beam_search(prior, cand, use_cache=False, **kw)
    assert [t for t, _ in fast] == [t for t, _ in slow]
    fast_s, slow_s = torch.tensor([s for _, s in fast]), torch.tensor([s for _, s in slow])
    torch.testing.assert_close(fast_s, slow_s, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama", "compact"])
def test_cached_variant_scores_equal_full_scoring(name: str) -> None:
    prior = make_prior(name)
    # distinct ids the compact vocabulary knows (multiples of 3): no two orderings tie on the score
    base = (3 * torch.randperm(V // 3 - 1, generator=torch.Generator().manual_seed(1))[:7]).tolist()
    moves = [list(m) for m in _span_moves(base, 3)] + [base]
    torch.testing.assert_close(prior.score_variants(base, moves, chunk=5), _score(prior, moves, 7), atol=1e-3, rtol=0)
    fast = reorder(prior, base[::-1], max_passes=2, use_cache=True)
    slow = reorder(prior, base[::-1], max_passes=2, use_cache=False)
    assert fast[0] == slow[0] and fast[1] == pytest.approx(slow[1], abs=1e-3)


def test_cover_makes_every_beam_use_every_candidate() -> None:
    from core.attacks.priors import BigramPrior
    from core.errors import ConfigError

    scores = torch.zeros(5, 5)
    scores[:, 1] = 5.0  # the prior wants token 1 everywhere
    prior = BigramPrior.from_scores(scores, bos_id=4)
    assert beam_search(prior, [0, 1, 2], length=3, beam_width=4)[0][0] == [1, 1, 1]
    for tokens, _ in beam_search(prior, [0, 1, 2], length=4, beam_width=4, n_return=4, cover=True):
        assert {0, 1, 2} <= set(tokens)
    with pytest.raises(ConfigError, match="cover needs at most"):
        beam_search(prior, [0, 1, 2], length=2, cover=True)


def test_cover_ranks_beams_by_future_cost_from_the_first_pass() -> None:
    """The true sentence 0 1 2 3 starts with an unlikely token: a plain beam search drops it at the first step and
    ends elsewhere; the second pass ranks beams with the future cost of the tokens they left and finds it."""
    from core.attacks.priors import BigramPrior

    s = torch.zeros(5, 5)
    s[4, 0], s[4, 1], s[4, 2], s[4, 3] = -4.0, 2.0, 2.0, 2.0  # from bos (4): the true first token is unlikely
    s[0, 1] = s[1, 2] = s[2, 3] = 8.0  # then the chain is near-certain
    s[3, 2] = 10.0  # and 0 after 3 unlikely
    prior = BigramPrior.from_scores(s, bos_id=4)
    truth = float(prior.sequence_log_prob(torch.tensor([[4, 0, 1, 2, 3]]))[0])
    [(plain, plain_score)] = beam_search(prior, [0, 1, 2, 3], length=4, beam_width=2, cover=True, cover_passes=1)
    [(best, score)] = beam_search(prior, [0, 1, 2, 3], length=4, beam_width=2, cover=True, cover_passes=2)
    assert plain != [0, 1, 2, 3] and plain_score < truth
    assert best == [0, 1, 2, 3] and score == pytest.approx(truth, abs=1e-5)
