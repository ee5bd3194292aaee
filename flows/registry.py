"""The flow registry: which flows ``privbench run`` (and the deployments of ``flows.deployments``) know, and how
a profile config is handed to each. Each flow module is imported only when its flow runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import ConfigError
from core.registry import lookup
from pbconfig.benchmark import BenchmarkConfig
from pbconfig.data import PrepareConfig


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
    return tangent_flow.with_options(task_runner=tangent_runner(cfg.tangent))(
        cfg.tangent, cfg.prepare, profile=cfg.profile
    )


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
    return attacks_flow.with_options(task_runner=attacks_runner(cfg.attacks))(
        cfg.attacks, cfg.prepare, profile=cfg.profile, train_dp=cfg.train_dp, tangent=cfg.tangent
    )


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
    return lookup("flow", FLOWS, name)(cfg)


# ------------------------------------------------------------------------------------- the runs to expect


def plan(name: str, cfg: BenchmarkConfig) -> dict[str, int | None]:
    """How many runs ``run_flow(name, cfg)`` records, told from the config alone, per flow name as the rows carry
    it: ``{"prepare": 3, "train-dp": 43}`` for ``train-dp`` on its own (it prepares its datasets first). ``None``
    for a flow whose count the config does not tell. For progress display only: a task that Prefect retries
    records one run more, and a flow that fails stops short."""
    return lookup("flow", PLANS, name)(cfg)


def _prepare_runs(p: PrepareConfig) -> int:
    """The prepare flow: its own run, one per dataset, image dataset, pretrained model and text dataset."""
    return 1 + len(p.datasets) + len(p.images) + len(p.models) + len(p.texts)


def _train_dp_runs(cfg: BenchmarkConfig) -> int:
    from tasks.train_dp import expand_grid, expand_tuning

    t = _section(cfg, "train_dp")
    prepared = {d.name: "" for d in t.datasets}
    search = 1 + len(expand_tuning(t, prepared)) if t.tuning is not None else 0  # its record and its points
    return 1 + search + len(expand_grid(t, prepared))


def _tangent_runs(cfg: BenchmarkConfig) -> int:
    t = _section(cfg, "tangent")
    dp = len(t.dp.regimes) * 2 * len(t.dp.epsilons) if t.dp else 0  # tangent and non-linear, per epsilon
    # flow + feature cache + Table 1 (taft, nlft, fc) + shards (taft and nlft) + Table 2 (3 per shard count)
    # + Fig. 1 (subtraction curve, retraining, one per forgotten fraction, the forget request's 5 methods) + Table 3;
    # with seeds, that once per seed under one run of the flow
    one = 1 + 1 + 3 + sum(2 * n for n in t.shards) + 3 * len(t.shards) + 2 + len(t.forget_fractions) + 5 + dp
    return one if t.seeds is None else 1 + len(t.seeds) * one


def _secure_inference_runs(cfg: BenchmarkConfig) -> int:
    from tasks.secure_inference_models import models_needed

    s = _section(cfg, "secure_inference")
    # flow + one training run per model + one generation per method + the scaling points; with seeds, that once per
    # seed under one run of the flow
    scaling = len([m for m in s.scaling_methods if m in s.methods]) * len(s.scaling_gen_lens) + len(
        s.scaling_methods
    ) * len(s.scaling_sizes)
    one = 1 + len(models_needed(s)) + len(s.methods) + scaling
    return one if s.seeds is None else 1 + len(s.seeds) * one


def _stip_runs(cfg: BenchmarkConfig) -> int:
    s = _section(cfg, "stip")
    designs = [len(m.designs or s.designs) for m in s.models]  # a protocol run per design, and an attacks run
    attacked = [n for m, n in zip(s.models, designs, strict=True) if m.attacks is None or m.attacks]  # where attacked
    return 1 + sum(designs) + sum(attacked)


def _attacks_runs(cfg: BenchmarkConfig) -> int:
    from tasks.audit import audit_targets

    a = _section(cfg, "attacks")
    f, u, audit = a.film, a.utility, a.audit
    trained = sum(p.kind == "trained" and p.path is None for p in f.priors) if f else 0
    film = trained + 1 + len(f.victims) * len(f.batch_sizes) if f else 0  # priors, coverage, FILM
    per_seed = len(u.lm_datasets) * len(u.embeddings) + (len(u.mt_embeddings) if u.translation else 0) if u else 0
    utility = per_seed * len(u.run_seeds) if u else 0
    audits = len(audit_targets(audit)) + bool(audit.unlearning) if audit else 0
    return 1 + film + utility + audits


def _attacks_prepare_runs(cfg: BenchmarkConfig) -> int:
    """The prepare subflow of the attacks stage run on its own: its texts, audited datasets, and the tangent
    stage's images and model when it audits unlearning."""
    a = _section(cfg, "attacks")
    unlearning = a.audit is not None and a.audit.unlearning
    return 1 + len(a.text_datasets()) + (len(a.audit.datasets) if a.audit else 0) + 2 * unlearning


def _section(cfg: BenchmarkConfig, name: str) -> Any:
    section = getattr(cfg, name)
    if section is None:
        raise ConfigError(f"profile {cfg.profile!r} has no {name} section")
    return section


def _benchmark_runs(cfg: BenchmarkConfig) -> dict[str, int | None]:
    """Each configured stage under the benchmark's run, on the prepared data of one prepare flow."""
    stages: dict[str, int | None] = {"benchmark": 1, "prepare": _prepare_runs(cfg.prepare)}
    for flow, section, count in (
        ("train-dp", "train_dp", _train_dp_runs),
        ("tangent", "tangent", _tangent_runs),
        ("secure-inference", "secure_inference", _secure_inference_runs),
        ("stip", "stip", _stip_runs),
        ("attacks", "attacks", _attacks_runs),
    ):
        if getattr(cfg, section) is not None:
            stages[flow] = count(cfg)
    return stages


PLANS: dict[str, Callable[[BenchmarkConfig], dict[str, int | None]]] = {
    "prepare": lambda cfg: {"prepare": _prepare_runs(cfg.prepare)},
    "train-dp": lambda cfg: {"prepare": 1 + len(_section(cfg, "train_dp").datasets), "train-dp": _train_dp_runs(cfg)},
    "tangent": lambda cfg: {"prepare": 3, "tangent": _tangent_runs(cfg)},  # its image dataset and model
    "secure-inference": lambda cfg: {"secure-inference": _secure_inference_runs(cfg)},
    "stip": lambda cfg: {"stip": _stip_runs(cfg)},
    "attacks": lambda cfg: {"prepare": _attacks_prepare_runs(cfg), "attacks": _attacks_runs(cfg)},
    "benchmark": _benchmark_runs,
}
