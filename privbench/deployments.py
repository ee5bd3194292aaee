"""The deployments of ``deploy/prefect.yaml``, for ``privbench serve`` (one machine: a Prefect runner serves
them, schedules and concurrency limits included, and runs them in subprocesses of this process) and for
``privbench deploy`` (registers them on the Prefect server at ``PREFECT_API_URL`` for workers polling the ``cpu``
and ``gpu`` pools).

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
    return [
        d for d in deployments if (not names or d["name"] in names) and (not pools or d["work_pool"]["name"] in pools)
    ]


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
    return ConcurrencyLimitConfig(limit=limit["limit"], collision_strategy=limit.get("collision_strategy", "ENQUEUE"))


def serve(deps: Sequence[dict[str, Any]], *, schedules: bool = True, echo: Any = print) -> None:
    """Serve ``deps`` on this machine until interrupted (Ctrl-C, SIGTERM): a Prefect ``Runner`` that holds the
    flows in memory and runs each flow run in a subprocess of this process.

    ``Runner.add_flow`` rather than ``prefect.serve(*deployments)``: the runner then runs the flow objects it
    holds instead of loading code from the deployment's path, so serving works from any directory, and it clears
    the work pool of a deployment ``privbench deploy`` registered before. ``prefect.serve`` of deployment objects
    left such a deployment without its pull step and with an entrypoint relative to the current directory, and its
    runs failed to find their code."""
    import asyncio

    from prefect.runner import Runner

    async def main() -> None:
        runner = Runner(name="privbench-serve")
        for dep in deps:
            await runner.aadd_flow(
                load_flow(dep["entrypoint"]),
                name=dep["name"],
                description=dep.get("description"),
                tags=dep.get("tags"),
                parameters=dict(dep.get("parameters") or {}),
                schedules=schedules_of(dep) if schedules else [],
                concurrency_limit=concurrency_of(dep),
            )
        echo(f"{len(deps)} deployment(s) being served; runs start in subprocesses of this process (Ctrl-C stops)")
        await runner.start()

    asyncio.run(main())


def require_server() -> str:
    url = os.environ.get("PREFECT_API_URL") or _profile_api_url()
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: point it at your Prefect server "
            "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api after `prefect server start`)"
        )
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
                raise ConfigError(
                    f"work pool {name!r} exists with type {pool.type!r}; privbench's deployments need "
                    f"a {POOL_TYPE!r} pool: delete it or rename the pool in deploy/prefect.yaml"
                )
    return created


def register(
    spec_path: Path, deps: Sequence[dict[str, Any]], *, repo: Path | None = None
) -> subprocess.CompletedProcess:
    """``prefect deploy`` for ``deps`` from ``spec_path``, with ``PRIVBENCH_REPO`` (the workers' checkout path)
    defaulting to this checkout. Raises ``ConfigError`` with Prefect's output when it fails."""
    env = os.environ | {"PRIVBENCH_REPO": str(repo or os.environ.get("PRIVBENCH_REPO") or REPO_ROOT)}
    cmd = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--prefect-file", str(spec_path)]
    for dep in deps:
        cmd += ["--name", dep["name"]]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(
            f"prefect deploy failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    return done


ZOMBIE_AUTOMATION = "privbench: crash flow runs that stopped heartbeating"


def heartbeat_seconds() -> int:
    """``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` here (Prefect's default 180 s): how often a flow run says it lives."""
    from prefect.settings import get_current_settings

    return int(get_current_settings().flows.heartbeat_frequency or 180)


def zombie_window(seconds: float | None) -> float:
    """The zombie automation's window: ``seconds`` checked (0 disables it), or 3 heartbeat periods by default."""
    if seconds is None:
        return 3.0 * heartbeat_seconds()
    if 0 < seconds < heartbeat_seconds():
        raise ConfigError(
            f"--zombie-after {seconds:g} s is shorter than the heartbeat period "
            f"({heartbeat_seconds()} s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY): healthy runs would be "
            f"crashed; use at least 2-3 heartbeats (e.g. {3 * heartbeat_seconds()}), or 0 to disable"
        )
    if seconds < 0:
        raise ConfigError(f"--zombie-after {seconds:g} is negative: give seconds, or 0 to disable the automation")
    return float(seconds)


def ensure_zombie_automation(within_s: float) -> str:
    """Create or update the server automation that marks a flow run Crashed when neither a heartbeat nor a final
    state of it arrives within ``within_s`` seconds of its last heartbeat (Prefect's zombie-flow recipe).

    Without it, a worker host that dies with its flow process (power loss, OOM kill of the container, a lost
    node) leaves the run Running forever: nobody is left to report the crash, the deployment's concurrency slot
    stays taken and ``prefect flow-run retry`` refuses the run. Once Crashed, the run can be retried and its
    finished tasks are reused. ``within_s <= 0`` disables the automation. Returns ``created``, ``updated`` or
    ``disabled`` (or ``absent`` when there was none to disable)."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.exceptions import ObjectNotFound

    try:
        existing = Automation.read(name=ZOMBIE_AUTOMATION)
    except (ObjectNotFound, ValueError):
        existing = None
    if within_s <= 0:
        if existing is None:
            return "absent"
        existing.disable()
        return "disabled"
    zombie_window(within_s)
    terminal = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    spec = Automation(
        name=ZOMBIE_AUTOMATION,
        description=f"A flow run with no heartbeat for {within_s:g} s (its worker host died) is marked Crashed, "
        "which frees its deployment's concurrency slot and lets `prefect flow-run retry` resume it.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *terminal},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within_s:g} s: the worker host or the flow process "
                "died; retry the run to resume it",
            )
        ],
    )
    if existing is None:
        spec.create()
        return "created"
    spec.id = existing.id
    spec.update()
    return "updated"


def _profile_api_url() -> str | None:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None
