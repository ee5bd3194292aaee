"""Causal LMs with subword / SEB embeddings: perplexity against a slow per-token reference, training lowers the
loss, the FILM-relevant gradient pattern of an untied subword embedding, embedding parameter counts against a hand
count at a compact and at GPT-2's whole vocabulary, a whole-vocabulary LM's loss against a slow cross-entropy over
its full table, and input validation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from core.attacks.lm import (
    EMBEDDINGS,
    EmbeddingParams,
    Plateau,
    build_causal_lm,
    count_parameters,
    embedding_parameter_count,
    embedding_parameters,
    lm_labels,
    perplexity,
    train_lm,
)
from core.attacks.seb import SEBEmbedding, build_byte_mapping
from core.errors import ConfigError, DataError
from core.models.gpt2 import GPT2_VOCAB

V = 40
TINY = {"n_layer": 1, "n_embd": 32, "n_head": 4, "n_positions": 32, "hidden": 64, "byte_dim": 16}


def tiny(embedding: str = "subword", **kw):
    mapping = None if embedding == "subword" else build_byte_mapping(V, n_bytes=4, byte_vocab=16)
    return build_causal_lm(V, embedding=embedding, mapping=mapping, **(TINY | kw))


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (5, 12), generator=g)
    mask = torch.ones(5, 12, dtype=torch.bool)
    mask[0, 8:] = False  # right padding
    mask[1, :4] = False  # left padding
    mask[2, 2:] = False  # a single prediction
    return ids, mask


@torch.no_grad()
def slow_perplexity(model, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """One forward pass per predicted token on the prefix only; both the input and the target must be real."""
    nll, count = 0.0, 0
    for i in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[i, t] and mask[i, t - 1]:
                logits = model(input_ids=ids[i : i + 1, :t], attention_mask=mask[i : i + 1, :t].long()).logits
                nll -= F.log_softmax(logits[0, -1].double(), -1)[ids[i, t]].item()
                count += 1
    return math.exp(nll / count)


@pytest.mark.parametrize("embedding", ["subword", "seb_co"])
def test_perplexity_matches_slow_reference(embedding: str) -> None:
    model = tiny(embedding).eval()
    ids, mask = padded_batch()
    fast = perplexity(model, ids, mask, batch_size=2)
    assert fast == pytest.approx(slow_perplexity(model, ids, mask), rel=1e-5)


def test_labels_mask_padding_and_first_real_token() -> None:
    ids = torch.tensor([[7, 8, 9, 1]])
    mask = torch.tensor([[False, True, True, False]])
    assert lm_labels(ids, mask).tolist() == [[-100, -100, 9, -100]]


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_training_lowers_loss_on_repetitive_corpus(embedding: str) -> None:
    pattern = torch.arange(10) * 3 % V
    ids = pattern.repeat(16, 2)[:, :16].roll(1, dims=1)  # (16, 16) shifted copies of one cycle
    ids = torch.stack([ids[i].roll(i) for i in range(16)])
    mask = torch.ones_like(ids, dtype=torch.bool)
    model = tiny(embedding)
    before = perplexity(model, ids, mask)
    stats = train_lm(model, ids, mask, steps=60, batch_size=8, lr=3e-3, warmup=5, seed=1)
    after = perplexity(model, ids, mask)
    assert stats["steps"] == 60 and stats["seconds"] > 0
    assert after < before / 4, (before, after, stats)


def test_training_is_reproducible_per_seed() -> None:
    ids, mask = padded_batch()
    a, b = tiny(), tiny()
    ra = train_lm(a, ids, mask, steps=5, batch_size=2, lr=1e-3, seed=3)
    rb = train_lm(b, ids, mask, steps=5, batch_size=2, lr=1e-3, seed=3)
    assert ra["train_loss"] == rb["train_loss"]


def test_max_seconds_stops_early() -> None:
    ids, mask = padded_batch()
    assert train_lm(tiny(), ids, mask, steps=10_000, batch_size=2, lr=1e-3, max_seconds=0.0)["steps"] == 1


def test_untied_subword_gradient_rows_are_the_batch_tokens() -> None:
    model = tiny()
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    ids = torch.tensor([[3, 5, 7, 3, 11, 13]])
    model(input_ids=ids, labels=ids).loss.backward()
    rows = torch.nonzero(model.get_input_embeddings().weight.grad.abs().sum(1)).flatten().tolist()
    assert rows == [3, 5, 7, 11]  # the last token (13) feeds no loss term under causal attention


def test_parameter_counts() -> None:
    untied, tied = tiny(), tiny(tie_subword=True)
    assert embedding_parameter_count(untied) == 2 * V * 32
    assert embedding_parameter_count(tied) == V * 32
    assert count_parameters(untied) - count_parameters(tied) == V * 32
    seb = tiny("seb_co")
    emb = seb.get_input_embeddings()
    assert isinstance(emb, SEBEmbedding) and emb.variant == "co"
    assert embedding_parameter_count(seb) == 2 * emb.embedding_parameter_count()
    assert embedding_parameter_count(tiny("seb_co", output="tied")) == emb.embedding_parameter_count()


# the utility LMs' build at a tiny shape: both arms tie the output layer to the input embedding
D, N_BYTES, BYTE_VOCAB, HIDDEN = 8, 4, 32, 16
UTILITY = {"n_layer": 1, "n_embd": D, "n_head": 2, "n_positions": 16, "hidden": HIDDEN, "byte_dim": 4}


def utility_lm(embedding: str, vocab_size: int, **kw):
    mapping = None if embedding == "subword" else build_byte_mapping(vocab_size, n_bytes=N_BYTES, byte_vocab=BYTE_VOCAB)
    tied = {"output": "tied", "tie_subword": True}
    return build_causal_lm(vocab_size, embedding=embedding, mapping=mapping, **(UTILITY | tied | kw))


# SEB_co by hand: w1 (n*V_b, hidden) + b1 (hidden,) + fc2 (hidden -> d) weight and bias; no V anywhere
SEB_CO_BY_HAND = N_BYTES * BYTE_VOCAB * HIDDEN + HIDDEN + HIDDEN * D + D  # 2048 + 16 + 128 + 8 = 2200


@pytest.mark.parametrize("vocab_size", [40, GPT2_VOCAB], ids=["compact", "full"])
def test_embedding_parameters_match_a_hand_count(vocab_size: int) -> None:
    sub, seb = utility_lm("subword", vocab_size), utility_lm("seb_co", vocab_size)
    assert embedding_parameters(sub) == EmbeddingParams(input=vocab_size * D, output_untied=0, vocab_size=vocab_size)
    assert embedding_parameters(seb) == EmbeddingParams(input=SEB_CO_BY_HAND, output_untied=0, vocab_size=vocab_size)
    assert embedding_parameter_count(sub) == vocab_size * D and embedding_parameter_count(seb) == SEB_CO_BY_HAND
    # the paper's relation holds at the whole vocabulary only: 40 x 8 = 320 < 2200 < 50,257 x 8 = 402,056
    assert (SEB_CO_BY_HAND < vocab_size * D) == (vocab_size == GPT2_VOCAB)
    # an untied head is counted as the output layer's own parameters
    untied = embedding_parameters(utility_lm("subword", vocab_size, tie_subword=False))
    assert (untied.input, untied.output_untied, untied.total) == (vocab_size * D, vocab_size * D, 2 * vocab_size * D)
    two = embedding_parameters(utility_lm("seb_co", vocab_size, output="seb"))
    assert (two.input, two.output_untied) == (SEB_CO_BY_HAND, SEB_CO_BY_HAND)


@torch.no_grad()
def slow_full_table_loss(model, ids: torch.Tensor) -> float:
    """Mean next-token NLL, one token at a time, with logits = last hidden state x the whole output table: the
    subword arm's ``wte`` rows, or the SEB arm's embedding of every id computed one id at a time by its forward."""
    emb = model.get_input_embeddings()
    if isinstance(emb, SEBEmbedding):
        table = torch.cat([emb(torch.arange(i, min(i + 4096, emb.vocab_size))) for i in range(0, emb.vocab_size, 4096)])
    else:
        table = emb.weight
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # (B, T, d), after ln_f
    nll, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            logits = table.double() @ hidden[b, t].double()  # (V,)
            nll += float(torch.logsumexp(logits, 0) - logits[ids[b, t + 1]])
            count += 1
    return nll / count


@pytest.mark.parametrize("embedding", ["subword", "seb_co"])
def test_a_whole_vocabulary_lm_scores_every_id_and_its_loss_matches_a_slow_reference(embedding: str) -> None:
    model = utility_lm(embedding, GPT2_VOCAB).eval()
    ids = torch.tensor([[50256, 464, 3290, 50255, 13], [0, 1, 50000, 50256, 262]])  # ids near both ends
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 5, GPT2_VOCAB)
    assert out.loss.item() == pytest.approx(slow_full_table_loss(model, ids), rel=1e-5)
    full_ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, GPT2_VOCAB), ids[:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx(full_ce.item(), rel=1e-6)


def test_perplexity_splits_batches_whose_logits_exceed_the_budget() -> None:
    model = utility_lm("seb_co", GPT2_VOCAB).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, GPT2_VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    one_row = perplexity(model, ids, mask, max_logits=6 * GPT2_VOCAB)  # one sequence per forward pass
    assert one_row == pytest.approx(perplexity(model, ids, mask), rel=1e-5)
    assert one_row == pytest.approx(slow_perplexity(model, ids, mask), rel=1e-5)
    with pytest.raises(ConfigError, match="max_logits=0"):
        perplexity(model, ids, mask, max_logits=0)


def test_empty_or_malformed_data_raise() -> None:
    model = tiny()
    empty = torch.zeros(0, 8, dtype=torch.long)
    with pytest.raises(DataError, match=r"\(0, 8\)"):
        train_lm(model, empty, empty.bool(), steps=1, batch_size=1, lr=1e-3)
    ids, mask = padded_batch()
    with pytest.raises(DataError, match="no next-token prediction"):
        perplexity(model, ids, torch.zeros_like(mask))
    with pytest.raises(DataError, match="bool"):
        perplexity(model, ids, mask.long())
    with pytest.raises(ConfigError, match="lr"):
        train_lm(model, ids, mask, steps=1, batch_size=1, lr=0.0)


def test_bad_build_arguments_raise() -> None:
    with pytest.raises(ConfigError, match="'bytes'.*subword"):
        build_causal_lm(V, embedding="bytes")
    with pytest.raises(ConfigError, match=r"needs a subword->bytes mapping.*build_byte_mapping\(40\)"):
        build_causal_lm(V, embedding="seb_cr")


def test_plateau_stops_at_the_best_validation_perplexity_and_restores_it() -> None:
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, V, (4, 16), generator=g)  # 4 random sequences: memorised, so validation gets worse
    val = torch.randint(0, V, (8, 16), generator=g)
    ones = torch.ones_like(val, dtype=torch.bool)
    model = tiny()
    plateau = Plateau(val, ones, every=10, patience=2)
    fit = train_lm(
        model, train, torch.ones_like(train, dtype=torch.bool), steps=2000, batch_size=4, lr=1e-2, plateau=plateau
    )
    steps = [s for s, _ in fit["val_curve"]]
    assert fit["plateaued"] and fit["steps"] < 2000 and steps == list(range(10, fit["steps"] + 1, 10))
    best = min(fit["val_curve"], key=lambda c: c[1])
    assert (fit["best_step"], fit["val_perplexity"]) == best
    assert fit["steps"] == best[0] + 2 * 10  # two measurements without improvement after the best
    assert perplexity(model, val, ones) == pytest.approx(fit["val_perplexity"], rel=1e-6)  # the best state is back


def test_plateau_without_patience_spent_runs_every_step() -> None:
    ids, mask = padded_batch()
    fit = train_lm(tiny(), ids, mask, steps=7, batch_size=2, lr=1e-4, plateau=Plateau(ids, mask, every=5, patience=50))
    assert fit["steps"] == 7 and not fit["plateaued"]
    assert [s for s, _ in fit["val_curve"]] == [5, 7]  # the last step is always measured


def test_no_patience_trains_the_whole_budget_and_keeps_the_best_measurement() -> None:
    """``patience=None`` (a fixed step budget, Fairseq's checkpoint_best): on the memorising case above, where
    validation gets worse, training still runs every step and the model is left at its best measurement."""
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, V, (4, 16), generator=g)
    val = torch.randint(0, V, (8, 16), generator=g)
    ones = torch.ones_like(val, dtype=torch.bool)
    model = tiny()
    fit = train_lm(
        model,
        train,
        torch.ones_like(train, dtype=torch.bool),
        steps=200,
        batch_size=4,
        lr=1e-2,
        plateau=Plateau(val, ones, every=10, patience=None),
    )
    assert fit["steps"] == 200 and not fit["plateaued"]
    assert [s for s, _ in fit["val_curve"]] == list(range(10, 201, 10))
    best = min(fit["val_curve"], key=lambda c: c[1])
    assert best[0] < 200  # validation got worse after its best: the case where keeping the best matters
    assert (fit["best_step"], fit["val_perplexity"]) == best
    assert perplexity(model, val, ones) == pytest.approx(fit["val_perplexity"], rel=1e-6)


@pytest.mark.parametrize("bad", [{"every": 0}, {"patience": 0}, {"min_delta": -0.1}])
def test_plateau_rejects_bad_settings(bad: dict) -> None:
    ids, mask = padded_batch()
    with pytest.raises(ConfigError, match="plateau needs"):
        Plateau(ids, mask, **({"every": 5, "patience": 2} | bad))
