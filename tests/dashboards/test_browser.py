"""In a real browser: ``privbench dashboard`` and ``privbench ui`` started on a copy of the filled store whose
train-dp grid was run again at two more seeds (real tiny runs), so that the leaderboard has three seeds per
method. Headless Chromium opens the overview (the leaderboards must show the values ``storage.leaderboard``
computes, intervals included, and the store's path relative to where the dashboard runs), clicks through every
tab, follows a leaderboard's compare link into MLflow's compare view, and takes screenshots once the pages have
rendered their content (not the loading skeleton, not a sidebar sliding in). With
``PRIVBENCH_UPDATE_SCREENSHOTS=1`` the screenshots are also written to ``docs/img/`` for the README."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dashboards import tables
from tests.browser import Page, browser, chromium, free_port, screenshot, settle, wait_http
from tests.filled_store import FilledStore

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = ROOT / "docs" / "img"
SEEDS = (1, 2)  # run again, on top of the filled store's seed 0
# every tab of the dashboard and what it shows once rendered (secure inference: its empty state without CrypTen)
TABS = {
    "Private training": ["Privacy-utility (DPFormer)", "Clipping speed and memory"],
    "Tangent": ["Accuracy vs number of shards", "Unlearning (forgetting shards)"],
    "Secure inference": ["MPC cost per operation"],
    "STIP": ["Protocol overhead", "Permutation-recovery attacks"],
    "Attacks": ["FILM text recovery vs SEB", "Membership-inference audit"],
}
# the rows of every dataframe of the page (Glide's accessible grid: header row, then the rendered rows)
GRIDS_JS = (
    "[...document.querySelectorAll('[data-testid=stDataFrame]')].filter(d => d.offsetParent !== null)"
    ".map(d => [...d.querySelectorAll('[role=row]')].map(r => "
    "[...r.querySelectorAll('[role=gridcell],[role=columnheader]')].map(c => c.innerText.trim())))"
)
SIDEBAR_JS = (
    "(() => { const r = document.querySelector('[data-testid=stSidebar]').getBoundingClientRect(); "
    "return [r.x, r.width]; })()"
)


@contextmanager
def serving(args: list[str], env: dict[str, str], health: str, log: Path, cwd: Path) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "privbench"), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
        )
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
    """The servers' environment: this checkout first on the path (the dashboard under test, not an installed
    one), the store, the MLflow UI the dashboard links to."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return (
        env
        | store.env
        | {
            "PRIVBENCH_MLFLOW_UI_URL": f"http://127.0.0.1:{mlflow_port}",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "PYTHONPATH": path,
        }
    )


def _copy_sqlite(src: Path, dst: Path) -> None:
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        with target:
            source.backup(target)
    finally:
        source.close()
        target.close()


def _with_more_seeds(store: FilledStore, base: Path) -> FilledStore:
    """A copy of ``store`` under ``base`` (the session's filled store stays as other tests expect it) with the
    train-dp grid of the filled store run again at ``SEEDS``: real tiny runs, recorded and tracked."""
    from flows.train_dp import train_dp_flow, train_dp_runner
    from storage.db import dispose_engines
    from tests.flows.test_train_dp_flow import TINY

    home = base / ".privbench"
    home.mkdir(parents=True)
    dispose_engines()
    for name in ("results.db", "mlflow.db"):
        _copy_sqlite(store.home / name, home / name)
    shutil.copytree(store.home / "mlartifacts", home / "mlartifacts")
    with sqlite3.connect(home / "mlflow.db") as conn:  # the copy's artifacts are its own
        conn.execute(
            "update experiments set artifact_location = replace(artifact_location, ?, ?)", (str(store.home), str(home))
        )
        conn.execute("update runs set artifact_uri = replace(artifact_uri, ?, ?)", (str(store.home), str(home)))
    copy = replace(
        store, home=home, db_url=f"sqlite:///{home / 'results.db'}", tracking_uri=f"sqlite:///{home / 'mlflow.db'}"
    )
    assert TINY.train_dp is not None and 0 in TINY.train_dp.seeds and not set(SEEDS) & set(TINY.train_dp.seeds)
    config = TINY.train_dp.model_copy(update={"seeds": SEEDS})
    with pytest.MonkeyPatch.context() as mp:
        for key, value in copy.env.items():
            mp.setenv(key, value)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        try:
            train_dp_flow.with_options(task_runner=train_dp_runner(config))(config, TINY.prepare, profile="tiny")
        finally:
            dispose_engines()
    return copy


def _not_a_skeleton(path: Path) -> None:
    """A rendered page has text and charts: many distinct colours, and ink over a good part of it. The loading
    skeleton is a few light-grey bars on white."""
    img = Image.open(path).convert("RGB")
    small = img.resize((img.width // 4, img.height // 4))
    pixels = np.asarray(small).reshape(-1, 3).astype(int)
    colours = len(np.unique(pixels, axis=0))
    dark = float((pixels.sum(axis=1) < 384).mean())
    assert colours > 200 and dark > 0.001, f"{path.name} looks unrendered: {colours} colours, {dark:.4f} dark"


def _sidebar_drawn(page: Page) -> None:
    x, width = page.evaluate(SIDEBAR_JS)
    assert x == 0 and width > 200, f"the sidebar is not fully drawn: x={x}, width={width}"


def _publish(path: Path) -> None:
    if os.environ.get("PRIVBENCH_UPDATE_SCREENSHOTS"):
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS / path.name)


def _click_tab(page: Page, name: str) -> None:
    page.click(f"[...document.querySelectorAll('[role=tab]')].find(b => b.innerText.trim() === {name!r})")


@pytest.mark.system  # the dashboard's and MLflow's real servers in a headless browser (CI runs it)
def test_dashboard_and_mlflow_compare_render_in_chromium(filled_store: FilledStore, tmp_path: Path) -> None:
    chromium()
    from storage.leaderboard import leaderboard

    started = time.perf_counter()
    store = _with_more_seeds(filled_store, tmp_path / "seeded")
    print(f"train-dp at seeds {SEEDS}: {time.perf_counter() - started:.0f} s")
    ranked = leaderboard(store.db_url)
    key = ranked[(ranked["board"] == "train-dp") & (ranked["metric"] == "ndcg_at_10")]
    assert len(key) >= 4 and (key["n"] == 1 + len(SEEDS)).all(), key[["context", "method", "n"]]
    n_boards = ranked["board"].nunique()
    ui_port, dash_port = free_port(), free_port()
    env = _env(store, ui_port)
    where = store.home.parent  # both started where the store is: the dashboard shows its path relative to it
    with (
        serving(["ui", "--port", str(ui_port)], env, f"http://127.0.0.1:{ui_port}/health", tmp_path / "ui.log", where),
        serving(
            ["dashboard", "--port", str(dash_port)],
            env,
            f"http://127.0.0.1:{dash_port}/_stcore/health",
            tmp_path / "dashboard.log",
            where,
        ),
        browser() as page,
    ):
        # the overview: the leaderboards first, with the store's values and intervals, then the runs
        text = screenshot(
            page,
            f"http://127.0.0.1:{dash_port}/",
            tmp_path / "dashboard-overview.png",
            texts=["privbench results", "Which method wins", "Private training (DPFormer)", "Recent runs", "finished"],
            min_charts=n_boards + 1,
            chart_selector="canvas",
        )
        _sidebar_drawn(page)
        assert "Traceback" not in text and "Error" not in text
        assert "store: sqlite:///.privbench/results.db" in text and str(where) not in text
        grids = page.evaluate(GRIDS_JS)
        header, *rows = grids[0]  # the first board: private training on test NDCG@10
        assert header == ["setting", "method", "test NDCG@10 (higher is better)", "95% interval", "n", "best", "MLflow"]
        assert len(rows) == len(key)
        for cells, row in zip(rows, key.to_dict("records"), strict=True):
            assert cells[:2] == [row["context"], row["method"]]
            assert cells[2] == f"{tables.fmt(row['mean'])} ± {tables.fmt(row['half_width'])}", cells
            assert cells[3] == f"[{tables.fmt(row['ci_low'])}, {tables.fmt(row['ci_high'])}]", cells
            assert cells[4] == str(1 + len(SEEDS)) and cells[5] in ("", "★", "★ clear win")
            assert cells[6].startswith(f"http://127.0.0.1:{ui_port}/#/compare-runs?runs=")
        assert sum(len(g) > 1 for g in grids) >= n_boards + 1  # every board has rows, and so has the run table
        compare = page.evaluate(
            "[...document.querySelectorAll('a')].find(a => a.innerText.trim() === 'ml-1m-tiny, ε=8').href"
        )
        assert compare.startswith(f"http://127.0.0.1:{ui_port}/#/compare-runs?")

        # every tab, clicked; the private-training tab is the README's screenshot
        for tab, texts in TABS.items():
            _click_tab(page, tab)
            if tab == "Private training":
                text = screenshot(
                    page,
                    None,
                    tmp_path / "dashboard.png",
                    texts=texts,
                    min_charts=3,
                    chart_selector=".js-plotly-plot .main-svg",
                )
                _sidebar_drawn(page)
                assert "No private-training runs yet" not in text
            else:
                text = settle(page, texts)
            assert "Traceback" not in text, tab

        # the leaderboard's compare link of the private grid points: MLflow's compare view lines them up
        n_runs = int(key.loc[key["context"] == "ml-1m-tiny, ε=8", "n"].sum())
        text = screenshot(
            page,
            compare,
            tmp_path / "mlflow-compare.png",
            texts=["run.technique", "test_ndcg_at_10"],
            min_charts=0,
            max_height=1600,
        )
        assert f"Comparing {n_runs} Runs" in text
    for name in ("dashboard-overview.png", "dashboard.png", "mlflow-compare.png"):
        _not_a_skeleton(tmp_path / name)
    # the overview in the docs is a real profile run's (tests/dashboards/readme_screenshot.py), not this tiny store's
    for name in ("dashboard.png", "mlflow-compare.png"):
        _publish(tmp_path / name)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
