"""The base every config model derives from (kept apart so stage configs can live in their own modules), and the
typed fields several stages share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

# a differential-privacy budget epsilon: every config field holding one (or a tuple of them) uses this type
Epsilon = Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="DP budget epsilon > 0")]
# a differential-privacy delta, in (0, 1); fields use ``Delta | None`` where None means the accountant's default
Delta = Annotated[float, Field(gt=0.0, lt=1.0, description="DP delta in (0, 1)")]


class FrozenConfig(BaseModel):
    """Base of every config: immutable, keyword-only, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelShape(FrozenConfig):
    """A GPT-2 shape (layers, width, heads); the width must be a multiple of the heads."""

    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=2)
    n_head: int = Field(ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        return self
