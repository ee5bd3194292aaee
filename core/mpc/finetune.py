"""The secure-inference stage's training data and its language-model training loops (MERGE, stage 4).

:func:`dialogue_data` turns an offline corpus (:mod:`core.mpc.textdata`) into GPT-2 token sequences: the
(prefix, response) pairs are deduplicated, shuffled with the seed and split into test and train, then packed
into right-padded ``(ids, mask)`` sequences and seeded minibatches. :func:`finetune_lm` trains a causal LM
(the GPT-2 every method starts from) on them with AdamW; the students, the ER model and the merge modules are
trained from it by :func:`core.mpc.approx.distill`, :func:`core.mpc.merge.train_er` and
:func:`core.mpc.merge.train_mm`. :func:`pretrain_lm` pretrains that GPT-2 first on blocks of English text
(:func:`stream_blocks`), with warm-up, cosine decay and a validation curve.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from core.divergence import DivergenceGuard
from core.errors import ConfigError, DataError
from core.mpc.textdata import EOS_ID, encode_pairs, lm_sequences, text_pairs

__all__ = [
    "DialogueData",
    "block_loss",
    "blocks_loss",
    "dialogue_data",
    "eval_prompts",
    "finetune_lm",
    "lm_batches",
    "lm_loss",
    "pretrain_lm",
    "stream_blocks",
    "usable_prompts",
]

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True, eq=False)
class DialogueData:
    """The split and encoded corpus: training sequences ``ids``/``mask`` ``(n, max_len)`` and their minibatches,
    test sequences, and the encoded test pairs the evaluation prompts are picked from."""

    corpus: str
    n_train_pairs: int
    n_test_pairs: int
    ids: Tensor
    mask: Tensor
    test_ids: Tensor
    test_mask: Tensor
    test_pairs: list[tuple[list[int], list[int]]] = field(repr=False)
    batches: list[Batch] = field(repr=False)

    def content_hash(self) -> str:
        """sha256 of the corpus name and every training and test token (what a trained model depends on)."""
        digest = hashlib.sha256(self.corpus.encode())
        for t in (self.ids, self.mask, self.test_ids, self.test_mask):
            digest.update(f"|{tuple(t.shape)}|".encode())
            digest.update(t.contiguous().numpy().tobytes())
        return digest.hexdigest()


def lm_batches(ids: Tensor, mask: Tensor, batch_size: int, seed: int) -> list[Batch]:
    """``(ids, mask)`` minibatches of ``batch_size`` rows (the last one smaller) in a seeded random order."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size=}")
    order = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(seed))
    return [(ids[i], mask[i]) for i in order.split(batch_size)]


def dialogue_data(
    tokenizer: Any,
    corpus: str = "auto",
    *,
    max_pairs: int | None,
    max_len: int,
    batch_size: int,
    n_prompts: int,
    seed: int,
) -> DialogueData:
    """The (prefix, response) pairs of ``corpus``, deduplicated and shuffled with ``seed``; the first
    ``max(4 n_prompts, n / 10)`` are the test pairs, the rest the training pairs; both encoded with
    ``tokenizer`` into sequences of at most ``max_len`` tokens (:func:`~core.mpc.textdata.lm_sequences`)."""
    name, pairs = text_pairs(corpus, max_pairs=max_pairs)
    pairs = sorted(set(pairs))
    random.Random(seed).shuffle(pairs)
    n_test = max(n_prompts * 4, len(pairs) // 10)
    test, train = pairs[:n_test], pairs[n_test:]
    enc_train = encode_pairs(tokenizer, train, max_len=max_len)
    enc_test = encode_pairs(tokenizer, test, max_len=max_len)
    pad = tokenizer.eos_token_id  # padding is masked out; an id of the tokenizer's own vocabulary
    ids, mask = lm_sequences(enc_train, max_len=max_len, pad_id=pad)
    test_ids, test_mask = lm_sequences(enc_test, max_len=max_len, pad_id=pad)
    return DialogueData(
        name,
        len(train),
        len(test),
        ids,
        mask,
        test_ids,
        test_mask,
        enc_test,
        lm_batches(ids, mask, batch_size, seed),
    )


def finetune_lm(model: nn.Module, batches: Sequence[Batch], steps: int, lr: float, *, seed: int = 0) -> list[float]:
    """Next-token training of a causal LM (``model(input_ids=, labels=).loss``, e.g. a ``GPT2LMHeadModel``) with
    ``torch.optim.AdamW`` at a constant ``lr``, one step per batch, the ``(ids, mask)`` batches cycled in order;
    padding (``mask`` False) is left out of the loss. Dropout draws from ``seed`` (the global RNG is left as it
    was), so the result is deterministic. Returns the loss of every step; ``model`` ends in eval mode.
    A NaN/inf or exploding loss raises :class:`~core.errors.DivergedError`."""
    batches = list(batches)
    if steps < 1 or not lr > 0:
        raise ConfigError(f"finetune_lm needs steps >= 1 and lr > 0, got {steps=}, {lr=}")
    if not batches:
        raise ConfigError("finetune_lm needs at least one batch, got none")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    guard = DivergenceGuard(hint=f"lower the learning rate (lr={lr:g})")
    losses: list[float] = []
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            ids, mask = batches[step % len(batches)]
            loss = model(input_ids=ids, labels=ids.masked_fill(~mask.bool(), -100)).loss
            losses.append(guard.check(loss, step=step + 1))  # DivergedError: NaN/inf or exploding
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    return losses


def stream_blocks(stream: Tensor, block: int, *, val_every: int = 100) -> tuple[Tensor, Tensor]:
    """A token stream ``(n,)`` cut into ``block``-token rows, the last partial one dropped: every ``val_every``-th
    row (the 1st, the ``val_every + 1``-th, ...; spread over the whole stream, so over every corpus in it) is held
    out for validation. Returns ``(train, val)``, each ``(rows, block)``."""
    n = stream.numel() // block
    if n < 2:
        raise DataError(f"a stream of {stream.numel()} tokens gives fewer than 2 blocks of {block}; add text")
    rows = stream[: n * block].view(n, block)
    held = torch.zeros(n, dtype=torch.bool)
    held[:: max(val_every, 2)] = True
    return rows[~held], rows[held]


def block_loss(model: nn.Module, ids: Tensor, keep: Tensor | None = None) -> Tensor:
    """Mean next-token loss of a ``GPT2LMHeadModel`` on full blocks ``ids (B, T)``, the softmax taken over the
    vocabulary ids ``keep`` only (``None``: all of them; then it equals ``model(input_ids=ids, labels=ids).loss``).
    Every target must be in ``keep``."""
    if keep is None:
        return model(input_ids=ids, labels=ids).loss
    hidden = model.transformer(input_ids=ids).last_hidden_state[:, :-1]  # (B, T-1, d), after ln_f
    table = model.get_output_embeddings().weight  # (V, d), tied to the input embedding
    index = torch.full((table.shape[0],), -1, dtype=torch.long)
    index[keep] = torch.arange(keep.numel())
    target = index[ids[:, 1:]]  # (B, T-1) positions in keep
    if bool((target < 0).any()):
        raise DataError("a target token is not in keep; build keep from every token of the blocks")
    logits = hidden @ table[keep].T  # (B, T-1, K)
    return nn.functional.cross_entropy(logits.reshape(-1, keep.numel()), target.reshape(-1))


def pretrain_lm(
    model: nn.Module,
    train: Tensor,
    val: Tensor,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    warmup: int,
    eval_every: int,
    keep: Tensor | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Pretrain a causal LM (``GPT2LMHeadModel``) on token blocks ``train (n, T)``: AdamW (weight decay 0.1 on
    matrices), linear warm-up over ``warmup`` steps to ``lr``, cosine decay to ``lr / 10`` at ``steps``, gradient
    norm clipped at 1, minibatches of ``batch_size`` rows drawn epoch by epoch in a ``seed``-ed order, dropout
    from ``seed`` (the global RNG is left as it was). ``keep``: the softmax over these vocabulary ids only (the
    ids the text holds, :func:`block_loss`), which leaves the loss unchanged where the model gives the other
    ids no mass and halves the LM head's cost on GPT-2's vocabulary. The validation loss on ``val`` is
    measured every ``eval_every`` steps and at the end.

    Returns ``train_loss`` (every step), ``val_curve`` ``[(step, loss)]`` and ``val_loss`` (the last);
    ``model`` ends in eval mode. A NaN/inf or exploding loss raises :class:`~core.errors.DivergedError`."""
    if steps < 1 or not lr > 0 or batch_size < 1 or warmup < 0 or eval_every < 1:
        raise ConfigError(
            f"pretrain_lm needs steps >= 1, lr > 0, batch_size >= 1, warmup >= 0 and eval_every >= 1, got "
            f"{steps=}, {lr=}, {batch_size=}, {warmup=}, {eval_every=}"
        )
    if train.ndim != 2 or val.ndim != 2 or train.shape[0] < 1 or val.shape[0] < 1:
        shapes = f"{tuple(train.shape)}, {tuple(val.shape)}"
        raise DataError(f"pretrain_lm needs (rows, T) train and val blocks, got {shapes}")
    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}], lr=lr)

    def rate(step: int) -> float:  # multiplier of lr at 0-based step
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    guard = DivergenceGuard(hint=f"lower the learning rate (pretrain lr={lr:g})")
    gen = torch.Generator().manual_seed(seed)
    order: list[Tensor] = []
    losses: list[float] = []
    curve: list[tuple[int, float]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(steps):
            if not order:
                order = list(torch.randperm(train.shape[0], generator=gen).split(batch_size))[::-1]
            model.train()
            loss = block_loss(model, train[order.pop()], keep)
            losses.append(guard.check(loss, step=step + 1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                curve.append((step + 1, blocks_loss(model, val, keep, batch_size)))
    model.eval()
    return {"train_loss": losses, "val_curve": curve, "val_loss": curve[-1][1]}


@torch.no_grad()
def blocks_loss(model: nn.Module, blocks: Tensor, keep: Tensor | None = None, batch_size: int = 16) -> float:
    """Mean next-token loss of ``model`` (eval mode) over every row of ``blocks (n, T)`` (:func:`block_loss`)."""
    model.eval()
    total = 0.0
    for part in blocks.split(batch_size):
        total += float(block_loss(model, part, keep)) * part.shape[0]
    return total / blocks.shape[0]


@torch.no_grad()
def lm_loss(model: nn.Module, ids: Tensor, mask: Tensor) -> float:
    """Mean next-token loss of ``model`` (eval mode) over the real tokens of ``(ids, mask)``."""
    model.eval()
    return float(model(input_ids=ids, labels=ids.masked_fill(~mask.bool(), -100)).loss)


def eval_prompts(
    encoded: Sequence[tuple[list[int], list[int]]],
    *,
    prefix_len: int,
    gen_len: int,
    n_prompts: int,
    eos: int = EOS_ID,
) -> dict[str, Any]:
    """``n_prompts`` test pairs whose prefix (ending in the EOS separator) has at least ``prefix_len`` tokens:
    ``prefix`` ``(n_prompts, prefix_len)`` (the last prefix tokens) and ``references`` (each response up to
    ``gen_len`` tokens, EOS dropped)."""
    chosen = [
        (p[-prefix_len:], [t for t in y if t != eos][:gen_len])
        for p, y in usable_prompts(encoded, prefix_len=prefix_len, eos=eos)
    ][:n_prompts]
    if len(chosen) < n_prompts:
        raise DataError(
            f"only {len(chosen)} test prompts have >= prefix_len={prefix_len} tokens; lower "
            f"secure_inference.prefix_len or n_prompts={n_prompts}"
        )
    return {"prefix": torch.tensor([p for p, _ in chosen]), "references": [y for _, y in chosen]}


def usable_prompts(
    encoded: Sequence[tuple[list[int], list[int]]], *, prefix_len: int, eos: int = EOS_ID
) -> list[tuple[list[int], list[int]]]:
    """The (prefix, response) pairs a prompt can be cut from, in order: a prefix of at least ``prefix_len`` tokens
    and a response holding a token other than ``eos`` (:func:`eval_prompts` picks the first of them)."""
    return [(p, y) for p, y in encoded if len(p) >= prefix_len and any(t != eos for t in y)]
