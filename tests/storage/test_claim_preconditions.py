"""Preconditions in the claims registry: a claim measured reproduced or not reproduced where its precondition is not
reproduced reads inconclusive either way, with both measurements in its reason; its other verdicts stand with the
precondition named; a precondition must name another claim of the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from pbconfig.claims import load_claims
from storage import claims as sc
from tests.hand_made import ABOVE, BEATS, claim_of, record_train_dp

FLOOR = {  # the precondition: the private Transformer above the popularity floor
    "source": "privacy_utility",
    "where": {"private": True},
    "value": "ndcg_at_10 / popularity_ndcg_at_10 - 1",
    "a": {"method": "transformer"},
    "per": ["epsilon"],
    "require": {"epsilon": [5, 8]},
    "unit": "%",
}


def _with_floor(dpformer: list[float], transformer: list[float], floor: float) -> list[sc.ClaimResult]:
    for eps in (5.0, 8.0):
        for seed, (a, b) in enumerate(zip(dpformer, transformer, strict=True)):
            record_train_dp("dpformer", seed, a, a, 1.0, epsilon=eps, popularity=floor)
            record_train_dp("transformer", seed, b, b, 1.0, epsilon=eps, popularity=floor)
    pre = claim_of(FLOOR, ABOVE).model_copy(update={"id": "floor"})
    main = claim_of(BEATS, ABOVE, precondition="floor")
    return sc.evaluate_claims(None, claims=[main, pre])  # the precondition may come after the claim


def test_a_failed_precondition_makes_not_reproduced_inconclusive(home: Path) -> None:
    # identical methods (not reproduced on their own), both below the popularity floor of 2 (-50%, -45%, -40%)
    main, pre = _with_floor([1.0, 1.1, 1.2], [1.0, 1.1, 1.2], floor=2.0)
    assert pre.verdict == sc.NOT_REPRODUCED and "at or below 0%" in pre.reason
    assert main.verdict == sc.INCONCLUSIVE
    assert main.reason.startswith("cannot show here: its precondition `floor` is not reproduced (ε=5: -45.0% [")
    assert "; measured not reproduced: ε=5: 0% [0%, 0%], n=3 lies entirely at or below 0%" in main.reason
    assert main.contexts == sc.evaluate_claim(None, claim_of(BEATS, ABOVE)).contexts  # the measurement is unchanged


def test_a_precondition_that_holds_leaves_the_verdict(home: Path) -> None:
    main, pre = _with_floor([1.0, 1.1, 1.2], [1.0, 1.1, 1.2], floor=0.5)
    assert pre.verdict == sc.REPRODUCED
    assert main.verdict == sc.NOT_REPRODUCED and "precondition" not in main.reason


def test_an_effect_seen_below_the_floor_is_inconclusive_too(home: Path) -> None:
    """Symmetric: a comparison that cannot show a difference cannot show one either way."""
    main, pre = _with_floor([1.2, 1.3, 1.45], [1.0, 1.1, 1.2], floor=9.0)
    assert pre.verdict == sc.NOT_REPRODUCED
    assert sc.evaluate_claim(None, claim_of(BEATS, ABOVE)).verdict == sc.REPRODUCED  # on its own
    assert main.verdict == sc.INCONCLUSIVE
    assert main.reason.startswith("cannot show here: its precondition `floor` is not reproduced (")
    assert main.reason.endswith("; measured reproduced")  # a reproduced claim has no reason of its own


def test_an_underpowered_precondition_is_named(home: Path) -> None:
    main, pre = _with_floor([1.0], [1.0], floor=0.5)  # one seed: the precondition has no interval
    assert pre.verdict == sc.UNDERPOWERED
    assert main.verdict == sc.UNDERPOWERED  # one seed: no interval either; the verdict stands
    own = sc.evaluate_claim(None, claim_of(BEATS, ABOVE)).reason
    assert main.reason == f"{own}; its precondition `floor` is underpowered ({pre.reason})"


def test_a_precondition_outside_the_list_comes_from_the_registry(home: Path) -> None:
    main = next(c for c in load_claims() if c.id == "dpformer-beats-transformer")
    main = main.model_copy(update={"precondition": "private-transformer-above-popularity"})
    (result,) = sc.evaluate_claims(None, claims=[main])
    assert result.verdict == sc.NOT_RUN


def test_a_precondition_must_name_another_claim(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "configs" / "claims" / "dpformer.yaml").read_text()
    (tmp_path / "dpformer.yaml").write_text(
        text.replace(
            "  - id: dpformer-beats-transformer\n",
            "  - id: dpformer-beats-transformer\n    precondition: no-such-claim\n",
            1,
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"dpformer.yaml: claim 'dpformer-beats-transformer' has precondition "
        r"'no-such-claim', which is no other claim of the registry",
    ):
        load_claims(tmp_path)
