"""The base every config model derives from (kept apart so stage configs can live in their own modules), and the
typed fields several stages share."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# a differential-privacy budget epsilon: every config field holding one (or a tuple of them) uses this type
Epsilon = Annotated[float, Field(gt=0.0, allow_inf_nan=False, description="DP budget epsilon > 0")]
# a differential-privacy delta, in (0, 1); fields use ``Delta | None`` where None means the accountant's default
Delta = Annotated[float, Field(gt=0.0, lt=1.0, description="DP delta in (0, 1)")]


class FrozenConfig(BaseModel):
    """Base of every config: immutable, keyword-only, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


def require_heads_divide(config: BaseModel, width: str, heads: str) -> None:
    """Refuse a Transformer width (field ``width`` of ``config``) that its number of attention heads (field
    ``heads``) does not divide: each head takes an equal slice of the width."""
    w, h = getattr(config, width), getattr(config, heads)
    if w % h:
        raise ValueError(f"{width}={w} must be a multiple of {heads}={h}")


class ModelShape(FrozenConfig):
    """A GPT-2 shape (layers, width, heads); the width must be a multiple of the heads."""

    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=2)
    n_head: int = Field(ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        require_heads_divide(self, "n_embd", "n_head")
        return self


class SeedPasses(FrozenConfig):
    """A stage that runs whole once per seed: ``seeds`` (None: the one ``seed``) runs it once per seed, in place
    of ``seed`` (:meth:`seed_configs`), so that its comparisons get intervals over seeds."""

    seed: int = Field(0, ge=0)
    seeds: tuple[int, ...] | None = Field(None, description="None: the one seed; else the stage runs once per seed")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, values: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if values is None:
            return None
        if not values:
            raise ValueError("seeds must name at least one seed, got []; e.g. [0, 1, 2], or null for the one `seed`")
        bad = [v for v in values if v < 0]
        if bad:
            raise ValueError(f"every seed must be >= 0, got {bad} in seeds={list(values)}; e.g. [0, 1, 2]")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(
                f"seeds must be distinct, got {list(values)} (repeated: {repeated}); a seed run again is a repeat, "
                "not a new sample: list each once, e.g. [0, 1, 2]"
            )
        return values

    def seed_configs(self) -> tuple[Self, ...]:
        """What each seed pass runs and records: this config with ``seed`` replaced by each of ``seeds`` (and
        ``seeds`` null, as a one-seed config), in order; just this config when ``seeds`` is None."""
        if self.seeds is None:
            return (self,)
        return tuple(self.model_copy(update={"seed": s, "seeds": None}) for s in self.seeds)
