"""What a stage's plan is made of. Each stage's tasks declare ``plan(config) -> list[Job]``: every run the stage
records below its own flow run, told from the config alone, before anything runs, in the order the flow starts
them. The flow dispatches its tasks from the plan's jobs and ``flows.registry`` counts the runs to expect from it,
so the two cannot drift apart; a test holds each plan against the runs a real tiny flow recorded."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

FLOW = "flow"  # the technique of a flow's own run (and of a seed pass's, or a search's, under it)


@runtime_checkable
class Job(Protocol):
    """One run a stage records: ``technique`` is what its row's ``technique`` column will say."""

    @property
    def technique(self) -> str: ...


@dataclass(frozen=True)
class Recorded:
    """A run a task records beside others, which the flow does not start one by one (e.g. the five runs of one
    forget request): declared for the count, started by the task that records it."""

    technique: str


@dataclass(frozen=True)
class SeedPass:
    """The flow run that holds one seed pass of a stage that runs once per seed."""

    seed: int
    technique: str = FLOW


J = TypeVar("J")


def of_type(jobs: Iterable[object], kind: type[J]) -> list[J]:
    """The jobs of ``kind``, in plan order."""
    return [j for j in jobs if isinstance(j, kind)]


def unique(values: Sequence[J]) -> list[J]:
    """``values`` without repeats, in first-seen order (e.g. the columns of a plan's per-cell jobs)."""
    return list(dict.fromkeys(values))
