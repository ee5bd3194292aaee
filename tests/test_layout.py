"""The import layers of the repository, checked on the source (every import statement, function-local ones
included) and on what a fresh interpreter really loads.

    privbench (cli, runner, supervisor, bench, deployments)    dashboards
        -> flows -> tasks -> {storage, pbconfig, core}         -> {storage, pbconfig, core}
    storage -> {pbconfig, core};  pbconfig -> core;  core -> nothing of ours

No cycle between the top-level packages; the orchestration and storage libraries stay out of the lower layers.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# for each package of ours: the packages of ours it may import (besides itself)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "pbconfig": {"core"},
    "storage": {"pbconfig", "core"},
    "tasks": {"storage", "pbconfig", "core"},
    "flows": {"tasks", "storage", "pbconfig", "core"},
    "dashboards": {"storage", "pbconfig", "core"},
    "privbench": {"flows", "tasks", "storage", "pbconfig", "core", "dashboards"},
}
OURS = set(ALLOWED)
# third-party libraries a package must not import
BANNED: dict[str, set[str]] = {
    "core": {"prefect", "mlflow", "sqlalchemy", "alembic"},
    "pbconfig": {"prefect", "mlflow", "sqlalchemy", "alembic"},
    "storage": {"prefect"},
    # every query of the store lives in storage/: the layers above call its functions
    "tasks": {"sqlalchemy", "alembic"},
    "flows": {"sqlalchemy", "alembic"},
    "dashboards": {"sqlalchemy", "alembic"},
    "privbench": {"sqlalchemy", "alembic"},
}


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every absolute import in the file, at any depth (function-local ones too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def package_edges() -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package of ours: ["file:line imports module", ...]}}`` (other packages only)."""
    edges: dict[str, dict[str, list[str]]] = {p: {} for p in OURS}
    for package in OURS:
        for path in sources(package):
            for line, module in imports(path):
                root = module.split(".")[0]
                if root in OURS and root != package:
                    edges[package].setdefault(root, []).append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return edges


def test_every_package_of_ours_has_rules() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == OURS, f"top-level packages without layering rules: {sorted(packages - OURS)}"


@pytest.mark.parametrize("package", sorted(OURS))
def test_package_imports_only_the_layers_below(package: str) -> None:
    offenders = [
        f"{where} (a {root} import; {package}/ may import {sorted(ALLOWED[package]) or 'nothing of ours'})"
        for root, places in package_edges()[package].items()
        if root not in ALLOWED[package]
        for where in places
    ]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("package", sorted(BANNED))
def test_package_keeps_out_banned_libraries(package: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module} ({package}/ must not import {sorted(BANNED[package])})"
        for path in sources(package)
        for line, module in imports(path)
        if module.split(".")[0] in BANNED[package]
    ]
    assert not offenders, "\n".join(offenders)


def test_no_import_cycle_between_packages() -> None:
    edges = package_edges()
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for package in sorted(OURS):
        if package not in state and (cycle := visit(package)):
            evidence = [f"{a} -> {b}: {edges[a][b][0]}" for a, b in itertools.pairwise(cycle)]
            pytest.fail("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(evidence))


def loaded_by(modules: list[str], forbidden: set[str]) -> str:
    """Import ``modules`` in a fresh interpreter; the loaded modules whose top level is in ``forbidden``."""
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(forbidden)!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def modules_of(package: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in sources(package)
        if "migrations" not in p.relative_to(ROOT).parts
    )


def test_core_imports_without_orchestration_or_storage() -> None:
    """Importing every core module in a fresh interpreter loads none of prefect, mlflow, sqlalchemy or another
    package of ours."""
    bad = loaded_by(
        modules_of("core"), {"prefect", "mlflow", "sqlalchemy", "storage", "tasks", "flows", "privbench", "pbconfig"}
    )
    assert bad == "", f"core pulled in: {bad}"


def test_pbconfig_imports_without_orchestration_or_storage() -> None:
    """Importing every pbconfig module loads none of prefect, mlflow, sqlalchemy, storage, tasks, flows,
    privbench."""
    bad = loaded_by(
        modules_of("pbconfig"), {"prefect", "mlflow", "sqlalchemy", "storage", "tasks", "flows", "privbench"}
    )
    assert bad == "", f"pbconfig pulled in: {bad}"


def test_storage_imports_without_orchestration() -> None:
    """Importing every storage module (the Alembic migration scripts aside) loads none of prefect, tasks, flows,
    privbench."""
    bad = loaded_by(modules_of("storage"), {"prefect", "tasks", "flows", "privbench"})
    assert bad == "", f"storage pulled in: {bad}"


def test_pbconfig_sets_the_offline_defaults() -> None:
    """``import pbconfig`` (which every package importing prefect or mlflow imports first) sets the offline
    Prefect/MLflow defaults, and does not load the config models until one is asked for."""
    code = (
        "import os, sys\n"
        "os.environ.pop('PREFECT_SERVER_ANALYTICS_ENABLED', None)\n"
        "import pbconfig\n"
        "print(os.environ['PREFECT_SERVER_ANALYTICS_ENABLED'], 'pydantic' in sys.modules)\n"
        "from pbconfig import TrainDPConfig, get_settings\n"
        "print(TrainDPConfig.__module__, get_settings.__module__)\n"
        "missing = [n for n in pbconfig.__all__ if getattr(pbconfig, n, None) is None]\n"
        "print(sorted(pbconfig.__all__) == sorted(['__version__', *pbconfig._WHERE]), missing)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["false False", "pbconfig.train_dp pbconfig.settings", "True []"]


def training_steps(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line what`` for each training step written in ``path``, in line order: a ``torch.optim`` optimiser
    made or imported, a ``.backward(...)`` call, an optimiser's ``.step()`` or ``.zero_grad()`` (the calls a training
    loop is made of)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch.optim"):
            found.append((node.lineno, f"imports {node.module}"))
        elif isinstance(node, ast.Attribute) and node.attr == "optim" and ast.unparse(node.value) == "torch":
            found.append((node.lineno, "uses torch.optim"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (node.func.attr in ("backward", "zero_grad") or (node.func.attr == "step" and not node.args))
        ):
            found.append((node.lineno, f"calls .{node.func.attr}()"))
    return [f"{path.relative_to(root)}:{line} {what}" for line, what in sorted(found)]


def test_tasks_hold_no_training_loop() -> None:
    """Tasks load, call core and record: optimisers and training loops live in core/ (a task that trains calls a
    core function that does)."""
    found = [hit for path in sources("tasks") for hit in training_steps(path)]
    assert not found, f"training steps in tasks/ (move them to a core/ function the task calls): {found}"


def test_the_training_loop_check_can_fail(tmp_path: Path) -> None:
    loop = tmp_path / "loop.py"
    loop.write_text(
        "import torch\nfrom torch.optim import Adam\n"
        "def fit(model, x):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    model(x).sum().backward()\n    opt.step()\n    opt.zero_grad()\n"
    )
    assert training_steps(loop, tmp_path) == [
        "loop.py:2 imports torch.optim", "loop.py:4 uses torch.optim", "loop.py:5 calls .backward()",
        "loop.py:6 calls .step()", "loop.py:7 calls .zero_grad()",
    ]  # fmt: skip
