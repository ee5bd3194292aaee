"""Gaussian noise on summed clipped gradients: distribution, in-place semantics, dtype/device, refusal."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import kstest

from core.dp.noise import NOISE_SOURCES, add_gaussian_noise_, noise_source, privatize_grads_
from core.errors import ConfigError, PrivacyError


def _param(*shape: int, dtype: torch.dtype = torch.float32, grad: torch.Tensor | None = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))
    p.grad = grad
    return p


def test_noise_std_is_sigma_times_clip_norm() -> None:
    """n = 100_000 draws of N(0, s^2), s = 1.3 * 0.7 = 0.91. The sample std has relative sd
    1/sqrt(2n) = 0.22%, so a 1.5% band is ~7 sd; the sample mean has sd s/sqrt(n) = 0.0029, band
    5 sd. KS against N(0, s^2): with a fixed seed this is deterministic; p > 1e-3 guards the shape."""
    sigma, clip = 1.3, 0.7
    p = _param(100_000, grad=torch.zeros(100_000))
    add_gaussian_noise_([p], noise_multiplier=sigma, clip_norm=clip, generator=torch.Generator().manual_seed(0))
    noise = p.grad.double()
    std = sigma * clip
    assert float(noise.std()) == pytest.approx(std, rel=0.015)
    assert abs(float(noise.mean())) < 5 * std / math.sqrt(noise.numel())
    assert kstest(noise.numpy() / std, "norm").pvalue > 1e-3


def test_noise_is_added_to_existing_grads_in_place_and_independent() -> None:
    """The correlation of two independent 50k-vectors has sd 1/sqrt(50k) = 0.0045; band 5 sd."""
    base_a, base_b = torch.randn(50_000), torch.randn(50_000)
    a, b = _param(50_000, grad=base_a.clone()), _param(50_000, grad=base_b.clone())
    grad_a = a.grad
    add_gaussian_noise_([a, b], noise_multiplier=2.0, clip_norm=1.0, generator=torch.Generator().manual_seed(1))
    assert a.grad is grad_a  # in place
    noise_a, noise_b = a.grad - base_a, b.grad - base_b
    assert float(noise_a.std()) == pytest.approx(2.0, rel=0.02)  # relative sd 0.32%
    corr = torch.corrcoef(torch.stack([noise_a, noise_b]))[0, 1]
    assert abs(float(corr)) < 5 / math.sqrt(50_000)


def test_zero_noise_multiplier_adds_nothing() -> None:
    grad = torch.randn(4, 3)
    p = _param(4, 3, grad=grad.clone())
    add_gaussian_noise_([p], noise_multiplier=0.0, clip_norm=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(p.grad, grad)
    q = _param(2, 2)
    add_gaussian_noise_([q], noise_multiplier=0.0, clip_norm=1.0, generator=None)
    assert torch.equal(q.grad, torch.zeros(2, 2))


def test_none_grad_gets_noise_only_grad() -> None:
    p = _param(20_000)
    assert p.grad is None
    add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=0.5, generator=torch.Generator().manual_seed(2))
    assert p.grad is not None and p.grad.shape == p.shape
    assert float(p.grad.std()) == pytest.approx(0.5, rel=0.03)  # relative sd 0.5%; band 6 sd


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_and_device_preserved(dtype: torch.dtype) -> None:
    p = _param(64, 8, dtype=dtype, grad=torch.zeros(64, 8, dtype=dtype))
    none_grad = _param(3, dtype=dtype)
    add_gaussian_noise_([p, none_grad], noise_multiplier=1.0, clip_norm=1.0, generator=torch.Generator().manual_seed(0))
    for param in (p, none_grad):
        assert param.grad.dtype == dtype and param.grad.device == param.device
        assert bool(torch.isfinite(param.grad).all())
    assert float(p.grad.float().abs().sum()) > 0


def test_same_seed_same_noise() -> None:
    def run(seed: int) -> torch.Tensor:
        p = _param(100, grad=torch.zeros(100))
        add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=1.0, generator=torch.Generator().manual_seed(seed))
        return p.grad

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_grads_are_refused_before_any_noise(bad: float) -> None:
    clean = torch.randn(5)
    ok = _param(5, grad=clean.clone())
    broken_grad = torch.randn(3, 3)
    broken_grad[1, 2] = bad
    broken = _param(3, 3, grad=broken_grad)
    with pytest.raises(PrivacyError, match=r"parameter #1 \(shape \(3, 3\)\)"):
        add_gaussian_noise_([ok, broken], noise_multiplier=1.0, clip_norm=1.0, generator=None)
    assert torch.equal(ok.grad, clean)  # nothing was released


def test_privatize_is_noise_then_divide_by_expected_batch_size() -> None:
    summed = torch.randn(10, 4)
    reference = _param(10, 4, grad=summed.clone())
    add_gaussian_noise_([reference], noise_multiplier=1.2, clip_norm=0.8, generator=torch.Generator().manual_seed(7))
    p = _param(10, 4, grad=summed.clone())
    privatize_grads_(
        [p],
        noise_multiplier=1.2,
        clip_norm=0.8,
        expected_batch_size=12.5,
        generator=torch.Generator().manual_seed(7),
    )
    torch.testing.assert_close(p.grad, reference.grad / 12.5)


def test_privatize_on_empty_batch_is_pure_scaled_noise() -> None:
    """Empty Poisson batch: no grads at all; the step must still release N(0, (sigma C)^2) / (q N)."""
    p = _param(40_000)
    privatize_grads_([p], noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=4.0, generator=None)
    assert float(p.grad.std()) == pytest.approx(0.25, rel=0.03)  # relative sd 0.35%


def test_accepts_generators_of_params() -> None:
    model = torch.nn.Linear(3, 2)
    privatize_grads_(
        (q for q in model.parameters()),
        noise_multiplier=1.0,
        clip_norm=1.0,
        expected_batch_size=2,
        generator=None,
    )
    assert all(q.grad is not None for q in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generator_on_another_device_is_refused() -> None:
    p = _param(3, grad=torch.zeros(3)).cuda()
    p.grad = torch.zeros(3, device="cuda")
    with pytest.raises(ConfigError, match="generator"):
        add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=1.0, generator=torch.Generator())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"noise_multiplier": -0.1, "clip_norm": 1.0, "expected_batch_size": 1.0}, "noise_multiplier"),
        ({"noise_multiplier": math.nan, "clip_norm": 1.0, "expected_batch_size": 1.0}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "clip_norm": 0.0, "expected_batch_size": 1.0}, "clip_norm"),
        ({"noise_multiplier": 1.0, "clip_norm": math.inf, "expected_batch_size": 1.0}, "clip_norm"),
        ({"noise_multiplier": 1.0, "clip_norm": 1.0, "expected_batch_size": 0.0}, "expected_batch_size"),
    ],
)
def test_invalid_arguments(kwargs: dict, name: str) -> None:
    p = _param(2, grad=torch.zeros(2))
    with pytest.raises(ConfigError, match=name):
        privatize_grads_([p], generator=None, **kwargs)
    assert torch.equal(p.grad, torch.zeros(2))


def test_keyword_only() -> None:
    with pytest.raises(TypeError):
        add_gaussian_noise_([_param(1)], 1.0, 1.0, None)  # type: ignore[misc]


def test_secure_mode_noise_is_gaussian_with_std_sigma_times_clip_norm() -> None:
    """Secure mode (Opacus's four-sample sum): same distribution as the seeded path, bands as above; the KS
    p-value is random here (no seed), so its floor is 1e-6 (a false failure once in a million runs)."""
    sigma, clip = 1.3, 0.7
    p = _param(100_000, grad=torch.zeros(100_000))
    add_gaussian_noise_([p], noise_multiplier=sigma, clip_norm=clip, generator=None, secure_mode=True)
    noise, std = p.grad.double(), sigma * clip
    assert float(noise.std()) == pytest.approx(std, rel=0.015)
    assert abs(float(noise.mean())) < 5 * std / math.sqrt(noise.numel())
    assert kstest(noise.numpy() / std, "norm").pvalue > 1e-6


def test_secure_mode_ignores_every_seed() -> None:
    """What a rerun with the recorded seed does (torch's global seed, the same call) does not regenerate it."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        p = _param(64, grad=torch.zeros(64))
        privatize_grads_(
            [p], noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=1.0, generator=None, secure_mode=True
        )
        draws.append(p.grad.clone())
    assert not torch.equal(draws[0], draws[1])
    seeded = []
    for _ in range(2):  # the seeded path, by contrast, is a function of its seed
        p = _param(64, grad=torch.zeros(64))
        add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=1.0, generator=torch.Generator().manual_seed(3))
        seeded.append(p.grad.clone())
    assert torch.equal(seeded[0], seeded[1])


def test_secure_mode_refuses_a_generator_and_keeps_dtype() -> None:
    p = _param(8, dtype=torch.float64, grad=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ConfigError, match="pass generator=None"):
        add_gaussian_noise_(
            [p], noise_multiplier=1.0, clip_norm=1.0, generator=torch.Generator().manual_seed(0), secure_mode=True
        )
    with pytest.raises(ConfigError, match="secure_mode must be a bool"):
        add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=1.0, generator=None, secure_mode=1)
    q = _param(8, dtype=torch.bfloat16)  # no grad: a noise-only gradient, in the parameter's dtype
    add_gaussian_noise_([q], noise_multiplier=1.0, clip_norm=1.0, generator=None, secure_mode=True)
    assert q.grad.dtype == torch.bfloat16 and bool(q.grad.ne(0).any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_secure_mode_draws_on_the_parameters_device() -> None:
    p = torch.nn.Parameter(torch.zeros(10_000, device="cuda"))
    p.grad = torch.zeros(10_000, device="cuda")
    add_gaussian_noise_([p], noise_multiplier=2.0, clip_norm=1.0, generator=None, secure_mode=True)
    assert p.grad.device.type == "cuda" and float(p.grad.std()) == pytest.approx(2.0, rel=0.05)


def test_noise_sources_name_the_regenerable_one() -> None:
    assert "seed kept secret" in noise_source(False) and noise_source(True).startswith("secure")
    assert set(NOISE_SOURCES) == {"seeded", "secure"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_generator_on_the_current_cuda_device_is_that_device() -> None:
    p = torch.nn.Parameter(torch.zeros(1000, device="cuda:0"))  # reports cuda:0; the generator reports cuda
    p.grad = torch.zeros(1000, device="cuda:0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    add_gaussian_noise_([p], noise_multiplier=1.0, clip_norm=1.0, generator=gen)
    assert float(p.grad.std()) == pytest.approx(1.0, rel=0.15)
