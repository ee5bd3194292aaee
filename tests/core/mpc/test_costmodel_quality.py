"""The network cost model and the text-quality scores, on hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError, DataError
from core.mpc.accounting import CostMeter
from core.mpc.costmodel import LAN, WAN, Network, project, project_all, sent_bytes
from core.mpc.crypten_compat import crypten_available, import_crypten
from core.mpc.quality import bleu, chrf, embedding_f1, paired_bootstrap, quality_drop, rouge_l

N_OPENED = 1000  # int64 ring elements opened in the convention test


def test_projection_adds_transfer_and_latency() -> None:
    out = project(2.0, 1.25e9, 1000, Network("x", 1e9, 0.01))  # 10 Gbit over 1 Gbit/s = 10 s; 1000 x 10 ms
    assert out == {"compute_s": 2.0, "bytes_sent": 1.25e9, "transfer_s": 10.0, "latency_s": 10.0, "projected_s": 22.0}
    assert LAN.bandwidth_bps == 10e9 and LAN.rtt_s == 2e-4 and WAN.bandwidth_bps == 1e8 and WAN.rtt_s == 0.04


def test_busiest_party_counts_with_bytes_sent_half_the_logged() -> None:
    out = project_all(1.0, {0: {"bytes": 100.0, "rounds": 3}, 1: {"bytes": 300.0, "rounds": 2}})
    # logged 300 = 150 sent + 150 received by the busiest party; only the 150 sent cross its outgoing link
    assert out["wan"]["bytes_sent"] == out["lan"]["bytes_sent"] == 150.0
    assert out["wan"]["transfer_s"] == pytest.approx(8 * 150 / 1e8) and out["wan"]["latency_s"] == pytest.approx(0.12)
    assert out["lan"]["projected_s"] == pytest.approx(1.0 + 8 * 150 / 1e10 + 3 * 2e-4)


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "16000", None, True])
def test_sent_bytes_halves_the_logged_count_and_names_a_bad_one(bad: object) -> None:
    assert sent_bytes(16_000) == 8_000.0 and sent_bytes(0) == 0.0
    with pytest.raises(ConfigError, match=r"logged_bytes must be a finite number >= 0, got logged_bytes="):
        sent_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="logged_bytes must be"):
        project_all(1.0, {0: {"bytes": bad, "rounds": 1}})


def _open_shares(ctx, n: int) -> dict:
    """Share n values from party 0, then open them to both parties, metering only the opening."""
    crypten = import_crypten()
    x = crypten.cryptensor(torch.arange(float(n)), src=0)
    meter = CostMeter()  # the counters privbench logs per party (``crypten_comm_stats``)
    with meter.region():
        plain = x.get_plain_text()
    return {"rank": ctx.rank, "plain": plain, **meter.totals()}


@pytest.mark.skipif(not crypten_available(), reason="CrypTen is not installed")
def test_crypten_logs_sent_plus_received_bytes_per_party() -> None:
    """The convention, measured: opening N int64 elements between two parties sends 8 N bytes each way; CrypTen
    logs 16 N bytes (sent + received) and one round for each party, so the projection counts 8 N."""
    from core.mpc.parties import run_local

    parties = run_local(_open_shares, (N_OPENED,), timeout_s=120)
    for p in parties:
        assert torch.equal(p["plain"], torch.arange(float(N_OPENED))), p["rank"]
        assert p["comm_bytes"] == 2 * 8 * N_OPENED == 16_000 and p["rounds"] == 1, p
        assert sent_bytes(p["comm_bytes"]) == 8 * N_OPENED
    per_party = {p["rank"]: {"bytes": p["comm_bytes"], "rounds": p["rounds"]} for p in parties}
    wan = project_all(0.0, per_party)["wan"]
    assert wan["bytes_sent"] == 8_000 and wan["transfer_s"] == pytest.approx(8 * 8_000 / 1e8)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1.0, 0, 0), "compute_s must be a finite number >= 0"),
        ((1.0, math.nan, 0), "bytes_sent must be a finite number >= 0"),
    ],
)
def test_bad_measurements_are_named(args: tuple, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        project(*args, LAN)
    with pytest.raises(ConfigError, match="bandwidth_bps must be"):
        Network("bad", 0, 0.1)


def test_rouge_l_on_hand_worked_lcs() -> None:
    # LCS("the cat sat", "the cat ran") = 2 tokens: P = R = 2/3, F = 2/3
    assert rouge_l(["the cat sat"], ["the cat ran"]) == pytest.approx(2 / 3)
    assert rouge_l(["a b c"], ["a b c"]) == pytest.approx(1.0)


def test_chrf_and_bleu_are_100_on_identity_and_lower_otherwise() -> None:
    refs = ["the quick brown fox jumps over the lazy dog"]
    assert chrf(refs, refs) == pytest.approx(100.0) and bleu(refs, refs) == pytest.approx(100.0)
    assert chrf(["the quick brown cat"], refs) < 100 and bleu(["a b"], refs) < 10
    with pytest.raises(DataError, match="2 candidates but 1 references"):
        chrf(["a", "b"], refs)


def test_embedding_f1_matches_a_hand_computation() -> None:
    table = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert embedding_f1([[0, 1]], [[0, 1]], table) == pytest.approx(1.0)
    # candidate [0] vs reference [2]: cos = 1/sqrt(2) both ways -> F1 = 1/sqrt(2)
    assert embedding_f1([[0]], [[2]], table) == pytest.approx(1 / math.sqrt(2))
    assert embedding_f1([[]], [[2]], table) == 0.0


def test_paired_bootstrap_collapses_on_a_constant_difference_and_covers_the_mean() -> None:
    assert paired_bootstrap([0.5, 0.7, 0.9], [0.4, 0.6, 0.8]) == pytest.approx((0.1, 0.1, 0.1))
    base, other = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [0.0] * 6
    mean, low, high = paired_bootstrap(base, other, seed=1)
    assert mean == pytest.approx(4 / 6) and 0.0 <= low < mean < high <= 1.0
    assert paired_bootstrap(base, other, seed=1) == (mean, low, high)  # seeded
    with pytest.raises(DataError, match="got 2 and 1"):
        paired_bootstrap([1.0, 2.0], [1.0])


def test_quality_drop_is_the_plaintext_score_minus_the_method_score() -> None:
    words = {0: "the", 1: "cat", 2: "sat", 3: "dog", 4: "ran"}
    decode = lambda ids: " ".join(words[i] for i in ids)
    table = torch.eye(5)
    refs = [[0, 1, 2], [0, 3, 4]]
    same = quality_drop(refs, refs, refs, decode, table)
    assert all(v == pytest.approx(0.0) for v in same.values())
    worse = [[0, 1, 4], [3]]  # ROUGE-L 2/3 and 1/2 where the plaintext model scored 1 and 1
    drop = quality_drop(refs, worse, refs, decode, table)
    assert drop["rouge_l"] == pytest.approx(1 - (2 / 3 + 1 / 2) / 2)
    assert drop["rouge_l_lo"] == pytest.approx(1 / 3) and drop["rouge_l_hi"] == pytest.approx(1 / 2)
    assert drop["chrf"] > 0 and drop["embedding_f1"] > 0 and drop["bleu"] == 0  # no 4-gram in 3 words: BLEU 0
    assert quality_drop(worse, refs, refs, decode, table)["rouge_l"] == pytest.approx(-drop["rouge_l"])
