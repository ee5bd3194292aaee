"""Random MPC payloads for the scaling sweep (``core.mpc.payloads``): the parameter count, the seed, the RNG."""

from __future__ import annotations

import pytest
import torch

from core.models.gpt2 import tiny_gpt2
from core.mpc import merge
from core.mpc.gpt2 import GPT2Weights, weights_from_hf
from core.mpc.merge_spec import MergeSpec
from core.mpc.payloads import payload_params, random_payload
from core.mpc.recipes import GPT2Shape
from tests.core.mpc.conftest import tiny_merge_spec

SHAPE = GPT2Shape(vocab=50, n_layer=2, n_embd=16, n_head=2, n_positions=16, eos=49)


def test_a_gpt2_payload_counts_the_models_parameters() -> None:
    payload = random_payload("vanilla", SHAPE, n_max=6, seed=0)
    model = tiny_gpt2(50, n_layer=2, n_embd=16, n_head=2, n_positions=16, eos_token_id=49, seed=0)
    assert isinstance(payload, GPT2Weights)
    assert payload_params(payload) == sum(p.numel() for p in model.parameters())  # the tied LM head counted once


def test_a_merge_spec_counts_every_tensor() -> None:
    # per layer: C (2, 16, 16), LayerNorm 2 x 16, W_V and W_d 16 x 16, b_a 16, M_u 16 x 32, b_u 32, W_O 32 x 16, b_O 16
    layer = 2 * 16 * 16 + 2 * 16 + 2 * 16 * 16 + 16 + 16 * 32 + 32 + 32 * 16 + 16
    # two layers, wpe (32, 16), final LayerNorm 2 x 16, lm_head (64, 16); the epsilons and activation count 0
    assert payload_params(tiny_merge_spec()) == 2 * layer + 32 * 16 + 2 * 16 + 64 * 16 == 5856
    assert payload_params([torch.zeros(3), (torch.zeros(2, 2), "x", 1.5)]) == 7


@pytest.mark.parametrize("method", ["vanilla", "merge"])
def test_a_random_payload_is_its_seeds_alone_and_leaves_the_global_rng(method: str) -> None:
    torch.manual_seed(99)
    before = torch.random.get_rng_state().clone()
    a = random_payload(method, SHAPE, n_max=6, seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(5)  # another global state: the same payload
    b = random_payload(method, SHAPE, n_max=6, seed=1)
    c = random_payload(method, SHAPE, n_max=6, seed=2)
    table = (lambda p: p.wte) if method == "vanilla" else (lambda p: p.lm_head)
    assert torch.equal(table(a), table(b)) and not torch.equal(table(a), table(c))


def test_a_random_merge_payload_equals_the_steps_written_out() -> None:
    """What the scaling task did inline: the global RNG seeded, a GPT-2 drawn, its merge module exported."""
    spec = random_payload("merge", SHAPE, n_max=6, seed=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = tiny_gpt2(50, n_layer=2, n_embd=16, n_head=2, n_positions=16, eos_token_id=49).eval()
        ids = torch.randint(0, 49, (4, 6), generator=torch.Generator().manual_seed(4))
        want = merge.export_spec(merge.build_merge_model(model, [ids], 6).eval())
        weights = weights_from_hf(model)
    assert isinstance(spec, MergeSpec) and spec.layers[0].C.shape == (2, 6, 6)
    assert torch.equal(spec.lm_head, want.lm_head)
    assert all(
        torch.equal(x.C, y.C) and torch.equal(x.M_u, y.M_u) for x, y in zip(spec.layers, want.layers, strict=True)
    )
    assert torch.equal(random_payload("vanilla", SHAPE, n_max=6, seed=4).wte, weights.wte)
