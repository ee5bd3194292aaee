"""Dispatch on a name: an unknown name is a ConfigError naming it and the known ones."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.registry import lookup


def test_lookup_returns_the_entry_or_names_the_known_ones() -> None:
    table = {"taft": 1, "nlft": 2}
    assert lookup("method", table, "nlft") == 2
    with pytest.raises(ConfigError, match=r"^unknown method 'lora'; known: taft, nlft$"):
        lookup("method", table, "lora")
    with pytest.raises(ConfigError, match=r"unknown method \['x'\]"):  # unhashable: still a ConfigError
        lookup("method", table, ["x"])
    with pytest.raises(ConfigError, match=r"known: \(none\)"):
        lookup("method", {}, "x")
