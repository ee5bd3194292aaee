"""The secure-inference stage's training data and its one language-model training loop (MERGE, stage 4).

:func:`dialogue_data` turns an offline corpus (:mod:`core.mpc.textdata`) into GPT-2 token sequences: the
(prefix, response) pairs are deduplicated, shuffled with the seed and split into test and train, then packed
into right-padded ``(ids, mask)`` sequences and seeded minibatches. :func:`finetune_lm` trains a causal LM
(the GPT-2 every method starts from) on them with AdamW; the students, the ER model and the merge modules are
trained from it by :func:`core.mpc.approx.distill`, :func:`core.mpc.merge.train_er` and
:func:`core.mpc.merge.train_mm`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from core.divergence import DivergenceGuard
from core.errors import ConfigError, DataError
from core.mpc.textdata import EOS_ID, encode_pairs, lm_sequences, text_pairs

__all__ = ["DialogueData", "dialogue_data", "eval_prompts", "finetune_lm", "lm_batches", "lm_loss"]

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
    ids, mask = lm_sequences(enc_train, max_len=max_len)
    test_ids, test_mask = lm_sequences(enc_test, max_len=max_len)
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
        for p, y in encoded
        if len(p) >= prefix_len and any(t != eos for t in y)
    ][:n_prompts]
    if len(chosen) < n_prompts:
        raise DataError(
            f"only {len(chosen)} test prompts have >= prefix_len={prefix_len} tokens; lower "
            f"secure_inference.prefix_len or n_prompts={n_prompts}"
        )
    return {"prefix": torch.tensor([p for p, _ in chosen]), "references": [y for _, y in chosen]}
