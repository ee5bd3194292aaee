"""FILM against one victim in FedSGD, end to end (SEB paper Sec. 3.3 and 5.1): warm the victim up, take one
client's gradient per attacked batch, extract candidates in every attacker setting, recover sentences with the
prior, score them with ROUGE against the batch.

Victims (``build_victim``): a GPT-2-shaped causal LM with the real 50,257-token GPT-2 vocabulary and either an
ordinary subword input embedding (untied from the output layer, so its gradient is non-zero exactly on the rows
of the batch's subwords, the threat model of Sec. 3.3) or SEB (the output layer is a separate SEB module over
the same mapping, ``output="seb"``, so no parameter anywhere is indexed by subword); or a SmolLM2-architecture
model with SmolLM2's 49,152-subword vocabulary (:mod:`core.attacks.llama_victim`), which has no position
embedding: the attack is then told the batch's longest sentence length, what GPT-2's position gradient reveals.

Attacker settings (``SETTINGS``):

* ``subwords``: non-zero rows of the subword embedding's gradient (subword victims);
* ``bytes``: non-zero byte rows of the SEB byte parameter, then every subword made only of those bytes;
* ``positional``: SEB_co's byte parameter is its first FFN layer, whose rows are (position, byte) pairs: the
  attacker keeps every subword whose byte at each position j is among position j's non-zero rows;
* ``relaxed``: the paper's relaxed setting for SEB (Sec. 5.1): ``relaxed_random`` random subwords plus the true
  ones. It hands the attacker the true subwords, so it measures the beam search's power, not the defence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import torch

from core.attacks import film
from core.attacks.federated import client_gradient, fedsgd_round
from core.attacks.vocab import GPT2_EOS, GPT2_VOCAB, pack
from core.errors import ConfigError

SETTINGS = ("subwords", "bytes", "positional", "relaxed")


def settings_for(victim: str, wanted: Sequence[str]) -> list[str]:
    """The attacker settings that apply to ``victim`` (subword victims: ``subwords``; SEB victims: ``bytes``,
    ``relaxed``, and ``positional`` for SEB_co only), in the order of ``wanted``."""
    ok = (
        {"subwords"}
        if victim == "subword"
        else {"bytes", "relaxed"} | ({"positional"} if victim == "seb_co" else set())
    )
    return [s for s in wanted if s in ok]


def build_victim(
    victim: str,
    *,
    mapping: torch.Tensor | None,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_positions: int,
    byte_dim: int,
    hidden: int,
    seed: int,
) -> torch.nn.Module:
    """The FedSGD victim: GPT-2 vocabulary, untied subword embedding or SEB in and out (see module docstring).
    The Transformer blocks get the same initial weights for every victim kind (same seed)."""
    from core.attacks.lm import build_causal_lm

    return build_causal_lm(
        GPT2_VOCAB,
        embedding=victim,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        mapping=mapping if victim != "subword" else None,
        byte_dim=byte_dim,
        hidden=hidden,
        output="seb",
        tie_subword=False,
        seed=seed,
    )


def embedding_gradients(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients the attacker reads: ``input`` (the subword embedding's weight or SEB's byte parameter)
    and ``positions`` (the position embedding), found by identity among the named parameters."""
    emb = model.get_input_embeddings()
    target = emb.byte_weight if hasattr(emb, "byte_weight") else emb.weight
    wpe = getattr(getattr(getattr(model, "transformer", None), "wpe", None), "weight", None)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p is target:
            out["input"] = grads[name]
        elif wpe is not None and p is wpe:
            out["positions"] = grads[name]
    if "input" not in out or (wpe is not None and "positions" not in out):
        raise ConfigError(f"victim {type(model).__name__} lacks an input embedding or position embedding gradient")
    return out


def candidates(
    setting: str,
    grad: torch.Tensor,
    *,
    mapping: torch.Tensor | None,
    byte_vocab: int,
    true_ids: Sequence[int],
    relaxed_random: int,
    seed: int,
    eos_id: int = GPT2_EOS,
) -> torch.Tensor:
    """Candidate subword ids (sorted) of one attacker setting from the input-embedding gradient ``grad``:
    (V, d) for a subword victim; (byte_vocab, byte_dim) for SEB_ar/cr; (n_bytes * byte_vocab, hidden) for SEB_co."""
    if setting == "subwords":
        return film.subword_candidates(grad, exclude=[eos_id])
    if mapping is None:
        raise ConfigError(f"attacker setting {setting!r} needs an SEB victim (a byte mapping)")
    if setting == "relaxed":
        return film.relaxed_candidates(
            torch.as_tensor(sorted(set(true_ids))),
            mapping.shape[0],
            n_random=relaxed_random,
            seed=seed,
            exclude=[eos_id],
        )
    n = mapping.shape[1]
    positional_rows = grad.shape[0] == n * byte_vocab and n > 1
    if setting == "positional":
        if not positional_rows:
            raise ConfigError(
                "the positional attacker needs SEB_co's (position, byte) rows; this victim has "
                f"{grad.shape[0]} byte rows"
            )
        present = film.positional_byte_sets(grad, n, byte_vocab)
    elif positional_rows:
        present = film.byte_bag(grad, n_bytes=n, byte_vocab=byte_vocab)
    else:
        present = film.byte_bag(grad)
    found = film.seb_candidates(mapping, present)
    return found[found != eos_id]


@dataclass(frozen=True)
class BatchResult:
    """One attacked batch in one attacker setting."""

    setting: str
    batch_size: int
    n_tokens: int
    n_unique_subwords: int
    n_unique_bytes: int
    n_candidates: int
    recall: float
    precision: float
    rouge1: float
    rouge2: float
    rougeL: float
    mean_rougeL_over_originals: float
    originals: list[str]
    recovered: list[str]
    best_recovered: str
    best_original: str
    seconds: float = 0.0  # candidates, beam search and reordering of this batch in this setting
    # batch of one sentence whose tokens are all candidates (the original is in the search space): the prior's
    # log-prob of the recovered and of the original sentence; original > recovered is a search error (the search
    # missed a sentence the prior prefers), otherwise the prior itself ranks a wrong sentence first
    logp_recovered: float = math.nan
    logp_original: float = math.nan

    @property
    def search_error(self) -> float:
        """1.0 for a search error, 0.0 for a prior error or an exact recovery, NaN when not comparable."""
        if math.isnan(self.logp_original) or math.isnan(self.logp_recovered):
            return math.nan
        return float(self.logp_original > self.logp_recovered + 1e-4)


def attack_batches(
    model: torch.nn.Module,
    batches: Sequence[Sequence[Sequence[int]]],
    *,
    victim: str,
    settings: Sequence[str],
    mapping: torch.Tensor,
    byte_vocab: int,
    prior: Any,
    decode: Callable[[Sequence[int]], str],
    beam_width: int,
    reorder_passes: int,
    relaxed_random: int,
    seed: int,
    repeat_penalty: float = 20.0,
    reorder_moves: int | None = 256,
    eos_id: int = GPT2_EOS,
) -> list[BatchResult]:
    """Attack each batch (a list of token-id sentences without EOS) of one client at the victim's current
    parameters, in every setting of ``settings_for(victim, settings)``. ``mapping`` is the SEB mapping (also
    given for subword victims: it counts the bytes a batch would touch, the statistics of Fig. 3).

    The candidates form a bag of subwords, most of which occur once in a sentence: the beam search subtracts
    ``repeat_penalty`` (nats) for each reuse of a subword and allows at most ceil(length / |candidates|) + 1
    uses, so that a strong prior cannot fill the sentence with its favourite word. A batch of one sentence
    contains every true candidate: when there are no more candidates than tokens, the beam must use them all
    (``film.beam_search``'s ``cover``). ``eos_id`` ends every sentence
    and is never a candidate. A victim without a position embedding (SmolLM2) gives the attack the longest
    sentence's length, which is what a GPT-2 victim's position gradient reveals."""
    results = []
    for k, sentences in enumerate(batches):
        ids, mask = pack([list(s) + [eos_id] for s in sentences], max_len=10**6, pad_id=eos_id)
        grads = embedding_gradients(model, client_gradient(model, ids, mask))
        if "positions" in grads:
            length = film.sequence_length_from_positions(grads["positions"])
        else:
            length = max(len(s) for s in sentences)
        true_ids = sorted({t for s in sentences for t in s})
        n_bytes = len(set(mapping[true_ids].flatten().tolist()))
        originals = [decode(s) for s in sentences]
        for setting in settings_for(victim, settings):
            t0 = time.perf_counter()
            cand = candidates(
                setting,
                grads["input"],
                mapping=mapping,
                byte_vocab=byte_vocab,
                true_ids=true_ids,
                relaxed_random=relaxed_random,
                seed=seed + k,
                eos_id=eos_id,
            )
            max_uses = -(-length // max(int(cand.numel()), 1)) + 1
            recovered_ids = film.film_recover(
                prior,
                cand,
                length=length,
                n_sentences=len(sentences),
                beam_width=beam_width,
                reorder_passes=reorder_passes,
                repeat_penalty=repeat_penalty,
                max_uses=max_uses,
                max_moves=reorder_moves,
                cover=len(sentences) == 1 and int(cand.numel()) <= length,
            )
            seconds = time.perf_counter() - t0
            recovered = [decode(r) for r in recovered_ids]
            best = film.best_match(recovered, originals)
            hit = len(set(cand.tolist()) & set(true_ids))
            logp_rec = logp_orig = math.nan
            if len(sentences) == 1 and hit == len(true_ids) and len(recovered_ids[0]) == len(sentences[0]):
                logp_rec, logp_orig = film.prior_log_probs(prior, [recovered_ids[0], list(sentences[0])]).tolist()
            results.append(
                BatchResult(
                    setting=setting,
                    batch_size=len(sentences),
                    n_tokens=int(sum(len(s) for s in sentences)),
                    n_unique_subwords=len(true_ids),
                    n_unique_bytes=n_bytes,
                    n_candidates=int(cand.numel()),
                    recall=hit / len(true_ids),
                    precision=hit / max(int(cand.numel()), 1),
                    rouge1=best["rouge1"],
                    rouge2=best["rouge2"],
                    rougeL=best["rougeL"],
                    mean_rougeL_over_originals=best["mean_rougeL_over_originals"],
                    originals=originals,
                    recovered=recovered,
                    best_recovered=best["recovered"],
                    best_original=best["original"],
                    seconds=seconds,
                    logp_recovered=logp_rec,
                    logp_original=logp_orig,
                )
            )
    return results


def warm_up(
    model: torch.nn.Module,
    clients: Sequence[Sequence[Sequence[int]]],
    *,
    rounds: int,
    batch_size: int,
    lr: float,
    seed: int,
    eos_id: int = GPT2_EOS,
) -> list[float]:
    """``rounds`` FedSGD rounds (eq. 1) over every client, each on a seeded random batch of its sentences.
    Returns the mean client loss of each round (measured before its update)."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(rounds):
        batches = []
        for sentences in clients:
            pick = torch.randperm(len(sentences), generator=gen)[:batch_size].tolist()
            batches.append(pack([list(sentences[i]) + [eos_id] for i in pick], max_len=10**6, pad_id=eos_id))
        with torch.no_grad():
            losses.append(
                fmean(
                    float(model(input_ids=i, attention_mask=m, labels=i.masked_fill(~m, -100)).loss) for i, m in batches
                )
            )
        fedsgd_round(model, batches, lr=lr)
    return losses


def summarize(results: Sequence[BatchResult]) -> dict[str, dict[str, float]]:
    """Means per setting over the attacked batches (the curves of Fig. 5 and the candidate statistics)."""
    out: dict[str, dict[str, float]] = {}
    for setting in dict.fromkeys(r.setting for r in results):
        rs = [r for r in results if r.setting == setting]
        out[setting] = {
            k: fmean(float(getattr(r, k)) for r in rs)
            for k in (
                "rouge1",
                "rouge2",
                "rougeL",
                "mean_rougeL_over_originals",
                "recall",
                "precision",
                "n_candidates",
                "n_tokens",
                "n_unique_subwords",
                "seconds",
            )
        }
        out[setting]["n_unique_bytes"] = fmean(float(r.n_unique_bytes) for r in rs)
        judged = [r.search_error for r in rs if not math.isnan(r.search_error)]
        out[setting]["search_error"] = fmean(judged) if judged else math.nan
        gaps = [r.logp_original - r.logp_recovered for r in rs if not math.isnan(r.search_error)]
        out[setting]["logp_gap"] = fmean(gaps) if gaps else math.nan
        out[setting]["n_batches"] = float(len(rs))
    return out
