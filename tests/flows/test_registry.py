"""The stage declarations of ``flows/registry.py``: the benchmark chain starts every configured stage, in order, under
its run and on its prepared data; a stage run on its own gets no parent and prepares what it reads. The flows are
replaced by recorders (no Prefect, no store): this checks the wiring, the flow tests check the flows."""

from __future__ import annotations

import importlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import ConfigError
from flows import registry
from pbconfig.benchmark import load_config
from storage.repository import ResultsRepository
from tests.filled_store import StageStore

FLOW_MODULES = {
    "train-dp": ("flows.train_dp", "train_dp_flow", "train_dp_runner"),
    "tangent": ("flows.tangent", "tangent_flow", "tangent_runner"),
    "secure-inference": ("flows.secure_inference", "secure_inference_flow", None),
    "stip": ("flows.stip", "stip_flow", None),
    "attacks": ("flows.attacks", "attacks_flow", "attacks_runner"),
}


class Recorder:
    """Stands in for a Prefect flow: ``with_options`` returns itself, a call is recorded."""

    def __init__(self, name: str, calls: list[tuple[str, tuple, dict]]) -> None:
        self.name, self.calls = name, calls

    def with_options(self, **_: Any) -> Recorder:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((self.name, args, kwargs))
        return {"stage": self.name}


def stub_flows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, dict]]:
    """Every stage's flow replaced by a :class:`Recorder` (and its task runner factory by a no-op); returns the list
    of calls they record, in order."""
    made: list[tuple[str, tuple, dict]] = []
    for stage, (module, flow, runner) in FLOW_MODULES.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, flow, Recorder(stage, made))
        if runner:
            monkeypatch.setattr(mod, runner, lambda cfg: None)
    return made


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, dict]]:
    return stub_flows(monkeypatch)


def _prepared(cfg: Any) -> dict[str, Any]:
    """What the chain's prepare flow returns, with a path per prepared item."""
    p = cfg.prepare
    return {
        kind: {d.name: {"path": f"/prepared/{kind}/{d.name}"} for d in getattr(p, kind)}
        for kind in ("datasets", "images", "models", "texts")
    }


def test_the_chain_starts_every_configured_stage_in_order_on_its_prepared_data(calls: list) -> None:
    cfg = load_config("quick")
    prepared = _prepared(cfg)
    out = registry.run_stages(cfg, "PARENT", prepared)  # type: ignore[arg-type]
    assert [name for name, _, _ in calls] == [s.name for s in registry.STAGES] == list(out)
    kw = {name: kwargs for name, _, kwargs in calls}
    assert all(k["parent"] == "PARENT" and k["profile"] == "quick" for k in kw.values())
    datasets = {n: d["path"] for n, d in prepared["datasets"].items()}
    assert kw["train-dp"]["prepared"] == datasets
    vision = {"images": f"/prepared/images/{cfg.tangent.dataset}", "model": f"/prepared/models/{cfg.tangent.model}"}
    assert kw["tangent"]["prepared"] == vision
    a = kw["attacks"]
    assert a["prepared"] == {n: d["path"] for n, d in prepared["texts"].items()} and a["seqrec"] == datasets
    assert a["vision"] == vision and a["train_dp"] == cfg.train_dp and a["tangent"] == cfg.tangent
    assert "prepared" not in kw["secure-inference"] and "prepared" not in kw["stip"]
    # each flow gets its own section
    assert [args[0] for _, args, _ in calls] == [getattr(cfg, s.section) for s in registry.STAGES]


def test_a_stage_left_out_of_the_profile_is_skipped_by_the_chain_and_refused_on_its_own(calls: list) -> None:
    cfg = load_config("quick").model_copy(update={"stip": None})
    registry.run_stages(cfg, "PARENT", _prepared(cfg))  # type: ignore[arg-type]
    assert "stip" not in [name for name, _, _ in calls]
    with pytest.raises(ConfigError, match="profile 'quick' has no stip section; add one or use --profile quick"):
        registry.run_flow("stip", cfg)


@pytest.mark.parametrize("stage", list(FLOW_MODULES))
def test_a_stage_on_its_own_has_no_parent_and_prepares_what_it_reads(calls: list, stage: str) -> None:
    cfg = load_config("quick")
    registry.run_flow(stage, cfg)
    ((name, args, kwargs),) = calls
    assert name == stage and args[0] == registry.STAGE[stage].config(cfg) and kwargs["parent"] is None
    assert all(kwargs.get(k) is None for k in ("prepared", "seqrec", "vision"))
    if stage == "attacks":
        assert kwargs["train_dp"] == cfg.train_dp and kwargs["tangent"] == cfg.tangent


def test_the_registry_declares_the_named_stages_in_the_chains_order() -> None:
    """``pbconfig.stages`` names the chain once; the registry's stages, its flows, the deployments' entry points and
    the report's stage sections agree with it, so a new stage missing from one of them fails here."""
    from flows.deployments import PROFILE_FLOWS
    from pbconfig.claims import STAGE_SECTIONS
    from pbconfig.stages import CHAIN, FLOW_NAMES, STAGE_NAMES

    assert [(s.name, s.section) for s in registry.STAGES] == [
        (f.name, f.section) for f in CHAIN if f.name in STAGE_NAMES
    ]
    assert tuple(registry.FLOWS) == tuple(registry.PLANS) == tuple(PROFILE_FLOWS) == FLOW_NAMES
    assert STAGE_SECTIONS == {s.name: s.section for s in registry.STAGES}
    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "prefect.yaml").read_text())
    served = {d["entrypoint"].partition(":")[2] for d in spec["deployments"]}
    assert {fl.fn.__name__ for fl in PROFILE_FLOWS.values()} <= served  # every flow has a deployment


# ------------------------------------------------------------------- each stage's plan against what it recorded


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.parametrize("stage", [s.name for s in registry.STAGES])
def test_each_stage_records_the_runs_its_plan_declares(
    stage: str, stage_store: StageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs a real tiny flow of the stage recorded below its run are, technique by technique, the jobs its
    plan declares (the plan the flow dispatches from and the progress display counts), and every one finished."""
    summary = stage_store.summary(stage)
    stage_store.point_at(monkeypatch)
    _, rows = ResultsRepository().query("select id, parent_id, technique, status from runs")
    children: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for run_id, parent, technique, status in rows:
        children[parent].append((run_id, technique, status))
    below, todo = [], [summary["run_id"]]
    while todo:
        for run_id, technique, status in children[todo.pop()]:
            below.append((technique, status))
            todo.append(run_id)
    jobs = importlib.import_module(registry.STAGE[stage].tasks).plan(stage_store.configs[stage])
    assert Counter(t for t, _ in below) == Counter(j.technique for j in jobs)
    assert {s for _, s in below} == {"finished"}


def test_a_plan_is_made_of_jobs_that_name_their_technique() -> None:
    """Every job of every stage's plan at the three profiles is a :class:`tasks.jobs.Job` (it names its technique),
    and a stage counts its flow's own run and its plan's."""
    from tasks.jobs import Job

    for profile in ("quick", "reference", "paper"):
        cfg = load_config(profile)
        for s in registry.STAGES:
            if getattr(cfg, s.section) is None:
                continue
            jobs = s.jobs(cfg)
            assert jobs and all(isinstance(j, Job) and j.technique for j in jobs), (profile, s.name)
            assert s.runs(cfg) == 1 + len(jobs)
