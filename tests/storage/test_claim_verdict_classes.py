"""Every verdict class of the claims report, reached on a hand-made store (runs recorded by hand, source
``metrics``); every recorded run counts for an every-run rule (runs of one seed at one commit all judged, a newer
commit supersedes an older one's); ``measure.power`` sets aside the runs that could not have failed; a projected
value is never reproduced; ``applies_at`` judges only the runs at the scale the bound is for; an exploratory claim
(registered after a result it bears on) is never reproduced or not reproduced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from storage import claims as sc
from storage.recording import record_run
from tests.hand_made import at_commit, claim_of, record_metric_run

SCORE = {"source": "metrics", "stage": "tangent", "techniques": ["gen"], "value": "score"}
ABOVE_0 = {"kind": "above", "bound": 0.0, "min_n": 3}
EXACT = {"source": "metrics", "stage": "tangent", "techniques": ["gen"], "value": "err", "reduce": "max"}
AT_MOST = {"kind": "all_at_most", "bound": 1e-4}
GPT2 = {"where": {"config.n_layer": 12}, "scale": "GPT-2 124M shape (12 layers)"}


def _run(metrics: dict[str, float], config: dict[str, Any] | None = None, technique: str = "gen", **kw: Any) -> str:
    """One finished ``tangent`` run of technique ``gen`` with ``metrics``; returns its id."""
    return record_metric_run(technique, metrics, config, **kw)


def _seeds(values: list[float], name: str = "score", **config: Any) -> None:
    for seed, value in enumerate(values):
        _run({name: value}, {"seed": seed, **config})


def _score(**extra: Any) -> Any:
    return claim_of(SCORE, ABOVE_0, stage="tangent", **extra)


# --- one test per verdict class ---


def test_reproduced(home: Path) -> None:
    _seeds([1.0, 1.1, 1.2])
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.REPRODUCED and result.reason == "" and result.n == 3


def test_not_reproduced(home: Path) -> None:
    _seeds([-1.0, -1.1, -1.2])
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.NOT_REPRODUCED
    assert result.reason.startswith("-1.1 [") and result.reason.endswith("n=3 lies entirely at or below 0")


def test_below_the_registered_n_no_verdict_on_either_side(home: Path) -> None:
    _seeds([-1.0, -1.1])  # two seeds, the rule wants 3: neither verdict, whichever side the interval lies on
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.UNDERPOWERED
    assert "lies on the wrong side of 0, but the rule needs n >= 3: run 1 more seed" in result.reason
    _run({"score": -1.05}, {"seed": 2})
    assert sc.evaluate_claim(None, _score()).verdict == sc.NOT_REPRODUCED


def test_inconclusive(home: Path) -> None:
    _seeds([-1.0, 0.5, 2.0])
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.INCONCLUSIVE and result.reason.endswith("n=3 straddles 0")


def test_underpowered(home: Path) -> None:
    _seeds([1.0])
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.UNDERPOWERED
    assert result.reason == "1 from 1 seed: no interval (needs >= 2); the rule needs n >= 3: run 2 more seeds"
    _run({"score": 1.01}, {"seed": 1})  # two seeds clear the bound, the rule wants three
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.UNDERPOWERED
    assert result.reason.endswith("n=2 clears 0, but the rule needs n >= 3: run 1 more seed")


def test_projected(home: Path) -> None:
    measure = {**EXACT, "value": "speedup", "reduce": "min", "projected": True, "validation": "fit.rel_err"}
    claim = claim_of(measure, {"kind": "all_at_least", "bound": 5.0}, stage="tangent")
    _run({"speedup": 6.5, "fit.rel_err": -0.034})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.PROJECTED
    assert result.reason == (
        "read from a fit, not measured: the projection meets the bound 5; its prediction error on a held-out "
        "measured run: 3.4% (worst of 1)"
    )


@pytest.mark.parametrize("values", [[1.0, 1.1, 1.2], [-1.0, -1.1, -1.2]])
def test_exploratory_whatever_its_rule_reads(home: Path, values: list[float]) -> None:
    """A claim registered after a result it bears on is shown with what its rule reads, never as reproduced or not
    reproduced; with nothing measured it is simply not run."""
    claim = _score(exploratory="registered after the sibling claim's report")
    assert sc.evaluate_claim(None, claim).verdict == sc.NOT_RUN
    _seeds(values)
    result = sc.evaluate_claim(None, claim)
    reads = sc.REPRODUCED if values[0] > 0 else sc.NOT_REPRODUCED
    assert result.verdict == sc.EXPLORATORY
    assert result.reason.startswith(f"its rule reads {reads}")
    assert result.reason.endswith("exploratory: registered after the sibling claim's report")
    assert sc.evaluate_claim(None, _score()).verdict == reads  # the same rule, registered before: judged


def test_not_applicable_at_this_scale(home: Path) -> None:
    _seeds([1.0, 1.1, 1.2], n_layer=2)
    result = sc.evaluate_claim(None, _score(applies_at=GPT2))
    assert result.verdict == sc.NOT_APPLICABLE
    assert result.reason == (
        "ran at n_layer=2; the rule's bound applies at GPT-2 124M shape (12 layers); at the scale that ran the rule "
        "would read reproduced (not counted)"
    )
    # what ran is shown (its estimate and interval), every context marked not applicable, none judged
    assert [(c.verdict, c.n_a, round(c.estimate, 6)) for c in result.contexts] == [(sc.NOT_APPLICABLE, 3, 1.1)]
    assert len(result.run_ids) == 3  # the runs are named, though not judged


def test_not_applicable_says_what_its_rule_would_read_where_it_ran(home: Path) -> None:
    """The reading at the scale that ran can be the other verdict: it is reported, and still not counted."""
    _seeds([-1.0, -1.1, -1.2], n_layer=2)
    result = sc.evaluate_claim(None, _score(applies_at=GPT2))
    assert result.verdict == sc.NOT_APPLICABLE
    assert result.reason.endswith("at the scale that ran the rule would read not reproduced (not counted)")


def test_not_run(home: Path) -> None:
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.NOT_RUN and result.contexts == ()
    assert result.reason == "nothing measured: run `privbench run tangent`"
    _run({"other": 1.0})  # a run of the stage without the claim's metric: counted, not hidden
    result = sc.evaluate_claim(None, _score())
    assert result.verdict == sc.NOT_RUN and result.contexts == ()
    assert result.reason == ("1 recorded run lacks the rule's measure (score): run `privbench run tangent`")


# --- every-run rules: every recorded run counts ---


def test_every_run_of_one_seed_at_one_commit_is_judged(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three runs of seed 0 at one commit: the oldest fails the bound, the newer two pass. A repeat is not a
    replacement: the oldest run still counts, and fails the claim."""
    at_commit(monkeypatch, "1111111")
    for err in (1e-2, 1e-7, 2e-7):
        _run({"err": err}, {"seed": 0})
    result = sc.evaluate_claim(None, claim_of(EXACT, AT_MOST, stage="tangent"))
    assert result.verdict == sc.NOT_REPRODUCED and result.superseded == 0
    (ctx,) = result.contexts
    assert sorted(ctx.values) == [1e-7, 2e-7, 1e-2] and ctx.n_a == 1  # three runs, one seed
    assert result.reason == "worst run 0.01 against the bound 0.0001"


def test_a_newer_commit_supersedes_the_failing_run(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same three runs, the failing one at an older commit: the code changed since, the newer commit's runs
    replace it; the reason says how many runs were superseded."""
    at_commit(monkeypatch, "1111111")
    _run({"err": 1e-2}, {"seed": 0})
    at_commit(monkeypatch, "2222222")
    for err in (1e-7, 2e-7):
        _run({"err": err}, {"seed": 0})
    result = sc.evaluate_claim(None, claim_of(EXACT, AT_MOST, stage="tangent"))
    assert result.verdict == sc.REPRODUCED and result.superseded == 1
    assert sorted(result.contexts[0].values) == [1e-7, 2e-7]
    assert result.reason == "1 run of an older commit superseded by the newest commit's"


def test_only_the_same_seed_is_superseded(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at_commit(monkeypatch, "1111111")
    _run({"err": 1e-2}, {"seed": 1})  # another seed: not measured again, it still counts
    at_commit(monkeypatch, "2222222")
    _run({"err": 1e-7}, {"seed": 0})
    result = sc.evaluate_claim(None, claim_of(EXACT, AT_MOST, stage="tangent"))
    assert result.verdict == sc.NOT_REPRODUCED and result.superseded == 0


# --- power: a run that could not have failed ---


def test_a_run_without_a_seed_mate_meets_every_run_of_the_other_side(home: Path) -> None:
    """Two sides of an every-run rule pair runs by seed; a run whose seed the other side lacks is not dropped: it is
    judged against every run of the other side."""
    ratio = {**EXACT, "value": "t", "reduce": "mean", "a": {"method": "a"}, "b": {"method": "b"}, "stat": "ratio"}
    claim = claim_of({**ratio, "techniques": ["a", "b"]}, {"kind": "all_at_most", "bound": 1.0}, stage="tangent")
    _run({"t": 1.0}, {"seed": 0}, technique="a")
    _run({"t": 2.0}, {"seed": 0}, technique="b")
    assert sc.evaluate_claim(None, claim).verdict == sc.REPRODUCED
    _run({"t": 4.2}, {"seed": 1}, technique="a")  # seed 1 has no b run: judged against b's seed 0
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.NOT_REPRODUCED and result.reason.startswith("worst run 2.1")


POWERED = {**EXACT, "value": "gap", "power": "gap_max"}  # gap_max: the gap of a perfect attack at the run's size
GAP = {"kind": "all_at_most", "bound": 0.0}


def test_no_run_could_have_failed_is_underpowered(home: Path) -> None:
    _run({"gap": -0.5, "gap_max": 0.0}, {"seed": 0})  # a perfect attack would reach the bound, not pass it
    _run({"gap": -0.9, "gap_max": -0.2}, {"seed": 1})
    result = sc.evaluate_claim(None, claim_of(POWERED, GAP, stage="tangent"))
    assert result.verdict == sc.UNDERPOWERED
    assert result.reason.startswith(
        "no run could have failed: the most a run could have shown (gap_max) is 0, not past the bound 0 (2 runs)"
    )


def test_a_run_with_power_past_the_bound_decides(home: Path) -> None:
    _run({"gap": -0.5, "gap_max": -0.1}, {"seed": 0})  # could not have failed: set aside
    _run({"gap": -0.3, "gap_max": 2.0}, {"seed": 1})
    result = sc.evaluate_claim(None, claim_of(POWERED, GAP, stage="tangent"))
    assert result.verdict == sc.REPRODUCED
    assert result.contexts[0].reason == (
        "judged: 1 run, each could have reached 2 against the bound 0; 1 that could not have failed set aside"
    )
    _run({"gap": 0.5, "gap_max": 2.0}, {"seed": 2})  # past the bound, and it could have been
    result = sc.evaluate_claim(None, claim_of(POWERED, GAP, stage="tangent"))
    assert result.verdict == sc.NOT_REPRODUCED
    assert result.reason == (
        "worst run 0.5 against the bound 0 (judged: 2 runs, each could have reached 2 against the bound 0; "
        "1 that could not have failed set aside)"
    )


# --- family: the strongest of many bounds is a 95% statement only for the family they were computed for ---

FAMILY = {**POWERED, "family": "share"}  # share: the alpha each run's bound was computed at (alpha / family)


@pytest.mark.parametrize("verdict_gap", [-0.3, 0.5], ids=["would-reproduce", "would-fail"])
def test_bounds_of_a_larger_family_than_computed_for_are_inconclusive(home: Path, verdict_gap: float) -> None:
    """Two bounds each at alpha / 2 hold together at 95%; a third run of the same family (a seed audited after the
    family was fixed) spends 0.075 > 0.05, and neither verdict stands, whichever way the rule reads."""
    for seed in (0, 1):
        _run({"gap": verdict_gap, "gap_max": 2.0, "share": 0.025}, {"seed": seed})
    claim = claim_of(FAMILY, GAP, stage="tangent")
    first = sc.evaluate_claim(None, claim)
    assert first.verdict == (sc.REPRODUCED if verdict_gap < 0 else sc.NOT_REPRODUCED)
    _run({"gap": -0.3, "gap_max": 2.0, "share": 0.025}, {"seed": 2})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.INCONCLUSIVE
    assert f"its rule reads {first.verdict}" in result.reason
    assert (
        "its 3 bounds were computed for a smaller family (their alpha shares add up to 0.075 > 0.05)" in result.reason
    )


def test_a_bound_without_a_family_share_is_inconclusive(home: Path) -> None:
    _run({"gap": -0.3, "gap_max": 2.0, "share": 0.025}, {"seed": 0})
    _run({"gap": -0.3, "gap_max": 2.0}, {"seed": 1})  # recorded at the full alpha, outside any family
    assert sc.evaluate_claim(None, claim_of(FAMILY, GAP, stage="tangent")).verdict == sc.INCONCLUSIVE


# --- projected: read from a fit, never reproduced ---


@pytest.mark.parametrize(
    ("speedup", "says"), [(6.5, "meets"), (4.0, "misses")], ids=["clears the bound", "misses the bound"]
)
def test_a_projection_is_never_reproduced(home: Path, speedup: float, says: str) -> None:
    measure = {**EXACT, "value": "speedup", "reduce": "min", "projected": True, "validation": "fit.rel_err"}
    claim = claim_of(measure, {"kind": "all_at_least", "bound": 5.0}, stage="tangent")
    _run({"speedup": speedup, "fit.rel_err": 0.021}, {"seed": 0})
    _run({"speedup": speedup + 1, "fit.rel_err": -0.05}, {"seed": 1})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.PROJECTED
    assert f"the projection {says} the bound 5;" in result.reason
    assert result.reason.endswith("its prediction error on a held-out measured run: 5.0% (worst of 2)")


def test_an_unvalidated_projection_says_so(home: Path) -> None:
    measure = {**EXACT, "value": "speedup", "reduce": "min", "projected": True}
    claim = claim_of(measure, {"kind": "all_at_least", "bound": 5.0}, stage="tangent")
    _run({"speedup": 6.5})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.PROJECTED
    assert result.reason.endswith("; the fit was not validated on a held-out measured run")
    with pytest.raises(ValueError, match="needs projected: true"):
        claim_of({**measure, "projected": False, "validation": "fit.rel_err"}, AT_MOST)


# --- applies_at: only the runs at the bound's scale are judged ---


def test_only_the_runs_at_the_scale_are_judged(home: Path) -> None:
    _seeds([-1.0, -1.1, -1.2], n_layer=2)  # another shape: would fail the bound, but it is not for them
    _seeds([1.0, 1.1, 1.2], n_layer=12)
    result = sc.evaluate_claim(None, _score(applies_at=GPT2))
    assert result.verdict == sc.REPRODUCED and result.rows == 3
    (ctx,) = result.contexts
    assert sorted(ctx.values) == [1.0, 1.1, 1.2]
    assert sc.evaluate_claim(None, _score()).verdict == sc.NOT_REPRODUCED  # without applies_at: seeds' means fail


def test_a_run_takes_its_scale_from_its_nearest_ancestor(home: Path) -> None:
    with record_run(
        flow="tangent", stage="tangent", technique="flow", dataset=None, profile="tiny", config={"n_layer": 12},
        track=False,
    ) as parent:  # fmt: skip
        for seed, score in enumerate((1.0, 1.1, 1.2)):
            _run({"score": score}, {"seed": seed}, parent=parent.ref)  # the child's config has no n_layer
    _run({"score": -5.0}, {"seed": 0, "n_layer": 2})
    result = sc.evaluate_claim(None, _score(applies_at=GPT2))
    assert result.verdict == sc.REPRODUCED and result.rows == 3
