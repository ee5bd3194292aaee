"""Attacks on STIP's permutation: each on a case where the answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from core.stip.attacks import (
    activation_statistics_attack,
    coordinate_statistics,
    guess_probability,
    model_dim_axes,
    permute_state,
    recovery_rate,
    weight_matching_attack,
    what_it_reveals,
)
from core.stip.vocab_attack import token_frequency_attack


def _tiny_gpt2(seed: int = 0, n_embd: int = 32):
    from core.models.gpt2 import tiny_gpt2

    torch.manual_seed(seed)
    return tiny_gpt2(97, n_layer=2, n_embd=n_embd, n_head=2, n_positions=64, dropout=0.0, eos_token_id=0).eval()


def _noisy(state, rel_std, gen):
    out = {}
    for k, t in state.items():
        if t.is_floating_point():
            scale = t.float().pow(2).mean().sqrt().clamp_min(1e-3)
            out[k] = t + rel_std * scale * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        else:
            out[k] = t
    return out


# ------------------------------------------------------------------ helpers


def test_guess_probability_is_log10_inverse_factorial():
    assert guess_probability(1) == 0.0
    assert guess_probability(5) == pytest.approx(-math.log10(120))
    assert guess_probability(768) < -1800  # log10(768!) ~ 1871
    with pytest.raises(ConfigError):
        guess_probability(0)


def test_model_dim_axes_gpt2_and_llama_conventions():
    model = _tiny_gpt2()
    sd = model.state_dict()
    ax = model_dim_axes(sd, "gpt2")
    assert ax["transformer.h.0.attn.c_attn.weight"] == 0
    assert ax["transformer.h.0.attn.c_proj.weight"] == 1
    assert ax["transformer.h.1.mlp.c_fc.weight"] == 0
    assert ax["transformer.h.1.mlp.c_proj.weight"] == 1
    assert ax["transformer.ln_f.bias"] == 0
    assert ax["transformer.wte.weight"] == 1
    assert "transformer.h.0.attn.c_attn.bias" not in ax
    for name, a in ax.items():
        assert sd[name].shape[a] == 32, name

    d, m = 8, 20
    llama = {
        "model.embed_tokens.weight": torch.zeros(50, d),
        "model.layers.0.input_layernorm.weight": torch.zeros(d),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(d, d),
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(d, d),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(m, d),
        "model.layers.0.mlp.down_proj.weight": torch.zeros(d, m),
        "model.norm.weight": torch.zeros(d),
        "model.rotary_emb.inv_freq": torch.zeros(4),
    }
    lax = model_dim_axes(llama, "llama")
    assert lax["model.layers.0.mlp.up_proj.weight"] == 1
    assert lax["model.layers.0.mlp.down_proj.weight"] == 0
    assert lax["model.layers.0.self_attn.q_proj.weight"] == 1
    assert lax["model.layers.0.self_attn.o_proj.weight"] == 0
    assert "model.rotary_emb.inv_freq" not in lax
    with pytest.raises(ConfigError, match="unknown arch"):
        model_dim_axes(llama, "bert")


# ------------------------------------------------------------------ (a) weight matching


def test_weight_matching_recovers_pi_from_finetuned_gpt2():
    base = _tiny_gpt2().state_dict()
    gen = torch.Generator().manual_seed(1)
    pi = torch.randperm(32, generator=gen)
    finetuned = _noisy(base, 1e-2, gen)
    transformed = permute_state(finetuned, pi, "gpt2")
    # P2 does not see the embedding table in STIP (the user embeds); drop it to be strict
    transformed = {k: v for k, v in transformed.items() if "wte" not in k and "lm_head" not in k}
    res = weight_matching_attack(transformed, base, "gpt2", true_perm=pi)
    assert res.recovery_rate == 1.0
    assert np.array_equal(res.recovered, pi.numpy())
    assert res.margin > 0
    assert res.n_tensors >= 10
    for metric in ("cosine", "corr"):
        assert weight_matching_attack(transformed, base, "gpt2", true_perm=pi, metric=metric).recovery_rate == 1.0


def test_weight_matching_degrades_with_huge_noise():
    base = _tiny_gpt2().state_dict()
    gen = torch.Generator().manual_seed(2)
    pi = torch.randperm(32, generator=gen)
    transformed = permute_state(_noisy(base, 30.0, gen), pi, "gpt2")
    res = weight_matching_attack(transformed, base, "gpt2", true_perm=pi)
    assert res.recovery_rate < 0.5


def test_weight_matching_generic_axes_mapping_and_size_errors():
    gen = torch.Generator().manual_seed(3)
    d = 16
    base = {
        "ln.weight": torch.randn(d, generator=gen),
        "w_in": torch.randn(d, 40, generator=gen),
        "w_out": torch.randn(40, d, generator=gen),
    }
    axes = {"ln.weight": 0, "w_in": 0, "w_out": 1}
    pi = torch.randperm(d, generator=gen)
    res = weight_matching_attack(permute_state(_noisy(base, 1e-3, gen), pi, axes), base, axes, true_perm=pi)
    assert res.recovery_rate == 1.0
    # callable axes
    res2 = weight_matching_attack(permute_state(base, pi, axes), base, lambda n, t: axes.get(n), true_perm=pi)
    assert res2.recovery_rate == 1.0

    bad = dict(base, w_in=torch.randn(d + 1, 40))
    with pytest.raises(ConfigError, match=r"\(17, 40\).*\(16, 40\)"):
        weight_matching_attack(bad, base, axes)
    with pytest.raises(ConfigError, match="size 15.*d=16"):
        weight_matching_attack(base, base, axes, true_perm=torch.arange(15))
    wrong_axes = {"ln.weight": 0, "w_in": 1}
    with pytest.raises(ConfigError, match="size 40"):
        weight_matching_attack(base, base, wrong_axes)


# ------------------------------------------------------------------ (b) activation statistics


def _synthetic_acts(n, d, param_seed, sample_seed):
    """Per-coordinate distributions fixed by param_seed (varied scales, means, 4 heavy-tailed
    outlier coordinates like GPT-2/LLaMA massive activations); samples drawn with sample_seed."""
    gp = torch.Generator().manual_seed(param_seed)
    scales = torch.exp(torch.linspace(-2, 2, d))[torch.randperm(d, generator=gp)]
    means = torch.randn(d, generator=gp)
    outliers = torch.randperm(d, generator=gp)[:4].tolist()
    gs = torch.Generator().manual_seed(sample_seed)
    x = torch.randn(n, d, generator=gs) * scales + means
    for j, c in enumerate(outliers):
        x[:, c] += (torch.rand(n, generator=gs) < 0.02 * (j + 1)).float() * 40.0 * (j + 1)
    return x, outliers


def test_activation_attack_distinct_coordinates_high_recovery():
    d = 64
    ref, outliers = _synthetic_acts(4000, d, param_seed=10, sample_seed=1)
    user, _ = _synthetic_acts(4000, d, param_seed=10, sample_seed=2)
    pi = torch.randperm(d, generator=torch.Generator().manual_seed(4))
    res = activation_statistics_attack(user[:, pi], ref, true_perm=pi, query_counts=[50, 500, 4000])
    assert res.recovery_rate > 0.9
    assert res.recovery_by_queries[4000] == res.recovery_rate
    assert res.recovery_by_queries[50] <= res.recovery_by_queries[4000] + 1e-9
    # the strongest outlier coordinates are recovered even from few queries
    r200 = activation_statistics_attack(user[:200, pi], ref, true_perm=pi)
    pos = {int(p): i for i, p in enumerate(pi.tolist())}
    assert all(r200.recovered[pos[c]] == c for c in outliers[2:])


def test_activation_attack_iid_coordinates_near_chance():
    gen = torch.Generator().manual_seed(5)
    d = 64
    ref = torch.randn(2000, d, generator=gen)
    priv = torch.randn(2000, d, generator=gen)
    pi = torch.randperm(d, generator=gen)
    res = activation_statistics_attack(priv[:, pi], ref, true_perm=pi)
    assert res.recovery_rate <= 6 / d  # chance is 1/d


def test_activation_attack_on_tiny_gpt2_hidden_states():
    model = _tiny_gpt2(seed=7)
    gen = torch.Generator().manual_seed(6)
    ids_ref = torch.randint(0, 97, (64, 32), generator=gen)
    ids_user = torch.randint(0, 97, (64, 32), generator=gen)
    with torch.no_grad():
        h_ref = model(ids_ref, output_hidden_states=True).hidden_states[1]
        h_user = model(ids_user, output_hidden_states=True).hidden_states[1]
    pi = torch.randperm(32, generator=gen)
    res = activation_statistics_attack(h_user[..., pi], h_ref, true_perm=pi)
    assert res.n_queries == 64 * 32
    assert res.recovery_rate > 0.5


def test_activation_attack_size_mismatch_and_features():
    with pytest.raises(ConfigError, match="d=8.*d=9"):
        activation_statistics_attack(torch.randn(10, 8), torch.randn(10, 9))
    with pytest.raises(ConfigError, match="unknown activation feature"):
        coordinate_statistics(torch.randn(10, 4), features=("median_of_means",))
    assert coordinate_statistics(torch.randn(10, 4)).shape == (4, 6 + 7)
    with pytest.raises(ConfigError, match="true_perm"):
        activation_statistics_attack(torch.randn(10, 4), torch.randn(10, 4), query_counts=[5])


# ------------------------------------------------------------------ (c) token frequencies


def _zipf_stream(n, v, gen_np, s=1.1):
    p = 1.0 / np.arange(1, v + 1) ** s
    p /= p.sum()
    order = gen_np.permutation(v)  # which true token has which rank
    probs = np.empty(v)
    probs[order] = p
    return gen_np.choice(v, size=n, p=probs), probs


def test_token_frequency_attack_recovers_frequent_tokens():
    rng = np.random.default_rng(0)
    v = 500
    user, probs = _zipf_stream(20000, v, rng)
    sigma = rng.permutation(v)
    observed = sigma[user]
    res = token_frequency_attack(observed, probs, v, true_sigma=sigma)
    assert res.coverage_recovery[0.5] >= 0.8
    top10_true = np.argsort(-probs)[:10]
    assert np.mean(res.recovered[top10_true] == sigma[top10_true]) >= 0.8
    assert res.stream_decoding_rate > 0.3
    assert res.n_stream == 20000
    # decode and recovered are inverse permutations
    assert np.array_equal(res.decode[res.recovered], np.arange(v))


def test_token_frequency_bigram_refinement_helps():
    rng = np.random.default_rng(1)
    v = 60
    # Markov chain with distinct transitions: unigram ties broken by context
    trans = rng.dirichlet(np.full(v, 0.05), size=v)

    def walk(n):
        out = np.empty(n, dtype=np.int64)
        out[0] = 0
        cum = np.cumsum(trans, axis=1)
        u = rng.random(n)
        for i in range(1, n):
            out[i] = min(int(np.searchsorted(cum[out[i - 1]], u[i])), v - 1)
        return out

    ref_stream = walk(40000)
    user = walk(20000)
    freqs = np.bincount(ref_stream, minlength=v)
    sigma = rng.permutation(v)
    plain = token_frequency_attack(sigma[user], freqs, v, true_sigma=sigma)
    refined = token_frequency_attack(sigma[user], freqs, v, true_sigma=sigma, reference_stream=ref_stream, n_anchors=10)
    assert refined.stream_decoding_rate >= plain.stream_decoding_rate
    assert refined.stream_decoding_rate > 0.8


def test_token_frequency_attack_bad_sizes():
    with pytest.raises(ConfigError, match="size 10 but vocab_size=20"):
        token_frequency_attack([1, 2, 3], np.ones(10), 20)
    with pytest.raises(ConfigError, match="vocab_size=5"):
        token_frequency_attack([1, 7], np.ones(5), 5)


# ------------------------------------------------------------------ what it reveals


def test_what_it_reveals_true_pi_recovers_all_random_pi_none():
    gen = torch.Generator().manual_seed(8)
    v, d, n = 200, 32, 100
    table = torch.randn(v, d, generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)
    pi = torch.randperm(d, generator=gen)
    seen = table[tokens][:, pi]
    full = what_it_reveals(pi, seen, table, tokens)
    assert full.token_recovery_rate == 1.0
    assert full.n_coordinates_used == d
    wrong = what_it_reveals(torch.randperm(d, generator=gen), seen, table, tokens)
    assert wrong.token_recovery_rate < 0.1
    partial = pi.clone()
    partial[d // 2 :] = -1  # half the coordinates placed
    half = what_it_reveals(partial, seen, table, tokens)
    assert half.n_coordinates_used == d // 2
    assert half.token_recovery_rate > 0.9
    # with public position embeddings added before permuting
    pos = torch.randn(n, d, generator=gen)
    withpos = what_it_reveals(pi, (table[tokens] + pos)[:, pi], table, tokens, offset=pos)
    assert withpos.token_recovery_rate == 1.0


def test_what_it_reveals_size_mismatch():
    with pytest.raises(ConfigError, match="d=8.*d=9"):
        what_it_reveals(torch.arange(8), torch.randn(3, 8), torch.randn(5, 9))
    with pytest.raises(ConfigError, match="3 tokens.*4 rows"):
        what_it_reveals(torch.arange(8), torch.randn(4, 8), torch.randn(5, 8), [1, 2, 3])
    with pytest.raises(ConfigError, match="repeats"):
        what_it_reveals([0, 0, 1, 2], torch.randn(4, 4), torch.randn(5, 4))


def test_recovery_rate():
    assert recovery_rate([0, 1, 2, 3], [0, 1, 3, 2]) == 0.5
    with pytest.raises(ConfigError, match="size 3.*size 4"):
        recovery_rate([0, 1, 2], [0, 1, 2, 3])
