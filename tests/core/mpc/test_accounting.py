from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.mpc.accounting import CATEGORIES, CostMeter


class Fake:
    """A clock and comm counter advanced by hand."""

    def __init__(self) -> None:
        self.t, self.b, self.r = 0.0, 0, 0

    def tick(self, s: float, b: int, r: int) -> None:
        self.t += s
        self.b += b
        self.r += r


def test_nested_ops_charge_innermost_only_and_sum_to_totals() -> None:
    f = Fake()
    m = CostMeter(stats=lambda: (f.b, f.r), clock=lambda: f.t)
    f.tick(100, 100, 100)  # outside any region: not counted
    with m.region():
        f.tick(1, 10, 1)  # Other
        with m.op("Linear"):
            f.tick(2, 20, 2)
            with m.op("Softmax"):
                f.tick(3, 30, 3)
            f.tick(4, 40, 4)
        with m.op("Generation"):
            f.tick(5, 50, 5)
    costs = m.as_dict()
    assert set(costs) == set(CATEGORIES)
    assert (costs["Linear"]["s"], costs["Linear"]["bytes"], costs["Linear"]["rounds"]) == (6, 60, 6)
    assert (costs["Softmax"]["s"], costs["Softmax"]["bytes"]) == (3, 30)
    assert (costs["Other"]["s"], costs["Generation"]["rounds"]) == (1, 5)
    tot = m.totals()
    assert tot == {"total_s": 15, "comm_bytes": 150, "rounds": 15}
    assert sum(c["s"] for c in costs.values()) == tot["total_s"]
    assert sum(c["bytes"] for c in costs.values()) == tot["comm_bytes"]


def test_unknown_category_lists_known() -> None:
    with pytest.raises(ConfigError, match="Linear") as err, CostMeter(stats=lambda: (0, 0)).op("Attention"):
        pass
    assert "Attention" in str(err.value)
