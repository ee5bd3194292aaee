"""The shared embedding's norm, each way it is computed, against brute force (one backward per sample):
Claim 4.1 with the ghost ``||G^T H||^2`` or with ``grad e_c = G^T H`` materialised (the cost-based choice of
``strategy="auto"``), and the paper's baseline, Ghost Clipping over the L + M lookups (``core.dp.ghost_tied``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core.dp import phantom as phantom_module
from core.dp.ghost_tied import GhostTiedClipping, ghost_tied_sq_norm, gram_bytes
from core.dp.phantom import PhantomClipping
from core.models import SeqRecConfig, build_seqrec, sequence_loss


def _tiny(seq_len: int, d_model: int, items: int = 40, norm_first: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    cfg = SeqRecConfig(
        num_items=items, max_len=seq_len, d_model=d_model, n_heads=2, n_layers=1, dropout=0.0, tied=True,
        norm_first=norm_first,
    )  # fmt: skip
    model = build_seqrec(cfg).double()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, items + 1, (3, seq_len), generator=g)  # padding (0) included
    ids[0, 0] = ids[0, 1]  # a repeated id in a sequence
    targets = torch.randint(1, items + 1, (3, seq_len), generator=g)
    return model, ids, targets


def _brute_force(model, ids, targets):
    params = [p for p in model.parameters() if p.requires_grad]
    per_sample = []
    for i in range(len(ids)):
        loss = sequence_loss(model(ids[i : i + 1]), targets[i : i + 1]).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        per_sample.append([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)])
    return params, per_sample


def _check(clipping_cls, model, ids, targets):
    params, per_sample = _brute_force(model, ids, targets)
    expected = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per_sample])
    coef = torch.rand(len(ids), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with clipping_cls(model) as clipping:
        norms = clipping.per_sample_norms(sequence_loss(model(ids), targets))
        clipping.accumulate_grad(coef)
    torch.testing.assert_close(norms, expected, rtol=1e-10, atol=1e-12)
    for k, p in enumerate(params):
        torch.testing.assert_close(p.grad, sum(coef[i] * per_sample[i][k] for i in range(len(ids))))


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of the materialised branch of eq. 4.1."""
    calls: list[int] = []
    materialised = phantom_module._tied_output_terms

    def counted(e, lin):
        calls.append(lin.grads.shape[0])
        return materialised(e, lin)

    monkeypatch.setattr(phantom_module, "_tied_output_terms", counted)
    return calls


# (seq_len, d_model): L (M + 2d) against d M with M = 41 rows
GHOST_SHAPE, MATERIALISED_SHAPE, MATERIALISED_KEPT_SHAPE = (3, 16), (12, 8), (12, 4)


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize(
    ("shape", "materialises"), [(GHOST_SHAPE, False), (MATERIALISED_SHAPE, True), (MATERIALISED_KEPT_SHAPE, True)]
)
def test_auto_choice_of_the_tied_output_norm_is_exact(shape, materialises, norm_first, spy, one_thread):
    seq_len, d = shape
    M = 41
    assert phantom_module._tied_ghost_is_cheaper(
        phantom_module._LinearUse(torch.zeros(1, seq_len, d), torch.zeros(1, seq_len, M))
    ) is (not materialises)
    model, ids, targets = _tiny(seq_len, d, norm_first=norm_first)
    _check(PhantomClipping, model, ids, targets)
    assert bool(spy) is materialises


def test_materialised_branch_chunks_samples_exactly(monkeypatch: pytest.MonkeyPatch, one_thread):
    """One sample per chunk (B L / (8 d) < 2; d > L / 2, so grad e_c is not kept) and a batch that is not a
    multiple of the chunk."""
    model, ids, targets = _tiny(12, 8)
    ids, targets = torch.cat([ids, ids[:2]]), torch.cat([targets, targets[:2].flip(1)])
    _check(PhantomClipping, model, ids, targets)


@pytest.mark.parametrize("shape", [GHOST_SHAPE, MATERIALISED_SHAPE])
@pytest.mark.parametrize("norm_first", [True, False])
def test_ghost_tied_baseline_is_exact(shape, norm_first, spy, one_thread):
    model, ids, targets = _tiny(*shape, norm_first=norm_first)
    _check(GhostTiedClipping, model, ids, targets)
    assert not spy  # the baseline never takes Claim 4.1's branches


def test_ghost_tied_forms_the_l_plus_m_gram_and_agrees_with_claim_4_1(one_thread):
    B, L, M, d = 2, 3, 7, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, M, (B, L), generator=g)
    e = phantom_module._EmbeddingUse(ids, torch.randn(B, L, d, generator=g, dtype=torch.float64), M)
    lin = phantom_module._LinearUse(
        torch.randn(B, L, d, generator=g, dtype=torch.float64), torch.randn(B, L, M, generator=g, dtype=torch.float64)
    )
    dense = torch.zeros(B, M, d, dtype=torch.float64)  # a_s^T grad e_s + G^T H, materialised
    dense.scatter_add_(1, ids.unsqueeze(-1).expand(B, L, d), e.grads)
    dense += torch.bmm(lin.grads.transpose(1, 2), lin.acts)
    expected = dense.flatten(1).pow(2).sum(1)
    torch.testing.assert_close(ghost_tied_sq_norm(e, lin), expected)
    phantom = (
        phantom_module._embedding_sq_norm(e)
        + phantom_module._linear_sq_norm(lin)
        + 2 * phantom_module._embedding_linear_dot(e, lin)
    )
    torch.testing.assert_close(phantom, expected)
    terms, kept = phantom_module._tied_output_terms(e, lin)  # d = 4 > L / 2: chunked, nothing kept
    torch.testing.assert_close(phantom_module._embedding_sq_norm(e) + terms, expected)
    assert kept is None
    assert gram_bytes(1, 128, 50257) == (128 + 50257) ** 2 * 5  # 12.7 GB at batch 1: the O(B M^2) term


class OutputInPlace(nn.Module):
    """A module output modified in place after the call (its edge keeps the gradient exact)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4)
        self.mix = nn.Linear(4, 4)
        self.out = nn.Linear(4, 9, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        h = self.mix(self.emb(ids))
        h.mul_(torch.linspace(0.5, 2.0, 4, dtype=h.dtype))
        return self.out(torch.tanh(h))


def test_output_modified_in_place_is_still_exact(one_thread):
    torch.manual_seed(0)
    model = OutputInPlace().double()
    ids = torch.tensor([[1, 2, 2, 0], [3, 4, 5, 8], [0, 0, 7, 7]])
    _check(PhantomClipping, model, ids, ids.roll(1, dims=1))
