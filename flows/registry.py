"""The flow registry: the chain's stages declared once (:class:`Stage`, :data:`STAGES`, in the order they run),
and from them which flows ``privbench run`` (and the deployments of ``flows.deployments``) know, how a profile
config is handed to each, the runs each records (:func:`plan`) and the benchmark chain (:func:`run_stages`). Each
flow module is imported only when its flow runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError
from core.registry import lookup
from pbconfig.benchmark import BenchmarkConfig
from pbconfig.data import PrepareConfig

if TYPE_CHECKING:
    from storage.recording import RunRef

Prepared = dict[str, Any]  # what the chain's prepare flow returned (``prepare_flow``)


@dataclass(frozen=True)
class Stage:
    """One stage of the chain, declared once: ``name`` (the flow's name, as its rows carry it), ``section`` (its
    ``BenchmarkConfig`` section: None there, the stage does not run), ``runs`` (the runs it records, told from the
    config), ``prepare_runs`` (the runs of the prepare flow it starts when it runs on its own; None: it prepares
    nothing) and ``start(cfg, parent, prepared)``: its flow under ``parent`` on the chain's prepared data, or on
    its own (``parent`` and ``prepared`` None: it prepares what it reads). ``privbench run``, ``registry.plan``
    and the benchmark chain are derived from :data:`STAGES`; a new stage is one more entry."""

    name: str
    section: str
    runs: Callable[[BenchmarkConfig], int]
    prepare_runs: Callable[[BenchmarkConfig], int] | None
    start: Callable[[BenchmarkConfig, RunRef | None, Prepared | None], dict[str, Any]]

    def config(self, cfg: BenchmarkConfig) -> Any:
        """The stage's section of ``cfg``; ConfigError naming the profile where it has none."""
        section = getattr(cfg, self.section)
        if section is None:
            raise ConfigError(f"profile {cfg.profile!r} has no {self.section} section; add one or use --profile quick")
        return section


def _paths(prepared: Prepared | None, kind: str) -> dict[str, str] | None:
    return None if prepared is None else {name: d["path"] for name, d in prepared.get(kind, {}).items()}


def _start_train_dp(cfg: BenchmarkConfig, parent: RunRef | None, prepared: Prepared | None) -> dict[str, Any]:
    from flows.train_dp import train_dp_flow, train_dp_runner

    t = STAGE["train-dp"].config(cfg)
    flow = train_dp_flow.with_options(task_runner=train_dp_runner(t))
    return flow(t, cfg.prepare, profile=cfg.profile, parent=parent, prepared=_paths(prepared, "datasets"))


def _vision(cfg: BenchmarkConfig, prepared: Prepared | None) -> dict[str, str] | None:
    """The tangent stage's prepared image dataset and pretrained model."""
    t = cfg.tangent
    if prepared is None or t is None:
        return None
    return {"images": prepared["images"][t.dataset]["path"], "model": prepared["models"][t.model]["path"]}


def _start_tangent(cfg: BenchmarkConfig, parent: RunRef | None, prepared: Prepared | None) -> dict[str, Any]:
    from flows.tangent import tangent_flow, tangent_runner

    t = STAGE["tangent"].config(cfg)
    flow = tangent_flow.with_options(task_runner=tangent_runner(t))
    return flow(t, cfg.prepare, profile=cfg.profile, parent=parent, prepared=_vision(cfg, prepared))


def _start_secure_inference(cfg: BenchmarkConfig, parent: RunRef | None, prepared: Prepared | None) -> dict[str, Any]:
    from flows.secure_inference import secure_inference_flow

    return secure_inference_flow(STAGE["secure-inference"].config(cfg), profile=cfg.profile, parent=parent)


def _start_stip(cfg: BenchmarkConfig, parent: RunRef | None, prepared: Prepared | None) -> dict[str, Any]:
    from flows.stip import stip_flow

    return stip_flow(STAGE["stip"].config(cfg), profile=cfg.profile, parent=parent)


def _start_attacks(cfg: BenchmarkConfig, parent: RunRef | None, prepared: Prepared | None) -> dict[str, Any]:
    from flows.attacks import attacks_flow, attacks_runner

    a = STAGE["attacks"].config(cfg)
    flow = attacks_flow.with_options(task_runner=attacks_runner(a))
    return flow(
        a,
        cfg.prepare,
        profile=cfg.profile,
        parent=parent,
        prepared=_paths(prepared, "texts"),
        train_dp=cfg.train_dp,
        seqrec=_paths(prepared, "datasets"),
        tangent=cfg.tangent,
        vision=_vision(cfg, prepared),
    )


def _prepare(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.prepare import prepare_flow

    return prepare_flow(cfg.prepare, profile=cfg.profile)


def _benchmark(cfg: BenchmarkConfig) -> dict[str, Any]:
    from flows.benchmark import benchmark_flow

    return benchmark_flow(cfg)


def _alone(stage: Stage) -> Callable[[BenchmarkConfig], dict[str, Any]]:
    def run(cfg: BenchmarkConfig) -> dict[str, Any]:
        stage.config(cfg)  # no section: refused before anything runs
        return stage.start(cfg, None, None)

    return run


def run_flow(name: str, cfg: BenchmarkConfig) -> dict[str, Any]:
    return lookup("flow", FLOWS, name)(cfg)


def run_stages(cfg: BenchmarkConfig, parent: RunRef, prepared: Prepared) -> dict[str, Any]:
    """Every stage ``cfg`` configures, in the chain's order, under ``parent`` on the chain's ``prepared`` data."""
    return {s.name: s.start(cfg, parent, prepared) for s in STAGES if getattr(cfg, s.section) is not None}


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
    # one run per audited target; the unlearning audit's own run and the feature cache it records first
    audits = len(audit_targets(audit)) + 2 * bool(audit.unlearning) if audit else 0
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
        raise ConfigError(f"profile {cfg.profile!r} has no {name} section; add one or use --profile quick")
    return section


STAGES: tuple[Stage, ...] = (
    Stage("train-dp", "train_dp", _train_dp_runs, lambda cfg: 1 + len(_section(cfg, "train_dp").datasets),
          _start_train_dp),
    Stage("tangent", "tangent", _tangent_runs, lambda cfg: 3, _start_tangent),  # its image dataset and model
    Stage("secure-inference", "secure_inference", _secure_inference_runs, None, _start_secure_inference),
    Stage("stip", "stip", _stip_runs, None, _start_stip),
    Stage("attacks", "attacks", _attacks_runs, _attacks_prepare_runs, _start_attacks),
)  # fmt: skip
STAGE: dict[str, Stage] = {s.name: s for s in STAGES}

FLOWS: dict[str, Callable[[BenchmarkConfig], dict[str, Any]]] = {
    "prepare": _prepare,
    **{s.name: _alone(s) for s in STAGES},
    "benchmark": _benchmark,
}


def _benchmark_runs(cfg: BenchmarkConfig) -> dict[str, int | None]:
    """Each configured stage under the benchmark's run, on the prepared data of one prepare flow."""
    stages: dict[str, int | None] = {"benchmark": 1, "prepare": _prepare_runs(cfg.prepare)}
    stages.update({s.name: s.runs(cfg) for s in STAGES if getattr(cfg, s.section) is not None})
    return stages


def _alone_runs(stage: Stage) -> Callable[[BenchmarkConfig], dict[str, int | None]]:
    def runs(cfg: BenchmarkConfig) -> dict[str, int | None]:
        prepare = {} if stage.prepare_runs is None else {"prepare": stage.prepare_runs(cfg)}
        return prepare | {stage.name: stage.runs(cfg)}

    return runs


PLANS: dict[str, Callable[[BenchmarkConfig], dict[str, int | None]]] = {
    "prepare": lambda cfg: {"prepare": _prepare_runs(cfg.prepare)},
    **{s.name: _alone_runs(s) for s in STAGES},
    "benchmark": _benchmark_runs,
}
