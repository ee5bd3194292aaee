"""The secure-inference flow end to end on a tiny GPT-2 (real 50,257-token vocabulary): models trained, every
method's encrypted generation recorded with per-op, per-party costs that sum to the totals, decrypted tokens
equal to the plaintext twin, quality and network projections, scaling points."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.mpc.crypten_compat import crypten_available
from core.mpc.methods import run_method_party
from core.mpc.parties import SECRET_SOURCE_TAG, SHARE_RANDOMNESS, PartyError
from flows.secure_inference import secure_inference_flow
from pbconfig.secure_inference import SecureInferenceConfig
from pbconfig.settings import get_settings
from storage.repository import ResultsRepository

pytestmark = [
    pytest.mark.usefixtures("prefect_harness"),
    pytest.mark.skipif(not crypten_available(), reason="CrypTen is not installed"),
]

TINY = SecureInferenceConfig(
    methods=("vanilla", "mpcformer_2quad", "merge"),
    n_layer=1,
    n_embd=16,
    n_head=2,
    n_positions=16,
    max_len=16,
    batch_size=8,
    max_pairs=400,
    train_steps=5,
    distill_steps=2,
    er_steps=2,
    mm_steps=2,
    prefix_len=3,
    gen_len=2,
    n_prompts=2,
    quality_prompts=4,  # 2 under MPC, 2 more through each method's plaintext twin
    scaling_gen_lens=(1,),
    scaling_methods=("merge",),
)


def test_secure_inference_flow_records_every_method(home: Path) -> None:
    summary = secure_inference_flow(TINY, profile="tiny")
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished"
    _, rows = repo.query("select technique, status from runs where stage = 'secure-inference' order by technique")
    assert all(s == "finished" for _, s in rows)
    assert sorted(t for t, _ in rows) == sorted(
        [
            "flow",
            "lm-train",
            "distill-mpcformer_2quad",
            "merge-er-train",
            "merge-mm-train",
            "vanilla",
            "mpcformer_2quad",
            "merge",
            "scaling-merge",
        ]
    )
    for method in TINY.methods:
        run_id = next(c["id"] for c in repo.get_run(summary["run_id"])["children"] if c["technique"] == method)
        run = repo.get_run(run_id)
        metrics = {m["name"]: m["value"] for m in run["metrics"]}
        costs = run["mpc_costs"]
        assert {c["party"] for c in costs} == {0, 1}
        for party in (0, 1):  # per-op rows of each party sum to that party's totals; the run keeps the slower one
            assert sum(c["bytes"] for c in costs if c["party"] == party) <= metrics["comm_bytes"]
        assert max(sum(c["bytes"] for c in costs if c["party"] == p) for p in (0, 1)) == metrics["comm_bytes"]
        assert metrics["mpc_plain_token_agreement"] == 1.0  # decrypted MPC output == plaintext twin
        assert 0.0 <= metrics["quality.rouge_l"] <= 1.0 and "quality.chrf" in metrics
        assert (metrics["mpc_prompts"], metrics["quality_prompts"]) == (2.0, 4.0)
        # the drop against the fine-tuned model's plaintext text: vanilla decrypts to exactly that text
        drop = {k.removeprefix("quality_drop."): v for k, v in metrics.items() if k.startswith("quality_drop.")}
        assert drop["rouge_l_lo"] <= drop["rouge_l"] <= drop["rouge_l_hi"]
        if method == "vanilla":
            assert all(v == pytest.approx(0.0) for v in drop.values())
        assert metrics["wan.projected_s"] > metrics["lan.projected_s"] >= metrics["total_s"] > 0
        assert metrics["wan.bytes_sent"] == metrics["lan.bytes_sent"] == metrics["comm_bytes"] / 2  # sent + received
    assert summary["table1"]["merge"]["Softmax"] == 0.0  # constant attention: no softmax under MPC
    assert summary["table1"]["vanilla"]["speedup_over_vanilla"] == 1.0
    assert summary["scaling"][0]["gen_len"] == 1 and "Table 2 analogue" in summary["markdown"]
    from mlflow import MlflowClient  # every MPC run names its share randomness (CrypTen's os.urandom seeds)

    _, ml = repo.query("select technique, mlflow_run_id from runs where stage = 'secure-inference'")
    client = MlflowClient(tracking_uri=get_settings().tracking_uri)  # this test's store, whatever mlflow's global
    source = {t: client.get_run(m).data.tags.get(SECRET_SOURCE_TAG) for t, m in ml}
    assert {source[t] for t in (*TINY.methods, "scaling-merge")} == {SHARE_RANDOMNESS}


def _dying_party(ctx, *args):
    if ctx.rank == 0:
        import os

        os._exit(3)  # the model owner's process dies mid-run
    return run_method_party(ctx, *args)


def test_a_party_that_dies_fails_the_run_cleanly(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.secure_inference as si

    monkeypatch.setattr(si, "run_method_party", _dying_party)
    cfg = TINY.model_copy(update={"methods": ("vanilla",), "scaling_methods": ()})
    with pytest.raises(PartyError, match="party 0"):
        secure_inference_flow(cfg, profile="tiny")
    _, rows = ResultsRepository().query(
        "select technique, status, error from runs where stage = 'secure-inference' order by started_at"
    )
    status = {t: (s, e) for t, s, e in rows}
    assert status["vanilla"][0] == "failed" and "party 0" in status["vanilla"][1]
    assert status["flow"][0] == "failed" and all(s != "running" for _, s, _ in rows)
    _, costs = ResultsRepository().query("select count(*) from mpc_costs")
    assert costs == [(0,)]  # nothing the failed run measured was written
