"""STIP secrets come from the OS CSPRNG: valid permutations, fresh per draw, independent of every torch seed, never
printed."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from core.stip.keys import StipKeys, draw_keys, secure_permutation
from core.stip.models import tiny_llama
from core.stip.transform import mlp_hidden_sizes, random_permutation
from tests.core.stip.tiny import stip_gpt2


@pytest.mark.parametrize("d", [1, 2, 32, 50257])
def test_secure_permutation_is_a_permutation(d):
    pi = secure_permutation(d)
    assert pi.dtype == torch.int64 and pi.shape == (d,)
    assert torch.equal(pi.sort().values, torch.arange(d))


def test_secure_permutation_ignores_torch_seeds():
    """Reseeding torch (what a rerun with the recorded seed does) does not reproduce the secret."""
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        draws.append(secure_permutation(64))
    assert not torch.equal(draws[0], draws[1])  # 1 / 64! chance of a false failure
    assert not any(torch.equal(draws[0], random_permutation(64, s)) for s in range(256))


def test_secure_permutation_is_roughly_uniform():
    """Every position takes every value about equally often (chi-square-free bound: 6 sigma of a binomial)."""
    d, n = 8, 4000
    counts = torch.zeros(d, d)
    for _ in range(n):
        counts[torch.arange(d), secure_permutation(d)] += 1
    expected, sd = n / d, (n * (1 / d) * (1 - 1 / d)) ** 0.5
    assert (counts - expected).abs().max() < 6 * sd


@pytest.mark.parametrize("d", [0, -1, 2.0, True])
def test_secure_permutation_rejects_bad_size(d):
    with pytest.raises(ConfigError, match="positive int"):
        secure_permutation(d)


@pytest.mark.parametrize(("make", "design"), [(stip_gpt2, "user_embed"), (tiny_llama, "vocab_perm")])
def test_draw_keys_shapes_and_freshness(make, design):
    model = make()
    a, b = draw_keys(model, design), draw_keys(model, design)
    d, vocab = model.config.hidden_size, model.get_input_embeddings().weight.shape[0]
    assert a.pi.shape == (d,) and [r.numel() for r in a.rho] == mlp_hidden_sizes(model)
    assert (a.sigma is None) == (design == "user_embed")
    if a.sigma is not None:
        assert a.sigma.shape == (vocab,) and not torch.equal(a.sigma, b.sigma)
    assert not torch.equal(a.pi, b.pi)
    assert not all(torch.equal(x, y) for x, y in zip(a.rho, b.rho, strict=True))


def test_keys_repr_names_sizes_only():
    keys = draw_keys(stip_gpt2(), "vocab_perm")
    text = repr(keys) + str(keys)
    assert text.count("StipKeys") == 2 and "tensor" not in text
    assert ", ".join(str(i) for i in keys.pi[:3].tolist()) not in text


def test_draw_keys_validates_a_test_source():
    with pytest.raises(ConfigError, match="not a permutation"):
        draw_keys(stip_gpt2(), "user_embed", source=lambda n: torch.zeros(n, dtype=torch.long))
    with pytest.raises(ConfigError, match="design"):
        draw_keys(stip_gpt2(), "bogus")
    assert isinstance(draw_keys(stip_gpt2(), "user_embed", source=lambda n: torch.arange(n)), StipKeys)
