"""Theorem 1 of STIP (f_theta'(x pi) = f_theta(x) pi) against the untransformed HF models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.errors import ConfigError
from core.stip.models import tiny_llama
from core.stip.transform import (
    base_model_of,
    check_permutation,
    inverse_permutation,
    mlp_hidden_sizes,
    permute_model,
    permute_vocab,
    random_permutation,
)
from tests.core.stip.tiny import stip_gpt2

T = 6


def _masks(t: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    causal = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return {"decoder": causal.view(1, 1, t, t), "encoder": torch.zeros(1, 1, t, t, dtype=dtype)}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture(params=["gpt2", "llama"])
def arch(request):
    return request.param


def _model(arch: str, dtype=torch.float32) -> nn.Module:
    return (stip_gpt2() if arch == "gpt2" else tiny_llama()).to(dtype)


def _rho(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """Seeded per-block MLP permutations (test-only; the protocol draws them from the OS CSPRNG)."""
    return [random_permutation(m, seed + i) for i, m in enumerate(mlp_hidden_sizes(model))]


def test_random_permutation_is_permutation_and_seeded():
    pi = random_permutation(50, 3)
    assert sorted(pi.tolist()) == list(range(50))
    assert torch.equal(pi, random_permutation(50, 3))
    assert not torch.equal(pi, random_permutation(50, 4))
    assert torch.equal(torch.arange(50)[pi][inverse_permutation(pi)], torch.arange(50))


@pytest.mark.parametrize(
    ("pi", "match"),
    [
        (torch.arange(31), "wrong size"),
        (torch.tensor([0, 0] + list(range(2, 32))), "not a permutation"),
        (torch.tensor([-1] + list(range(1, 32))), "not a permutation"),
        (torch.arange(32).float(), "integer"),
        (torch.arange(32).view(4, 8), "1-D"),
        ([0, 1], "torch.Tensor"),
    ],
)
def test_check_permutation_rejects(pi, match):
    with pytest.raises(ConfigError, match=match):
        check_permutation(pi, 32)


def test_permute_model_rejects_bad_pi():
    with pytest.raises(ConfigError, match="wrong size"):
        permute_model(stip_gpt2(), torch.arange(16))


def test_permute_model_rejects_bad_rho():
    model = stip_gpt2()
    pi, rho = random_permutation(32, 0), _rho(model, 1)
    with pytest.raises(ConfigError, match="rho has 1 permutations"):
        permute_model(model, pi, rho=rho[:1])
    with pytest.raises(ConfigError, match="wrong size"):
        permute_model(model, pi, rho=[torch.arange(7)] * len(rho))


def test_gpt2_block_theorem1_decoder_and_encoder_masks():
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-10)):
        model = _model("gpt2", dtype)
        pi = random_permutation(model.config.n_embd, 0)
        new = permute_model(model, pi, rho=_rho(model, 5))
        x = torch.randn(2, T, model.config.n_embd, dtype=dtype)
        for mask in _masks(T, dtype).values():
            for blk, blk_t in zip(model.transformer.h, new.transformer.h, strict=True):
                y = _first(blk(x, attention_mask=mask))
                y_t = _first(blk_t(x[..., pi], attention_mask=mask))
                torch.testing.assert_close(y_t, y[..., pi], atol=tol, rtol=0)


def test_llama_layer_theorem1_with_rotary():
    model = _model("llama")
    pi = random_permutation(model.config.hidden_size, 0)
    new = permute_model(model, pi, rho=_rho(model, 5))
    x = torch.randn(2, T, model.config.hidden_size)
    pos = model.model.rotary_emb(x, torch.arange(T).view(1, T))
    for mask in _masks(T, torch.float32).values():
        for layer, layer_t in zip(model.model.layers, new.model.layers, strict=True):
            y = _first(layer(x, attention_mask=mask, position_embeddings=pos))
            y_t = _first(layer_t(x[..., pi], attention_mask=mask, position_embeddings=pos))
            torch.testing.assert_close(y_t, y[..., pi], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mlp_seed", [None, 7])
def test_whole_model_theorem1_and_logits_recovered(arch, mlp_seed):
    """With and without the per-block MLP permutations rho."""
    model = _model(arch)
    d = model.config.hidden_size
    pi = random_permutation(d, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = permute_model(model, pi, rho=None if mlp_seed is None else _rho(model, mlp_seed))
    ids = torch.randint(0, model.config.vocab_size, (2, T))
    x = base_model_of(model).get_input_embeddings()(ids)
    h = base_model_of(model)(inputs_embeds=x).last_hidden_state
    h_t = base_model_of(new)(inputs_embeds=x[..., pi]).last_hidden_state
    torch.testing.assert_close(h_t, h[..., pi], atol=1e-5, rtol=0)
    logits = h_t[..., inverse_permutation(pi)] @ model.lm_head.weight.T
    plain = model(input_ids=ids).logits
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=0)
    assert torch.equal(logits.argmax(-1), plain.argmax(-1))
    for k, v in model.state_dict().items():  # the original is untouched
        assert torch.equal(v, before[k]), k


def test_whole_gpt2_float64_exact():
    model = _model("gpt2", torch.float64)
    pi = random_permutation(model.config.n_embd, 2)
    new = permute_model(model, pi)
    x = torch.randn(1, T, model.config.n_embd, dtype=torch.float64)
    h = model.transformer(inputs_embeds=x).last_hidden_state
    h_t = new.transformer(inputs_embeds=x[..., pi]).last_hidden_state
    torch.testing.assert_close(h_t, h[..., pi], atol=1e-10, rtol=0)


def test_norms_are_nontrivial_and_permuted(arch):
    model = _model(arch)
    pi = random_permutation(model.config.hidden_size, 0)
    new = permute_model(model, pi)
    norm, norm_t = (
        (model.transformer.h[0].ln_1, new.transformer.h[0].ln_1)
        if arch == "gpt2"
        else (model.model.layers[0].input_layernorm, new.model.layers[0].input_layernorm)
    )
    assert norm.weight.std() > 0.1  # randomised, not the identity init
    assert torch.equal(norm_t.weight, norm.weight[pi])
    assert not torch.equal(norm_t.weight, norm.weight)
    if arch == "gpt2":
        assert norm.bias.abs().max() > 0.1
        assert torch.equal(norm_t.bias, norm.bias[pi])


def test_forgetting_the_norms_breaks_theorem1():
    """Sanity check that the test above would catch the public script's bug (untouched norms)."""
    model = _model("gpt2")
    pi = random_permutation(model.config.n_embd, 0)
    new = permute_model(model, pi)
    with torch.no_grad():
        new.transformer.h[0].ln_1.weight.copy_(model.transformer.h[0].ln_1.weight)
    x = torch.randn(1, T, model.config.n_embd)
    h = model.transformer(inputs_embeds=x).last_hidden_state
    h_t = new.transformer(inputs_embeds=x[..., pi]).last_hidden_state
    assert (h_t - h[..., pi]).abs().max() > 1e-3


def test_permute_vocab_substitutes_logits():
    model = _model("llama")
    pi = random_permutation(model.config.hidden_size, 0)
    sigma = random_permutation(model.config.vocab_size, 1)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    e2, h2 = permute_vocab(emb, head, pi, sigma)
    ids = torch.tensor([3, 5, 8])
    torch.testing.assert_close(e2[sigma[ids]], emb[ids][:, pi])
    h = torch.randn(4, model.config.hidden_size)
    torch.testing.assert_close((h[:, pi] @ h2.T)[:, sigma], h @ head.T, atol=1e-5, rtol=0)


class _Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_custom_activation_module_rejected():
    model = stip_gpt2()
    model.transformer.h[1].mlp.act = _Swish()
    with pytest.raises(ConfigError, match="_Swish"):
        permute_model(model, random_permutation(32, 0))


def test_extra_module_in_block_rejected():
    model = tiny_llama()
    model.model.layers[0].adapter = nn.Linear(32, 32)
    with pytest.raises(ConfigError, match="adapter|not transformed"):
        permute_model(model, random_permutation(32, 0))


def test_unsupported_model_type_rejected():
    from transformers import BertConfig, BertModel

    bert = BertModel(
        BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    with pytest.raises(ConfigError, match="BertModel"):
        permute_model(bert, random_permutation(32, 0))


def test_smollm2_real_weights_theorem1():
    """Fast real-weights check (~15-20 s, dominated by GGUF loading): whole-model Theorem 1, 8 tokens."""
    from core.errors import DataError
    from core.stip.models import load_smollm2

    try:
        model = load_smollm2()
    except DataError as exc:
        pytest.skip(str(exc))
    pi = random_permutation(model.config.hidden_size, 0)
    new = permute_model(model, pi)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1345]])
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        h_t = new.model(inputs_embeds=x[..., pi]).last_hidden_state
        logits = h_t[..., inverse_permutation(pi)] @ model.lm_head.weight.T
        plain = model(input_ids=ids).logits
    assert (logits - plain).abs().max() < 1e-3
    assert torch.equal(logits.argmax(-1), plain.argmax(-1))
