"""A results store filled by real tiny runs of every stage flow, for the flow tests (each reads its own stage's
run) and the tests of the read side (dashboard views, SQL examples, the browser test).

``StageStore(base)`` keeps, under ``base/.privbench``, its own SQLite results store and its own MLflow SQLite
store ``mlflow.db`` with artifacts in ``mlartifacts`` (MLflow's default for that home). ``summary(stage)`` runs
one stage's tiny flow the first time it is asked for: train-dp (non-private + DP transformer, DPFormer, an Opacus
peer), tangent (tiny Dinov2 on tiny IDX images: shards, composition, unlearning, DP regimes), secure-inference
(tiny GPT-2 under CrypTen, when CrypTen is installed), stip, attacks (FILM against subword and SEB, SEB utility,
and the membership audit of a DP and a non-private transformer) and one tiny ``dp-clipping`` bench record;
``filled()`` runs every stage. The configs are the flow tests' tiny ones (``tests/flows``). It needs a Prefect API
(the session's ``prefect_harness``) and points the environment at the store only while a stage runs
(``point_at`` points it there for a test's own checks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pbconfig.attacks import AttacksConfig
from tests.tiny_benchmark import tiny_benchmark


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


def _fill_train_dp(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
    from flows.train_dp import train_dp_flow, train_dp_runner
    from tests.flows.test_train_dp_flow import TINY

    assert TINY.train_dp is not None
    store.configs["train-dp"] = TINY.train_dp
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(TINY.train_dp))
    return flow(TINY.train_dp, TINY.prepare, profile="tiny")


def _fill_tangent(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
    from flows.tangent import tangent_flow, tangent_runner
    from storage.recording import record_run
    from tests.flows.test_tangent_flow import _config, prepare_tiny_inputs

    cfg = _config()
    assert cfg.tangent is not None
    with record_run(flow="prepare", stage="data", technique="flow", config={}, profile="tiny", track=False) as parent:
        prepared = prepare_tiny_inputs(store.base / "tangent" / "idx", store.home, parent.ref)
    store.inputs["tangent"] = prepared
    store.configs["tangent"] = cfg.tangent
    return tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile="tiny", prepared=prepared
    )


def _fill_secure_inference(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
    from flows.secure_inference import secure_inference_flow
    from tests.flows.test_secure_inference_flow import TINY

    store.configs["secure-inference"] = TINY
    return secure_inference_flow(TINY, profile="tiny")


def _fill_stip(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
    from flows.stip import stip_flow
    from tests.flows.test_stip_flow import TINY

    store.configs["stip"] = TINY
    return stip_flow(TINY, profile="tiny")


def _fill_attacks(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
    """FILM + SEB utility (the attacks flow test's config) and the membership audit, in one attacks flow run."""
    from flows.attacks import attacks_flow
    from tests.flows.test_attacks_flow import TINY, write_texts

    scratch = store.base / "attacks"
    scratch.mkdir(parents=True)
    prepare = write_texts(scratch)
    audited = tiny_benchmark(
        {"methods": ["transformer"]},
        texts=[t.model_dump() for t in prepare.texts],
        attacks=TINY.model_dump()
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
    )
    config: AttacksConfig | None = audited.attacks
    assert config is not None
    store.configs["attacks"] = config
    return attacks_flow(config, audited.prepare, profile="tiny", train_dp=audited.train_dp)


def _fill_bench(store: StageStore, mp: pytest.MonkeyPatch) -> dict[str, Any]:
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
    return run_benchmark("dp-clipping", profile="quick", progress=quiet)


FILLERS: dict[str, Callable[[StageStore, pytest.MonkeyPatch], dict[str, Any]]] = {
    "train-dp": _fill_train_dp,
    "tangent": _fill_tangent,
    "secure-inference": _fill_secure_inference,
    "stip": _fill_stip,
    "attacks": _fill_attacks,
    "bench": _fill_bench,
}


class StageStore:
    """The session's store, filled one stage at a time on first use: ``summary(stage)`` runs that stage's tiny
    flow (once per session) and returns what the flow returned. The flow tests read their stage's run from it
    instead of running the same flow again; ``filled()`` fills every stage, for the read side's tests."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.home = base / ".privbench"
        self.db_url = f"sqlite:///{self.home / 'results.db'}"
        self.tracking_uri = f"sqlite:///{self.home / 'mlflow.db'}"
        self.summaries: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, dict[str, str]] = {}  # what a stage was given (the tangent stage's prepared paths)
        self.configs: dict[str, Any] = {}  # the config section each stage's flow ran with
        self.fill_s: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def _home_env(self, mp: pytest.MonkeyPatch) -> None:
        from storage.db import dispose_engines

        dispose_engines()
        mp.setenv("PRIVBENCH_HOME", str(self.home))
        mp.setenv("PRIVBENCH_DB_URL", self.db_url)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default for this home: artifacts in home/mlartifacts

    def point_at(self, mp: pytest.MonkeyPatch) -> None:
        """Point privbench and ``MLFLOW_TRACKING_URI`` at this store for as long as ``mp`` lasts. An
        ``MlflowClient`` a test makes should still name ``tracking_uri``: a process-wide ``mlflow.set_tracking_uri``
        made by an earlier test wins over the environment."""
        self._home_env(mp)
        mp.setenv("MLFLOW_TRACKING_URI", self.tracking_uri)

    def summary(self, stage: str) -> dict[str, Any]:
        """The summary of ``stage``'s flow run in this store, running the flow first if it has not run;
        skips the test when the stage cannot run here (CrypTen missing)."""
        from core.mpc.crypten_compat import crypten_available
        from storage.db import dispose_engines

        if stage == "secure-inference" and not crypten_available():
            self.skipped[stage] = "CrypTen is not installed"
        if stage in self.skipped:
            pytest.skip(self.skipped[stage])
        if stage in self.failed:  # not run again: its failed rows are in the store and would skew every count
            pytest.fail(f"filling the {stage} stage failed earlier in this session: {self.failed[stage]}")
        if stage not in self.summaries:
            with pytest.MonkeyPatch.context() as mp:
                self._home_env(mp)
                try:
                    start = time.perf_counter()
                    self.summaries[stage] = FILLERS[stage](self, mp)
                    self.fill_s[stage] = round(time.perf_counter() - start, 1)
                except Exception as exc:
                    self.failed[stage] = f"{type(exc).__name__}: {exc}"
                    raise
                finally:
                    dispose_engines()
        return self.summaries[stage]

    def filled(self) -> FilledStore:
        """Every stage filled (those that cannot run here listed in ``skipped``)."""
        for stage in FILLERS:
            if stage not in self.skipped:
                try:
                    self.summary(stage)
                except pytest.skip.Exception:
                    pass
        return FilledStore(
            home=self.home,
            db_url=self.db_url,
            tracking_uri=self.tracking_uri,
            flow_runs={stage: summary["run_id"] for stage, summary in self.summaries.items()},
            fill_s=dict(self.fill_s),
            skipped=dict(self.skipped),
        )
