"""What the STIP stage measures, as plain functions shared by the flow and the benchmark: the protocol's
correctness and costs, and the three attacks on the permutation with what each reveals of the user's input.

* :func:`protocol_costs`: one three-process run (tokens vs plaintext, max logit error, bytes per generated token
  in each direction) plus ``repeats`` in-process runs timing P2's share against the plaintext model on the same
  thread (median of per-repeat ratios) and P3's share of the protocol's work. Each repeat is one round that times
  the plaintext service and the protocol back to back, so ``server_over_plaintext_same_work_time`` (P2 against the
  plaintext time of the work P2 does: the block stack in ``user_embed``, the whole step in ``vocab_perm``) has one
  ratio per round and the sign-test 95% interval of their median (``_lo``/``_hi``; 6 rounds or more).
  ``server_over_plaintext_time`` divides by the whole plaintext step in both designs (in ``user_embed`` that
  includes the LM head, which P3 runs, not P2).

  Like for like (``timing_order`` ``"abba"``): the plaintext side is the same model rebuilt as P2 builds its own
  (same class, attention implementation, dtype, loading path, fresh instance) running the same step code on the same
  thread (``parties._plain_service``); every object of a round is built before its timed parts; one untimed round
  warms both sides up; and the order alternates, plaintext first in even rounds and the protocol first in odd ones
  (P S S P P S ...), so that an advantage of going first or second (warm caches, the allocator) falls on each side
  in half the rounds instead of always on the protocol. With an even number of rounds the two orders are balanced;
  with an odd one, plaintext goes first once more. ``"fixed"`` (plaintext first in every round, the old scheme) is
  kept for comparison only.
* :func:`attack_weight_matching`: the deployed model is the public base checkpoint plus a simulated fine-tune
  (Gaussian noise of ``rel_noise`` times each tensor's RMS); P2 holds its transformed blocks (no embedding, no
  head) and matches them to the base with the Hungarian algorithm; the recovered ``pi`` then decodes a user's
  permuted input embeddings by nearest neighbour in the public embedding table.
* :func:`attack_activation_stats`: P2 sees the permuted inputs X[:, pi] of ``n_queries`` queries; the attacker
  has the base model's inputs on other text; coordinates are matched by their statistics.
* :func:`attack_token_frequency`: permuted-vocabulary design; P2 sees a substituted token stream and knows
  public unigram frequencies (:func:`corpus_streams`: the stream and the public text, from the offline corpus).

Secrets: every permutation an attack targets (and every protocol run's ``pi``, ``rho``, ``sigma``) is drawn from the
OS CSPRNG (``core.stip.keys``), fresh per call; ``seed`` drives only public things (the simulated fine-tune, the
user's random-token inputs, the corpus split). ``pi=``/``sigma=`` let a test fix the target.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from core.errors import ConfigError
from core.order_stats import median_interval
from core.stip import attacks as A
from core.stip import keys as K
from core.stip.parties import float64_exactness, run_stip, run_stip_inprocess
from core.stip.transform import arch_of, base_model_of, check_permutation
from core.stip.vocab_attack import token_frequency_attack

__all__ = [
    "attack_activation_stats",
    "attack_token_frequency",
    "attack_weight_matching",
    "corpus_streams",
    "embedding_table",
    "model_dim",
    "protocol_costs",
    "simulate_finetune",
]


def model_dim(model: nn.Module) -> int:
    return int(model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd)


def embedding_table(model: nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


TIMING_ORDERS = ("abba", "fixed")


def plaintext_first(round_index: int, order: str = "abba") -> bool:
    """Whether round ``round_index`` (from 0) times the plaintext service before the protocol: in even rounds under
    ``"abba"`` (the order alternates), in every round under ``"fixed"``."""
    if order not in TIMING_ORDERS:
        raise ConfigError(f"timing order must be one of {TIMING_ORDERS}, got {order=!r}")
    return order == "fixed" or round_index % 2 == 0


def protocol_costs(
    model: nn.Module,
    prompt: torch.Tensor,
    n_new: int,
    *,
    design: str,
    repeats: int,
    timeout_s: float,
    order: str = "abba",
) -> dict[str, Any]:
    """Correctness and costs of one design (see the module docstring); every run draws fresh secrets. Exactness is
    judged in float64 (``exact_float64``: relative logit error <= 1e-9, ``parties.float64_exactness``); the float32
    errors (``max_abs_err``, ``max_rel_err``) are reported as measured. ``order``: the order of the two timed parts
    over rounds (``plaintext_first``; ``"fixed"`` for comparison only), recorded as ``timing_order``."""
    plaintext_first(0, order)  # checks the order before the runs
    res = run_stip(model, prompt, n_new, design=design, timeout_s=timeout_s)
    run_stip_inprocess(model, prompt, n_new, design=design, plaintext_first=True)  # untimed warm-up of both sides
    ratios, same_work, fractions, p2s, plains = [], [], [], [], []
    for r in range(repeats):
        ip = run_stip_inprocess(model, prompt, n_new, design=design, plaintext_first=plaintext_first(r, order))
        ratios.append(ip.p2_seconds / ip.plain_seconds)
        same_work.append(ip.p2_seconds / ip.plain_same_work_seconds)
        fractions.append(ip.p3_seconds / (ip.p2_seconds + ip.p3_seconds))
        p2s.append(ip.p2_seconds)
        plains.append(ip.plain_seconds)
    same = median_interval(same_work)
    interval = (
        {}
        if same.lo is None
        else {
            "server_over_plaintext_same_work_time_lo": same.lo,
            "server_over_plaintext_same_work_time_hi": same.hi,
            # the interval's exact coverage (at least 95%; 1 - 2/2^8 = 99.2% at 8 rounds, where it is [min, max])
            "server_over_plaintext_same_work_time_coverage": same.coverage,
        }
    )
    return {
        "design": design,
        "tokens_match": float(res.tokens_match),
        "max_abs_err": res.max_abs_logit_error,
        "max_rel_err": res.max_rel_logit_error,
        **float64_exactness(model, prompt, n_new, design=design),
        "server_over_plaintext_time": statistics.median(ratios),
        "server_over_plaintext_same_work_time": same.median,
        **interval,
        "timing_rounds": float(repeats),
        "timing_order": order,
        "round_ratios": same_work,  # each round's P2 / same-work plaintext time, in round order (recorded as steps)
        "user_overhead_fraction": statistics.median(fractions),
        "p2_s": statistics.median(p2s),
        "plaintext_s": statistics.median(plains),
        "bytes_up_per_token": res.bytes_up_per_token,
        "bytes_down_per_token": res.bytes_down_per_token,
        "setup_bytes_to_cloud": res.setup_bytes_p1_to_p2,
        "setup_bytes_to_user": res.setup_bytes_p1_to_p3,
        "three_process_wall_s": res.wall_seconds,
        "tokens": res.tokens,
        "plain_tokens": res.plain_tokens,
    }


def simulate_finetune(model: nn.Module, rel_noise: float, seed: int) -> nn.Module:
    """A copy of ``model`` with every floating parameter moved by N(0, (rel_noise * RMS)^2): a stand-in for the
    deployed fine-tune of a public base checkpoint (no fine-tuned pair of real checkpoints is available offline)."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.is_floating_point():
                rms = p.pow(2).mean().sqrt()
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * rel_noise * rms)
    return out


def _block_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What P2 holds in the user_embed design: every parameter but the token embedding and the LM head."""
    skip = ("wte", "embed_tokens", "lm_head")
    return {
        k: v.detach() for k, v in model.state_dict().items() if not any(s in k for s in skip) and v.is_floating_point()
    }


def _user_inputs(model: nn.Module, n: int, length: int, seed: int) -> torch.Tensor:
    vocab = embedding_table(model).shape[0]
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _target(pi: torch.Tensor | None, d: int) -> torch.Tensor:
    """The secret under attack: a fresh CSPRNG permutation, or the test's own."""
    return K.secure_permutation(d) if pi is None else check_permutation(pi, d)


def attack_weight_matching(
    base: nn.Module, *, rel_noise: float, seed: int, pi: torch.Tensor | None = None
) -> dict[str, Any]:
    arch = arch_of(base)
    deployed = simulate_finetune(base, rel_noise, seed)
    d = model_dim(base)
    pi = _target(pi, d)
    state = _block_state(deployed)
    axes = A.model_dim_axes(state, arch)
    transformed = A.permute_state(state, pi, axes)
    t0 = time.perf_counter()
    res = A.weight_matching_attack(transformed, _block_state(base), axes=arch, true_perm=pi)
    seconds = time.perf_counter() - t0
    ids = _user_inputs(base, 1, 16, seed + 7)[0]
    table = embedding_table(deployed)
    reveal = A.what_it_reveals(res.recovered, table[ids][:, pi], table, true_tokens=ids)
    return {
        "recovery_rate": res.recovery_rate,
        "input_tokens_recovered": reveal.token_recovery_rate,
        "margin": res.margin,
        "attack_s": seconds,
        "d": d,
        "rel_noise": rel_noise,
        "log10_guess_probability": A.guess_probability(d),
    }


@torch.no_grad()
def _input_activations(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The block-stack input P2 receives (token embeddings, plus positions for GPT-2), rows (n*T, d)."""
    base = base_model_of(model)
    x = model.get_input_embeddings()(ids)
    if hasattr(base, "wpe"):
        x = x + base.wpe(torch.arange(ids.shape[1]))
    return x.reshape(-1, x.shape[-1])


def attack_activation_stats(
    base: nn.Module, *, n_queries: int, seq_len: int, rel_noise: float, seed: int, pi: torch.Tensor | None = None
) -> dict[str, Any]:
    deployed = simulate_finetune(base, rel_noise, seed)
    d = model_dim(base)
    pi = _target(pi, d)
    seen = _input_activations(deployed, _user_inputs(base, n_queries, seq_len, seed + 2))[:, pi]
    reference = _input_activations(base, _user_inputs(base, max(n_queries, 64), seq_len, seed + 3))
    t0 = time.perf_counter()
    res = A.activation_statistics_attack(seen, reference, true_perm=pi)
    seconds = time.perf_counter() - t0
    ids = _user_inputs(base, 1, seq_len, seed + 2)[0]
    table = embedding_table(deployed)
    x = _input_activations(deployed, ids[None])[:, pi]
    offset = None
    b = base_model_of(deployed)
    if hasattr(b, "wpe"):
        offset = b.wpe.weight.detach()[: ids.shape[0]]
    reveal = A.what_it_reveals(res.recovered, x, table, true_tokens=ids, offset=offset)
    return {
        "recovery_rate": res.recovery_rate,
        "input_tokens_recovered": reveal.token_recovery_rate,
        "n_queries": n_queries,
        "rows": int(seen.shape[0]),
        "attack_s": seconds,
        "d": d,
    }


def attack_token_frequency(
    stream: torch.Tensor, reference: torch.Tensor, vocab_size: int, *, sigma: torch.Tensor | None = None
) -> dict[str, Any]:
    """``stream``: the user's token ids (substituted here with a secret sigma); ``reference``: public text ids."""
    sigma = _target(sigma, vocab_size)
    freqs = torch.bincount(reference, minlength=vocab_size).double()
    t0 = time.perf_counter()
    res = token_frequency_attack(
        sigma[stream], freqs / freqs.sum(), vocab_size, true_sigma=sigma, reference_stream=reference
    )
    return {
        "recovery_rate": res.stream_decoding_rate,
        "vocabulary_recovered": res.recovery_rate,
        "coverage_recovery": res.coverage_recovery,
        "n_stream": int(stream.numel()),
        "attack_s": time.perf_counter() - t0,
    }


def corpus_streams(
    stream_tokens: int, seed: int, *, encode: Callable[[str], list[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Public text as token ids (the offline dialogue corpus; GPT-2 BPE unless ``encode`` is given): the user's
    stream (``stream_tokens`` ids, substituted by the attack) and a disjoint reference half whose unigram
    frequencies the attacker knows. The third value is GPT-2's vocabulary size (meaningful for GPT-2 ids)."""
    from core.models.gpt2 import GPT2_VOCAB
    from core.mpc.textdata import gpt2_tokenizer, text_pairs

    encode = encode or gpt2_tokenizer().encode
    _, pairs = text_pairs("auto")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    halves = [order[0::2], order[1::2]]  # seeded random halves: both from the same distribution of topics
    user = torch.tensor([t for i in halves[0] for t in encode(pairs[i][0] + " " + pairs[i][1])], dtype=torch.long)
    public = torch.tensor([t for i in halves[1] for t in encode(pairs[i][0] + " " + pairs[i][1])], dtype=torch.long)
    return user[:stream_tokens], public, GPT2_VOCAB
