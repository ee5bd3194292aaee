"""Re-Attention (paper Sec. 5): effective error, key propagation vs Monte Carlo, score correction.

Monte Carlo tolerances: see :mod:`tests.core.dp.montecarlo`.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.dp import moments
from core.dp.reattention import (
    KeyPropagation,
    ReAttention,
    ScoreCorrection,
    block_error_variance,
    embedding_error_variance,
    reattention_correction,
    token_presence_frequency,
)
from core.errors import ConfigError, DataError
from tests.core.dp.montecarlo import F64
from tests.core.dp.montecarlo import gen as _gen
from tests.core.dp.montecarlo import randn as _randn

# ==================================================================================================
# error instantiation (Claims 5.3, 5.4, App. C)
# ==================================================================================================


def test_token_presence_frequency_counts_sequences_not_occurrences() -> None:
    sequences = torch.tensor([[0, 1, 1, 2], [0, 0, 2, 3], [3, 3, 3, 3]])
    p = token_presence_frequency(sequences, num_embeddings=5)
    # token 1: seq 0 only (twice there) -> 1/3; token 2: seqs 0, 1; token 3: seqs 1, 2; token 4: none
    torch.testing.assert_close(p, torch.tensor([0.0, 1 / 3, 2 / 3, 2 / 3, 0.0]))
    with pytest.raises(DataError, match="token ids"):
        token_presence_frequency(sequences, num_embeddings=3)


def test_effective_batch_size_is_b_times_p() -> None:
    """Eq. C.3: E[# sequences of an i.i.d. batch containing token i] = B p_i. Simulated with 4000
    batches of B = 32 (sd of the mean count <= sqrt(32 * 0.25 / 4000) = 0.045; band 0.2)."""
    gen = _gen(0)
    data = torch.randint(1, 20, (500, 6), generator=gen) ** 2 % 20  # skewed token distribution
    p = token_presence_frequency(data, num_embeddings=20)
    batches = data[torch.randint(0, 500, (4000, 32), generator=gen)]  # (4000, 32, 6)
    for token in (1, 4, 9):
        contains = (batches == token).any(dim=-1).sum(dim=-1).double()  # per batch
        assert float(contains.mean()) == pytest.approx(32 * float(p[token]), abs=0.2)


def test_claims_5_3_and_5_4() -> None:
    sigma, clip, batch = 2.0, 0.5, 10.0
    # Claim 5.3: sigma_eff = sigma C / B = 0.1 -> variance 0.01
    assert block_error_variance(noise_multiplier=sigma, clip_norm=clip, batch_size=batch) == pytest.approx(0.01)
    # Claim 5.4: sigma_eff = sigma C / (B p_i): p = 0.5 -> 0.2, p = 0.1 -> 1.0, p = 1 -> 0.1 (= block)
    p = torch.tensor([0.0, 0.5, 0.1, 1.0])
    var = embedding_error_variance(noise_multiplier=sigma, clip_norm=clip, batch_size=batch, frequencies=p)
    torch.testing.assert_close(var, torch.tensor([0.0, 0.04, 1.0, 0.01]))
    # paper's setting C = 1 (Sec. 6): sigma / (B p_i)
    var = embedding_error_variance(noise_multiplier=1.0, clip_norm=1.0, batch_size=4.0, frequencies=p)
    torch.testing.assert_close(var, torch.tensor([0.0, 0.25, 6.25, 0.0625]))


def test_embedding_error_variance_rejects_unseen_tokens_unless_floored() -> None:
    p = torch.tensor([0.0, 0.5, 0.0])
    with pytest.raises(DataError, match="min_frequency"):
        embedding_error_variance(noise_multiplier=1.0, clip_norm=1.0, batch_size=10.0, frequencies=p)
    var = embedding_error_variance(
        noise_multiplier=1.0, clip_norm=1.0, batch_size=10.0, frequencies=p, min_frequency=0.01
    )
    torch.testing.assert_close(var, torch.tensor([0.0, 0.04, 100.0]))
    with pytest.raises(ConfigError, match="batch_size"):
        embedding_error_variance(noise_multiplier=1.0, clip_norm=1.0, batch_size=0.0, frequencies=p)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        block_error_variance(noise_multiplier=-1.0, clip_norm=1.0, batch_size=1.0)
    with pytest.raises(DataError, match="frequencies"):
        embedding_error_variance(noise_multiplier=1.0, clip_norm=1.0, batch_size=1.0, frequencies=p + 2)


# ==================================================================================================
# key propagation to the first attention layer (KeyPropagation)
# ==================================================================================================


def test_key_propagation_matches_monte_carlo_of_the_first_layer() -> None:
    """Token + position embeddings with per-row noise, pre-LN, then W_K with weight noise: compare the
    scalar key variance per position with a simulation of all the DP noise. n = 20_000: sample
    variances have relative sd ~1%; LN is first order with noise <= 1% of the feature spread; band 5%."""
    gen = _gen(9)
    vocab, d, d_k, length = 6, 16, 8, 4
    item_emb = _randn(vocab, d, gen=gen)
    item_var = torch.tensor([0.0, 1e-4, 1e-3, 4e-3, 1e-2, 2e-3], dtype=F64)
    pos_emb, pos_var = _randn(length, d, gen=gen) * 0.5, 1e-4
    ln_w, ln_b = torch.rand(d, generator=gen, dtype=F64) + 0.5, _randn(d, gen=gen) * 0.1
    key_w, key_w_var = _randn(d_k, d, gen=gen) / math.sqrt(d), 1e-4
    prop = KeyPropagation(
        item_embedding=item_emb,
        key_weight=key_w,
        key_weight_var=key_w_var,
        position_embedding=pos_emb,
        position_error_var=pos_var,
        layer_norm=(ln_w, ln_b, 1e-5),
    )
    ids = torch.tensor([[1, 2, 3, 4], [5, 5, 2, 1]])
    expected = prop.key_variance(ids, item_var)
    assert expected.shape == (2, length)

    n = 20_000
    noisy_items = item_emb + item_var.sqrt()[:, None] * _randn(n, vocab, d, gen=gen)
    noisy_pos = pos_emb + math.sqrt(pos_var) * _randn(n, length, d, gen=gen)
    noisy_w = key_w + math.sqrt(key_w_var) * _randn(n, d_k, d, gen=gen)
    x = noisy_items[:, ids] + noisy_pos[:, None]  # (n, B, L, d)
    x = torch.nn.functional.layer_norm(x, (d,), ln_w, ln_b, 1e-5)
    keys = torch.einsum("nbld,nkd->nblk", x, noisy_w)
    simulated = keys.var(dim=0).mean(dim=-1)  # scalar key variance per position
    torch.testing.assert_close(expected, simulated, rtol=0.05, atol=0)
    # rare tokens (larger item variance) get noisier keys, all else equal
    rare_first = prop.key_variance(torch.tensor([[4, 1]]), item_var)
    assert float(rare_first[0, 0]) > float(rare_first[0, 1])


def test_moment_primitives_are_re_exported_from_reattention() -> None:
    """core.dp.moments was split out of this module; the old import path must keep working."""
    from core.dp import reattention

    for name in moments.__all__:
        assert getattr(reattention, name) is getattr(moments, name), name
        assert name in reattention.__all__, name


# ==================================================================================================
# the correction (eq. 5.2 and Re-Attention)
# ==================================================================================================


def _noisy_attention_setup(n: int = 20_000):
    """Fixed query q (|q|^2 = 2) and 4 clean keys with <q, k_j> = mu_j; the last two are 'tail' keys
    with large per-coordinate noise variance (Figure 4). Returns (q, mu, key_var, noisy logits (n, 4))."""
    gen = _gen(10)
    d = 8
    q = _randn(d, gen=gen)
    q = q / q.norm() * math.sqrt(2.0)
    mu = torch.tensor([2.0, 1.5, -1.0, -1.5], dtype=F64)
    key_var = torch.tensor([0.01, 0.01, 0.5, 1.0], dtype=F64)
    orth = _randn(4, d, gen=gen)
    orth = orth - (orth @ q)[:, None] * q / q.dot(q)
    clean_keys = mu[:, None] * q / q.dot(q) + orth
    noisy_keys = clean_keys + key_var.sqrt()[:, None] * _randn(n, 4, d, gen=gen)
    return q, mu, key_var, noisy_keys @ q


def test_eq_5_2_noise_inflates_expected_scores_and_correction_removes_it() -> None:
    """E[exp <q, K_j>] = exp(<q, k_j>) exp(C sigma_j^2 / 2), C = <q, q> (eq. 5.2); after the correction
    E[exp(corrected logit)] = exp(<q, k_j>). The MC mean of a lognormal with log-variance s^2 has
    relative sd sqrt((e^{s^2} - 1)/n) (<= 1.8% here, s^2 <= 2); bands are 5 sd per key."""
    q, mu, key_var, logits = _noisy_attention_setup()
    n = logits.shape[0]
    c = float(q.dot(q))
    s2 = c * key_var
    rel_sd = torch.sqrt(torch.expm1(s2) / n)
    inflation = logits.exp().mean(dim=0) / mu.exp()
    torch.testing.assert_close(inflation, torch.exp(s2 / 2), rtol=0, atol=float(5 * rel_sd.max() * 2.72))
    assert float(inflation[3]) > 2.5  # the noisiest key's expected score is ~e times too large

    corrected = reattention_correction(logits[:, None, :], key_var.expand(n, 4), scale=c)[:, 0]
    ratio = corrected.exp().mean(dim=0) / mu.exp()
    assert bool(((ratio - 1).abs() < 5 * rel_sd).all()), ratio


def test_correction_brings_normalised_attention_back_to_clean() -> None:
    q, mu, key_var, logits = _noisy_attention_setup()
    n = logits.shape[0]
    clean = torch.softmax(mu, dim=-1)
    noisy = torch.softmax(logits, dim=-1).mean(dim=0)
    correction = ScoreCorrection(key_var.expand(n, 4), scale=float(q.dot(q)))
    corrected = torch.softmax(correction(logits[:, None, :])[:, 0], dim=-1).mean(dim=0)
    # attention distraction: the tail keys draw more than their clean share (Figure 4, middle)
    assert bool((noisy[2:] > 1.3 * clean[2:]).all())
    # Re-Attention: much closer to the clean attention in total variation (0.073 -> 0.004 here)
    tv_noisy, tv_corrected = (noisy - clean).abs().sum() / 2, (corrected - clean).abs().sum() / 2
    assert tv_corrected < 0.2 * tv_noisy
    # ratio of expectations, E[S_j] / sum_k E[S_k], is unbiased up to MC error (~1%)
    scores = correction(logits[:, None, :])[:, 0].exp().mean(dim=0)
    torch.testing.assert_close(scores / scores.sum(), clean, rtol=0.05, atol=0)


def test_reattention_end_to_end_api() -> None:
    item_var = torch.tensor([0.0, 0.01, 0.5, 2.0])
    ids = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0]])
    re_attention = ReAttention(item_var, scale=0.5)
    correction = re_attention.for_batch(ids)
    assert isinstance(correction, ScoreCorrection)
    torch.testing.assert_close(correction.key_var, torch.tensor([[0.0, 0.01, 0.5, 2.0], [2.0, 2.0, 0.01, 0.0]]))
    logits = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))  # (B, H, L, L)
    logits[:, :, :, 0] = -math.inf  # a masked key column
    before = logits.clone()
    out = correction(logits)
    assert torch.equal(logits, before)  # pure function
    expected = before - 0.5 * correction.key_var[:, None, None, :] / 2
    torch.testing.assert_close(out, expected)
    assert bool(torch.isneginf(out[:, :, :, 0]).all())
    # per-query scale from the queries: C = |q|^2 / d_h
    query = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out_q = correction(before, query=query)
    c = query.detach().pow(2).sum(-1, keepdim=True) / 16
    torch.testing.assert_close(out_q, before - c * correction.key_var[:, None, None, :] / 2)
    assert not out_q.requires_grad  # the correction is not trained through


def test_correction_is_invariant_to_a_common_key_variance() -> None:
    """Softmax is shift invariant: adding the same variance to every key changes nothing."""
    logits = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(2))
    key_var = torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.3, 1.0]])
    a = torch.softmax(reattention_correction(logits, key_var, scale=1.5), dim=-1)
    b = torch.softmax(reattention_correction(logits, key_var + 0.7, scale=1.5), dim=-1)
    torch.testing.assert_close(a, b)


def test_reattention_with_key_propagation_and_padding() -> None:
    gen = _gen(11)
    item_emb = torch.randn(5, 8, generator=gen)
    item_var = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])
    prop = KeyPropagation(item_embedding=item_emb, key_weight=torch.eye(8), key_weight_var=0.0)
    key_var = ReAttention(item_var, propagation=prop).key_variance(torch.tensor([[0, 2, 4]]))
    # identity W_K, no weight noise: key variance = embedding variance, padding forced to 0
    torch.testing.assert_close(key_var, torch.tensor([[0.0, 0.2, 0.4]]))
    with_pos = KeyPropagation(
        item_embedding=item_emb,
        key_weight=torch.eye(8),
        key_weight_var=0.0,
        position_embedding=torch.zeros(3, 8),
        position_error_var=0.05,
    )
    key_var = ReAttention(item_var, propagation=with_pos, padding_idx=None).key_variance(torch.tensor([[0, 2, 4]]))
    torch.testing.assert_close(key_var, torch.tensor([[0.05, 0.25, 0.45]]))
    with pytest.raises(DataError, match="exceeds"):
        ReAttention(item_var, propagation=with_pos).key_variance(torch.tensor([[1, 1, 1, 1]]))


def test_reattention_validation() -> None:
    item_var = torch.tensor([0.0, 0.1])
    with pytest.raises(ConfigError, match="query"):
        ReAttention(item_var).for_batch(torch.tensor([[1, 1]]))(torch.zeros(1, 2, 2))
    with pytest.raises(DataError, match="input_ids"):
        ReAttention(item_var, scale=1.0).for_batch(torch.tensor([[1, 2]]))
    with pytest.raises(DataError, match="item_error_var"):
        ReAttention(torch.tensor([0.0, -1.0]), scale=1.0)
    with pytest.raises(ConfigError, match="scale"):
        ReAttention(item_var, scale=-1.0)
    with pytest.raises(ConfigError, match="key_var"):
        reattention_correction(torch.zeros(2, 3, 3), torch.zeros(2, 4), scale=1.0)
    with pytest.raises(ConfigError, match="key_weight"):
        KeyPropagation(item_embedding=torch.zeros(3, 4), key_weight=torch.zeros(2, 5), key_weight_var=0.0)


def test_position_alignment_and_per_row_position_variance() -> None:
    item_emb = torch.zeros(3, 4)
    positions = torch.arange(5, dtype=torch.float32)[:, None].expand(5, 4).contiguous()  # row r = r
    pos_var = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4])
    ids = torch.tensor([[1, 2]])
    kwargs = {"item_embedding": item_emb, "key_weight": torch.eye(4), "key_weight_var": 0.0}
    left = KeyPropagation(**kwargs, position_embedding=positions, position_error_var=pos_var)
    right = KeyPropagation(
        **kwargs, position_embedding=positions, position_error_var=pos_var, position_alignment="right"
    )
    zero = torch.zeros(3)
    torch.testing.assert_close(left.key_moments(ids, zero).mean[0, :, 0], torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(right.key_moments(ids, zero).mean[0, :, 0], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(right.key_variance(ids, zero), torch.tensor([[0.3, 0.4]]))
    with pytest.raises(ConfigError, match="'left', 'right'"):
        KeyPropagation(**kwargs, position_alignment="centre")
    with pytest.raises(ConfigError, match="position_error_var"):
        KeyPropagation(**kwargs, position_embedding=positions, position_error_var=torch.zeros(4))


def _transformer(seed: int, norm_first: bool = True):
    from core.models.seqrec import SeqRecConfig, TransformerSeqRec

    torch.manual_seed(seed)
    cfg = SeqRecConfig(num_items=6, max_len=5, d_model=8, n_heads=2, n_layers=2, dropout=0.0, norm_first=norm_first)
    return TransformerSeqRec(cfg).eval()


def _propagation_for(model, *, v_block: float) -> KeyPropagation:
    """The wiring documented in KeyPropagation's docstring for TransformerSeqRec."""
    block = model.blocks[0]
    return KeyPropagation(
        item_embedding=model.item_emb.weight.detach(),
        key_weight=block.attn.k_proj.weight.detach(),
        key_bias=block.attn.k_proj.bias.detach(),
        key_weight_var=v_block,
        key_bias_var=v_block,
        position_embedding=model.pos_emb.weight.detach(),
        position_error_var=v_block,
        position_alignment="right",
        layer_norm=(block.ln_attn.weight.detach(), block.ln_attn.bias.detach(), block.ln_attn.eps),
    )


def test_wiring_into_transformer_seqrec() -> None:
    """ReAttention plugs into core.models' attention (called with query=) and, with all variances 0,
    leaves the model's output unchanged; with noise it changes the attention."""
    model = _transformer(0)
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 5, 6]])
    zero = ReAttention(torch.zeros(7), propagation=_propagation_for(model, v_block=0.0)).for_batch(ids)
    with torch.no_grad():
        plain = model(ids)
        torch.testing.assert_close(model(ids, score_correction=zero), plain)
        item_var = torch.tensor([0.0, 0.01, 0.5, 0.02, 1.0, 0.01, 0.3])
        noisy = ReAttention(item_var, propagation=_propagation_for(model, v_block=1e-4)).for_batch(ids)
        assert not torch.allclose(model(ids, score_correction=noisy), plain)


def test_key_variance_matches_monte_carlo_of_transformer_seqrec_keys() -> None:
    """Perturb the real model's item/position embeddings and first key projection with the assumed
    DP noise and compare the variance of its first-layer keys k_proj(ln_attn(E[ids] + P[pos])) with
    the propagated key variance (20k draws: ~1% sd; noise <= 1% of the feature spread; band 6%)."""
    model = _transformer(1)
    block = model.blocks[0]
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 5, 6]])
    item_var = torch.tensor([0.0, 1e-4, 2e-3, 5e-4, 2.5e-3, 1e-4, 1e-3])
    v_block = 1e-4
    expected = ReAttention(item_var, propagation=_propagation_for(model, v_block=v_block)).key_variance(ids)

    n, gen = 20_000, _gen(13)
    emb, pos = (
        model.item_emb.weight.detach().double(),
        model.pos_emb.weight.detach().double()[1:],
    )  # rows 1..4
    w, b = block.attn.k_proj.weight.detach().double(), block.attn.k_proj.bias.detach().double()
    noisy_emb = emb + item_var.double().sqrt()[:, None] * _randn(n, *emb.shape, gen=gen)
    noisy_pos = pos + math.sqrt(v_block) * _randn(n, *pos.shape, gen=gen)
    noisy_w = w + math.sqrt(v_block) * _randn(n, *w.shape, gen=gen)
    noisy_b = b + math.sqrt(v_block) * _randn(n, *b.shape, gen=gen)
    x = noisy_emb[:, ids] + noisy_pos[:, None]  # (n, B, L, d)
    ln = block.ln_attn
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), ln.weight.double(), ln.bias.double(), ln.eps)
    keys = torch.einsum("nbld,nkd->nblk", x, noisy_w) + noisy_b[:, None, None, :]
    simulated = keys.var(dim=0).mean(dim=-1).float()
    real = ids != 0
    torch.testing.assert_close(expected[real], simulated[real], rtol=0.06, atol=0)
    assert bool((expected[~real] == 0).all())
