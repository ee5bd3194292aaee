"""The utility LM task (``tasks.attacks.utility_lm``) at the compact and at GPT-2's whole vocabulary: each run records
the vocabulary it trained at in its config (``utility.lm_vocab``) and in ``vocab_size``, embedding parameter counts
equal to a hand count of the tiny model, and the claims machinery tells the two settings apart (a claim with
``where: {config.utility.lm_vocab: full}`` reads the whole-vocabulary runs only, where SEB_co has fewer embedding
parameters than the subword table; at the compact vocabulary it has more)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from core.attacks.vocab import GPT2_VOCAB
from core.errors import ConfigError
from pbconfig.attacks import AttacksConfig
from pbconfig.claims import Claim
from pbconfig.data import TextDatasetSpec
from storage.claims import evaluate_claim
from storage.recording import record_run
from storage.repository import ResultsRepository
from tasks.attacks import utility_lm
from tasks.prepare_texts import prepare_text_dataset
from tests.flows.test_attacks_flow import WORDS

D, N_BYTES, BYTE_VOCAB, HIDDEN = 16, 4, 256, 16
CFG = AttacksConfig(
    seb={"n_bytes": N_BYTES, "byte_vocab": BYTE_VOCAB, "byte_dim": 8, "hidden": HIDDEN},
    utility={
        "embeddings": ["subword", "seb_co"],
        "lm_datasets": ["lines"],
        "lm_shape": {"n_layer": 1, "n_embd": D, "n_head": 2},
        "lm_max_len": 16,
        "lm_steps": 2,
        "lm_eval_every": 1,
        "lm_patience": 1,
        "lm_batch_size": 4,
        "translation": None,
    },
)
SEB_CO_BY_HAND = N_BYTES * BYTE_VOCAB * HIDDEN + HIDDEN + HIDDEN * D + D  # w1, b1, fc2: 16,672 at any vocabulary


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    """The task sets the worker's thread count (``threads_per_worker``: 1); restored afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _parent(flow: str, stage: str) -> Any:
    with record_run(flow=flow, stage=stage, technique="flow", config={}, track=False) as parent:
        pass
    return parent.ref


@pytest.fixture
def lines(home: Path, tmp_path: Path) -> str:
    """A prepared text dataset of 60 short English sentences; its folder."""
    sentences = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5)).capitalize() + "." for i in range(60)]
    source = tmp_path / "lines.txt"
    source.write_text("\n".join(f"{s} {i}" for i, s in enumerate(sentences)) + "\n", encoding="utf-8")
    spec = TextDatasetSpec(name="lines", source="text-file", path=str(source), n_test=10)
    return prepare_text_dataset.fn(spec, _parent("prepare", "data")).path


def _params_claim(vocab: str) -> Claim:
    """seb-no-more-embedding-parameters restricted to one vocabulary setting (the form a new claim would take)."""
    return Claim.model_validate(
        {
            "id": f"test-params-{vocab}",
            "paper": "SEB",
            "stage": "attacks",
            "source": "Table 6",
            "statement": "SEB needs no more embedding parameters than subword embeddings",
            "paper_value": "10.5M vs 13.7M parameters",
            "registered": {"commit": "911a767", "date": "2026-11-24"},
            "measure": {
                "source": "metrics",
                "stage": "attacks",
                "techniques": ["seb-lm-subword", "seb-lm-seb_co"],
                "where": {"config.utility.lm_vocab": vocab},
                "value": "embedding_params",
                "a": {"method": "seb-lm-seb_co"},
                "b": {"method": "seb-lm-subword"},
                "per": ["dataset"],
                "stat": "ratio",
                "unit": "x",
            },
            "rule": {"kind": "all_at_most", "bound": 1.0},
        }
    )


def test_utility_lm_records_its_vocabulary_and_the_claims_tell_the_two_apart(lines: str) -> None:
    parent = _parent("attacks", "attacks")
    got = {
        (vocab, embedding): utility_lm.fn("lines", embedding, CFG, lines, parent, vocab=vocab)
        for vocab in ("compact", "full")
        for embedding in ("subword", "seb_co")
    }
    compact = got["compact", "subword"]["vocab_size"]
    assert 20 < compact < 100  # the sentences' subwords, EOS and <unk>
    for (vocab, embedding), r in got.items():
        size = compact if vocab == "compact" else GPT2_VOCAB
        by_hand = size * D if embedding == "subword" else SEB_CO_BY_HAND
        assert r["lm_vocab"] == vocab and r["vocab_size"] == size
        assert r["embedding_params"] == r["input_embedding_params"] == by_hand
        assert r["output_head_params"] == 0  # both arms tie the output layer to the input embedding
        full_by_hand = GPT2_VOCAB * D if embedding == "subword" else SEB_CO_BY_HAND
        assert r["embedding_params_full_vocab"] == full_by_hand
        assert r["perplexity"] > 1 and r["best_step"] in (1.0, 2.0)
        assert (r["test_unk_rate"] == 0.0) == (vocab == "full")  # compact folds unseen test subwords into <unk>
    assert got["compact", "subword"]["params"] < got["full", "subword"]["params"]

    _, rows = ResultsRepository().query("select technique, config_json from runs where technique like 'seb-lm-%'")
    assert sorted((t, json.loads(c)["utility"]["lm_vocab"]) for t, c in rows) == [
        (f"seb-lm-{e}", v) for e in ("seb_co", "subword") for v in ("compact", "full")
    ]
    at_full, at_compact = evaluate_claim(None, _params_claim("full")), evaluate_claim(None, _params_claim("compact"))
    assert len(at_full.run_ids) == len(at_compact.run_ids) == 2 and not set(at_full.run_ids) & set(at_compact.run_ids)
    assert at_full.verdict == "reproduced" and at_full.contexts[0].estimate == pytest.approx(
        SEB_CO_BY_HAND / (GPT2_VOCAB * D)
    )
    assert at_compact.verdict == "not reproduced" and at_compact.contexts[0].estimate > 1


def test_utility_lm_refuses_an_unknown_vocabulary_before_recording(lines: str) -> None:
    parent = _parent("attacks", "attacks")
    with pytest.raises(ConfigError, match=r"vocab='whole' is unknown.*'compact', 'full'"):
        utility_lm.fn("lines", "subword", CFG, lines, parent, vocab="whole")
    _, rows = ResultsRepository().query("select count(*) from runs where technique like 'seb-lm-%'")
    assert rows == [(0,)]


def test_matched_seb_takes_the_subword_tables_size_and_the_report_shows_both(lines: str) -> None:
    """``matched``: SEB_co's FFN is the widest whose module fits in the subword table of the same vocabulary (here
    GPT-2's whole one, where that is wider than ``seb.hidden``); the run is its own technique, the view and the report
    show its size beside the subword arm's; where the byte layer alone exceeds the table (8 bytes at the compact
    vocabulary), the run fails with that said."""
    from storage import views
    from tasks.report_tables import seb_utility_section

    parent = _parent("attacks", "attacks")
    sub = utility_lm.fn("lines", "subword", CFG, lines, parent, vocab="full")
    got = utility_lm.fn("lines", "seb_co", CFG, lines, parent, vocab="full", matched=True)
    h = got["seb_hidden"]

    def by_hand(width: int) -> int:
        return N_BYTES * BYTE_VOCAB * width + width + width * D + D

    assert got["subword_embedding_params"] == sub["embedding_params"] == GPT2_VOCAB * D
    assert got["embedding_params"] == by_hand(h) <= GPT2_VOCAB * D < by_hand(h + 1)
    assert h > HIDDEN and got["matched"] and got["perplexity"] > 1

    table = views.seb_utility()
    assert table.set_index("method")["matched"].to_dict() == {"seb-lm-seb_co-matched": True, "seb-lm-subword": False}
    row = table[table["method"] == "seb-lm-seb_co-matched"].iloc[0]
    assert (row["seb_hidden"], row["lm_vocab"], row["embedding_params"]) == (h, "full", by_hand(h))
    section = "\n".join(seb_utility_section(table))
    assert f"| lines | full | seb-lm-seb_co-matched | 1 | {got['perplexity']:.2f} | {by_hand(h):,} | {h:,} |" in section
    assert f"| lines | full | seb-lm-subword | 1 | {sub['perplexity']:.2f} | {GPT2_VOCAB * D:,} | - |" in section

    wide = CFG.model_copy(update={"seb": CFG.seb.model_copy(update={"n_bytes": 8})})  # 2,048 one-hot rows
    with pytest.raises(ConfigError, match="more than the budget"):  # the compact table: under 100 x 16
        utility_lm.fn("lines", "seb_co", wide, lines, parent, vocab="compact", matched=True)
    _, rows = ResultsRepository().query("select status, error from runs where technique = 'seb-lm-seb_co-matched'")
    assert sorted(r[0] for r in rows) == ["failed", "finished"]
    assert "more than the budget" in next(e for s, e in rows if s == "failed")
    with pytest.raises(ConfigError, match="embedding='subword' is not SEB"):
        utility_lm.fn("lines", "subword", CFG, lines, parent, matched=True)


def test_the_plan_trains_each_matched_variant_beside_its_arms() -> None:
    from tasks.attacks import LMJob, plan

    cfg = CFG.model_copy(update={"utility": CFG.utility.model_copy(update={"matched": ("seb_co",), "seeds": (0, 1)})})
    lm = [j for j in plan(cfg) if isinstance(j, LMJob)]
    assert sorted(j.technique for j in lm) == sorted(
        [f"seb-lm-{e}" for e in ("subword", "seb_co") for _ in (0, 1)] + ["seb-lm-seb_co-matched"] * 2
    )
    with pytest.raises(ValueError, match="subword"):
        AttacksConfig.model_validate({"utility": {"matched": ["subword"]}})
    with pytest.raises(ValueError, match=r"utility.matched=\['seb_co', 'seb_co'\] names a variant twice"):
        AttacksConfig.model_validate({"utility": {"matched": ["seb_co", "seb_co"]}})
