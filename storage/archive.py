"""The results store as files, and back: ``privbench results export`` writes every table a report reads, one file per
table plus ``manifest.json``; ``privbench results restore`` loads such an export into an empty store, and
``privbench report --from DIR`` renders a report from one (through a temporary SQLite store).

An export is deterministic: rows in primary-key order, columns in the schema's order, gzip without a timestamp,
floats written exactly (the shortest text that reads back as the same double), times in UTC, so exporting the same
store twice gives the same bytes and export -> restore -> export gives the same files. CSV files are
``<table>.csv.gz``: an empty field is NULL; a text value that is empty or starts with a backslash is written with
one more backslash in front (``\\`` is the empty string). Parquet files (``--format parquet``, needs pyarrow) are
``<table>.parquet`` with typed columns. ``manifest.json`` names the schema revision, the selection, the profiles
and commits of the exported runs, and each file's columns, row count and sha256; a restore checks all of them.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Column, Connection, DateTime, Float, Integer, Table, func, select, text
from sqlalchemy.exc import DBAPIError

from core.errors import StoreError
from pbconfig.settings import get_settings
from storage.db import dispose_engine, get_engine, redact, schema_revisions
from storage.models import Base, Run

MANIFEST = "manifest.json"
FORMAT = "privbench-store-export"
VERSION = 1
FORMATS = ("csv", "parquet")
SUFFIX = {"csv": ".csv.gz", "parquet": ".parquet"}
TABLES = tuple(t.name for t in Base.metadata.sorted_tables)  # parents first: runs, then what hangs off them
PAPER = "paper"  # every report says whether this profile's stages ran


@dataclass(frozen=True)
class Exported:
    """What :func:`export_store` wrote: the files (the manifest last) and the manifest itself."""

    files: list[Path]
    manifest: dict[str, Any]


def export_store(
    out_dir: Path,
    fmt: Literal["csv", "parquet"] = "csv",
    *,
    db_url: str | None = None,
    profile: str | None = None,
) -> Exported:
    """Write every table of the store at ``db_url`` (default the configured one) to ``out_dir`` as ``fmt``, with
    ``manifest.json``. With ``profile``, only what the report of that profile reads (:func:`profile_runs`) and the
    rows hanging off those runs. Files of an earlier export in ``out_dir`` that this one does not write are
    removed (the folder holds one export)."""
    if fmt not in FORMATS:
        raise StoreError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    url = db_url or get_settings().db_url
    engine = get_engine(url)
    revision, _known = schema_revisions(url)
    with engine.connect() as conn:
        keep = None if profile is None else profile_runs(conn, profile)
        if profile is not None and not conn.execute(select(Run.id).where(Run.profile == profile).limit(1)).first():
            known = conn.scalars(select(Run.profile).where(Run.profile.is_not(None)).distinct()).all()
            raise StoreError(
                f"no run of profile {profile!r} in the store; its profiles: {', '.join(sorted(known)) or 'none'}"
            )
        tables = {name: _rows(conn, Base.metadata.tables[name], keep) for name in TABLES}
    tables = {name: _without_home(rows, get_settings().home) for name, rows in tables.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    entries: dict[str, Any] = {}
    for name, rows in tables.items():
        table = Base.metadata.tables[name]
        path = out_dir / f"{name}{SUFFIX[fmt]}"
        (_write_csv if fmt == "csv" else _write_parquet)(path, table, rows)
        written.append(path)
        entries[name] = {
            "file": path.name,
            "rows": len(rows),
            "columns": [c.name for c in table.columns],
            "sha256": _sha256(path),
        }
    runs = tables["runs"]
    cols = [c.name for c in Base.metadata.tables["runs"].columns]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "file_format": fmt,
        "schema_revision": revision,
        "selection": {"profile": profile},
        # what stands for the measuring machine's folders in paths (prepared data, configs, shipped data)
        "placeholders": {"home": HOME, "checkout": CHECKOUT},
        "profiles": sorted({r[cols.index("profile")] for r in runs if r[cols.index("profile")] is not None}),
        "commits": sorted({r[cols.index("git_commit")] for r in runs if r[cols.index("git_commit")] is not None}),
        "tables": entries,
    }
    for name in TABLES:  # an earlier export's files in the other format would contradict the manifest
        for suffix in SUFFIX.values():
            stale = out_dir / f"{name}{suffix}"
            if stale not in written and stale.exists():
                stale.unlink()
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return Exported([*written, path], manifest)


def profile_runs(conn: Connection, profile: str) -> set[str]:
    """The ids of the runs the report of ``profile`` reads: the runs of ``profile`` and every run under them, the
    benchmark runs of its bench profile (a profile the benchmarks do not have reads the ``paper`` ones), the runs
    of every claim's ``measure.b_source`` (a peer's, of its own profile), the paper profile's stage flow runs (the
    report says whether it ran); and the ancestors of all of these."""
    from pbconfig.claims import load_claims
    from storage.claims import bench_profile
    from storage.stage_runs import STAGE_FLOWS

    runs = [
        tuple(r) for r in conn.execute(select(Run.id, Run.parent_id, Run.profile, Run.flow, Run.stage, Run.technique))
    ]
    children: dict[str, list[str]] = {}
    for run_id, parent, *_ in runs:
        if parent is not None:
            children.setdefault(parent, []).append(run_id)
    bench = bench_profile(profile)
    peers = [c.measure.b_source for c in load_claims() if c.measure.b_source is not None]

    def read(prof: str | None, flow: str, stage: str, technique: str) -> bool:
        own = prof == profile or (flow == "bench" and prof == bench)
        paper_stage = prof == PAPER and technique == "flow" and flow in STAGE_FLOWS
        return own or paper_stage or any(_peer_reads(peer, prof, stage, technique) for peer in peers)

    chosen = {run_id for run_id, _parent, *rest in runs if read(*rest)}
    todo = [run_id for run_id, _parent, prof, *_ in runs if prof == profile]
    while todo:  # every run under a run of the profile
        for child in children.get(todo.pop(), []):
            if child not in chosen:
                chosen.add(child)
                todo.append(child)
    parent_of = {run_id: parent for run_id, parent, *_ in runs}
    for run_id in list(chosen):  # and every run above a chosen one
        parent = parent_of.get(run_id)
        while parent is not None and parent not in chosen:
            chosen.add(parent)
            parent = parent_of.get(parent)
    return chosen


def _peer_reads(peer: Any, prof: str | None, stage: str, technique: str) -> bool:
    """Whether the claim side ``peer`` (a ``measure.b_source``) reads a run of this profile, stage and technique."""
    if peer.profile is not None and prof != peer.profile:
        return False
    return peer.source != "metrics" or (stage == peer.stage and (not peer.techniques or technique in peer.techniques))


def read_manifest(src: Path) -> dict[str, Any]:
    """The manifest of the export in ``src``; StoreError naming what is wrong when ``src`` is not one."""
    path = src / MANIFEST
    if not path.is_file():
        raise StoreError(
            f"{src} is not a results-store export (no {MANIFEST} in it); give a folder written by "
            "`privbench results export --out DIR`"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StoreError(f"cannot read {path}: {exc}; export the store again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path} is not the manifest of a results-store export (format is not {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise StoreError(
            f"{path} is an export of version {manifest.get('version')!r}; this privbench reads version {VERSION}: "
            "use the privbench that wrote it (its commits are in the manifest)"
        )
    return manifest


def restore_store(src: Path, db_url: str | None = None) -> dict[str, int]:
    """Load the export in ``src`` into the empty store at ``db_url`` (default the configured one), all or nothing;
    returns the rows loaded per table. StoreError when the store is not empty, or the export does not match its
    manifest (a file missing, edited or truncated) or holds columns this schema does not have."""
    url = db_url or get_settings().db_url
    manifest = read_manifest(src)
    engine = get_engine(url)
    _revision, known = schema_revisions(url)
    theirs = manifest.get("schema_revision") or []
    unknown = [r for r in theirs if r not in known]
    if unknown:
        raise StoreError(
            f"the export in {src} has schema revision {', '.join(theirs)}, newer than this privbench's "
            f"({known[-1]}); restore it with the privbench that wrote it or a newer one"
        )
    entries = manifest.get("tables") or {}
    missing = [t for t in TABLES if t not in entries]
    if missing:
        raise StoreError(f"the export in {src} has no table {', '.join(missing)}; export the store again")
    loaded = {name: _read(src, Base.metadata.tables[name], entries[name], manifest["file_format"]) for name in TABLES}
    with engine.connect() as conn:
        counts = {
            name: conn.execute(select(func.count()).select_from(Base.metadata.tables[name])).scalar_one()
            for name in TABLES
        }
    if any(counts.values()):
        held = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
        raise StoreError(
            f"the results store {redact(url)} is not empty ({held}); restore into an empty store: pass "
            "--db sqlite:///PATH/results.db with a new file, or set PRIVBENCH_HOME to an empty folder"
        )
    try:
        with engine.begin() as conn:
            for name in TABLES:
                columns, rows = loaded[name]
                if name == "runs":
                    rows = _parents_first(columns, rows)
                if rows:
                    conn.execute(
                        Base.metadata.tables[name].insert(), [dict(zip(columns, r, strict=True)) for r in rows]
                    )
            if engine.dialect.name == "postgresql":  # ids were given: move each id sequence past them
                for name in TABLES:
                    table = Base.metadata.tables[name]
                    pk = list(table.primary_key.columns)
                    if len(pk) == 1 and isinstance(pk[0].type, Integer) and pk[0].autoincrement:
                        conn.execute(
                            text(
                                f"SELECT setval(pg_get_serial_sequence('{name}', '{pk[0].name}'), "
                                f"COALESCE((SELECT MAX({pk[0].name}) FROM {name}), 0) + 1, false)"
                            )
                        )
    except DBAPIError as exc:
        raise StoreError(f"cannot restore {src} into the results store {redact(url)}: {exc.orig}") from None
    return {name: len(loaded[name][1]) for name in TABLES}


@contextmanager
def restored(src: Path) -> Iterator[str]:
    """The URL of a temporary SQLite store holding the export in ``src``, deleted after the block."""
    folder = Path(tempfile.mkdtemp(prefix="privbench-restored-"))
    url = f"sqlite:///{folder / 'results.db'}"
    try:
        restore_store(src, url)
        yield url
    finally:
        dispose_engine(url)
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ rows


HOME = "$PRIVBENCH_HOME"
CHECKOUT = "$PRIVBENCH_CHECKOUT"
_CHECKOUT_DIR = Path(__file__).resolve().parent.parent


def _without_home(rows: list[tuple[Any, ...]], home: Path) -> list[tuple[Any, ...]]:
    """The rows with the measuring machine's folders in text values written as placeholders: its
    ``PRIVBENCH_HOME`` as ``$PRIVBENCH_HOME`` (a prepared dataset's path, a config that names one) and the privbench
    checkout as ``$PRIVBENCH_CHECKOUT`` (data shipped in its virtual environment): an export is the same wherever the
    runs were measured, and names no folder of that machine."""
    # the longer path first: the home may sit inside the checkout (the default .privbench)
    swaps = sorted(((str(home), HOME), (str(_CHECKOUT_DIR), CHECKOUT)), key=lambda p: -len(p[0]))

    def plain(value: Any) -> Any:
        if isinstance(value, str):
            for path, placeholder in swaps:
                value = value.replace(path, placeholder)
        return value

    return [tuple(plain(v) for v in row) for row in rows]


def _rows(conn: Connection, table: Table, keep: set[str] | None) -> list[tuple[Any, ...]]:
    """Every row of ``table`` (of the runs in ``keep`` when given) as plain values, in primary-key order (sorted
    here: the databases' collations differ)."""
    rows = [tuple(_plain(c, v) for c, v in zip(table.columns, r, strict=True)) for r in conn.execute(select(table))]
    if keep is not None:
        index = [c.name for c in table.columns].index("id" if table.name == "runs" else "run_id")
        rows = [r for r in rows if r[index] in keep]
    pk = [i for i, c in enumerate(table.columns) if c.primary_key]
    return sorted(rows, key=lambda r: tuple(r[i] for i in pk))


def _plain(column: Column[Any], value: Any) -> Any:
    if value is None:
        return None
    if isinstance(column.type, DateTime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).astimezone(UTC)  # SQLite: naive, in UTC
    if isinstance(column.type, Float):
        return float(value)
    if isinstance(column.type, Integer):
        return int(value)
    return str(value)


def _parents_first(columns: list[str], rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The runs ordered so that each run's parent comes before it (the foreign key is checked on insert)."""
    i, p = columns.index("id"), columns.index("parent_id")
    ids = {r[i] for r in rows}
    orphans = [r for r in rows if r[p] is not None and r[p] not in ids]
    if orphans:
        raise StoreError(
            f"the export's run {orphans[0][i]} has parent {orphans[0][p]}, which is not in the export; export "
            "the store again (an export holds every run above the runs it selects)"
        )
    placed: set[Any] = set()
    out: list[tuple[Any, ...]] = []
    pending = rows
    while pending:
        later = [r for r in pending if r[p] is not None and r[p] not in placed]
        ready = [r for r in pending if r[p] is None or r[p] in placed]
        if not ready:
            raise StoreError(f"the export's runs {sorted(r[i] for r in later)[:3]} are their own ancestors")
        out += ready
        placed.update(r[i] for r in ready)
        pending = later
    return out


# ------------------------------------------------------------------------------------------------ CSV


def _encode(column: Column[Any], value: Any) -> str:
    if value is None:
        return ""
    if isinstance(column.type, DateTime):
        return value.isoformat()
    if isinstance(column.type, Float):
        return repr(value)  # the shortest text that reads back as the same double (also nan, inf)
    if isinstance(column.type, Integer):
        return str(value)
    return "\\" + value if value == "" or value.startswith("\\") else value


def _decode(column: Column[Any], field: str) -> Any:
    if field == "":
        return None
    if isinstance(column.type, DateTime):
        moment = datetime.fromisoformat(field)
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).astimezone(UTC)
    if isinstance(column.type, Float):
        return float(field)
    if isinstance(column.type, Integer):
        return int(field)
    return field.removeprefix("\\")


def _write_csv(path: Path, table: Table, rows: Sequence[tuple[Any, ...]]) -> None:
    columns = list(table.columns)
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as zipped,
        io.TextIOWrapper(zipped, encoding="utf-8", newline="") as out,
    ):
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([c.name for c in columns])
        for row in rows:
            writer.writerow([_encode(c, v) for c, v in zip(columns, row, strict=True)])


def _read_csv(path: Path, table: Table) -> tuple[list[str], list[tuple[Any, ...]]]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise StoreError(f"{path} is empty (not even a header row); export the store again")
        columns = _known_columns(path, table, header)
        typed = [table.c[name] for name in columns]
        rows = []
        for line, fields in enumerate(reader, start=2):
            if len(fields) != len(columns):
                raise StoreError(f"{path} line {line}: {len(fields)} fields, the header names {len(columns)}")
            try:
                rows.append(tuple(_decode(c, f) for c, f in zip(typed, fields, strict=True)))
            except ValueError as exc:
                raise StoreError(f"{path} line {line}: {exc}") from None
        return columns, rows


# ------------------------------------------------------------------------------------------------ Parquet


def _arrow_type(column: Column[Any]) -> Any:
    import pyarrow as pa

    if isinstance(column.type, DateTime):
        return pa.timestamp("us", tz="UTC")
    if isinstance(column.type, Float):
        return pa.float64()
    if isinstance(column.type, Integer):
        return pa.int64()
    return pa.string()


def _write_parquet(path: Path, table: Table, rows: Sequence[tuple[Any, ...]]) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise StoreError("--format parquet needs pyarrow (pip install pyarrow); or use --format csv") from None
    columns = list(table.columns)
    schema = pa.schema([pa.field(c.name, _arrow_type(c)) for c in columns])
    arrays = [pa.array([r[i] for r in rows], type=schema.field(i).type) for i in range(len(columns))]
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path, compression="zstd")


def _read_parquet(path: Path, table: Table) -> tuple[list[str], list[tuple[Any, ...]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise StoreError(f"reading {path} needs pyarrow (pip install pyarrow)") from None
    data = pq.read_table(path)
    columns = _known_columns(path, table, data.column_names)
    values = [data.column(name).to_pylist() for name in columns]
    typed = [table.c[name] for name in columns]
    rows = [tuple(_plain(c, v) for c, v in zip(typed, r, strict=True)) for r in zip(*values, strict=True)]
    return columns, rows


# ------------------------------------------------------------------------------------------------ checks


def _read(src: Path, table: Table, entry: dict[str, Any], fmt: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """One table's rows from its file, checked against the manifest's entry (sha256, columns, row count)."""
    path = src / str(entry.get("file"))
    if not path.is_file():
        raise StoreError(f"the export in {src} lists {path.name} for table {table.name}, which is missing")
    digest = _sha256(path)
    if digest != entry.get("sha256"):
        raise StoreError(
            f"{path} does not match {src / MANIFEST} (sha256 {digest[:12]}..., the manifest says "
            f"{str(entry.get('sha256'))[:12]}...): it changed after the export; export the store again"
        )
    columns, rows = (_read_csv if fmt == "csv" else _read_parquet)(path, table)
    if columns != entry.get("columns") or len(rows) != entry.get("rows"):
        raise StoreError(
            f"{path} holds {len(rows)} rows of columns {columns}; the manifest says {entry.get('rows')} rows of "
            f"{entry.get('columns')}; export the store again"
        )
    return columns, rows


def _known_columns(path: Path, table: Table, header: Sequence[str]) -> list[str]:
    unknown = [h for h in header if h not in table.c]
    if unknown:
        raise StoreError(
            f"{path} has column(s) {', '.join(unknown)} that table {table.name} does not have here; restore it "
            "with the privbench that wrote it (its commits are in the manifest) or a newer one"
        )
    return list(header)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


__all__ = [
    "FORMATS",
    "MANIFEST",
    "TABLES",
    "Exported",
    "export_store",
    "profile_runs",
    "read_manifest",
    "restore_store",
    "restored",
]
