"""``claim.shows``: the scale column names each side's recipe per technique (one value, a range of numbers, or the
values seen), so a reader sees the point a search chose and the schedule behind a verdict."""

from __future__ import annotations

import math

import pandas as pd

from pbconfig.claims import Claim, load_claims
from storage.claims import shown_per_side


def _claim(claim_id: str) -> Claim:
    return next(c for c in load_claims() if c.id == claim_id)


def test_each_technique_and_side_names_its_chosen_point() -> None:
    claim = _claim("tangent-dp-beats-regular-dp")
    rows = pd.DataFrame(
        {
            "method": ["dp-full"] * 4,
            "config.parameters": ["ours", "ours", "reg", "reg"],
            "config.lr": [0.01, 0.01, 0.001, 0.01],
            "config.pretrained": [True, True, False, True],
            "config.epochs": [2, 2, 2, 2],
            "config.batch_size": [250, 250, 250, 250],
        }
    )
    assert shown_per_side(rows, claim) == (
        "dp-full ours: lr 0.01, pretrained True, epochs 2, batch_size 250",
        "dp-full reg: lr 0.001-0.01, pretrained False/True, epochs 2, batch_size 250",
    )


def test_a_column_no_run_recorded_is_left_out_and_a_side_named_by_its_technique_once() -> None:
    claim = _claim("seb-utility-close-to-subword")
    rows = pd.DataFrame(
        {
            "method": ["seb-lm-seb_co", "seb-lm-subword"],
            "steps": [1000.0, 800.0],
            "best_step": [math.nan, math.nan],
        }
    )
    assert shown_per_side(rows, claim) == ("seb-lm-seb_co: steps 1000", "seb-lm-subword: steps 800")


def test_a_claim_that_shows_nothing_adds_nothing() -> None:
    claim = _claim("composition-equals-ensemble")
    assert claim.shows == ()
    assert shown_per_side(pd.DataFrame({"method": ["x"], "lr": [1.0]}), claim) == ()


def test_a_list_in_a_runs_config_is_shown_as_one_value() -> None:
    """A schedule's milestones and a search's grid are lists in a run's config: the scale column shows them (slow
    reference: the list written out by hand), where before they were dropped; a list of anything else stays out."""
    from storage.claim_rows import flat_config

    config = {
        "lr": 0.01,
        "lr_milestones": [5, 8],
        "constant": [],
        "search_grid": [[0.03, True], [0.01, False]],
        "models": [{"name": "a"}],
        "search": {"lrs": {"taft": [0.001, 0.0001]}},
        "none": None,
    }
    assert flat_config(config) == {
        "config.lr": 0.01,
        "config.lr_milestones": "[5, 8]",
        "config.constant": "[]",
        "config.search_grid": "[[0.03, True], [0.01, False]]",
        "config.search.lrs.taft": "[0.001, 0.0001]",
    }
    claim = _claim("taft-forgetting-more-accurate-than-sisa")
    flat = flat_config({"lr": 0.001, "epochs": 10, "lr_milestones": [5, 8]})
    rows = pd.DataFrame([{"method": "forget-taft-subtract", **flat}, {"method": "forget-sisa-drop", **flat}])
    assert shown_per_side(rows, claim) == (
        "forget-taft-subtract: lr 0.001, epochs 10, lr_milestones [5, 8]",
        "forget-sisa-drop: lr 0.001, epochs 10, lr_milestones [5, 8]",
    )
