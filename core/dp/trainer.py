"""DP-SGD training of sequential recommenders (DPFormer Sec. 3, 5 and 6; App. E.1-E.3).

:func:`train_seqrec` trains one method of :mod:`core.dp.methods` on a
:class:`~core.data.sequential.SequentialDataset` and evaluates it by full ranking.

**Privacy unit.** Each user contributes exactly one training row, so the guarantee is user-level
(App. E.1): ``N`` = number of users. With ``train_targets="every"`` (the default, as RecBole's SASRec trains)
the row holds every next-item pair of the user's training prefix in windows of ``max_len``
(:meth:`SequentialDataset.train_windows`), read by the model window by window but clipped as one sample; with
``"last_window"`` only the last ``max_len`` pairs (:meth:`SequentialDataset.train_examples`). A batch is run in
chunks of users with similar window counts (:meth:`_Run.chunks`); per-sample clipping makes the chunks'
clipped sums add up to the batch's, and the noise is added once per step. Neighbouring datasets differ by
**adding or removing one user**
(:data:`NEIGHBOURING`), the relation of the Poisson-subsampled Gaussian's RDP analysis the accountants
implement; a user's clipped contribution has norm at most ``C`` and the noisy sum is divided by the
fixed ``q N``, not by the batch's size.

**DP-SGD (eq. 3.1).** ``T = epochs * round(1 / q)`` steps (capped by ``max_steps``) over
Poisson-sampled batches with rate ``q = batch_size / N`` (:mod:`core.dp.sampling`). The noise
multiplier ``sigma`` is calibrated *before* training so that the ``T`` steps spend the target
epsilon at ``delta`` (default ``1 / (10 N)``; Sec. 6: "we fix the total training epochs and derive
the noise ... from the preset privacy budget"). Per step: the per-sequence losses (sum of the
next-item cross-entropies over the sequence's positions) go through the clipper, which leaves
``sum_i clip(g_i)`` in ``p.grad``; :func:`~core.dp.noise.privatize_grads_` adds
``N(0, (sigma C)^2)`` and divides by the expected batch size ``q N``; Adam (weight decay ``1e-5``,
E.3) steps with a learning rate warmed up linearly over the first ``warmup_frac`` of the steps, then
decayed linearly to 0 (Sec. 6). An empty Poisson batch is a noise-only step. Every step is recorded
by a :class:`~core.dp.accounting.PrivacyAccountant`, and the budget is checked at the end.

**Randomness.** ``cfg.seed`` (recorded with the run) seeds initialisation and dropout and, by default, the
Poisson batches and the DP noise: a rerun reproduces the run exactly, and so does anyone who reads the seed,
who can then regenerate the noise stream; such a run is DP only while its seed stays secret. With
``cfg.secure_mode`` the batches come from a generator seeded by ``secrets.randbits(64)`` and the noise from a
fresh CSPRNG-seeded generator per step (:mod:`core.dp.noise`), neither recorded; :func:`noise_source_of` names
what a run used (recorded as ``privbench.noise_source``).

**Re-Attention (Sec. 5).** For ``reattention=True`` the item embedding's effective error variance
``(sigma C / (q N p_i))^2`` (Claim 5.4) -- with ``p_i`` the fraction of training sequences that
contain item ``i`` (eq. C.3), floored at ``1 / N`` for items absent from every training window --
and the block variance ``(sigma C / (q N))^2`` (Claim 5.3) are propagated block by block to every
block's attention logits by :class:`~core.dp.propagation.BlockReAttention` (positions: Claim 5.4 with
the fraction of sequences reaching each position), and each block's logits are corrected by half their
propagated variance. The per-batch corrections are passed to every forward, in training and in
evaluation; their sizes over the last epoch's training batches are returned
(``TrainResult.correction_sizes``, :class:`~core.dp.propagation.CorrectionSizes`). As in the paper
(Remark C.1) the frequencies are treated as **public**: they are computed here from the private
training data and are *not* covered by the DP guarantee.

**Non-private runs** (``clipping="nonprivate"``): shuffled fixed-size batches, ``ceil(N /
batch_size)`` per epoch, loss = mean over the batch's sequences of the per-sequence loss (sum over
positions), ordinary backward; same optimiser and schedule.

**Evaluation** every ``eval_every`` epochs and after the last step: full ranking over all items
(:func:`~core.metrics.rank_of_target`, padding excluded, pessimistic ties) of the validation target
(input ``s[:-2]``) and the test target (input ``s[:-1]``) of every user; NDCG@10 and HIT@10 means,
under two protocols (:data:`EVAL_PROTOCOL`) from the same scores: **history ranked** (``*10``: the
items the user already interacted with compete with the target) and **history masked** (``*10_masked``,
RecBole's full ranking: :meth:`~core.data.sequential.SequentialDataset.history_mask` removes every item
of the sequence before the target, the target itself excepted, as if scored ``-inf``). Each protocol
picks its own best evaluation on its own validation NDCG@10 (``best_epoch``, ``best_epoch_masked``);
test metrics are never used to select. The training loss and all metrics are diagnostics computed on
private data: they are not covered by the guarantee (neither is hyper-parameter selection on them,
footnote 9).

**Divergence.** A non-finite loss or gradient, or a per-token training loss that explodes above
``max(10 l_1, l_1 + 10)`` (``l_1``: the first step's; :class:`~core.divergence.DivergenceGuard`), stops
training with :class:`TrainingDivergedError` naming the step, the loss and the learning rate to lower.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from core.data.sequential import SequentialDataset
from core.divergence import DivergenceGuard
from core.dp.accounting import (
    PrivacyAccountant,
    PrivacyLedger,
    require_accountant,
)
from core.dp.clipping import Clipper, make_clipper
from core.dp.methods import METHODS, DPTrainConfig, build_reattention, method_config
from core.dp.noise import noise_source, privatize_grads_
from core.dp.propagation import BlockReAttention, CorrectionSizes
from core.dp.sampling import poisson_batches
from core.dp.schedule import EpsilonTracker, RunSchedule, lr_multiplier, run_schedule
from core.errors import ConfigError, DataError, DivergedError, PrivacyError
from core.metrics import hit_from_ranks, ndcg_from_ranks, rank_of_target
from core.models import PADDING_ID, SeqRecConfig, SeqRecModel, build_seqrec, sequence_loss
from core.models.seqrec import Corrections

__all__ = [
    "EVAL_PROTOCOL",
    "METHODS",
    "NEIGHBOURING",
    "PRIVACY_UNIT",
    "DPTrainConfig",
    "EpochLog",
    "TrainResult",
    "TrainingDivergedError",
    "build_reattention",
    "lr_multiplier",
    "method_config",
    "noise_source_of",
    "train_seqrec",
]

EVAL_BATCH_SIZE = 256
TOP_K = 10
#: The protected unit and the neighbouring relation of the (epsilon, delta) guarantee (module docstring).
PRIVACY_UNIT, NEIGHBOURING = "user", "add/remove"
#: How :func:`train_seqrec` evaluates (recorded with every run as ``privbench.protocol``).
EVAL_PROTOCOL = (
    "full ranking over all items, pessimistic ties, leave-last-out; two protocols: history ranked (*_at_10: "
    "the user's earlier items compete with the target) and history masked (*_at_10_masked, RecBole: the "
    "user's earlier items excluded, the target never); each selects its best epoch on its own validation "
    "NDCG@10 (best_epoch, best_epoch_masked), never on test"
)


class TrainingDivergedError(DivergedError, PrivacyError):
    """DP-SGD training diverged: NaN/inf or exploding loss, or a NaN/inf gradient (the message names the step).

    Also a :class:`~core.errors.PrivacyError`: a non-finite gradient voids the clipping bound that the noise is
    calibrated to, so no such step may be taken.
    """


@dataclass(frozen=True, kw_only=True)
class EpochLog:
    """One evaluation: after ``step`` optimiser steps, in (possibly partial) epoch ``epoch`` (1-based).

    ``train_loss``: mean next-item cross-entropy per target position over the epoch's batches (NaN
    if they were all empty). ``*10``: history ranked; ``*10_masked``: history masked (:data:`EVAL_PROTOCOL`).
    ``epsilon_spent``: privacy spent so far (``math.inf`` if non-private).
    ``wall_s``: seconds since :func:`train_seqrec` was called, noise calibration included (excluded
    from ``==``).
    """

    epoch: int
    step: int
    train_loss: float
    valid_ndcg10: float
    valid_hit10: float
    test_ndcg10: float
    test_hit10: float
    valid_ndcg10_masked: float
    valid_hit10_masked: float
    test_ndcg10_masked: float
    test_hit10_masked: float
    epsilon_spent: float
    wall_s: float = field(compare=False)


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """Outcome of :func:`train_seqrec`.

    ``test_ndcg10``/``test_hit10`` are taken at ``best_epoch``, the evaluation with the highest
    validation NDCG@10 (first on ties; the paper reports best results); ``final_*`` at the last one.
    The ``*_masked`` fields are the same under the history-masked protocol, at ``best_epoch_masked``
    (highest *masked* validation NDCG@10).
    ``ledger`` is None for non-private runs (``noise_multiplier`` 0). ``model`` is the trained model
    (excluded from ``==`` and ``repr``, as is ``wall_s``). ``correction_sizes``: Re-Attention's
    per-block correction sizes over the last epoch (:meth:`~core.dp.propagation.CorrectionSizes.metrics`),
    empty without Re-Attention.
    """

    history: tuple[EpochLog, ...]
    best_epoch: int
    test_ndcg10: float
    test_hit10: float
    final_test_ndcg10: float
    final_test_hit10: float
    best_epoch_masked: int
    test_ndcg10_masked: float
    test_hit10_masked: float
    final_test_ndcg10_masked: float
    final_test_hit10_masked: float
    ledger: PrivacyLedger | None
    noise_multiplier: float
    sample_rate: float
    steps: int
    n_params: int
    config: DPTrainConfig
    wall_s: float = field(compare=False)
    model: SeqRecModel | None = field(default=None, compare=False, repr=False)
    correction_sizes: dict[str, float] = field(default_factory=dict)


def noise_source_of(cfg: DPTrainConfig) -> str:
    """Where ``cfg``'s DP noise comes from (:data:`core.dp.noise.NOISE_SOURCES`), or ``"none (non-private)"``."""
    return noise_source(cfg.secure_mode) if cfg.private else "none (non-private)"


@dataclass(frozen=True)
class _Tensors:
    """Training rows (N, K L) of every user (K = 1 for ``last_window``), the number of windows each user's
    row really holds (N,), and evaluation inputs (N, L) / targets (N,)."""

    inputs: Tensor
    targets: Tensor
    windows: Tensor
    valid: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]


def _tensors(data: SequentialDataset, cfg: DPTrainConfig, device: torch.device) -> _Tensors:
    max_len, users = cfg.max_len, np.arange(data.n_users)
    if cfg.train_targets == "every":
        inputs, targets = data.train_windows(max_len)
        windows = torch.from_numpy(data.train_window_counts(max_len))
    else:
        inputs, targets = data.train_examples(max_len)
        windows = torch.ones(data.n_users, dtype=torch.int64)
    valid = tuple(t.to(device) for t in data.padded_batch(users, max_len, split="valid"))
    test = tuple(t.to(device) for t in data.padded_batch(users, max_len, split="test"))
    return _Tensors(inputs.to(device), targets.to(device), windows.to(device), valid, test)


#: A chunk of a batch keeps a user whose windows number at least this share of the chunk's first (largest) user's,
#: so that padding windows stay under about a quarter of a chunk (:meth:`_Run.chunks`).
CHUNK_FILL = 0.75


def _device(cfg: DPTrainConfig) -> torch.device:
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={cfg.device!r} but CUDA is not available; use device='cpu'")
    return device


class _Run:
    """State of one training run: model, clipper, optimiser, schedule, accountant, generators."""

    def __init__(self, data: SequentialDataset, cfg: DPTrainConfig, plan: RunSchedule, device: torch.device) -> None:
        self.cfg, self.plan, self.device = cfg, plan, device
        self.data = data  # for the history masks of evaluation
        self.t = _tensors(data, cfg, device)
        model_cfg = SeqRecConfig(
            num_items=data.n_items, max_len=cfg.max_len, d_model=cfg.d_model, n_heads=cfg.n_heads,
            n_layers=cfg.n_layers, dropout=cfg.dropout, tied=cfg.tied, arch=cfg.arch,
            norm_first=cfg.norm_first,
        )  # fmt: skip
        self.model = build_seqrec(model_cfg).to(device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_multiplier(s, total_steps=plan.total_steps, warmup_steps=plan.warmup_steps),
        )
        # secure_mode: batches and noise from the OS CSPRNG, never from the recorded seed (module docstring)
        self.sample_gen = torch.Generator().manual_seed(secrets.randbits(64) if cfg.secure_mode else cfg.seed)
        self.noise_gen = None if cfg.secure_mode else torch.Generator(device).manual_seed(cfg.seed + 0x5EED)
        self.clipper: Clipper | None = None
        self.accountant: PrivacyAccountant | None = None
        self.epsilon: EpsilonTracker | None = None
        self.reattention: BlockReAttention | None = None
        self.correction_sizes = CorrectionSizes()
        if cfg.private:
            self.accountant = require_accountant(PrivacyAccountant(accountant=cfg.accountant, delta=plan.delta))
            self.epsilon = EpsilonTracker(self.accountant, noise_multiplier=plan.sigma, sample_rate=plan.sample_rate)
            self.clipper = make_clipper(cfg.clipping, self.model, clip_norm=cfg.clip_norm, normalize=cfg.normalize)
            if cfg.reattention:
                self.reattention = build_reattention(
                    self.model, self.t.inputs, self.t.targets, noise_multiplier=plan.sigma,
                    clip_norm=cfg.clip_norm, expected_batch_size=plan.expected_batch, window=cfg.max_len,
                )  # fmt: skip
        self.net: nn.Module = self.model if self.clipper is None else self.clipper.model
        self.guard = DivergenceGuard(hint=_divergence_hint(cfg), error=TrainingDivergedError)
        self.step = 0
        self.loss_sum, self.loss_tokens = 0.0, 0

    # ------------------------------------------------------------------------------ batches
    def batches(self) -> Iterator[Tensor]:
        """User indices of each step: Poisson batches (DP) or shuffled fixed-size batches."""
        plan = self.plan
        if self.cfg.private:
            yield from poisson_batches(
                plan.n, sample_rate=plan.sample_rate, steps=plan.total_steps, generator=self.sample_gen
            )
            return
        produced = 0
        while True:
            for batch in torch.randperm(plan.n, generator=self.sample_gen).split(self.cfg.batch_size):
                if produced == plan.total_steps:
                    return
                produced += 1
                yield batch

    # ------------------------------------------------------------------------------ training
    def chunks(self, users: Tensor) -> Iterator[Tensor]:
        """The batch's users in chunks of similar window counts, most windows first (all of them in one chunk
        for ``last_window``). Per-sample clipping makes the chunks' clipped sums add up to the batch's."""
        counts = self.t.windows[users]
        if len(users) == 0 or bool((counts == counts[0]).all()):
            yield users
            return
        order = torch.argsort(counts, descending=True, stable=True)
        users, counts = users[order], counts[order]
        start = 0
        while start < len(users):
            floor = CHUNK_FILL * float(counts[start])
            end = start + int((counts[start:] >= floor).sum())  # counts are sorted, so these are consecutive
            yield users[start:end]
            start = end

    def _correction(self, ids: Tensor, *, track: bool = False) -> Corrections:
        """Re-Attention for this batch, one correction per block; ``track``: tally its size (training).
        Rows of several windows are propagated window by window, as the attention reads them."""
        if self.reattention is None:
            return None
        windows = ids.reshape(-1, self.cfg.max_len) if ids.shape[1] > self.cfg.max_len else ids
        errors = self.reattention.propagate(windows)
        if track:
            self.correction_sizes.add(self.epoch, errors, windows)
        return BlockReAttention.corrections(errors)

    def _per_sequence_loss(self, users: Tensor) -> Tensor:
        """(B,) each user's summed next-item loss over every target of its row."""
        k = int(self.t.windows[users].max()) if len(users) else 1
        columns = k * self.cfg.max_len if self.t.inputs.shape[1] > self.cfg.max_len else self.t.inputs.shape[1]
        ids, targets = self.t.inputs[users, -columns:], self.t.targets[users, -columns:]
        correction = self._correction(ids, track=True)
        logits = self.net(ids) if correction is None else self.net(ids, score_correction=correction)
        loss = sequence_loss(logits, targets, reduction="none")  # (B,)
        total, tokens = float(loss.detach().sum()), int((targets != PADDING_ID).sum())
        if tokens or not math.isfinite(total):  # the per-token loss; a batch without targets has none
            self.guard.check(total / max(tokens, 1), step=self.step, epoch=self.epoch)
        self.loss_sum += total
        self.loss_tokens += tokens
        return loss

    @property
    def epoch(self) -> int:
        """The (1-based) epoch of the current step."""
        return -(-self.step // self.plan.steps_per_epoch)

    def train_step(self, users: Tensor) -> None:
        self.step += 1
        users = users.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        try:
            if self.clipper is None:
                for chunk in self.chunks(users):
                    (self._per_sequence_loss(chunk).sum() / len(users)).backward()
                self._check_grads()
            else:
                if len(users):  # an empty Poisson batch is a noise-only step
                    for chunk in self.chunks(users):
                        self.clipper.backward(self._per_sequence_loss(chunk))
                privatize_grads_(
                    self.params, noise_multiplier=self.plan.sigma, clip_norm=self.cfg.clip_norm,
                    expected_batch_size=self.plan.expected_batch, generator=self.noise_gen,
                    secure_mode=self.cfg.secure_mode,
                )  # fmt: skip
        except TrainingDivergedError:
            raise
        except PrivacyError as err:  # privatize_grads_ refuses a non-finite gradient
            raise TrainingDivergedError(
                f"training diverged at step {self.step} (epoch {self.epoch}): {err}; {self.guard.hint}"
            ) from err
        self.optimizer.step()
        self.scheduler.step()
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.plan.sigma, sample_rate=self.plan.sample_rate)

    def _check_grads(self) -> None:
        norms = torch.stack([p.grad.norm() for p in self.params if p.grad is not None])
        if not bool(torch.isfinite(norms).all()):
            raise TrainingDivergedError(
                f"training diverged: gradient is not finite at step {self.step} (epoch {self.epoch}); {self.guard.hint}"
            )

    # ---------------------------------------------------------------------------- evaluation
    @torch.inference_mode()
    def _ranking_metrics(self, inputs: Tensor, targets: Tensor, split: str) -> tuple[float, float, float, float]:
        """NDCG@10 and HIT@10 with the history ranked, then with it masked, from one scoring of every user."""
        ranks, masked = [], []
        for start in range(0, len(inputs), EVAL_BATCH_SIZE):
            ids, target = inputs[start : start + EVAL_BATCH_SIZE], targets[start : start + EVAL_BATCH_SIZE]
            correction = self._correction(ids)
            hidden = self.model.hidden(ids, correction)[:, -1]  # (b, d), the last (most recent) position
            scores = self.model.output(hidden)  # (b, M + 1)
            history = self.data.history_mask(np.arange(start, start + len(ids)), split)  # (b, M + 1)
            ranks.append(rank_of_target(scores, target))
            masked.append(rank_of_target(scores, target, exclude=history.to(scores.device)))
        rank, rank_masked = torch.cat(ranks), torch.cat(masked)
        return (
            float(ndcg_from_ranks(rank, k=TOP_K).mean()),
            float(hit_from_ranks(rank, k=TOP_K).mean()),
            float(ndcg_from_ranks(rank_masked, k=TOP_K).mean()),
            float(hit_from_ranks(rank_masked, k=TOP_K).mean()),
        )

    def evaluate(self, epoch: int, started: float) -> EpochLog:
        self.net.eval()
        try:
            valid = self._ranking_metrics(*self.t.valid, "valid")
            test = self._ranking_metrics(*self.t.test, "test")
        finally:
            self.net.train()
        train_loss = self.loss_sum / self.loss_tokens if self.loss_tokens else math.nan
        self.loss_sum, self.loss_tokens = 0.0, 0
        return EpochLog(
            epoch=epoch, step=self.step, train_loss=train_loss,
            valid_ndcg10=valid[0], valid_hit10=valid[1], test_ndcg10=test[0], test_hit10=test[1],
            valid_ndcg10_masked=valid[2], valid_hit10_masked=valid[3],
            test_ndcg10_masked=test[2], test_hit10_masked=test[3],
            epsilon_spent=math.inf if self.epsilon is None else self.epsilon.epsilon(),
            wall_s=time.perf_counter() - started,
        )  # fmt: skip

    def close(self) -> None:
        if self.clipper is not None:
            self.clipper.close()


def _divergence_hint(cfg: DPTrainConfig) -> str:
    """What to change when ``cfg``'s training diverges."""
    if cfg.private:
        return f"lower the learning rate (lr={cfg.lr:g}) or the clip norm (clip_norm={cfg.clip_norm:g})"
    return f"lower the learning rate (lr={cfg.lr:g})"


def _check_call(data: SequentialDataset, cfg: DPTrainConfig) -> None:
    if not isinstance(cfg, DPTrainConfig):
        raise ConfigError(f"cfg must be a DPTrainConfig (see method_config), got {type(cfg).__name__}")
    if not isinstance(data, SequentialDataset):
        raise DataError(f"data must be a SequentialDataset (build_sequential_dataset), got {type(data).__name__}")
    if data.n_users < 1 or data.n_interactions == 0:
        raise DataError(f"{data.source}: empty dataset ({data.n_users} users); nothing to train on")
    if not bool((data.seq_lens >= 4).any()):  # a training prefix s[:-2] of >= 2 items has a target
        raise DataError(
            f"{data.source}: no training targets -- every one of the {data.n_users} users has exactly 3 "
            "interactions, all held out for validation/test; training needs users with >= 4 interactions"
        )


def train_seqrec(
    data: SequentialDataset,
    cfg: DPTrainConfig,
    *,
    on_epoch: Callable[[EpochLog], None] | None = None,
) -> TrainResult:
    """Train ``cfg``'s method on ``data`` (module docstring); ``on_epoch`` gets every :class:`EpochLog`.

    Seeded by ``cfg.seed``: initialisation and dropout use torch's global RNG, forked so that the
    caller's RNG state is left untouched; batch sampling and DP noise use their own generators, seeded
    from ``cfg.seed`` too unless ``cfg.secure_mode`` (then from the OS CSPRNG, not reproducible).
    An exception raised by ``on_epoch`` stops training (e.g. early stopping).

    Raises:
        ConfigError: bad config, ``batch_size > N``, an explicit ``delta >= 1/N``, unreachable epsilon.
        DataError: no training targets (every sequence fully held out).
        TrainingDivergedError: NaN/inf or exploding loss, NaN/inf gradient (names the step; module docstring).
        PrivacyError: the spent epsilon exceeds the target (accounting bug).
    """
    _check_call(data, cfg)
    started = time.perf_counter()
    device = _device(cfg)
    plan = run_schedule(data, cfg)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(cfg.seed)
        run = _Run(data, cfg, plan, device)
        try:
            history = _train(run, started, on_epoch)
        finally:
            run.close()
    ledger = None if run.accountant is None else _final_ledger(run.accountant, cfg)
    best = max(history, key=lambda log: log.valid_ndcg10)  # first maximum on ties; never on test
    best_masked = max(history, key=lambda log: log.valid_ndcg10_masked)
    final = history[-1]
    return TrainResult(
        history=history, best_epoch=best.epoch, test_ndcg10=best.test_ndcg10, test_hit10=best.test_hit10,
        final_test_ndcg10=final.test_ndcg10, final_test_hit10=final.test_hit10,
        best_epoch_masked=best_masked.epoch, test_ndcg10_masked=best_masked.test_ndcg10_masked,
        test_hit10_masked=best_masked.test_hit10_masked, final_test_ndcg10_masked=final.test_ndcg10_masked,
        final_test_hit10_masked=final.test_hit10_masked,
        ledger=ledger, noise_multiplier=plan.sigma, sample_rate=plan.sample_rate, steps=run.step,
        n_params=sum(p.numel() for p in run.params), config=cfg,
        wall_s=time.perf_counter() - started, model=run.model.eval(),
        correction_sizes=run.correction_sizes.metrics(),
    )  # fmt: skip


def _final_ledger(accountant: PrivacyAccountant, cfg: DPTrainConfig) -> PrivacyLedger:
    """The run's ledger, refusing (PrivacyError) a spent epsilon above the target."""
    ledger = accountant.ledger(clip_norm=cfg.clip_norm, target_epsilon=cfg.epsilon)
    if ledger.epsilon > cfg.epsilon:
        raise PrivacyError(
            f"privacy budget exceeded: spent epsilon={ledger.epsilon:.4f} > target epsilon={cfg.epsilon!r} "
            f"at delta={ledger.delta!r} after {ledger.steps} steps; the noise calibration is broken"
        )
    return ledger


def _train(run: _Run, started: float, on_epoch: Callable[[EpochLog], None] | None) -> tuple[EpochLog, ...]:
    history: list[EpochLog] = []
    per_epoch, total = run.plan.steps_per_epoch, run.plan.total_steps
    best, stale = (-math.inf, -math.inf), 0  # the best validation NDCG@10 (ranked, masked); evaluations since
    for users in run.batches():
        run.train_step(users)
        epoch, at_epoch_end = run.epoch, run.step % per_epoch == 0
        if (at_epoch_end and epoch % run.cfg.eval_every == 0) or run.step == total:
            log = run.evaluate(epoch, started)
            history.append(log)
            if on_epoch is not None:
                on_epoch(log)
            improved = log.valid_ndcg10 > best[0] or log.valid_ndcg10_masked > best[1]
            best = (max(best[0], log.valid_ndcg10), max(best[1], log.valid_ndcg10_masked))
            stale = 0 if improved else stale + 1
            if run.cfg.patience is not None and stale >= run.cfg.patience:
                break  # early stopping on validation (the config's patience)
    return tuple(history)
