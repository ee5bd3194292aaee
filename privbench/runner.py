"""Which flows ``privbench run`` knows, and how a profile config is handed to each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import ConfigError
from privbench.config import BenchmarkConfig


def _prepare(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.prepare import prepare_flow

    return prepare_flow(cfg.prepare, profile=cfg.profile)


def _train_dp(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.train_dp import train_dp_flow, train_dp_runner

    if cfg.train_dp is None:
        raise ConfigError(f"profile {cfg.profile!r} has no train_dp section; add one or use --profile quick")
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(cfg.train_dp))
    return flow(cfg.train_dp, cfg.prepare, profile=cfg.profile)


def _tangent(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.tangent import tangent_flow, tangent_runner

    if cfg.tangent is None:
        raise ConfigError(f"profile {cfg.profile!r} has no tangent section; add one or use --profile quick")
    return tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(cfg.tangent, cfg.prepare,
                                                                             profile=cfg.profile)


def _secure_inference(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.secure_inference import secure_inference_flow

    if cfg.secure_inference is None:
        raise ConfigError(f"profile {cfg.profile!r} has no secure_inference section; add one or use --profile quick")
    return secure_inference_flow(cfg.secure_inference, profile=cfg.profile)


def _stip(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.stip import stip_flow

    if cfg.stip is None:
        raise ConfigError(f"profile {cfg.profile!r} has no stip section; add one or use --profile quick")
    return stip_flow(cfg.stip, profile=cfg.profile)


def _attacks(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.attacks import attacks_flow, attacks_runner

    if cfg.attacks is None:
        raise ConfigError(f"profile {cfg.profile!r} has no attacks section; add one or use --profile quick")
    return attacks_flow.with_options(task_runner=attacks_runner(cfg.attacks))(cfg.attacks, cfg.prepare,
                                                                             profile=cfg.profile,
                                                                             train_dp=cfg.train_dp,
                                                                             tangent=cfg.tangent)


def _benchmark(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.benchmark import benchmark_flow

    return benchmark_flow(cfg)


FLOWS: dict[str, Callable[[BenchmarkConfig], dict[str, Any]]] = {
    "prepare": _prepare,
    "train-dp": _train_dp,
    "tangent": _tangent,
    "secure-inference": _secure_inference,
    "stip": _stip,
    "attacks": _attacks,
    "benchmark": _benchmark,
}


def run_flow(name: str, cfg: BenchmarkConfig) -> dict[str, Any]:
    return FLOWS[name](cfg)


if __name__ == "__main__":  # the flow process of ``privbench run`` (see privbench.supervisor)
    import sys

    from privbench.supervisor import child_main

    sys.exit(child_main(sys.argv[1:]))
