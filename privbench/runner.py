"""Which flows ``privbench run`` knows, and how a profile config is handed to each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from privbench.config import BenchmarkConfig


def _prepare(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.prepare import prepare_flow

    return prepare_flow(cfg.prepare, profile=cfg.profile)


def _benchmark(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.benchmark import benchmark_flow

    return benchmark_flow(cfg)


FLOWS: dict[str, Callable[[BenchmarkConfig], dict[str, Any]]] = {
    "prepare": _prepare,
    "benchmark": _benchmark,
}


def run_flow(name: str, cfg: BenchmarkConfig) -> dict[str, Any]:
    return FLOWS[name](cfg)
