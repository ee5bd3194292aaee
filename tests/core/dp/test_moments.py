"""Gaussian moment propagation (core.dp.moments) vs Monte Carlo: eq. 5.5, 5.6, App. D, LayerNorm, softmax.

Monte Carlo tolerances: see :mod:`tests.core.dp.montecarlo`.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.dp.moments import (
    GaussianMoments,
    add_moments,
    attention_moments,
    embedding_moments,
    layer_norm_linear_moments,
    layer_norm_moments,
    linear_moments,
    logit_variance,
    relu_moments,
    softmax_moments,
)
from core.errors import ConfigError
from tests.core.dp.montecarlo import F64, N_MC
from tests.core.dp.montecarlo import gen as _gen
from tests.core.dp.montecarlo import randn as _randn

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
    torch.testing.assert_close(out.mean, y.mean(dim=0), rtol=0, atol=5 * float(y.std(dim=0).max()) / math.sqrt(N_MC))


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
    y = torch.nn.functional.layer_norm(mu + var.sqrt() * _randn(N_MC, 4, d, gen=gen), (d,), weight, bias, 1e-5)
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


def _slow_layer_norm_linear_var(x: GaussianMoments, weight, weight_var, ln_weight, ln_bias, eps) -> torch.Tensor:
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
    ln_out = ln_weight * centred / expected_feature_var.sqrt() + ln_bias  # E[LN(x)], shrunk by the noise
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
    out = layer_norm_linear_moments(x, weight, weight_var=1e-3, ln_weight=ln_weight, ln_bias=ln_bias, eps=1e-5)
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
    independent = linear_moments(layer_norm_moments(x, weight=ln_weight, bias=ln_bias), weight, weight_var=1e-3)
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
    value = GaussianMoments(_randn(2, length, dv, gen=gen), torch.rand(2, length, dv, generator=gen, dtype=F64) * 0.02)
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


def _relu_moments_reference(x: GaussianMoments) -> GaussianMoments:
    """Lemma D.2 term by term, as written (the slow, obviously correct form :func:`relu_moments` must equal)."""
    c, d = x.mean.to(F64), x.full_var().to(F64)
    sd = d.sqrt()
    noisy = sd > 0
    a = torch.where(noisy, c / torch.where(noisy, sd, torch.ones_like(sd)), torch.zeros_like(c))
    cdf, cdf_neg = torch.special.ndtr(a), torch.special.ndtr(-a)
    pdf = torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    mean = torch.where(noisy, c * cdf + sd * pdf, c.clamp_min(0))
    unit_var = cdf + a * a * cdf * cdf_neg + a * pdf * (cdf_neg - cdf) - pdf * pdf
    var = torch.where(noisy, d * unit_var.clamp_min(0), torch.zeros_like(d))
    return GaussianMoments(mean.to(x.mean.dtype), var.to(x.mean.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("some_exact", [False, True])
def test_relu_moments_equal_the_term_by_term_lemma(dtype: torch.dtype, some_exact: bool) -> None:
    gen = _gen(11)
    mean = (torch.randn(6, 50, 64, generator=gen, dtype=F64) * 3).to(dtype)
    var = (torch.rand(6, 50, 64, generator=gen, dtype=F64) ** 4 * 2).to(dtype)  # many tiny: |a| up to ~1e3
    if some_exact:
        var[0, :10] = 0.0
    x = GaussianMoments(mean, var.clone())
    fast, slow = relu_moments(x), _relu_moments_reference(x)
    assert torch.equal(x.var, var)  # the input is left as it was
    tol = {"rtol": 1e-12, "atol": 1e-15} if dtype == F64 else {"rtol": 1e-6, "atol": 1e-12}
    torch.testing.assert_close(fast.mean, slow.mean, **tol)
    torch.testing.assert_close(fast.var, slow.var, **tol)
    iso = relu_moments(GaussianMoments(mean, var[..., :1]))  # an isotropic (broadcast) variance
    torch.testing.assert_close(iso.var, _relu_moments_reference(GaussianMoments(mean, var[..., :1])).var, **tol)


def test_linear_moments_with_a_scalar_weight_variance_equal_the_full_matrix() -> None:
    gen = _gen(12)
    x = GaussianMoments(torch.randn(4, 7, 16, generator=gen, dtype=F64), torch.rand(4, 7, 16, generator=gen, dtype=F64))
    weight = torch.randn(24, 16, generator=gen, dtype=F64)
    bias = {"bias": torch.ones(24, dtype=F64), "bias_var": 0.1}
    scalar = linear_moments(x, weight, weight_var=0.37, **bias)
    full = linear_moments(x, weight, weight_var=torch.full_like(weight, 0.37), **bias)
    torch.testing.assert_close(scalar.mean, full.mean, rtol=1e-14, atol=0)
    torch.testing.assert_close(scalar.var, full.var, rtol=1e-13, atol=0)
