"""FedSGD (SEB paper Sec. 3.2, eq. 1) on a tiny GPT-2: client gradients against a manual autograd
computation, and the server update theta^{t+1} = theta^t - lr * sum_i grad_i, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

from core.attacks.federated import (
    FedSGDSimulation,
    aggregate_gradients,
    client_gradient,
    fedsgd_round,
    lm_labels,
    pad_sequences,
)
from core.errors import ConfigError, DataError
from core.models.gpt2 import tiny_gpt2 as build_tiny_gpt2

V, EOS, PAD = 500, 499, 498


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = build_tiny_gpt2(
        V, n_layer=1, n_embd=32, n_head=2, n_positions=32, eos_token_id=EOS, tie_word_embeddings=False
    )
    return model.eval()


def batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.cat([torch.randint(0, PAD, (n - 1,), generator=gen), torch.tensor([EOS])]) for n in lengths]
    return pad_sequences(seqs, pad_id=PAD)


@pytest.fixture(scope="module")
def model() -> GPT2LMHeadModel:
    return tiny_gpt2()


def manual_gradient(model: GPT2LMHeadModel, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Slow reference: shifted cross-entropy written out, .backward(), read .grad."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
    labels = ids.masked_fill(~mask, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def test_lm_labels_and_padding() -> None:
    ids, mask = pad_sequences([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=PAD)
    assert ids.tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert mask.tolist() == [[True, True, True], [True, False, False]]
    assert lm_labels(ids, mask).tolist() == [[1, 2, 3], [4, -100, -100]]


def test_client_gradient_matches_manual_autograd_and_leaves_no_grad(model: GPT2LMHeadModel) -> None:
    ids, mask = batch([7, 4, 9], seed=1)
    got = client_gradient(model, ids, mask)
    assert all(p.grad is None for p in model.parameters())
    ref = manual_gradient(model, ids, mask)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_client_gradient_rejects_empty_batches(model: GPT2LMHeadModel) -> None:
    with pytest.raises(DataError, match="empty batch"):
        client_gradient(model, torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, dtype=torch.bool))
    one_token = torch.tensor([[3, PAD]]), torch.tensor([[True, False]])
    with pytest.raises(DataError, match="no next-token target"):
        client_gradient(model, *one_token)
    with pytest.raises(DataError, match="shape"):
        client_gradient(model, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool))


def test_fedsgd_round_applies_eq1_exactly() -> None:
    model = tiny_gpt2(seed=3)
    before = copy.deepcopy(model)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    clients = [batch([5, 8], seed=10), batch([6], seed=11), batch([4, 4, 9], seed=12)]
    lr = 0.05
    grads = fedsgd_round(model, clients, lr=lr)
    assert len(grads) == 3
    for name, p in model.named_parameters():
        expected = theta[name] - lr * (grads[0][name] + grads[1][name] + grads[2][name])
        assert torch.equal(p.detach(), expected), name
    # every client's gradient was taken at the same theta^t (the parameters before the update)
    for (ids, mask), g in zip(clients, grads, strict=True):
        ref = client_gradient(before, ids, mask)
        assert all(torch.equal(g[n], ref[n]) for n in ref)
    assert all(p.grad is None for p in model.parameters())


def test_fedsgd_validation() -> None:
    model = tiny_gpt2()
    with pytest.raises(ConfigError, match="lr"):
        fedsgd_round(model, [batch([4], seed=0)], lr=0.0)
    with pytest.raises(DataError, match="no client"):
        fedsgd_round(model, [], lr=0.1)
    with pytest.raises(DataError, match="aggregate"):
        aggregate_gradients([])


def test_simulation_round_is_seeded_and_updates_by_the_sum() -> None:
    clients = [batch([5, 7, 4, 6], seed=20), batch([8, 3, 5], seed=21)]
    sim = FedSGDSimulation(tiny_gpt2(seed=4), clients, lr=0.1)
    theta = {n: p.detach().clone() for n, p in sim.model.named_parameters()}
    batches, grads = sim.round(2, torch.Generator().manual_seed(7))
    total = aggregate_gradients(grads)
    for name, p in sim.model.named_parameters():
        assert torch.equal(p.detach(), theta[name] - 0.1 * total[name]), name
    assert sim.rounds_done == 1 and len(batches) == 2
    for (ids, mask), (all_ids, all_mask) in zip(batches, clients, strict=True):
        assert ids.shape[0] == 2 and mask[:, -1].any()  # trailing all-padding columns are cut
        rows = {tuple(r[m].tolist()) for r, m in zip(all_ids, all_mask, strict=True)}
        assert all(tuple(r[m].tolist()) in rows for r, m in zip(ids, mask, strict=True))
    again = FedSGDSimulation(tiny_gpt2(seed=4), clients, lr=0.1)
    batches2 = again.sample_batches(2, torch.Generator().manual_seed(7))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, batches2, strict=True))
    with pytest.raises(ConfigError, match="batch_size"):
        sim.round(4, torch.Generator().manual_seed(0))
    with pytest.raises(DataError, match="at least one client"):
        FedSGDSimulation(tiny_gpt2(), [], lr=0.1)
