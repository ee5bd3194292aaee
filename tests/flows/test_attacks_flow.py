"""The attacks flow on tiny models and small text files: every run is recorded (prior, FILM per victim and batch
size, coverage, utility), attack_results rows carry ROUGE and recall per attacker setting, the report renders,
and a text dataset the profile does not prepare is refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from mlflow.tracking import MlflowClient

from core.attacks.vocab import GPT2_VOCAB
from core.errors import ConfigError
from pbconfig.attacks import AttacksConfig
from pbconfig.benchmark import BenchmarkConfig, validate
from pbconfig.data import PrepareConfig
from pbconfig.settings import get_settings
from storage.repository import ResultsRepository
from tests.core.data.test_text import write_mo

if TYPE_CHECKING:
    from tests.filled_store import StageStore

pytestmark = pytest.mark.usefixtures("prefect_harness")

WORDS = [
    "the",
    "king",
    "of",
    "france",
    "came",
    "to",
    "the",
    "old",
    "castle",
    "with",
    "his",
    "men",
    "and",
    "spoke",
    "of",
    "war",
    "and",
    "love",
]


def _sentences(n: int, seed: int) -> list[str]:
    out = []
    for i in range(n):
        k = 10 + (i * 7 + seed) % 12
        out.append(" ".join(WORDS[(i * 3 + j * (seed + 1)) % len(WORDS)] for j in range(k)).capitalize() + f" {i}.")
    return out


@pytest.fixture
def prepare(tmp_path: Path) -> PrepareConfig:
    return write_texts(tmp_path)


def write_texts(tmp_path: Path) -> PrepareConfig:
    """Two English text files and a German-English gettext catalogue under ``tmp_path``, and their config."""
    (tmp_path / "private.txt").write_text("\n".join(_sentences(80, 1)))
    (tmp_path / "public.txt").write_text("\n".join(_sentences(80, 2)))
    mo_dir = tmp_path / "LC_MESSAGES"
    mo_dir.mkdir()
    write_mo(
        mo_dir / "demo.mo",
        {f"Could not open the file number {i} for reading": f"Datei Nummer {i} nicht lesbar" for i in range(40)},
    )
    return PrepareConfig(
        texts=(
            {"name": "private", "source": "text-file", "path": str(tmp_path / "private.txt"), "n_test": 10},
            {"name": "public", "source": "text-file", "path": str(tmp_path / "public.txt"), "n_test": 10},
            {"name": "de-en", "source": "gettext-de-en", "path": str(mo_dir), "n_test": 8},
        )
    )


TINY = AttacksConfig(
    seb={"n_bytes": 4, "byte_vocab": 256, "byte_dim": 8, "hidden": 16},
    film={
        "private": ["private"],
        "victims": ["subword", "seb_co"],
        "batch_sizes": [1, 2],
        "batches_per_size": {1: 2, 2: 1},
        "relaxed_random": 50,
        "shape": {"n_layer": 1, "n_embd": 16, "n_head": 2},
        "max_tokens": 32,
        "min_tokens": 4,
        "n_clients": 2,
        "warmup_rounds": 1,
        "client_batch_size": 2,
        "beam_width": 2,
        "reorder_passes": 1,
        "reorder_moves": 8,
        "prior": {
            "public": ["public"],
            "shape": {"n_layer": 1, "n_embd": 16, "n_head": 2},
            "max_len": 32,
            "steps": 3,
            "batch_size": 4,
        },
    },
    utility={
        "embeddings": ["subword", "seb_co"],
        "lm_datasets": ["private"],
        "lm_shape": {"n_layer": 1, "n_embd": 16, "n_head": 2},
        "lm_max_len": 16,
        "lm_steps": 2,
        "lm_eval_every": 1,
        "lm_patience": 1,
        "lm_batch_size": 4,
        "translation": "de-en",
        "mt_d_model": 16,
        "mt_layers": 1,
        "mt_heads": 2,
        "mt_ff": 16,
        "mt_max_len": 24,
        "mt_steps": 2,
        "mt_batch_size": 4,
        "mt_eval": 4,
        "seeds": [0, 1],
    },
    workers=1,
)


def test_attacks_flow_records_film_and_utility(
    stage_store: StageStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # attacks_flow(TINY, prepare, ...) with the membership audit below added, run once for the session's tests
    summary = stage_store.summary("attacks")
    stage_store.point_at(monkeypatch)
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished"
    _, rows = repo.query(
        "select a.target, a.setting, a.rouge1, a.rougeL, a.recall from attack_results a "
        "join runs r on r.id = a.run_id where r.stage = 'attacks' and a.attack = 'film'"
    )
    got = {(t, s) for t, s, *_ in rows}
    assert got == {
        ("subword", "subwords,prior=kjv-small,batch=1"),
        ("subword", "subwords,prior=kjv-small,batch=2"),
        *{("seb_co", f"{s},prior=kjv-small,batch={b}") for s in ("bytes", "positional", "relaxed") for b in (1, 2)},
    }
    assert all(0.0 <= r1 <= 1.0 and 0.0 <= rl <= 1.0 and rec == 1.0 for *_, r1, rl, rec in rows)
    assert {(r["victim"], r["batch_size"]) for r in summary["recovery"]} == {
        (v, b) for v in ("subword", "seb_co") for b in (1, 2)
    }
    assert sorted((r["dataset"], r["embedding"], r["seed"]) for r in summary["utility_lm"]) == [
        ("private", e, s) for e in ("seb_co", "subword") for s in (0, 1)
    ]
    assert sorted((r["embedding"], r["seed"]) for r in summary["utility_mt"]) == [
        (e, s) for e in ("seb_co", "subword") for s in (0, 1)
    ]
    assert all(r["seconds"] >= 0 for r in summary["recovery"])
    for r in summary["utility_lm"]:  # trained to a plateau (or the 2-step cap) and counted at the whole vocabulary
        assert r["best_step"] in (1.0, 2.0) and r["val_perplexity"] > 1 and r["plateaued"] in (0.0, 1.0)
        full = GPT2_VOCAB * 16 if r["embedding"] == "subword" else r["embedding_params"]
        assert r["embedding_params_full_vocab"] == full
    assert all(r["perplexity"] > 1 for r in summary["utility_lm"]) and all(
        r["bleu"] >= 0 for r in summary["utility_mt"]
    )
    assert summary["coverage"]["256"]["only"] == summary["coverage"]["256"]["any"] == GPT2_VOCAB  # every byte
    assert "FILM recovery" in summary["markdown"] and "translation" in summary["markdown"]
    _, techniques = repo.query("select technique, status from runs where stage = 'attacks' and technique != 'flow'")
    assert {s for _, s in techniques} == {"finished"}
    assert {
        "film-prior",
        "film-subword",
        "film-seb_co",
        "seb-coverage",
        "seb-lm-subword",
        "seb-lm-seb_co",
        "seb-mt-subword",
        "seb-mt-seb_co",
    } <= {t for t, _ in techniques}
    _, film_runs = repo.query("select mlflow_run_id from runs where technique like 'film-s%'")
    assert len(film_runs) == 4
    for (mlflow_id,) in film_runs:
        # this test's tracking store named (another test may have set mlflow's process-wide URI)
        client = MlflowClient(tracking_uri=get_settings().tracking_uri)
        local = client.download_artifacts(mlflow_id, "recovered.json", str(tmp_path))
        batches = json.loads(Path(local).read_text())["kjv-small"]
        assert batches and all(b["originals"] and b["recovered"] for b in batches)
        assert len({(b["setting"], tuple(b["originals"])) for b in batches}) == len(batches)
        assert {len(batches) / len({b["setting"] for b in batches})} <= {1.0, 2.0}  # 2 batches of 1, 1 of 2
    _, seeds = repo.query("select config_json from runs where technique like 'seb-lm-%'")
    assert sorted(json.loads(c)["seed"] for (c,) in seeds) == [0, 0, 1, 1]  # the claims pair runs by this seed


def test_attacks_need_their_text_prepared(prepare: PrepareConfig) -> None:
    with pytest.raises(ConfigError, match=r"not prepared.*prepare.texts"):
        validate(
            BenchmarkConfig,
            {"prepare": {"texts": [prepare.texts[0].model_dump()]}, "attacks": TINY.model_dump()},
            origin="test",
        )


def test_attacks_flow_audits_private_and_nonprivate_models(
    stage_store: StageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the audit of a DP (epsilon 8) and a non-private transformer on synthetic ML-1M at scale 0.05, 4 shadows,
    # 2 epochs (tests/filled_store.py), run beside FILM in the session's one attacks flow run
    summary = stage_store.summary("attacks")
    stage_store.point_at(monkeypatch)
    repo = ResultsRepository()
    assert repo.get_run(summary["run_id"])["status"] == "finished"
    rows = {(r["dp"], r["attack"]): r for r in summary["audit"]}
    assert set(rows) == {(dp, a) for dp in ("eps=8", "nonprivate") for a in ("loss", "lira_online", "lira_offline")}
    for (dp, _), r in rows.items():
        lo, hi = r["empirical_epsilon_ci"]
        assert 0.0 <= r["auc"] <= 1.0 and 0.0 <= lo <= hi
        if dp == "eps=8":
            assert 7.0 < r["accountant_epsilon"] <= 8.0 and lo <= r["accountant_epsilon"]  # the audit's invariant
    _, runs = repo.query(
        "select r.id from runs r join privacy_ledger p on p.run_id = r.id where r.technique = 'mia-transformer'"
    )  # the DP target: the one with a ledger
    assert len(runs) == 1
    shown = repo.get_run(runs[0][0])
    assert shown["privacy_ledger"] and len(shown["attack_results"]) == 3
    for a in shown["attack_results"]:  # the JSON contract of `privbench results show RUN --json`
        assert {
            "auc",
            "tpr_at_0.1pct_fpr",
            "tpr_at_1pct_fpr",
            "empirical_epsilon",
            "empirical_epsilon_ci",
            "accountant_epsilon",
        } <= set(a)
    assert "Membership-inference audit" in summary["markdown"]
