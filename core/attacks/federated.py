"""FedSGD for causal language models: what the server (the attacker of FILM) receives.

SEB paper (Subword Embedding from Bytes) Sec. 3.2: in communication round ``t`` the server sends the
parameters ``theta^t`` to every client ``c_i``; each client computes the gradient of the loss on a batch
``B_i`` sampled from its private data, ``Delta_i^t = grad_theta L_theta^t(B_i)``, and sends it back; the
server aggregates and takes one gradient step (eq. 1)::

    theta^{t+1} = theta^t - eta * sum_i Delta_i^t

Sec. 3.3 (threat model, after Gupta et al. 2022, FILM): the server sees every ``Delta_i^t`` in the
clear together with ``theta^t``; :mod:`core.attacks.film` recovers text from them.

The loss is the mean next-token cross-entropy of a Hugging Face causal LM
(``model(input_ids=ids, attention_mask=mask, labels=labels).loss``) over the real (unmasked) tokens of
a right-padded batch. Padding carries label ``-100``, so padding positions contribute no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from core.errors import ConfigError, DataError

__all__ = [
    "FedSGDSimulation",
    "aggregate_gradients",
    "client_gradient",
    "fedsgd_round",
    "lm_labels",
    "pad_sequences",
]

#: Label value ignored by Hugging Face's (and PyTorch's) cross-entropy.
IGNORE_INDEX = -100

Batch = tuple[torch.Tensor, torch.Tensor]
Gradients = dict[str, torch.Tensor]


def _check_batch(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ``(B, T)`` token batch and its mask; returns ``(ids, mask.bool())``."""
    if ids.dim() != 2:
        raise DataError(f"ids must be a (batch, seq_len) tensor, got shape {tuple(ids.shape)}; add a batch dim")
    if ids.dtype not in (torch.int64, torch.int32):
        raise DataError(f"ids must be an integer (Long) tensor of token ids, got dtype={ids.dtype}")
    if mask.shape != ids.shape:
        raise DataError(f"mask must have the shape of ids, got mask {tuple(mask.shape)} vs ids {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise DataError(f"empty batch: ids has shape {tuple(ids.shape)}; give at least one token sequence")
    return ids, mask.bool()


def lm_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token labels for a causal LM: ``ids`` with ``-100`` wherever ``mask`` is False.

    Args:
        ids: ``(B, T)`` token ids.
        mask: ``(B, T)`` bool, True on real tokens.

    Returns:
        ``(B, T)`` long labels (Hugging Face shifts them by one position inside the loss).
    """
    ids, mask = _check_batch(ids, mask)
    return ids.long().masked_fill(~mask, IGNORE_INDEX)


def pad_sequences(seqs: Sequence[torch.Tensor], *, pad_id: int) -> Batch:
    """Right-pad 1-D token sequences into ``ids (N, T_max)`` and ``mask (N, T_max)`` (True on tokens)."""
    if len(seqs) == 0:
        raise DataError("pad_sequences got no sequences; give at least one 1-D token tensor")
    lengths = [int(s.numel()) for s in seqs]
    if min(lengths) == 0 or any(s.dim() != 1 for s in seqs):
        raise DataError(f"every sequence must be a non-empty 1-D tensor, got lengths={lengths}")
    ids = torch.full((len(seqs), max(lengths)), pad_id, dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        ids[row, : seq.numel()] = seq.long()
        mask[row, : seq.numel()] = True
    return ids, mask


def client_gradient(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> Gradients:
    """One client's FedSGD message ``Delta_i^t = grad_theta L_theta^t(B_i)`` (Sec. 3.2).

    The gradient of the mean next-token cross-entropy of ``model`` on the batch, taken at the model's
    current parameters with :func:`torch.autograd.grad`, so ``.grad`` of the model is left untouched.
    The model's train/eval mode is the caller's choice (dropout makes the gradient random).

    Args:
        model: a Hugging Face causal LM (returns ``.loss`` when given ``labels``).
        ids: ``(B, T)`` token ids, right-padded.
        mask: ``(B, T)`` bool attention mask, True on real tokens.

    Returns:
        ``{name: grad}`` for every parameter with ``requires_grad``, detached, each of the parameter's
        shape (zeros for parameters the loss does not reach).

    Raises:
        DataError: an empty batch, or one with no token that has a next token to predict.
    """
    ids, mask = _check_batch(ids, mask)
    if not (mask[:, 1:] & mask[:, :-1]).any():
        raise DataError(
            f"batch of shape {tuple(ids.shape)} has no next-token target (every sequence has < 2 real "
            "tokens); give sequences of at least two tokens"
        )
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("model has no parameter with requires_grad=True; there is no gradient to send")
    device = named[0][1].device
    ids, mask = ids.to(device), mask.to(device)
    loss = model(input_ids=ids, attention_mask=mask, labels=lm_labels(ids, mask)).loss
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {
        name: (torch.zeros_like(p) if g is None else g.detach().clone())
        for (name, p), g in zip(named, grads, strict=True)
    }


def aggregate_gradients(grads: Sequence[Gradients]) -> Gradients:
    """``sum_i Delta_i^t`` of eq. (1), summed left to right (``g_1 + g_2 + ...``) per parameter."""
    if len(grads) == 0:
        raise DataError("no client gradients to aggregate; give at least one client")
    total = {name: g.clone() for name, g in grads[0].items()}
    for client in grads[1:]:
        if client.keys() != total.keys():
            raise DataError(f"client gradients have different parameter names: {sorted(client)} vs {sorted(total)}")
        for name, g in client.items():
            total[name] = total[name] + g
    return total


def _check_lr(lr: float) -> float:
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be a finite number > 0, got {lr=}; pass the server learning rate eta")
    return float(lr)


def fedsgd_round(model: nn.Module, client_batches: Sequence[Batch], *, lr: float) -> list[Gradients]:
    """One FedSGD communication round (Sec. 3.2, eq. 1), updating ``model`` in place.

    Every client computes :func:`client_gradient` at the same ``theta^t``; the server then sets
    ``theta^{t+1} = theta^t - lr * sum_i Delta_i^t`` (computed as ``p - lr * total``).

    Args:
        model: the global model (its parameters are ``theta^t`` on entry, ``theta^{t+1}`` on exit).
        client_batches: one ``(ids (B_i, T_i), mask (B_i, T_i))`` batch per client.
        lr: the server learning rate ``eta`` (> 0).

    Returns:
        The per-client gradients, in client order: exactly what the server (the attacker) receives.
    """
    lr = _check_lr(lr)
    if len(client_batches) == 0:
        raise DataError("fedsgd_round got no client batches; give one (ids, mask) batch per client")
    grads = [client_gradient(model, ids, mask) for ids, mask in client_batches]
    total = aggregate_gradients(grads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in total:
                p.copy_(p - lr * total[name])
    return grads


@dataclass
class FedSGDSimulation:
    """A FedSGD simulation: one global model, ``N`` clients each holding private token sequences.

    Attributes:
        model: the global causal LM (updated in place by :meth:`round`).
        clients: per client ``(ids (N_i, T_i), mask (N_i, T_i))``: its private sequences, right-padded.
        lr: the server learning rate ``eta`` of eq. (1).
        rounds_done: how many rounds have been run.
    """

    model: nn.Module
    clients: list[Batch]
    lr: float = 1e-3
    rounds_done: int = field(default=0)

    def __post_init__(self) -> None:
        self.lr = _check_lr(self.lr)
        if len(self.clients) == 0:
            raise DataError("FedSGDSimulation needs at least one client; give clients=[(ids, mask), ...]")
        self.clients = [_check_batch(ids, mask) for ids, mask in self.clients]

    def sample_batches(self, batch_size: int, rng: torch.Generator) -> list[Batch]:
        """One batch of ``batch_size`` distinct sequences per client, trailing all-padding columns cut."""
        smallest = min(ids.shape[0] for ids, _ in self.clients)
        if not (isinstance(batch_size, int) and 1 <= batch_size <= smallest):
            raise ConfigError(
                f"batch_size must be an int in [1, {smallest}] (the smallest client's data), got {batch_size=}"
            )
        batches = []
        for ids, mask in self.clients:
            rows = torch.randperm(ids.shape[0], generator=rng)[:batch_size]
            b_ids, b_mask = ids[rows], mask[rows]
            width = int(b_mask.any(0).nonzero().max()) + 1 if b_mask.any() else 1
            batches.append((b_ids[:, :width], b_mask[:, :width]))
        return batches

    def round(self, batch_size: int, rng: torch.Generator) -> tuple[list[Batch], list[Gradients]]:
        """Sample one batch per client (seeded by ``rng``), run :func:`fedsgd_round`.

        Returns:
            ``(batches, grads)``: the private batches (ground truth for scoring an attack) and the
            per-client gradients the server received.
        """
        batches = self.sample_batches(batch_size, rng)
        grads = fedsgd_round(self.model, batches, lr=self.lr)
        self.rounds_done += 1
        return batches, grads
