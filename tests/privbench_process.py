"""A real ``privbench`` command in a process of its own, for the tests of the command line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def privbench_process(
    args: Sequence[str], env: Mapping[str, str], *, cwd: Path = ROOT, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m privbench ARGS`` with environment ``env`` in ``cwd``, its output captured as text; a non-zero
    exit is returned, not raised."""
    return subprocess.run(
        [sys.executable, "-m", "privbench", *args],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
