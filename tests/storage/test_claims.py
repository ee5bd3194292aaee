"""The claims registry and its verdicts: the registry's entries read columns their sources have and its errors name
the bad entry; a claim with no runs is ``not run``; config columns, a side b from another source (a peer) and bench
claims read what they should; ``privbench report`` renders the registry from the store filled by real tiny runs of
every stage. How one context is judged (intervals, verdicts, superseded runs) is ``test_claim_context.py``'s."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from core.errors import ConfigError
from pbconfig.claims import VERDICTS, load_claims
from storage import claims as sc
from storage import view_columns
from storage.recording import record_run
from tests.filled_store import FilledStore
from tests.hand_made import ABOVE, BEATS, at_commit, claim_of, record_dp, record_grid, record_metric_run

VIEW_COLUMNS = {
    "privacy_utility": view_columns.PRIVACY_UTILITY_COLUMNS,
    "clipping_bench": view_columns.CLIPPING_COLUMNS,
    "tangent_accuracy": view_columns.TANGENT_ACCURACY_COLUMNS,
    "unlearning": view_columns.UNLEARNING_COLUMNS,
    "mpc_costs": view_columns.MPC_COSTS_COLUMNS,
    "stip_overhead": view_columns.STIP_OVERHEAD_COLUMNS,
    "stip_attacks": view_columns.STIP_ATTACKS_COLUMNS,
    "film": view_columns.FILM_COLUMNS,
    "membership": view_columns.MEMBERSHIP_COLUMNS,
}


def test_registry_loads_and_reads_columns_its_sources_have() -> None:
    claims = load_claims()
    assert len(claims) >= 20
    assert len({c.id for c in claims}) == len(claims)
    papers = {c.paper for c in claims}
    assert {"DPFormer", "TAFT", "MERGE", "STIP", "SEB", "Audit"} <= papers
    for claim in claims:
        m = claim.measure
        if m.source in VIEW_COLUMNS:
            missing = m.columns - set(VIEW_COLUMNS[m.source])
            assert not missing, f"{claim.id}: {m.source} has no {missing}"
        else:
            assert m.stage
        if m.b_source is not None and m.b_source.source in VIEW_COLUMNS:
            missing = m.b_source.columns(m.per) - set(VIEW_COLUMNS[m.b_source.source])
            assert not missing, f"{claim.id}: b_source {m.b_source.source} has no {missing}"


def test_registry_errors_name_the_file_and_the_bad_entry(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(
        "paper: P\ntitle: T\nfile: f.txt\nclaims:\n  - id: x\n    stage: s\n    source: s\n    statement: s\n"
        "    paper_value: v\n    measure: {source: nowhere, value: v}\n    rule: {kind: above, bound: 0}\n"
    )
    with pytest.raises(ConfigError, match=r"(?s)bad\.yaml.*nowhere"):
        load_claims(tmp_path)
    with pytest.raises(ValueError, match="only column names"):
        claim_of({**BEATS, "value": "__import__('os')"}, ABOVE)
    with pytest.raises(ValueError, match="needs a side b"):
        claim_of({**BEATS, "b": None}, ABOVE)
    with pytest.raises(ValueError, match="not in per"):
        claim_of({**BEATS, "require": {"dataset": ["d"]}}, ABOVE)


def test_no_runs_is_not_run(home: Path) -> None:
    result = sc.evaluate_claim(None, claim_of(BEATS, ABOVE))
    assert result.verdict == sc.NOT_RUN and result.contexts == ()
    assert "privbench run train-dp" in result.reason


def test_runs_that_lack_the_rules_measure_are_named_in_the_not_run_reason(home: Path) -> None:
    """Runs recorded before a rule's measure existed are not silently "nothing measured": the reason counts them."""
    record_grid({("dpformer", 5.0): [1.0, 2.0], ("transformer", 5.0): [1.0, 2.0]})  # no masked figures recorded
    result = sc.evaluate_claim(None, claim_of({**BEATS, "value": "ndcg_at_10_masked"}, ABOVE))
    assert result.verdict == sc.NOT_RUN
    assert result.reason.startswith("4 recorded runs lack the rule's measure (ndcg_at_10_masked): run `privbench")


def test_value_b_and_config_columns(home: Path) -> None:
    record_metric_run("forget-retrain", {"retrain_s": 12.0})
    record_metric_run("forget-subtraction", {"subtraction_s": 0.5})
    cheaper = claim_of(
        {
            "source": "metrics",
            "stage": "tangent",
            "value": "retrain_s",
            "value_b": "subtraction_s",
            "a": {"method": "forget-retrain"},
            "b": {"method": "forget-subtraction"},
            "stat": "ratio",
            "unit": "x",
        },
        {"kind": "all_at_least", "bound": 10},
        stage="tangent",
    )
    result = sc.evaluate_claim(None, cheaper)
    assert result.verdict == sc.REPRODUCED and result.contexts[0].estimate == pytest.approx(24.0)
    for kind, acc in (("ours", 0.6), ("reg", 0.5)):
        record_metric_run("dp-full", {"test_accuracy": acc}, {"parameters": kind, "target_epsilon": 3.0})
    tangent_dp = claim_of(
        {
            "source": "metrics",
            "stage": "tangent",
            "techniques": ["dp-full"],
            "value": "test_accuracy",
            "a": {"config.parameters": "ours"},
            "b": {"config.parameters": "reg"},
            "per": ["method", "config.target_epsilon"],
            "stat": "difference",
            "unit": "pt",
        },
        {"kind": "above", "bound": 0, "min_n": 1},
        stage="tangent",
    )
    result = sc.evaluate_claim(None, tangent_dp)
    assert [c.context for c in result.contexts] == ["dp-full, target_epsilon=3"]
    assert result.contexts[0].estimate == pytest.approx(0.1) and result.verdict == sc.UNDERPOWERED  # one seed


PEER = {
    "source": "privacy_utility",
    "where": {"private": False},
    "value": "ndcg_at_10",
    "a": {"method": "transformer"},
    "b_source": {
        "source": "metrics",
        "stage": "bench",
        "techniques": ["recbole-sasrec"],
        "where": {"config.setting.users": None},
        "value": "test_ndcg_at_10",
        "profile": "paper",
    },
    "per": ["dataset"],
    "require": {"dataset": ["d"]},
    "stat": "relative",
    "unit": "%",
}


def _peer_run(seed: int, ndcg: float, *, profile: str = "paper", users: int | None = None) -> None:
    with record_run(
        flow="bench",
        stage="bench",
        technique="recbole-sasrec",
        dataset="d",
        profile=profile,
        config={"benchmark": "recbole-sasrec", "setting": {"seed": seed, "users": users}},
        track=False,
    ) as rec:
        rec.metrics({"test_ndcg_at_10": ndcg})


def test_side_b_from_another_source_is_a_peer(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``b_source``: side b is another source's rows (a peer's bench runs against our train-dp baseline), read
    with its own profile whatever ours, never paired with our seeds (Welch / delta method)."""
    claim = claim_of(PEER, {"kind": "above", "bound": -0.05, "min_n": 3})
    at_commit(monkeypatch, "1111111")
    for seed, ndcg in enumerate((1.0, 1.1, 1.2)):
        record_dp("transformer", seed, ndcg, epsilon=None)
    record_dp("transformer", 0, 9.0, epsilon=8.0)  # private: not side a
    record_dp("dpformer", 1, 9.0, epsilon=None)  # another method: not side a
    result = sc.evaluate_claim(None, claim, profile="tiny")
    assert result.verdict == sc.NOT_RUN
    assert "only one side measured (d)" in result.reason
    assert "privbench bench recbole-sasrec --profile paper" in result.reason

    for seed, ndcg in enumerate((1.0, 1.05, 1.1)):  # the same seed numbers as ours: still unpaired
        _peer_run(seed, ndcg)
    _peer_run(3, 0.1, profile="quick")  # another profile than the peer's
    _peer_run(4, 0.1, users=150)  # a subsample, left out by b_source.where
    result = sc.evaluate_claim(None, claim, profile="tiny")  # our profile: the peer's runs are profile paper
    (context,) = result.contexts
    assert context.context == "d" and context.interval == "delta method (Welch)"
    assert context.n_a == context.n_b == 3 and result.n == 3
    ratio, va, vb = 1.1 / 1.05, 0.01 / 3, 0.0025 / 3
    se = ratio * math.sqrt(va / 1.1**2 + vb / 1.05**2)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    from scipy import stats

    half = stats.t.ppf(0.975, df) * se
    assert context.estimate == pytest.approx(ratio - 1)
    assert (context.low, context.high) == pytest.approx((ratio - 1 - half, ratio - 1 + half))
    assert result.verdict == sc.INCONCLUSIVE and "straddles -5.0%" in result.reason
    assert len(result.run_ids) == 6 and result.datasets == ("d",)
    assert claim.stat_label == "ndcg_at_10 (transformer) / test_ndcg_at_10 (recbole-sasrec, setting.users=None) - 1"

    at_commit(monkeypatch, "2222222")
    for seed in range(3):  # the peer run again with the same seeds at a newer commit, far below ours: it counts
        _peer_run(seed, 0.5 + 0.01 * seed)
    result = sc.evaluate_claim(None, claim, profile="tiny")
    assert result.verdict == sc.REPRODUCED and result.contexts[0].n_b == 3
    assert result.superseded == 3 and result.reason == "3 runs of an older commit superseded by the newest commit's"
    assert result.contexts[0].estimate == pytest.approx(1.1 / 0.51 - 1)
    assert result.contexts[0].means == pytest.approx((1.1, 0.51))  # the report shows both numbers, not just the ratio
    assert f"(ours {sc.fmt(1.1)}, peer {sc.fmt(0.51)}) (n=3)" in result.ours()


def test_b_source_is_validated() -> None:
    peer = PEER["b_source"]
    with pytest.raises(ValueError, match="not both"):
        claim_of({**PEER, "b": {"method": "gru"}}, ABOVE)
    with pytest.raises(ValueError, match="value_b does not apply"):
        claim_of({**PEER, "value_b": "hit_at_10"}, ABOVE)
    with pytest.raises(ValueError, match="takes no side b"):
        claim_of({**PEER, "stat": "value"}, ABOVE)
    with pytest.raises(ValueError, match=r"set measure\.b_source\.stage"):
        claim_of({**PEER, "b_source": {**peer, "stage": None}}, ABOVE)
    with pytest.raises(ValueError, match="only column names"):
        claim_of({**PEER, "b_source": {**peer, "value": "open('x')"}}, ABOVE)


def test_the_registry_verdicts_are_the_evaluators() -> None:
    """Each is reached on a hand-made store in ``test_claim_verdict_classes``."""
    assert list(VERDICTS) == [
        sc.REPRODUCED,
        sc.NOT_REPRODUCED,
        sc.INCONCLUSIVE,
        sc.UNDERPOWERED,
        sc.PROJECTED,
        sc.EXPLORATORY,
        sc.NOT_APPLICABLE,
        sc.NOT_RUN,
    ]
    assert [str(v) for v in VERDICTS] == [v.value for v in VERDICTS]  # shown and stored as the plain text
    from privbench.display import VERDICT_COLOURS

    assert set(VERDICT_COLOURS) == set(VERDICTS)  # the CLI colours every verdict


def test_report_on_the_filled_store(filled_store: FilledStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry on real tiny runs of every stage: every claim gets a verdict, the measured ones are many, and
    ``privbench report`` writes the Markdown with one table per paper and the stage figures."""
    for key, value in filled_store.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = sc.evaluate_claims(filled_store.db_url)
    assert {r.verdict for r in results} <= set(VERDICTS)
    measured = [r.claim.id for r in results if r.verdict != sc.NOT_RUN]
    assert len(measured) >= 12, [(r.claim.id, r.verdict, r.reason) for r in results]

    from privbench.cli import app

    out = tmp_path / "tiny.md"
    run = CliRunner().invoke(app, ["report", "--profile", "tiny", "--out", str(out), "--json"])
    assert run.exit_code == 0, run.output
    text = out.read_text()
    for paper in ("## DPFormer", "## TAFT", "## MERGE", "## STIP", "## SEB", "## Audit"):
        assert paper in text
    assert "| claim | source | paper | ours (mean [95% interval], n) | scale | verdict | rule |" in text
    assert "Verdicts: " in text and "wall time" in text
    assert "The stages ran as separate commands (no benchmark chain run): " in text  # their total wall time
    pngs = sorted((tmp_path / "tiny").glob("*.png"))
    assert pngs and all(f"tiny/{p.name}" in text for p in pngs)

    # the benchmark flow's last step, on one chain (here the train-dp flow run): verdict metrics and a folder
    from tasks.report import claims_report

    root = filled_store.flow_runs["train-dp"]
    done = claims_report.fn(SimpleNamespace(run_id=root), "tiny")
    try:
        assert (done["folder"] / "report.md").is_file() and list((done["folder"] / "report").glob("*.png"))
        assert sum(done["counts"].values()) == len(load_claims())
        assert done["metrics"]["claims.not_run"] == done["counts"]["not run"] < len(load_claims())
        assert done["metrics"]["claims.dpformer-beats-transformer"] in (0.0, 0.5, 1.0)
        assert not any(k.startswith("claims.film") for k in done["metrics"])  # not in this chain: not run
    finally:
        shutil.rmtree(done["folder"], ignore_errors=True)


def test_contexts_in_numeric_order_whatever_the_run_order(home: Path) -> None:
    record_grid({("dpformer", 10.0): [1.0], ("transformer", 10.0): [1.0]})  # recorded first
    record_grid(
        {("dpformer", 5.0): [1.0], ("transformer", 5.0): [1.0], ("dpformer", 8.0): [1.0], ("transformer", 8.0): [1.0]}
    )
    measure = {**BEATS, "require": {"epsilon": [5, 8, 10]}}
    result = sc.evaluate_claim(None, claim_of(measure, ABOVE))
    assert [c.context for c in result.contexts] == ["ε=5", "ε=8", "ε=10"]


def test_large_vocabulary_clipping_claims_read_the_bench_settings(home: Path) -> None:
    """The dp-clipping claims of the large-vocabulary setting read ``settings.large_vocab.ratios.*`` of the bench's
    runs at M = 50,257 only (a quick run, another M, is not measured); the timing ratios are judged per device on
    the run's own interval (``ratio_intervals``), the batch ratios on every run."""
    ids = {
        "phantom-faster-than-ghost-clipping-large-vocab",
        "phantom-max-batch-over-ghost-clipping-large-vocab",
        "phantom-not-slower-than-opacus-large-vocab",
        "phantom-max-batch-not-below-opacus-large-vocab",
    }
    claims = {c.id: c for c in load_claims() if c.id in ids}
    assert set(claims) == ids
    key = "settings.large_vocab."

    def bench(items: float, ratios: dict[str, float], device: str = "H100") -> None:
        metrics = {f"{key}setting.items": items} | {f"{key}ratios.{k}": v for k, v in ratios.items()}
        for k, v in ratios.items():  # the run's own interval of each ratio: +-5%
            metrics |= {f"{key}ratio_intervals.{k}.lo": 0.95 * v, f"{key}ratio_intervals.{k}.hi": 1.05 * v}
        with record_run(
            flow="bench", stage="bench", technique="dp-clipping", dataset="synthetic", profile="paper",
            config={"setting": {"device_name": device}}, track=False,
        ) as rec:  # fmt: skip
            rec.metrics(metrics)

    good = {
        "ghost_tied_over_phantom_time": 90.0,
        "phantom_over_ghost_tied_max_batch": 40.0,
        "opacus_hooks_over_phantom_time": 1.1,
        "phantom_over_opacus_hooks_max_batch": 1.0,
    }
    bench(4096, {k: 0.5 for k in good})  # the quick setting: not what the claims measure
    assert {sc.evaluate_claim(None, c).verdict for c in claims.values()} == {sc.NOT_RUN}
    bench(50257, good)
    assert {sc.evaluate_claim(None, c).verdict for c in claims.values()} == {sc.REPRODUCED}
    bench(50257, good | {"ghost_tied_over_phantom_time": 3.0}, device="A100")  # another machine: its own verdict
    result = sc.evaluate_claim(None, claims["phantom-faster-than-ghost-clipping-large-vocab"])
    assert result.verdict == sc.NOT_REPRODUCED
    assert [(c.context, c.verdict) for c in result.contexts] == [
        ("setting.device_name=A100", sc.NOT_REPRODUCED),
        ("setting.device_name=H100", sc.REPRODUCED),
    ]
    assert result.reason == "setting.device_name=A100: 3x [2.85x, 3.15x], n=1 lies entirely at or below 4x"


def test_a_reference_report_judges_bench_claims_on_the_paper_bench(home: Path) -> None:
    """The benchmarks have only the quick and paper profiles: a reference report reads the paper bench runs (not the
    quick ones), and says which in its scale column."""
    [claim] = [c for c in load_claims() if c.id == "phantom-norms-exact"]

    def bench(profile: str, err: float) -> None:
        with record_run(
            flow="bench", stage="bench", technique="dp-clipping", dataset="synthetic", profile=profile, config={},
            track=False,
        ) as rec:  # fmt: skip
            rec.metrics({"exactness.phantom_norm_max_rel_err": err})

    assert sc.bench_profile("reference") == "paper" and sc.bench_profile("quick") == "quick"
    bench("quick", 1.0)  # a quick bench run is not what a reference report judges
    assert sc.evaluate_claim(None, claim, profile="reference").verdict == sc.NOT_RUN
    assert sc.evaluate_claim(None, claim, profile="quick").verdict == sc.NOT_REPRODUCED
    bench("paper", 1e-16)
    result = sc.evaluate_claim(None, claim, profile="reference")
    assert result.verdict == sc.REPRODUCED
    assert sc.claims_table([result], "reference")["scale"].iloc[0].startswith("bench paper profile")


def test_the_report_lists_the_bench_runs_with_their_device_and_top_level_ratios(home: Path, tmp_path: Path) -> None:
    from tasks.report import render_report

    with record_run(
        flow="bench", stage="bench", technique="mpc-generation", dataset=None, profile="paper", config={},
        track=False,
    ) as rec:  # fmt: skip
        rec.metrics(
            {"ratios.merge_speedup_over_vanilla": 2.5464, "lengths.L128.ratios.merge_speedup_over_vanilla": 9.0}
        )
    from storage.bench_runs import bench_runs

    runs = bench_runs(profile="paper")
    assert list(runs["benchmark"]) == ["mpc-generation"] and runs["ratios"].iloc[0] == {
        "merge_speedup_over_vanilla": 2.5464
    }  # the nested (projected) ratios are the claims' business
    assert bench_runs(profile="quick").empty
    text = render_report(tmp_path / "paper.md", profile="paper", figures=False).path.read_text()
    assert "## Benchmark runs" in text and f"| mpc-generation | `{rec.run_id}` |" in text
    assert "merge_speedup_over_vanilla 2.55 |" in text
    assert "## Benchmark runs" not in render_report(tmp_path / "q.md", profile="quick", figures=False).path.read_text()
