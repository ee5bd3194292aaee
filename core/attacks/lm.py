"""Small causal LMs with subword or SEB embeddings: build, train, perplexity (SEB paper Sec. 5.1, 5.2.3).

The FILM attack (Gupta et al., 2022; SEB paper Sec. 3.3) reads which rows of the input-embedding gradient are
non-zero. With ``embedding="subword"`` and an untied head these rows are exactly the batch's tokens; with
``embedding="seb_*"`` (:mod:`core.attacks.seb`) only byte-indexed rows exist. Data are ``ids (N, T)`` int64 and
``mask (N, T)`` bool (True on real tokens).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.attacks.seb import install_seb
from core.divergence import DivergenceGuard
from core.errors import ConfigError, DataError
from core.models.gpt2 import tiny_gpt2

EMBEDDINGS: tuple[str, ...] = ("subword", "seb_ar", "seb_cr", "seb_co")
_MAX_EVAL_LOGITS = 1 << 26  # floats of one evaluation batch's logits (256 MB)


def build_causal_lm(
    vocab_size: int,
    *,
    embedding: str = "subword",
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 128,
    mapping: Tensor | None = None,
    byte_dim: int = 64,
    hidden: int = 512,
    output: str = "seb",
    byte_vocab: int | None = None,
    tie_subword: bool = False,
    dropout: float = 0.0,
    seed: int = 0,
) -> nn.Module:
    """A randomly initialised ``GPT2LMHeadModel`` (:func:`core.models.gpt2.tiny_gpt2`, sdpa attention) with the
    chosen embedding.

    ``"subword"``: an ordinary (V, n_embd) ``wte``; with ``tie_subword=False`` the ``lm_head`` is a separate
    matrix, so the ``wte`` gradient is non-zero exactly on the rows of the batch's input tokens (FILM's signal;
    strictly, of the tokens that feed a loss term: the last real token of a sequence predicts nothing and,
    under causal attention, gets no gradient).
    ``"seb_ar" | "seb_cr" | "seb_co"``: :func:`core.attacks.seb.install_seb` with ``mapping`` (V, n_bytes) and
    ``output`` (``"seb"``, ``"tied"`` or ``"subword"``). Initialisation is seeded without touching the global RNG.
    """
    if embedding not in EMBEDDINGS:
        raise ConfigError(f"unknown embedding {embedding!r}; choose one of {EMBEDDINGS}")
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"dropout must be in [0, 1), got {dropout=}")
    if embedding != "subword" and mapping is None:
        raise ConfigError(
            f"embedding={embedding!r} needs a subword->bytes mapping; pass mapping=build_byte_mapping({vocab_size})"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_gpt2(
            vocab_size,
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_positions=n_positions,
            dropout=dropout,
            eos_token_id=0,
            tie_word_embeddings=tie_subword and embedding == "subword",
            attn_implementation="sdpa",
        )
        if embedding != "subword":
            variant = embedding.removeprefix("seb_")
            install_seb(
                model,
                mapping,
                variant=variant,
                byte_dim=byte_dim,
                hidden=hidden,
                output=output,
                byte_vocab=byte_vocab,
            )
    return model


def count_parameters(model: nn.Module) -> int:
    """All distinct parameters (shared ones counted once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class EmbeddingParams:
    """What an LM's embedding parameter count counts (the SEB paper's Table 6 "# Parameters").

    * ``input``: the input embedding module - subword: the (V, d) table ``wte``; SEB: its byte-indexed first
      layer (or byte table) and FFN, whatever V is (the subword->bytes mapping is a buffer, not counted).
    * ``output_untied``: the output layer's parameters not shared with the input module: 0 for a tied head (the
      utility LMs': subword ``lm_head.weight is wte.weight``; SEB's :class:`~core.attacks.seb.SEBLMHead` over the
      input module), V x d for an untied subword head, a second SEB module for ``output="seb"``.
    * ``vocab_size``: the output layer's width (the logits' last dimension), i.e. the vocabulary trained.

    ``total = input + output_untied`` is :func:`embedding_parameter_count`. The position table (``wpe``) is in
    neither: it is the same in every arm.
    """

    input: int
    output_untied: int
    vocab_size: int

    @property
    def total(self) -> int:
        return self.input + self.output_untied


def embedding_parameters(model: nn.Module) -> EmbeddingParams:
    """The input embedding module's parameters and the output head's not shared with it (:class:`EmbeddingParams`)."""
    own = {id(p): p.numel() for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings()
    extra = {id(p): p.numel() for p in head.parameters()} if head is not None else {}
    untied = sum(n for key, n in extra.items() if key not in own)
    return EmbeddingParams(input=sum(own.values()), output_untied=untied, vocab_size=int(model.config.vocab_size))


def embedding_parameter_count(model: nn.Module) -> int:
    """Parameters of the input embedding module plus the output head, a parameter tied between them once
    (:attr:`EmbeddingParams.total`)."""
    return embedding_parameters(model).total


def _check_data(ids: Tensor, mask: Tensor) -> None:
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise DataError(f"ids and mask must both be (N, T), got ids {tuple(ids.shape)} and mask {tuple(mask.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise DataError(f"need at least one sequence of length >= 2, got ids of shape {tuple(ids.shape)}")
    if mask.dtype != torch.bool:
        raise DataError(f"mask must be a bool tensor (True on real tokens), got dtype={mask.dtype}")
    if not bool(next_token_mask(mask).any()):
        raise DataError("mask leaves no next-token prediction (no two adjacent real tokens); check the padding")


def next_token_mask(mask: Tensor) -> Tensor:
    """(N, T) bool: position t is a real prediction target when tokens t-1 and t are both real."""
    prev = torch.zeros_like(mask)
    prev[:, 1:] = mask[:, :-1]  # (N, T) mask shifted right by one
    return mask & prev


def lm_labels(ids: Tensor, mask: Tensor) -> Tensor:
    """HF-style labels (N, T): ``ids`` with -100 where no real next-token prediction ends (HF shifts inside)."""
    return ids.masked_fill(~next_token_mask(mask), -100)


def _denormals_flushed() -> bool:
    """Whether the CPU currently flushes denormal floats to zero (torch has a setter but no getter)."""
    return float(torch.tensor([1e-30]) * torch.tensor([1e-10])) == 0.0


@contextlib.contextmanager
def flush_denormals(enabled: bool = True) -> Iterator[None]:
    """Flush denormal floats to zero on CPU inside the block, restoring the previous mode after.

    Sharp attention (e.g. a learned reversal) makes softmax probabilities of ~1e-40; their gradients are
    denormals, and CPU matmuls on denormals run 10-50x slower (measured: 300 translation steps 52 s -> 4 s).
    GPUs are unaffected. Flushing changes values below 1.2e-38 only.
    """
    if not enabled:
        yield
        return
    before = _denormals_flushed()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _check_train_args(steps: int, batch_size: int, lr: float, warmup: int) -> None:
    if steps < 1 or batch_size < 1:
        raise ConfigError(f"steps and batch_size must be >= 1, got {steps=}, {batch_size=}")
    if not lr > 0:
        raise ConfigError(f"lr must be > 0, got {lr=}")
    if warmup < 0:
        raise ConfigError(f"warmup must be >= 0, got {warmup=}")


def train_lm(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    warmup: int = 0,
    weight_decay: float = 0.0,
    max_seconds: float | None = None,
    grad_clip: float | None = 1.0,
    flush_denormal: bool = True,
    plateau: Plateau | None = None,
) -> dict:
    """AdamW next-token training on ``ids (N, T)`` / ``mask (N, T)``; batches drawn with a seeded generator.

    Linear warmup over ``warmup`` steps then cosine decay to 0. Returns ``{"steps": done, "train_loss": mean
    of the last 50 step losses, "seconds": wall time}``; stops early once ``max_seconds`` have passed.
    ``flush_denormal`` runs the loop under :func:`flush_denormals` (a CPU speed fix). With ``plateau`` the
    validation perplexity is measured every ``plateau.every`` steps (and after the last), training stops once it
    has not improved for ``plateau.patience`` measurements (never, with ``patience=None``: all ``steps`` are
    trained, Fairseq's ``checkpoint_best``), and the model is left at its best measurement; the result then also
    has ``best_step``, ``val_perplexity`` (the best), ``val_curve`` (``[(step, perplexity), ...]``) and
    ``plateaued`` (stopped by patience, not by the step or time budget).
    """
    _check_data(ids, mask)
    _check_train_args(steps, batch_size, lr, warmup)
    if plateau is not None:
        _check_data(plateau.ids, plateau.mask)
    with flush_denormals(flush_denormal):
        device = next(model.parameters()).device
        labels = lm_labels(ids, mask)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, warmup))
        gen = torch.Generator().manual_seed(seed)
        guard = DivergenceGuard(hint=f"lower the learning rate (lr={lr:g})")
        watch = _Watch(plateau) if plateau is not None else None
        model.train()
        losses: list[float] = []
        start = time.perf_counter()
        for step in range(1, steps + 1):
            idx = torch.randint(ids.shape[0], (batch_size,), generator=gen)
            out = model(
                input_ids=ids[idx].to(device),
                attention_mask=mask[idx].to(device).long(),
                labels=labels[idx].to(device),
            )
            losses.append(guard.check(out.loss, step=step))  # DivergedError: NaN/inf or exploding
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            sched.step()
            if watch is not None and (step % plateau.every == 0 or step == steps) and watch.measure(model, step):
                break
            if max_seconds is not None and time.perf_counter() - start > max_seconds:
                break
        model.eval()
        tail = losses[-50:]
        out = {"steps": len(losses), "train_loss": sum(tail) / len(tail), "seconds": time.perf_counter() - start}
        if watch is not None:
            out |= watch.finish(model, len(losses))
        return out


@dataclass(frozen=True)
class Plateau:
    """Validation perplexity on ``ids (N, T)`` / ``mask (N, T)`` held out from training, measured every ``every``
    steps, the model kept at its best measurement: early stopping after ``patience`` measurements without a
    relative improvement of more than ``min_delta``, or (``patience=None``) none: the whole step budget is trained
    and the best measurement kept."""

    ids: Tensor
    mask: Tensor
    every: int
    patience: int | None
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.every < 1 or (self.patience is not None and self.patience < 1) or self.min_delta < 0:
            raise ConfigError(
                f"plateau needs every >= 1, patience >= 1 (or None) and min_delta >= 0, got every={self.every}, "
                f"patience={self.patience}, min_delta={self.min_delta}"
            )


class _Watch:
    """Validation measurements for :class:`Plateau`, keeping the best state."""

    def __init__(self, plateau: Plateau) -> None:
        self.plateau = plateau
        self.curve: list[tuple[int, float]] = []
        self.best = (math.inf, 0)
        self.state: dict[str, Tensor] | None = None
        self.stale = 0
        self.plateaued = False

    def measure(self, model: nn.Module, step: int) -> bool:
        """Measure at ``step``; True once the patience is spent."""
        ppl = perplexity(model, self.plateau.ids, self.plateau.mask)
        model.train()
        self.curve.append((step, ppl))
        if ppl < self.best[0] * (1.0 - self.plateau.min_delta):
            self.best, self.stale = (ppl, step), 0
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            self.stale += 1
        self.plateaued = self.plateau.patience is not None and self.stale >= self.plateau.patience
        return self.plateaued

    def finish(self, model: nn.Module, steps: int) -> dict:
        if not self.curve or self.curve[-1][0] != steps:
            self.measure(model, steps)
            model.eval()
        if self.state is not None:
            model.load_state_dict(self.state)
        return {
            "best_step": self.best[1],
            "val_perplexity": self.best[0],
            "val_curve": self.curve,
            "plateaued": self.plateaued,
        }


@torch.no_grad()
def perplexity(
    model: nn.Module, ids: Tensor, mask: Tensor, *, batch_size: int = 64, max_logits: int = _MAX_EVAL_LOGITS
) -> float:
    """exp(token-weighted mean NLL) over every real next-token prediction (both tokens real; Sec. 5.2.3).

    Sequences are scored ``batch_size`` at a time, fewer where a batch's logits (B, T, V) would exceed
    ``max_logits`` floats (a whole-vocabulary model: 64 x 128 x 50,257 logits are 1.6 GB); the sum is the same.
    """
    _check_data(ids, mask)
    if batch_size < 1 or max_logits < 1:
        raise ConfigError(f"batch_size and max_logits must be >= 1, got {batch_size=}, {max_logits=}")
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 1))
    batch_size = max(1, min(batch_size, max_logits // (ids.shape[1] * vocab)))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, ids.shape[0], batch_size):
        x, m = ids[i : i + batch_size].to(device), mask[i : i + batch_size].to(device)
        logits = model(input_ids=x, attention_mask=m.long()).logits[:, :-1]  # (B, T-1, V) predicts x[:, 1:]
        keep = next_token_mask(m)[:, 1:]  # (B, T-1)
        nll = F.cross_entropy(logits[keep].float(), x[:, 1:][keep], reduction="sum")  # over (K, V) rows
        total += float(nll)
        count += int(keep.sum())
    model.train(was_training)
    return math.exp(total / count)
