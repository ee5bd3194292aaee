"""A claim's verdict classes, defined once (``docs/claims.md`` says when each is given). A module of its own, without
pydantic, so that the command line can colour verdicts without loading the config models."""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """A claim's verdict, in the order the report counts them. The verdict engine, the report, the CLI's colours
    and the dashboard's icons all key on it."""

    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not reproduced"
    INCONCLUSIVE = "inconclusive"
    UNDERPOWERED = "underpowered"
    PROJECTED = "projected"
    EXPLORATORY = "exploratory"
    NOT_APPLICABLE = "not applicable at this scale"
    NOT_RUN = "not run"


__all__ = ["Verdict"]
