"""Every claim of the registry can fail, and cannot pass on a measurement that could not have failed it: for each
claim, rows built from its own measure and rule (its ``per`` contexts, its sides' selectors, every required
context) stand in for the store. Values on the wrong side of the bound with n = max(min_n, 3) seeds give ``not
reproduced`` (a projected claim: ``projected``, its reason saying the projection misses the bound); a measurement
with no power (one seed without an interval; every run's ``power`` short of the bound) gives ``underpowered``; an
every-run rule without ``power`` is a deterministic check that one run on the wrong side fails; one run whose own
interval (``run_interval``) lies on the wrong side fails a claim. A claim with a ``family`` gets bounds of one family
(their alpha shares add up to 0.05)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest

from pbconfig.claims import Claim, load_claims
from storage import claim_rows
from storage import claims as sc

CLAIMS = load_claims()
EVERY_RUN = ("all_at_most", "all_at_least")
COMMIT = "abc1234"
VALIDATION_ERROR = 0.02  # a projection's relative prediction error on a held-out measured run


def _first(wanted: Any) -> Any:
    return wanted[0] if isinstance(wanted, list) else wanted


def _wrong_stat(claim: Claim) -> float:
    """A stat on the wrong side of the rule's bound, half the bound's scale away (the ratio of two positive
    costs stays positive)."""
    rule = claim.rule
    delta = 0.5 * max(1.0, abs(rule.bound))
    return rule.bound - delta if rule.kind in ("above", "all_at_least") else rule.bound + delta


def _side_a(stat: str, target: float, b: float) -> float:
    """Side a's value that gives ``target`` against side b's ``b``."""
    if stat in ("value", "difference"):
        return target + (b if stat == "difference" else 0.0)
    return (target + 1) * b if stat == "relative" else target * b


def _contexts(claim: Claim) -> list[dict[str, Any]]:
    """Every context the claim's measure needs: each required value of a ``per`` column (every combination), a
    side a selector's value where a ``per`` column is one, else one value."""
    m = claim.measure
    contexts: list[dict[str, Any]] = [{}]
    for column in m.per:
        assert column not in (m.b or {}), f"{claim.id}: per column {column} selects side b: no comparison"
        if column in m.require:
            values = list(m.require[column])
        elif column in m.a:
            values = [_first(m.a[column])]
        else:
            values = ["d" if column == "dataset" else "x"]
        contexts = [{**c, column: v} for c in contexts for v in values]
    return contexts


def _frame(
    claim: Claim, stats: list[float], *, power: float | None = None, own_interval: float | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The rows ``claim_rows`` would give (and the runs' meta): per context, one run per seed a side, seed ``i``'s
    stat ``stats[i]``; ``power`` the stat of the strongest result a run allows; ``own_interval`` the half-width of
    each run's own recorded interval (None: none recorded, NaN where the measure reads one)."""
    m = claim.measure
    two_sided = m.stat != "value"
    peer_seeds = 100 if m.b_source is not None else 0  # a peer's seeds have nothing in common with ours
    rows, meta = [], []
    for k, context in enumerate(_contexts(claim)):
        for i, target in enumerate(stats):
            b_value = 1.0 + 0.01 * i  # side b's cost or accuracy, a narrow spread over seeds
            sides = [("a", _side_a(m.stat, target, b_value), i)]
            if two_sided:
                sides.append(("b", b_value, peer_seeds + i))
            for side, value, seed in sides:
                run_id = f"run-{k}-{side}-{i}"
                started = pd.Timestamp("2026-01-01", tz="UTC") + pd.Timedelta(seconds=len(meta))
                row: dict[str, Any] = {c: _first(v) for c, v in m.where.items()}
                row |= {"dataset": "d"} | context
                if m.b_source is None:
                    row |= {c: _first(v) for c, v in (m.a if side == "a" else m.b or {}).items()}
                else:
                    row["side"] = side
                row |= {"run_id": run_id, "value": value, "started_at": started, "git_commit": COMMIT}
                if m.run_interval is not None:
                    half = math.nan if own_interval is None else own_interval
                    row |= {"low": value - half, "high": value + half}
                if m.power is not None:
                    row["power"] = power
                if m.validation is not None:
                    row["validation"] = VALIDATION_ERROR * (-1) ** i
                if m.choose is not None:  # one value to choose among, with the data the choice reads
                    row |= {c: "x" if c == m.choose.among else 0.5 for c in m.choose.columns()}
                rows.append(row)
                meta.append({"run_id": run_id, "seed": seed, "started_at": started, "git_commit": COMMIT})
    frame = pd.DataFrame(rows)
    if m.family is not None:  # every bound of one family: their alpha shares add up to the claim's 0.05
        frame["family"] = 0.05 / len(frame)
    if m.b_source is not None:  # claim_rows keeps these columns of both sides
        frame = frame.reindex(columns=list(dict.fromkeys(["run_id", "value", "dataset", *m.per, "side"])))
    return frame, pd.DataFrame(meta)


def _evaluate(claim: Claim, monkeypatch: pytest.MonkeyPatch, frame: pd.DataFrame, meta: pd.DataFrame) -> sc.ClaimResult:
    """``evaluate_claim`` with ``frame`` as the store's rows, ``meta`` as its runs' seeds, commits and start times
    and every run at the scale of the claim's ``applies_at``."""
    monkeypatch.setattr(sc, "claim_rows", lambda db_url, c, **filters: frame.copy())
    monkeypatch.setattr(sc, "run_meta", lambda db_url, run_ids: meta[meta["run_id"].isin(run_ids)].copy())
    at = {k: _first(v) for k, v in claim.applies_at.where.items()} if claim.applies_at is not None else {}
    monkeypatch.setattr(claim_rows, "run_configs", lambda db_url, run_ids: {r: dict(at) for r in run_ids})
    return sc.evaluate_claim(None, claim)


def _seeds(claim: Claim) -> int:
    return max(claim.rule.min_n, 3)


def _jitter(claim: Claim, n: int) -> list[float]:
    """n seeds' stats on the wrong side of the bound, a narrow spread around one value."""
    scale = max(1.0, abs(claim.rule.bound))
    return [_wrong_stat(claim) + 1e-3 * scale * (i - (n - 1) / 2) for i in range(n)]


def _past(claim: Claim, how_far: float) -> float:
    """A power ``how_far`` (in units of the bound's scale) past the bound, in the direction that can fail it."""
    scale = max(1.0, abs(claim.rule.bound))
    return claim.rule.bound + (how_far if claim.rule.kind in ("all_at_most", "below") else -how_far) * scale


def _assert_fails(claim: Claim, result: sc.ClaimResult) -> None:
    reads = sc.PROJECTED if claim.measure.projected else sc.NOT_REPRODUCED  # what the rule itself gives
    if claim.exploratory:  # registered after a result it bears on: its rule's reading, never a verdict
        assert result.verdict == sc.EXPLORATORY, (result.verdict, result.reason)
        assert result.reason.startswith(f"its rule reads {reads}"), result.reason
    else:
        assert result.verdict == reads, (result.verdict, result.reason)
    if claim.measure.projected:
        assert "the projection misses the bound" in result.reason, result.reason
        if claim.measure.validation is not None:
            assert f"held-out measured run: {100 * VALIDATION_ERROR:.1f}%" in result.reason, result.reason


IDS = [c.id for c in CLAIMS]


@pytest.mark.parametrize("claim", CLAIMS, ids=IDS)
def test_values_on_the_wrong_side_are_not_reproduced(claim: Claim, monkeypatch: pytest.MonkeyPatch) -> None:
    n = _seeds(claim)
    power = _past(claim, 2.0) if claim.measure.power is not None else None
    frame, meta = _frame(claim, _jitter(claim, n), power=power, own_interval=1e-3)
    result = _evaluate(claim, monkeypatch, frame, meta)
    _assert_fails(claim, result)
    measured = [c for c in result.contexts if c.verdict != sc.NOT_RUN]
    assert len(measured) == len(_contexts(claim)) == len(result.contexts)  # every required context judged
    if claim.rule.kind not in EVERY_RUN:
        assert all(c.n_a == n and (claim.measure.stat == "value" or c.n_b == n) for c in measured)


@pytest.mark.parametrize("claim", CLAIMS, ids=IDS)
def test_a_measurement_that_could_not_have_failed_is_underpowered(
    claim: Claim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interval rules: one seed, without a run's own interval; every-run rules with ``power``: every run's power
    short of the bound; every-run rules without it are deterministic checks: one run on the wrong side fails. A rule
    that one run may decide on its own interval (``run_interval``, ``min_n: 1``) is short of a run's interval, not
    of seeds, where the run recorded none: ``inconclusive``."""
    m, rule = claim.measure, claim.rule
    if rule.kind not in EVERY_RUN:
        frame, meta = _frame(claim, _jitter(claim, 1))
        result = _evaluate(claim, monkeypatch, frame, meta)
        own = m.run_interval is not None and rule.min_n <= 1
        context = sc.INCONCLUSIVE if own else sc.UNDERPOWERED
        if claim.exploratory:  # its rule's reading, shown under the exploratory verdict
            assert result.verdict == sc.EXPLORATORY and result.reason.startswith(f"its rule reads {context}")
        else:
            assert result.verdict == (sc.PROJECTED if m.projected else context), (result.verdict, result.reason)
        assert result.contexts and all(c.verdict == context for c in result.contexts)
        if own:
            assert "from 1 run: it recorded no interval of its own" in result.reason, result.reason
        if m.power is not None:  # enough seeds on the wrong side, but no run could have got past the bound
            frame, meta = _frame(claim, _jitter(claim, _seeds(claim)), power=_past(claim, 0.0), own_interval=1e-3)
            result = _evaluate(claim, monkeypatch, frame, meta)
            assert result.verdict == sc.UNDERPOWERED and "no run could have failed" in result.reason, result.reason
    elif m.power is not None:  # runs within the bound whose power reaches the bound at most
        within = [_past(claim, -0.3) + 1e-3 * i for i in range(_seeds(claim))]
        frame, meta = _frame(claim, within, power=_past(claim, 0.0))
        result = _evaluate(claim, monkeypatch, frame, meta)
        assert result.verdict == sc.UNDERPOWERED, (result.verdict, result.reason)
        assert "no run could have failed" in result.reason
        frame, meta = _frame(claim, _jitter(claim, 1), power=_past(claim, 0.0))  # wrong side, but no power
        assert _evaluate(claim, monkeypatch, frame, meta).verdict == sc.UNDERPOWERED
    else:
        frame, meta = _frame(claim, _jitter(claim, 1))
        _assert_fails(claim, _evaluate(claim, monkeypatch, frame, meta))


RUN_INTERVAL = [c for c in CLAIMS if c.measure.run_interval is not None]


@pytest.mark.parametrize("claim", RUN_INTERVAL, ids=[c.id for c in RUN_INTERVAL])
def test_one_seed_whose_own_interval_is_on_the_wrong_side_is_not_reproduced(
    claim: Claim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's own interval over its examples (``run_interval``) judges a claim from one seed where the rule's
    ``min_n`` is 1: the wrong side is ``not reproduced``; where the rule wants more seeds, neither verdict
    (``underpowered``)."""
    frame, meta = _frame(claim, _jitter(claim, 1), own_interval=1e-3)
    result = _evaluate(claim, monkeypatch, frame, meta)
    if claim.rule.min_n > 1:
        assert result.verdict == sc.UNDERPOWERED, (claim.id, result.reason)
    else:
        _assert_fails(claim, result)
    assert all(c.n_a == 1 and "own" in c.interval for c in result.contexts)


def test_the_registry_has_claims_of_every_kind_this_file_checks() -> None:
    kinds = {c.rule.kind for c in CLAIMS}
    assert kinds == {"above", "below", "all_at_most", "all_at_least"}
    assert any(c.measure.power is not None for c in CLAIMS) and any(c.measure.projected for c in CLAIMS)
    assert RUN_INTERVAL and any(c.measure.b_source is not None for c in CLAIMS)
    assert any(c.applies_at is not None for c in CLAIMS)
