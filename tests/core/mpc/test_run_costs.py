"""A two-party run's costs from its parties' results (``core.mpc.run_costs``), against hand-computed figures."""

from __future__ import annotations

import pytest
import torch

from core.errors import DataError
from core.mpc.accounting import CATEGORIES
from core.mpc.costmodel import Network
from core.mpc.gpt2 import GenerationResult
from core.mpc.run_costs import OpCost, aggregate_parties, run_metrics


def _party(rank: int, scale: float, linear: dict[str, float]) -> GenerationResult:
    costs = {c: {"s": 0.0, "bytes": 0, "rounds": 0, "calls": 0} for c in CATEGORIES}
    costs["Linear"] = {**linear, "calls": 1}
    costs["Softmax"] = {"s": 1.0 * scale, "bytes": 100 * scale, "rounds": 2 * scale, "calls": 1}
    tokens = torch.tensor([[7, 8]]) if rank == 1 else None
    return GenerationResult(
        rank, "vanilla", tokens, costs, total_s=3.0 * scale, comm_bytes=int(1000 * scale), rounds=int(10 * scale)
    )


def _parties() -> list[GenerationResult]:
    owner = _party(0, 2.0, {"s": 0.5, "bytes": 40, "rounds": 9})  # slower overall, fewer Linear bytes
    client = _party(1, 1.0, {"s": 0.7, "bytes": 80, "rounds": 3})
    return [owner, client]


def test_the_slower_party_bounds_every_figure_and_the_client_holds_the_tokens() -> None:
    for parties in (_parties(), _parties()[::-1]):  # the order of the results does not matter
        run = aggregate_parties(parties, wall_s=9.5)
        assert (run.total_s, run.comm_bytes, run.rounds, run.wall_s) == (6.0, 2000, 20, 9.5)
        assert torch.equal(run.tokens, torch.tensor([[7, 8]]))
        # figure by figure: Linear's seconds and bytes from the client, its rounds from the owner
        assert run.ops["Linear"] == OpCost(s=0.7, bytes=80.0, rounds=9.0)
        assert run.ops["Softmax"] == OpCost(s=2.0, bytes=200.0, rounds=4.0)
        assert run.ops["Embed"] == OpCost(s=0.0, bytes=0.0, rounds=0.0) and set(run.ops) == set(CATEGORIES)


def test_the_metrics_flatten_the_run_and_project_the_busiest_party() -> None:
    run = aggregate_parties(_parties(), wall_s=9.5)
    out = run_metrics(run, {"net": Network("net", 8000.0, 0.5)})
    # busiest party: 2000 bytes logged -> 1000 sent -> 8000 bits at 8000 bit/s = 1 s; 20 rounds x 0.5 s = 10 s
    assert out.projection == {
        "net": {"compute_s": 6.0, "bytes_sent": 1000.0, "transfer_s": 1.0, "latency_s": 10.0, "projected_s": 17.0}
    }
    m = out.metrics
    assert (m["total_s"], m["comm_bytes"], m["rounds"], m["wall_s"]) == (6.0, 2000, 20, 9.5)
    assert (m["ops.Linear.s"], m["ops.Linear.bytes"], m["ops.Linear.rounds"]) == (0.7, 80.0, 9.0)
    assert m["net.projected_s"] == 17.0 and m["net.latency_s"] == 10.0
    assert len(m) == 4 + 3 * len(CATEGORIES) + 5


def test_a_run_without_parties_or_a_client_is_refused() -> None:
    with pytest.raises(DataError, match="no party results"):
        aggregate_parties([], wall_s=1.0)
    with pytest.raises(DataError, match="exactly one client"):
        aggregate_parties(_parties()[:1], wall_s=1.0)
