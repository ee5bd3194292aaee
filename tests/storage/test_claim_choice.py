"""``measure.choose``: one value of a column (the membership audit's attack) chosen once per context on data the
judged value does not read, pooled over both sides and every seed, so that neither side is judged under its own best
pick. Known cases: the pooled choice where each side alone would pick another attack, ties, contexts choosing apart,
the registry's ``nonprivate-more-exposed`` failing on a hand-made case that per-side picks would pass, and a choice
that reads the judged value refused by name."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
from pydantic import ValidationError

from core.errors import ConfigError
from pbconfig.claims import Measure, load_claims
from storage import claim_rows as cr
from storage import claims as sc

MEASURE = {
    "source": "membership",
    "where": {"audit": "dp"},
    "choose": {"among": "attack", "by": "auc_selection"},
    "value": "auc_heldout",
    "a": {"private": False},
    "b": {"private": True},
    "per": ["dataset"],
    "stat": "difference",
}


def _rows(table: dict[tuple[str, bool, int], tuple[float, float]], dataset: str = "d") -> list[dict[str, Any]]:
    """Membership rows: (attack, private, seed) -> (auc_selection, auc_heldout), one run per (arm, seed)."""
    return [
        {
            "audit": "dp",
            "dataset": dataset,
            "attack": attack,
            "private": private,
            "run_id": f"{dataset}-{'dp' if private else 'np'}-{seed}",
            "auc_selection": sel,
            "auc_heldout": held,
        }
        for (attack, private, seed), (sel, held) in table.items()
    ]


def _claim_rows(measure: dict[str, Any], rows: list[dict[str, Any]]) -> pd.DataFrame:
    """``choose_once`` on the rows, the judged value ``auc_heldout``; the choice in ``attrs["chosen"]``."""
    frame = pd.DataFrame(rows).assign(value=lambda f: f["auc_heldout"])
    out, chosen = cr.choose_once(frame, Measure.model_validate(measure))
    out.attrs["chosen"] = chosen
    return out


# each side alone would pick another attack: the non-private arm lira (0.70), the DP arm loss (0.60); pooled, the
# means are lira 0.60, loss 0.575: lira for both
SPLIT = {
    ("lira", False, 0): (0.70, 0.52),
    ("loss", False, 0): (0.55, 0.90),
    ("lira", True, 0): (0.50, 0.51),
    ("loss", True, 0): (0.60, 0.95),
}


def test_one_attack_is_chosen_for_both_sides_on_the_pooled_selection_halves() -> None:
    rows = _claim_rows(MEASURE, _rows(SPLIT))
    assert set(rows["attack"]) == {"lira"}
    assert sorted(rows["private"]) == [False, True]
    assert rows.attrs["chosen"] == {("d",): "lira"}
    # the judged value never enters the choice: loss holds the highest held-out AUCs on both sides
    assert rows["value"].tolist() == [0.52, 0.51]


def test_ties_go_to_the_first_value_in_sorted_order() -> None:
    table = {("loss", False, 0): (0.6, 0.5), ("lira", False, 0): (0.6, 0.5)}
    table |= {("loss", True, 0): (0.5, 0.5), ("lira", True, 0): (0.5, 0.5)}
    assert _claim_rows(MEASURE, _rows(table)).attrs["chosen"] == {("d",): "lira"}


def test_each_context_chooses_on_its_own_rows() -> None:
    other = {(a, p, s): (1.0 - sel, held) for (a, p, s), (sel, held) in SPLIT.items()}  # loss wins here
    rows = _claim_rows(MEASURE, _rows(SPLIT, "d") + _rows(other, "e"))
    assert rows.attrs["chosen"] == {("d",): "lira", ("e",): "loss"}
    assert set(zip(rows["dataset"], rows["attack"], strict=True)) == {("d", "lira"), ("e", "loss")}


def test_rows_of_neither_side_do_not_vote() -> None:
    measure = MEASURE | {"a": {"private": False, "method": "m"}, "b": {"private": True, "method": "m"}}
    rows = [r | {"method": "m"} for r in _rows(SPLIT)]
    # a third model, on neither side, whose loss selection AUC would swing the pooled mean to loss
    rows += [r | {"method": "other"} for r in _rows({("loss", True, 0): (1.0, 0.5), ("lira", True, 0): (0.0, 0.5)})]
    assert _claim_rows(measure, rows).attrs["chosen"] == {("d",): "lira"}


def test_one_choice_pools_every_seed() -> None:
    """Seeds 1 and 2 alone would choose loss (by 0.02 each); seed 0's lira lead (0.30) carries the pooled mean: a
    choice per seed would judge seeds 1 and 2 under loss."""
    table = {("lira", p, 0): (0.80, 0.5) for p in (False, True)} | {("loss", p, 0): (0.50, 0.5) for p in (False, True)}
    for s in (1, 2):
        table |= {("lira", p, s): (0.50, 0.5) for p in (False, True)}
        table |= {("loss", p, s): (0.52, 0.5) for p in (False, True)}
    rows = _claim_rows(MEASURE, _rows(table))
    assert rows.attrs["chosen"] == {("d",): "lira"}
    assert set(rows["attack"]) == {"lira"} and rows["run_id"].nunique() == 6


def _membership(seeds: int) -> pd.DataFrame:
    """A hand-made audit where the non-private arm is less exposed than the DP arm under either attack (held-out AUC
    2 points lower), but each arm's own best pick would make it look more exposed: the non-private arm's selection
    half favours lira, whose held-out AUC is high on both arms, and the DP arm's favours loss, low on both."""
    table = {}
    for s in range(seeds):
        jitter = 0.001 * s
        table |= {
            ("lira", False, s): (0.70, 0.70 + jitter),
            ("loss", False, s): (0.55, 0.50 + jitter),
            ("lira", True, s): (0.54, 0.72 - jitter),
            ("loss", True, s): (0.60, 0.52 - jitter),
        }
    frame = pd.DataFrame(_rows(table, "ml-100k"))
    frame["method"] = "transformer"
    frame["epsilon"] = [8.0 if p else float("nan") for p in frame["private"]]
    frame["selected"] = False
    for _, part in frame.groupby(["run_id", "private"]):  # each audit's own pick, as recorded
        frame.loc[part["auc_selection"].idxmax(), "selected"] = True
    for side in ("lo", "hi"):
        frame[f"auc_heldout_{side}"] = frame["auc_heldout"] + (-0.01 if side == "lo" else 0.01)
    return frame


def _evaluate(monkeypatch: pytest.MonkeyPatch, claim_id: str, frame: pd.DataFrame) -> sc.ClaimResult:
    claim = next(c for c in load_claims() if c.id == claim_id)
    monkeypatch.setattr(cr, "_source_rows", lambda *args, **kwargs: frame.copy())
    runs = frame["run_id"].drop_duplicates().tolist()
    meta = pd.DataFrame(
        {
            "run_id": runs,
            "seed": [int(r.rsplit("-", 1)[1]) for r in runs],
            "started_at": pd.Timestamp("2026-01-01", tz="UTC"),
            "git_commit": "abc1234",
        }
    )
    monkeypatch.setattr(sc, "run_meta", lambda db_url, run_ids: meta[meta["run_id"].isin(run_ids)].copy())
    return sc.evaluate_claim(None, claim)


def test_the_registered_audit_claim_fails_where_per_side_picks_would_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = _membership(seeds=3)
    result = _evaluate(monkeypatch, "nonprivate-more-exposed", frame)
    assert result.verdict == sc.NOT_REPRODUCED, (result.verdict, result.reason)
    assert any("attack lira chosen once on auc_selection" in r for r in result.recipes), result.recipes
    # the same rows judged under each arm's own recorded pick (the rule before 2026-11-29) would have passed
    picked = frame[frame["selected"]]
    gap = picked[~picked["private"]]["auc_heldout"].mean() - picked[picked["private"]]["auc_heldout"].mean()
    assert gap > 0.15


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"choose": {"among": "attack", "by": "auc_heldout"}}, "reads the judged value"),
        ({"choose": {"among": "attack", "by": "auc_heldout_lo + 0"}, "run_interval": ["auc_heldout_lo", "x"]}, "reads"),
        ({"where": {"audit": "dp", "attack": "loss"}}, "choose.among 'attack' is also in where or per"),
    ],
)
def test_a_choice_on_the_judged_data_or_with_nothing_to_choose_is_refused(change: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        Measure.model_validate(MEASURE | change)


def test_runs_of_an_older_commit_do_not_vote(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same seeds measured at an older commit, whose selection halves favour loss by far, are superseded by the
    newest commit's runs (which favour lira) before the choice: the choice is lira, and it names no old run."""
    new = _membership(seeds=3)
    old = new.copy()
    old["run_id"] = "old-" + old["run_id"]
    old["auc_selection"] = [0.99 if a == "loss" else 0.01 for a in old["attack"]]
    frame = pd.concat([old, new], ignore_index=True)
    monkeypatch.setattr(cr, "_source_rows", lambda *args, **kwargs: frame.copy())
    runs = frame["run_id"].drop_duplicates().tolist()
    meta = pd.DataFrame(
        {
            "run_id": runs,
            "seed": [int(r.rsplit("-", 1)[1]) for r in runs],
            "started_at": [pd.Timestamp("2026-01-0" + ("1" if r.startswith("old-") else "2"), tz="UTC") for r in runs],
            "git_commit": ["0ld0000" if r.startswith("old-") else "abc1234" for r in runs],
        }
    )
    monkeypatch.setattr(sc, "run_meta", lambda db_url, run_ids: meta[meta["run_id"].isin(run_ids)].copy())
    claim = next(c for c in load_claims() if c.id == "nonprivate-more-exposed")
    result = sc.evaluate_claim(None, claim)
    assert any("attack lira chosen once" in r for r in result.recipes), result.recipes
    assert result.superseded == 6


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # the whole-set AUC: a differently named column measured on the same examples the value reads
        ({"choose": {"among": "attack", "by": "auc"}}, "'auc' on membership is not a selection column"),
        # a selection column, but the judged value is not the data it was measured apart from
        ({"value": "auc"}, "measured apart from the judged auc"),
        ({"source": "film", "choose": {"among": "attack", "by": "auc_selection"}}, "selection columns of film: none"),
    ],
)
def test_a_choice_on_a_column_not_declared_apart_from_the_value_is_refused(change: dict, named: str) -> None:
    """The registry checks names only; the store's check reads what each view's selection column was measured apart
    from (storage.view_columns.SELECTION_COLUMNS), so a renamed or unrelated column cannot pass as a selection."""
    with pytest.raises(ConfigError, match=named):
        sc.check_choice(Measure.model_validate(MEASURE | change))


def test_every_registered_choice_reads_a_declared_selection_column() -> None:
    for claim in load_claims():
        if claim.measure.choose is not None:
            sc.check_choice(claim.measure)


def test_a_refused_choice_stops_the_claim_before_any_row_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    (claim,) = [c for c in load_claims() if c.id == "nonprivate-more-exposed"]
    bad = claim.model_copy(
        update={
            "measure": claim.measure.model_copy(
                update={"choose": claim.measure.choose.model_copy(update={"by": "auc"})}
            )
        }
    )
    with pytest.raises(ConfigError, match="not a selection column"):
        sc._chosen(pd.DataFrame(), bad.measure, {})
