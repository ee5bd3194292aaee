"""Closed vocabularies over GPT-2's BPE ids, and the attacker's prior on such a vocabulary.

Small models trained on one corpus only ever see a fraction of GPT-2's 50,257 subwords (Shakespeare: ~12k), and
most of a small model's compute is its output layer, so the utility models and the attacker's prior use a
*compact* vocabulary: the ids seen in their training text plus ``<unk>`` (the closed-vocabulary setting of
fairseq's dictionaries). :class:`CompactPrior` turns an LM over a compact vocabulary back into a distribution
over all of GPT-2's ids, so that the FILM beam search can range over any candidate set: a subword the prior
never saw gets an equal share of the ``<unk>`` probability.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from core.errors import ConfigError, DataError

GPT2_VOCAB = 50257
GPT2_EOS = 50256


class CompactVocab:
    """The GPT-2 ids of a corpus (sorted) plus ``<unk>`` as the last compact id.

    ``encode`` maps full ids to compact ids (unseen -> ``unk``); ``decode`` maps back (``unk`` -> ``unk_full``).
    """

    def __init__(self, ids: Sequence[int] | torch.Tensor, *, full_size: int = GPT2_VOCAB, unk_full: int = GPT2_EOS):
        kept = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)  # (V_c - 1,)
        if kept.numel() == 0:
            raise DataError("a compact vocabulary needs at least one token id; the corpus is empty")
        if int(kept.min()) < 0 or int(kept.max()) >= full_size:
            raise DataError(f"token ids must lie in [0, {full_size}), got min {int(kept.min())} max {int(kept.max())}; "
                            "the tokenizer does not match the model's vocabulary")
        self.full_size, self.unk_full = full_size, unk_full
        self.ids = kept
        self.unk = kept.numel()
        self._to_compact = torch.full((full_size,), self.unk, dtype=torch.long)
        self._to_compact[kept] = torch.arange(kept.numel())

    @classmethod
    def from_sequences(cls, seqs: Iterable[Sequence[int]], *, always: Sequence[int] = (GPT2_EOS,),
                       full_size: int = GPT2_VOCAB) -> CompactVocab:
        seen = {t for s in seqs for t in s} | set(always)
        return cls(sorted(seen), full_size=full_size)

    @property
    def size(self) -> int:
        return self.unk + 1

    @property
    def n_unseen(self) -> int:
        return self.full_size - self.unk

    def encode(self, full_ids: torch.Tensor) -> torch.Tensor:
        return self._to_compact[full_ids]

    def decode(self, compact_ids: torch.Tensor) -> torch.Tensor:
        table = torch.cat([self.ids, torch.tensor([self.unk_full])])
        return table[compact_ids]

    def state(self) -> dict[str, object]:
        return {"ids": self.ids.tolist(), "full_size": self.full_size, "unk_full": self.unk_full}

    @classmethod
    def from_state(cls, state: dict) -> CompactVocab:
        return cls(state["ids"], full_size=int(state["full_size"]), unk_full=int(state["unk_full"]))


def pack(seqs: Sequence[Sequence[int]], *, max_len: int, pad_id: int = GPT2_EOS) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(ids, mask)``, both (n, T) with T = min(max_len, longest); sequences longer than max_len
    are cut. Raises on an empty list or an empty sequence."""
    if not seqs:
        raise DataError("no sequences to pack (empty batch)")
    if any(len(s) == 0 for s in seqs):
        raise DataError("a sequence in the batch is empty; drop empty sentences before packing")
    width = min(max_len, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        s = list(s)[:width]
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


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
            raise ConfigError(f"prior model vocabulary ({n_model}) differs from the compact vocabulary "
                              f"({vocab.size}); load the vocabulary saved with the model")
        self.model, self.vocab, self.bos_id, self.max_batch = model.eval(), vocab, bos_id, max_batch
        self.vocab_size = vocab.full_size
        self._unseen_shift = math.log(max(vocab.n_unseen, 1))
        self._full_of_compact = vocab.ids  # (V_c - 1,)
        self._n_positions = getattr(model.config, "n_positions", None) or getattr(
            model.config, "max_position_embeddings", 1 << 30)

    def _logits(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        ids = self.vocab.encode(ids[:, -self._n_positions:])
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
