"""The STIP server-time ratios of ``protocol_costs`` on a case with a known answer (timings stubbed): P2 against
the plaintext time of the same work, one ratio per round, and the sign-test interval of their median."""

from __future__ import annotations

import math

import pytest

from core.stip import evaluate as E
from core.stip.parties import StipResult


def _result(design: str, p2: float, plain: float, blocks: float) -> StipResult:
    return StipResult(
        design=design, tokens=[1, 2], plain_tokens=[1, 2], max_abs_logit_error=0.0, p2_seconds=p2, p3_seconds=0.5,
        wall_seconds=p2 + 0.5, plain_seconds=plain, bytes_p3_to_p2=8, bytes_p2_to_p3=8, setup_bytes_p1_to_p2=1,
        setup_bytes_p1_to_p3=1, plain_blocks_seconds=blocks,
    )  # fmt: skip


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float, float]]:
    """Round ``i`` of the in-process timing returns ``rounds[i]`` as (P2, plaintext step, plaintext blocks); the
    untimed warm-up before the rounds returns a wild value that no result may show."""
    rounds: list[tuple[float, float, float]] = []
    calls = iter(range(10**6))
    warm_up = [False]

    def three_processes(model, prompt, n_new, *, design, timeout_s):
        warm_up[0] = True  # protocol_costs starts with it, then warms up
        return _result(design, 1, 1, 1)

    def inprocess(model, prompt, n_new, *, design, plaintext_first):
        if warm_up[0]:
            warm_up[0] = False
            return _result(design, 1000.0, 1.0, 1.0)
        return _result(design, *rounds[next(calls)])

    monkeypatch.setattr(E, "run_stip_inprocess", inprocess)
    monkeypatch.setattr(E, "run_stip", three_processes)
    monkeypatch.setattr(E, "float64_exactness", lambda model, prompt, n_new, *, design: {})
    return rounds


def test_user_embed_server_is_compared_with_the_plaintext_blocks(stubbed: list) -> None:
    # P2 takes 2 s; the plaintext step 4 s, of which its blocks 1 s (the head is the user's): the server does the
    # blocks' work in twice their time, which the whole-step ratio (0.5) hides
    stubbed += [(2.0, 4.0, 1.0)] * 7
    out = E.protocol_costs(None, None, 2, design="user_embed", repeats=7, timeout_s=1.0)
    assert out["server_over_plaintext_time"] == pytest.approx(0.5)
    assert out["server_over_plaintext_same_work_time"] == pytest.approx(2.0)
    assert out["server_over_plaintext_same_work_time_lo"] == out["server_over_plaintext_same_work_time_hi"] == 2.0
    assert out["timing_rounds"] == 7
    assert out["timing_order"] == "abba"


def test_vocab_perm_server_is_compared_with_the_whole_step(stubbed: list) -> None:
    stubbed += [(4.4, 4.0, 1.0)] * 7
    out = E.protocol_costs(None, None, 2, design="vocab_perm", repeats=7, timeout_s=1.0)
    assert out["server_over_plaintext_same_work_time"] == pytest.approx(1.1)
    assert out["server_over_plaintext_time"] == pytest.approx(1.1)


def test_interval_is_the_sign_test_interval_of_the_rounds_and_absent_below_six(stubbed: list) -> None:
    ratios = [1.0, 1.4, 1.2, 0.9, 1.6, 1.1, 1.3]  # P2 time per round against 1 s of plaintext blocks
    stubbed += [(r, 3.0, 1.0) for r in ratios]
    out = E.protocol_costs(None, None, 2, design="user_embed", repeats=7, timeout_s=1.0)
    ordered = sorted(ratios)  # n = 7: the 95% sign-test interval is [x_(1), x_(7)] (coverage 0.984)
    assert out["server_over_plaintext_same_work_time"] == pytest.approx(ordered[3])
    assert out["server_over_plaintext_same_work_time_lo"] == pytest.approx(ordered[0])
    assert out["server_over_plaintext_same_work_time_hi"] == pytest.approx(ordered[-1])
    assert out["server_over_plaintext_same_work_time_coverage"] == pytest.approx(1 - 2 / 2**7)  # [min, max] of 7
    stubbed += [(1.2, 3.0, 1.0)] * 5
    short = E.protocol_costs(None, None, 2, design="user_embed", repeats=5, timeout_s=1.0)
    assert "server_over_plaintext_same_work_time_lo" not in short  # 5 rounds cannot give a 95% interval
    assert "server_over_plaintext_same_work_time_coverage" not in short
    assert math.isclose(short["server_over_plaintext_same_work_time"], 1.2)
