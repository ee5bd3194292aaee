"""Phantom Clipping (Claim 4.1) against brute force: one forward + backward per sample.

Transformers are checked in both block layouts: pre-LN (``norm_first=True``) and the post-LN encoder of
Vaswani et al. that the DP methods use (``norm_first=False``, App. E.2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core.dp.clipping import make_clipper
from core.dp.methods import build_reattention
from core.dp.phantom import PhantomClipping
from core.errors import ConfigError, PrivacyError
from core.models import SeqRecConfig, build_seqrec, sequence_loss

M, L = 12, 6
IDS = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 3, 5, 12], [0, 0, 0, 0, 0, 7], [9, 9, 9, 2, 1, 4]])
TARGETS = torch.tensor([[0, 0, 4, 5, 6, 7], [2, 3, 4, 5, 12, 1], [0, 0, 0, 0, 0, 3], [9, 9, 2, 1, 4, 4]])


def _model(arch="transformer", tied=True, dtype=torch.float64, seed=0, norm_first=True):
    torch.manual_seed(seed)
    cfg = SeqRecConfig(
        num_items=M, max_len=L, d_model=8, n_heads=2, n_layers=2, dropout=0.0, tied=tied, arch=arch,
        norm_first=norm_first,
    )  # fmt: skip
    return build_seqrec(cfg).to(dtype)


def _loss(model, ids=IDS, targets=TARGETS):
    return sequence_loss(model(ids), targets)


def brute_force(model, loss_fn, n):
    """Per-sample gradients by a separate forward and backward of each sample: list of [grad per param]."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(n):
        grads = torch.autograd.grad(loss_fn(i).sum(), params, allow_unused=True)
        out.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
    return params, out


def _norms(per_sample):
    return torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in grads)) for grads in per_sample])


def _phantom_step(model, loss, coef_seed=1, strategy="auto"):
    with PhantomClipping(model, strategy=strategy) as phantom:
        norms = phantom.per_sample_norms(loss(model))
        coef = torch.rand(norms.shape[0], generator=torch.Generator().manual_seed(coef_seed), dtype=norms.dtype)
        phantom.accumulate_grad(coef)
    return norms, coef


def _check_against_brute_force(model, rtol=1e-4, strategy="auto", loss=_loss, ids=IDS, targets=TARGETS):
    params, per_sample = brute_force(model, lambda i: loss(model, ids[i : i + 1], targets[i : i + 1]), len(ids))
    norms, coef = _phantom_step(model, lambda m: loss(m, ids, targets), strategy=strategy)
    torch.testing.assert_close(norms, _norms(per_sample), rtol=rtol, atol=1e-7)
    for k, p in enumerate(params):
        expected = sum(coef[i] * per_sample[i][k] for i in range(len(ids)))
        torch.testing.assert_close(p.grad, expected, rtol=rtol, atol=1e-7)


LAYOUTS = [("transformer", True), ("transformer", False), ("gru", True), ("lstm", True)]


@pytest.mark.parametrize(("arch", "norm_first"), LAYOUTS, ids=["pre_ln", "post_ln", "gru", "lstm"])
@pytest.mark.parametrize("tied", [True, False])
def test_norms_and_weighted_sum_match_brute_force(arch, norm_first, tied):
    _check_against_brute_force(_model(arch, tied, norm_first=norm_first))


@pytest.mark.parametrize("strategy", ["ghost", "direct"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_forced_strategies_are_exact(strategy, tied, norm_first):
    _check_against_brute_force(_model(tied=tied, norm_first=norm_first), strategy=strategy)


def test_float32_close_and_dtype_preserved():
    model = _model(dtype=torch.float32)
    _check_against_brute_force(model, rtol=1e-4)
    norms, _ = _phantom_step(model, _loss)
    assert norms.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    norms64, _ = _phantom_step(_model(), _loss)
    assert norms64.dtype == torch.float64


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_auto_strategy_mixes_ghost_and_direct_layers(tied, norm_first):
    # d=16, T=8: attention Linears (16x16) and positions are materialised, the FFN (16x64),
    # the untied output layer and the item embedding use ghost norms
    torch.manual_seed(3)
    cfg = SeqRecConfig(
        num_items=40, max_len=8, d_model=16, n_heads=1, n_layers=1, dropout=0.0, tied=tied,
        norm_first=norm_first,
    )  # fmt: skip
    model = build_seqrec(cfg).double()
    ids = torch.randint(0, 41, (3, 8))
    targets = torch.randint(1, 41, (3, 8))
    _check_against_brute_force(model, ids=ids, targets=targets)


class TiedWithPaddingIdx(nn.Module):
    """An embedding with padding_idx tied to the output layer, no masking of padding positions."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(M + 1, 5, padding_idx=0)
        self.mix = nn.Linear(5, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, M + 1, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        h = h + torch.tanh(self.mix(input=h)).cumsum(dim=1)  # positions interact; keyword input
        return self.out(self.norm(h))


def test_padding_idx_rows_are_excluded_like_autograd():
    torch.manual_seed(0)
    model = TiedWithPaddingIdx().double()
    _check_against_brute_force(model)
    assert model.emb.weight.grad[0].abs().sum() > 0  # output side still reaches the padding row


def test_hooks_are_removed_after_use():
    model = _model()
    with PhantomClipping(model) as phantom:
        assert any(m._forward_hooks for m in model.modules())
        phantom.per_sample_norms(_loss(model))
    assert not any(m._forward_hooks for m in model.modules())
    phantom.remove()  # idempotent
    with pytest.raises(PrivacyError, match="removed"):
        _loss(model)
        phantom.per_sample_norms(_loss(model))


class WithConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(M + 1, 4)
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, ids):
        return self.conv(self.emb(ids).transpose(1, 2))


def test_unsupported_layer_lists_supported_modules():
    with pytest.raises(ConfigError, match=r"conv \(Conv1d\).*nn\.Linear, nn\.Embedding, nn\.LayerNorm"):
        PhantomClipping(WithConv())
    frozen = WithConv()
    frozen.conv.requires_grad_(False)
    PhantomClipping(frozen).remove()  # frozen parameters need no per-sample norm


def test_embedding_options_that_change_gradients_are_rejected():
    with pytest.raises(ConfigError, match="scale_grad_by_freq"):
        PhantomClipping(nn.Embedding(5, 2, scale_grad_by_freq=True))
    with pytest.raises(ConfigError, match="unknown strategy"):
        PhantomClipping(_model(), strategy="fast")


class _EmbeddingHead(nn.Module):
    """An embedding and a linear head; each subclass below uses them in a way Phantom Clipping must refuse."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(M + 1, 4)
        self.head = nn.Linear(4, M + 1)


class FunctionalUse(_EmbeddingHead):
    def forward(self, ids):
        return F.linear(self.emb(ids), self.head.weight)  # bypasses head's forward


class SeqFirst(_EmbeddingHead):
    def forward(self, ids):
        return self.head(self.emb(ids).transpose(0, 1)).transpose(0, 1)  # head sees (L, B, d)


class InPlace(_EmbeddingHead):
    def forward(self, ids):
        h = self.emb(ids)
        out = self.head(h)
        h.mul_(2.0)
        return out


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (FunctionalUse, "without a recorded call"),  # a functional use of a parameter is detected
        (SeqFirst, "batch size 6"),  # a layer without a batch-first dimension raises
        (InPlace, "modified in place"),  # an in-place modification is detected
    ],
)
def test_misused_layers_raise_privacy_errors(module: type[_EmbeddingHead], message: str):
    model = module()
    with PhantomClipping(model) as phantom, pytest.raises(PrivacyError, match=message):
        phantom.per_sample_norms(_loss(model))


def test_misuse_raises_privacy_errors():
    model = _model()
    with PhantomClipping(model) as phantom:
        with pytest.raises(PrivacyError, match="no forward pass"):
            phantom.per_sample_norms(torch.ones(2, requires_grad=True))
        with pytest.raises(PrivacyError, match="per_sample_norms first"):
            phantom.accumulate_grad(torch.ones(4))
        with torch.no_grad():
            detached = _loss(model)
        with pytest.raises(PrivacyError, match="no forward pass"):
            phantom.per_sample_norms(detached)


def test_unused_forward_and_unused_parameters_are_ignored():
    torch.manual_seed(0)
    model = _model()
    extra = nn.Linear(3, 3).double()
    model.extra = extra  # trainable, never called
    params, per_sample = brute_force(model, lambda i: _loss(model, IDS[i : i + 1], TARGETS[i : i + 1]), 4)
    with PhantomClipping(model) as phantom:
        model(IDS[:2])  # an evaluation forward with grad enabled, not part of the loss
        norms = phantom.per_sample_norms(_loss(model))
        phantom.accumulate_grad(torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(norms, _norms(per_sample))
    assert torch.count_nonzero(extra.weight.grad) == 0
    for k, p in enumerate(params):
        torch.testing.assert_close(p.grad, sum(g[k] for g in per_sample))


def test_accumulate_adds_to_existing_grad():
    model = _model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with PhantomClipping(model) as phantom:
        phantom.per_sample_norms(_loss(model))
        phantom.accumulate_grad(torch.zeros(4, dtype=torch.float64))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("norm_first", [True, False])
def test_exact_with_a_re_attention_score_correction(norm_first):
    def correction(logits, query):  # differentiable in the queries, like a per-query Re-Attention C
        return logits - 0.1 * query.pow(2).sum(-1, keepdim=True) * torch.linspace(0, 1, logits.shape[-1]).to(logits)

    def loss(model, ids, targets):
        return sequence_loss(model(ids, score_correction=correction), targets)

    _check_against_brute_force(_model(norm_first=norm_first), loss=loss)


@pytest.mark.parametrize("tied", [True, False])
def test_post_ln_opacus_hooks_and_phantom_agree(tied):
    """Post-LN (the DP methods' layout) with the model's own Re-Attention correction: Opacus' materialised
    per-sample gradients and Phantom Clipping give the same norms and the same clipped sum."""
    ids = torch.cat([IDS, IDS.flip(0)])
    targets = torch.cat([TARGETS, TARGETS.flip(0)])
    results = []
    for method in ("phantom", "opacus_hooks"):
        model = _model(tied=tied, norm_first=False).train()  # dropout 0: deterministic
        reattention = build_reattention(
            model, ids, targets, noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=4.0
        )
        clipper = make_clipper(method, model, clip_norm=1.0, normalize=True)
        try:
            logits = clipper.model(ids, score_correction=reattention.for_batch(ids))
            norms = clipper.backward(sequence_loss(logits, targets))
        finally:
            clipper.close()
        results.append((norms, [p.grad for p in model.parameters()]))
    (norms_phantom, grads_phantom), (norms_opacus, grads_opacus) = results
    torch.testing.assert_close(norms_phantom, norms_opacus, rtol=1e-6, atol=1e-9)
    for a, b in zip(grads_phantom, grads_opacus, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
