"""One context of a claim (``storage.claim_context``), reached through ``evaluate_claim`` on hand-made stores with
known answers: the paired interval over seeds and Welch's when the seeds differ (hand-computed), each verdict with
its reason (not reproduced, inconclusive, underpowered), a seed run again at one commit counted with its mean and at
a newer commit replacing the older runs, every-run bounds, and one run judged on its own recorded interval."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from storage import claims as sc
from tests.hand_made import ABOVE, BEATS, T_975_2, at_commit, claim_of, record_dp, record_grid, record_metric_run


def test_reproduced_with_the_paired_interval(home: Path) -> None:
    # per seed, dpformer / transformer - 1 = 0.18, 0.2, 0.22 at both budgets: mean 0.2, std 0.02
    record_grid(
        {
            ("dpformer", 5.0): [1.18, 2.4, 3.66],
            ("transformer", 5.0): [1.0, 2.0, 3.0],
            ("dpformer", 8.0): [1.18, 2.4, 3.66],
            ("transformer", 8.0): [1.0, 2.0, 3.0],
        }
    )
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.REPRODUCED and result.reason == ""
    assert [c.context for c in result.contexts] == ["ε=5", "ε=8"]
    for context in result.contexts:
        assert context.interval == "paired t over seeds" and context.n_a == context.n_b == 3
        assert context.estimate == pytest.approx(0.2)
        half = T_975_2 * 0.02 / math.sqrt(3)
        assert (context.low, context.high) == pytest.approx((0.2 - half, 0.2 + half))
    assert result.n == 3
    assert "ε=5: +20.0% [" in result.ours()


def test_not_reproduced_when_one_context_fails_and_says_why(home: Path) -> None:
    record_grid(
        {
            ("dpformer", 5.0): [1.18, 2.4, 3.66],
            ("transformer", 5.0): [1.0, 2.0, 3.0],
            ("dpformer", 8.0): [0.82, 1.6, 2.34],  # -18%, -20%, -22%
            ("transformer", 8.0): [1.0, 2.0, 3.0],
        }
    )
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.NOT_REPRODUCED
    assert [c.verdict for c in result.contexts] == [sc.REPRODUCED, sc.NOT_REPRODUCED]
    assert result.reason.startswith("ε=8: -20.0% [") and "at or below 0%" in result.reason


def test_identical_methods_are_not_reproduced_not_inconclusive(home: Path) -> None:
    record_grid(
        {("dpformer", e): [1.0, 2.0, 3.0] for e in (5.0, 8.0)}
        | {("transformer", e): [1.0, 2.0, 3.0] for e in (5.0, 8.0)}
    )
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.NOT_REPRODUCED  # a zero-width interval at 0 is no gain


@pytest.mark.parametrize(
    ("grid", "why"),
    [
        (  # the interval straddles 0
            {("dpformer", 5.0): [1.3, 1.9, 3.2], ("transformer", 5.0): [1.0, 2.0, 3.0]}
            | {("dpformer", 8.0): [1.3, 1.9, 3.2], ("transformer", 8.0): [1.0, 2.0, 3.0]},
            "straddles",
        ),
        ({("dpformer", 5.0): [1.1, 2.4, 3.9], ("transformer", 5.0): [1.0, 2.0, 3.0]}, "ε=8: not run"),
    ],
)
def test_inconclusive_cases(home: Path, grid: dict[tuple[str, float], list[float]], why: str) -> None:
    record_grid(grid)
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.INCONCLUSIVE
    assert why in result.reason, result.reason


@pytest.mark.parametrize(
    ("grid", "why"),
    [
        (
            {
                ("dpformer", 5.0): [1.1],
                ("transformer", 5.0): [1.0],
                ("dpformer", 8.0): [1.1],
                ("transformer", 8.0): [1.0],
            },
            "one seed in each of the 2 contexts: no interval, so no verdict (the rule needs n >= 3); run more seeds",
        ),
        (  # clears the bound with 2 seeds, the rule wants 3
            {("dpformer", 5.0): [1.1, 2.22], ("transformer", 5.0): [1.0, 2.0]}
            | {("dpformer", 8.0): [1.1, 2.22], ("transformer", 8.0): [1.0, 2.0]},
            "clears 0%, but the rule needs n >= 3: run 1 more seed",
        ),
    ],
)
def test_underpowered_cases(home: Path, grid: dict[tuple[str, float], list[float]], why: str) -> None:
    """Too few seeds for "reproduced" (one seed: no interval; an interval that clears the bound below ``min_n``)
    is underpowered, and the reason says how many seeds the rule needs."""
    record_grid(grid)
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.UNDERPOWERED
    assert why in result.reason, result.reason


def test_a_seed_run_again_at_one_commit_counts_with_its_mean(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at_commit(monkeypatch, "1111111")
    record_grid({("dpformer", 5.0): [1.7], ("transformer", 5.0): [1.0]})  # seed 0 again below: both runs count
    record_grid({("dpformer", 5.0): [1.1, 2.4, 3.9], ("transformer", 5.0): [1.0, 2.0, 3.0]})
    result = sc.evaluate_claim(None, claim_of({**BEATS, "require": {}}, ABOVE))
    (context,) = result.contexts
    assert result.superseded == 0 and "superseded" not in result.reason
    assert context.n_a == context.n_b == 3 and context.interval == "paired t over seeds"
    assert sorted(context.values) == pytest.approx([0.2, 0.3, 0.4])  # seed 0: (1.7 + 1.1) / 2 / 1.0 - 1
    assert context.means == pytest.approx(((1.4 + 2.4 + 3.9) / 3, 2.0))


def test_a_seed_run_again_at_a_newer_commit_supersedes_the_older(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at_commit(monkeypatch, "1111111")
    record_grid({("dpformer", 5.0): [9.0], ("transformer", 5.0): [1.0]})  # superseded below
    at_commit(monkeypatch, "2222222")
    record_grid({("dpformer", 5.0): [1.1, 2.4, 3.9], ("transformer", 5.0): [1.0, 2.0, 3.0]})
    result = sc.evaluate_claim(None, claim_of({**BEATS, "require": {}}, ABOVE))
    (context,) = result.contexts
    assert context.n_a == 3 and context.estimate == pytest.approx(0.2)
    assert result.superseded == 2  # seed 0 of both sides
    assert "2 runs of an older commit superseded by the newest commit's" in result.reason


def test_unpaired_sides_use_welch(home: Path) -> None:
    for seed, v in zip((0, 1, 2), (2.0, 3.0, 4.0), strict=True):
        record_dp("dpformer", seed, v, 5.0)
    for seed, v in zip((10, 11, 12), (1.0, 1.5, 2.0), strict=True):
        record_dp("transformer", seed, v, 5.0)
    measure = {**BEATS, "require": {}, "stat": "difference", "unit": ""}
    (context,) = sc.evaluate_claim(None, claim_of(measure, ABOVE)).contexts
    va, vb = 1.0 / 3, 0.25 / 3
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    from scipy import stats

    half = stats.t.ppf(0.975, df) * se
    assert context.interval == "Welch t"
    assert context.estimate == pytest.approx(1.5)
    assert (context.low, context.high) == pytest.approx((1.5 - half, 1.5 + half))


def test_bound_on_every_run_from_metrics(home: Path) -> None:
    claim = claim_of(
        {"source": "metrics", "stage": "tangent", "techniques": ["forget-subtraction"], "value": "err.max"},
        {"kind": "all_at_most", "bound": 1e-4},
        stage="tangent",
    )
    record_metric_run("forget-subtraction", {"err.max": 1e-7})
    record_metric_run("forget-retrain", {"err.max": 1.0})  # another technique: not measured
    assert sc.evaluate_claim(None, claim).verdict == sc.REPRODUCED
    record_metric_run("forget-subtraction", {"err.max": 1e-2})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.NOT_REPRODUCED and "worst run 0.01" in result.reason


def test_one_run_is_judged_on_its_own_recorded_interval(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure = {
        "source": "metrics",
        "stage": "tangent",
        "techniques": ["gen"],
        "value": "drop.r",
        "run_interval": ["drop.r_lo", "drop.r_hi"],
    }
    claim = claim_of(measure, {"kind": "below", "bound": 0.05, "min_n": 1}, stage="tangent")
    at_commit(monkeypatch, "1111111")
    record_metric_run("gen", {"drop.r": 0.01, "drop.r_lo": -0.02, "drop.r_hi": 0.04}, {"seed": 0})
    result = sc.evaluate_claim(None, claim)
    (ctx,) = result.contexts
    assert result.verdict == sc.REPRODUCED and (ctx.low, ctx.high) == (-0.02, 0.04)
    assert ctx.interval == "the run's own (recorded over its examples or rounds)"
    at_commit(monkeypatch, "2222222")  # seed 0 at a newer commit: supersedes the older run
    record_metric_run("gen", {"drop.r": 0.03, "drop.r_lo": 0.0, "drop.r_hi": 0.08}, {"seed": 0})
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.INCONCLUSIVE and result.superseded == 1
    at_commit(monkeypatch, "3333333")
    record_metric_run("gen", {"drop.r": 0.2, "drop.r_lo": 0.1, "drop.r_hi": 0.3}, {"seed": 0})
    assert sc.evaluate_claim(None, claim).verdict == sc.NOT_REPRODUCED
    record_metric_run(
        "gen", {"drop.r": 0.3, "drop.r_lo": 0.29, "drop.r_hi": 0.31}, {"seed": 1}
    )  # two seeds: t over seeds
    (ctx,) = sc.evaluate_claim(None, claim).contexts
    half = 12.706204736174698 * (0.1 / math.sqrt(2)) / math.sqrt(2)  # t(0.975, 1) s / sqrt(n), seeds 0.2 and 0.3
    assert ctx.interval == "t over seeds" and ctx.estimate == pytest.approx(0.25)
    assert ctx.high - ctx.estimate == pytest.approx(half)
    without = claim_of({**measure, "run_interval": None}, {"kind": "below", "bound": 0.05, "min_n": 1}, stage="tangent")
    with pytest.raises(ValueError, match="run_interval applies to stat 'value' or 'difference', got stat 'relative'"):
        claim_of({**BEATS, "run_interval": ["a", "b"]}, ABOVE)
    assert without.measure.run_interval is None


def test_one_run_a_side_is_judged_on_their_own_intervals(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the membership audit's shape: a run's rows are attacks, reduce max keeps the strongest attack and its interval
    measure = {
        "source": "metrics",
        "stage": "tangent",
        "techniques": ["nonprivate", "private"],
        "value": "auc",
        "reduce": "max",
        "a": {"method": "nonprivate"},
        "b": {"method": "private"},
        "stat": "difference",
        "run_interval": ["auc_lo", "auc_hi"],
    }
    claim = claim_of(measure, {"kind": "above", "bound": 0.0, "min_n": 1}, stage="tangent")
    at_commit(monkeypatch, "1111111")
    record_metric_run("nonprivate", {"auc": 0.9, "auc_lo": 0.86, "auc_hi": 0.95}, {"seed": 0})  # half-widths 0.04, 0.05
    record_metric_run("private", {"auc": 0.55, "auc_lo": 0.52, "auc_hi": 0.58}, {"seed": 0})
    (ctx,) = sc.evaluate_claim(None, claim).contexts
    z = 1.959963984540054
    assert ctx.interval == "the runs' own (normal, sides independent)"
    assert ctx.estimate == pytest.approx(0.35)
    half = z * math.sqrt((0.05 / z) ** 2 + (0.03 / z) ** 2)  # each side's larger half-width
    assert (ctx.low, ctx.high) == pytest.approx((0.35 - half, 0.35 + half))
    assert ctx.verdict == sc.REPRODUCED
    from tasks.report import _paper_section

    table = sc.claims_table([sc.evaluate_claim(None, claim)])  # the report names the interval whole
    assert "Intervals: the runs' own (normal, sides independent)." in _paper_section("p", "P", "f", table)
    at_commit(monkeypatch, "2222222")  # a newer commit's run supersedes the older one
    record_metric_run("private", {"auc": 0.87, "auc_lo": 0.84, "auc_hi": 0.9}, {"seed": 0})  # straddles 0
    assert sc.evaluate_claim(None, claim).verdict == sc.INCONCLUSIVE
    at_commit(monkeypatch, "3333333")
    record_metric_run("private", {"auc": 0.2}, {"seed": 0})  # the newest records no interval
    result = sc.evaluate_claim(None, claim)
    assert result.verdict == sc.INCONCLUSIVE  # n = min_n = 1: the run, not the seed count, is short of an interval
    assert result.reason.startswith("0.7 from 1 run: it recorded no interval of its own (auc_lo, auc_hi); 2 runs")
    assert result.superseded == 2
    with pytest.raises(ValueError, match="run_interval does not apply to a b_source"):
        claim_of(
            {**measure, "b": None, "b_source": {"source": "metrics", "stage": "bench", "value": "x"}},
            {"kind": "above", "bound": 0.0},
        )
