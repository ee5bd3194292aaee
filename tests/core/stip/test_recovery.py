"""The full-strength attacks on STIP (``core.stip.checkpoint_attack``, ``fixed_code_frequency_attack``,
``core.stip.recovery``), each on a small case with a known answer, against the state ``Developer`` really deploys
(pi on the model dimension and rho on every MLP)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from core.stip import checkpoint_attack as C
from core.stip import recovery as R
from core.stip.models import tiny_llama
from core.stip.transform import permute_model, permute_vocab, random_permutation
from core.stip.vocab_attack import fixed_code_frequency_attack
from tests.core.stip.tiny import stip_gpt2


def _deployed(model, pi, rho):
    return R._blocks(permute_model(model, pi, rho=rho))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_match_pi_and_rho_exact_on_the_deployed_state(arch: str) -> None:
    model = stip_gpt2(0) if arch == "gpt2" else tiny_llama(d=32, intermediate=64, seed=0)
    d = 32
    pi = random_permutation(d, 11)
    m = 64 if arch == "llama" else 128
    rho = [random_permutation(m, 20 + i) for i in range(2)]
    deployed = _deployed(model, pi, rho)
    base = R._blocks(model)
    axes = C.deployed_axes(base, arch)
    assert sum(r is not None for _, r in axes.values()) >= 4  # the MLP weights carry rho
    res = C.match_pi(deployed, base, arch, true_pi=pi)
    assert res.recovery_rate == 1.0 and np.array_equal(res.recovered, pi.numpy())
    assert res.n_sorted >= 4  # MLP weights used through their rho-invariant sorted slices
    for layer in range(2):
        rec, rate = C.match_rho(deployed, base, arch, res.recovered, layer, true_rho=rho[layer])
        assert rate == 1.0 and np.array_equal(rec, rho[layer].numpy())


def test_match_pi_survives_finetune_noise_and_rho() -> None:
    model = stip_gpt2(1)
    pi = random_permutation(32, 3)
    rho = [random_permutation(128, 4), random_permutation(128, 5)]
    tuned = R.simulate_finetune(model, 0.5, seed=2)
    res = C.match_pi(_deployed(tuned, pi, rho), R._blocks(model), "gpt2", true_pi=pi)
    assert res.recovery_rate == 1.0
    with pytest.raises(ConfigError, match="unknown arch"):
        C.deployed_axes(R._blocks(model), "bert")


def test_match_sigma_exact_at_noise_zero_and_sampled() -> None:
    model = stip_gpt2(2)
    embed = model.get_input_embeddings().weight.detach()
    v = embed.shape[0]
    pi, sigma = random_permutation(32, 6), random_permutation(v, 7)
    e2, _ = permute_vocab(embed, model.lm_head.weight.detach(), pi, sigma)
    full = C.match_sigma([e2], [embed], pi, true_sigma=sigma)
    assert full.recovery_rate == 1.0 and full.n_decoded == v
    assert np.array_equal(full.decode[sigma.numpy()], np.arange(v))  # decode inverts sigma
    some = C.match_sigma([e2], [embed], pi, true_sigma=sigma, rows=[0, 5, 9, 5])
    assert some.n_decoded == 3 and some.recovery_rate == 1.0
    with pytest.raises(ConfigError, match="one base table per deployed table"):
        C.match_sigma([e2, e2], [embed], pi)


def test_nearest_rows_is_brute_force_nearest_neighbour() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(300, 16, generator=gen)
    queries = table[torch.tensor([3, 7, 299])] + 0.05 * torch.randn(3, 16, generator=gen)
    cand, dist = C.nearest_rows(queries, table, components=8, candidates=5)
    brute = torch.cdist(queries, table).argmin(1).numpy()
    assert np.array_equal(cand[:, 0], brute) and np.array_equal(brute, [3, 7, 299])
    assert (np.diff(dist, axis=1) >= 0).all()


def test_fixed_code_frequency_attack_decodes_a_code_stream() -> None:
    v, d = 40, 8
    counts = np.arange(v, 0, -1) * 3  # distinct counts: ranks identify every token
    tokens = np.repeat(np.arange(v), counts)
    np.random.default_rng(0).shuffle(tokens)
    table = torch.randn(v, d, generator=torch.Generator().manual_seed(1))
    pi = random_permutation(d, 2)
    rows = table[torch.as_tensor(tokens)][:, pi]  # a fixed row per token, as P3 sends in user_embed
    res = fixed_code_frequency_attack(rows, counts, v, true_tokens=tokens)
    assert res.token_recovery_rate == 1.0 and res.n_codes == v and res.n_stream == tokens.size
    with pytest.raises(ConfigError, match="3 tokens"):
        fixed_code_frequency_attack(rows, counts, v, true_tokens=[0, 1, 2])


def _streams(model):
    return R.model_streams(model, 3000, seed=0)  # public text folded into the 97-token vocabulary


def test_strongest_attack_reaches_99pct_up_to_10pct_noise_on_a_small_model() -> None:
    model = stip_gpt2(3)
    stream, reference = _streams(model)
    noises = (0.0, 0.1)
    tables = {}
    for design in ("user_embed", "vocab_perm"):
        rows = R.recovery_rows(
            model, design, noises=noises, seed=0, stream=stream, reference=reference, decode_tokens=500
        )
        assert {r["attack"] for r in rows} == {"checkpoint_match", "frequency"}
        tables[design] = R.recovery_table(rows, noises)
        metrics = R.recovery_metrics(rows, noises)
        assert metrics["checkpoint.pi_recovered.noise_0pct"] == 1.0
        assert metrics["checkpoint.rho_recovered.noise_0pct"] == 1.0
        assert metrics["strongest.tokens_recovered"] >= metrics["none.tokens_recovered"]
    ve, ue = tables["vocab_perm"], tables["user_embed"]
    assert min(ve["strongest"]["sigma"].values()) >= 0.99 and ve["checkpoint"]["sigma"]["0"] == 1.0
    assert min(ue["strongest"]["tokens"].values()) >= 0.99 and ue["checkpoint"]["tokens"]["0"] == 1.0
    assert "pi" not in ue.get("none", {})  # frequency analysis does not target pi
    with pytest.raises(ConfigError, match="unknown STIP attacks"):
        R.recovery_rows(model, "user_embed", seed=0, stream=stream, reference=reference, attacks=("guess",))


def test_metric_names_and_worst_case_below_10pct() -> None:
    nan = math.nan
    rows = [
        {
            "attack": "a",
            "prior": "checkpoint",
            "noise": n,
            "attack_s": 0.0,
            "pi_recovered": p,
            "rho_recovered": nan,
            "sigma_recovered": nan,
            "tokens_recovered": t,
        }
        for n, p, t in ((0.0, 1.0, 1.0), (0.1, 0.9, 0.95), (0.5, 0.2, 0.1))
    ] + [
        {
            "attack": "f",
            "prior": "none",
            "noise": nan,
            "attack_s": 0.0,
            "pi_recovered": nan,
            "rho_recovered": nan,
            "sigma_recovered": nan,
            "tokens_recovered": 0.3,
        }
    ]
    m = R.recovery_metrics(rows, (0.0, 0.1, 0.5))
    assert R.metric_name("checkpoint", "tokens", 0.1) == "checkpoint.tokens_recovered.noise_10pct"
    assert m["checkpoint.pi_recovered.up_to_10pct"] == 0.9 and m["checkpoint.pi_recovered"] == 1.0
    assert m["none.tokens_recovered.noise_50pct"] == 0.3 and m["strongest.tokens_recovered.noise_50pct"] == 0.3
    assert "none.pi_recovered" not in m
