"""Table 3's recipe (App. A): the DP-SGD schedule and the choice of learning rate and PT on validation data.

The paper trains every DP cell for 50 epochs at a constant learning rate, each step's gradient "aggregated over the
entire dataset" (full batch: Poisson sampling at rate ``q = 1``, one step per epoch), predicts with the JVP output
only, and searches ``PT in {T, F}`` (linearise the pretrained last block, or reset it first) for each epsilon. So
that "Ours" (tangent parameters) and "Reg" (original parameters) are compared like with like, each column gets the
same search: a grid of (lr, PT) points (:func:`search_grid`), each trained with DP-SGD on the fitting part of the DP
training images and scored on a validation part carved from the same images (:func:`validation_split`), the best
validation accuracy chosen (:func:`choose_point`); the caller then retrains the chosen point on all the DP training
images and evaluates it on the test set, which no function here receives. The split and the choice are
:mod:`core.tangent.search`'s, which Tables 1 and 2 use too.

Privacy: every search run is a DP-SGD release of (a subset of) the same images, so under basic composition the
search and the final run together spend ``points x epsilon_search + epsilon`` (:meth:`DPSearch.epsilon_with_tuning`,
as the train-dp stage reports). Choosing the best reads the validation labels without noise, which no epsilon here
covers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

from torch import Tensor, nn

from core.errors import ConfigError, DivergedError
from core.tangent.experiments import dp_regime_cell
from core.tangent.search import Selection, choose_point, validation_split
from core.tangent.train import TangentTrainConfig

__all__ = [
    "DPPoint",
    "DPSearch",
    "choose_point",
    "dp_train_config",
    "search_dp",
    "search_grid",
    "validation_split",
]


@dataclass(frozen=True)
class DPPoint:
    """One point of the search: Adam's learning rate and App. A's PT (``pretrained=False``: the last block reset)."""

    lr: float
    pretrained: bool

    @property
    def label(self) -> str:
        return f"lr={self.lr:g} PT={'T' if self.pretrained else 'F'}"


def search_grid(lrs: Sequence[float], pts: Sequence[bool]) -> tuple[DPPoint, ...]:
    """``lrs x pts`` in that order (learning rate major): the order :func:`choose_point` breaks ties by."""
    lrs, pts = list(lrs), list(pts)
    if not lrs or not pts:
        raise ConfigError(f"the search needs at least one lr and one PT, got lrs={lrs}, pts={pts}")
    bad = [v for v in lrs if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0]
    if bad:
        raise ConfigError(f"every lr must be a finite number > 0, got {bad}; e.g. lrs=[0.001, 0.0001]")
    if len(set(lrs)) != len(lrs) or len(set(pts)) != len(pts):
        raise ConfigError(f"lrs and pts must not repeat a value, got lrs={lrs}, pts={pts}")
    return tuple(DPPoint(float(lr), bool(pt)) for lr in lrs for pt in pts)


def dp_train_config(
    n: int, *, epochs: int, lr: float, seed: int, batch_size: int | None, n_full: int | None = None
) -> TangentTrainConfig:
    """The DP-SGD schedule of a Table 3 run on ``n`` images (cross-entropy, no lr decay, App. A).

    ``batch_size=None`` is the paper's full batch: every step's gradient over all ``n`` (sample rate 1), so
    :func:`~core.tangent.train.train_dp` takes ``epochs`` steps. Otherwise Poisson batches at the sample rate
    ``batch_size / n_full`` of the whole DP training set (``n_full``, default ``n``): a search run on ``n < n_full``
    images keeps that rate and the number of steps (expected batch ``round(q n)``), so it runs the final run's
    mechanism on fewer images."""
    if batch_size is None:
        batch = n
    else:
        full = n if n_full is None else n_full
        if not 1 <= batch_size <= full or n > full:
            raise ConfigError(f"need 1 <= batch_size <= n_full and n <= n_full, got {batch_size=}, {n=}, n_full={full}")
        batch = max(1, round(batch_size * n / full))
    return TangentTrainConfig(epochs=epochs, batch_size=batch, lr=lr, loss="ce", seed=seed)


@dataclass(frozen=True)
class DPSearch(Selection[DPPoint]):
    """A finished DP search (:class:`~core.tangent.search.Selection` over :class:`DPPoint`) and the epsilon every
    search run spent."""

    point_type: ClassVar[type] = DPPoint

    epsilon: float = field(kw_only=True)

    def epsilon_with_tuning(self, final_epsilon: float) -> float:
        """Basic composition of the search's runs and a final run at ``final_epsilon`` on the same images."""
        return self.points * self.epsilon + final_epsilon


def search_dp(
    backbone: nn.Module,
    head: nn.Linear,
    fit: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
    grid: Sequence[DPPoint],
    *,
    regime: str,
    tangent: bool,
    cfg: TangentTrainConfig,
    target_epsilon: float,
    clip_norm: float,
    init_seed: int,
    k: int = 1,
    delta: float | None = None,
    accountant: str = "rdp",
    batch_size: int = 256,
    reg_start: str = "zero",
) -> DPSearch:
    """Train every point of ``grid`` with DP-SGD on ``fit = (h, y)`` (:func:`~core.tangent.experiments.
    dp_regime_cell`: ``cfg``'s schedule and noise seed at the point's lr, the last block reset from ``init_seed``
    where PT=F) at ``target_epsilon``, score it on ``val = (h, y)`` and choose the best (:func:`choose_point`). The
    same noise seed for every point (common random numbers): the points differ only in lr and PT. A point that
    diverges scores NaN."""
    grid = tuple(grid)
    if not grid:
        raise ConfigError("the search grid is empty; give at least one lr and one PT")
    t0 = time.perf_counter()
    valid = []
    for p in grid:
        try:
            cell = dp_regime_cell(
                backbone,
                head,
                *fit,
                *val,
                regime=regime,
                tangent=tangent,
                cfg=replace(cfg, lr=p.lr),
                target_epsilon=target_epsilon,
                clip_norm=clip_norm,
                k=k,
                delta=delta,
                accountant=accountant,
                batch_size=batch_size,
                reg_start=reg_start,
                pretrained=p.pretrained,
                init_seed=init_seed,
            )
            valid.append(cell.test_accuracy)
        except DivergedError:
            valid.append(math.nan)
    return DPSearch(
        grid=grid,
        valid_accuracy=tuple(valid),
        chosen=choose_point(valid),
        epsilon=float(target_epsilon),
        n_fit=int(fit[0].shape[0]),
        n_val=int(val[0].shape[0]),
        seconds=time.perf_counter() - t0,
    )
