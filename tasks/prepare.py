"""Data-preparation tasks: materialise a dataset's source file, then prepare it once, content-addressed.

A prepared dataset lives in ``<PRIVBENCH_HOME>/data/<name>-<cache key>/`` where the cache key hashes the
dataset spec, the source file's bytes and the preprocessing version: an unchanged dataset is never
prepared twice (a second run finds the manifest and records a cache hit), and a changed file or spec
gets a new folder. Folders are written to a temporary name and renamed into place, so a crash or a
concurrent run never leaves a half-written dataset behind.

Every preparation task (sequential datasets here, images and pretrained models in ``tasks.prepare_images``,
texts in ``tasks.prepare_texts``) keys its folder with :func:`content_key`, writes it with
:func:`write_prepared` and records itself with :func:`record_prepared` (a :class:`Preparation` names its kind).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prefect import task
from pydantic import BaseModel

from core.data.registry import parse_ratings, recbole_ml100k_path
from core.data.sequential import SequentialDataset, build_sequential_dataset
from core.data.synthetic import amazon_games_shaped, ml1m_shaped, write_synthetic
from core.errors import ConfigError, DataError
from core.registry import lookup
from pbconfig.canon import canonical_json
from pbconfig.data import DatasetSpec
from pbconfig.settings import get_settings
from storage.recording import Recorder, RunRef
from storage.repository import ResultsRepository
from tasks.records import retry_transient, task_record

PREP_VERSION = "seqrec-v1"  # bump when preprocessing changes: every cache key changes with it
MANIFEST = "manifest.json"
_PRESETS = {"ml-1m": ml1m_shaped, "amazon-games": amazon_games_shaped}
_SYNTHETIC_FILES = {"ml-1m": "ratings.dat", "amazon-csv": "ratings.csv", "amazon-jsonl": "reviews_5core.json"}


@dataclass(frozen=True)
class SourceRef:
    """A raw ratings file ready to parse."""

    path: str
    format: str
    sha256: str
    origin: str  # "recbole ml-100k wheel", "file", "synthetic <preset> seed <n>"


@dataclass(frozen=True)
class PreparedRef:
    """What later stages receive: where the prepared dataset is and what is in it."""

    name: str
    path: str
    content_hash: str
    cache_key: str
    stats: dict[str, Any]
    cached: bool
    run_id: str | None = None


@dataclass(frozen=True)
class Preparation:
    """A kind of prepared folder: the ``technique`` of its runs, the preparation ``version`` (in its cache key and
    its manifest: bump it when the preparation changes) and the ``kind`` of its ``datasets`` row."""

    technique: str
    version: str
    kind: str


SEQREC_PREP = Preparation(technique="seqrec-prep", version=PREP_VERSION, kind="seqrec")


@task(
    name="materialize-source", retries=2, retry_delay_seconds=1, retry_condition_fn=lambda t, r, s: retry_transient(s)
)
def materialize_source(spec: DatasetSpec) -> SourceRef:
    """Find (recbole, file) or generate once (synthetic) the raw ratings file of ``spec``."""
    if spec.source == "recbole-ml100k":
        path = recbole_ml100k_path()
        return SourceRef(str(path), "recbole-inter", sha256_file(path), "recbole==1.2.1 wheel (MovieLens-100k)")
    if spec.source == "file":
        path = Path(spec.path or "").expanduser()
        if not path.is_file():
            raise DataError(f"dataset {spec.name!r}: file {str(path)!r} does not exist; fix prepare.datasets[].path")
        return SourceRef(str(path.absolute()), str(spec.format), sha256_file(path), "file")
    return _synthetic_source(spec)


@task(name="prepare-dataset", retries=1, retry_delay_seconds=1, retry_condition_fn=lambda t, r, s: retry_transient(s))
def prepare_dataset(spec: DatasetSpec, source: SourceRef, parent: RunRef) -> PreparedRef:
    """Parse, k-core filter, split leave-last-out and save ``spec``'s dataset, recorded as one run."""
    key = cache_key(spec, source)
    out_dir = prepared_dir(spec.name, key)

    def build(rec: Recorder) -> dict[str, Any]:
        manifest, timings = _build(spec, source, key, out_dir)
        rec.metrics(timings, units={k: "s" for k in timings})
        return manifest

    return record_prepared(
        spec, SEQREC_PREP, parent=parent, key=key, out_dir=out_dir, build=build, source=source.origin
    )


def cache_key(spec: DatasetSpec, source: SourceRef) -> str:
    """sha256 of the spec (its name excluded: renaming does not change content), source bytes, prep version."""
    return content_key(PREP_VERSION, spec, source.format, source.sha256, blank=("name",))


def content_key(version: str, spec: BaseModel, *sources: str, blank: tuple[str, ...] = ("name", "path")) -> str:
    """The cache key of a prepared folder: sha256 of the preparation ``version``, the spec with its ``blank``
    fields blanked (the name: renaming changes no content; the path: the source's bytes are hashed instead) and
    the ``sources`` (hashes of the source bytes, formats), ``|``-separated."""
    blanked = {f: ("_" if f == "name" else None) for f in blank}
    spec_json = canonical_json(spec.model_copy(update=blanked))
    return hashlib.sha256("|".join((version, spec_json, *sources)).encode()).hexdigest()


def prepared_dir(name: str, key: str) -> Path:
    """Where the prepared folder of dataset ``name`` with cache ``key`` lives (under the data directory)."""
    return get_settings().data_dir / f"{name}-{key[:16]}"


def timed(write: Callable[[], dict[str, Any]]) -> Callable[[Recorder], dict[str, Any]]:
    """A ``build`` for :func:`record_prepared` that calls ``write()`` and records its wall time as ``prepare_s``."""

    def build(rec: Recorder) -> dict[str, Any]:
        t0 = time.perf_counter()
        manifest = write()
        rec.metric("prepare_s", time.perf_counter() - t0, unit="s")
        return manifest

    return build


def prepare_keyed(
    spec: BaseModel, prep: Preparation, parent: RunRef, source_hash: str, write: Callable[[str, Path], dict[str, Any]]
) -> PreparedRef:
    """:func:`record_prepared` of ``spec``'s folder in the data directory (:func:`prepared_dir`), keyed by
    :func:`content_key` of ``prep.version``, the spec and ``source_hash``; ``write(key, out_dir)`` builds it and
    returns its manifest, timed (:func:`timed`)."""
    key = content_key(prep.version, spec, source_hash)
    out_dir = prepared_dir(spec.name, key)  # type: ignore[attr-defined]
    return record_prepared(
        spec, prep, parent=parent, key=key, out_dir=out_dir, build=timed(lambda: write(key, out_dir))
    )


def record_prepared(
    spec: BaseModel,
    prep: Preparation,
    *,
    parent: RunRef,
    key: str,
    out_dir: Path,
    build: Callable[[Recorder], dict[str, Any]],
    source: str | None = None,
    metric_keys: Sequence[str] | None = None,
) -> PreparedRef:
    """Prepare ``spec`` (a config with a ``name``) into ``out_dir`` once per content, recorded as one run.

    The run (``prep.technique``, a child of ``parent``) finds a complete folder of ``prep.version`` (a cache
    hit) or calls ``build(rec)``, which writes the folder (:func:`write_prepared`) and returns its manifest
    (``content_hash``, ``stats``, ``source``), recording its own timings on ``rec``. Either way the run records
    the numeric ``stats`` (or only ``metric_keys``), ``cache_hit``, the ``datasets`` row of this (name, key) when
    the store has none yet (``prep.kind``; ``source`` defaults to the manifest's), the content hash tag and the
    manifest artifact. Returns what later stages receive."""
    name = spec.name  # type: ignore[attr-defined]
    with task_record(parent=parent, technique=prep.technique, config=spec, dataset=name) as rec:
        manifest = read_manifest(out_dir, prep.version)
        cached = manifest is not None
        if manifest is None:
            manifest = build(rec)
        stats = manifest["stats"]
        keys = metric_keys if metric_keys is not None else [k for k, v in stats.items() if isinstance(v, int | float)]
        rec.metrics({k: stats[k] for k in keys})
        rec.metric("cache_hit", float(cached))
        if ResultsRepository().find_dataset(name, key) is None:
            rec.dataset(
                name=name,
                content_hash=manifest["content_hash"],
                cache_key=key,
                path=str(out_dir),
                source=manifest["source"] if source is None else source,
                stats=stats,
                kind=prep.kind,
            )
        rec.tag("privbench.dataset_hash", manifest["content_hash"])
        rec.artifact_json("manifest.json", manifest)
    return PreparedRef(name, str(out_dir), manifest["content_hash"], key, stats, cached, rec.run_id)


def read_manifest(out_dir: Path, version: str = PREP_VERSION) -> dict[str, Any] | None:
    """The manifest of a complete prepared folder written by preparation ``version``, or None if there is none
    (or it is unreadable, or from another version)."""
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("prep_version") == version else None


def load_prepared(ref: PreparedRef | str | Path) -> SequentialDataset:
    """Load a prepared dataset (for later stages), checking its content hash against the manifest."""
    path = Path(ref.path if isinstance(ref, PreparedRef) else ref)
    manifest = read_manifest(path)
    if manifest is None:
        raise DataError(f"{path} is not a prepared dataset (no valid {MANIFEST}); run `privbench run prepare`")
    data = SequentialDataset.load(path)
    if data.content_hash() != manifest["content_hash"]:
        raise DataError(
            f"{path}: content hash differs from its manifest (modified on disk?); delete the folder "
            "and run `privbench run prepare` again"
        )
    return data


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- internals


def _build(spec: DatasetSpec, source: SourceRef, key: str, out_dir: Path) -> tuple[dict[str, Any], dict[str, float]]:
    t0 = time.perf_counter()
    interactions = parse_ratings(source.format, source.path)
    t1 = time.perf_counter()
    data = build_sequential_dataset(interactions, k=spec.min_interactions)
    t2 = time.perf_counter()
    manifest = {
        "name": spec.name,
        "prep_version": PREP_VERSION,
        "cache_key": key,
        "content_hash": data.content_hash(),
        "spec": spec.model_dump(mode="json"),
        "source": asdict(source),
        "stats": data.stats(),
        "raw": {
            "n_users": int(interactions.n_users),
            "n_items": int(interactions.n_items),
            "n_interactions": len(interactions),
        },
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    write_prepared(out_dir, manifest, data.save)
    t3 = time.perf_counter()
    written = read_manifest(out_dir)  # a concurrent writer may have won the rename; theirs is identical
    return written or manifest, {"parse_s": t1 - t0, "preprocess_s": t2 - t1, "write_s": t3 - t2}


def _synthetic_source(spec: DatasetSpec) -> SourceRef:
    syn = spec.synthetic
    if syn is None:
        raise ConfigError(f"dataset {spec.name!r}: source 'synthetic' needs a 'synthetic' section")
    shaped = lookup("synthetic preset", _PRESETS, syn.preset)(syn.scale)
    if syn.zipf_a is not None:
        shaped = replace(shaped, zipf_a=syn.zipf_a)
    digest = hashlib.sha256(json.dumps([syn.format, syn.seed, asdict(shaped)], sort_keys=True).encode()).hexdigest()
    folder = get_settings().home / "raw" / f"synthetic-{syn.preset}-{digest[:16]}"
    path = folder / lookup("synthetic format", _SYNTHETIC_FILES, syn.format)
    if not path.is_file():
        write_atomically(folder, lambda tmp: write_synthetic(tmp / path.name, shaped, fmt=syn.format, seed=syn.seed))
    return SourceRef(str(path), syn.format, sha256_file(path), f"synthetic {syn.preset} x{syn.scale} seed {syn.seed}")


def write_prepared(out_dir: Path, manifest: dict[str, Any], write: Callable[[Path], object]) -> None:
    """Write a prepared folder atomically (:func:`write_atomically`): ``write(tmp)`` fills it, then its manifest is
    written, last: a folder with a manifest is complete."""

    def fill(tmp: Path) -> None:
        write(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    write_atomically(out_dir, fill)


def write_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """Fill a temporary sibling folder with ``write(tmp)`` and rename it to ``target`` (first writer wins)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # target exists: another run finished first
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
