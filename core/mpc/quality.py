"""Quality of generated text against references: ROUGE-L (Lin 2004), chrF and BLEU (sacrebleu), and an
embedding-similarity score (BERTScore-style greedy matching of token embeddings).

* ROUGE-L F-measure from Google's ``rouge-score`` package (the reference implementation the MERGE paper's
  Rouge-L numbers come from), averaged over examples.
* chrF and BLEU are corpus-level, from ``sacrebleu`` (the standard, tokenisation-stable implementations).
* ``embedding_f1``: for token embeddings ``a_i`` of the candidate and ``b_j`` of the reference (rows of an
  embedding table, e.g. the fine-tuned GPT-2's), precision = mean_i max_j cos(a_i, b_j), recall =
  mean_j max_i cos(a_i, b_j), F1 their harmonic mean (BERTScore without IDF or baseline rescaling, with
  static embeddings, since no contextual scorer is available offline); averaged over examples. An empty
  candidate scores 0.
* ``quality_drop``: the MERGE paper's Table 3 comparison, a method's scores subtracted from the plaintext
  model's on the same prompts, with a paired bootstrap interval over prompts for the per-example scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from core.errors import DataError

__all__ = [
    "bleu",
    "chrf",
    "embedding_f1",
    "embedding_f1_per_example",
    "paired_bootstrap",
    "quality_drop",
    "rouge_l",
    "rouge_l_per_example",
    "text_quality",
]


def _check(candidates: Sequence[str], references: Sequence[str]) -> None:
    if len(candidates) != len(references):
        raise DataError(f"got {len(candidates)} candidates but {len(references)} references; they must pair up")
    if not candidates:
        raise DataError("no candidates to score; generate at least one text")


def rouge_l_per_example(candidates: Sequence[str], references: Sequence[str]) -> list[float]:
    """ROUGE-L F-measure of each (candidate, reference) pair, in [0, 1]."""
    from rouge_score import rouge_scorer

    _check(candidates, references)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return [scorer.score(r, c)["rougeL"].fmeasure for c, r in zip(candidates, references, strict=True)]


def rouge_l(candidates: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F-measure in [0, 1]."""
    scores = rouge_l_per_example(candidates, references)
    return sum(scores) / len(scores)


def chrf(candidates: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (0-100)."""
    import sacrebleu

    _check(candidates, references)
    return float(sacrebleu.corpus_chrf(list(candidates), [list(references)]).score)


def bleu(candidates: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (0-100), sacrebleu's defaults (13a tokenisation, exponential smoothing off)."""
    import sacrebleu

    _check(candidates, references)
    return float(sacrebleu.corpus_bleu(list(candidates), [list(references)]).score)


def embedding_f1_per_example(
    candidates: Sequence[Sequence[int]], references: Sequence[Sequence[int]], table: Tensor
) -> list[float]:
    """Greedy-matching F1 of token embeddings (rows of ``table: (V, d)``) of each pair, in [-1, 1]."""
    _check(candidates, references)
    unit = torch.nn.functional.normalize(table.detach().to(torch.float64), dim=1)
    out = []
    for cand, ref in zip(candidates, references, strict=True):
        if not len(ref):
            raise DataError("a reference has no tokens; drop empty references before scoring")
        if not len(cand):
            out.append(0.0)
            continue
        sim = unit[torch.as_tensor(list(cand))] @ unit[torch.as_tensor(list(ref))].T  # (n_cand, n_ref)
        p, r = float(sim.max(dim=1).values.mean()), float(sim.max(dim=0).values.mean())
        out.append(0.0 if p + r <= 0 else 2 * p * r / (p + r))
    return out


def embedding_f1(candidates: Sequence[Sequence[int]], references: Sequence[Sequence[int]], table: Tensor) -> float:
    """Mean greedy-matching F1 of token embeddings (rows of ``table: (V, d)``) in [-1, 1]."""
    scores = embedding_f1_per_example(candidates, references, table)
    return sum(scores) / len(scores)


def paired_bootstrap(
    base: Sequence[float], other: Sequence[float], *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``base - other`` over examples and its 95% percentile-bootstrap interval (examples resampled with
    replacement, the two scores of an example kept together), ``(mean, low, high)``."""
    if len(base) != len(other) or not base:
        raise DataError(f"paired_bootstrap needs equally many (>= 1) scores, got {len(base)} and {len(other)}")
    diff = torch.tensor(base, dtype=torch.float64) - torch.tensor(other, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    means = diff[torch.randint(len(diff), (n_boot, len(diff)), generator=gen)].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(diff.mean()), float(low), float(high)


def quality_drop(
    base_ids: Sequence[Sequence[int]],
    candidate_ids: Sequence[Sequence[int]],
    reference_ids: Sequence[Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    table: Tensor,
    *,
    seed: int = 0,
) -> dict[str, float]:
    """How much worse ``candidate_ids`` score than ``base_ids`` (the plaintext model's generations for the same
    prompts) against the references (the MERGE paper's Table 3 drop: positive = worse): ``rouge_l``, ``chrf``,
    ``bleu``, ``embedding_f1``, and for the per-example scores (ROUGE-L, embedding F1) the paired bootstrap 95%
    interval over prompts (``rouge_l_lo``/``_hi``, ``embedding_f1_lo``/``_hi``)."""
    base = text_quality(base_ids, reference_ids, decode, table)
    cand = text_quality(candidate_ids, reference_ids, decode, table)
    out = {k: base[k] - cand[k] for k in base}
    refs = [decode(r).strip() for r in reference_ids]
    per = {
        "rouge_l": (
            rouge_l_per_example([decode(c).strip() for c in base_ids], refs),
            rouge_l_per_example([decode(c).strip() for c in candidate_ids], refs),
        ),
        "embedding_f1": (
            embedding_f1_per_example(base_ids, reference_ids, table),
            embedding_f1_per_example(candidate_ids, reference_ids, table),
        ),
    }
    for name, (b, c) in per.items():
        _, out[f"{name}_lo"], out[f"{name}_hi"] = paired_bootstrap(b, c, seed=seed)
    return out


def text_quality(
    candidate_ids: Sequence[Sequence[int]],
    reference_ids: Sequence[Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    table: Tensor,
) -> dict[str, float]:
    """All four scores for token-id candidates and references: ``rouge_l``, ``chrf``, ``bleu``,
    ``embedding_f1``."""
    cands = [decode(c).strip() for c in candidate_ids]
    refs = [decode(r).strip() for r in reference_ids]
    return {
        "rouge_l": rouge_l(cands, refs),
        "chrf": chrf(cands, refs),
        "bleu": bleu(cands, refs),
        "embedding_f1": embedding_f1(candidate_ids, reference_ids, table),
    }
