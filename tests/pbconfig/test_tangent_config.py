"""The tangent stage's DP section (``tangent.dp``, Table 3): the schedule, the (lr, PT) search and its validation
part, each bad value refused with a message that names it and the fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import ConfigError
from pbconfig.benchmark import load_config
from pbconfig.tangent import TangentDPConfig


def test_defaults_are_one_point_and_poisson_batches() -> None:
    dp = TangentDPConfig()
    assert dp.lrs == (1e-3,) and dp.pts == (True,) and dp.search_points == 1
    assert not dp.full_batch and dp.batch_size == 256 and dp.search_epsilon is None


def test_the_papers_recipe_validates() -> None:
    dp = TangentDPConfig(
        full_batch=True, batch_size=None, epochs=50, lrs=(1e-3, 1e-4), pts=(True, False), val_fraction=0.1
    )
    assert dp.search_points == 4 and dp.full_batch and dp.batch_size is None


def test_a_single_lr_is_a_one_lr_grid() -> None:
    """``lr`` (the key profiles used before the search) is read as ``lrs: [lr]``; both at once are refused."""
    assert TangentDPConfig.model_validate({"lr": 0.01}).lrs == (0.01,)
    with pytest.raises(ValidationError, match=r"give lrs only, got both lr=0.01 and lrs=\[0.001\]"):
        TangentDPConfig.model_validate({"lr": 0.01, "lrs": [0.001]})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"full_batch": True}, "batch_size=256 with full_batch=true"),
        ({"batch_size": None}, "batch_size=None needs full_batch=true"),
        ({"lrs": [0.001, 0.001]}, "learning rates must be distinct, got [0.001, 0.001]"),
        ({"lrs": [0.0]}, "every learning rate must be a finite number > 0, got [0.0]"),
        ({"lrs": [float("inf")]}, "every learning rate must be a finite number > 0, got [inf]"),
        ({"lrs": []}, "lrs"),
        ({"pts": [True, True]}, "PT values must be distinct, got [True, True]"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"search_epsilon": 2.0}, "search_epsilon=2 is not one of epsilons [1.0, 3.0, 8.0]"),
        ({"search_epsilon": 0.0}, "search_epsilon"),
    ],
)
def test_bad_dp_values_name_the_value_and_the_fix(values: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        TangentDPConfig.model_validate(values)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("tangent.dp.full_batch=true", "with full_batch=true: a full-batch step takes every training image"),
        ("tangent.dp.lrs=[0.01, 0.01]", "learning rates must be distinct, got [0.01, 0.01]"),
        ("tangent.dp.val_fraction=0", "tangent.dp.val_fraction = 0: Input should be greater than 0"),
        ("tangent.dp.search_epsilon=3", "search_epsilon=3 is not one of epsilons [1.0, 8.0]"),
    ],
)
def test_bad_dp_values_in_a_profile_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("quick", overrides=(override,))
    assert message in str(err.value)


def test_profiles_run_the_search() -> None:
    """quick wires the search (PT searched once per column); paper runs App. A's recipe at every epsilon."""
    quick = load_config("quick").tangent
    assert quick is not None and quick.dp is not None
    assert quick.dp.search_points > 1 and quick.dp.search_epsilon in quick.dp.epsilons
    paper = load_config("paper").tangent
    assert paper is not None and paper.dp is not None
    dp = paper.dp
    assert dp.full_batch and dp.epochs == 50 and dp.search_epsilon is None and set(dp.pts) == {True, False}
