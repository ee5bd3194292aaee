"""Where and on what a run ran: git commit, host, device. Recorded on every run row and MLflow run."""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


@functools.cache
def git_commit() -> str | None:
    """The commit of the privbench checkout (``PRIVBENCH_GIT_COMMIT`` overrides, e.g. in containers)."""
    if os.environ.get("PRIVBENCH_GIT_COMMIT"):
        return os.environ["PRIVBENCH_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    ).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def host() -> str:
    return socket.gethostname()


@functools.cache
def device() -> str:
    """e.g. ``cpu: Intel(R) Xeon(R) Processor, 2 cores, torch 2.13.0+cpu`` or ``cuda: NVIDIA H100 80GB HBM3 (x1),
    torch ...``."""
    import torch  # local: storage needs torch only for this description

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return f"cuda: {name} (x{torch.cuda.device_count()}), torch {torch.__version__}"
    return f"cpu: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (an Intel Xeon and an AMD EPYC run the same work about 1.5x
    apart, so a report must say which), else the architecture ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key, value = key.strip().lower(), value.strip()
            # x86 names the model; some ARM kernels give it as "Hardware" or a non-numeric "Processor"
            if key in ("model name", "hardware") and value or key == "processor" and value and not value.isdigit():
                return value
    except OSError:
        pass
    return platform.processor() or platform.machine()
