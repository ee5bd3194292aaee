"""Dispatch on a name through a table: an unknown name is a :class:`~core.errors.ConfigError` that names the bad
value and the known ones, never a bare ``KeyError``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from core.errors import ConfigError

__all__ = ["lookup"]

T = TypeVar("T")


def lookup(kind: str, table: Mapping[str, T], name: object) -> T:
    """``table[name]``; ``ConfigError("unknown <kind> 'x'; known: a, b, c")`` when ``name`` is not a key.

    ``kind`` says what the names are (``"tangent method"``, ``"MPC approximation"``), for the message.
    """
    try:
        return table[name]  # type: ignore[index]
    except (KeyError, TypeError):  # TypeError: an unhashable name
        raise ConfigError(f"unknown {kind} {name!r}; known: {', '.join(map(str, table)) or '(none)'}") from None
