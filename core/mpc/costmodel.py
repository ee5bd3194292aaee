"""Projecting a measured two-party run onto a network: compute + bytes / bandwidth + rounds x RTT.

A run measured with both parties on one machine talks over loopback, so its wall time is (almost) all
computation. On a real network each party also waits for its bytes to cross the link and for one round
trip per communication round; with ``compute_s`` the measured wall seconds, ``bytes`` the bytes one party
sends and ``rounds`` its communication rounds,

    ``projected_s = compute_s + 8 * bytes / bandwidth_bps + rounds * rtt_s``.

The parties send symmetric traffic in CrypTen's two-party protocols, so the slower party (the maximum
over parties of each term) bounds the run. Loopback transfer time is left inside ``compute_s``: it makes
the projection an upper bound by at most the loopback cost, which is small next to a LAN or WAN link.
The defaults are the settings the MERGE paper's discussion and common MPC papers use: LAN 10 Gbit/s with
0.2 ms RTT, WAN 100 Mbit/s with 40 ms RTT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import ConfigError

__all__ = ["LAN", "NETWORKS", "WAN", "Network", "project", "project_all"]


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


def project(compute_s: float, bytes_sent: float, rounds: float, network: Network) -> dict[str, float]:
    """Projected seconds of one run on ``network``, with its three terms.

    Returns ``{"compute_s", "transfer_s", "latency_s", "projected_s"}``; raises ConfigError on negative or
    non-finite inputs (naming the bad value)."""
    for name, value in (("compute_s", compute_s), ("bytes_sent", bytes_sent), ("rounds", rounds)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name} must be a finite number >= 0, got {name}={value!r}")
    transfer = 8.0 * bytes_sent / network.bandwidth_bps
    latency = rounds * network.rtt_s
    return {
        "compute_s": float(compute_s),
        "transfer_s": transfer,
        "latency_s": latency,
        "projected_s": float(compute_s) + transfer + latency,
    }


def project_all(
    compute_s: float, per_party: Mapping[int, Mapping[str, float]], networks: Mapping[str, Network] = NETWORKS
) -> dict[str, dict[str, float]]:
    """Project a run onto every network: ``per_party[rank] = {"bytes": ..., "rounds": ...}``; the busiest
    party's bytes and rounds count (both parties wait for the slower one)."""
    if not per_party:
        raise ConfigError("per_party is empty; give at least one party's bytes and rounds")
    busiest_bytes = max(float(p["bytes"]) for p in per_party.values())
    busiest_rounds = max(float(p["rounds"]) for p in per_party.values())
    return {name: project(compute_s, busiest_bytes, busiest_rounds, net) for name, net in networks.items()}
