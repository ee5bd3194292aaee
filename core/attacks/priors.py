"""Language-model priors for the FILM attack (step 2 and 3, SEB paper Sec. 5.1): the :class:`LMPrior` protocol,
a Hugging Face causal LM (:class:`HFPrior`), an explicit bigram table for tests (:class:`BigramPrior`), and an
LM over a compact vocabulary lifted to the full GPT-2 vocabulary (:class:`CompactPrior`).

Priors over a Hugging Face model also offer a KV cache (:class:`CachedPrior`): ``start`` / ``advance`` let the
beam search (``core.attacks.film.beam_search``) feed one new token per beam and step instead of the whole
prefix, and ``score_variants`` scores many reorderings of one sentence from the cached prefix they share with it
(``core.attacks.film.reorder``). Both give the log-probs of the uncached path up to float rounding."""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from core.attacks.vocab import GPT2_EOS, CompactVocab
from core.errors import ConfigError, DataError


def _cache_of(out: object) -> object:
    """The KV cache a Hugging Face forward returned (``cache`` in transformers 5, ``past_key_values`` before)."""
    found = getattr(out, "cache", None)
    return found if found is not None else out.past_key_values


@runtime_checkable
class CachedPrior(Protocol):
    """A prior with a KV cache (:class:`HFPrior`, :class:`CompactPrior`)."""

    def start(self) -> tuple[object, torch.Tensor]:
        """The cache after ``[bos]`` and ``(1, V)`` next-token log-probs."""
        ...

    def advance(self, cache: object, parent: torch.Tensor, token: torch.Tensor) -> tuple[object, torch.Tensor]:
        """Keep cache rows ``parent (K,)`` (in that order, repeats allowed), append ``token (K,)``: the new cache
        and ``(K, V)`` next-token log-probs."""
        ...


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


class _KVCacheMixin:
    """``start``/``advance``/``score_variants`` for a prior over a Hugging Face causal LM ``self.model``.

    Subclasses define ``_in(ids)`` (full ids -> model ids) and ``_out(logits)`` (``(..., V_model)`` logits ->
    ``(..., V)`` float32 log-probs over the full vocabulary on the CPU)."""

    model: nn.Module
    bos_id: int
    _limit: int | None

    def _call(self, ids: torch.Tensor, cache: object = None) -> tuple[torch.Tensor, object]:
        held = cache.get_seq_length() if cache is not None else 0
        if self._limit is not None and ids.shape[1] + held > self._limit:
            raise ConfigError(f"a cached prefix may hold at most the prior's context of {self._limit} positions")
        device = next(self.model.parameters()).device
        out = self.model(input_ids=self._in(ids).to(device), cache=cache, use_cache=True)
        return out.logits, _cache_of(out)

    @torch.no_grad()
    def start(self) -> tuple[object, torch.Tensor]:
        logits, cache = self._call(torch.full((1, 1), self.bos_id, dtype=torch.long))
        return cache, self._out(logits[:, -1])  # (1, V)

    @torch.no_grad()
    def advance(self, cache: object, parent: torch.Tensor, token: torch.Tensor) -> tuple[object, torch.Tensor]:
        device = next(self.model.parameters()).device
        cache.reorder_cache(parent.long().to(device))  # (K,) rows of the old cache, repeats allowed
        logits, cache = self._call(token.long().view(-1, 1).cpu(), cache)  # (K, 1, V_model)
        return cache, self._out(logits[:, -1])

    @torch.no_grad()
    def score_variants(self, base: Sequence[int], variants: Sequence[Sequence[int]], chunk: int = 64) -> torch.Tensor:
        """``(N,)`` log-probs (bos prepended) of ``variants``, each a reordering of ``base`` (same length).

        ``base`` runs once with the cache; the variants that first differ from it at position ``p`` share its
        first ``p`` tokens, so they reuse the cache cut to ``bos + base[:p]`` and feed only their own suffix."""
        base = [int(t) for t in base]
        n = len(base)
        if any(len(v) != n for v in variants):
            raise DataError(f"every variant must have the base's {n} tokens")
        ids = torch.tensor([[self.bos_id, *base]], dtype=torch.long)  # (1, n+1)
        logits, cache = self._call(ids)
        logp = self._out(logits[0])  # (n+1, V): row t predicts token t+1
        prefix = torch.cat([torch.zeros(1), logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1).cumsum(0)])  # (n+1,)
        scores = torch.empty(len(variants))
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(variants):
            p = next((j for j, (a, b) in enumerate(zip(v, base, strict=True)) if int(a) != b), n)
            groups.setdefault(p, []).append(i)
        for p, rows in groups.items():
            suffix = torch.tensor([list(variants[i])[p:] for i in rows], dtype=torch.long)  # (m, n-p)
            if suffix.shape[1] == 0:
                scores[rows] = prefix[p]
                continue
            first = logp[p][suffix[:, 0]]  # (m,) the first changed token, from the base's own logits
            rest = torch.zeros(len(rows))
            if suffix.shape[1] > 1:
                parts = []
                for part in suffix.split(chunk):
                    sub = copy.deepcopy(cache)
                    sub.crop(p - n)  # drop base[p:], keep bos + base[:p] (n - p > 0 here)
                    sub.batch_repeat_interleave(part.shape[0])
                    out, _ = self._call(part[:, :-1], sub)  # (m', n-p-1, V_model)
                    parts.append(self._out(out).gather(-1, part[:, 1:, None]).squeeze(-1).sum(1))
                rest = torch.cat(parts)
            scores[rows] = prefix[p] + first + rest
        return scores


class HFPrior(_KVCacheMixin):
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
        self._limit = self.max_positions

    def _in(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[..., : self.vocab_size].float().log_softmax(dim=-1).cpu()

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


class CompactPrior(_KVCacheMixin):
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
        self._limit = self._n_positions

    def _in(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vocab.encode(ids)

    def _out(self, logits: torch.Tensor) -> torch.Tensor:
        return self._full(F.log_softmax(logits.float(), dim=-1)).cpu()

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
