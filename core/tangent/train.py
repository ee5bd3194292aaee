"""Training Tangent Transformers with TAFT on cached frozen features, shards and unlearning (Sec. 3-5).

TAFT trains only ``Delta-w`` of the linearised suffix ``f_lin(x) = f_w(x) + J_w f(x) Delta-w``
(:class:`core.tangent.model.TangentModel`). The frozen prefix is computed once per example
(``cache_frozen``), so one training step costs about one forward/backward of the linearised part
(Sec. 5). The objective is the Rescaled Square Loss (eq. 2) or cross-entropy plus a ridge penalty,

    ``min_dw  1/B sum_i L(f_lin(x_i; dw), y_i) + ridge * ||dw||_2^2``,

optionally with projected gradient descent onto ``{dw : ||dw||_2 <= R}`` after every step (App. B).

:func:`train_dp` is the DP-SGD variant (Sec. 3.4): per-example gradients by
``vmap(grad)`` on the cached features, Poisson sampling, clipping, Gaussian noise and an accountant
from :mod:`core.dp`. Sharded training, forgetting, and the non-linear baselines (NLFT-k, FC, SISA,
Model Soup) live in :mod:`core.tangent.baselines`, composition (eq. 13) in :mod:`core.tangent.compose`,
and the stage's experiment procedures (Tables 1-3, Fig. 1) in :mod:`core.tangent.experiments`.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from core.divergence import DivergenceGuard
from core.dp.accounting import (
    PrivacyAccountant,
    PrivacyLedger,
    calibrate_noise_multiplier,
    check_clip_norm,
    default_delta,
)
from core.dp.noise import privatize_grads_
from core.dp.sampling import poisson_batches, sample_rate_for
from core.errors import ConfigError, DataError
from core.tangent.loss import l2_penalty, project_to_ball_, rescaled_square_loss
from core.tangent.model import TangentModel, force_eager_attention_

__all__ = [
    "DP_NEIGHBOURING",
    "DP_PRIVACY_UNIT",
    "EpochStats",
    "TangentTrainConfig",
    "TrainStats",
    "check_data",
    "evaluate",
    "fit",
    "objective",
    "per_sample_grads",
    "train_dp",
    "train_tangent",
]

LossName = Literal["rsl", "ce"]
# what train_dp protects: one training example, under Poisson sampling's add/remove neighbouring relation
DP_PRIVACY_UNIT, DP_NEIGHBOURING = "example", "add/remove"
OptimizerName = Literal["adam", "sgd"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, kw_only=True)
class TangentTrainConfig:
    """Hyperparameters of TAFT (App. A: Adam, batch 32, 30 epochs, lr in {1e-3, 1e-4}, decay x0.1
    at epochs 15 and 25, RSL with kappa = 15; App. B: PGD with kappa = 5, R in {1, 10}).

    Attributes:
        epochs: passes over the (cached) data, >= 1.
        batch_size: minibatch size, >= 1 (the last batch of an epoch may be smaller).
        lr: learning rate > 0.
        loss: ``"rsl"`` (eq. 2 with ``alpha``, ``kappa``) or ``"ce"`` (cross-entropy).
        alpha, kappa: RSL hyperparameters (ignored for ``"ce"``).
        ridge: weight ``lambda >= 0`` of the penalty ``lambda ||dw||_2^2`` (0 for PGD, App. B).
        ball_radius: ``R > 0`` to project ``dw`` onto the ball after every step, or ``None``.
        seed: seed of the minibatch order (training is deterministic given data and seed).
        optimizer: ``"adam"`` or ``"sgd"`` (plain SGD, no momentum).
        lr_milestones: epochs (strictly increasing, in [1, epochs)) at which lr is multiplied by
            ``lr_decay`` (App. A: ``(15, 25)`` with 0.1).
        lr_decay: factor in (0, 1].
    """

    epochs: int = 30
    batch_size: int = 32
    lr: float = 1e-3
    loss: LossName = "rsl"
    alpha: float = 1.0
    kappa: float = 15.0
    ridge: float = 0.0
    ball_radius: float | None = None
    seed: int = 0
    optimizer: OptimizerName = "adam"
    lr_milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {name}={v!r}")
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an int, got seed={self.seed!r}")
        if not _is_real(self.lr) or self.lr <= 0:
            raise ConfigError(f"lr must be a finite number > 0, got lr={self.lr!r}; App. A uses 1e-3 or 1e-4")
        if self.loss not in get_args(LossName):
            raise ConfigError(f"unknown loss={self.loss!r}; known: {', '.join(get_args(LossName))}")
        if self.optimizer not in get_args(OptimizerName):
            raise ConfigError(f"unknown optimizer={self.optimizer!r}; known: {', '.join(get_args(OptimizerName))}")
        if not _is_real(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"alpha must be a finite number > 0, got alpha={self.alpha!r}")
        if not _is_real(self.kappa):
            raise ConfigError(f"kappa must be a finite number, got kappa={self.kappa!r}")
        if not _is_real(self.ridge) or self.ridge < 0:
            raise ConfigError(f"ridge must be a finite number >= 0, got ridge={self.ridge!r}")
        if self.ball_radius is not None and (not _is_real(self.ball_radius) or self.ball_radius <= 0):
            raise ConfigError(f"ball_radius must be None or a finite number > 0, got ball_radius={self.ball_radius!r}")
        ms = self.lr_milestones
        if (
            not isinstance(ms, tuple)
            or not all(_is_int(m) and 1 <= m < self.epochs for m in ms)
            or list(ms) != sorted(set(ms))
        ):
            raise ConfigError(
                f"lr_milestones must be a strictly increasing tuple of ints in [1, {self.epochs}), "
                f"got lr_milestones={ms!r}"
            )
        if not _is_real(self.lr_decay) or not 0 < self.lr_decay <= 1:
            raise ConfigError(f"lr_decay must be in (0, 1], got lr_decay={self.lr_decay!r}")

    def lr_at(self, epoch: int) -> float:
        """Learning rate of ``epoch`` (0-based): ``lr * lr_decay ** #{m in milestones : m <= epoch}``."""
        return self.lr * self.lr_decay ** sum(1 for m in self.lr_milestones if m <= epoch)


@dataclass(frozen=True)
class EpochStats:
    """One epoch: mean objective (data loss + penalty) over its steps, ``||dw||_2`` at its end, lr."""

    epoch: int
    loss: float
    delta_norm: float
    lr: float
    seconds: float


@dataclass(frozen=True)
class TrainStats:
    """A training run: per-epoch stats, number of optimizer steps and wall-clock seconds."""

    epochs: tuple[EpochStats, ...]
    steps: int
    seconds: float

    @property
    def losses(self) -> list[float]:
        return [e.loss for e in self.epochs]


def check_data(cached: Tensor, labels: Tensor, what: str = "cached") -> None:
    """Validate ``cached: (n, ...)`` floating features and ``labels: (n,)`` integer classes, ``n >= 1``."""
    if not isinstance(cached, Tensor) or not cached.is_floating_point() or cached.dim() < 2:
        desc = f"{cached.dtype} {tuple(cached.shape)}" if isinstance(cached, Tensor) else type(cached).__name__
        raise DataError(f"{what} must be a floating (n, ...) tensor of frozen features, got {desc}")
    if cached.shape[0] == 0:
        raise DataError(f"{what} is empty (n=0); training needs at least one sample (empty shard?)")
    if not isinstance(labels, Tensor) or labels.dim() != 1 or labels.shape[0] != cached.shape[0]:
        desc = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise DataError(f"labels must be a (n,) tensor with n={cached.shape[0]} matching {what}, got {desc}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise DataError(f"labels must be integer class indices, got dtype {labels.dtype}")


def objective(logits: Tensor, labels: Tensor, cfg: TangentTrainConfig) -> Tensor:
    """Mean data loss: RSL (eq. 2) or cross-entropy; ``()`` scalar."""
    if cfg.loss == "rsl":
        return rescaled_square_loss(logits, labels, alpha=cfg.alpha, kappa=cfg.kappa)
    return nn.functional.cross_entropy(logits, labels.long())


def fit(
    forward: Callable[[Tensor], Tensor],
    params: Sequence[nn.Parameter],
    cached: Tensor,
    labels: Tensor,
    cfg: TangentTrainConfig,
    *,
    penalty: Callable[[], Tensor] | None = None,
    on_epoch: Callable[[EpochStats], None] | None = None,
) -> TrainStats:
    """Generic minibatch loop shared by TAFT and the baselines.

    Each step minimises ``objective(forward(h_B), y_B) + ridge * penalty()`` over ``params``
    (``penalty`` defaults to ``||params||^2``), then projects ``params`` onto the ball of radius
    ``cfg.ball_radius`` if set. The minibatch order is ``randperm(n)`` from ``cfg.seed`` per epoch;
    it depends only on ``n`` and the seed, never on the data. A NaN/inf or exploding objective raises
    :class:`~core.errors.DivergedError` (:class:`~core.divergence.DivergenceGuard`).
    """
    check_data(cached, labels)
    params = list(params)
    if not params:
        raise ConfigError("no trainable parameters passed to fit(); check the model's tangent_parameters()")
    if penalty is None:
        penalty = lambda: l2_penalty(params)
    opt_cls = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.SGD
    opt = opt_cls(params, lr=cfg.lr)
    labels = labels.long().to(cached.device)
    n = cached.shape[0]
    gen = torch.Generator().manual_seed(cfg.seed)
    guard = DivergenceGuard(hint=f"lower the learning rate (lr={cfg.lr:g})")
    stats: list[EpochStats] = []
    steps, start = 0, time.perf_counter()
    for epoch in range(cfg.epochs):
        t0, lr = time.perf_counter(), cfg.lr_at(epoch)
        for g in opt.param_groups:
            g["lr"] = lr
        total, count = 0.0, 0
        for idx in torch.randperm(n, generator=gen).split(cfg.batch_size):
            idx = idx.to(cached.device)
            loss = objective(forward(cached[idx]), labels[idx], cfg)
            if cfg.ridge > 0:
                loss = loss + cfg.ridge * penalty()
            value = guard.check(loss, step=steps + 1, epoch=epoch + 1)  # DivergedError: NaN/inf or exploding
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cfg.ball_radius is not None:
                project_to_ball_(params, cfg.ball_radius)
            total, count, steps = total + value, count + 1, steps + 1
        with torch.no_grad():
            norm = float(l2_penalty([p.detach().double() for p in params]).sqrt())
        es = EpochStats(epoch, total / count, norm, lr, time.perf_counter() - t0)
        stats.append(es)
        if on_epoch is not None:
            on_epoch(es)
    return TrainStats(tuple(stats), steps, time.perf_counter() - start)


def train_tangent(
    model: TangentModel,
    cached: Tensor,
    labels: Tensor,
    cfg: TangentTrainConfig,
    *,
    on_epoch: Callable[[EpochStats], None] | None = None,
) -> TrainStats:
    """Train ``model``'s ``Delta-w`` in place on cached frozen activations (TAFT, Sec. 3 and 5).

    Args:
        model: a :class:`TangentModel`; training starts from its current delta (zero when fresh).
        cached: ``(n, N, D)`` from ``model.cache_frozen(images)`` (same backbone and ``k``).
        labels: ``(n,)`` integer classes in ``[0, num_classes)``.
        cfg: :class:`TangentTrainConfig`; ``ridge`` penalises ``||dw||^2`` (the distance from ``w``).
    Returns:
        :class:`TrainStats`. The trained delta is ``model.get_delta()``.
    """
    if not isinstance(model, TangentModel):
        raise ConfigError(f"train_tangent needs a TangentModel, got {type(model).__name__}")
    check_data(cached, labels)
    if cached.dim() != 3 or cached.shape[-1] != model.head.weight.shape[1]:
        raise DataError(
            f"cached must be (n, N, D={model.head.weight.shape[1]}) from model.cache_frozen, got {tuple(cached.shape)}"
        )
    model.train()
    try:
        return fit(model.forward_from_cache, model.tangent_parameters(), cached, labels, cfg, on_epoch=on_epoch)
    finally:
        model.eval()


@torch.no_grad()
def evaluate(model: nn.Module, cached: Tensor, labels: Tensor, *, batch_size: int = 256) -> float:
    """Top-1 accuracy in [0, 1] of ``model.forward_from_cache`` (or ``model(...)`` when it has none)
    on cached features ``(n, ...)`` and labels ``(n,)``."""
    check_data(cached, labels)
    fwd = getattr(model, "forward_from_cache", model)
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, cached.shape[0], batch_size):
        pred = fwd(cached[i : i + batch_size]).argmax(dim=1)
        correct += int((pred.cpu() == labels[i : i + batch_size].cpu().long()).sum())
    model.train(was_training)
    return correct / cached.shape[0]


# ---------------------------------------------------------------------------------- DP (Sec. 3.4)
class _FromCache(nn.Module):
    """Adapter ``h -> m.forward_from_cache(h)``, so ``functional_call`` parameter names are ``m.<name>``.
    ``m`` is anything with ``forward_from_cache``: a :class:`TangentModel` or a ``NonlinearSuffix``."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, h: Tensor) -> Tensor:
        return self.m.forward_from_cache(h)


def _delta_names(model: nn.Module, what: str) -> list[str]:
    """The default trainable names: a TangentModel's ``Delta-w`` in ``named_parameters`` order."""
    if not isinstance(model, TangentModel):
        raise ConfigError(
            f"{what} needs names= for a {type(model).__name__}; only a TangentModel has default "
            "trainable parameters (its deltas)"
        )
    return [n for n, _ in model.named_parameters() if n in model.source_names]


def _resolve_names(model: nn.Module, names: Sequence[str] | None, what: str) -> list[str]:
    names = _delta_names(model, what) if names is None else list(names)
    if not names:
        raise ConfigError(f"{what}: empty set of trainable parameter names; pass at least one parameter")
    named = dict(model.named_parameters())
    unknown = [n for n in names if n not in named]
    if unknown:
        raise ConfigError(f"{what}: unknown parameter names {unknown} for {type(model).__name__}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{what}: duplicate parameter names in {names}")
    return names


def per_sample_grads(
    model: nn.Module,
    h: Tensor,
    y: Tensor,
    cfg: TangentTrainConfig,
    *,
    names: Sequence[str] | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Per-example gradients ``g_i = grad_theta L(f(x_i; theta), y_i)`` via ``vmap(grad)``:
    ``{name: (B, *shape)}`` and their joint L2 norms ``(B,)``. ``h: (B, N, D)``, ``y: (B,)``.

    ``model`` has ``forward_from_cache`` (a :class:`TangentModel` or a ``NonlinearSuffix``);
    ``theta`` are the parameters ``names`` (default: a TangentModel's deltas), all others are held
    at their current values. ``model`` must be free of randomness (eval mode: no dropout) and of
    cross-example coupling (no batch norm)."""
    names = _resolve_names(model, names, "per_sample_grads")
    wrap = _FromCache(model)
    named = dict(model.named_parameters())
    params = {f"m.{n}": named[n].detach() for n in names}

    with torch.no_grad():
        out0 = model.forward_from_cache(h[:1])
    objective(out0, y[:1], cfg)  # validates shapes / labels once
    num_classes = out0.shape[-1]
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise DataError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    classes = torch.arange(num_classes, device=h.device)

    def loss_one(p: dict[str, Tensor], hi: Tensor, yi: Tensor) -> Tensor:
        out = torch.func.functional_call(wrap, p, (hi.unsqueeze(0),))[0]  # (C,)
        onehot = (classes == yi).to(out.dtype)  # no data-dependent indexing/checks under vmap
        if cfg.loss == "ce":
            return -(torch.log_softmax(out, dim=0) * onehot).sum()
        w = 1.0 + (cfg.alpha - 1.0) * onehot
        return (w * (out - cfg.kappa * onehot) ** 2).sum() / out.shape[0]

    g = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, h, y.long())
    g = {n[2:]: t for n, t in g.items()}
    g = {n: g[n] for n in names}  # in the order of ``names``
    # vector_norm, not pow(2).sum(1): it does not materialise the squares of every per-example gradient (the
    # full regime's are (B, 1.8M) for one DINOv2-small block) and is several times faster on a CPU
    per_tensor = torch.stack([torch.linalg.vector_norm(t.flatten(1), dim=1) for t in g.values()])  # (P, B)
    norms = torch.linalg.vector_norm(per_tensor, dim=0)  # (B,)
    return g, norms


def clipped_grad_sum(
    model: nn.Module,
    names: Sequence[str],
    h: Tensor,
    y: Tensor,
    cfg: TangentTrainConfig,
    clip_norm: float,
    *,
    chunk: int | None = None,
) -> dict[str, Tensor]:
    """``sum_i g_i min(1, C / (||g_i|| + 1e-6))`` over the batch ``h: (B, N, D)``, by name.

    Every clipped per-example contribution has norm ``<= C`` (the DP-SGD sensitivity). ``chunk``
    bounds the number of per-example gradients held in memory at once (``None``: the whole batch).
    """
    chunk = h.shape[0] if chunk is None else chunk
    total: dict[str, Tensor] | None = None
    for s in range(0, h.shape[0], chunk):
        g, norms = per_sample_grads(model, h[s : s + chunk], y[s : s + chunk], cfg, names=names)
        coef = (clip_norm / (norms + 1e-6)).clamp(max=1.0)  # (b,)
        part = {nm: torch.einsum("b,b...->...", coef, g[nm]) for nm in names}
        total = part if total is None else {nm: total[nm] + part[nm] for nm in names}
    assert total is not None  # h is non-empty here (internal invariant)
    return total


@torch.no_grad()
def _project_around_(params: Sequence[Tensor], center: Sequence[Tensor], radius: float) -> None:
    """Project ``params`` onto ``{theta : ||theta - center|| <= R}`` in place."""
    diffs = [p - c for p, c in zip(params, center, strict=True)]
    project_to_ball_(diffs, radius)
    for p, c, d in zip(params, center, diffs, strict=True):
        p.copy_(c + d)


@functools.lru_cache(maxsize=256)
def _noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: Any) -> float:
    """:func:`~core.dp.accounting.calibrate_noise_multiplier`, remembered per process: a Table 3 search trains
    every point at the same epsilon, sampling rate and steps, and one calibration costs a bisection of the
    accountant (a third of a second for Poisson sampling)."""
    return calibrate_noise_multiplier(
        target_epsilon=target_epsilon, delta=delta, sample_rate=sample_rate, steps=steps, accountant=accountant
    )


def train_dp(
    module: nn.Module,
    cached: Tensor,
    labels: Tensor,
    cfg: TangentTrainConfig,
    *,
    target_epsilon: float,
    clip_norm: float,
    names: Sequence[str] | None = None,
    delta: float | None = None,
    accountant: str = "rdp",
    generator: torch.Generator | None = None,
    max_physical_batch: int | None = 256,
) -> tuple[TrainStats, PrivacyLedger]:
    """DP-SGD (Sec. 3.4, Table 3) on the parameters ``names`` of ``module``, in place; the one DP entry point.

    ``module`` has ``forward_from_cache(h): (B, N, D) -> (B, C)`` (a :class:`TangentModel` or a
    ``NonlinearSuffix``); ``names`` defaults to a TangentModel's ``Delta-w`` (a Table 3 regime's subset:
    :func:`core.tangent.regimes.regime_parameter_names`). Poisson batches of expected size
    ``q n = cfg.batch_size``, ``T = epochs * ceil(n / batch_size)`` steps, per-example gradients by
    ``vmap(grad(functional_call))`` clipped to ``C = clip_norm``:

        ``G = ( sum_{i in B} g_i min(1, C / ||g_i||) + N(0, sigma^2 C^2 I) ) / (q n)``,

    with ``sigma`` calibrated so that the accountant spends at most ``target_epsilon`` at ``delta``
    (default ``1/(10 n)``); then Adam/SGD. The ridge gradient ``2 lambda (theta - theta_0)`` (data
    independent) is added after the noise and the ball ``||theta - theta_0|| <= R`` is post-processing, both
    around the parameters' values ``theta_0`` at the start of training (for a fresh TangentModel the origin
    ``Delta-w = 0``). Sampling and noise come from ``generator`` (default: seeded with ``cfg.seed``).
    Per-example gradients are computed in chunks of at most ``max_physical_batch`` examples (a memory bound;
    the sum is the same). Every other parameter stays bit-identical; HF attention is switched to eager
    (:func:`~core.tangent.model.force_eager_attention_`) and ``module`` runs in eval mode (no dropout),
    restored to its previous mode afterwards. Use ``loss="ce"`` and ``predict_jvp_only`` as App. A.

    Returns the stats (losses are *not* private, for monitoring) and the privacy ledger. Raises
    :class:`ConfigError` for an empty or unknown name set, a bad epsilon/clip norm/batch size.
    """
    if not hasattr(module, "forward_from_cache"):
        raise ConfigError(f"train_dp needs a module with forward_from_cache, got {type(module).__name__}")
    check_data(cached, labels)
    check_clip_norm(clip_norm)
    names = _resolve_names(module, names, "train_dp")
    if max_physical_batch is not None and (not _is_int(max_physical_batch) or max_physical_batch < 1):
        raise ConfigError(f"max_physical_batch must be None or an int >= 1, got {max_physical_batch=!r}")
    force_eager_attention_(module)
    n = cached.shape[0]
    q = sample_rate_for(cfg.batch_size, n)
    per_epoch = math.ceil(n / cfg.batch_size)
    steps = cfg.epochs * per_epoch
    delta = default_delta(n) if delta is None else delta
    sigma = _noise_multiplier(target_epsilon, delta, q, steps, accountant)
    acct = PrivacyAccountant(accountant=accountant, delta=delta)
    gen = generator if generator is not None else torch.Generator().manual_seed(cfg.seed)
    named = dict(module.named_parameters())
    params = [named[nm] for nm in names]
    centers = [p.detach().clone() for p in params]
    opt = (torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.SGD)(params, lr=cfg.lr)
    labels = labels.long()
    guard = DivergenceGuard(hint=f"lower the learning rate (lr={cfg.lr:g}) or the clip norm (clip_norm={clip_norm:g})")
    stats: list[EpochStats] = []
    was_training = module.training
    module.eval()
    start, t0, total, count = time.perf_counter(), time.perf_counter(), 0.0, 0
    try:
        for t, idx in enumerate(poisson_batches(n, sample_rate=q, steps=steps, generator=gen)):
            epoch = t // per_epoch
            for g_ in opt.param_groups:
                g_["lr"] = cfg.lr_at(epoch)
            for p in params:
                p.grad = None
            if idx.numel():
                with torch.no_grad():
                    loss = objective(module.forward_from_cache(cached[idx]), labels[idx], cfg)
                total += guard.check(loss, step=t + 1, epoch=epoch + 1)  # DivergedError: NaN/inf or exploding
                count += 1
                g = clipped_grad_sum(module, names, cached[idx], labels[idx], cfg, clip_norm, chunk=max_physical_batch)
                for nm, p in zip(names, params, strict=True):
                    p.grad = g[nm].to(p.dtype)
            privatize_grads_(
                params, noise_multiplier=sigma, clip_norm=clip_norm, expected_batch_size=q * n, generator=gen
            )
            if cfg.ridge > 0:
                for p, c in zip(params, centers, strict=True):
                    p.grad.add_(p.detach() - c, alpha=2 * cfg.ridge)
            opt.step()
            if cfg.ball_radius is not None:
                _project_around_(params, centers, cfg.ball_radius)
            acct.step(noise_multiplier=sigma, sample_rate=q)
            if (t + 1) % per_epoch == 0:
                moved = [p.detach().double() - c.double() for p, c in zip(params, centers, strict=True)]
                norm = float(l2_penalty(moved).sqrt())
                es = EpochStats(epoch, total / max(count, 1), norm, cfg.lr_at(epoch), time.perf_counter() - t0)
                stats.append(es)
                t0, total, count = time.perf_counter(), 0.0, 0
    finally:
        module.train(was_training)
    ledger = acct.ledger(clip_norm=clip_norm, target_epsilon=target_epsilon)
    acct.check_budget(target_epsilon=target_epsilon)
    return TrainStats(tuple(stats), steps, time.perf_counter() - start), ledger
