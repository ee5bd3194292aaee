"""Choosing a fine-tuning recipe on validation data: the split, the scoring of every grid point, the choice.

App. A of the TAFT paper trains Tables 1 and 2 for 30 epochs (learning rate divided by 10 at epochs 15 and 25) and
picks, for each method, the learning rate from ``{1e-3, 1e-4}`` and, for TAFT, PT (linearise the pretrained last
block, ``pretrained=True``, or reset it first) and CLS (linearise the CLS token) by validation. So that every arm
of a comparison is tuned alike, each method gets the same procedure here: a grid of :class:`FTPoint` (lr major,
then PT, then CLS: :func:`fine_tune_grid`), each point trained on the fitting part of the training images and scored
on a validation part carved from them (:func:`validation_split`, drawn from the seed), the best validation accuracy
chosen (:func:`choose_point`: the first in grid order on ties, a diverged point never). The caller then retrains the
chosen point on all the training images and evaluates it on the test set, which no function here receives.

:func:`select` is the procedure for any scorer (a callable from a point to its validation accuracy);
:func:`search_table1` scores Table 1's methods (:func:`core.tangent.experiments.table1_cell`). Table 3's DP search
(:mod:`core.tangent.dp_search`) shares the split and the choice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor, nn

from core.errors import ConfigError, DataError, DivergedError
from core.tangent.experiments import table1_cell
from core.tangent.train import TangentTrainConfig

__all__ = [
    "FTPoint",
    "Selection",
    "choose_point",
    "fine_tune_grid",
    "search_table1",
    "select",
    "validation_split",
]


def validation_split(
    n: int,
    fraction: float,
    seed: int,
    *,
    what: str = "DP training images",
    fix: str = "raise tangent.dp.n_train or change tangent.dp.val_fraction",
) -> tuple[Tensor, Tensor]:
    """Split ``range(n)`` (the training images of a search) at random from ``seed`` into ``(fit, val)`` index
    tensors, both sorted, disjoint and covering ``range(n)``; ``val`` holds ``round(fraction n)`` of them. Raises
    :class:`DataError` when either part would be empty (``what`` names the images and ``fix`` the remedy)."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"the validation fraction must lie in (0, 1), got {fraction=}")
    n_val = round(fraction * n)
    if not 1 <= n_val <= n - 1:
        raise DataError(
            f"a validation fraction of {fraction:g} of {n} {what} leaves an empty part ({n_val} for validation); {fix}"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def choose_point(valid: Sequence[float]) -> int:
    """Index of the highest validation accuracy, the first in grid order on ties; a diverged point (NaN) is never
    chosen. Raises :class:`DivergedError` when every point diverged."""
    done = [(v, -i) for i, v in enumerate(valid) if math.isfinite(v)]
    if not done:
        raise DivergedError(f"every point of the search diverged ({len(valid)} points); add smaller lrs")
    return -max(done)[1]


@dataclass(frozen=True)
class FTPoint:
    """One fine-tuning recipe of Tables 1-2 (App. A): Adam's learning rate, PT (``pretrained=False``: the last block
    reset before linearising) and CLS (``cls=True``: the CLS token linearised). PT and CLS are TAFT's knobs; the
    non-linear baselines have only the learning rate (PT=T, CLS=F)."""

    lr: float
    pretrained: bool = True
    cls: bool = False

    @property
    def label(self) -> str:
        return f"lr={self.lr:g} PT={'T' if self.pretrained else 'F'} CLS={'T' if self.cls else 'F'}"


def fine_tune_grid(
    lrs: Sequence[float], pts: Sequence[bool] = (True,), cls: Sequence[bool] = (False,)
) -> tuple[FTPoint, ...]:
    """``lrs x pts x cls`` in that order (learning rate major, CLS fastest): the order :func:`choose_point` breaks
    ties by. Raises :class:`ConfigError` naming the bad values."""
    lrs, pts, cls = list(lrs), list(pts), list(cls)
    if not lrs or not pts or not cls:
        raise ConfigError(f"the search needs at least one lr, PT and CLS value, got lrs={lrs}, pts={pts}, cls={cls}")
    bad = [v for v in lrs if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0]
    if bad:
        raise ConfigError(f"every lr must be a finite number > 0, got {bad}; e.g. lrs=[0.001, 0.0001]")
    not_bool = [v for v in pts + cls if not isinstance(v, bool)]
    if not_bool:
        raise ConfigError(f"PT and CLS values must be true or false, got {not_bool}; e.g. pts=[true, false]")
    if len(set(lrs)) != len(lrs) or len(set(pts)) != len(pts) or len(set(cls)) != len(cls):
        raise ConfigError(f"lrs, pts and cls must not repeat a value, got lrs={lrs}, pts={pts}, cls={cls}")
    return tuple(FTPoint(float(lr), pt, c) for lr in lrs for pt in pts for c in cls)


P = TypeVar("P")


@dataclass(frozen=True)
class Selection(Generic[P]):
    """A finished search: the grid, each point's validation accuracy (NaN: diverged) in grid order, the chosen
    index, the sizes of the fitting and validation parts and the wall seconds it took. ``point_type`` is the grid's
    point class (:class:`FTPoint` here; Table 3's :class:`~core.tangent.dp_search.DPSearch` extends this with its
    own), which :meth:`from_dict` rebuilds."""

    point_type: ClassVar[type] = FTPoint

    grid: tuple[P, ...]
    valid_accuracy: tuple[float, ...]
    chosen: int
    n_fit: int
    n_val: int
    seconds: float

    @property
    def point(self) -> P:
        return self.grid[self.chosen]

    @property
    def points(self) -> int:
        return len(self.grid)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON types (a diverged point's accuracy as None); :meth:`from_dict` reads it back."""
        d = asdict(self)
        d["valid_accuracy"] = [v if math.isfinite(v) else None for v in self.valid_accuracy]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Selection[P]:
        return cls(
            **{
                **d,
                "grid": tuple(cls.point_type(**p) if isinstance(p, dict) else p for p in d["grid"]),
                "valid_accuracy": tuple(math.nan if v is None else float(v) for v in d["valid_accuracy"]),
            }
        )


def select(grid: Sequence[FTPoint], score: Callable[[FTPoint], float], *, n_fit: int, n_val: int) -> Selection:
    """Score every point of ``grid`` with ``score`` (its accuracy on the validation part; a point whose training
    diverges, :class:`DivergedError`, or scores NaN counts as diverged) and choose the best (:func:`choose_point`).
    ``score`` is the only thing that trains; it sees points, never the test set."""
    grid = tuple(grid)
    if not grid:
        raise ConfigError("the search grid is empty; give at least one lr")
    t0 = time.perf_counter()
    valid = []
    for p in grid:
        try:
            v = float(score(p))
        except DivergedError:
            v = math.nan
        valid.append(v if math.isfinite(v) else math.nan)
    return Selection(grid, tuple(valid), choose_point(valid), int(n_fit), int(n_val), time.perf_counter() - t0)


def search_table1(
    method: str,
    backbone: nn.Module,
    head: nn.Linear,
    fit: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
    grid: Sequence[FTPoint],
    cfg: TangentTrainConfig,
    *,
    k: int = 1,
    seed: int = 0,
    batch_size: int = 256,
) -> Selection:
    """Table 1's search for ``method`` (``taft``, ``nlft`` or ``fc``): every point of ``grid`` trained on
    ``fit = (h, y)`` (:func:`~core.tangent.experiments.table1_cell`: ``cfg``'s schedule and minibatch seed at the
    point's lr, the last block reset from ``seed`` where PT=F) and scored on ``val = (h, y)``; the best chosen. The
    same minibatch order for every point (common random numbers): the points differ only in their knobs."""

    def score(p: FTPoint) -> float:
        cell = table1_cell(
            method,
            backbone,
            head,
            *fit,
            *val,
            replace(cfg, lr=p.lr),
            k=k,
            pretrained=p.pretrained,
            cls=p.cls,
            seed=seed,
            batch_size=batch_size,
        )
        return cell.eval_accuracy

    return select(grid, score, n_fit=int(fit[0].shape[0]), n_val=int(val[0].shape[0]))
