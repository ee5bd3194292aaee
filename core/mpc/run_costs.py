"""The costs of one two-party encrypted run, from its parties' results (MERGE Tables 1-2).

Both parties wait for each other at every communication round, so the slower party bounds the run: for each
figure ``x`` (seconds, bytes as CrypTen logs them, rounds) of the whole generation and of each op category ``c``,

    ``x_run = max_p x_p``  and  ``x_run[c] = max_p x_p[c]``  over the parties ``p``,

taken figure by figure (the maxima may come from different parties). The decrypted tokens are the client's
(:data:`~core.mpc.parties.CLIENT`). :func:`run_metrics` flattens the figures into named metrics and projects the
run onto networks with :func:`~core.mpc.costmodel.project_all` (the busiest party's bytes sent and rounds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from core.errors import DataError
from core.mpc.accounting import CATEGORIES
from core.mpc.costmodel import NETWORKS, Network, project_all
from core.mpc.gpt2 import GenerationResult
from core.mpc.parties import CLIENT

__all__ = ["EncryptedRun", "OpCost", "RunMetrics", "aggregate_parties", "run_metrics"]


@dataclass(frozen=True)
class OpCost:
    """One op category's seconds, bytes (sent + received) and communication rounds."""

    s: float
    bytes: float
    rounds: float


@dataclass(frozen=True, eq=False)
class EncryptedRun:
    """One encrypted generation: every party's result, the client's decrypted ``tokens`` (B, n_new), the wall
    seconds around the whole run (process start-up included), and the slower party's ``total_s``,
    ``comm_bytes``, ``rounds`` and per-category ``ops``."""

    parties: tuple[GenerationResult, ...]
    tokens: Tensor
    wall_s: float
    total_s: float
    comm_bytes: int
    rounds: int
    ops: Mapping[str, OpCost]


@dataclass(frozen=True)
class RunMetrics:
    """A run's flat metrics (``total_s``, ``comm_bytes``, ``rounds``, ``wall_s``, ``ops.<category>.<s|bytes|
    rounds>``, ``<network>.<term>``) and its projection per network (:func:`~core.mpc.costmodel.project_all`)."""

    metrics: dict[str, float]
    projection: dict[str, dict[str, float]]


def aggregate_parties(parties: Sequence[GenerationResult], wall_s: float) -> EncryptedRun:
    """The run of ``parties`` (each with costs for every op category of :data:`~core.mpc.accounting.CATEGORIES`):
    the maximum over parties of every figure, the client's tokens."""
    if not parties:
        raise DataError("no party results to aggregate; run at least the model owner and the client")
    clients = [p for p in parties if p.rank == CLIENT]
    if len(clients) != 1 or clients[0].tokens is None:
        raise DataError(
            f"exactly one client (rank {CLIENT}) with decrypted tokens expected, got ranks {[p.rank for p in parties]}"
        )
    ops = {
        c: OpCost(**{k: max(float(p.costs[c][k]) for p in parties) for k in ("s", "bytes", "rounds")})
        for c in CATEGORIES
    }
    return EncryptedRun(
        parties=tuple(parties),
        tokens=clients[0].tokens,
        wall_s=wall_s,
        total_s=max(p.total_s for p in parties),
        comm_bytes=max(p.comm_bytes for p in parties),
        rounds=max(p.rounds for p in parties),
        ops=ops,
    )


def run_metrics(run: EncryptedRun, networks: Mapping[str, Network] = NETWORKS) -> RunMetrics:
    """``run``'s figures as flat metrics, and its projection onto each of ``networks`` from ``total_s`` and
    every party's logged bytes and rounds."""
    per_party = {p.rank: {"bytes": p.comm_bytes, "rounds": p.rounds} for p in run.parties}
    projection = project_all(run.total_s, per_party, networks)
    metrics = {"total_s": run.total_s, "comm_bytes": run.comm_bytes, "rounds": run.rounds, "wall_s": run.wall_s}
    for cat, c in run.ops.items():
        metrics.update({f"ops.{cat}.s": c.s, f"ops.{cat}.bytes": c.bytes, f"ops.{cat}.rounds": c.rounds})
    for net, terms in projection.items():
        metrics.update({f"{net}.{k}": v for k, v in terms.items()})
    return RunMetrics(metrics, projection)
