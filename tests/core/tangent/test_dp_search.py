"""Table 3's recipe (core.tangent.dp_search): the full-batch schedule, PT=F, the validation split, the (lr, PT)
search that chooses on validation data only, and the fc control (both columns tie from the same head)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from core.dp.accounting import compute_epsilon
from core.errors import ConfigError, DataError, DivergedError
from core.tangent.baselines import NonlinearSuffix
from core.tangent.dp_search import (
    DPPoint,
    DPSearch,
    choose_point,
    dp_train_config,
    search_dp,
    search_grid,
    validation_split,
)
from core.tangent.experiments import dp_regime_cell
from core.tangent.model import TangentModel
from core.tangent.regimes import build_regime_model, regime_parameter_names
from core.tangent.train import TangentTrainConfig, objective, train_dp
from tests.core.tangent.test_regimes import Setup


@pytest.fixture(scope="module")
def s() -> Setup:
    return Setup()


# ------------------------------------------------------------------------------ the schedule
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("tangent", [True, False])
def test_full_batch_steps_take_every_image_and_the_accountant_sees_rate_1(s: Setup, tangent: bool) -> None:
    """``batch_size=None``: every step's gradient over all n images (App. A), so the accountant records sample rate
    1 and exactly ``epochs`` steps; at negligible noise and inactive clipping the run is plain full-batch gradient
    descent on the mean loss, checked step by step against it."""
    n, epochs, lr, clip = s.cached.shape[0], 3, 2e-3, 200.0
    cfg = replace(dp_train_config(n, epochs=epochs, lr=lr, seed=0, batch_size=None), optimizer="sgd")
    assert cfg.batch_size == n and cfg.loss == "ce" and cfg.lr_milestones == ()  # no lr decay
    model = build_regime_model(s.backbone, s.head, tangent=tangent)
    names = regime_parameter_names(model, "bitfit")
    stats, ledger = train_dp(model, s.cached, s.y, cfg, names=names, target_epsilon=1e9, clip_norm=clip, delta=1e-3)
    assert ledger.sample_rate == 1.0 and ledger.steps == stats.steps == epochs and len(stats.epochs) == epochs
    assert ledger.epsilon == pytest.approx(
        compute_epsilon(noise_multiplier=ledger.noise_multiplier, delta=1e-3, sample_rate=1.0, steps=epochs)
    )
    ref = build_regime_model(s.backbone, s.head, tangent=tangent)  # reference: epochs plain full-batch GD steps
    params = dict(ref.named_parameters())
    for _ in range(epochs):
        for p in params.values():
            p.grad = None
        objective(ref.forward_from_cache(s.cached), s.y, cfg).backward()
        with torch.no_grad():
            for name in names:
                params[name] -= lr * params[name].grad
    noise_sd = ledger.noise_multiplier * clip / n
    assert ledger.noise_multiplier < 1e-4
    for name, p in model.named_parameters():
        assert float((p - params[name]).detach().abs().max()) <= epochs * lr * 6 * noise_sd + 1e-10, name


def test_full_batch_calibrates_for_the_steps_it_takes(s: Setup) -> None:
    """The noise is calibrated for q = 1 and ``epochs`` steps: the epsilon spent is the target's, and the same noise
    over more steps would overspend it."""
    n = s.cached.shape[0]
    model = build_regime_model(s.backbone, s.head, tangent=True)
    cfg = dp_train_config(n, epochs=4, lr=1e-2, seed=0, batch_size=None)
    _, ledger = train_dp(model, s.cached, s.y, cfg, names=["head.d_bias"], target_epsilon=2.0, clip_norm=1.0)
    assert ledger.steps == 4 and ledger.sample_rate == 1.0 and 1.98 <= ledger.epsilon <= 2.0
    more = compute_epsilon(noise_multiplier=ledger.noise_multiplier, delta=ledger.delta, sample_rate=1.0, steps=8)
    assert more > 2.0


def test_poisson_schedule_keeps_the_full_sets_rate_for_a_search_run() -> None:
    full = dp_train_config(1000, epochs=2, lr=1e-3, seed=0, batch_size=250)
    part = dp_train_config(800, epochs=2, lr=1e-3, seed=1, batch_size=250, n_full=1000)
    assert (full.batch_size, part.batch_size) == (250, 200)  # the same q = 0.25 and 4 steps an epoch
    assert math.ceil(1000 / full.batch_size) == math.ceil(800 / part.batch_size)
    with pytest.raises(ConfigError, match="batch_size=2000"):
        dp_train_config(1000, epochs=2, lr=1e-3, seed=0, batch_size=2000)


# ------------------------------------------------------------------------------ PT=F
def test_pt_false_resets_the_same_last_block_in_both_columns(s: Setup) -> None:
    """PT=F: "Ours" linearises around the reset block and "Reg" fine-tunes the same reset block: the tangent model's
    value path at zero delta is the uncentred regular suffix's output, and neither equals the pretrained one."""
    ours = TangentModel(s.backbone, 3, 1, head=s.head, reinit_last_block=True, seed=5)
    reg = NonlinearSuffix(s.backbone, s.head, 1, reinit_last_block=True, seed=5)
    pretrained = NonlinearSuffix(s.backbone, s.head, 1)
    with torch.no_grad():
        a, b = ours.forward_from_cache(s.cached), reg.forward_from_cache(s.cached)
        c = pretrained.forward_from_cache(s.cached)
    assert float((a - b).abs().max()) <= 1e-10
    assert float((b - c).abs().max()) > 1e-3
    for name, block in s.backbone.encoder.layer[-1].named_parameters():  # the backbone itself is untouched
        assert torch.equal(block, dict(pretrained.blocks[-1].named_parameters())[name]), name
    for tangent, ref in ((True, ours), (False, reg)):  # build_regime_model passes PT to both columns
        model = build_regime_model(s.backbone, s.head, tangent=tangent, pretrained=False, seed=5)
        built, expected = model.blocks.state_dict(), ref.blocks.state_dict()
        assert built.keys() == expected.keys()
        assert all(torch.equal(built[k], expected[k]) for k in built)


# ------------------------------------------------------------------------------ the search
def test_validation_split_is_seeded_disjoint_and_complete() -> None:
    fit, val = validation_split(100, 0.2, seed=3)
    assert val.numel() == 20 and fit.numel() == 80
    assert sorted(torch.cat([fit, val]).tolist()) == list(range(100))
    again, other = validation_split(100, 0.2, seed=3), validation_split(100, 0.2, seed=4)
    assert torch.equal(again[1], val) and not torch.equal(other[1], val)
    with pytest.raises(DataError, match="validation fraction of 0.01 of 10 DP training images"):
        validation_split(10, 0.01, seed=0)
    with pytest.raises(ConfigError, match="fraction=1.5"):
        validation_split(10, 1.5, seed=0)


def test_grid_order_and_choice() -> None:
    grid = search_grid([1e-3, 1e-4], [True, False])
    assert grid == (DPPoint(1e-3, True), DPPoint(1e-3, False), DPPoint(1e-4, True), DPPoint(1e-4, False))
    assert grid[1].label == "lr=0.001 PT=F"
    assert choose_point([0.2, 0.5, 0.5, 0.1]) == 1  # ties: the first in grid order
    assert choose_point([math.nan, 0.1, math.nan]) == 1  # a diverged point is never chosen
    with pytest.raises(DivergedError, match="every point of the search diverged"):
        choose_point([math.nan, math.nan])
    with pytest.raises(ConfigError, match=r"got \[-1\]"):
        search_grid([-1], [True])
    with pytest.raises(ConfigError, match="must not repeat"):
        search_grid([1e-3], [True, True])
    search = DPSearch(grid, (0.2, 0.5, 0.5, 0.1), 1, 80, 20, 1.0, epsilon=3.0)
    assert search.point == DPPoint(1e-3, False) and search.points == 4
    assert search.epsilon_with_tuning(1.0) == 4 * 3.0 + 1.0  # basic composition of the search and the final run


def _predictions(
    s: Setup, point: DPPoint, fit: torch.Tensor, val: torch.Tensor, cfg: TangentTrainConfig
) -> torch.Tensor:
    """What the search's run at ``point`` predicts on ``val`` (the same training as :func:`dp_regime_cell`'s)."""
    model = build_regime_model(s.backbone, s.head, tangent=True, pretrained=point.pretrained, seed=0)
    names = regime_parameter_names(model, "fc")
    train_dp(model, s.cached[fit], s.y[fit], replace(cfg, lr=point.lr), names=names, target_epsilon=50.0, clip_norm=1.0)
    with torch.no_grad():
        return model.forward_from_cache(s.cached[val]).argmax(dim=1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_search_chooses_by_validation_where_test_disagrees(s: Setup) -> None:
    """A case where validation and test disagree by construction: the validation labels are what the PT=F point
    predicts and the test labels what the PT=T point predicts, so each set has its own perfect point. The search,
    given the validation set (it never receives a test set), picks the validation winner; given the test labels in
    its place it would have picked the other point, so the choice follows the set it scores on."""
    fit, val = validation_split(s.cached.shape[0], 0.3, seed=0)
    grid = search_grid([5e-2], [True, False])
    cfg = dp_train_config(fit.numel(), epochs=3, lr=1.0, seed=1, batch_size=None)
    test_labels, val_labels = (_predictions(s, p, fit, val, cfg) for p in grid)
    assert not torch.equal(test_labels, val_labels)  # the two points disagree somewhere
    kw = {"regime": "fc", "tangent": True, "cfg": cfg, "target_epsilon": 50.0, "clip_norm": 1.0, "init_seed": 0}
    fitting = (s.cached[fit], s.y[fit])
    search = search_dp(s.backbone, s.head, fitting, (s.cached[val], val_labels), grid, **kw)
    assert search.valid_accuracy[1] == 1.0 > search.valid_accuracy[0]
    assert search.chosen == 1 and search.point == DPPoint(5e-2, False)
    assert (search.n_fit, search.n_val, search.epsilon) == (fit.numel(), val.numel(), 50.0)
    on_test = search_dp(s.backbone, s.head, fitting, (s.cached[val], test_labels), grid, **kw)
    assert on_test.chosen == 0 and on_test.valid_accuracy[0] == 1.0  # choosing on test would pick the other


# ------------------------------------------------------------------------------ the fc control
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("pretrained", [True, False])
def test_fc_columns_tie_at_the_papers_schedule_and_through_the_search(s: Setup, pretrained: bool) -> None:
    """The control of Table 3 at App. A's schedule: in the ``fc`` regime "Ours" (head deltas, JVP only) and "Reg"
    (the centred head) from the same head, with the same noise seed, lr and full-batch steps, end with the same
    parameters (the tangent delta is the regular head's change), the same logits and the same test accuracy; the
    search sees the same validation accuracies in both columns, so it makes the same choice."""
    n = s.cached.shape[0]
    cfg = dp_train_config(n, epochs=4, lr=5e-2, seed=2, batch_size=None)
    models = {}
    for tangent in (True, False):
        model = build_regime_model(s.backbone, s.head, tangent=tangent, pretrained=pretrained, seed=7)
        names = regime_parameter_names(model, "fc")
        _, ledger = train_dp(model, s.cached, s.y, cfg, names=names, target_epsilon=2.0, clip_norm=1.0)
        models[tangent] = (model, ledger)
    (ours, led_ours), (reg, led_reg) = models[True], models[False]
    assert led_ours == led_reg and led_ours.sample_rate == 1.0 and led_ours.steps == 4
    assert torch.allclose(ours.head.d_weight, reg.head.weight - s.head.weight, atol=1e-10)
    assert torch.allclose(ours.head.d_bias, reg.head.bias - s.head.bias, atol=1e-10)
    with torch.no_grad():
        lo, lg = ours.forward_from_cache(s.cached), reg.forward_from_cache(s.cached)
    assert float(lo.abs().max()) > 0.1  # trained away from the zero start: the tie is not two untrained models
    assert float((lo - lg).abs().max()) <= 1e-9
    grid = search_grid([5e-2, 5e-3], [True, False])
    fit, val = validation_split(n, 0.3, seed=0)
    fit_cfg = dp_train_config(fit.numel(), epochs=4, lr=5e-2, seed=2, batch_size=None)
    searches = [
        search_dp(
            s.backbone,
            s.head,
            (s.cached[fit], s.y[fit]),
            (s.cached[val], s.y[val]),
            grid,
            regime="fc",
            tangent=t,
            cfg=fit_cfg,
            target_epsilon=2.0,
            clip_norm=1.0,
            init_seed=7,
        )
        for t in (True, False)
    ]
    assert searches[0].valid_accuracy == searches[1].valid_accuracy and searches[0].chosen == searches[1].chosen
    cells = [
        dp_regime_cell(
            s.backbone,
            s.head,
            s.cached,
            s.y,
            s.cached,
            s.y,
            regime="fc",
            tangent=t,
            cfg=cfg,
            target_epsilon=2.0,
            clip_norm=1.0,
            pretrained=pretrained,
            init_seed=7,
        )
        for t in (True, False)
    ]
    assert cells[0].test_accuracy == cells[1].test_accuracy and cells[0].ledger == cells[1].ledger


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fc_control_fails_when_the_columns_start_apart(s: Setup) -> None:
    """The tie above can fail: "Reg" from the random head's output (``reg_start="head"``) ends at other logits."""
    n = s.cached.shape[0]
    cfg = dp_train_config(n, epochs=4, lr=5e-2, seed=2, batch_size=None)
    out = []
    for tangent in (True, False):
        model = build_regime_model(s.backbone, s.head, tangent=tangent, reg_start="head")
        train_dp(
            model, s.cached, s.y, cfg, names=regime_parameter_names(model, "fc"), target_epsilon=2.0, clip_norm=1.0
        )
        with torch.no_grad():
            out.append(model.forward_from_cache(s.cached))
    assert float((out[0] - out[1]).abs().max()) > 0.1
