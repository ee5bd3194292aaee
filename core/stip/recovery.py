"""What P2 recovers of ``pi``, ``sigma`` and the user's tokens, per design, prior knowledge and fine-tune noise.

The deployment is the one ``core.stip.parties.Developer`` builds: the public base checkpoint plus a simulated
fine-tune (Gaussian noise of ``rel_noise`` times each tensor's RMS, ``core.stip.evaluate.simulate_finetune``),
transformed with fresh CSPRNG secrets ``pi``, ``rho`` (every layer) and, in ``vocab_perm``, ``sigma``
(``core.stip.keys.draw_keys``). P2 holds the transformed blocks (and ``E'``, ``H'`` in ``vocab_perm``) and sees
what P3 sends: the rows ``E[t][pi]`` of the user's tokens (``user_embed``) or the ids ``sigma[t]``
(``vocab_perm``). The user's tokens are public text in the model's own tokenizer (:func:`model_streams`).

Attacks, by what P2 knows besides what it holds and sees (``prior``):

* ``checkpoint`` (the public base checkpoint the model was fine-tuned from):
  ``checkpoint_match`` recovers ``pi`` from the blocks with rho-invariant statistics, ``rho`` of the first
  ``rho_layers`` layers, then ``sigma`` from ``E'``/``H'`` (``vocab_perm``) or the user's tokens by nearest
  neighbour in the public table (``user_embed``), ``core.stip.checkpoint_attack``; ``activation_stats`` matches
  per-coordinate statistics of the permuted inputs to the base model's (``core.stip.evaluate``).
* ``none`` (public text statistics only): ``frequency`` analysis of the fixed code per token, on the substituted
  ids (``vocab_perm``) or on the distinct rows P3 sends (``user_embed``), ``core.stip.vocab_attack``. It does not
  use the weights, so its result does not depend on the fine-tune noise: it runs once per design.

Each row of :func:`recovery_rows` is one attack at one noise: the fraction of ``pi``, ``rho``, ``sigma`` and of the
user's stream positions recovered (NaN where the attack does not target it). Secrets never leave this module.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from core.errors import ConfigError
from core.stip import checkpoint_attack as C
from core.stip.evaluate import attack_activation_stats, embedding_table, simulate_finetune
from core.stip.keys import StipKeys, draw_keys
from core.stip.transform import arch_of, base_model_of, permute_model, permute_vocab
from core.stip.vocab_attack import fixed_code_frequency_attack, token_frequency_attack

__all__ = [
    "ATTACKS",
    "NOISES",
    "TARGETS",
    "metric_name",
    "model_streams",
    "recovery_metrics",
    "recovery_rows",
    "recovery_table",
]

NOISES = (0.0, 0.01, 0.1, 0.5)
ATTACKS = ("checkpoint_match", "activation_stats", "frequency")
TARGETS = ("pi", "rho", "sigma", "tokens")
_EMBED_KEYS = ("wte.weight", "embed_tokens.weight")


def _tables(model: nn.Module) -> list[torch.Tensor]:
    """The embedding table and, when not tied to it, the LM head (what ``vocab_perm`` gives P2 after substitution)."""
    embed = embedding_table(model)
    head = model.lm_head.weight.detach()
    return [embed] if head.data_ptr() == embed.data_ptr() or torch.equal(head, embed) else [embed, head]


def _blocks(model: nn.Module) -> dict[str, torch.Tensor]:
    """P2's block state of a (transformed) model, as ``Developer`` ships it: no token table."""
    state = base_model_of(model).state_dict()
    return {k: v for k, v in state.items() if k not in _EMBED_KEYS and v.is_floating_point()}


def _deploy(base: nn.Module, design: str, rel_noise: float, seed: int) -> tuple[nn.Module, StipKeys, dict, list]:
    """(fine-tuned model, secrets, P2's blocks, P2's substituted tables or [])."""
    tuned = simulate_finetune(base, rel_noise, seed)
    keys = draw_keys(tuned, design)
    blocks = _blocks(permute_model(tuned, keys.pi, rho=keys.rho))
    tables: list[torch.Tensor] = []
    if design == "vocab_perm":
        embed, head = embedding_table(tuned), tuned.lm_head.weight.detach()
        e2, h2 = permute_vocab(embed, head, keys.pi, keys.sigma)
        tables = [e2] if len(_tables(tuned)) == 1 else [e2, h2]
    return tuned, keys, blocks, tables


def _row(attack: str, prior: str, noise: float, seconds: float, **found: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"attack": attack, "prior": prior, "noise": float(noise), "attack_s": seconds}
    for t in TARGETS:
        value = found.get(t)
        row[f"{t}_recovered"] = math.nan if value is None else float(value)
    return row


def _decode_user_rows(pi_hat: np.ndarray, rows: torch.Tensor, table: torch.Tensor, stream: torch.Tensor) -> float:
    """Fraction of stream positions whose row (``E[t][pi]``) decodes to ``t`` by nearest neighbour in the public
    ``table`` with ``pi_hat`` undone (each distinct row decoded once)."""
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    inv = torch.empty(pi_hat.shape[0], dtype=torch.int64)
    inv[torch.as_tensor(pi_hat)] = torch.arange(pi_hat.shape[0])
    cand, _ = C.nearest_rows(uniq.to(torch.float32).index_select(1, inv), table.to(torch.float32))
    return float(np.mean(cand[inverse.numpy(), 0] == stream.numpy()))


def _checkpoint_rows(
    base: nn.Module,
    design: str,
    noise: float,
    seed: int,
    stream: torch.Tensor,
    *,
    rho_layers: int,
    sigma_rows: int,
    match_layers: int | None,
) -> list[dict[str, Any]]:
    tuned, keys, blocks, tables = _deploy(base, design, noise, seed)
    arch = arch_of(base)
    t0 = time.perf_counter()
    pm = C.match_pi(blocks, _blocks(base), arch, true_pi=keys.pi, layers=match_layers)
    layers = min(rho_layers, len(keys.rho))
    rho = [C.match_rho(blocks, _blocks(base), arch, pm.recovered, i, true_rho=keys.rho[i])[1] for i in range(layers)]
    found: dict[str, float | None] = {"pi": pm.recovery_rate, "rho": float(np.mean(rho)) if rho else None}
    if design == "vocab_perm":
        vocab = keys.sigma.numel()
        seen = keys.sigma[stream].numpy()  # the ids P2 sees
        sample = None  # the whole vocabulary, one-to-one
        if sigma_rows < vocab:  # an estimate from a public random sample of ids (plus the ids P2 saw)
            pick = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:sigma_rows].numpy()
            sample = np.concatenate([pick, seen])
        sm = C.match_sigma(tables, _tables(base), pm.recovered, true_sigma=keys.sigma, rows=sample)
        if sample is not None:  # score sigma on the random sample alone (the seen ids are not uniform)
            truth = torch.empty(vocab, dtype=torch.int64)
            truth[keys.sigma] = torch.arange(vocab)
            sm_rate = float(np.mean(sm.decode[pick] == truth.numpy()[pick]))
        else:
            sm_rate = sm.recovery_rate
        found["sigma"] = sm_rate
        found["tokens"] = float(np.mean(sm.decode[seen] == stream.numpy()))
    else:
        rows = embedding_table(tuned)[stream][:, keys.pi]  # what P3 sends, one row per token
        found["tokens"] = _decode_user_rows(pm.recovered, rows, embedding_table(base), stream)
    return [_row("checkpoint_match", "checkpoint", noise, time.perf_counter() - t0, **found)]


def _frequency_row(
    base: nn.Module, design: str, seed: int, stream: torch.Tensor, reference: torch.Tensor
) -> dict[str, Any]:
    tuned, keys, _, _ = _deploy(base, design, 0.0, seed)
    vocab = embedding_table(base).shape[0]
    freqs = torch.bincount(reference, minlength=vocab).double()
    t0 = time.perf_counter()
    if design == "vocab_perm":
        res = token_frequency_attack(
            keys.sigma[stream], freqs, vocab, true_sigma=keys.sigma, reference_stream=reference
        )
        found = {"sigma": res.recovery_rate, "tokens": res.stream_decoding_rate}
    else:
        rows = embedding_table(tuned)[stream][:, keys.pi]
        code = fixed_code_frequency_attack(rows, freqs, vocab, true_tokens=stream, reference_stream=reference)
        found = {"tokens": code.token_recovery_rate}
    return _row("frequency", "none", math.nan, time.perf_counter() - t0, **found)


def recovery_rows(
    base: nn.Module,
    design: str,
    *,
    noises: Sequence[float] = NOISES,
    seed: int,
    stream: torch.Tensor,
    reference: torch.Tensor,
    decode_tokens: int = 2000,
    rho_layers: int = 1,
    sigma_rows: int = 2048,
    match_layers: int | None = 4,
    activation_queries: int = 0,
    seq_len: int = 8,
    attacks: Sequence[str] = ATTACKS,
) -> list[dict[str, Any]]:
    """Every attack on ``design`` at every noise (see the module docstring); ``stream`` is the user's text and
    ``reference`` public text, both in ``base``'s vocabulary. The checkpoint attacks decode the first
    ``decode_tokens`` positions of the stream and score ``sigma`` on ``sigma_rows`` ids drawn at random (the whole
    vocabulary, matched one-to-one, when it is no larger), matching ``pi`` on the first ``match_layers`` blocks
    (None: all); ``attacks`` picks some of :data:`ATTACKS` (``activation_stats`` only with ``activation_queries``).
    The ``frequency`` row (noise NaN) holds for every noise."""
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise ConfigError(f"unknown STIP attacks {sorted(unknown)}; known: {list(ATTACKS)}")
    rows = [_frequency_row(base, design, seed, stream, reference)] if "frequency" in attacks else []
    user = stream[:decode_tokens]
    for noise in noises:
        if "checkpoint_match" in attacks:
            rows += _checkpoint_rows(
                base,
                design,
                float(noise),
                seed,
                user,
                rho_layers=rho_layers,
                sigma_rows=sigma_rows,
                match_layers=match_layers,
            )
        if activation_queries > 0 and "activation_stats" in attacks:
            t0 = time.perf_counter()
            out = attack_activation_stats(
                base, n_queries=activation_queries, seq_len=seq_len, rel_noise=float(noise), seed=seed
            )
            rows.append(
                _row(
                    "activation_stats",
                    "checkpoint",
                    noise,
                    time.perf_counter() - t0,
                    pi=out["recovery_rate"],
                    tokens=out["input_tokens_recovered"],
                )
            )
    return rows


def _pct(noise: float) -> str:
    return f"{100 * noise:g}".replace(".", "_") + "pct"


def metric_name(prior: str, target: str, noise: float | None = None) -> str:
    """``<prior>.<target>_recovered[.noise_<pct>]``, e.g. ``checkpoint.tokens_recovered.noise_10pct``."""
    base = f"{prior}.{target}_recovered"
    return base if noise is None else f"{base}.noise_{_pct(noise)}"


def recovery_table(rows: Sequence[dict[str, Any]], noises: Sequence[float]) -> dict[str, dict[str, dict[str, float]]]:
    """``table[prior][target][noise]`` (noise as ``f"{noise:g}"``): the best attack's recovered fraction per cell,
    for ``prior`` in checkpoint, none (noise-free: the same at every noise) and strongest (either); cells that no
    attack targets are left out."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for prior in ("checkpoint", "none", "strongest"):
        for target in TARGETS:
            key = f"{target}_recovered"
            for noise in noises:
                cell = [
                    r[key]
                    for r in rows
                    if prior in ("strongest", r["prior"])
                    and (math.isnan(r["noise"]) or r["noise"] == float(noise))
                    and not math.isnan(r[key])
                ]
                if cell:
                    table.setdefault(prior, {}).setdefault(target, {})[f"{float(noise):g}"] = max(cell)
    return table


def recovery_metrics(rows: Sequence[dict[str, Any]], noises: Sequence[float]) -> dict[str, float]:
    """:func:`recovery_table` as flat metrics: ``<prior>.<target>_recovered.noise_<pct>``; ``.up_to_10pct`` the
    worst of the noises <= 10%; ``<prior>.<target>_recovered`` the best over every noise."""
    out: dict[str, float] = {}
    for prior, targets in recovery_table(rows, noises).items():
        for target, cells in targets.items():
            for noise, value in cells.items():
                out[metric_name(prior, target, float(noise))] = value
            low = [v for n, v in cells.items() if float(n) <= 0.1 + 1e-12]
            if low:
                out[f"{prior}.{target}_recovered.up_to_10pct"] = min(low)
            out[metric_name(prior, target)] = max(cells.values())
    return out


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from core.stip.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def model_streams(model: nn.Module, stream_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The user's text and the public reference text (``core.stip.evaluate.corpus_streams``: seeded random halves of
    the offline dialogue corpus) in ``model``'s vocabulary: GPT-2 BPE for a GPT-2 vocabulary, SmolLM2's own
    tokenizer for SmolLM2's, and for a small test vocabulary GPT-2 ids folded modulo its size."""
    from core.models.gpt2 import GPT2_VOCAB
    from core.stip.evaluate import corpus_streams

    vocab = int(embedding_table(model).shape[0])
    if vocab == 49152 and arch_of(model) == "llama":
        return corpus_streams(stream_tokens, seed, encode=_smollm2_tokenizer().encode)[:2]
    user, public, _ = corpus_streams(stream_tokens, seed)
    if vocab != GPT2_VOCAB:
        user, public = user % vocab, public % vocab
    return user, public
