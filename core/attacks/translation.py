"""German -> English translation with subword or SEB embeddings, small scale (SEB paper Sec. 5.2.1, Table 3).

:class:`Seq2SeqLM` is a pre-norm encoder-decoder Transformer over ONE shared vocabulary (GPT-2 BPE ids, possibly
remapped to a compact vocabulary by the caller) with every embedding shared, as fairseq's
``--share-all-embeddings``: ``"subword"`` shares one (V, d) table between encoder input, decoder input and the
output projection; ``"seb_ar" | "seb_cr" | "seb_co"`` share one :class:`~core.attacks.seb.SEBEmbedding` the same
way (output through :class:`~core.attacks.seb.SEBLMHead`). Token embeddings are scaled by sqrt(d_model) and
initialised with std d_model**-0.5 (fairseq), so both the input and the tied logits start at unit scale.
Evaluation: SacreBLEU, case-sensitive, 13a tokenizer (Sec. 5.2.1).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.attacks.lm import EMBEDDINGS, flush_denormals, lr_factor
from core.attacks.seb import SEBEmbedding, SEBLMHead
from core.divergence import DivergenceGuard
from core.errors import ConfigError, DataError


class Seq2SeqLM(nn.Module):
    """Encoder-decoder Transformer: ``forward(src (B, S), tgt_in (B, T)) -> logits (B, T, vocab_size)``.

    Padding is ``pad_id`` in both ``src`` and ``tgt_in``; sequences longer than ``max_len`` are rejected.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 128,
        nhead: int = 4,
        num_layers: int = 2,
        ff: int = 256,
        max_len: int = 64,
        embedding: str = "subword",
        mapping: Tensor | None = None,
        byte_dim: int = 64,
        hidden: int = 256,
        byte_vocab: int | None = None,
        pad_id: int = 0,
        dropout: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if embedding not in EMBEDDINGS:
            raise ConfigError(f"unknown embedding {embedding!r}; choose one of {EMBEDDINGS}")
        if embedding != "subword" and mapping is None:
            raise ConfigError(f"embedding={embedding!r} needs mapping=build_byte_mapping({vocab_size})")
        if not 0 <= pad_id < vocab_size:
            raise ConfigError(f"pad_id must be a token id in [0, {vocab_size}), got {pad_id=}")
        if d_model % nhead:
            raise ConfigError(f"d_model must be divisible by nhead, got {d_model=}, {nhead=}")
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.pad_id, self.embedding = pad_id, embedding
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if embedding == "subword":
                self.tok = nn.Embedding(vocab_size, d_model)
                nn.init.normal_(self.tok.weight, std=d_model**-0.5)
                self.head = None
            else:
                self.tok = SEBEmbedding(
                    mapping,
                    d_model,
                    variant=embedding.removeprefix("seb_"),
                    byte_dim=byte_dim,
                    hidden=hidden,
                    byte_vocab=byte_vocab,
                    init_std=d_model**-0.5,
                )
                self.head = SEBLMHead(self.tok)
            self.pos = nn.Embedding(max_len, d_model)
            nn.init.normal_(self.pos.weight, std=0.02)
            self.drop = nn.Dropout(dropout)
            enc = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout, batch_first=True, norm_first=True)
            dec = nn.TransformerDecoderLayer(d_model, nhead, ff, dropout, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(
                enc, num_layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False
            )
            self.decoder = nn.TransformerDecoder(dec, num_layers, norm=nn.LayerNorm(d_model))

    def _embed(self, ids: Tensor) -> Tensor:
        """(B, L) ids -> (B, L, d_model): scaled token embedding + learned position embedding."""
        if ids.shape[1] > self.max_len:
            raise DataError(f"sequence length {ids.shape[1]} exceeds max_len={self.max_len}; truncate or raise it")
        pos = self.pos(torch.arange(ids.shape[1], device=ids.device))  # (L, d_model)
        return self.drop(self.tok(ids) * math.sqrt(self.d_model) + pos)

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """``src (B, S)`` -> (memory (B, S, d_model), src padding mask (B, S))."""
        src_pad = src == self.pad_id
        return self.encoder(self._embed(src), src_key_padding_mask=src_pad), src_pad

    def decode(self, tgt_in: Tensor, memory: Tensor, src_pad: Tensor) -> Tensor:
        """``tgt_in (B, T)`` -> logits (B, T, vocab_size)."""
        T = tgt_in.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tgt_in.device).triu(1)  # (T, T), True = blocked
        h = self.decoder(
            self._embed(tgt_in),
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            tgt_key_padding_mask=tgt_in == self.pad_id,
            memory_key_padding_mask=src_pad,
        )  # (B, T, d_model)
        return self.head(h) if self.head is not None else F.linear(h, self.tok.weight)  # (B, T, V)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)


def embedding_parameter_count(model: Seq2SeqLM) -> int:
    """Parameters of the shared token embedding (the output head is tied to it; positions not counted)."""
    return sum(p.numel() for p in model.tok.parameters())


def _pad(seqs: list[list[int]], pad_id: int) -> Tensor:
    """Right-pad to (B, L_max)."""
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)


def _check_pairs(src: list[list[int]], tgt: list[list[int]] | None = None) -> None:
    if len(src) == 0:
        raise DataError("no source sentences given; pass at least one tokenised sentence")
    if tgt is not None and len(tgt) != len(src):
        raise DataError(f"src and tgt must pair up, got {len(src)} sources and {len(tgt)} targets")
    if any(len(s) == 0 for s in src):
        raise DataError(f"source sentence {next(i for i, s in enumerate(src) if not s)} is empty; drop it")


def train_translation(
    model: Seq2SeqLM,
    src: list[list[int]],
    tgt: list[list[int]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    seed: int = 0,
    warmup: int = 0,
    max_seconds: float | None = None,
    label_smoothing: float = 0.1,
    grad_clip: float | None = 1.0,
    flush_denormal: bool = True,
) -> dict:
    """Teacher-forced training: decoder input ``[bos] + y``, target ``y + [eos]``; sequences are truncated to
    ``model.max_len``. AdamW (betas 0.9, 0.98), linear warmup then cosine decay, label-smoothed cross-entropy.
    Returns ``{"steps", "train_loss" (mean of the last 50 steps), "seconds"}``. ``flush_denormal``: see
    :func:`core.attacks.lm.flush_denormals` (sharp attention makes CPU training 10x slower without it).
    """
    _check_pairs(src, tgt)
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ConfigError(f"steps, batch_size must be >= 1 and lr > 0, got {steps=}, {batch_size=}, {lr=}")
    if pad_id != model.pad_id:
        raise ConfigError(f"pad_id={pad_id} differs from the model's pad_id={model.pad_id}; pass the same id")
    if not 0.0 <= label_smoothing < 1.0:
        raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing=}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
    gen = torch.Generator().manual_seed(seed)
    guard = DivergenceGuard(hint=f"lower the learning rate (lr={lr:g})")
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    with flush_denormals(flush_denormal):
        for step in range(1, steps + 1):
            loss = _train_step(
                model,
                opt,
                sched,
                (src, tgt),
                gen,
                batch_size,
                (bos_id, eos_id, pad_id),
                label_smoothing,
                grad_clip,
            )
            losses.append(guard.check(loss, step=step))  # DivergedError: NaN/inf or exploding
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
    model.eval()
    tail = losses[-50:]
    return {"steps": len(losses), "train_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - start}


def _train_step(
    model: Seq2SeqLM,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    pairs: tuple[list[list[int]], list[list[int]]],
    gen: torch.Generator,
    batch_size: int,
    ids: tuple[int, int, int],
    label_smoothing: float,
    grad_clip: float | None,
) -> float:
    """One teacher-forced AdamW step on a seeded random batch; ``ids = (bos, eos, pad)``; returns the loss."""
    (src, tgt), (bos_id, eos_id, pad_id) = pairs, ids
    L, device = model.max_len, next(model.parameters()).device
    idx = torch.randint(len(src), (batch_size,), generator=gen).tolist()
    x = _pad([src[i][:L] for i in idx], pad_id).to(device)  # (B, S)
    y_in = _pad([([bos_id] + tgt[i])[:L] for i in idx], pad_id).to(device)  # (B, T)
    y_out = _pad([(tgt[i] + [eos_id])[:L] for i in idx], -100).to(device)  # (B, T), -100 = ignored
    logits = model(x, y_in)  # (B, T, V)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),  # (B*T, V)
        y_out.reshape(-1),  # (B*T,)
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    sched.step()
    return float(loss.detach())


@torch.no_grad()
def translate(
    model: Seq2SeqLM,
    src: list[list[int]],
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int = 64,
    batch_size: int = 64,
) -> list[list[int]]:
    """Greedy decoding (the decoder is recomputed each step). Returns token ids without bos/eos."""
    _check_pairs(src)
    if pad_id != model.pad_id:
        raise ConfigError(f"pad_id={pad_id} differs from the model's pad_id={model.pad_id}; pass the same id")
    steps = min(max_len, model.max_len - 1)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hyps: list[list[int]] = []
    for i in range(0, len(src), batch_size):
        x = _pad([s[: model.max_len] for s in src[i : i + batch_size]], pad_id).to(device)  # (B, S)
        memory, src_pad = model.encode(x)
        y = torch.full((x.shape[0], 1), bos_id, dtype=torch.long, device=device)  # (B, 1)
        done = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
        for _ in range(steps):
            nxt = model.decode(y, memory, src_pad)[:, -1].argmax(-1)  # (B,)
            nxt = nxt.masked_fill(done, pad_id)
            y = torch.cat([y, nxt[:, None]], dim=1)  # (B, t+1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        for row in y[:, 1:].tolist():
            hyps.append(row[: row.index(eos_id)] if eos_id in row else [t for t in row if t != pad_id])
    model.train(was_training)
    return hyps


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus SacreBLEU (0-100), case-sensitive, 13a tokenizer, one reference per sentence (Sec. 5.2.1)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise DataError(f"need one reference per hypothesis, got {len(hypotheses)} hypotheses, {len(references)} refs")
    if not hypotheses:
        raise DataError("no hypotheses to score; pass at least one sentence")
    return float(sacrebleu.corpus_bleu(hypotheses, [references], tokenize="13a", lowercase=False).score)
