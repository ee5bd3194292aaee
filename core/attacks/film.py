"""FILM: recovering private text from FedSGD gradients of a language model (Gupta et al. 2022).

Threat model of the SEB paper, Sec. 3.3: the server holds ``theta^t`` and a client's gradient
``grad_theta L_theta^t(B_i)`` (see :mod:`core.attacks.federated`) and wants to recover at least one
sentence of the batch ``B_i``. FILM works in three steps:

1. **Candidate tokens** -- the rows of the input-embedding gradient ``(V, d)`` that are non-zero are
   exactly the subwords of the batch (:func:`subword_candidates`). With SEB (Sec. 4) the input is a
   byte-embedding matrix, so the gradient only reveals a *bag of bytes* (:func:`byte_bag`) and the
   candidates become every subword made only of those bytes (:func:`seb_candidates`) -- almost the
   whole vocabulary for realistic batches (Sec. 5.1, Fig. 3-4; :func:`byte_coverage`). The paper's
   relaxed setting samples 7,000 random subwords plus the true ones (:func:`relaxed_candidates`).
2. **Beam search** over the candidates under a pretrained LM prior (GPT-2 in Sec. 5.1)
   (:func:`beam_search`).
3. **Reordering** of the recovered tokens to maximise the prior's likelihood (:func:`reorder`).

Recovery is scored with ROUGE-1/2/L F (Sec. 5.1; :func:`rouge_scores`, :func:`best_match`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from core.attacks.priors import BigramPrior, CachedPrior, HFPrior, LMPrior
from core.errors import ConfigError, DataError

__all__ = [
    "BigramPrior",
    "HFPrior",
    "LMPrior",
    "beam_search",
    "best_match",
    "byte_bag",
    "byte_coverage",
    "candidate_precision",
    "candidate_recall",
    "film_recover",
    "nonzero_rows",
    "positional_byte_sets",
    "prior_log_probs",
    "relaxed_candidates",
    "reorder",
    "rouge_scores",
    "seb_candidates",
    "sequence_length_from_positions",
    "subword_candidates",
]

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")

# --------------------------------------------------------------------------------------------------
# Step 1: candidate tokens from the gradients (Sec. 3.3)
# --------------------------------------------------------------------------------------------------


def nonzero_rows(grad: torch.Tensor, *, atol: float = 0.0) -> torch.Tensor:
    """Sorted indices of the rows of ``grad (R, ...)`` whose max ``|value|`` exceeds ``atol``.

    Returns:
        ``(k,)`` long tensor on the CPU.
    """
    if grad.dim() < 1 or grad.shape[0] == 0:
        raise DataError(f"grad must have at least one row, got shape {tuple(grad.shape)}")
    if atol < 0:
        raise ConfigError(f"atol must be >= 0, got {atol=}")
    flat = grad.detach().reshape(grad.shape[0], -1)  # (R, prod(rest))
    if flat.shape[1] == 0:
        return torch.zeros(0, dtype=torch.long)
    return (flat.abs().amax(dim=1) > atol).nonzero().flatten().cpu()


def subword_candidates(embedding_grad: torch.Tensor, *, exclude: Sequence[int] = ()) -> torch.Tensor:
    """FILM step 1: the subwords of the batch, i.e. the non-zero rows of the input-embedding gradient.

    Args:
        embedding_grad: ``(V, d)`` gradient of the token-embedding matrix (GPT-2: ``transformer.wte``).
        exclude: special ids to drop (e.g. GPT-2's EOS 50256).

    Returns:
        ``(k,)`` sorted long tensor of candidate token ids.
    """
    if embedding_grad.dim() != 2:
        raise DataError(f"embedding_grad must be (vocab, dim), got shape {tuple(embedding_grad.shape)}")
    rows = nonzero_rows(embedding_grad)
    if len(exclude):
        rows = rows[~torch.isin(rows, torch.as_tensor(list(exclude), dtype=torch.long))]
    return rows


def positional_byte_sets(byte_grad: torch.Tensor, n_bytes: int, byte_vocab: int) -> torch.Tensor:
    """Per-position byte sets of SEB co (one-hot bytes concatenated, first FFN layer, Sec. 4.2).

    Row ``j * byte_vocab + b`` of ``byte_grad (n_bytes * byte_vocab, k)`` multiplies the one-hot of
    byte ``b`` at position ``j``; it is non-zero iff some subword of the batch has byte ``b`` at ``j``.

    Returns:
        ``(n_bytes, byte_vocab)`` bool.
    """
    if byte_grad.dim() < 1 or byte_grad.shape[0] != n_bytes * byte_vocab:
        raise DataError(
            f"byte_grad must have n_bytes*byte_vocab={n_bytes * byte_vocab} rows, got shape "
            f"{tuple(byte_grad.shape)}; check n_bytes and byte_vocab against the SEB mapping"
        )
    present = torch.zeros(n_bytes * byte_vocab, dtype=torch.bool)
    present[nonzero_rows(byte_grad)] = True
    return present.view(n_bytes, byte_vocab)  # (position, byte)


def byte_bag(byte_grad: torch.Tensor, *, n_bytes: int | None = None, byte_vocab: int | None = None) -> torch.Tensor:
    """The bag of bytes revealed by a SEB byte-embedding gradient.

    Args:
        byte_grad: ``(byte_vocab, k)`` for SEB ar/cr (rows are bytes), or ``(n_bytes * byte_vocab, k)``
            for SEB co (row ``j * byte_vocab + b`` is byte ``b`` at position ``j``; pass ``n_bytes``).
        n_bytes: bytes per subword ``n``; given, the bag is the union over positions.
        byte_vocab: ``V_b``; inferred from the shape when omitted.

    Returns:
        ``(byte_vocab,)`` bool: True for the bytes whose gradient rows are non-zero.
    """
    rows = byte_grad.shape[0] if byte_grad.dim() else 0
    if n_bytes is None:
        byte_vocab = rows if byte_vocab is None else byte_vocab
        if rows != byte_vocab:
            raise DataError(f"byte_grad has {rows} rows but byte_vocab={byte_vocab}; for SEB co pass n_bytes as well")
        present = torch.zeros(byte_vocab, dtype=torch.bool)
        present[nonzero_rows(byte_grad)] = True
        return present
    if n_bytes < 1 or rows % n_bytes:
        raise ConfigError(f"n_bytes must be >= 1 and divide the {rows} rows of byte_grad, got {n_bytes=}")
    byte_vocab = rows // n_bytes if byte_vocab is None else byte_vocab
    return positional_byte_sets(byte_grad, n_bytes, byte_vocab).any(dim=0)


def seb_candidates(mapping: torch.Tensor, present: torch.Tensor, *, exclude: Sequence[int] = ()) -> torch.Tensor:
    """Subwords consistent with the bytes a SEB gradient reveals (vectorised over the vocabulary).

    Args:
        mapping: ``(V, n)`` the SEB subword -> byte-sequence mapping ``M`` (Sec. 4.1).
        present: ``(V_b,)`` bool bag: every subword all of whose bytes are in the bag; or
            ``(n, V_b)`` bool positional sets (SEB co only): every subword whose ``j``-th byte is in
            the set of position ``j``, for every ``j``.
        exclude: special ids to drop.

    Returns:
        ``(k,)`` sorted long tensor of candidate ids.
    """
    if mapping.dim() != 2:
        raise DataError(f"mapping must be (vocab, n_bytes), got shape {tuple(mapping.shape)}")
    mapping, present = mapping.long().cpu(), present.bool().cpu()
    n = mapping.shape[1]
    if present.dim() == 1:
        ok = present[mapping].all(dim=1)  # (V,)
    elif present.dim() == 2 and present.shape[0] == n:
        ok = present[torch.arange(n).unsqueeze(0), mapping].all(dim=1)  # (V, n) -> (V,)
    else:
        raise DataError(
            f"present must be a (byte_vocab,) bag or ({n}, byte_vocab) positional sets, got {tuple(present.shape)}"
        )
    if len(exclude):
        ok[torch.as_tensor(list(exclude), dtype=torch.long)] = False
    return ok.nonzero().flatten()


def relaxed_candidates(
    true_ids: torch.Tensor | Sequence[int],
    vocab_size: int,
    *,
    n_random: int = 7000,
    seed: int = 0,
    exclude: Sequence[int] = (),
) -> torch.Tensor:
    """The paper's relaxed SEB attacker (Sec. 5.1): ``n_random`` random subwords plus the true ones.

    ``n_random`` distinct ids are drawn uniformly (seeded) from the vocabulary minus ``exclude``; the
    true ids (minus ``exclude``) are added. Returns a ``(k,)`` sorted unique long tensor.
    """
    true = torch.as_tensor(true_ids, dtype=torch.long).flatten().unique()
    pool = torch.ones(vocab_size, dtype=torch.bool)
    if len(exclude):
        pool[torch.as_tensor(list(exclude), dtype=torch.long)] = False
    pool = pool.nonzero().flatten()
    if not 0 <= n_random <= pool.numel():
        raise ConfigError(f"n_random must be in [0, {pool.numel()}] (vocab minus exclude), got {n_random=}")
    if true.numel() and (true.min() < 0 or true.max() >= vocab_size):
        raise DataError(f"true_ids must lie in [0, {vocab_size}), got range [{true.min()}, {true.max()}]")
    gen = torch.Generator().manual_seed(seed)
    sampled = pool[torch.randperm(pool.numel(), generator=gen)[:n_random]]
    true = true[~torch.isin(true, torch.as_tensor(list(exclude), dtype=torch.long))]
    return torch.cat([sampled, true]).unique()


def sequence_length_from_positions(position_grad: torch.Tensor) -> int:
    """Length the attacker learns from the position-embedding gradient ``(n_positions, d)``.

    Returns the last non-zero row + 1: the number of positions of the longest sequence that take part
    in the loss. With right padding (labels ``-100``) padding rows are exactly zero, and so is the row
    of a sequence's *last* token, which is only a target: for sentences ending in EOS this is the number
    of text tokens before the EOS -- the length to recover.
    """
    rows = nonzero_rows(position_grad)
    if rows.numel() == 0:
        raise DataError("position_grad is all zero; the gradient reveals no sequence length")
    return int(rows.max()) + 1


def _ids_set(ids: torch.Tensor | Sequence[int]) -> set[int]:
    return set(torch.as_tensor(ids, dtype=torch.long).flatten().tolist())


def candidate_recall(candidates: torch.Tensor | Sequence[int], true_ids: torch.Tensor | Sequence[int]) -> float:
    """Fraction of the distinct true ids that are among the candidates."""
    true = _ids_set(true_ids)
    if not true:
        raise DataError("true_ids is empty; recall is undefined without ground-truth tokens")
    return len(true & _ids_set(candidates)) / len(true)


def candidate_precision(candidates: torch.Tensor | Sequence[int], true_ids: torch.Tensor | Sequence[int]) -> float:
    """Fraction of the distinct candidates that are true ids (0.0 for no candidates)."""
    cand = _ids_set(candidates)
    return len(cand & _ids_set(true_ids)) / len(cand) if cand else 0.0


# --------------------------------------------------------------------------------------------------
# Step 2: beam search over the candidates
# --------------------------------------------------------------------------------------------------


def _candidate_mask(candidates: torch.Tensor | Sequence[int], vocab_size: int) -> torch.Tensor:
    cand = torch.as_tensor(candidates, dtype=torch.long).flatten().cpu()
    if cand.numel() == 0:
        raise ConfigError("candidates is empty; the attack needs at least one candidate token")
    if cand.min() < 0 or cand.max() >= vocab_size:
        raise ConfigError(f"candidate ids must lie in [0, {vocab_size}), got [{cand.min()}, {cand.max()}]")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[cand] = True
    return mask


def _beam_pass(
    prior: LMPrior,
    cand_mask: torch.Tensor,
    length: int,
    beam_width: int,
    repeat_penalty: float,
    max_uses: int | None,
    use_cache: bool,
    cover: bool,
    best_seen: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One left-to-right beam search (see :func:`beam_search`): the beams ``(K, length+1)``, their scores ``(K,)``
    and the best log-prob each token has had in any context this pass (and ``best_seen``) saw ``(V,)``."""
    vocab = prior.vocab_size
    beams = torch.full((1, 1), prior.bos_id, dtype=torch.long)  # (K, t+1)
    scores = torch.zeros(1)  # (K,)
    counts = torch.zeros(1, vocab, dtype=torch.long)  # (K, V) uses of each token per beam
    floor = torch.finfo(torch.float32).min
    cached = use_cache and isinstance(prior, CachedPrior)
    parent = token = torch.zeros(1, dtype=torch.long)
    if cached:
        cache, logp = prior.start()  # (1, V)
    informed = best_seen is not None  # future costs from an earlier pass (the first pass ranks by score alone)
    if best_seen is None:
        best_seen = torch.full((vocab,), floor)
    for step in range(length):
        if cached and step:
            cache, logp = prior.advance(cache, parent, token)  # (K, V)
        elif not cached:
            logp = prior.next_log_probs(beams).float().cpu()  # (K, V)
        allowed = cand_mask.unsqueeze(0).expand_as(logp)
        if max_uses is not None:
            allowed = allowed & (counts < max_uses)
        if cover:
            unused = cand_mask.unsqueeze(0) & (counts == 0)  # (K, V)
            must = unused.sum(dim=1, keepdim=True) >= length - step  # (K, 1) no step left to spare
            allowed = torch.where(must, allowed & unused, allowed)
        total = scores.unsqueeze(1) + logp - repeat_penalty * (counts > 0).float()  # (K, V)
        ranked = total
        if cover:
            best_seen = torch.maximum(best_seen, logp.max(dim=0).values.clamp(min=floor))
        if cover and informed:
            ahead = torch.where(cand_mask, best_seen, torch.zeros(())).clamp(min=-1e4)  # (V,)
            left = (unused.float() * ahead).sum(dim=1, keepdim=True)  # (K, 1) the unused candidates' future cost
            ranked = total + left - (counts == 0).float() * ahead  # the extension's token is no longer ahead
        # rank allowed extensions above disallowed ones even where the prior gives -inf
        key = torch.where(allowed, ranked.clamp(min=floor), torch.full_like(total, float("-inf")))
        k = min(beam_width, int(allowed.sum()))
        _, flat = key.flatten().topk(k)  # (k,)
        parent, token = flat // vocab, flat % vocab
        beams = torch.cat([beams[parent], token.unsqueeze(1)], dim=1)
        scores = total.flatten()[flat]
        counts = counts[parent]
        counts[torch.arange(k), token] += 1
    return beams, scores, best_seen


def beam_search(
    prior: LMPrior,
    candidates: torch.Tensor | Sequence[int],
    *,
    length: int,
    beam_width: int = 8,
    n_return: int = 1,
    repeat_penalty: float = 0.0,
    max_uses: int | None = None,
    use_cache: bool = True,
    cover: bool = False,
    cover_passes: int = 2,
) -> list[tuple[list[int], float]]:
    """FILM step 2: beam search for ``length`` tokens drawn only from ``candidates``.

    From ``[bos]``, each beam ``(K, t+1)`` is extended by one token: the prior's ``(K, V)`` next-token
    log-probs are masked to the candidates (``-inf`` elsewhere), ``repeat_penalty`` is subtracted for a
    token already in the beam, tokens used ``max_uses`` times are masked, and the ``beam_width`` best
    of the ``K * V`` extensions are kept (one ``topk``; no Python loop over candidates). Beams are
    distinct by construction. ``cover`` (a batch of one sentence: every candidate occurs in it) forces a beam to
    take a candidate it has not used yet once the steps left equal its unused candidates, so that every beam
    uses every candidate (needs ``len(candidates) <= length``). Every beam then covers the same bag, so beams are
    ranked as a phrase-based MT decoder ranks hypotheses that cover different source words: by their score plus
    the future cost of the candidates they have not used yet, each at the best log-prob it has had in any context
    seen so far. ``cover_passes`` searches run: the first ranks by score alone and records the future costs,
    each later one ranks with those of the passes before it; the best beams of all passes are returned. With
    ``use_cache`` and a :class:`CachedPrior` each step feeds only the new token of each beam against the KV cache
    of its parent (``O(K)`` tokens per step instead of ``O(K t)``).

    Returns:
        Up to ``n_return`` ``(tokens, score)`` pairs, best first, tokens without the bos; the score is
        the summed log-prob minus the repeat penalties.
    """
    if not isinstance(length, int) or length < 1:
        raise ConfigError(f"length must be an int >= 1, got {length=}")
    if beam_width < 1 or not 1 <= n_return <= beam_width:
        raise ConfigError(f"need beam_width >= 1 and 1 <= n_return <= beam_width, got {beam_width=}, {n_return=}")
    if repeat_penalty < 0:
        raise ConfigError(f"repeat_penalty must be >= 0, got {repeat_penalty=}")
    cand_mask = _candidate_mask(candidates, prior.vocab_size)  # (V,)
    if cover and int(cand_mask.sum()) > length:
        raise ConfigError(f"cover needs at most length={length} candidates, got {int(cand_mask.sum())}")
    if max_uses is not None and (max_uses < 1 or max_uses * int(cand_mask.sum()) < length):
        raise ConfigError(
            f"max_uses={max_uses} with {int(cand_mask.sum())} candidates cannot fill length={length}; "
            "raise max_uses or pass max_uses=None"
        )
    if cover_passes < 1:
        raise ConfigError(f"cover_passes must be >= 1, got {cover_passes=}")
    best_seen, found = None, {}
    for _ in range(cover_passes if cover else 1):
        beams, scores, best_seen = _beam_pass(
            prior, cand_mask, length, beam_width, repeat_penalty, max_uses, use_cache, cover, best_seen
        )
        for row, score in zip(beams[:, 1:].tolist(), scores.tolist(), strict=True):
            found[tuple(row)] = score
    ranked = sorted(found.items(), key=lambda item: -item[1])[:n_return]
    return [(list(tokens), score) for tokens, score in ranked]


# --------------------------------------------------------------------------------------------------
# Step 3: reordering
# --------------------------------------------------------------------------------------------------


def _span_moves(tokens: list[int], max_span: int) -> list[tuple[int, ...]]:
    """All distinct orderings reachable by moving one span of <= max_span tokens, or an adjacent swap."""
    n = len(tokens)
    seen = {tuple(tokens)}
    out = []
    for span in range(1, min(max_span, n - 1) + 1):
        for i in range(n - span + 1):
            block, rest = tokens[i : i + span], tokens[:i] + tokens[i + span :]
            for j in range(len(rest) + 1):
                cand = tuple(rest[:j] + block + rest[j:])
                if cand not in seen:
                    seen.add(cand)
                    out.append(cand)
    for i in range(n - 1):
        cand = tuple(tokens[:i] + [tokens[i + 1], tokens[i]] + tokens[i + 2 :])
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def _score(prior: LMPrior, seqs: Sequence[Sequence[int]], chunk: int) -> torch.Tensor:
    """Prior log-prob of each token sequence (bos prepended), in chunks: ``(len(seqs),)``."""
    ids = torch.tensor([[prior.bos_id, *s] for s in seqs], dtype=torch.long)  # (N, T+1)
    return torch.cat([prior.sequence_log_prob(part).float().cpu() for part in ids.split(chunk)])


def prior_log_probs(prior: LMPrior, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The prior's log-prob of each token sequence after its bos, sequences of any lengths: ``(len(seqs),)``."""
    return torch.cat([_score(prior, [list(s)], 1) for s in seqs]) if len(seqs) else torch.zeros(0)


def reorder(
    prior: LMPrior,
    tokens: Sequence[int],
    *,
    max_passes: int = 3,
    max_span: int = 3,
    chunk: int = 512,
    max_moves: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> tuple[list[int], float]:
    """FILM step 3: greedy local search over token orders under the prior.

    Each pass scores, in batches, every ordering reachable by moving one span of up to ``max_span``
    tokens to any other position (adjacent swaps included), and accepts the best one if it strictly
    improves the prior log-prob; stops when none improves or after ``max_passes``. The score never
    decreases. A sentence of n tokens has O(max_span * n^2) such orderings; ``max_moves`` caps each pass
    at a seeded random sample of them to bound the prior's work. With ``use_cache`` and a prior that has
    ``score_variants`` (:class:`HFPrior`), orderings reuse the KV cache of the prefix they share with the current
    order.

    Returns:
        ``(tokens, log_prob)`` of the final order.
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise DataError("reorder got no tokens; give at least one token id")
    if max_passes < 0 or max_span < 1:
        raise ConfigError(f"need max_passes >= 0 and max_span >= 1, got {max_passes=}, {max_span=}")
    best = float(_score(prior, [tokens], chunk)[0])
    if max_moves is not None and max_moves < 1:
        raise ConfigError(f"max_moves must be >= 1 or None, got {max_moves=}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_passes):
        moves = _span_moves(tokens, max_span)
        if not moves:
            break
        if max_moves is not None and len(moves) > max_moves:
            pick = torch.randperm(len(moves), generator=gen)[:max_moves]
            moves = [moves[i] for i in sorted(pick.tolist())]
        if use_cache and hasattr(prior, "score_variants"):
            scores = prior.score_variants(tokens, moves, chunk=min(chunk, 64))
        else:
            scores = _score(prior, moves, chunk)
        i = int(scores.argmax())
        if not float(scores[i]) > best:
            break
        tokens, best = list(moves[i]), float(scores[i])
    return tokens, best


def film_recover(
    prior: LMPrior,
    candidates: torch.Tensor | Sequence[int],
    *,
    length: int,
    n_sentences: int = 1,
    beam_width: int = 8,
    reorder_passes: int = 3,
    repeat_penalty: float = 0.0,
    max_uses: int | None = None,
    max_span: int = 3,
    max_moves: int | None = None,
    cover: bool = False,
) -> list[list[int]]:
    """The FILM attack (steps 2-3): ``n_sentences`` distinct beams of ``length`` tokens, each reordered
    (``max_moves`` orderings per reordering pass at most, see :func:`reorder`).

    Returns:
        ``n_sentences`` token-id lists (fewer if fewer distinct sequences exist).
    """
    beams = beam_search(
        prior,
        candidates,
        length=length,
        beam_width=max(beam_width, n_sentences),
        n_return=n_sentences,
        repeat_penalty=repeat_penalty,
        max_uses=max_uses,
        cover=cover,
    )
    return [
        reorder(prior, toks, max_passes=reorder_passes, max_span=max_span, max_moves=max_moves)[0] for toks, _ in beams
    ]


# --------------------------------------------------------------------------------------------------
# Scoring (Sec. 5.1: ROUGE-1/2/L F; Fig. 4: byte coverage)
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _scorer():  # -> rouge_scorer.RougeScorer (imported lazily: nltk is slow to import)
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=False)


def rouge_scores(recovered: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures of a recovered sentence against the original (Lin 2004)."""
    result = _scorer().score(reference, recovered)
    return {key: float(result[key].fmeasure) for key in ROUGE_KEYS}


def best_match(recovered: Sequence[str], originals: Sequence[str]) -> dict[str, float | str]:
    """FILM's reported number: the (recovered, original) pair with the highest ROUGE-L F.

    Returns:
        ``{"rouge1", "rouge2", "rougeL", "recovered", "original"}`` of that pair, plus
        ``"mean_rougeL_over_originals"``: each original's best ROUGE-L F over the recovered, averaged.
    """
    if not recovered or not originals:
        raise DataError(f"best_match needs sentences, got {len(recovered)} recovered, {len(originals)} originals")
    table = [[rouge_scores(r, o) for r in recovered] for o in originals]  # [original][recovered]
    best_o, best_r = max(
        ((o, r) for o in range(len(originals)) for r in range(len(recovered))),
        key=lambda p: table[p[0]][p[1]]["rougeL"],
    )
    per_original = [max(s["rougeL"] for s in row) for row in table]
    return {
        **table[best_o][best_r],
        "recovered": recovered[best_r],
        "original": originals[best_o],
        "mean_rougeL_over_originals": sum(per_original) / len(per_original),
    }


def byte_coverage(
    mapping: torch.Tensor,
    k_values: Sequence[int],
    *,
    trials: int = 20,
    seed: int = 0,
    byte_vocab: int | None = None,
) -> dict[int, dict[str, float]]:
    """Fig. 4 analogue: how many subwords a random set of ``k`` bytes covers.

    Args:
        mapping: ``(V, n)`` SEB mapping.
        k_values: sizes of the random byte sets.
        byte_vocab: ``V_b``; default ``mapping.max() + 1``.

    Returns:
        ``{k: {"only": mean #subwords made only of the k bytes, "any": mean #containing at least one}}``.
    """
    if trials < 1:
        raise ConfigError(f"trials must be >= 1, got {trials=}")
    mapping = mapping.long().cpu()
    byte_vocab = int(mapping.max()) + 1 if byte_vocab is None else byte_vocab
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k in k_values:
        if not 0 <= k <= byte_vocab:
            raise ConfigError(f"every k must be in [0, {byte_vocab}], got k={k}")
        only = anyb = 0.0
        for _ in range(trials):
            present = torch.zeros(byte_vocab, dtype=torch.bool)
            present[torch.randperm(byte_vocab, generator=gen)[:k]] = True
            hit = present[mapping]  # (V, n)
            only += float(hit.all(dim=1).sum())
            anyb += float(hit.any(dim=1).sum())
        out[int(k)] = {"only": only / trials, "any": anyb / trials}
    return out
