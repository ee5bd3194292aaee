"""The secure-inference stage's LM training loop and data helpers (``core.mpc.finetune``)."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError, DataError
from core.models.gpt2 import tiny_gpt2
from core.mpc.finetune import (
    DialogueData,
    block_loss,
    blocks_loss,
    eval_prompts,
    finetune_lm,
    lm_batches,
    lm_loss,
    pretrain_lm,
    stream_blocks,
    usable_prompts,
)

V = 40


def _data(n: int = 12, t: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[::3, 7:] = False  # some right padding
    return ids, mask


def _model(dropout: float = 0.0) -> torch.nn.Module:
    return tiny_gpt2(V, n_layer=1, n_embd=16, n_head=2, n_positions=16, dropout=dropout, eos_token_id=0, seed=0)


def _reference_loop(model: torch.nn.Module, batches: list, steps: int, lr: float) -> list[float]:
    """The hand-written AdamW loop the secure-inference task had before the core loop."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        ids, mask = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids.masked_fill(~mask.bool(), -100)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def test_lm_batches_are_a_seeded_partition() -> None:
    ids, mask = _data()
    batches = lm_batches(ids, mask, 5, seed=3)
    assert [b[0].shape[0] for b in batches] == [5, 5, 2]
    rows = torch.cat([b[0] for b in batches])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, ids.tolist()))
    again = lm_batches(ids, mask, 5, seed=3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))
    with pytest.raises(ConfigError, match="batch_size"):
        lm_batches(ids, mask, 0, seed=0)


def test_finetune_lm_matches_the_old_loop_and_learns() -> None:
    batches = lm_batches(*_data(), 4, seed=0)
    model, ref = _model(), _model()
    losses = finetune_lm(model, batches, 12, 1e-2)
    assert losses == _reference_loop(ref, batches, 12, 1e-2)  # no dropout: the very same steps
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not model.training
    assert losses[-1] < losses[0]
    ids, mask = _data()
    assert lm_loss(model, ids, mask) < lm_loss(_model(), ids, mask)  # lower than the untrained model's


def test_finetune_lm_is_deterministic_with_a_seed_and_leaves_the_global_rng() -> None:
    batches = lm_batches(*_data(), 4, seed=0)
    state = torch.random.get_rng_state()
    a = finetune_lm(_model(dropout=0.1), batches, 6, 1e-2, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert a == finetune_lm(_model(dropout=0.1), batches, 6, 1e-2, seed=5)
    assert a != finetune_lm(_model(dropout=0.1), batches, 6, 1e-2, seed=6)  # dropout draws from the seed
    with pytest.raises(ConfigError, match="steps >= 1"):
        finetune_lm(_model(), batches, 0, 1e-2)
    with pytest.raises(ConfigError, match="at least one batch"):
        finetune_lm(_model(), [], 3, 1e-2)


def test_eval_prompts_and_content_hash() -> None:
    eos = 0
    encoded = [
        ([5, 6, 7, eos], [8, 9, eos]),
        ([5, eos], [3, eos]),
        ([1, 2, 3, 4, eos], [eos]),
        ([9, 9, 9, eos], [4, 4, 4, 4, eos]),
    ]
    out = eval_prompts(encoded, prefix_len=3, gen_len=2, n_prompts=2, eos=eos)
    assert out["prefix"].tolist() == [[6, 7, eos], [9, 9, eos]] and out["references"] == [[8, 9], [4, 4]]
    with pytest.raises(DataError, match="prefix_len=3"):
        eval_prompts(encoded, prefix_len=3, gen_len=2, n_prompts=3, eos=eos)
    ids, mask = _data()

    def data(corpus: str, first: int) -> DialogueData:
        changed = ids.clone()
        changed[0, 0] = first
        return DialogueData(corpus, 10, 2, changed, mask, ids[:2], mask[:2], [], [])

    assert data("a", 1).content_hash() == data("a", 1).content_hash()
    assert data("a", 1).content_hash() != data("a", 2).content_hash() != data("b", 2).content_hash()


# ----------------------------------------------------------------------------------------------- pretraining


def test_stream_blocks_hold_out_every_hundredth_block() -> None:
    stream = torch.arange(1000 * 4 + 3)  # 1000 whole blocks of 4, 3 tokens left over
    train, val = stream_blocks(stream, 4)
    assert train.shape == (990, 4) and val.shape == (10, 4)
    assert val[:, 0].tolist() == [4 * i for i in range(0, 1000, 100)]  # blocks 0, 100, ..., 900
    assert torch.equal(torch.cat([train, val]).flatten().sort().values, stream[:4000])
    with pytest.raises(DataError, match="fewer than 2 blocks of 8"):
        stream_blocks(torch.arange(10), 8)


def test_block_loss_over_kept_ids_equals_the_full_softmax_restricted_to_them() -> None:
    model = _model().eval()
    keep = torch.tensor([1, 3, 4, 7, 9, 20, 33])
    ids = keep[torch.randint(0, keep.numel(), (3, 9), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, :-1]  # (3, 8, V): the slow reference, every logit
        logp = torch.log_softmax(full[..., keep], dim=-1)  # softmax over the kept columns only
        target = (ids[:, 1:, None] == keep).float().argmax(-1)
        want = -logp.gather(-1, target[..., None]).mean()
        assert torch.allclose(block_loss(model, ids, keep), want, atol=1e-6)
        assert torch.allclose(block_loss(model, ids), model(input_ids=ids, labels=ids).loss)
        assert float(block_loss(model, ids, keep)) < float(block_loss(model, ids))  # less mass to share
    with pytest.raises(DataError, match="not in keep"):
        block_loss(model, torch.tensor([[1, 2, 3]]), keep)


def test_pretrain_lm_learns_is_deterministic_and_names_bad_settings() -> None:
    stream = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12] * 60)  # a cycle a model learns in a few steps
    train, val = stream_blocks(stream, 8, val_every=10)
    keep = torch.unique(stream)
    runs = []
    for _ in range(2):
        model = _model(dropout=0.1)
        state = torch.random.get_rng_state()
        fit = pretrain_lm(
            model, train, val, steps=40, lr=1e-2, batch_size=4, warmup=5, eval_every=10, keep=keep, seed=3
        )
        assert torch.equal(torch.random.get_rng_state(), state) and not model.training
        runs.append(fit)
    a, b = runs
    assert a["train_loss"] == b["train_loss"] and a["val_curve"] == b["val_curve"]
    assert [s for s, _ in a["val_curve"]] == [10, 20, 30, 40] and a["val_loss"] == a["val_curve"][-1][1]
    assert a["val_loss"] < 0.5 < math.log(keep.numel())  # far below the uniform guess over the kept ids
    assert a["val_loss"] == pytest.approx(blocks_loss(model, val, keep), abs=1e-6)
    with pytest.raises(ConfigError, match="warmup >= 0"):
        pretrain_lm(_model(), train, val, steps=1, lr=1e-3, batch_size=2, warmup=-1, eval_every=1)
    with pytest.raises(DataError, match=r"\(rows, T\)"):
        pretrain_lm(_model(), train[0], val, steps=1, lr=1e-3, batch_size=2, warmup=0, eval_every=1)


def test_usable_prompts_is_the_filter_eval_prompts_picks_from() -> None:
    eos = 9
    pairs = [([1, 2, eos], [3, eos]), ([1, eos], [4]), ([1, 2, 3, eos], [eos, eos]), ([5, 6, eos], [eos, 7])]
    assert usable_prompts(pairs, prefix_len=3, eos=eos) == [pairs[0], pairs[3]]  # short prefix; EOS-only response
    prompts = eval_prompts(pairs, prefix_len=3, gen_len=4, n_prompts=2, eos=eos)
    assert prompts["prefix"].tolist() == [[1, 2, eos], [5, 6, eos]] and prompts["references"] == [[3], [7]]
