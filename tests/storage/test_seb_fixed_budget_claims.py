"""The fixed-budget SEB utility claims read only language models trained with no early stopping and no time cap
(``utility.lm_patience`` and ``utility.max_seconds`` null) at seeds 3-5: runs stopped by a patience (the rule set
after a result) and seeds 0-2 (reported before the claims were written) never enter them, whatever they measured;
the earlier claims read only their patience-1 runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pbconfig.claims import load_claims
from storage import claims as sc
from storage.recording import record_run

CLAIMS = {c.id: c for c in load_claims()}


def _lm(technique: str, dataset: str, seed: int, perplexity: float, utility: dict[str, Any]) -> None:
    config = {"seed": seed, "dataset": dataset, "embedding": technique.removeprefix("seb-lm-"), "utility": utility}
    with record_run(
        flow="attacks",
        stage="attacks",
        technique=technique,
        dataset=dataset,
        profile="tiny",
        config=config,
        track=False,
    ) as rec:
        rec.metrics({"perplexity": perplexity, "steps": 1600.0, "best_step": 1400.0})


def _record(seb: list[float], utility: dict[str, Any], seeds: tuple[int, ...] = (3, 4, 5)) -> None:
    """Both corpora, 3 seeds: subword at perplexity 100, SEB_co (and its matched twin) at ``seb[i]`` at seed i."""
    for dataset in ("shakespeare", "kjv"):
        for seed, value in zip(seeds, seb, strict=True):
            _lm("seb-lm-subword", dataset, seed, 100.0, utility)
            _lm("seb-lm-seb_co", dataset, seed, value, utility)
            _lm("seb-lm-seb_co-matched", dataset, seed, value, utility)


FIXED = {"lm_steps": 1600, "lm_eval_every": 200, "lm_patience": None, "max_seconds": None}
PAPER = {"lm_steps": 20000, "lm_eval_every": 1000, "lm_patience": None, "max_seconds": None}
PATIENCE = {"lm_steps": 4000, "lm_eval_every": 200, "lm_patience": 1, "max_seconds": None}
CAPPED = {"lm_steps": 400, "lm_eval_every": None, "lm_patience": None, "max_seconds": 8}
NAMES = ("seb-utility-close-to-subword-fixed-budget", "seb-utility-close-to-subword-matched-params-fixed-budget")


def _verdicts() -> list[str]:
    return [sc.evaluate_claim(None, CLAIMS[name]).verdict for name in NAMES]


def test_runs_stopped_by_a_patience_or_a_clock_or_at_seen_seeds_are_not_read(home: Path) -> None:
    _record([100.0, 100.5, 101.0], PATIENCE)  # within 5% of subword: would reproduce, if read
    _record([100.0, 100.5, 101.0], CAPPED)
    _record([100.0, 100.5, 101.0], FIXED, seeds=(0, 1, 2))  # the seeds reported before the claims were written
    assert _verdicts() == [sc.NOT_RUN, sc.NOT_RUN]


def test_the_earlier_claims_read_only_their_patience_runs(home: Path) -> None:
    old = [CLAIMS["seb-utility-close-to-subword"], CLAIMS["seb-utility-close-to-subword-matched-params"]]
    _record([100.0, 100.5, 101.0], FIXED)
    assert [sc.evaluate_claim(None, c).verdict for c in old] == [sc.NOT_RUN, sc.NOT_RUN]
    _record([120.0, 121.0, 122.0], PATIENCE, seeds=(0, 1, 2))
    results = [sc.evaluate_claim(None, c) for c in old]
    assert [r.verdict for r in results] == [sc.EXPLORATORY, sc.EXPLORATORY]  # shown, not counted
    assert all("+20" in r.reason or "+21" in r.reason for r in results)  # read from the patience runs alone


def test_a_fixed_budget_run_can_fail_and_can_pass(home: Path) -> None:
    _record([100.0, 100.5, 101.0], PATIENCE)  # close, but stopped by a patience: ignored
    _record([120.0, 121.0, 122.0], FIXED)  # 20% worse at the fixed budget
    assert _verdicts() == [sc.NOT_REPRODUCED, sc.NOT_REPRODUCED]


def test_a_fixed_budget_run_within_the_bound_reproduces(home: Path) -> None:
    _record([130.0, 131.0, 132.0], PATIENCE)  # far, but stopped by a patience: ignored
    _record([100.0, 100.5, 101.0], FIXED)
    assert _verdicts() == [sc.REPRODUCED, sc.REPRODUCED]


def test_the_paper_profiles_form_is_read_too(home: Path) -> None:
    _record([100.0, 100.5, 101.0], PAPER)
    assert _verdicts() == [sc.REPRODUCED, sc.REPRODUCED]
