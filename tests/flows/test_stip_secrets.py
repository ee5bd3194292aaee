"""The STIP secrets are not in the records (issue 19): two runs of one config draw different permutations, and
nothing the results store, MLflow or PRIVBENCH_HOME holds about the runs contains a permutation or regenerates it.

The permutations drawn in this process (the in-process protocol repeats and every attack's target; P1 of the
three-process run draws in its own process through the same function) are captured by wrapping
``core.stip.keys.secure_permutation``, so the test sees the real secrets without the flow recording them."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import torch
from sqlalchemy import inspect, text

from core.stip import keys as K
from core.stip.transform import random_permutation
from flows.stip import stip_flow
from storage.repository import ResultsRepository
from tests.flows import test_stip_flow as base

pytestmark = pytest.mark.usefixtures("prefect_harness")

WINDOW = 8  # entries of a permutation searched for: a written prefix or suffix of this length counts as a leak
SEED_OFFSETS = range(4)  # seed, seed + 1, ... (the old scheme derived pi, rho, sigma from seed, seed + 1, seed + 2)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every secret permutation drawn in this process, in order (the real CSPRNG draws, only observed)."""
    real, out = K.secure_permutation, []

    def observe(d: int) -> torch.Tensor:
        out.append(real(d))
        return out[-1]

    monkeypatch.setattr(K, "secure_permutation", observe)
    return out


# ------------------------------------------------------------------------------------------ what is recorded


def _store_text(repo: ResultsRepository) -> str:
    """Every value of every column of every table of the results store, one per line."""
    lines = []
    with repo.engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'select * from "{table}"')):
                lines.extend(str(v) for v in row if v is not None)
    return "\n".join(lines)


def _mlflow_text(repo: ResultsRepository, tmp: Path) -> tuple[str, list[bytes]]:
    """Params, tags and metrics of the runs' MLflow runs, and the bytes of every artifact they logged."""
    from mlflow import MlflowClient

    client, lines, blobs = MlflowClient(), [], []
    _, rows = repo.query("select mlflow_run_id from runs where mlflow_run_id is not null")
    assert rows, "the runs were not tracked in MLflow"

    def walk(run_id: str, path: str | None) -> None:
        for item in client.list_artifacts(run_id, path):
            if item.is_dir:
                walk(run_id, item.path)
            else:
                blobs.append(Path(client.download_artifacts(run_id, item.path, str(tmp))).read_bytes())

    for (run_id,) in rows:
        data = client.get_run(run_id).data
        for mapping in (data.params, data.tags, data.metrics):
            lines.extend(f"{k}={v}" for k, v in mapping.items())
        walk(run_id, None)
    return "\n".join(lines), blobs


def _home_bytes(home: Path) -> list[bytes]:
    """Every file under PRIVBENCH_HOME (the SQLite store's own pages included: BLOB columns, freed pages)."""
    return [p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file()]


# ------------------------------------------------------------------------------------------ leak detectors


def _list_pattern(values: list[int]) -> re.Pattern[str]:
    """``values`` written as a list in any common text form: JSON (compact or indented), comma-, semicolon-,
    space- or newline-separated, a tensor or numpy repr."""
    return re.compile(r"(?<![\d.])" + r"[\s,;]{1,16}".join(str(v) for v in values) + r"(?![\d.])")


def _binary_forms(pi: torch.Tensor) -> list[bytes]:
    head = pi[: 3 * WINDOW].numpy()
    raw = [head.astype("<i8").tobytes(), head.astype("<i4").tobytes(), head.astype(">i8").tobytes()]
    return raw + [base64.b64encode(raw[0][:48]), raw[0][:48].hex().encode()]


def _written(pi: torch.Tensor, texts: list[str], blobs: list[bytes]) -> list[str]:
    """Where ``pi`` (a prefix or suffix of it, or its int64/int32 bytes, base64 or hex) appears."""
    values = pi.tolist()
    patterns = [_list_pattern(values[:WINDOW]), _list_pattern(values[-WINDOW:])]
    found = [f"text {i}" for i, t in enumerate(texts) if any(p.search(t) for p in patterns)]
    forms = _binary_forms(pi)
    found += [f"file {i}" for i, b in enumerate(blobs) if any(f in b for f in forms)]
    found += [f"file {i} as text" for i, b in enumerate(blobs) if any(p.search(b.decode("latin-1")) for p in patterns)]
    return found


def _recorded_ints(texts: list[str]) -> set[int]:
    """Every integer written anywhere (a candidate seed), as torch's manual_seed accepts it."""
    return {int(m) for t in texts for m in re.findall(r"(?<![\d.])\d{1,19}(?![\d])", t) if int(m) < 2**63}


def _regenerable(secrets: list[torch.Tensor], candidates: set[int]) -> list[int]:
    """Indices of ``secrets`` that a recorded integer (plus a small offset) reproduces through
    ``random_permutation``, i.e. ``torch.manual_seed(s); torch.randperm(d)``."""
    sizes = {p.numel() for p in secrets}
    seeds = {s + k for s in candidates for k in SEED_OFFSETS if s + k < 2**63}
    regenerated = {tuple(random_permutation(d, s).tolist()) for d in sizes for s in seeds}
    return [i for i, p in enumerate(secrets) if tuple(p.tolist()) in regenerated]


def test_detectors_catch_the_old_scheme() -> None:
    """The detectors would have failed the seeded secrets: a recorded seed 0 and pi = random_permutation(d, 0)."""
    pi = random_permutation(32, 0)
    assert _regenerable([random_permutation(32, 99), pi], _recorded_ints(['{"prompt_len":4,"seed":0}'])) == [1]
    import json

    for written in (
        json.dumps(pi.tolist()),
        json.dumps(pi.tolist(), indent=2),
        str(pi),
        ",".join(map(str, pi.tolist())),
    ):
        assert _written(pi, [written], []) == ["text 0"], written
    assert _written(pi, [], [b"xx" + pi.numpy().astype("<i8").tobytes()]) == ["file 0"]
    assert _written(pi, [], [base64.b64encode(pi.numpy().astype("<i8").tobytes())]) == ["file 0"]
    assert not _written(random_permutation(32, 1), [json.dumps(pi.tolist())], [])


# ------------------------------------------------------------------------------------------ the flow


def test_two_runs_draw_different_secrets_and_record_none(home: Path, tmp_path: Path, drawn) -> None:
    summaries = []
    counts = []
    for _ in range(2):
        summaries.append(stip_flow(base.TINY, profile="tiny"))
        counts.append(len(drawn))
    first, second = drawn[: counts[0]], drawn[counts[0] :]
    # per run: in-process protocol repeat (pi, rho, + sigma for vocab_perm) and each design's attack targets
    assert len(first) == len(second) >= 2 + 3 + 3
    assert [p.numel() for p in first] == [p.numel() for p in second]
    assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True)), "a rerun reproduced a secret"
    assert len({tuple(p.tolist()) for p in drawn}) == len(drawn)  # no two draws alike, within a run either
    for s in summaries:  # the protocol and the attacks still work on CSPRNG secrets
        assert all(r["tokens_match"] == 1.0 for r in s["protocol"])
        assert next(a for a in s["attacks"] if a["design"] == "user_embed")["metrics"]["checkpoint.pi_recovered"] == 1.0

    repo = ResultsRepository()
    ml_text, artifacts = _mlflow_text(repo, tmp_path / "artifacts")
    assert ml_text.count(f"{K.SECRET_SOURCE_TAG}={K.SECRET_SOURCE}") == 2 * (2 + 2)  # protocol and attack runs
    texts = [_store_text(repo), ml_text]
    blobs = artifacts + _home_bytes(home)
    assert '"seed":0' in texts[0]  # the config seed is recorded (it drives public things only) ...
    for i, pi in enumerate(drawn):
        assert not _written(pi, texts, blobs), f"secret #{i} (size {pi.numel()}) is in the records"
    # ... and neither it nor any other recorded number regenerates a secret (sigma, V = 50,257, is checked
    # against the config seed only: a randperm of that size per recorded number would dominate the test)
    candidates = _recorded_ints(texts)
    assert 0 in candidates and len(candidates) > 10
    small = [p for p in drawn if p.numel() <= 4096]
    assert not _regenerable(small, candidates), "a secret is regenerable from a recorded number"
    assert not _regenerable(drawn, {base.TINY.seed}), "a secret is regenerable from the config seed"
