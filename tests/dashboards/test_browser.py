"""In a real browser: ``privbench dashboard`` and ``privbench ui`` started on the filled store, screenshots taken by
headless Chromium once the pages have rendered their content (not the loading skeleton). With
``PRIVBENCH_UPDATE_SCREENSHOTS=1`` the screenshots are also written to ``docs/img/`` for the README."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.browser import browser, chromium, free_port, screenshot, wait_http
from tests.filled_store import FilledStore

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = ROOT / "docs" / "img"


@contextmanager
def serving(args: list[str], env: dict[str, str], health: str, log: Path) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "privbench"), *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_http(health, 120, proc)
            yield
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _env(store: FilledStore, mlflow_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return env | store.env | {"PRIVBENCH_MLFLOW_UI_URL": f"http://127.0.0.1:{mlflow_port}",
                              "MLFLOW_DISABLE_TELEMETRY": "true"}


def _not_a_skeleton(path: Path) -> None:
    """A rendered page has text and charts: many distinct colours, and ink over a good part of it. The loading
    skeleton is a few light-grey bars on white."""
    img = Image.open(path).convert("RGB")
    small = img.resize((img.width // 4, img.height // 4))
    pixels = np.asarray(small).reshape(-1, 3).astype(int)
    colours = len(np.unique(pixels, axis=0))
    dark = float((pixels.sum(axis=1) < 384).mean())
    assert colours > 200 and dark > 0.001, f"{path.name} looks unrendered: {colours} colours, {dark:.4f} dark"


def _publish(path: Path) -> None:
    if os.environ.get("PRIVBENCH_UPDATE_SCREENSHOTS"):
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS / path.name)


def test_dashboard_and_mlflow_compare_render_in_chromium(filled_store: FilledStore, tmp_path: Path) -> None:
    chromium()
    from storage.repository import ResultsRepository

    repo = ResultsRepository(filled_store.db_url)
    _, rows = repo.query("select mlflow_run_id, mlflow_experiment_id from runs where stage = 'train-dp' "
                         "and technique != 'flow' and status = 'finished' order by technique, started_at")
    assert len(rows) >= 2
    runs = [r for r, _ in rows]
    ui_port, dash_port = free_port(), free_port()
    env = _env(filled_store, ui_port)
    with serving(["ui", "--port", str(ui_port)], env, f"http://127.0.0.1:{ui_port}/health", tmp_path / "ui.log"), \
         serving(["dashboard", "--port", str(dash_port)], env, f"http://127.0.0.1:{dash_port}/_stcore/health",
                 tmp_path / "dashboard.log"), browser() as page:
        # the dashboard: the overview's run table, then the private-training tab's charts
        text = screenshot(page, f"http://127.0.0.1:{dash_port}/", tmp_path / "dashboard-overview.png",
                          texts=["privbench results", "Overview", "finished"], min_charts=1,
                          chart_selector="canvas")
        assert "Traceback" not in text and "Error" not in text
        page.click("[...document.querySelectorAll('[role=tab]')]"
                   ".find(b => b.innerText.includes('Private training'))")
        text = screenshot(page, None, tmp_path / "dashboard.png",
                          texts=["Privacy-utility (DPFormer)", "Clipping speed and memory"], min_charts=3,
                          chart_selector=".js-plotly-plot .main-svg")
        assert "No private-training runs yet" not in text
        # MLflow's compare view of the train-dp grid points: the shared run.* params line them up
        query = urllib.parse.urlencode({"runs": json.dumps(runs), "experiments": json.dumps([rows[0][1]])})
        text = screenshot(page, f"http://127.0.0.1:{ui_port}/#/compare-runs?{query}", tmp_path / "mlflow-compare.png",
                          texts=["run.technique", "test_ndcg_at_10"], min_charts=0)
        assert f"Comparing {len(runs)} Runs" in text
    for name in ("dashboard-overview.png", "dashboard.png", "mlflow-compare.png"):
        _not_a_skeleton(tmp_path / name)
        _publish(tmp_path / name)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
