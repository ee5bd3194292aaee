"""The benchmark chain's flows by name, in the order the chain runs them: the one list every layer reads.

Each entry is a flow as its rows carry it (``runs.flow``), the ``BenchmarkConfig`` section it runs (None for the
chain itself) and the title the report gives its row. ``flows/registry.py`` declares each stage's behaviour
(:class:`flows.registry.Stage`) for these names and a test checks the two agree; the report (``tasks/report.py``),
the store's stage runs (``storage/stage_runs.py``), the CLI's flow names and the deployments
(``deploy/prefect.yaml``, checked by a test) read them from here. Adding a stage is one entry here and one
``Stage`` in the registry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainFlow:
    """One flow of the chain: ``name`` (``runs.flow``), ``section`` (its ``BenchmarkConfig`` section; None: the
    chain), ``title`` (the report's stage table)."""

    name: str
    section: str | None
    title: str


CHAIN: tuple[ChainFlow, ...] = (
    ChainFlow("prepare", "prepare", "prepare (datasets)"),
    ChainFlow("train-dp", "train_dp", "train-dp (DPFormer)"),
    ChainFlow("tangent", "tangent", "tangent (TAFT)"),
    ChainFlow("secure-inference", "secure_inference", "secure-inference (MERGE)"),
    ChainFlow("stip", "stip", "stip (STIP)"),
    ChainFlow("attacks", "attacks", "attacks (FILM / SEB, membership)"),
    ChainFlow("benchmark", None, "benchmark (the whole chain)"),
)
FLOW_NAMES: tuple[str, ...] = tuple(f.name for f in CHAIN)  # every flow ``privbench run`` knows, the chain last
STAGE_NAMES: tuple[str, ...] = tuple(f.name for f in CHAIN if f.name not in ("prepare", "benchmark"))
TITLES: dict[str, str] = {f.name: f.title for f in CHAIN}

__all__ = ["CHAIN", "FLOW_NAMES", "STAGE_NAMES", "TITLES", "ChainFlow"]
