"""Projecting a measured two-party run onto a network: compute + bytes sent / bandwidth + rounds x RTT.

A run measured with both parties on one machine talks over loopback, so its wall time is (almost) all
computation. On a real network each party also waits for its bytes to cross the link and for one round
trip per communication round; with ``compute_s`` the measured wall seconds, ``bytes_sent`` the bytes one
party sends and ``rounds`` its communication rounds,

    ``projected_s = compute_s + 8 * bytes_sent / bandwidth_bps + rounds * rtt_s``.

Bytes convention. The per-party ``bytes`` privbench logs (``comm_bytes``, the ``mpc_costs`` rows, read from
CrypTen's ``get_communication_stats()`` by ``core.mpc.accounting``) are bytes SENT PLUS RECEIVED by that
party: CrypTen counts an all-reduce (the opening of a shared value) of n ring elements as 2 (world_size - 1) n
elements of 8 bytes, and a send or a receive as n elements on the side that does it. A link is full duplex,
so what a party waits for is what it sends (its peer's bytes arrive over the other direction at the same
time). In CrypTen's two-party protocols the traffic is symmetric (every opening is an exchange of equal
halves), so

    ``bytes_sent = logged_bytes / 2``  (:func:`sent_bytes`);

opening 1,000 int64 elements logs 16,000 bytes per party and sends 8,000 (``tests/core/mpc``). One-way
transfers (a result revealed to one party only) are a small part of a run; for them the halving undercounts
the busier direction by at most 2x.

Both parties wait for the slower one, so the busiest party (the maximum over parties of bytes and of rounds)
bounds the run. Loopback transfer time is left inside ``compute_s``: it makes the projection an upper bound
by at most the loopback cost, which is small next to a LAN or WAN link. The defaults are the settings the
MERGE paper's discussion and common MPC papers use: LAN 10 Gbit/s with 0.2 ms RTT, WAN 100 Mbit/s with
40 ms RTT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import ConfigError

__all__ = ["LAN", "NETWORKS", "WAN", "Network", "project", "project_all", "sent_bytes"]


@dataclass(frozen=True)
class Network:
    """A link: ``bandwidth_bps`` bits per second (> 0) and round-trip time ``rtt_s`` seconds (>= 0)."""

    name: str
    bandwidth_bps: float
    rtt_s: float

    def __post_init__(self) -> None:
        if not (
            isinstance(self.bandwidth_bps, int | float) and math.isfinite(self.bandwidth_bps) and self.bandwidth_bps > 0
        ):
            raise ConfigError(
                f"network {self.name!r}: bandwidth_bps must be a finite number > 0, got {self.bandwidth_bps!r}"
            )
        if not (isinstance(self.rtt_s, int | float) and math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ConfigError(f"network {self.name!r}: rtt_s must be a finite number >= 0, got {self.rtt_s!r}")


LAN = Network("lan", 10e9, 0.2e-3)
WAN = Network("wan", 100e6, 40e-3)
NETWORKS = {"lan": LAN, "wan": WAN}


def _check(name: str, value: object) -> float:
    if isinstance(value, bool) or not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {name}={value!r}")
    return float(value)


def sent_bytes(logged_bytes: float) -> float:
    """Bytes one party sent, from the bytes CrypTen logged for it (sent + received): ``logged_bytes / 2``.

    Exact for CrypTen's symmetric two-party exchanges (see the module docstring); raises ConfigError on a
    negative or non-finite count, naming it."""
    return _check("logged_bytes", logged_bytes) / 2.0


def project(compute_s: float, bytes_sent: float, rounds: float, network: Network) -> dict[str, float]:
    """Projected seconds of one run on ``network``, with its three terms; ``bytes_sent`` is what the party
    SENDS (:func:`sent_bytes` of the logged count), not CrypTen's sent + received count.

    Returns ``{"compute_s", "bytes_sent", "transfer_s", "latency_s", "projected_s"}``; raises ConfigError on
    negative or non-finite inputs (naming the bad value)."""
    compute_s = _check("compute_s", compute_s)
    bytes_sent = _check("bytes_sent", bytes_sent)
    rounds = _check("rounds", rounds)
    transfer = 8.0 * bytes_sent / network.bandwidth_bps
    latency = rounds * network.rtt_s
    return {
        "compute_s": compute_s,
        "bytes_sent": bytes_sent,
        "transfer_s": transfer,
        "latency_s": latency,
        "projected_s": compute_s + transfer + latency,
    }


def project_all(
    compute_s: float, per_party: Mapping[int, Mapping[str, float]], networks: Mapping[str, Network] = NETWORKS
) -> dict[str, dict[str, float]]:
    """Project a run onto every network: ``per_party[rank] = {"bytes": ..., "rounds": ...}`` with ``bytes`` as
    logged (sent + received). The busiest party's bytes SENT (:func:`sent_bytes`) and rounds count (both
    parties wait for the slower one); each network's dict holds ``bytes_sent`` and the terms of :func:`project`."""
    if not per_party:
        raise ConfigError("per_party is empty; give at least one party's bytes and rounds")
    busiest_sent = max(sent_bytes(p["bytes"]) for p in per_party.values())
    busiest_rounds = max(_check("rounds", p["rounds"]) for p in per_party.values())
    return {name: project(compute_s, busiest_sent, busiest_rounds, net) for name, net in networks.items()}
