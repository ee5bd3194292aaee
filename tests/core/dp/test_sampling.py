"""Poisson sampling: inclusion rate, independence, variable/empty batches, determinism, validation."""

from __future__ import annotations

import math

import pytest
import torch

from core.dp.sampling import poisson_batches, sample_rate_for
from core.errors import ConfigError


def _inclusion_matrix(n: int, q: float, steps: int, seed: int) -> torch.Tensor:
    """(steps, n) bool: row t marks the examples in batch t."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.zeros(steps, n, dtype=torch.bool)
    for t, batch in enumerate(poisson_batches(n, sample_rate=q, steps=steps, generator=gen)):
        rows[t, batch] = True
    return rows


def test_batches_are_sorted_unique_long_indices() -> None:
    gen = torch.Generator().manual_seed(0)
    batches = list(poisson_batches(50, sample_rate=0.3, steps=20, generator=gen))
    assert len(batches) == 20
    for batch in batches:
        assert batch.dtype == torch.long and batch.dim() == 1
        assert torch.equal(batch, torch.unique(batch))  # sorted, no duplicates
        assert batch.numel() == 0 or (int(batch.min()) >= 0 and int(batch.max()) < 50)
    assert len({b.numel() for b in batches}) > 1  # variable batch size


def test_inclusion_rate_matches_q() -> None:
    """Total inclusions ~ Binomial(n * steps, q): mean 10000, sd sqrt(200000 * 0.05 * 0.95) = 97.5.
    A 5-sd band fails with probability < 1e-6 (and the seed is fixed)."""
    n, q, steps = 1000, 0.05, 200
    rows = _inclusion_matrix(n, q, steps, seed=1)
    mean, sd = n * steps * q, math.sqrt(n * steps * q * (1 - q))
    assert abs(int(rows.sum()) - mean) < 5 * sd
    # batch sizes are Binomial(n, q): sample variance ~ n q (1 - q) = 47.5 (not a fixed size);
    # the sample variance over 200 steps has relative sd ~ sqrt(2/199) = 0.10, so allow +-40%
    sizes = rows.sum(dim=1).double()
    assert 0.6 * n * q * (1 - q) < float(sizes.var()) < 1.4 * n * q * (1 - q)
    # no example is favoured: per-example counts ~ Binomial(200, 0.05) (mean 10, sd 3.1), and
    # P(any of the 1000 counts >= 32) <= 1000 * P(Bin >= 32) = 7e-6
    counts = rows.sum(dim=0)
    assert int(counts.max()) < 32


def test_inclusions_independent_across_steps_and_examples() -> None:
    """Joint inclusions in consecutive steps ~ Binomial(n (steps-1), q^2): mean 497.5, sd 22.3;
    same for neighbouring examples within a step. 5-sd bands."""
    n, q, steps = 1000, 0.05, 200
    rows = _inclusion_matrix(n, q, steps, seed=2)
    pairs = n * (steps - 1)
    mean, sd = pairs * q * q, math.sqrt(pairs * q * q * (1 - q * q))
    assert abs(int((rows[1:] & rows[:-1]).sum()) - mean) < 5 * sd
    pairs = (n - 1) * steps
    mean, sd = pairs * q * q, math.sqrt(pairs * q * q * (1 - q * q))
    assert abs(int((rows[:, 1:] & rows[:, :-1]).sum()) - mean) < 5 * sd


def test_empty_batches_occur_and_are_empty_long_tensors() -> None:
    # n = 5, q = 0.05: P(empty) = 0.95^5 = 0.77 per step
    gen = torch.Generator().manual_seed(3)
    batches = list(poisson_batches(5, sample_rate=0.05, steps=30, generator=gen))
    empty = [b for b in batches if b.numel() == 0]
    assert empty, "expected some empty batches"
    assert all(b.shape == (0,) and b.dtype == torch.long for b in empty)


def test_full_sample_rate_takes_everyone() -> None:
    gen = torch.Generator().manual_seed(0)
    for batch in poisson_batches(7, sample_rate=1.0, steps=3, generator=gen):
        assert torch.equal(batch, torch.arange(7))


def test_deterministic_given_seed() -> None:
    a = _inclusion_matrix(200, 0.1, 30, seed=123)
    b = _inclusion_matrix(200, 0.1, 30, seed=123)
    c = _inclusion_matrix(200, 0.1, 30, seed=124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_global_rng_when_generator_is_none() -> None:
    torch.manual_seed(0)
    a = [b.clone() for b in poisson_batches(100, sample_rate=0.2, steps=5, generator=None)]
    torch.manual_seed(0)
    b = list(poisson_batches(100, sample_rate=0.2, steps=5, generator=None))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_validation_happens_at_call_time() -> None:
    gen = torch.Generator()
    for kwargs, name in (
        ({"n": 0, "sample_rate": 0.1, "steps": 1}, "n"),
        ({"n": 10, "sample_rate": 0.0, "steps": 1}, "sample_rate"),
        ({"n": 10, "sample_rate": 1.1, "steps": 1}, "sample_rate"),
        ({"n": 10, "sample_rate": 0.1, "steps": 0}, "steps"),
    ):
        n = kwargs.pop("n")
        with pytest.raises(ConfigError, match=name):
            poisson_batches(n, generator=gen, **kwargs)  # no iteration needed
    with pytest.raises(ConfigError, match="generator"):
        poisson_batches(10, sample_rate=0.1, steps=1, generator=123)  # type: ignore[arg-type]


def test_sample_rate_for() -> None:
    assert sample_rate_for(256, 60000) == 256 / 60000
    assert sample_rate_for(10, 10) == 1.0
    with pytest.raises(ConfigError, match="batch larger than the dataset"):
        sample_rate_for(11, 10)
    with pytest.raises(ConfigError, match="batch_size"):
        sample_rate_for(0, 10)
    with pytest.raises(ConfigError, match="n"):
        sample_rate_for(1, 0)
