"""A results store filled by real tiny runs of every stage flow, for the tests of the read side (dashboard views,
SQL examples, the browser test).

``fill_store(base, mp)`` runs, under ``base/.privbench`` (its own SQLite results store, and its own MLflow
SQLite store ``mlflow.db`` with artifacts in ``mlartifacts``, MLflow's default for that home): prepare, train-dp
(non-private + DP transformer, DPFormer, an Opacus peer), tangent (tiny Dinov2 on tiny
IDX images: shards, composition, unlearning, DP regimes), secure-inference (tiny GPT-2 under CrypTen, when
CrypTen is installed), stip, attacks (FILM against subword and SEB, SEB utility, and the membership audit of a
DP and a non-private transformer) and one tiny ``dp-clipping`` bench record. The configs are the flow tests'
tiny ones (``tests/flows``). It needs a Prefect API (the session's ``prefect_harness``) and sets the
environment only while it runs: the caller restores it (``pytest.MonkeyPatch.context()``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from pbconfig.attacks import AttacksConfig
from pbconfig.benchmark import BenchmarkConfig, validate


@dataclass(frozen=True)
class FilledStore:
    """Where the filled store lives. ``flow_runs`` maps each filled stage (``train-dp``, ``tangent``,
    ``secure-inference``, ``stip``, ``attacks``, ``bench``) to its top-level run id; ``fill_s`` per stage."""

    home: Path
    db_url: str
    tracking_uri: str
    flow_runs: dict[str, str] = field(default_factory=dict)
    fill_s: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment variables that point privbench at this store (MLflow follows ``PRIVBENCH_HOME``
        when ``MLFLOW_TRACKING_URI`` is unset: unset it too)."""
        return {"PRIVBENCH_HOME": str(self.home), "PRIVBENCH_DB_URL": self.db_url}


def _fill_train_dp() -> str:
    from flows.train_dp import train_dp_flow, train_dp_runner
    from tests.flows.test_train_dp_flow import TINY

    assert TINY.train_dp is not None
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(TINY.train_dp))
    return flow(TINY.train_dp, TINY.prepare, profile="tiny")["run_id"]


def _fill_tangent(scratch: Path, home: Path) -> str:
    from flows.tangent import tangent_flow, tangent_runner
    from storage.recording import record_run
    from tests.flows.test_tangent_flow import _config, prepare_tiny_inputs

    cfg = _config()
    assert cfg.tangent is not None
    with record_run(flow="prepare", stage="data", technique="flow", config={}, profile="tiny", track=False) as parent:
        prepared = prepare_tiny_inputs(scratch / "idx", home, parent.ref)
    summary = tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
    )
    return summary["run_id"]


def _fill_secure_inference() -> str:
    from flows.secure_inference import secure_inference_flow
    from tests.flows.test_secure_inference_flow import TINY

    return secure_inference_flow(TINY, profile="tiny")["run_id"]


def _fill_stip() -> str:
    from flows.stip import stip_flow
    from tests.flows.test_stip_flow import TINY

    return stip_flow(TINY, profile="tiny")["run_id"]


def _fill_attacks(scratch: Path) -> str:
    """FILM + SEB utility (the attacks flow test's config) and the membership audit, in one attacks flow run."""
    from flows.attacks import attacks_flow
    from tests.flows.test_attacks_flow import TINY, write_texts

    scratch.mkdir(parents=True)
    prepare = write_texts(scratch)
    audited = validate(
        BenchmarkConfig,
        {
            "profile": "tiny",
            "prepare": {
                "datasets": [
                    {
                        "name": "ml-1m-tiny",
                        "source": "synthetic",
                        "synthetic": {"preset": "ml-1m", "scale": 0.05, "seed": 3},
                    }
                ],
                "texts": [t.model_dump() for t in prepare.texts],
            },
            "train_dp": {
                "datasets": [{"name": "ml-1m-tiny"}],
                "methods": ["transformer"],
                "epsilons": [8],
                "epochs": 1,
                "lrs": [0.005],
                "batch_sizes": [64],
                "max_len": 16,
                "d_model": 16,
            },
            "attacks": TINY.model_dump()
            | {
                "audit": {
                    "datasets": ["ml-1m-tiny"],
                    "methods": ["transformer"],
                    "epsilons": [8],
                    "shadows": 4,
                    "epochs": 2,
                    "unlearning": False,
                }
            },
        },
        origin="test",
    )
    config: AttacksConfig | None = audited.attacks
    assert config is not None
    return attacks_flow(config, audited.prepare, profile="tiny", train_dp=audited.train_dp)["run_id"]


def _fill_bench(mp: pytest.MonkeyPatch) -> str:
    """One ``dp-clipping`` record at a tiny setting (one round of the four methods, one timed step each)."""
    from privbench.bench import dp_clipping, run_benchmark
    from privbench.bench.harness import Progress

    tiny = replace(
        dp_clipping.PROFILES["quick"],
        items=64,
        seq_len=8,
        batch=8,
        d_model=16,
        n_layers=1,
        repeats=1,
        warmup=1,
        steps=1,
    )
    mp.setitem(dp_clipping.PROFILES, "quick", tiny)
    large = replace(tiny, name="large_vocab", items=100, batch=2, methods=dp_clipping.LARGE_VOCAB_METHODS)
    mp.setitem(dp_clipping.LARGE_VOCAB, "quick", large)

    class _Quiet:
        def print(self, *objects: object, **kwargs: object) -> None:
            pass

    quiet: Progress = _Quiet()
    return run_benchmark("dp-clipping", profile="quick", progress=quiet)["run_id"]


def fill_store(base: Path, mp: pytest.MonkeyPatch) -> FilledStore:
    """Fill ``base/.privbench`` by real tiny runs of every stage; ``mp`` sets the environment (undo it after)."""
    from core.mpc.crypten_compat import crypten_available
    from storage.db import dispose_engines

    home = base / ".privbench"
    db_url = f"sqlite:///{home / 'results.db'}"
    tracking_uri = f"sqlite:///{home / 'mlflow.db'}"
    mp.setenv("PRIVBENCH_HOME", str(home))
    mp.setenv("PRIVBENCH_DB_URL", db_url)
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default for this home: artifacts in home/mlartifacts
    store = FilledStore(home=home, db_url=db_url, tracking_uri=tracking_uri)
    stages = {
        "train-dp": _fill_train_dp,
        "tangent": lambda: _fill_tangent(base / "tangent", home),
        "secure-inference": _fill_secure_inference,
        "stip": _fill_stip,
        "attacks": lambda: _fill_attacks(base / "attacks"),
        "bench": lambda: _fill_bench(mp),
    }
    dispose_engines()
    try:
        for stage, fill in stages.items():
            if stage == "secure-inference" and not crypten_available():
                store.skipped[stage] = "CrypTen is not installed"
                continue
            start = time.perf_counter()
            store.flow_runs[stage] = fill()
            store.fill_s[stage] = round(time.perf_counter() - start, 1)
    finally:
        dispose_engines()
    return store
