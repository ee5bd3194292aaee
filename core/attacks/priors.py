"""Language-model priors for the FILM attack (step 2 and 3, SEB paper Sec. 5.1): the :class:`LMPrior` protocol,
a Hugging Face causal LM (:class:`HFPrior`), an explicit bigram table for tests (:class:`BigramPrior`), and an
LM over a compact vocabulary lifted to the full GPT-2 vocabulary (:class:`CompactPrior`)."""

from __future__ import annotations

import inspect
import math
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from core.attacks.vocab import GPT2_EOS, CompactVocab
from core.errors import ConfigError, DataError


@runtime_checkable
class LMPrior(Protocol):
    """A left-to-right LM prior over token ids; sequences start with ``bos_id``."""

    vocab_size: int
    bos_id: int

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B, V)``: ``log p(next | ids)``."""
        ...

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B,)``: ``sum_{t>=1} log p(ids[t] | ids[:t])``."""
        ...


class HFPrior:
    """A Hugging Face causal LM as FILM's prior (GPT-2 in Sec. 5.1), in eval mode, without grad.

    Args:
        model: a causal LM returning ``.logits (B, T, V)``.
        bos_id: start token; default the config's ``bos_token_id`` then ``eos_token_id`` (GPT-2: 50256).
        batch_size: rows per forward pass (bounds memory: ``batch_size * T * V`` floats for
            :meth:`sequence_log_prob`).
    """

    def __init__(self, model: nn.Module, *, bos_id: int | None = None, batch_size: int = 32) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size=}")
        cfg = model.config
        bos = bos_id if bos_id is not None else getattr(cfg, "bos_token_id", None)
        bos = bos if bos is not None else getattr(cfg, "eos_token_id", None)
        if bos is None:
            raise ConfigError("the model config has no bos/eos token id; pass bos_id explicitly")
        self.model = model.eval()
        self.vocab_size = int(cfg.vocab_size)
        self.bos_id = int(bos)
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.max_positions = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)

    @torch.no_grad()
    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B, V)`` float32 on the CPU; only the last position's logits are computed.

        Prefixes longer than the model's context keep their last ``max_positions`` tokens.
        """
        if self.max_positions is not None:
            ids = ids[:, -self.max_positions :]
        out = []
        for chunk in ids.split(self.batch_size):
            kwargs = {"logits_to_keep": 1} if self._keep_last else {}
            logits = self.model(input_ids=chunk.to(self.device), **kwargs).logits[:, -1, : self.vocab_size]
            out.append(logits.float().log_softmax(dim=-1).cpu())
        return torch.cat(out)

    @torch.no_grad()
    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` -> ``(B,)`` float32 on the CPU (zeros for ``T < 2``)."""
        if ids.shape[1] < 2:
            return torch.zeros(ids.shape[0])
        if self.max_positions is not None and ids.shape[1] - 1 > self.max_positions:
            raise ConfigError(
                f"sequences of {ids.shape[1] - 1} tokens after bos exceed the prior's context of "
                f"{self.max_positions} positions; recover shorter sequences"
            )
        out = []
        for chunk in ids.split(self.batch_size):
            chunk = chunk.to(self.device)
            logits = self.model(input_ids=chunk[:, :-1]).logits[:, :, : self.vocab_size]  # (b, T-1, V)
            logp = logits.float().log_softmax(dim=-1).gather(-1, chunk[:, 1:, None]).squeeze(-1)
            out.append(logp.sum(dim=1).cpu())
        return torch.cat(out)


class BigramPrior:
    """A toy prior from an explicit bigram table: ``log p(b | a) = table[a, b]``.

    Args:
        table: ``(V, V)`` log-probabilities, row = previous token (rows need not be normalised).
        bos_id: the start token (a row of the table).
    """

    def __init__(self, table: torch.Tensor, *, bos_id: int) -> None:
        if table.dim() != 2 or table.shape[0] != table.shape[1]:
            raise DataError(f"table must be a square (V, V) tensor, got shape {tuple(table.shape)}")
        if not 0 <= bos_id < table.shape[0]:
            raise ConfigError(f"bos_id must be in [0, {table.shape[0]}), got {bos_id=}")
        self.table = table.float().cpu()
        self.vocab_size = int(table.shape[0])
        self.bos_id = int(bos_id)

    @classmethod
    def from_scores(cls, scores: torch.Tensor, *, bos_id: int) -> BigramPrior:
        """Normalise ``(V, V)`` scores row-wise with a log-softmax."""
        return cls(scores.float().log_softmax(dim=-1), bos_id=bos_id)

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids[:, -1].cpu()]  # (B, V)

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.cpu()
        return self.table[ids[:, :-1], ids[:, 1:]].sum(dim=1)  # (B,)


class CompactPrior:
    """An LM prior over all GPT-2 ids from a causal LM over a :class:`CompactVocab` (``core.attacks.film.LMPrior``).

    p(v | prefix) = p_c(v' | prefix') for a seen subword v (v' its compact id), and p_c(unk | prefix') / n_unseen
    for each of the ``n_unseen`` subwords the prior never saw: a proper distribution over the full vocabulary.
    Prefixes are mapped to compact ids (unseen -> unk). ``bos_id`` (a full id, GPT-2's EOS) starts every sequence.
    """

    def __init__(self, model: torch.nn.Module, vocab: CompactVocab, *, bos_id: int = GPT2_EOS, max_batch: int = 256):
        emb = model.get_input_embeddings()
        n_model = getattr(emb, "num_embeddings", None) or getattr(emb, "vocab_size", None)
        if n_model is not None and n_model != vocab.size:
            raise ConfigError(
                f"prior model vocabulary ({n_model}) differs from the compact vocabulary "
                f"({vocab.size}); load the vocabulary saved with the model"
            )
        self.model, self.vocab, self.bos_id, self.max_batch = model.eval(), vocab, bos_id, max_batch
        self.vocab_size = vocab.full_size
        self._unseen_shift = math.log(max(vocab.n_unseen, 1))
        self._full_of_compact = vocab.ids  # (V_c - 1,)
        self._n_positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", 1 << 30
        )

    def _logits(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        ids = self.vocab.encode(ids[:, -self._n_positions :])
        out = []
        with torch.no_grad():
            for chunk in ids.split(self.max_batch):
                kw = {"logits_to_keep": 1} if last_only else {}
                out.append(self.model(input_ids=chunk, **kw).logits.float())
        return torch.cat(out)  # (B, T or 1, V_c)

    def _full(self, logp_c: torch.Tensor) -> torch.Tensor:
        """(..., V_c) compact log-probs -> (..., V_full) full log-probs."""
        full = (logp_c[..., -1:] - self._unseen_shift).expand(*logp_c.shape[:-1], self.vocab_size).clone()
        full[..., self._full_of_compact] = logp_c[..., :-1]
        return full

    def next_log_probs(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) full ids starting with bos -> (B, V_full) log p(next | ids)."""
        return self._full(F.log_softmax(self._logits(ids, last_only=True)[:, -1], dim=-1))

    def sequence_log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) full ids starting with bos -> (B,) sum_{t>=1} log p(ids[t] | ids[:t])."""
        if ids.shape[1] < 2:
            return torch.zeros(ids.shape[0])
        logp = F.log_softmax(self._logits(ids[:, :-1], last_only=False), dim=-1)  # (B, T-1, V_c)
        target = ids[:, 1:]
        compact = self.vocab.encode(target)
        picked = logp.gather(-1, compact.unsqueeze(-1)).squeeze(-1)  # (B, T-1)
        unseen = compact == self.vocab.unk
        picked = torch.where(unseen, picked - self._unseen_shift, picked)
        return picked.sum(dim=1)
