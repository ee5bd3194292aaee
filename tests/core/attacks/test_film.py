"""FILM (Gupta et al. 2022) as used in the SEB paper (Sec. 3.3, 5.1): candidate extraction from real
gradients of a tiny GPT-2 (subword and SEB), beam search and reordering against brute force on bigram
priors, and ROUGE scoring against hand-worked values."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.attacks.federated import client_gradient, pad_sequences
from core.attacks.film import (
    BigramPrior,
    HFPrior,
    beam_search,
    best_match,
    byte_bag,
    byte_coverage,
    candidate_precision,
    candidate_recall,
    film_recover,
    nonzero_rows,
    positional_byte_sets,
    relaxed_candidates,
    reorder,
    rouge_scores,
    seb_candidates,
    sequence_length_from_positions,
    subword_candidates,
)
from core.errors import ConfigError, DataError
from tests.core.attacks.test_federated import EOS, PAD, V, tiny_gpt2


def eos_batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Sentences of ``lengths`` tokens (the last one EOS), right-padded with PAD (never a text token)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.cat([torch.randint(0, PAD, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    ids, mask = pad_sequences(seqs, pad_id=PAD)
    return ids, mask, seqs


# --- step 1: candidates from a real embedding gradient ---------------------------------------------------------


def test_subword_candidates_are_exactly_the_batch_tokens() -> None:
    model = tiny_gpt2()
    ids, mask, seqs = eos_batch([7, 5, 11], seed=0)
    grad = client_gradient(model, ids, mask)
    cand = subword_candidates(grad["transformer.wte.weight"], exclude=[EOS])
    text = torch.cat([s[:-1] for s in seqs]).unique()
    assert torch.equal(cand, text)  # sorted, no EOS, no PAD: padding positions carry no gradient
    assert candidate_recall(cand, text) == 1.0 and candidate_precision(cand, text) == 1.0
    # The final EOS of each sentence is only a target, so its position row is zero too: the attacker
    # learns the number of text tokens of the longest sentence (11 tokens incl. EOS -> 10).
    assert sequence_length_from_positions(grad["transformer.wpe.weight"]) == 10
    assert int(mask.sum(1).max()) - 1 == 10


def test_nonzero_rows_and_candidate_metrics() -> None:
    g = torch.zeros(6, 2, 3)
    g[1, 0, 2], g[4, 1, 1], g[5, 0, 0] = 1.0, -0.5, 1e-9
    assert nonzero_rows(g).tolist() == [1, 4, 5]
    assert nonzero_rows(g, atol=1e-6).tolist() == [1, 4]
    assert candidate_recall([1, 2, 3], [3, 4]) == 0.5
    assert candidate_precision([1, 2, 3, 4], [3, 4, 4]) == 0.5
    assert candidate_precision([], [1]) == 0.0
    with pytest.raises(DataError):
        candidate_recall([1], [])
    with pytest.raises(DataError):
        sequence_length_from_positions(torch.zeros(4, 3))


# --- step 1 with SEB: bags of bytes --------------------------------------------------------------------------


def seb_model_and_grad(variant: str, lengths: list[int], seed: int):
    seb = pytest.importorskip("core.attacks.seb")
    mapping = seb.build_byte_mapping(V, n_bytes=4, byte_vocab=16, seed=0)  # (500, 4)
    model = tiny_gpt2()
    seb.install_seb(model, mapping, variant=variant, byte_dim=8, hidden=16, output="seb", byte_vocab=16)
    ids, mask, seqs = eos_batch(lengths, seed=seed)
    grad = client_gradient(model, ids, mask)
    weight = model.transformer.wte.byte_weight
    name = next(n for n, p in model.named_parameters() if p is weight)
    text = torch.cat([s[:-1] for s in seqs]).unique()
    return mapping, grad[name], text


@pytest.mark.parametrize("variant", ["ar", "co"])
def test_byte_bag_is_exactly_the_batch_bytes(variant: str) -> None:
    mapping, g, text = seb_model_and_grad(variant, [6, 4], seed=1)
    bag = byte_bag(g, n_bytes=4) if variant == "co" else byte_bag(g)
    expected = torch.zeros(16, dtype=torch.bool)
    expected[mapping[text].flatten()] = True
    assert torch.equal(bag, expected)
    cand = seb_candidates(mapping, bag)
    assert candidate_recall(cand, text) == 1.0
    assert cand.numel() >= text.numel()


def test_positional_sets_are_exact_for_seb_co() -> None:
    mapping, g, text = seb_model_and_grad("co", [4], seed=2)  # one sentence: 3 text tokens + EOS
    sets = positional_byte_sets(g, 4, 16)  # (4, 16)
    expected = torch.zeros(4, 16, dtype=torch.bool)
    for j in range(4):
        expected[j, mapping[text, j]] = True
    assert torch.equal(sets, expected)
    # A subword survives if its byte at every position j is in S_j: prod_j |S_j| <= 3**4 = 81 byte
    # sequences, of which ~ (81 - 3) * 497 / 16**4 ~= 0.6 are expected to be other subwords of the
    # 500-token mapping. The positional attacker is therefore exact only with high probability; with
    # this fixed seed there is no collision, and it is strictly sharper than the bag of bytes.
    cand = seb_candidates(mapping, sets)
    assert torch.equal(cand, text)
    assert seb_candidates(mapping, sets.any(0)).numel() > cand.numel()


def slow_seb_candidates(mapping: torch.Tensor, present: torch.Tensor) -> list[int]:
    out = []
    for v, row in enumerate(mapping.tolist()):
        if present.dim() == 1:
            ok = all(bool(present[b]) for b in row)
        else:
            ok = all(bool(present[j, b]) for j, b in enumerate(row))
        if ok:
            out.append(v)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_seb_candidates_match_a_python_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randint(0, 8, (300, 3), generator=gen)
    bag = torch.rand(8, generator=gen) < 0.6
    sets = torch.rand(3, 8, generator=gen) < 0.6
    assert seb_candidates(mapping, bag).tolist() == slow_seb_candidates(mapping, bag)
    assert seb_candidates(mapping, sets).tolist() == slow_seb_candidates(mapping, sets)
    assert 0 not in seb_candidates(mapping, torch.ones(8, dtype=torch.bool), exclude=[0]).tolist()


def test_seb_candidates_at_gpt2_size() -> None:  # speed is the attack benchmark's business, not a unit test's
    mapping = torch.randint(0, 256, (50257, 8), generator=torch.Generator().manual_seed(0))
    present = torch.rand(256, generator=torch.Generator().manual_seed(1)) < 0.9
    bag = seb_candidates(mapping, present)
    assert bag.tolist() == torch.nonzero(present[mapping].all(dim=1)).flatten().tolist()
    assert seb_candidates(mapping, torch.ones(8, 256, dtype=torch.bool)).numel() == 50257


def test_byte_bag_validation() -> None:
    with pytest.raises(DataError, match="n_bytes"):
        byte_bag(torch.ones(32, 3), byte_vocab=16)
    with pytest.raises(ConfigError, match="n_bytes"):
        byte_bag(torch.ones(30, 3), n_bytes=4)
    with pytest.raises(DataError, match="present"):
        seb_candidates(torch.zeros(5, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))


def test_relaxed_candidates() -> None:
    true = torch.tensor([5, 17, 999, 5])
    a = relaxed_candidates(true, 1000, n_random=100, seed=3)
    sampled = relaxed_candidates([], 1000, n_random=100, seed=3)
    assert torch.isin(torch.tensor([5, 17, 999]), a).all()
    overlap = int(torch.isin(torch.tensor([5, 17, 999]), sampled).sum())
    assert a.numel() == 100 + 3 - overlap and sampled.numel() == 100
    assert torch.equal(a, a.unique())  # sorted unique
    assert torch.equal(a, relaxed_candidates(true, 1000, n_random=100, seed=3))
    assert not torch.equal(a, relaxed_candidates(true, 1000, n_random=100, seed=4))
    b = relaxed_candidates(true, 1000, n_random=998, seed=0, exclude=[5, 7])
    assert 5 not in b.tolist() and 7 not in b.tolist() and b.numel() == 998
    with pytest.raises(ConfigError, match="n_random"):
        relaxed_candidates(true, 1000, n_random=999, exclude=[5, 7])


def test_byte_coverage_matches_brute_force() -> None:
    mapping = torch.randint(0, 8, (200, 3), generator=torch.Generator().manual_seed(0))
    cov = byte_coverage(mapping, [0, 3, 8], trials=5, seed=1, byte_vocab=8)
    assert cov[0] == {"only": 0.0, "any": 0.0}
    assert cov[8] == {"only": 200.0, "any": 200.0}
    gen = torch.Generator().manual_seed(1)  # replay the same draws in the same order
    expected = {}
    for k in (0, 3, 8):
        only = anyb = 0
        for _ in range(5):
            chosen = set(torch.randperm(8, generator=gen)[:k].tolist())
            only += sum(all(b in chosen for b in row) for row in mapping.tolist())
            anyb += sum(any(b in chosen for b in row) for row in mapping.tolist())
        expected[k] = {"only": only / 5, "any": anyb / 5}
    assert cov == expected


# --- priors ------------------------------------------------------------------------------------------------------


def test_hf_prior_matches_full_logits() -> None:
    model = tiny_gpt2(seed=1)
    prior = HFPrior(model, batch_size=2)
    assert prior.bos_id == EOS and prior.vocab_size == V
    ids = torch.cat([torch.full((3, 1), EOS), torch.randint(0, V, (3, 5))], dim=1)  # (3, 6)
    with torch.no_grad():
        full = model(input_ids=ids).logits.log_softmax(-1)  # (3, 6, V)
    torch.testing.assert_close(prior.next_log_probs(ids), full[:, -1], rtol=1e-5, atol=1e-5)
    expected = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).sum(1)
    torch.testing.assert_close(prior.sequence_log_prob(ids), expected, rtol=1e-5, atol=1e-5)
    stepwise = sum(prior.next_log_probs(ids[:, :t])[torch.arange(3), ids[:, t]] for t in range(1, 6))
    torch.testing.assert_close(prior.sequence_log_prob(ids), stepwise, rtol=1e-5, atol=1e-4)
    assert torch.equal(prior.sequence_log_prob(ids[:, :1]), torch.zeros(3))
    long = torch.randint(0, V, (1, 40))  # beyond n_positions=32: next_log_probs keeps the last 32 tokens
    torch.testing.assert_close(prior.next_log_probs(long), prior.next_log_probs(long[:, -32:]))
    with pytest.raises(ConfigError, match="context"):
        prior.sequence_log_prob(long)


# --- step 2: beam search -----------------------------------------------------------------------------------------

BOS6 = 5


def trap_prior() -> BigramPrior:
    """Tokens 0..3 are candidates, 4 is not, 5 is bos. Greedy takes 0 first (p=0.4) and is then stuck
    (p=0.05 per step); the best 4-token sequence over {0,1,2,3} is 1 2 3 0 (0.3 * 0.9**3)."""
    p = torch.tensor(
        [
            # 0     1     2     3     4     5       (next token)
            [0.05, 0.05, 0.05, 0.05, 0.78, 0.02],  # after 0
            [0.01, 0.01, 0.90, 0.01, 0.05, 0.02],  # after 1
            [0.01, 0.01, 0.01, 0.90, 0.05, 0.02],  # after 2
            [0.90, 0.01, 0.01, 0.01, 0.05, 0.02],  # after 3
            [1 / 6] * 6,  # after 4
            [0.40, 0.30, 0.04, 0.04, 0.20, 0.02],  # after bos
        ]
    )
    return BigramPrior(p.log(), bos_id=BOS6)


def brute_force(prior: BigramPrior, cand: list[int], length: int, penalty: float = 0.0, max_uses=None):
    out = []
    for seq in itertools.product(cand, repeat=length):
        if max_uses is not None and max(seq.count(t) for t in seq) > max_uses:
            continue
        reuses = length - len(set(seq))
        score = float(prior.sequence_log_prob(torch.tensor([[prior.bos_id, *seq]]))[0]) - penalty * reuses
        out.append((list(seq), score))
    return sorted(out, key=lambda x: -x[1])


def test_beam_search_finds_the_best_sequence_greedy_misses() -> None:
    prior, cand = trap_prior(), [0, 1, 2, 3]
    truth = brute_force(prior, cand, 4)
    assert truth[0][0] == [1, 2, 3, 0] and truth[0][1] > truth[1][1]  # unique optimum
    greedy = beam_search(prior, cand, length=4, beam_width=1)
    assert greedy[0][0][0] == 0 and greedy[0][0] != [1, 2, 3, 0]
    ((best, score),) = beam_search(prior, cand, length=4, beam_width=2)
    assert best == [1, 2, 3, 0]
    assert score == pytest.approx(truth[0][1], abs=1e-5)
    # the restriction is what keeps token 4 out: with it as a candidate, greedy goes bos -> 0 -> 4
    assert beam_search(prior, list(range(5)), length=4, beam_width=1)[0][0][:2] == [0, 4]


@pytest.mark.parametrize("seed", range(3))
def test_exhaustive_beam_equals_brute_force(seed: int) -> None:
    prior = BigramPrior.from_scores(torch.randn(7, 7, generator=torch.Generator().manual_seed(seed)) * 2, bos_id=6)
    cand = [0, 2, 3, 5]
    for penalty, max_uses in [(0.0, None), (1.5, None), (0.0, 1), (0.7, 2)]:
        truth = brute_force(prior, cand, 3, penalty, max_uses)
        got = beam_search(prior, cand, length=3, beam_width=16, n_return=5, repeat_penalty=penalty, max_uses=max_uses)
        assert [s for s, _ in got] == [s for s, _ in truth[:5]]
        assert [x for _, x in got] == pytest.approx([x for _, x in truth[:5]], abs=1e-5)


class RandomPrior:
    """A 50,257-token prior with fixed random next-token log-probs (for speed tests)."""

    vocab_size, bos_id = 50257, 50256

    def __init__(self) -> None:
        self.logp = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(0)).log_softmax(0)

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logp.expand(ids.shape[0], -1)

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logp[ids[:, 1:]].sum(1)


def test_beam_search_over_the_whole_gpt2_vocabulary() -> None:
    prior = RandomPrior()
    out = beam_search(prior, torch.arange(50256), length=12, beam_width=8, n_return=8, max_uses=1)
    assert len(out) == 8 and len({tuple(s) for s, _ in out}) == 8
    assert all(len(set(s)) == 12 for s, _ in out)  # max_uses=1: no token twice
    top = prior.logp[:50256].topk(12).indices.tolist()
    assert sorted(out[0][0]) == sorted(top)


def test_beam_search_validation() -> None:
    prior = trap_prior()
    with pytest.raises(ConfigError, match="candidates is empty"):
        beam_search(prior, [], length=3)
    with pytest.raises(ConfigError, match="length"):
        beam_search(prior, [0, 1], length=0)
    with pytest.raises(ConfigError, match="n_return"):
        beam_search(prior, [0, 1], length=2, beam_width=2, n_return=3)
    with pytest.raises(ConfigError, match="max_uses"):
        beam_search(prior, [0, 1], length=3, max_uses=1)


# --- step 3: reordering ------------------------------------------------------------------------------------------


def chain_prior(n: int) -> BigramPrior:
    """Tokens 0..n-1 and bos = n; strongly prefers bos 0 1 2 ... n-1."""
    scores = torch.zeros(n + 1, n + 1)
    scores[n, 0] = 6.0
    scores[torch.arange(n - 1), torch.arange(1, n)] = 6.0
    return BigramPrior.from_scores(scores, bos_id=n)


@pytest.mark.parametrize("shuffled", [[3, 4, 5, 0, 1, 2], [1, 0, 2, 3, 5, 4], [5, 0, 1, 2, 3, 4], [2, 3, 0, 1, 4, 5]])
def test_reorder_recovers_the_preferred_order(shuffled: list[int]) -> None:
    prior = chain_prior(6)
    tokens, score = reorder(prior, shuffled, max_passes=4, max_span=3)
    assert tokens == [0, 1, 2, 3, 4, 5]
    assert score == pytest.approx(float(prior.sequence_log_prob(torch.tensor([[6, 0, 1, 2, 3, 4, 5]]))[0]))


@pytest.mark.parametrize("seed", range(5))
def test_reorder_never_lowers_the_score(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    prior = BigramPrior.from_scores(torch.randn(9, 9, generator=gen) * 3, bos_id=8)
    tokens = torch.randint(0, 8, (7,), generator=gen).tolist()
    start = float(prior.sequence_log_prob(torch.tensor([[8, *tokens]]))[0])
    out, score = reorder(prior, tokens, max_passes=3, max_span=2)
    assert sorted(out) == sorted(tokens)
    assert score >= start
    assert score == pytest.approx(float(prior.sequence_log_prob(torch.tensor([[8, *out]]))[0]))
    assert reorder(prior, tokens, max_passes=0) == (tokens, pytest.approx(start))


def test_film_recover_end_to_end_on_a_bigram_prior() -> None:
    prior = chain_prior(6)
    out = film_recover(prior, [0, 1, 2, 3, 4, 5], length=6, n_sentences=3, beam_width=4, reorder_passes=2, max_uses=1)
    assert len(out) == 3 and out[0] == [0, 1, 2, 3, 4, 5]
    assert all(sorted(s) == [0, 1, 2, 3, 4, 5] for s in out)


# --- scoring -----------------------------------------------------------------------------------------------------


def test_rouge_scores_hand_worked() -> None:
    ref = "the cat sat on the mat"
    rec = "the cat on the mat sat"
    s = rouge_scores(rec, ref)
    # unigrams: both have {the:2, cat, sat, on, mat} -> 6/6 matched, F = 1
    # bigrams: ref {the cat, cat sat, sat on, on the, the mat}, rec {the cat, cat on, on the, the mat,
    #          mat sat}: 3 of 5 shared -> P = R = 3/5, F = 0.6
    # LCS: "the cat on the mat" = 5 tokens -> P = R = 5/6, F = 5/6
    assert s == pytest.approx({"rouge1": 1.0, "rouge2": 0.6, "rougeL": 5 / 6})
    # "the cat sat" vs ref: 3 matched unigrams, P = 1, R = 1/2 -> F = 2/3; bigrams P = 1, R = 2/5 -> F = 4/7
    assert rouge_scores("the cat sat", ref) == pytest.approx({"rouge1": 2 / 3, "rouge2": 4 / 7, "rougeL": 2 / 3})
    assert rouge_scores(ref, ref) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}


def test_best_match() -> None:
    originals = ["the cat sat on the mat", "a dog ran in the park"]
    recovered = ["dog park ran", "the cat sat on the mat"]
    m = best_match(recovered, originals)
    assert m["recovered"] == originals[0] and m["original"] == originals[0]
    assert m["rougeL"] == 1.0 and m["rouge1"] == 1.0
    second = max(rouge_scores(r, originals[1])["rougeL"] for r in recovered)
    assert m["mean_rougeL_over_originals"] == pytest.approx((1.0 + second) / 2)
    with pytest.raises(DataError):
        best_match([], originals)
