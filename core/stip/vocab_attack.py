"""Frequency analysis against STIP's permuted-vocabulary design (what the cloud party P2 learns of the user's text).

In the ``vocab_perm`` design P2 sees the user's tokens through a secret vocabulary permutation ``sigma``: a
substitution cipher. :func:`token_frequency_attack` ranks the observed ids by count against public unigram
frequencies (plus optional bigram context, matched by Hungarian assignment) and scores the recovered ``sigma``.

:func:`fixed_code_frequency_attack` runs the same analysis on every design where P2 sees a fixed code per token:
in ``user_embed`` P3 sends each token as the row ``E[t][pi]``, the same row every time, so P2 numbers the distinct
rows it sees and holds a substituted token stream without knowing ``pi`` or any checkpoint.
The attacks on the model-dimension permutation ``pi`` are in :mod:`core.stip.attacks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from core.errors import ConfigError
from core.stip.attacks import as_permutation, hungarian, recovery_rate

__all__ = ["FixedCodeResult", "TokenFrequencyResult", "fixed_code_frequency_attack", "token_frequency_attack"]


@dataclass
class TokenFrequencyResult:
    """Outcome of :func:`token_frequency_attack`.

    ``recovered[t]`` is the guessed observed id of true token ``t`` (the
    estimate of ``sigma``); ``decode[o]`` the guessed true token of observed
    id ``o``.
    """

    recovered: np.ndarray
    decode: np.ndarray
    recovery_rate: float | None  # fraction of the whole vocabulary mapped right
    coverage_recovery: dict[float, float]  # X -> fraction right among the top tokens covering X of the stream
    stream_decoding_rate: float | None  # fraction of observed stream positions decoded to the true token
    n_observed_types: int
    n_stream: int


def _as_ids(x: object, what: str, vocab_size: int) -> np.ndarray:
    arr = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x).astype(np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ConfigError(
            f"{what} holds ids in [{arr.min()}, {arr.max()}] but vocab_size={vocab_size}; ids must be in "
            f"[0, {vocab_size})"
        )
    return arr


def _bigram_context(stream: np.ndarray, anchors: np.ndarray, vocab_size: int) -> np.ndarray:
    """(V, 2K) counts of each token followed by / preceded by each anchor, row-normalised."""
    k = anchors.shape[0]
    slot = np.full(vocab_size, -1, dtype=np.int64)
    slot[anchors] = np.arange(k)
    ctx = np.zeros((vocab_size, 2 * k))
    left, right = stream[:-1], stream[1:]
    m = slot[right] >= 0
    np.add.at(ctx, (left[m], slot[right[m]]), 1.0)
    m = slot[left] >= 0
    np.add.at(ctx, (right[m], k + slot[left[m]]), 1.0)
    tot = ctx.sum(1, keepdims=True)
    return ctx / np.where(tot > 0, tot, 1.0)


def token_frequency_attack(
    observed_token_stream: object,
    reference_frequencies: object,
    vocab_size: int,
    *,
    true_sigma: object | None = None,
    coverage: Sequence[float] = (0.5, 0.8, 0.9, 0.95),
    reference_stream: object | None = None,
    n_anchors: int = 64,
    refine_top: int = 1000,
    bigram_weight: float = 1.0,
) -> TokenFrequencyResult:
    """Undo a secret vocabulary permutation ``sigma`` by frequency analysis.

    ``observed_token_stream`` holds ``sigma[t]`` for the user's tokens ``t``;
    ``reference_frequencies`` (size ``vocab_size``, counts or probabilities)
    is the unigram distribution of a public corpus. Observed ids ranked by
    count are paired with reference tokens ranked by frequency. With
    ``reference_stream`` (public token ids) the top ``refine_top`` observed
    types are re-matched by Hungarian assignment on a cost mixing the
    log-frequency gap and the distance between bigram-context profiles
    against the ``n_anchors`` most frequent (rank-matched) tokens.

    With ``true_sigma``: ``recovery_rate`` over the whole vocabulary,
    ``coverage_recovery[X]`` the fraction right among the most frequent
    observed types that together cover a fraction X of the stream, and
    ``stream_decoding_rate`` the fraction of stream positions decoded to the
    right token (what the attack reveals of the user's text).
    """
    if int(vocab_size) != vocab_size or vocab_size < 1:
        raise ConfigError(f"vocab_size must be a positive integer, got vocab_size={vocab_size!r}")
    v = int(vocab_size)
    obs = _as_ids(observed_token_stream, "observed_token_stream", v)
    if obs.size == 0:
        raise ConfigError("observed_token_stream is empty; the attack needs observed tokens")
    ref = np.asarray(
        reference_frequencies.cpu() if isinstance(reference_frequencies, torch.Tensor) else reference_frequencies,
        dtype=np.float64,
    ).reshape(-1)
    if ref.shape[0] != v:
        raise ConfigError(f"reference_frequencies has size {ref.shape[0]} but vocab_size={v}; sizes must match")
    obs_counts = np.bincount(obs, minlength=v).astype(np.float64)
    # stable ranking: ties broken by id, deterministic
    obs_rank = np.lexsort((np.arange(v), -obs_counts))
    ref_rank = np.lexsort((np.arange(v), -ref))
    sigma_hat = np.empty(v, dtype=np.int64)
    sigma_hat[ref_rank] = obs_rank

    if reference_stream is not None:
        rstream = _as_ids(reference_stream, "reference_stream", v)
        top = int(min(refine_top, int((obs_counts > 0).sum()), v))
        k = int(min(n_anchors, top))
        if top >= 2 and k >= 1 and rstream.size > 1:
            ref_anchor = ref_rank[:k]
            obs_anchor = sigma_hat[ref_anchor]
            ctx_o = _bigram_context(obs, obs_anchor, v)
            ctx_r = _bigram_context(rstream, ref_anchor, v)
            o_ids = obs_rank[:top]
            r_ids = ref_rank[:top]
            lo = np.log(obs_counts[o_ids] / obs_counts.sum())
            rp = ref / ref.sum()
            lr = np.log(np.maximum(rp[r_ids], 1e-300))
            a, b = ctx_o[o_ids], ctx_r[r_ids]
            ctx_cost = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
            scale = np.median(np.abs(lo[:, None] - lr[None, :])) + 1e-12
            ctx_scale = np.median(ctx_cost) + 1e-12
            cost = np.abs(lo[:, None] - lr[None, :]) / scale + bigram_weight * ctx_cost / ctx_scale
            assign, _ = hungarian(cost)  # observed row i -> reference column
            sigma_hat[r_ids[assign]] = o_ids

    decode = np.empty(v, dtype=np.int64)
    decode[sigma_hat] = np.arange(v)
    rate = None
    cov: dict[float, float] = {}
    stream_rate = None
    if true_sigma is not None:
        sig = as_permutation(true_sigma, v, "true_sigma")
        rate = recovery_rate(sigma_hat, sig)
        true_decode = np.empty(v, dtype=np.int64)
        true_decode[sig] = np.arange(v)
        correct_obs = decode == true_decode  # per observed id
        stream_rate = float(correct_obs[obs].mean())
        counts_sorted = obs_counts[obs_rank]
        cum = np.cumsum(counts_sorted) / counts_sorted.sum()
        for x in coverage:
            if not 0 < x <= 1:
                raise ConfigError(f"coverage levels must be in (0, 1], got {x}")
            n_types = int(np.searchsorted(cum, x - 1e-12) + 1)
            cov[float(x)] = float(correct_obs[obs_rank[:n_types]].mean())
    return TokenFrequencyResult(
        recovered=sigma_hat,
        decode=decode,
        recovery_rate=rate,
        coverage_recovery=cov,
        stream_decoding_rate=stream_rate,
        n_observed_types=int((obs_counts > 0).sum()),
        n_stream=int(obs.size),
    )


@dataclass
class FixedCodeResult:
    """Outcome of :func:`fixed_code_frequency_attack`."""

    decoded: np.ndarray  # guessed token per stream position
    token_recovery_rate: float | None  # fraction of stream positions decoded right (when the truth is given)
    n_codes: int  # distinct codes (rows) seen
    n_stream: int


def fixed_code_frequency_attack(
    observed_rows: object,
    reference_frequencies: object,
    vocab_size: int,
    *,
    true_tokens: object | None = None,
    reference_stream: object | None = None,
    n_anchors: int = 64,
    refine_top: int = 1000,
) -> FixedCodeResult:
    """Frequency analysis of a stream of fixed codes: ``observed_rows`` ``(n, d)`` (or ``(n,)`` ids), one per
    token of the user's stream. Equal rows get one code id (numbered in order of first appearance), and the code
    stream is attacked as a substitution cipher (:func:`token_frequency_attack`, same public statistics)."""
    rows = observed_rows.detach() if isinstance(observed_rows, torch.Tensor) else torch.as_tensor(observed_rows)
    if rows.dim() == 1:
        rows = rows[:, None]
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ConfigError(f"observed_rows must be (n, d) with n >= 1, got shape {tuple(rows.shape)}")
    _, codes = torch.unique(rows, dim=0, return_inverse=True)
    codes = codes.numpy().astype(np.int64)
    n_codes = int(codes.max()) + 1
    if n_codes > vocab_size:
        raise ConfigError(f"{n_codes} distinct codes but vocab_size={vocab_size}; a code per token cannot exceed V")
    res = token_frequency_attack(
        codes,
        reference_frequencies,
        vocab_size,
        reference_stream=reference_stream,
        n_anchors=n_anchors,
        refine_top=refine_top,
    )
    decoded = res.decode[codes]
    rate = None
    if true_tokens is not None:
        tt = _as_ids(true_tokens, "true_tokens", vocab_size)
        if tt.shape[0] != decoded.shape[0]:
            raise ConfigError(f"true_tokens has {tt.shape[0]} tokens but observed_rows has {decoded.shape[0]} rows")
        rate = float(np.mean(decoded == tt))
    return FixedCodeResult(decoded, rate, n_codes, int(codes.shape[0]))
