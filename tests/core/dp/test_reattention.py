"""Re-Attention (paper Sec. 5): effective error, moment propagation vs Monte Carlo, score correction.

Monte Carlo tolerances: a sample variance over n draws has relative sd sqrt((kurtosis - 1) / n);
with n = 40_000 and kurtosis <= 9 (products of Gaussians) that is <= 1.4%, so the 6% bands used for
exact formulas are >= 4 sd. First-order (delta-method) formulas get wider, stated bands. All seeds
are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.dp.reattention import (
    GaussianMoments,
    KeyPropagation,
    ReAttention,
    ScoreCorrection,
    add_moments,
    attention_moments,
    block_error_variance,
    embedding_error_variance,
    embedding_moments,
    layer_norm_linear_moments,
    layer_norm_moments,
    linear_moments,
    logit_variance,
    reattention_correction,
    relu_moments,
    softmax_moments,
    token_presence_frequency,
)
from core.errors import ConfigError, DataError

F64 = torch.float64
N_MC = 40_000


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


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
    assert block_error_variance(noise_multiplier=sigma, clip_norm=clip, batch_size=batch) == pytest.approx(
        0.01
    )
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
# propagation vs Monte Carlo (eq. 5.5, 5.6, App. D, our LayerNorm / softmax derivations)
# ==================================================================================================


def test_linear_moments_match_monte_carlo() -> None:
    """Eq. 5.5 summed over the input: exact for independent X and W (band 6% = 4+ sd)."""
    gen = _gen(1)
    mu_x, var_x = _randn(3, 6, gen=gen), torch.rand(3, 6, generator=gen, dtype=F64) * 0.5
    weight, bias = _randn(4, 6, gen=gen), _randn(4, gen=gen)
    w_var, b_var = 0.2, 0.05
    out = linear_moments(GaussianMoments(mu_x, var_x), weight, weight_var=w_var, bias=bias, bias_var=b_var)
    x = mu_x + var_x.sqrt() * _randn(N_MC, 3, 6, gen=gen)
    w = weight + math.sqrt(w_var) * _randn(N_MC, 4, 6, gen=gen)
    b = bias + math.sqrt(b_var) * _randn(N_MC, 4, gen=gen)
    y = torch.einsum("nbi,noi->nbo", x, w) + b[:, None, :]
    torch.testing.assert_close(out.var, y.var(dim=0), rtol=0.06, atol=0)
    torch.testing.assert_close(
        out.mean, y.mean(dim=0), rtol=0, atol=5 * float(y.std(dim=0).max()) / math.sqrt(N_MC)
    )


def test_linear_moments_exact_cases() -> None:
    gen = _gen(2)
    mu, var, weight = _randn(5, 3, gen=gen), torch.rand(5, 3, generator=gen, dtype=F64), _randn(2, 3, gen=gen)
    out = linear_moments(GaussianMoments(mu, var), weight, weight_var=0.0)
    torch.testing.assert_close(out.var, var @ weight.T.pow(2))  # deterministic weight: Var = sum W^2 v
    # scalar (broadcast) input variance == expanded, and tensor weight_var == scalar
    iso = linear_moments(GaussianMoments(mu, torch.tensor([0.3], dtype=F64)), weight, weight_var=0.1)
    full = linear_moments(
        GaussianMoments(mu, torch.full_like(mu, 0.3)), weight, weight_var=torch.full_like(weight, 0.1)
    )
    torch.testing.assert_close(iso.var, full.var)


@pytest.mark.parametrize(("std", "published"), [(1.0, 0.3408), (0.1, 0.0034), (0.01, 3.40e-5)])
def test_relu_moments_reproduce_paper_table_3(std: float, published: float) -> None:
    """App. D, Table 3 'Analytic' column: Var[ReLU(X)], X ~ N(0, std^2) (the table's N(0, s) uses the
    std), = (1/2 - 1/(2 pi)) std^2. Printed to 2-4 significant digits."""
    out = relu_moments(GaussianMoments(torch.zeros(1, dtype=F64), torch.tensor([std**2], dtype=F64)))
    assert float(out.var) == pytest.approx(published, rel=0.01)
    assert float(out.var) == pytest.approx((0.5 - 0.5 / math.pi) * std**2, rel=1e-12)
    assert float(out.mean) == pytest.approx(std / math.sqrt(2 * math.pi), rel=1e-12)


def test_relu_moments_match_monte_carlo_and_edge_cases() -> None:
    gen = _gen(3)
    mean = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], dtype=F64)
    var = torch.tensor([1.0, 0.3, 2.0, 0.5, 0.2], dtype=F64)
    out = relu_moments(GaussianMoments(mean, var))
    y = torch.relu(mean + var.sqrt() * _randn(N_MC, 5, gen=gen))
    torch.testing.assert_close(out.var, y.var(dim=0), rtol=0.06, atol=0)
    torch.testing.assert_close(out.mean, y.mean(dim=0), rtol=0, atol=0.02)  # 5 sd of the MC mean
    # no noise: relu of the mean; far from the kink: the identity (var kept, no cancellation)
    flat = relu_moments(GaussianMoments(torch.tensor([-1.0, 2.0], dtype=F64), torch.zeros(2, dtype=F64)))
    assert flat.mean.tolist() == [0.0, 2.0] and flat.var.tolist() == [0.0, 0.0]
    far = relu_moments(GaussianMoments(torch.tensor([1e3, -1e3]), torch.tensor([1e-6, 1e-6])))
    assert float(far.var[0]) == pytest.approx(1e-6, rel=1e-4) and float(far.var[1]) == 0.0


def test_layer_norm_moments_match_monte_carlo() -> None:
    """First-order formula; input noise variance <= 1% of the feature spread, so the neglected terms
    are O(1%); band 6%."""
    gen = _gen(4)
    d = 16
    mu = _randn(4, d, gen=gen) * torch.tensor([0.5, 1.0, 2.0, 1.0], dtype=F64)[:, None]
    var = torch.rand(4, d, generator=gen, dtype=F64) * 0.0025 * mu.var(dim=-1, keepdim=True)
    weight, bias = torch.rand(d, generator=gen, dtype=F64) + 0.5, _randn(d, gen=gen)
    out = layer_norm_moments(GaussianMoments(mu, var), weight=weight, bias=bias, eps=1e-5)
    y = torch.nn.functional.layer_norm(
        mu + var.sqrt() * _randn(N_MC, 4, d, gen=gen), (d,), weight, bias, 1e-5
    )
    torch.testing.assert_close(out.var, y.var(dim=0), rtol=0.06, atol=0)
    torch.testing.assert_close(out.mean, y.mean(dim=0), rtol=0, atol=0.01)


def test_layer_norm_moments_stay_accurate_for_large_isotropic_noise() -> None:
    """The expected-feature-variance denominator keeps the total output variance within 10% even when
    the noise variance equals the feature variance (the plain delta method is off by 2-10x there)."""
    gen = _gen(5)
    d = 16
    mu = _randn(3, d, gen=gen)
    var = mu.var(dim=-1, unbiased=False, keepdim=True).expand(3, d).clone()
    out = layer_norm_moments(GaussianMoments(mu, var), eps=1e-5)
    y = torch.nn.functional.layer_norm(mu + var.sqrt() * _randn(N_MC, 3, d, gen=gen), (d,), eps=1e-5)
    torch.testing.assert_close(out.var.sum(-1), y.var(dim=0).sum(-1), rtol=0.10, atol=0)


def _slow_layer_norm_linear_var(
    x: GaussianMoments, weight, weight_var, ln_weight, ln_bias, eps
) -> torch.Tensor:
    """Reference: materialise the (d, d) LN Jacobian per token and the full output covariance."""
    mu, v = x.mean, x.full_var()
    d = mu.shape[-1]
    centred = mu - mu.mean(-1, keepdim=True)
    feature_var = centred.pow(2).mean(-1, keepdim=True) + eps
    xhat = centred / feature_var.sqrt()
    expected_feature_var = feature_var + v.mean(-1, keepdim=True) * (d - 1) / d
    projector = torch.eye(d, dtype=mu.dtype) - 1 / d - xhat[..., :, None] * xhat[..., None, :] / d
    jac = ln_weight[:, None] * projector / expected_feature_var.sqrt()[..., None]  # (..., d, d)
    cov = jac @ torch.diag_embed(v) @ jac.transpose(-1, -2)
    from_input = torch.einsum("kd,...de,ke->...k", weight, cov, weight)
    ln_out = torch.nn.functional.layer_norm(mu, (d,), ln_weight, ln_bias, eps)
    second_moment = torch.diagonal(cov, dim1=-2, dim2=-1) + ln_out.pow(2)
    return from_input + weight_var * second_moment.sum(-1, keepdim=True)


def test_layer_norm_linear_moments_fast_path_matches_full_covariance_and_monte_carlo() -> None:
    gen = _gen(12)
    d, d_out = 12, 5
    mu = _randn(3, 4, d, gen=gen)
    var = torch.rand(3, 4, d, generator=gen, dtype=F64) * 0.01
    weight, ln_weight, ln_bias = (
        _randn(d_out, d, gen=gen),
        torch.rand(d, generator=gen, dtype=F64) + 0.5,
        _randn(d, gen=gen),
    )
    x = GaussianMoments(mu, var)
    out = layer_norm_linear_moments(
        x, weight, weight_var=1e-3, ln_weight=ln_weight, ln_bias=ln_bias, eps=1e-5
    )
    reference = _slow_layer_norm_linear_var(x, weight, 1e-3, ln_weight, ln_bias, 1e-5)
    torch.testing.assert_close(out.var, reference, rtol=1e-9, atol=1e-12)
    # Monte Carlo (first order; noise <= 1% of the feature spread): band 6%
    noisy = torch.nn.functional.layer_norm(
        mu + var.sqrt() * _randn(N_MC, 3, 4, d, gen=gen), (d,), ln_weight, ln_bias, 1e-5
    )
    noisy_w = weight + math.sqrt(1e-3) * _randn(N_MC, d_out, d, gen=gen)
    y = torch.einsum("nbld,nkd->nblk", noisy, noisy_w)
    torch.testing.assert_close(out.var, y.var(dim=0), rtol=0.06, atol=0)
    # ignoring LN's output correlations is measurably worse here
    independent = linear_moments(
        layer_norm_moments(x, weight=ln_weight, bias=ln_bias), weight, weight_var=1e-3
    )
    err_fused = ((out.var - y.var(0)).abs() / y.var(0)).max()
    err_independent = ((independent.var - y.var(0)).abs() / y.var(0)).max()
    assert err_fused < err_independent


def test_softmax_moments_match_monte_carlo() -> None:
    """First order in the logit noise (variances <= 0.02): band 8%."""
    gen = _gen(6)
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.5], [0.1, 0.0, -0.2, 0.3]], dtype=F64)
    logit_var = torch.tensor([[0.01, 0.01, 0.02, 0.02], [0.02, 0.01, 0.005, 0.02]], dtype=F64)
    out = softmax_moments(logits, logit_var)
    a = torch.softmax(logits + logit_var.sqrt() * _randn(N_MC, 2, 4, gen=gen), dim=-1)
    torch.testing.assert_close(out.var, a.var(dim=0), rtol=0.08, atol=0)
    torch.testing.assert_close(out.mean, a.mean(dim=0), rtol=0, atol=0.005)
    masked = softmax_moments(torch.tensor([0.0, -math.inf]), torch.tensor([0.1, 0.1]))
    assert masked.mean.tolist() == [1.0, 0.0] and masked.var.tolist() == [0.0, 0.0]


def test_attention_moments_match_monte_carlo() -> None:
    gen = _gen(7)
    length, dv = 5, 3
    logits = _randn(2, length, length, gen=gen)
    logit_var = torch.rand(2, length, length, generator=gen, dtype=F64) * 0.02
    value = GaussianMoments(
        _randn(2, length, dv, gen=gen), torch.rand(2, length, dv, generator=gen, dtype=F64) * 0.02
    )
    out = attention_moments(torch.softmax(logits, -1), logit_var, value)
    noisy_logits = logits + logit_var.sqrt() * _randn(N_MC, 2, length, length, gen=gen)
    noisy_value = value.mean + value.var.sqrt() * _randn(N_MC, 2, length, dv, gen=gen)
    o = torch.softmax(noisy_logits, -1) @ noisy_value
    torch.testing.assert_close(out.var, o.var(dim=0), rtol=0.08, atol=0)  # first order, small noise


def test_logit_variance_matches_monte_carlo() -> None:
    """Var[<q, K>/sqrt(d_h)] for K ~ N(k, s^2 I): exactly |q|^2 s^2 / d_h (Gaussian; band 6%)."""
    gen = _gen(8)
    d_h = 8
    query, key = _randn(3, d_h, gen=gen), _randn(4, d_h, gen=gen)
    key_var = torch.tensor([0.0, 0.1, 0.5, 2.0], dtype=F64)
    keys = key + key_var.sqrt()[:, None] * _randn(N_MC, 4, d_h, gen=gen)
    logits = torch.einsum("qd,nkd->nqk", query, keys) / math.sqrt(d_h)
    expected = logit_variance(query, key_var)
    assert expected.shape == (3, 4)
    torch.testing.assert_close(expected[:, 1:], logits.var(dim=0)[:, 1:], rtol=0.06, atol=0)
    assert bool((expected[:, 0] == 0).all())


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


def test_add_and_embedding_moments() -> None:
    weight = torch.arange(12, dtype=F64).reshape(4, 3)
    row_var = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=F64)
    m = embedding_moments(torch.tensor([[3, 1]]), weight, row_var, scale=2.0)
    torch.testing.assert_close(m.mean, 2 * weight[[3, 1]][None])
    torch.testing.assert_close(m.full_var(), torch.tensor([[[12.0] * 3, [4.0] * 3]], dtype=F64))
    s = add_moments(m, GaussianMoments(torch.ones(2, 3, dtype=F64), torch.tensor([0.5], dtype=F64)))
    torch.testing.assert_close(s.scalar_var(), torch.tensor([[12.5, 4.5]], dtype=F64))
    with pytest.raises(ConfigError, match="broadcast"):
        GaussianMoments(torch.zeros(2, 3), torch.zeros(4))


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
    torch.testing.assert_close(
        correction.key_var, torch.tensor([[0.0, 0.01, 0.5, 2.0], [2.0, 2.0, 0.01, 0.0]])
    )
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
    key_var = ReAttention(item_var, propagation=with_pos, padding_idx=None).key_variance(
        torch.tensor([[0, 2, 4]])
    )
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


def _transformer(seed: int):
    from core.models.seqrec import SeqRecConfig, TransformerSeqRec

    torch.manual_seed(seed)
    cfg = SeqRecConfig(num_items=6, max_len=5, d_model=8, n_heads=2, n_layers=2, dropout=0.0)
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
