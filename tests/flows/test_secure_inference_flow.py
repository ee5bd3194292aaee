"""The secure-inference flow end to end on a tiny GPT-2 (real 50,257-token vocabulary): models trained, every
method's encrypted generation recorded with per-op, per-party costs that sum to the totals, decrypted tokens
equal to the plaintext twin, quality and network projections, scaling points."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from core.mpc.crypten_compat import crypten_available
from core.mpc.methods import run_method_party
from core.mpc.parties import SHARE_RANDOMNESS, PartyError
from core.secret_source import SECRET_SOURCE_TAG
from flows.secure_inference import secure_inference_flow
from pbconfig.claims import load_claims
from pbconfig.secure_inference import SecureInferenceConfig
from pbconfig.settings import get_settings
from storage.repository import ResultsRepository

if TYPE_CHECKING:
    from tests.filled_store import StageStore

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


def test_secure_inference_flow_records_every_method(stage_store: StageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = stage_store.summary("secure-inference")  # secure_inference_flow(TINY, profile="tiny"), run once
    stage_store.point_at(monkeypatch)
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


def test_seeds_run_one_pass_each_under_one_flow_run(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.secure_inference as fsi

    seen: list[tuple[int, str | None, str]] = []

    def fake_pass(config: SecureInferenceConfig, profile: str, parent: object) -> dict[str, object]:
        seen.append((config.seed, config.seeds, getattr(parent, "run_id", None)))
        return {"run_id": f"pass-{config.seed}"}

    monkeypatch.setattr(fsi, "seed_pass", fake_pass)
    summary = secure_inference_flow(TINY.model_copy(update={"seeds": (3, 1)}), profile="tiny")
    assert [(seed, seeds) for seed, seeds, _ in seen] == [(3, None), (1, None)]  # in order, each a one-seed config
    assert {parent for *_, parent in seen} == {summary["run_id"]}  # both under the stage's one flow run
    assert summary["seeds"] == {"3": {"run_id": "pass-3"}, "1": {"run_id": "pass-1"}}
    run = ResultsRepository().get_run(summary["run_id"])
    assert run["status"] == "finished" and run["config"]["seeds"] == [3, 1]
    with pytest.raises(ValueError, match=r"seeds must be distinct, got \[1, 1\]"):
        SecureInferenceConfig.model_validate({**TINY.model_dump(), "seeds": [1, 1]})


@pytest.mark.slow
def test_seeds_run_the_stage_once_per_seed_and_the_merge_claims_pair_by_seed(home: Path) -> None:
    import json

    from flows.registry import plan
    from pbconfig.benchmark import BenchmarkConfig
    from storage.claims import evaluate_claims
    from storage.leaderboard import config_seed

    cfg = TINY.model_copy(
        update={"methods": ("vanilla", "merge"), "seeds": (0, 1), "scaling_gen_lens": (), "quality_prompts": 2}
    )
    summary = secure_inference_flow(cfg, profile="tiny")
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished" and set(summary["seeds"]) == {"0", "1"}
    _, rows = repo.query(
        "select id, parent_id, technique, status, config_json from runs where stage = 'secure-inference'"
    )
    whole = BenchmarkConfig.model_construct(profile="tiny", secure_inference=cfg)  # plan reads this section only
    expected = plan("secure-inference", whole)["secure-inference"]
    assert len(rows) == expected and all(status == "finished" for *_, status, _ in rows)
    passes = {r[0]: config_seed(json.loads(r[4])) for r in rows if r[2] == "flow" and r[1] == summary["run_id"]}
    assert sorted(passes.values()) == [0, 1]  # one seed pass each, its config carrying its seed
    assert all(r[1] in passes for r in rows if r[2] in ("vanilla", "merge"))  # every generation under its pass
    (speedup,) = evaluate_claims(
        profile="tiny", claims=[c for c in load_claims() if c.id == "merge-speedup-over-vanilla"]
    )
    (ctx,) = speedup.contexts
    assert (ctx.n_a, ctx.n_b, len(ctx.values)) == (2, 2, 2) and ctx.interval == "paired t over seeds"


def test_too_few_test_prompts_fail_before_any_model_trains(home: Path) -> None:
    from core.errors import DataError

    with pytest.raises(
        DataError,
        match=r"seed 0: the test split of .* has \d+ prompts of >= prefix_len=3 tokens, "
        r"fewer than secure_inference.quality_prompts=10000 asks for; lower it to at most \d+",
    ):
        secure_inference_flow(TINY.model_copy(update={"quality_prompts": 10_000}), profile="tiny")
    _, rows = ResultsRepository().query("select technique, status, error from runs where stage = 'secure-inference'")
    assert [(t, s) for t, s, _ in rows] == [("flow", "failed")]  # nothing trained, the stage's row failed with why
    assert "quality_prompts=10000" in rows[0][2]
