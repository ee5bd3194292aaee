"""The documentation's dashboard picture, from a real profile run: the run's committed export is restored into a
fresh store, ``privbench dashboard`` serves it, and headless Chromium takes the overview once its leaderboards have
rendered. (The browser test's own screenshots show its tiny test store; they are not the docs' picture.)

    python -m tests.dashboards.readme_screenshot docs/results/data/reference docs/img/dashboard-overview.png
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.browser import browser, free_port, screenshot
from tests.dashboards.test_browser import BIN, ROOT, serving

TEXTS = ("privbench results", "Which method wins", "Recent runs")


def take(export: Path, out: Path, *, min_charts: int = 3) -> str:
    """Restore ``export`` (``privbench results export``) into a temporary home, screenshot the dashboard's
    overview to ``out``; returns the page's text."""
    if not (export / "manifest.json").is_file():
        raise SystemExit(f"{export} is not a store export (no manifest.json); give e.g. docs/results/data/reference")
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        # this temporary store only: no configured database, MLflow store or other privbench setting reaches it
        keep = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI" and not k.startswith("PRIVBENCH_")}
        env = keep | {
            "PRIVBENCH_HOME": str(where / ".privbench"),
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        }
        subprocess.run([str(BIN / "privbench"), "results", "restore", str(export)], env=env, check=True, cwd=where)
        port = free_port()
        health, log = f"http://127.0.0.1:{port}/_stcore/health", where / "dashboard.log"
        with serving(["dashboard", "--port", str(port)], env, health, log, where), browser() as page:
            text = screenshot(
                page,
                f"http://127.0.0.1:{port}/",
                out,
                texts=list(TEXTS),
                min_charts=min_charts,
                chart_selector="canvas",
            )
    if "Traceback" in text:
        raise SystemExit(f"the dashboard showed a traceback on {export}; see its log")
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    take(Path(args[0]).resolve(), Path(args[1]).resolve())
    print(f"wrote {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
