"""Tables 1-2's recipe choice (core.tangent.search) and Table 1's cells (core.tangent.experiments.table1_cell): the
grid and its order, the choice on validation data only (never the test set, ties to the first point, a diverged
point never), and a one-point grid that trains exactly what Table 1 trained before the search existed."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from core.errors import ConfigError, DataError, DivergedError
from core.tangent import experiments as X
from core.tangent.baselines import NonlinearSuffix, train_fc, train_nonlinear
from core.tangent.model import TangentModel
from core.tangent.search import (
    FTPoint,
    Selection,
    choose_point,
    fine_tune_grid,
    search_table1,
    select,
    validation_split,
)
from core.tangent.train import TangentTrainConfig, train_tangent
from tests.core.tangent.test_regimes import Setup

CFG = TangentTrainConfig(epochs=2, batch_size=8, lr=1e-3, loss="ce", seed=3)


@pytest.fixture(scope="module")
def s() -> Setup:
    return Setup()


# ------------------------------------------------------------------------------ the grid and the choice
def test_grid_order_labels_and_bad_values() -> None:
    grid = fine_tune_grid([1e-3, 1e-4], [True, False], [False, True])
    assert [(p.lr, p.pretrained, p.cls) for p in grid[:4]] == [
        (1e-3, True, False),
        (1e-3, True, True),
        (1e-3, False, False),
        (1e-3, False, True),
    ]  # lr major, CLS fastest: the order ties are broken by
    assert len(grid) == 8 and grid[-1] == FTPoint(1e-4, False, True) and grid[3].label == "lr=0.001 PT=F CLS=T"
    assert fine_tune_grid([1e-3]) == (FTPoint(1e-3, True, False),)  # the non-linear methods: lr only
    with pytest.raises(ConfigError, match=r"every lr must be a finite number > 0, got \[0\]"):
        fine_tune_grid([0])
    with pytest.raises(ConfigError, match=r"got lrs=\[0.001, 0.001\]"):
        fine_tune_grid([1e-3, 1e-3])
    with pytest.raises(ConfigError, match=r"PT and CLS values must be true or false, got \[1\]"):
        fine_tune_grid([1e-3], [1])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="at least one lr, PT and CLS value"):
        fine_tune_grid([1e-3], [], [False])


def test_the_split_names_the_images_and_the_fix() -> None:
    fit, val = validation_split(48, 0.25, seed=0, what="training images", fix="change tangent.search.val_fraction")
    assert (fit.numel(), val.numel()) == (36, 12) and sorted(torch.cat([fit, val]).tolist()) == list(range(48))
    with pytest.raises(DataError, match="0.001 of 48 training images leaves an empty part.*tangent.search"):
        validation_split(48, 0.001, seed=0, what="training images", fix="change tangent.search.val_fraction")


def test_select_scores_every_point_and_picks_the_best_validation() -> None:
    grid = fine_tune_grid([1e-3, 1e-4], [True, False])
    scores = {grid[0]: 0.5, grid[1]: 0.7, grid[2]: 0.7, grid[3]: math.nan}
    seen = []

    def score(p: FTPoint) -> float:
        seen.append(p)
        return scores[p]

    sel = select(grid, score, n_fit=36, n_val=12)
    assert seen == list(grid)  # every point, in grid order, once
    assert sel.chosen == 1 and sel.point == grid[1]  # a tie goes to the first in grid order; NaN never wins
    assert sel.points == 4 and (sel.n_fit, sel.n_val) == (36, 12) and math.isnan(sel.valid_accuracy[3])
    back = Selection.from_dict(sel.as_dict())
    assert back.grid == sel.grid and back.chosen == 1 and math.isnan(back.valid_accuracy[3])
    assert sel.as_dict()["valid_accuracy"][3] is None  # JSON has no NaN

    def diverges(p: FTPoint) -> float:
        if p.lr == 1e-3:
            raise DivergedError("loss is NaN at step 1; lower the learning rate")
        return 0.1

    assert select(grid, diverges, n_fit=1, n_val=1).chosen == 2  # a diverged point scores NaN and is skipped
    with pytest.raises(DivergedError, match="every point of the search diverged"):
        select(grid, lambda p: math.nan, n_fit=1, n_val=1)
    assert choose_point([0.2, 0.9, 0.9]) == 1


# ------------------------------------------------------------------------------ Table 1's search
def _predict(s: Setup, p: FTPoint, fit: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """What TAFT at point ``p`` trained on ``fit`` predicts on ``val`` (the training of :func:`X.table1_cell`)."""
    model = TangentModel(s.backbone, 3, 1, reinit_last_block=not p.pretrained, linearize_cls_token=p.cls, head=s.head)
    train_tangent(model, s.cached[fit], s.y[fit], replace(CFG, lr=p.lr))
    return X.logits_of(model, s.cached[val]).argmax(dim=1)


def test_the_search_chooses_by_validation_where_test_disagrees(s: Setup) -> None:
    """Validation and test disagree by construction: the validation labels are what the PT=F point predicts and
    the test labels what the PT=T point predicts, so each set has its own perfect point. The search, given the
    validation set (it never receives a test set), picks the validation winner; given the test labels in its place
    it picks the other, so the choice follows the set it scores on."""
    fit, val = validation_split(s.cached.shape[0], 0.3, seed=0)
    grid = fine_tune_grid([1e-3], [True, False])
    test_labels, val_labels = (_predict(s, p, fit, val) for p in grid)
    assert not torch.equal(test_labels, val_labels)  # the two points disagree somewhere
    before = copy.deepcopy((s.backbone.state_dict(), s.head.state_dict()))
    fitting = (s.cached[fit], s.y[fit])
    search = search_table1("taft", s.backbone, s.head, fitting, (s.cached[val], val_labels), grid, CFG)
    assert search.valid_accuracy[1] == 1.0 > search.valid_accuracy[0]
    assert search.chosen == 1 and search.point == FTPoint(1e-3, False, False)
    assert (search.n_fit, search.n_val) == (fit.numel(), val.numel())
    on_test = search_table1("taft", s.backbone, s.head, fitting, (s.cached[val], test_labels), grid, CFG)
    assert on_test.chosen == 0 and on_test.valid_accuracy[0] == 1.0  # choosing on test would pick the other
    after = (s.backbone.state_dict(), s.head.state_dict())  # the points start from the same, untouched weights
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after, strict=True) for k in a)


@pytest.mark.parametrize("method", ["nlft", "fc"])
def test_baselines_search_their_learning_rate_only(s: Setup, method: str) -> None:
    fit, val = validation_split(s.cached.shape[0], 0.3, seed=0)
    grid = fine_tune_grid([1e-3, 1e-4])
    search = search_table1(method, s.backbone, s.head, (s.cached[fit], s.y[fit]), (s.cached[val], s.y[val]), grid, CFG)
    assert search.points == 2 and all(0.0 <= v <= 1.0 for v in search.valid_accuracy)
    cells = [
        X.table1_cell(method, s.backbone, s.head, s.cached[fit], s.y[fit], s.cached[val], s.y[val], replace(CFG, lr=lr))
        for lr in (1e-3, 1e-4)
    ]
    assert search.valid_accuracy == tuple(c.eval_accuracy for c in cells)  # each point scored as its own cell
    with pytest.raises(ConfigError, match=f"PT and CLS are TAFT's knobs.*{method} has neither"):
        search_table1(
            method, s.backbone, s.head, (s.cached, s.y), (s.cached, s.y), fine_tune_grid([1e-3], [False]), CFG
        )


# ------------------------------------------------------------------------------ one point: as before
def _before(method: str, s: Setup, cfg: TangentTrainConfig) -> tuple[float, float, int, list[tuple[float, float]]]:
    """Table 1 as tasks/tangent.py computed it before the search existed (train on all, evaluate on the test set)."""
    h, y, th, ty = s.cached, s.y, s.cached[:11], s.y[:11]
    if method == "taft":
        model = TangentModel(s.backbone, 3, 1, reinit_last_block=False, linearize_cls_token=False, head=s.head, seed=0)
        stats = train_tangent(model, h, y, cfg)
        n = sum(p.numel() for p in model.tangent_parameters())
        accs = X.accuracy(X.logits_of(model, th), ty), X.accuracy(X.logits_of(model, h), y)
    elif method == "nlft":
        suffix, stats = train_nonlinear(s.backbone, NonlinearSuffix(s.backbone, s.head, 1).head, h, y, cfg, k=1)
        n = sum(p.numel() for p in suffix.parameters())
        accs = X.accuracy(X.logits_of(suffix, th), ty), X.accuracy(X.logits_of(suffix, h), y)
    else:
        base = NonlinearSuffix(s.backbone, s.head, 1)
        z_train, z_test = X.cls_features(base, h), X.cls_features(base, th)
        fc, stats = train_fc(base.head, z_train, y, cfg)
        with torch.no_grad():
            accs = X.accuracy(fc(z_test), ty), X.accuracy(fc(z_train), y)
        n = sum(p.numel() for p in fc.parameters())
    return *accs, n, [(e.loss, e.delta_norm) for e in stats.epochs]


@pytest.mark.parametrize("method", ["taft", "nlft", "fc"])
def test_one_point_trains_what_table1_trained_before(s: Setup, method: str) -> None:
    """A method with a one-point grid is not searched: one cell on all the training images, whose training (loss and
    distance moved at every epoch), accuracies and size equal the code path before the search, exactly."""
    cfg = replace(CFG, loss="rsl" if method == "taft" else "ce")
    cell = X.table1_cell(method, s.backbone, s.head, s.cached, s.y, s.cached[:11], s.y[:11], cfg)
    test_acc, train_acc, n, trajectory = _before(method, s, cfg)
    assert (cell.eval_accuracy, cell.train_accuracy, cell.trainable) == (test_acc, train_acc, n)
    assert [(e.loss, e.delta_norm) for e in cell.stats.epochs] == trajectory
    assert cell.stats.steps == cfg.epochs * math.ceil(s.cached.shape[0] / cfg.batch_size)  # all 30 images, once


def test_table1_cell_refuses_an_unknown_method(s: Setup) -> None:
    with pytest.raises(ConfigError, match="unknown Table 1 method 'sisa'; known: taft, nlft, fc"):
        X.table1_cell("sisa", s.backbone, s.head, s.cached, s.y, s.cached, s.y, CFG)
    assert X.TABLE1_METHODS == ("taft", "nlft", "fc")
