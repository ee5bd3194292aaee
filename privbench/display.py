"""How the command line shows values: literally (never read as Rich markup) and with the passwords of URLs
redacted (``core.redact``); table cells; the claims report's verdict table."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from core.redact import redact_url
from pbconfig.verdicts import Verdict

if TYPE_CHECKING:
    import pandas as pd

VERDICT_COLOURS = {
    Verdict.REPRODUCED: "green",
    Verdict.NOT_REPRODUCED: "red",
    Verdict.INCONCLUSIVE: "yellow",
    Verdict.UNDERPOWERED: "yellow",
    Verdict.PROJECTED: "cyan",
    Verdict.EXPLORATORY: "dim",
    Verdict.NOT_APPLICABLE: "dim",
    Verdict.NOT_RUN: "dim",
}


def literal(text: str) -> Text:
    """``text`` as it is (never read as Rich markup), with the passwords of any URLs in it redacted."""
    return Text(redact_url(text))


def shown(value: Any) -> str:
    """``value`` for an f-string that is printed as Rich markup: redacted, then escaped to show literally."""
    return escape(redact_url(str(value)))


def cell(value: Any) -> Text:
    """A table cell, shown literally."""
    if isinstance(value, float):
        return Text(f"{value:.6g}")
    if isinstance(value, dict | list):
        return literal(json.dumps(value)[:80])
    return literal("" if value is None else str(value))


def seconds(value: float | None) -> Text:
    return Text("" if value is None else f"{value:.1f}")


def verdict_table(table: pd.DataFrame) -> Table:
    """``privbench report``'s summary on the terminal: paper, claim, ours (cut to 70 characters), verdict."""
    out = Table("paper", "claim", "ours", "verdict", box=None, pad_edge=False)
    for row in table.itertuples(index=False):
        colour = VERDICT_COLOURS.get(row.verdict, "dim")
        out.add_row(literal(row.paper), literal(row.claim), literal(row.ours[:70]), Text(row.verdict, colour))
    return out
