"""The flow registry: the chain's stages declared once (:class:`Stage`, :data:`STAGES`, in the order they run),
and from them which flows ``privbench run`` (and the deployments of ``flows.deployments``) know, how a profile
config is handed to each, the runs each records (:func:`plan`, counted from each stage's own plan of jobs, the
one its flow dispatches from) and the benchmark chain (:func:`run_stages`). Each flow module is imported only when
its flow runs, each stage's plan only when it is asked for."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError
from core.registry import lookup
from pbconfig.benchmark import BenchmarkConfig
from pbconfig.data import PrepareConfig

if TYPE_CHECKING:
    from storage.recording import RunRef
    from tasks.jobs import Job

Prepared = dict[str, Any]  # what the chain's prepare flow returned (``prepare_flow``)


@dataclass(frozen=True)
class Stage:
    """One stage of the chain, declared once: ``name`` (the flow's name, as its rows carry it), ``section`` (its
    ``BenchmarkConfig`` section: None there, the stage does not run), ``tasks`` (the module of its tasks whose
    ``plan(section) -> list[Job]`` declares every run it records below its flow run, :mod:`tasks.jobs`),
    ``prepare_runs`` (the runs of the prepare flow it starts when it runs on its own; None: it prepares nothing)
    and ``start(cfg, parent, prepared)``: its flow under ``parent`` on the chain's prepared data, or on its own
    (``parent`` and ``prepared`` None: it prepares what it reads). ``privbench run``, ``registry.plan`` and the
    benchmark chain are derived from :data:`STAGES`; a new stage is one more entry."""

    name: str
    section: str
    tasks: str
    prepare_runs: Callable[[BenchmarkConfig], int] | None
    start: Callable[[BenchmarkConfig, RunRef | None, Prepared | None], dict[str, Any]]

    def config(self, cfg: BenchmarkConfig) -> Any:
        """The stage's section of ``cfg``; ConfigError naming the profile where it has none."""
        section = getattr(cfg, self.section)
        if section is None:
            raise ConfigError(f"profile {cfg.profile!r} has no {self.section} section; add one or use --profile quick")
        return section

    def jobs(self, cfg: BenchmarkConfig) -> list[Job]:
        """Every run the stage records below its flow run, as its tasks' ``plan`` declares them."""
        jobs: list[Job] = importlib.import_module(self.tasks).plan(self.config(cfg))
        return jobs

    def runs(self, cfg: BenchmarkConfig) -> int:
        """The runs the stage records: its flow's own and its plan's."""
        return 1 + len(self.jobs(cfg))


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


def _attacks_prepare_runs(cfg: BenchmarkConfig) -> int:
    """The prepare subflow of the attacks stage run on its own: its texts, audited datasets, and the tangent
    stage's images and model when it audits unlearning."""
    a = STAGE["attacks"].config(cfg)
    unlearning = a.audit is not None and a.audit.unlearning
    return 1 + len(a.text_datasets()) + (len(a.audit.datasets) if a.audit else 0) + 2 * unlearning


STAGES: tuple[Stage, ...] = (
    Stage("train-dp", "train_dp", "tasks.train_dp", lambda cfg: 1 + len(STAGE["train-dp"].config(cfg).datasets),
          _start_train_dp),
    Stage("tangent", "tangent", "tasks.tangent_plan", lambda cfg: 3, _start_tangent),  # its images and model
    Stage("secure-inference", "secure_inference", "tasks.secure_inference", None, _start_secure_inference),
    Stage("stip", "stip", "tasks.stip", None, _start_stip),
    Stage("attacks", "attacks", "tasks.attacks", _attacks_prepare_runs, _start_attacks),
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
