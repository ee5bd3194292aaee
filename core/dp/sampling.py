"""Poisson subsampling of the training set, the sampling scheme the DP-SGD accountants assume.

At every step each of the ``n`` private records is included independently with probability
``q = sample_rate``. The batch size is therefore random (``Binomial(n, q)``, mean ``q n``) and may be
**zero**. Privacy amplification by subsampling -- and hence every epsilon reported by
``core.dp.accounting`` -- holds only for this scheme; shuffling into fixed-size batches is a
different mechanism with a different (weaker) guarantee.

Notes for the trainer:

* An empty batch is still a DP-SGD step: the update is pure noise, ``N(0, (sigma C)^2)`` divided by
  the *expected* batch size ``q n`` (see ``core.dp.noise.privatize_grads_``), and it must be
  recorded with the accountant. Skipping empty batches changes the mechanism (it leaks that the
  batch was empty) and voids the accounting.
* Normalise by the expected batch size ``q n``, never by the realised ``len(batch)``: the realised
  size depends on the private data set's membership.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

import torch

from core.errors import ConfigError

__all__ = ["poisson_batches", "sample_rate_for"]


def sample_rate_for(batch_size: int, n: int) -> float:
    """Poisson sampling rate ``q = batch_size / n`` giving an *expected* batch size of ``batch_size``."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"n (dataset size) must be an integer >= 1, got n={n!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got batch_size={batch_size!r}")
    if batch_size > n:
        raise ConfigError(
            f"batch larger than the dataset: batch_size={batch_size} > n={n}; "
            f"use batch_size <= {n} (batch_size == n gives sample_rate 1, full-batch DP-SGD)"
        )
    return batch_size / n


def poisson_batches(
    n: int,
    *,
    sample_rate: float,
    steps: int,
    generator: torch.Generator | None,
) -> Iterator[torch.Tensor]:
    """Yield ``steps`` Poisson-sampled batches of indices into a dataset of size ``n``.

    Each batch is a sorted ``LongTensor`` of shape ``(b_t,)`` with ``b_t ~ Binomial(n, q)``,
    possibly ``(0,)``; inclusions are independent across examples and across steps. Sampling runs
    on the generator's device (CPU for ``None``, which uses torch's global RNG). A seeded
    ``generator`` makes the sequence reproducible -- for a deployment whose sampling randomness
    must be unpredictable, seed it from a cryptographic source.
    """
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"n (dataset size) must be an integer >= 1, got n={n!r}")
    if not (isinstance(sample_rate, numbers.Real) and 0 < sample_rate <= 1):
        raise ConfigError(
            f"sample_rate must be in (0, 1], got sample_rate={sample_rate!r}; use sample_rate_for(batch_size, n)"
        )
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ConfigError(f"steps must be an integer >= 1, got steps={steps!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return _poisson_batches(int(n), float(sample_rate), int(steps), generator)


def _poisson_batches(
    n: int, sample_rate: float, steps: int, generator: torch.Generator | None
) -> Iterator[torch.Tensor]:
    device = generator.device if generator is not None else torch.device("cpu")
    for _ in range(steps):
        mask = torch.rand(n, generator=generator, device=device) < sample_rate
        yield mask.nonzero().flatten()
