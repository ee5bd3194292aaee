"""Stage 6 (stip): the STIP three-party permutation protocol and its attacks (the ``stip`` section)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from pbconfig.base import FrozenConfig

StipDesign = Literal["user_embed", "vocab_perm"]
StipAttack = Literal["checkpoint_match", "activation_stats", "frequency"]


class StipModelSpec(FrozenConfig):
    """A model for STIP: ``gpt2-config`` (a GPT-2 built from this shape with the real 50,257-token vocabulary,
    seeded random weights) or ``smollm2`` (the real pretrained SmolLM2-135M, LLaMA architecture)."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    source: Literal["gpt2-config", "smollm2"]
    n_layer: int = Field(4, ge=1)
    n_embd: int = Field(256, ge=2)
    n_head: int = Field(4, ge=1)
    designs: tuple[StipDesign, ...] | None = Field(
        None, description="designs to run on this model (None: the stage's designs)"
    )
    attacks: tuple[StipAttack, ...] | None = Field(
        None, description="attacks to run on this model (None: the stage's attacks; empty: none)"
    )


class StipConfig(FrozenConfig):
    """Stage 6: the STIP three-party permutation protocol (correctness, costs) and attacks on the permutation.

    Attacks (``core.stip.recovery``), each run on every design at every fine-tune noise of ``finetune_noises`` (the
    deployed model is the public base checkpoint plus Gaussian noise of that size relative to each tensor's RMS):
    ``checkpoint_match`` (P2 knows the public base checkpoint: ``pi`` from rho-invariant statistics of the
    blocks, then ``sigma`` from the substituted tables or the user's tokens from the rows P3 sends),
    ``activation_stats`` (per-coordinate statistics of ``attack_queries`` permuted inputs against the base model's),
    ``frequency`` (no checkpoint: frequency analysis of the fixed code per token, on ``stream_tokens`` tokens of
    public text, in both designs).

    ``seed`` is recorded with the run, so it drives public things only; every secret permutation is drawn fresh
    from the OS CSPRNG (``core.stip.keys``) and never recorded.
    """

    models: tuple[StipModelSpec, ...] = Field(min_length=1)
    designs: tuple[StipDesign, ...] = get_args(StipDesign)
    attacks: tuple[StipAttack, ...] = get_args(StipAttack)
    prompt_len: int = Field(8, ge=1)
    gen_len: int = Field(8, ge=1)
    finetune_noises: tuple[float, ...] = Field((0.0, 0.01, 0.1, 0.5), min_length=1)
    attack_queries: int = Field(64, ge=1)
    stream_tokens: int = Field(20000, ge=100)
    timing_repeats: int = Field(8, ge=1, description="timing rounds (6 or more: a 95% interval; even: orders balance)")
    party_timeout_s: float = Field(600.0, gt=0.0)
    seed: int = Field(
        0,
        ge=0,
        description="public randomness only (model init, prompts, simulated fine-tune, corpus split); the secret "
        "permutations come from the OS CSPRNG, never from this seed",
    )

    @field_validator("finetune_noises")
    @classmethod
    def _noises(cls, noises: tuple[float, ...]) -> tuple[float, ...]:
        if any(n < 0 for n in noises) or len(set(noises)) != len(noises):
            raise ValueError(f"finetune_noises must be distinct and >= 0, got {noises}")
        return noises

    @field_validator("models")
    @classmethod
    def _unique(cls, models: tuple[StipModelSpec, ...]) -> tuple[StipModelSpec, ...]:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"stip model names must be unique, got {names}")
        return models
