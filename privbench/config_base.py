"""The base every config model derives from (kept apart so stage configs can live in their own modules)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FrozenConfig(BaseModel):
    """Base of every config: immutable, keyword-only, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)
