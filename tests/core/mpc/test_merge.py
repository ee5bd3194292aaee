"""MERGE: the merged module (eq. 10-11) against the unmerged constant-attention block, ER losses, training."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from core.errors import ConfigError
from core.mpc.merge import (
    ERConfig,
    MergeModel,
    alignment_loss,
    augment_embeddings,
    average_attention,
    build_merge_model,
    er_loss,
    export_spec,
    merge_generate,
    train_er,
    train_mm,
)
from core.mpc.merge_spec import (
    MergeState,
    merge_generate_plain,
    merged_block,
    merged_forward,
    merged_forward_step,
    merged_logits,
    mm_generate_plain,
)
from tests.core.mpc.conftest import tiny_gpt2

N_MAX = 12


def synthetic_batches(n=4, b=4, length=10, seed=1) -> list[torch.Tensor]:
    """A tiny learnable corpus: arithmetic progressions mod 100 (token t+1 = token t + step)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, 100, (b, 1), generator=g)
        step = torch.randint(1, 3, (b, 1), generator=g)
        out.append((start + step * torch.arange(length)) % 100)
    return out


def perturbed_merge_model(seed=0) -> MergeModel:
    model = tiny_gpt2(seed=seed)
    mm = MergeModel(model, average_attention(model, synthetic_batches(), N_MAX))
    torch.manual_seed(seed + 7)
    with torch.no_grad():  # move away from the init so every merged term matters
        for p in mm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mm


def test_merged_block_equals_unmerged_constant_attention_block():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    h = torch.randn(3, 9, 16, dtype=torch.float64)
    for block, layer in zip(mm.blocks, spec.layers, strict=True):
        torch.testing.assert_close(merged_block(layer, h), block(h), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("d", "heads"), [(64, 2), (256, 8), (768, 12)])
def test_exported_block_has_no_more_weights_than_a_gpt2_block(d, heads):
    hf = GPT2LMHeadModel(
        GPT2Config(vocab_size=8, n_positions=8, n_embd=d, n_layer=1, n_head=heads, bos_token_id=0, eos_token_id=0)
    ).eval()
    c0 = torch.ones(8, 8).tril()
    spec = export_spec(MergeModel(hf, (c0 / c0.sum(-1, keepdim=True)).expand(1, heads, 8, 8)))  # no training
    gpt2_block = sum(p.numel() for p in hf.transformer.h[0].parameters())
    assert gpt2_block == 12 * d * d + 13 * d
    assert spec.layers[0].n_weights == 10 * d * d + 8 * d <= gpt2_block
    assert spec.layers[0].M_u.shape == (d, 4 * d)  # eq. 10's M_u is d x d_I


def test_incremental_steps_equal_the_whole_sequence():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    E = mm.wte(synthetic_batches()[0])  # (4, 10, 16)
    state, rows = MergeState(), []
    for lo, hi in ((0, 4), (4, 5), (5, 6), (6, 10)):  # a prefix, single positions, a chunk
        rows.append(merged_forward_step(spec, E[:, lo:hi], state))
    assert state.length == 10
    torch.testing.assert_close(torch.cat(rows, dim=1), merged_forward(spec, E), atol=1e-10, rtol=0)


def test_incremental_generation_equals_recomputed_reference():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    prefix = synthetic_batches()[0][:, :4]
    tokens, hidden = merge_generate_plain(spec, mm.wte(prefix), 6)
    ref_tokens, ref_hidden = merge_generate_plain(spec, mm.wte(prefix), 6, recompute=True)
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(merged_logits(spec, hidden), merged_logits(spec, ref_hidden), atol=1e-9, rtol=0)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(mm_generate_plain(spec, prefix, 6), mm_generate_plain(spec, prefix, 6, recompute=True))


def test_merged_forward_equals_model_forward_and_is_causal():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    ids = synthetic_batches()[0]
    out = merged_forward(spec, mm.wte(ids))
    torch.testing.assert_close(out, mm(ids).hidden[-1], atol=1e-5, rtol=0)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 100
    torch.testing.assert_close(merged_forward(spec, mm.wte(ids2))[:, :-1], out[:, :-1], atol=1e-12, rtol=0)


def test_constant_attention_is_causal_row_stochastic_average():
    model = tiny_gpt2()
    c = average_attention(model, synthetic_batches(), N_MAX)
    assert c.shape == (2, 2, N_MAX, N_MAX)
    torch.testing.assert_close(c.sum(-1), torch.ones(2, 2, N_MAX, dtype=c.dtype))
    assert torch.all(c.triu(1) == 0)
    mm = MergeModel(model, c)
    torch.testing.assert_close(mm.blocks[0].att.probs(), c[0])


def test_merge_generate_matches_plain_spec_generation():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    prefix = synthetic_batches()[0][:, :4]
    tokens, hidden = merge_generate(mm, prefix, 5)
    tokens2, hidden2 = merge_generate_plain(spec, mm.wte(prefix), 5)
    assert tokens.shape == (4, 5) and hidden.shape == (4, 5, 16)
    torch.testing.assert_close(hidden2, hidden, atol=1e-5, rtol=0)
    assert torch.equal(tokens, tokens2)
    tok1, hid1 = merge_generate(tiny_gpt2(), prefix[0], 3)  # plain HF GPT-2 with ER
    assert tok1.shape == (3,) and hid1.shape == (3, 16)


def test_sequence_longer_than_constant_attention_raises_naming_both_numbers():
    mm = perturbed_merge_model()
    spec = export_spec(mm)
    ids = torch.zeros(1, N_MAX + 3, dtype=torch.long)
    with pytest.raises(ConfigError, match=rf"{N_MAX + 3}.*N_max={N_MAX}"):
        mm(ids)
    with pytest.raises(ConfigError, match=rf"{N_MAX + 3}.*N_max={N_MAX}"):
        merged_forward(spec, torch.zeros(1, N_MAX + 3, 16, dtype=torch.float64))
    with pytest.raises(ConfigError, match=rf"{N_MAX + 1}.*N_max={N_MAX}"):
        merge_generate_plain(spec, torch.zeros(1, 4, 16, dtype=torch.float64), N_MAX - 2)


def test_alignment_loss_hand_worked():
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])  # (1, 3, 2)
    embeds = torch.tensor([[[9.0, 9.0], [2.0, 0.0], [-1.0, 1.0]]])
    # pairs (h0, E1): cos = 1 -> 0; (h1, E2): cos = 1/sqrt(2) -> 1 - 0.70711
    expected = (0.0 + (1 - 2**-0.5)) / 2
    assert alignment_loss(hidden, embeds).item() == pytest.approx(expected, abs=1e-6)
    mask = torch.tensor([[True, True, False]])  # only the first pair counts
    assert alignment_loss(hidden, embeds, mask).item() == pytest.approx(0.0, abs=1e-6)


def test_augmentation_identity_and_statistics():
    E = torch.randn(4, 8, 16)
    assert torch.equal(augment_embeddings(E, dropout=0.0, noise=0.0), E)
    g = torch.Generator().manual_seed(0)
    big = torch.ones(200, 200)
    out = augment_embeddings(big, dropout=0.6, noise=0.0, generator=g)
    assert set(out.unique().tolist()) <= {0.0, 1.0}
    assert (out == 0).float().mean().item() == pytest.approx(0.6, abs=0.02)
    noisy = augment_embeddings(big, dropout=0.0, noise=0.75, generator=g)
    assert (noisy - 1).abs().max().item() <= 0.75


def test_er_training_reduces_losses():
    model = tiny_gpt2(dtype=torch.float32, d=32)
    batches = synthetic_batches()
    cfg = ERConfig(dropout=0.1, noise=0.05, lam=0.5)
    before = [er_loss(model, b, cfg=ERConfig(dropout=0.0, noise=0.0, lam=0.5)) for b in batches]
    train_er(model, batches, steps=30, lr=5e-3, cfg=cfg)
    after = [er_loss(model, b, cfg=ERConfig(dropout=0.0, noise=0.0, lam=0.5)) for b in batches]
    for name in ("align", "ce", "total"):
        b0 = sum(getattr(x, name).item() for x in before)
        b1 = sum(getattr(x, name).item() for x in after)
        assert b1 < b0, (name, b0, b1)


def test_mm_distillation_reduces_loss_and_stays_exactly_mergeable():
    teacher = tiny_gpt2(dtype=torch.float32, d=32)
    batches = synthetic_batches()
    student = build_merge_model(teacher, batches, N_MAX)
    losses = train_mm(student, teacher, batches, steps=16, lr=3e-3)
    assert sum(losses[-4:]) < sum(losses[:4])
    spec = export_spec(student.double())
    ids = batches[0]
    torch.testing.assert_close(merged_forward(spec, student.wte(ids)), student(ids).hidden[-1], atol=1e-5, rtol=0)


def test_bad_configs_raise():
    with pytest.raises(ConfigError, match="dropout"):
        ERConfig(dropout=1.0)
    with pytest.raises(ConfigError, match="lam"):
        ERConfig(lam=2.0)
    with pytest.raises(ConfigError, match="n_new"):
        merge_generate(perturbed_merge_model(), torch.zeros(1, 3, dtype=torch.long), 0)
