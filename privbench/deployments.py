"""The deployments of ``deploy/prefect.yaml``, for ``privbench serve`` (one machine: ``prefect.serve`` runs
them, schedules and concurrency limits included, in subprocesses of this process) and ``privbench deploy``
(registers them on the Prefect server at ``PREFECT_API_URL`` for workers polling the ``cpu`` and ``gpu`` pools).

The YAML file is the single source: ``serve`` builds its deployments from the same entries (names, parameters,
schedules, concurrency limits, descriptions, tags) that ``prefect deploy`` reads, so the two cannot drift.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from core.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = REPO_ROOT / "deploy" / "prefect.yaml"
POOL_TYPE = "process"


def load_spec(path: Path = DEFAULT_SPEC) -> dict[str, Any]:
    """The parsed ``prefect.yaml`` (anchors and aliases resolved), checked for what privbench relies on."""
    if not path.is_file():
        raise ConfigError(f"no deployment file at {path}; run from a checkout of privbench or pass --file")
    spec = yaml.safe_load(path.read_text())
    deployments = spec.get("deployments") if isinstance(spec, dict) else None
    if not isinstance(deployments, list) or not deployments:
        raise ConfigError(f"{path} has no `deployments:` list")
    for dep in deployments:
        missing = [k for k in ("name", "entrypoint", "work_pool") if not dep.get(k)]
        if missing:
            raise ConfigError(f"deployment {dep.get('name', '?')!r} in {path} lacks {', '.join(missing)}")
    return spec


def select(spec: dict[str, Any], names: Sequence[str] = (), pools: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The deployments named in ``names`` (all when empty) on the work pools in ``pools`` (all when empty)."""
    deployments = spec["deployments"]
    known = [d["name"] for d in deployments]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ConfigError(f"unknown deployment(s) {', '.join(unknown)}; known: {', '.join(known)}")
    known_pools = sorted({d["work_pool"]["name"] for d in deployments})
    bad_pools = sorted(set(pools) - set(known_pools))
    if bad_pools:
        raise ConfigError(f"unknown work pool(s) {', '.join(bad_pools)}; the deployments use {', '.join(known_pools)}")
    return [d for d in deployments
            if (not names or d["name"] in names) and (not pools or d["work_pool"]["name"] in pools)]


def load_flow(entrypoint: str) -> Any:
    """The Prefect flow at ``path/to/file.py:function`` (relative to the repository root)."""
    path, _, attr = entrypoint.partition(":")
    module = path.removesuffix(".py").replace("/", ".")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"entrypoint {entrypoint!r} does not name a flow: {exc}") from None
    if not hasattr(found, "to_deployment"):
        raise ConfigError(f"entrypoint {entrypoint!r} is not a Prefect flow")
    return found


def schedules_of(dep: dict[str, Any]) -> list[Any]:
    from prefect.schedules import Cron

    out = []
    for s in dep.get("schedules") or ():
        if "cron" not in s:
            raise ConfigError(f"deployment {dep['name']!r}: only cron schedules are supported, got {s!r}")
        out.append(Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True)))
    return out


def concurrency_of(dep: dict[str, Any]) -> Any:
    from prefect.client.schemas.objects import ConcurrencyLimitConfig

    limit = dep.get("concurrency_limit")
    if limit is None or isinstance(limit, int):
        return limit
    return ConcurrencyLimitConfig(limit=limit["limit"],
                                  collision_strategy=limit.get("collision_strategy", "ENQUEUE"))


def runner_deployments(deps: Iterable[dict[str, Any]], *, schedules: bool = True) -> list[Any]:
    """``RunnerDeployment`` objects for ``prefect.serve`` (work pools do not apply to served deployments)."""
    out = []
    for dep in deps:
        flow = load_flow(dep["entrypoint"])
        out.append(flow.to_deployment(
            name=dep["name"], description=dep.get("description"), tags=dep.get("tags"),
            parameters=dict(dep.get("parameters") or {}), schedules=schedules_of(dep) if schedules else None,
            concurrency_limit=concurrency_of(dep),
        ))
    return out


def serve(deps: Sequence[dict[str, Any]], *, schedules: bool = True) -> None:
    """Serve ``deps`` on this machine until interrupted (Ctrl-C, SIGTERM)."""
    from prefect import serve as prefect_serve

    prefect_serve(*runner_deployments(deps, schedules=schedules), print_starting_message=True)


def require_server() -> str:
    url = os.environ.get("PREFECT_API_URL") or _profile_api_url()
    if not url:
        raise ConfigError("PREFECT_API_URL is not set: point it at your Prefect server "
                          "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api after `prefect server start`)")
    return url


def ensure_work_pools(names: Iterable[str]) -> list[str]:
    """Create the missing process work pools among ``names``; returns those created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    created = []
    with get_client(sync_client=True) as client:
        for name in sorted(set(names)):
            try:
                pool = client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=name, type=POOL_TYPE))
                created.append(name)
                continue
            if pool.type != POOL_TYPE:
                raise ConfigError(f"work pool {name!r} exists with type {pool.type!r}; privbench's deployments need "
                                  f"a {POOL_TYPE!r} pool: delete it or rename the pool in deploy/prefect.yaml")
    return created


def register(spec_path: Path, deps: Sequence[dict[str, Any]], *, repo: Path | None = None) -> subprocess.CompletedProcess:
    """``prefect deploy`` for ``deps`` from ``spec_path``, with ``PRIVBENCH_REPO`` (the workers' checkout path)
    defaulting to this checkout. Raises ``ConfigError`` with Prefect's output when it fails."""
    env = os.environ | {"PRIVBENCH_REPO": str(repo or os.environ.get("PRIVBENCH_REPO") or REPO_ROOT)}
    cmd = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--prefect-file", str(spec_path)]
    for dep in deps:
        cmd += ["--name", dep["name"]]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"prefect deploy failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def _profile_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None
