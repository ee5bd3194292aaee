"""The worked examples of ``docs/contributing.md``, run.

Each code block there preceded by ``<!-- tested: NAME -->`` is executed here the way the page says to use it:

* example A (a new clipping method): the class block is code of ``core/dp/clipping.py`` and runs in that module's
  names; its registration is removed after each test (``clippers``). The method entry is read as an entry of
  ``core.dp.methods.METHODS``, the ``PeerMethod`` line as the line of ``pbconfig/train_dp.py``, the YAML as a
  profile's ``train_dp`` keys. Checked: the clipper equals a slow per-sample reference and keeps each clipped
  contribution within C, the configs accept it, a tiny model trains with it, and one grid point of the peer trained
  by the train-dp task lands on the store's train-dp leaderboard.
* example B (a new stage): the file blocks become the modules ``pbconfig.toy``, ``core.toy``, ``tasks.toy`` and
  ``flows.toy`` (in ``sys.modules`` for the test only); the registry block and the ``Stage`` entry are added to a
  copy of ``flows/registry.py`` executed apart (the real ``STAGES`` is never touched). Checked: the stage is
  planned and started by the registry's machinery with the flows replaced by recorders (as in
  ``tests/flows/test_registry.py``), agrees with the doc's ``CHAIN`` entry, deployment and ``prefect.yaml`` entry,
  and its real flow records the planned runs in a store.

A rename in the code that a block uses fails here; so does a name or file the page's prose cites that no longer
exists (``test_the_page_cites_only_what_exists``).
"""

from __future__ import annotations
import __future__

import ast
import copy
import importlib.util
import math
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, get_args

import pytest
import torch
import yaml
from pydantic import ValidationError, create_model

from core.dp import clipping
from core.dp import methods as dp_methods
from core.dp.clipping import CLIPPERS, FLAT_CLIP_EPS, Clipper, make_clipper
from core.dp.methods import DPTrainConfig, method_config
from core.dp.trainer import train_seqrec
from core.errors import ConfigError
from core.models import SeqRecConfig, build_seqrec, sequence_loss
from flows import registry
from pbconfig import train_dp as pb_train_dp
from pbconfig.benchmark import BenchmarkConfig, load_config, validate
from pbconfig.stages import CHAIN
from pbconfig.train_dp import PEER_METHODS, TrainDPConfig
from tests.core.dp.test_trainer import cyclic_dataset
from tests.flows.test_registry import Recorder, _prepared, stub_flows

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "contributing.md"
BLOCK = re.compile(
    r"<!-- tested: (?P<name>[a-z0-9-]+) -->\n```(?P<lang>python|yaml)\n(?P<code>.*?)^```", re.DOTALL | re.MULTILINE
)
TESTED = {
    "example-a-clipper",
    "example-a-method",
    "example-a-peer",
    "example-a-config",
    "example-b-config-model",
    "example-b-benchmark",
    "example-b-chain",
    "example-b-core",
    "example-b-task",
    "example-b-flow",
    "example-b-registry",
    "example-b-stage",
    "example-b-deployment",
    "example-b-prefect",
    "example-b-profile",
}
# example B's new files, in import order: block -> module
TOY_MODULES = {
    "example-b-config-model": "pbconfig.toy",
    "example-b-core": "core.toy",
    "example-b-task": "tasks.toy",
    "example-b-flow": "flows.toy",
}
FUTURE = __future__.annotations.compiler_flag  # the repository's modules all start with this import


def _blocks() -> dict[str, str]:
    found: dict[str, str] = {}
    for m in BLOCK.finditer(DOC.read_text(encoding="utf-8")):
        assert m["name"] not in found, f"docs/contributing.md marks two blocks {m['name']!r}"
        found[m["name"]] = m["code"]
    return found


BLOCKS = _blocks()


def _compile(name: str, mode: str = "exec", *, future: bool = True) -> Any:
    """Block ``name`` compiled as part of a module (``from __future__ import annotations``: the files it goes in
    start so); an indented fragment is dedented."""
    return compile(textwrap.dedent(BLOCKS[name]), f"docs/contributing.md [{name}]", mode, future * FUTURE, True)


def _exec(code: Any, names: dict[str, Any]) -> None:
    """Run a block (or a part of ``flows/registry.py``) in ``names``: the examples are code to run."""
    exec(code, names)  # noqa: S102


def test_the_page_marks_every_example_as_tested() -> None:
    assert set(BLOCKS) == TESTED, "docs/contributing.md's tested blocks changed: update TESTED and the tests"


# ------------------------------------------------------------------------------ example A: a clipping method


@pytest.fixture
def clippers() -> Iterator[dict[str, type[Clipper]]]:
    """The clipper registry, restored in place afterwards (``core.dp.methods`` holds the same dict)."""
    saved = dict(CLIPPERS)
    yield CLIPPERS
    CLIPPERS.clear()
    CLIPPERS.update(saved)


def _register_example(clippers: dict[str, type[Clipper]]) -> tuple[str, type[Clipper]]:
    """Run the class block as code of ``core/dp/clipping.py``: the one name it registers, and its class."""
    before = set(clippers)
    _exec(_compile("example-a-clipper"), dict(vars(clipping)))
    (name,) = set(clippers) - before
    return name, clippers[name]


def _method_entry() -> tuple[str, dict[str, Any]]:
    """The block's entry of ``core.dp.methods.METHODS``, read in that module's names."""
    ((key, value),) = eval(compile("{" + BLOCKS["example-a-method"] + "}", "docs", "eval"), vars(dp_methods)).items()
    return key, value


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = SeqRecConfig(num_items=12, max_len=6, d_model=8, n_heads=2, n_layers=1, dropout=0.0, tied=True)
    return build_seqrec(cfg).to(torch.float64).train()


IDS = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 3, 5, 12], [0, 0, 0, 0, 0, 7], [9, 9, 9, 2, 1, 4]])
TARGETS = torch.tensor([[0, 0, 4, 5, 6, 7], [2, 3, 4, 5, 12, 1], [0, 0, 0, 0, 0, 3], [9, 9, 2, 1, 4, 4]])


def _per_layer_reference(model: torch.nn.Module, clip_norm: float, normalize: bool, gamma: float) -> list[torch.Tensor]:
    """Slow and independent: one forward and backward per sample, then each of the K tensors' gradient scaled so
    that its norm is below C / sqrt(K) (flat: ``min(1, (C / sqrt K) / (norm + 1e-6 / sqrt K))``; normalised:
    ``(C / sqrt K) / (norm + gamma / sqrt K)``), summed over the samples."""
    params = [p for p in model.parameters() if p.requires_grad]
    k = len(params)
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(IDS)):
        model.zero_grad(set_to_none=True)
        sequence_loss(model(IDS[i : i + 1]), TARGETS[i : i + 1]).sum().backward()
        for acc, p in zip(total, params, strict=True):
            g = torch.zeros_like(p) if p.grad is None else p.grad
            norm = float(g.norm())
            scale = clip_norm / (math.sqrt(k) * norm + (gamma if normalize else FLAT_CLIP_EPS))
            acc += g * (scale if normalize else min(1.0, scale))
    model.zero_grad(set_to_none=True)
    return total


@pytest.mark.parametrize("normalize", [False, True])
def test_example_a_the_new_clipper_equals_a_slow_per_sample_reference(clippers: dict, normalize: bool) -> None:
    name, cls = _register_example(clippers)
    model = _model()
    reference = _per_layer_reference(copy.deepcopy(model), clip_norm=0.3, normalize=normalize, gamma=0.01)
    clipper = make_clipper(name, model, clip_norm=0.3, normalize=normalize)
    assert type(clipper) is cls and isinstance(clipper, Clipper)
    norms = clipper.backward(sequence_loss(clipper.model(IDS), TARGETS))
    clipper.close()
    assert norms.shape == (len(IDS),) and bool((norms > 0.3).all())  # the bound is active for every sample
    for p, expected in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("clip_norm", [1e-3, 0.05, 10.0])
@pytest.mark.parametrize("normalize", [False, True])
def test_example_a_each_clipped_contribution_is_within_c(clippers: dict, clip_norm: float, normalize: bool) -> None:
    name, _ = _register_example(clippers)
    for i in range(len(IDS)):
        model = _model(seed=i)
        clipper = make_clipper(name, model, clip_norm=clip_norm, normalize=normalize)
        clipper.backward(sequence_loss(clipper.model(IDS[i : i + 1]), TARGETS[i : i + 1]))
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        assert total <= clip_norm * (1 + 1e-12)


@pytest.mark.usefixtures("one_thread")
def test_example_a_the_configs_accept_it_and_a_tiny_model_trains_with_it(
    clippers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, _ = _register_example(clippers)
    key, entry = _method_entry()
    assert entry["clipping"] == name, "the doc's method entry must name the clipping method its class registers"
    assert DPTrainConfig(clipping=name, epsilon=8.0, epochs=1, batch_size=8, lr=1e-2).private
    with pytest.raises(ConfigError, match=rf"unknown clipping='{name}x'; known: .*\b{name}\b"):
        DPTrainConfig(clipping=f"{name}x", epsilon=8.0, epochs=1, batch_size=8, lr=1e-2)
    monkeypatch.setattr(dp_methods, "METHODS", MappingProxyType({**dp_methods.METHODS, key: entry}))
    tiny = {"d_model": 16, "max_len": 8, "batch_size": 8, "lr": 1e-2, "epochs": 1}
    result = train_seqrec(cyclic_dataset(), method_config(key, **tiny, epsilon=8.0, max_steps=2))
    assert result.config.clipping == name and result.steps == 2
    assert result.ledger is not None and 0 < result.ledger.epsilon <= 8.0
    assert all(math.isfinite(log.train_loss) for log in result.history)


def _peer_config_model() -> tuple[str, type[TrainDPConfig]]:
    """``TrainDPConfig`` with the doc's ``PeerMethod`` line in place of the repository's."""
    key, _ = _method_entry()
    names = dict(vars(pb_train_dp))
    _exec(_compile("example-a-peer"), names)
    peers = get_args(names["PeerMethod"])
    assert peers[: len(PEER_METHODS)] == PEER_METHODS, "the doc's PeerMethod line is the repository's plus the new one"
    assert key in peers
    peer = names["PeerMethod"]
    model = create_model("TrainDPConfigWithPeer", __base__=TrainDPConfig, peers=(tuple[peer, ...], PEER_METHODS))
    return key, model


def _tiny_train_dp(section: dict[str, Any]) -> dict[str, Any]:
    base = {
        "datasets": [{"name": "tiny", "dropout": 0.0}],
        "methods": ["transformer"],
        "epsilons": [8.0],
        "nonprivate": False,
        "epochs": 1,
        "lrs": [5e-3],
        "batch_sizes": [64],
        "max_len": 16,
        "d_model": 16,
        "eval_every": 1,
        "workers": 1,
    }
    return base | section


def test_example_a_the_peer_line_and_the_profile_put_it_in_the_grid() -> None:
    from tasks.train_dp import expand_grid

    key, model = _peer_config_model()
    section = yaml.safe_load(BLOCKS["example-a-config"])["train_dp"]
    assert key in section["peers"]
    with pytest.raises(ValidationError):  # the Literal is hand-written: without the doc's line the name is refused
        TrainDPConfig.model_validate(_tiny_train_dp(section))
    cfg = model.model_validate(_tiny_train_dp(section))
    points = [p for p in expand_grid(cfg, {"tiny": "/prepared/tiny"}) if p.method == key]
    assert [p.epsilon for p in points] == list(cfg.peer_epsilons) and all(p.dataset == "tiny" for p in points)


@pytest.mark.usefixtures("one_thread")
def test_example_a_a_grid_point_of_the_peer_reaches_the_leaderboard(
    home: Path, clippers: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the stage's own task, unchanged: the run is recorded under the method's name and ranked."""
    from pbconfig.data import DatasetSpec
    from storage.leaderboard import leaderboard
    from storage.recording import record_run
    from tasks.prepare import materialize_source, prepare_dataset
    from tasks.train_dp import expand_grid, train_point

    _register_example(clippers)
    key, entry = _method_entry()
    monkeypatch.setattr(dp_methods, "METHODS", MappingProxyType({**dp_methods.METHODS, key: entry}))
    _, model = _peer_config_model()
    cfg = model.model_validate(_tiny_train_dp(yaml.safe_load(BLOCKS["example-a-config"])["train_dp"]))
    spec = DatasetSpec(name="tiny", source="synthetic", synthetic={"preset": "ml-1m", "scale": 0.02, "seed": 3})
    with record_run(flow="prepare", stage="data", technique="flow", config={}, track=False) as prep:
        ref = prepare_dataset.fn(spec, materialize_source.fn(spec), prep.ref)
    (point,) = [p for p in expand_grid(cfg, {"tiny": ref.path}) if p.method == key]
    with record_run(flow="train-dp", stage="train-dp", technique="flow", config=cfg, profile="tiny") as flow_run:
        out = train_point.fn(point, cfg, flow_run.ref)
    assert out["status"] == "finished" and out["method"] == key
    board = leaderboard(boards=["train-dp"])
    assert key in set(board["method"])


# ---------------------------------------------------------------------------------- example B: a new stage


@pytest.fixture
def toy_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, ModuleType]:
    """The doc's new files as the modules they would be, for this test only."""
    made: dict[str, ModuleType] = {}
    for block, name in TOY_MODULES.items():
        assert name not in sys.modules and not (ROOT / f"{name.replace('.', '/')}.py").exists(), name
        path = tmp_path / f"{name.replace('.', '/')}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(BLOCKS[block], encoding="utf-8")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        made[name] = module
    return made


def _with_toy_section() -> type[BenchmarkConfig]:
    """The doc's ``BenchmarkConfig`` block, read as the real class with the one field it adds."""
    names: dict[str, Any] = {"__name__": __name__, "FrozenConfig": BenchmarkConfig}
    _exec(_compile("example-b-benchmark", future=False), names)
    cls = names["BenchmarkConfig"]
    assert issubclass(cls, BenchmarkConfig) and set(cls.model_fields) - set(BenchmarkConfig.model_fields) == {"toy"}
    return cls


def _toy_config() -> Any:
    raw = load_config("quick").model_dump(mode="json") | yaml.safe_load(BLOCKS["example-b-profile"])
    return validate(_with_toy_section(), raw, origin="docs/contributing.md")


def _registry_with_toy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A copy of ``flows/registry.py`` with the doc's functions and ``Stage`` added to ``STAGES`` before the module
    derives ``STAGE``, ``FLOWS`` and ``PLANS`` from it."""
    path = Path(registry.__file__)
    source = path.read_text(encoding="utf-8")
    anchor = "\nSTAGE: dict[str, Stage] = "
    assert source.count(anchor) == 1, (
        "flows/registry.py no longer derives STAGE from STAGES as it did: update example B of "
        "docs/contributing.md and this helper"
    )
    head, tail = source.split(anchor)
    module = ModuleType("flows._registry_with_toy")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    _exec(compile(head, str(path), "exec", FUTURE, True), module.__dict__)
    _exec(_compile("example-b-registry"), module.__dict__)
    stage = eval(_compile("example-b-stage", "eval"), module.__dict__)
    module.STAGES = (*module.STAGES, stage)
    _exec(compile(anchor + tail, str(path), "exec", FUTURE, True), module.__dict__)
    return module


def _chain_with_toy() -> tuple[Any, ...]:
    import pbconfig.stages

    entry = eval(_compile("example-b-chain", "eval"), vars(pbconfig.stages))
    assert CHAIN[-1].name == "benchmark"
    return (*CHAIN[:-1], entry, CHAIN[-1])


def _stub_flows(monkeypatch: pytest.MonkeyPatch, toy: ModuleType) -> list[tuple[str, tuple, dict]]:
    made = stub_flows(monkeypatch)
    monkeypatch.setattr(toy, "toy_flow", Recorder("toy", made))
    return made


def test_example_b_the_registry_plans_and_starts_the_declared_stage(
    toy_modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = _registry_with_toy(monkeypatch)
    calls = _stub_flows(monkeypatch, toy_modules["flows.toy"])
    cfg = _toy_config()
    runs = 1 + len(cfg.toy.sizes)
    assert reg.plan("toy", cfg) == {"toy": runs} and reg.plan("benchmark", cfg)["toy"] == runs
    assert reg.run_flow("toy", cfg) == {"stage": "toy"}
    assert calls == [("toy", (cfg.toy,), {"profile": "quick", "parent": None})]
    calls.clear()
    out = reg.run_stages(cfg, "PARENT", _prepared(cfg))
    assert [name for name, _, _ in calls] == [s.name for s in reg.STAGES] == list(out) and calls[-1][0] == "toy"
    assert calls[-1][1:] == ((cfg.toy,), {"profile": "quick", "parent": "PARENT"})
    with pytest.raises(ConfigError, match="profile 'quick' has no toy section"):
        reg.run_flow("toy", cfg.model_copy(update={"toy": None}))
    # the doc's CHAIN entry agrees with the declaration, as tests/flows/test_registry.py checks for the real stages
    chain = _chain_with_toy()
    stages = [(f.name, f.section) for f in chain if f.name not in ("prepare", "benchmark")]
    assert [(s.name, s.section) for s in reg.STAGES] == stages
    assert tuple(reg.FLOWS) == tuple(reg.PLANS) == tuple(f.name for f in chain)


def test_example_b_the_deployment_runs_the_stage_by_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.deployments

    names = dict(vars(flows.deployments))
    _exec(_compile("example-b-deployment"), names)
    (fn,) = [v for k, v in names.items() if k not in vars(flows.deployments)]
    assert fn.name == "toy-profile"
    seen: list[tuple] = []
    names["_run"] = lambda *args: seen.append(args) or {}
    fn.fn(profile="quick", overrides=["toy.seed=1"])
    assert seen == [("toy", "quick", ["toy.seed=1"])]
    deploy = (ROOT / "deploy" / "prefect.yaml").read_text(encoding="utf-8")
    spec = yaml.safe_load(deploy + "\n" + BLOCKS["example-b-prefect"])
    *others, toy = spec["deployments"]
    assert toy["entrypoint"] == f"flows/deployments.py:{fn.fn.__name__}"
    assert set(toy) <= set().union(*others)


def test_example_b_the_core_function_and_the_config_section(toy_modules: dict[str, ModuleType]) -> None:
    noisy_mean = toy_modules["core.toy"].noisy_mean
    exact = noisy_mean(1000, clip=1.0, noise_multiplier=0.0, seed=3)
    assert exact.abs_error == 0.0 and exact.released == exact.exact
    a, b = (noisy_mean(100, clip=0.5, noise_multiplier=2.0, seed=3) for _ in range(2))
    assert a == b and a.abs_error > 0 and abs(a.exact) <= 0.5
    with pytest.raises(ConfigError, match="n must be >= 1"):
        noisy_mean(0, clip=1.0, noise_multiplier=1.0, seed=0)
    with pytest.raises(ValidationError):
        toy_modules["pbconfig.toy"].ToyConfig(sizes=())


@pytest.mark.usefixtures("prefect_harness")
def test_example_b_the_toy_stage_records_the_runs_it_plans(
    home: Path, toy_modules: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage.repository import ResultsRepository

    reg = _registry_with_toy(monkeypatch)
    cfg = _toy_config()
    summary = reg.run_flow("toy", cfg)
    repo = ResultsRepository()
    runs = repo.list_runs(stage="toy", limit=None)
    assert len(runs) == reg.plan("toy", cfg)["toy"] and {r["status"] for r in runs} == {"finished"}
    assert sorted(r["technique"] for r in runs) == ["flow", *["toy-mean"] * len(cfg.toy.sizes)]
    assert [p["n"] for p in summary["points"]] == list(cfg.toy.sizes)
    assert all(p["abs_error"] >= 0 for p in summary["points"])


# ------------------------------------------------------------------------------------- the page's citations

OURS = ("core", "pbconfig", "tasks", "flows", "storage", "privbench")
DOTTED = re.compile(rf"(?:{'|'.join(OURS)})(?:\.\w+)+")
PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:\.(?:py|md|yaml)|/)")
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")
NEW_FILES = {name.replace(".", "/") + ".py" for name in TOY_MODULES.values()}


def _prose() -> str:
    """The page without its fenced code blocks (their names are checked by running them)."""
    return re.sub(r"^```.*?^```", "", DOC.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)


def _top_level(path: Path) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            names.update({(a.asname or a.name): node for a in node.names})
    return names


def _resolves(dotted: str) -> bool:
    """``pkg.module`` is a module or package of ours; ``pkg.module.NAME`` is defined at its top level;
    ``pkg.module.Class.attr`` is in the class's body."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if path.is_file():
            rest = parts[i:]
            break
    else:
        return False
    if not rest:
        return True
    node = _top_level(path).get(rest[0])
    if node is None or len(rest) > 2:
        return False
    if len(rest) == 2:
        return isinstance(node, ast.ClassDef) and any(
            getattr(n, "name", None) == rest[1]
            or (isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == rest[1])
            for n in node.body
        )
    return True


def test_the_page_cites_only_what_exists() -> None:
    prose = _prose()
    spans = re.findall(r"`([^`]+)`", prose)
    dotted = sorted({s for s in spans if DOTTED.fullmatch(s)})
    paths = sorted({s for s in spans if PATH.fullmatch(s) and "/" in s})
    assert dotted and paths
    missing = [d for d in dotted if not _resolves(d)]
    missing += [p for p in paths if p not in NEW_FILES and not (ROOT / p).exists()]
    missing += [t for t in LINK.findall(prose) if not (DOC.parent / t).exists()]
    assert not missing, f"docs/contributing.md cites what the repository does not have: {missing}"
