"""The stip flow on a small config-built GPT-2: both designs reproduce the plaintext tokens and logits, costs and
attack results are recorded (attack_results rows with the recovered fraction)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.stip import stip_flow
from pbconfig.stip import StipConfig
from storage.repository import ResultsRepository

pytestmark = pytest.mark.usefixtures("prefect_harness")

TINY = StipConfig(
    models=({"name": "gpt2-tiny", "source": "gpt2-config", "n_layer": 1, "n_embd": 32, "n_head": 2},),
    prompt_len=4,
    gen_len=2,
    attack_queries=8,
    stream_tokens=2000,
    timing_repeats=1,
    party_timeout_s=120,
)


def test_stip_flow_records_protocol_and_attacks(home: Path) -> None:
    summary = stip_flow(TINY, profile="tiny")
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished"
    assert {r["design"] for r in summary["protocol"]} == {"user_embed", "vocab_perm"}
    for r in summary["protocol"]:
        assert r["tokens_match"] == 1.0 and r["exact_float64"] == 1.0 and r["float64_max_rel_err"] <= 1e-9
        assert 0 <= r["max_abs_err"] < 1e-3  # float32, reported as measured
        assert r["bytes_up_per_token"] > 0 and r["bytes_down_per_token"] > 0 and 0 < r["user_overhead_fraction"] < 1
    vocab = next(r for r in summary["protocol"] if r["design"] == "vocab_perm")
    assert vocab["bytes_down_per_token"] > 50257 * 4  # logits over the whole (substituted) vocabulary come back
    _, rows = repo.query(
        "select a.attack, a.recovered_fraction from attack_results a join runs r on r.id = a.run_id "
        "where r.stage = 'stip' order by a.attack"
    )
    found = dict(rows)
    assert set(found) == {"stip_weight_matching", "stip_activation_stats", "stip_token_frequency"}
    assert found["stip_weight_matching"] == 1.0  # a fine-tuned copy of a public checkpoint gives pi away
    assert all(0.0 <= v <= 1.0 for v in found.values())
