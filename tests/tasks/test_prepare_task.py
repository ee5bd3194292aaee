"""The prepare task's content addressing: cache keys, atomic folders, tamper detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.errors import DataError
from pbconfig.data import DatasetSpec
from storage.recording import record_run
from tasks.prepare import SourceRef, cache_key, load_prepared, materialize_source, prepare_dataset


def _source(path: Path, text: str) -> SourceRef:
    path.write_text(text, encoding="latin-1")
    spec = DatasetSpec(name="x", source="file", format="ml-1m", path=str(path))
    return materialize_source.fn(spec)


def test_cache_key_follows_content_spec_not_name(tmp_path: Path) -> None:
    a = _source(tmp_path / "a.dat", "1::1::5::1\n")
    b = _source(tmp_path / "b.dat", "1::1::5::1\n")
    c = _source(tmp_path / "c.dat", "1::1::5::2\n")
    spec = DatasetSpec(name="x", source="file", format="ml-1m", path="p")
    assert a.sha256 == b.sha256 != c.sha256
    assert cache_key(spec, a) == cache_key(spec.model_copy(update={"name": "y"}), b)
    assert cache_key(spec, a) != cache_key(spec, c)
    assert cache_key(spec, a) != cache_key(spec.model_copy(update={"min_interactions": 3}), a)


def test_prepared_folder_is_complete_and_tampering_is_detected(home: Path) -> None:
    spec = DatasetSpec(name="ml-100k", source="recbole-ml100k")
    source = materialize_source.fn(spec)
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as parent:
        pass
    ref = prepare_dataset.fn(spec, source, parent.ref)
    folder = Path(ref.path)
    assert json.loads((folder / "manifest.json").read_text())["content_hash"] == ref.content_hash
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert load_prepared(ref).n_users == 943
    again = prepare_dataset.fn(spec, source, parent.ref)
    assert again.cached and again.path == ref.path
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["content_hash"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="content hash differs from its manifest"):
        load_prepared(ref)


def test_unknown_or_missing_sources_are_clear(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        materialize_source.fn(DatasetSpec(name="x", source="file", format="ml-1m", path=str(tmp_path / "no")))
    with pytest.raises(DataError, match="not a prepared dataset"):
        load_prepared(tmp_path)
