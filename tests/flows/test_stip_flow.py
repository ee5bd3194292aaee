"""The stip flow on a small config-built GPT-2: both designs reproduce the plaintext tokens and logits, costs and
attack results are recorded (attack_results rows with the recovered fraction)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pbconfig.stip import StipConfig
from storage.repository import ResultsRepository

if TYPE_CHECKING:
    from tests.filled_store import StageStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

TINY = StipConfig(
    models=({"name": "gpt2-tiny", "source": "gpt2-config", "n_layer": 1, "n_embd": 32, "n_head": 2},),
    prompt_len=4,
    gen_len=2,
    attack_queries=8,
    stream_tokens=2000,
    finetune_noises=(0.1,),
    timing_repeats=1,
    party_timeout_s=120,
)


def test_stip_flow_records_protocol_and_attacks(stage_store: StageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = stage_store.summary("stip")  # stip_flow(TINY, profile="tiny"), run once for the session's tests
    stage_store.point_at(monkeypatch)
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished"
    assert {r["design"] for r in summary["protocol"]} == {"user_embed", "vocab_perm"}
    for r in summary["protocol"]:
        assert r["tokens_match"] == 1.0 and r["exact_float64"] == 1.0 and r["float64_max_rel_err"] <= 1e-9
        assert 0 <= r["max_abs_err"] < 1e-3  # float32, reported as measured
        assert r["bytes_up_per_token"] > 0 and r["bytes_down_per_token"] > 0 and 0 < r["user_overhead_fraction"] < 1
    _, rounds = repo.query(
        "select r.technique, m.step, m.value from metrics m join runs r on r.id = m.run_id "
        "where m.name = 'server_over_plaintext_same_work_time_round' order by r.technique, m.step"
    )
    median = {f"stip-{r['design']}": r["server_over_plaintext_same_work_time"] for r in summary["protocol"]}
    assert [(t, s) for t, s, _ in rounds] == [("stip-user_embed", 0), ("stip-vocab_perm", 0)]  # one round each
    assert all(v == median[t] for t, _, v in rounds)  # one round: its ratio is the median
    vocab = next(r for r in summary["protocol"] if r["design"] == "vocab_perm")
    assert vocab["bytes_down_per_token"] > 50257 * 4  # logits over the whole (substituted) vocabulary come back
    _, rows = repo.query(
        "select a.attack, a.setting, a.recovered_fraction from attack_results a join runs r on r.id = a.run_id "
        "where r.stage = 'stip' order by a.attack"
    )
    assert {a for a, _, _ in rows} == {"stip_checkpoint_match", "stip_activation_stats", "stip_frequency"}
    assert all(v is None or 0.0 <= v <= 1.0 for _, _, v in rows)
    # a fine-tuned copy of a public checkpoint gives pi (user_embed) and sigma (vocab_perm) away
    assert [v for a, _, v in rows if a == "stip_checkpoint_match"] == [1.0, 1.0]
    by_design = {a["design"]: a["metrics"] for a in summary["attacks"]}
    assert set(by_design) == {"user_embed", "vocab_perm"}
    for metrics in by_design.values():
        assert metrics["checkpoint.tokens_recovered.noise_10pct"] >= 0.99
        assert metrics["strongest.tokens_recovered"] >= metrics["none.tokens_recovered"] > 0
    assert by_design["vocab_perm"]["checkpoint.sigma_recovered.up_to_10pct"] >= 0.99
    _, flow_metrics = repo.query("select m.name from metrics m where m.run_id = :r", {"r": summary["run_id"]})
    assert "gpt2-tiny.user_embed.strongest.tokens_recovered" in {k for (k,) in flow_metrics}
