"""Closed vocabularies over GPT-2's BPE ids, and padded batches of token-id sequences.

Small models trained on one corpus only ever see a fraction of GPT-2's 50,257 subwords (Shakespeare: ~12k), and
most of a small model's compute is its output layer, so the utility models and the attacker's prior use a
*compact* vocabulary: the ids seen in their training text plus ``<unk>`` (the closed-vocabulary setting of
fairseq's dictionaries). ``core.attacks.priors.CompactPrior`` turns an LM over a compact vocabulary back into
a distribution over all of GPT-2's ids.

The utility LMs can instead train at the tokenizer's *whole* vocabulary (:class:`FullVocab`, ids unchanged), the
setting of the SEB paper's Table 6: there the subword table has all 50,257 rows while SEB's parameters do not
depend on the vocabulary. :func:`lm_vocabulary` picks one by name (``LM_VOCABS``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from core.errors import ConfigError, DataError
from core.models.gpt2 import GPT2_EOS, GPT2_VOCAB

# the vocabularies a utility LM can train at: the training text's subwords plus <unk>, or the tokenizer's whole one
LM_VOCABS: tuple[str, ...] = ("compact", "full")


class CompactVocab:
    """The GPT-2 ids of a corpus (sorted) plus ``<unk>`` as the last compact id.

    ``encode`` maps full ids to compact ids (unseen -> ``unk``); ``decode`` maps back (``unk`` -> ``unk_full``).
    """

    def __init__(self, ids: Sequence[int] | torch.Tensor, *, full_size: int = GPT2_VOCAB, unk_full: int = GPT2_EOS):
        kept = torch.as_tensor(ids, dtype=torch.long).unique(sorted=True)  # (V_c - 1,)
        if kept.numel() == 0:
            raise DataError("a compact vocabulary needs at least one token id; the corpus is empty")
        if int(kept.min()) < 0 or int(kept.max()) >= full_size:
            raise DataError(
                f"token ids must lie in [0, {full_size}), got min {int(kept.min())} max {int(kept.max())}; "
                "the tokenizer does not match the model's vocabulary"
            )
        self.full_size, self.unk_full = full_size, unk_full
        self.ids = kept
        self.unk = kept.numel()
        self._to_compact = torch.full((full_size,), self.unk, dtype=torch.long)
        self._to_compact[kept] = torch.arange(kept.numel())

    @classmethod
    def from_sequences(
        cls, seqs: Iterable[Sequence[int]], *, always: Sequence[int] = (GPT2_EOS,), full_size: int = GPT2_VOCAB
    ) -> CompactVocab:
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

    def unk_rate(self, ids: torch.Tensor) -> float:
        """The share of (already encoded) compact ids that are ``<unk>``."""
        return float((ids == self.unk).float().mean())

    def decode(self, compact_ids: torch.Tensor) -> torch.Tensor:
        table = torch.cat([self.ids, torch.tensor([self.unk_full])])
        return table[compact_ids]

    def state(self) -> dict[str, object]:
        return {"ids": self.ids.tolist(), "full_size": self.full_size, "unk_full": self.unk_full}

    @classmethod
    def from_state(cls, state: dict) -> CompactVocab:
        return cls(state["ids"], full_size=int(state["full_size"]), unk_full=int(state["unk_full"]))


class FullVocab:
    """The tokenizer's whole vocabulary, ids unchanged (no ``<unk>``): the same interface as :class:`CompactVocab`.

    A model over it has ``full_size`` rows in its subword table and ``full_size`` logits, whether or not the
    training text uses them (the SEB paper's Table 6 setting, GPT-2's 50,257 subwords).
    """

    unk = None

    def __init__(self, full_size: int = GPT2_VOCAB) -> None:
        if full_size < 1:
            raise ConfigError(f"full_size must be >= 1, got {full_size=}")
        self.full_size = full_size

    @property
    def size(self) -> int:
        return self.full_size

    @property
    def n_unseen(self) -> int:
        return 0

    def encode(self, full_ids: torch.Tensor) -> torch.Tensor:
        """``full_ids`` themselves, after checking they lie in [0, full_size)."""
        if full_ids.numel() and (int(full_ids.min()) < 0 or int(full_ids.max()) >= self.full_size):
            raise DataError(
                f"token ids must lie in [0, {self.full_size}), got min {int(full_ids.min())} max "
                f"{int(full_ids.max())}; the tokenizer does not match the model's vocabulary"
            )
        return full_ids

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def unk_rate(self, ids: torch.Tensor) -> float:
        """0.0: every id is its own class."""
        return 0.0


def lm_vocabulary(kind: str, seqs: Iterable[Sequence[int]], *, full_size: int = GPT2_VOCAB) -> CompactVocab | FullVocab:
    """The vocabulary a utility LM trains at: ``"compact"`` (the ids of ``seqs`` plus ``<unk>``) or ``"full"``
    (all ``full_size`` ids, ``seqs`` unused)."""
    if kind == "compact":
        return CompactVocab.from_sequences(seqs, full_size=full_size)
    if kind == "full":
        return FullVocab(full_size)
    raise ConfigError(
        f"unknown LM vocabulary {kind!r}; choose one of {LM_VOCABS}: 'compact' (the training text's subwords plus "
        f"<unk>) or 'full' (the tokenizer's whole vocabulary, {full_size} ids)"
    )


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
