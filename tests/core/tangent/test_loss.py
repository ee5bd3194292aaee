"""Rescaled Square Loss (eq. 2), ridge penalty, and App. B ball projection: hand-worked values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from core.errors import ConfigError, DataError
from core.tangent.loss import (
    RSL_ALPHA,
    RSL_KAPPA,
    RSL_KAPPA_PGD,
    RescaledSquareLoss,
    global_norm,
    l2_penalty,
    project_to_ball_,
    rescaled_square_loss,
)


def test_paper_defaults() -> None:
    assert RSL_KAPPA == 15.0  # App. A
    assert RSL_KAPPA_PGD == 5.0  # App. B
    assert RSL_ALPHA == 1.0  # not reported by the paper: neutral choice


def test_hand_worked_values_alpha2_kappa5() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]], dtype=torch.float64)
    labels = torch.tensor([2, 0])
    # K = 3. Sample 0, y=2: (2*(3-5)^2 + 1^2 + 2^2) / 3 = (8 + 1 + 4) / 3 = 13/3
    # Sample 1, y=0: (2*(0-5)^2 + (-1)^2 + 4^2) / 3 = (50 + 1 + 16) / 3 = 67/3
    per = rescaled_square_loss(logits, labels, alpha=2.0, kappa=5.0, reduction="none")
    assert per.shape == (2,)
    assert per.dtype == torch.float64
    torch.testing.assert_close(per, torch.tensor([13 / 3, 67 / 3], dtype=torch.float64))
    mean = rescaled_square_loss(logits, labels, alpha=2.0, kappa=5.0)
    assert mean.shape == ()
    assert mean.item() == pytest.approx((13 / 3 + 67 / 3) / 2)


def test_defaults_kappa15() -> None:
    # perfect prediction kappa*e_y gives 0; all-zero scores give alpha*kappa^2/K = 225/2
    logits = torch.tensor([[15.0, 0.0], [0.0, 0.0]])
    per = rescaled_square_loss(logits, torch.tensor([0, 1]), reduction="none")
    torch.testing.assert_close(per, torch.tensor([0.0, 112.5]))


def test_alpha1_is_mse_to_scaled_onehot() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    target = 7.0 * torch.nn.functional.one_hot(labels, 4).double()
    expected = ((logits - target) ** 2).mean(dim=1)
    got = rescaled_square_loss(logits, labels, alpha=1.0, kappa=7.0, reduction="none")
    torch.testing.assert_close(got, expected)


def test_gradient_hand_worked() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    rescaled_square_loss(logits, torch.tensor([2]), alpha=2.0, kappa=5.0).backward()
    # dL/df_i = 2 f_i / K (i != y); dL/df_y = 2 alpha (f_y - kappa) / K
    torch.testing.assert_close(logits.grad, torch.tensor([[2 / 3, 4 / 3, 2 * 2 * (3 - 5) / 3]]))


def test_dataclass_wrapper_and_validation() -> None:
    loss = RescaledSquareLoss(alpha=2.0, kappa=5.0, reduction="none")
    out = loss(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([2]))
    torch.testing.assert_close(out, torch.tensor([13 / 3]))
    with pytest.raises(ConfigError, match="alpha=0"):
        RescaledSquareLoss(alpha=0)
    with pytest.raises(ConfigError, match="kappa=nan"):
        RescaledSquareLoss(kappa=math.nan)
    with pytest.raises(ConfigError, match="reduction='sum'"):
        RescaledSquareLoss(reduction="sum")  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.alpha = 3.0  # type: ignore[misc]


def test_input_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(DataError, match=r"\[0, 3\)"):
        rescaled_square_loss(x, torch.tensor([0, 3]))
    with pytest.raises(DataError, match="integer class indices"):
        rescaled_square_loss(x, torch.tensor([0.0, 1.0]))
    with pytest.raises(DataError, match="B=2"):
        rescaled_square_loss(x, torch.tensor([0]))
    with pytest.raises(DataError, match=r"\(B, K\)"):
        rescaled_square_loss(torch.zeros(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ConfigError, match="reduction"):
        rescaled_square_loss(x, torch.tensor([0, 1]), reduction="sum")  # type: ignore[arg-type]


def test_l2_penalty_hand_worked() -> None:
    a = torch.tensor([3.0, 4.0], requires_grad=True)  # 9 + 16 = 25
    b = torch.tensor([[1.0, -2.0]])  # 1 + 4 = 5
    pen = l2_penalty([a, b])
    assert pen.item() == pytest.approx(30.0)
    pen.backward()
    torch.testing.assert_close(a.grad, torch.tensor([6.0, 8.0]))
    assert l2_penalty({"a": a, "b": b}).item() == pytest.approx(30.0)
    assert l2_penalty(b).item() == pytest.approx(5.0)
    assert l2_penalty([]).item() == 0.0
    assert global_norm([a, b]).item() == pytest.approx(math.sqrt(30.0))
    with pytest.raises(DataError, match="item 0"):
        l2_penalty([torch.tensor([1, 2])])


def test_project_outside_ball_scales_to_radius() -> None:
    a = torch.tensor([3.0, 4.0])  # joint norm sqrt(9 + 16 + 144) = 13
    b = torch.tensor([12.0])
    before = project_to_ball_([a, b], radius=1.0)
    assert before == pytest.approx(13.0)
    torch.testing.assert_close(a, torch.tensor([3 / 13, 4 / 13]))
    torch.testing.assert_close(b, torch.tensor([12 / 13]))
    assert global_norm([a, b]).item() <= 1.0 + 1e-6


def test_project_random_params_norm_at_most_r() -> None:
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(10, 7, generator=g) * 5, "b": torch.randn(7, generator=g)}
    project_to_ball_(params, radius=10.0)
    assert global_norm(params).item() <= 10.0 * (1 + 1e-6)
    assert global_norm(params).item() == pytest.approx(10.0, rel=1e-5)


def test_project_inside_ball_unchanged() -> None:
    p = torch.nn.Parameter(torch.tensor([0.3, -0.4]))  # norm 0.5
    before = p.detach().clone()
    assert project_to_ball_([p], radius=1.0) == pytest.approx(0.5)
    assert torch.equal(p.detach(), before)
    assert p.requires_grad  # in-place under no_grad keeps it a leaf parameter


def test_project_bad_radius() -> None:
    for r in (0.0, -1.0, math.inf):
        with pytest.raises(ConfigError, match="radius"):
            project_to_ball_([torch.ones(2)], radius=r)
