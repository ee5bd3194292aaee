"""The network cost model and the text-quality scores, on hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError, DataError
from core.mpc.costmodel import LAN, WAN, Network, project, project_all
from core.mpc.quality import bleu, chrf, embedding_f1, rouge_l


def test_projection_adds_transfer_and_latency() -> None:
    out = project(2.0, 1.25e9, 1000, Network("x", 1e9, 0.01))  # 10 Gbit over 1 Gbit/s = 10 s; 1000 x 10 ms
    assert out == {"compute_s": 2.0, "transfer_s": 10.0, "latency_s": 10.0, "projected_s": 22.0}
    assert LAN.bandwidth_bps == 10e9 and LAN.rtt_s == 2e-4 and WAN.bandwidth_bps == 1e8 and WAN.rtt_s == 0.04


def test_busiest_party_counts() -> None:
    out = project_all(1.0, {0: {"bytes": 100.0, "rounds": 3}, 1: {"bytes": 300.0, "rounds": 2}})
    assert out["wan"]["transfer_s"] == pytest.approx(8 * 300 / 1e8) and out["wan"]["latency_s"] == pytest.approx(0.12)


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
