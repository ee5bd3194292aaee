"""Headless Chromium for the browser tests, driven over the DevTools protocol: load a page, wait until it shows
the given texts and enough rendered charts (a single-page app such as Streamlit or the MLflow UI first paints a
loading skeleton, then renders over a websocket), then take a full-page PNG screenshot."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium() -> str:
    """The Chromium binary; missing: a skip outside CI, a failure in CI (``.ci/run`` installs Debian's)."""
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("CI must provide Chromium for the browser tests (.ci/run installs Debian's chromium)")
    pytest.skip("no Chromium: apt-get install chromium to run the browser tests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout:.0f} s")


class Page:
    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self.width = 1400
        self.height = 1000

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def click(self, selector_js: str) -> None:
        """A real mouse click (press and release) at the centre of the element ``selector_js`` evaluates to."""
        box = self.evaluate(
            f"(() => {{ const r = ({selector_js}).getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise AssertionError(
                f"{expression[:200]}: {reply['exceptionDetails'].get('exception', {}).get('description')}"
            )
        return reply["result"].get("value")


@contextmanager
def browser(width: int = 1400, height: int = 1000) -> Iterator[Page]:
    from websockets.sync.client import connect

    port = free_port()
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--no-first-run",
                f"--remote-debugging-port={port}",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/json/version", 60, proc)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
                target = next(t for t in json.load(r) if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=None) as ws:
                page = Page(ws)
                page.width, page.height = width, height
                page.call("Page.enable")
                page.call(
                    "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
                )
                yield page
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# what a page's full height is: the document, or the scroll container of an app that scrolls inside one
# (Streamlit's main section); and what must be stable before a screenshot: the text, the charts, the height,
# and where the sidebar is (Streamlit slides it in)
_HEIGHT_JS = (
    "Math.max(document.body.scrollHeight, document.documentElement.scrollHeight, "
    "...[...document.querySelectorAll('[data-testid=stMain], main')].map(e => e.scrollHeight))"
)
_LAYOUT_JS = (
    "(() => { const s = document.querySelector('[data-testid=stSidebar]'); "
    "const r = s ? s.getBoundingClientRect() : null; "
    "return JSON.stringify([document.body ? document.body.innerText.length : 0, "
    "r ? [Math.round(r.x), Math.round(r.width)] : null, s ? getComputedStyle(s).transform : null, "
    "document.querySelectorAll('[data-testid=stSkeleton], [data-stale=true]').length, "
    f"{_HEIGHT_JS}]); }})()"
)


def screenshot(
    page: Page,
    url: str | None,
    out: Path,
    *,
    texts: Sequence[str],
    min_charts: int = 0,
    chart_selector: str = ".js-plotly-plot .main-svg, canvas, svg.recharts-surface",
    timeout: float = 90,
    max_height: int = 6000,
) -> str:
    """Load ``url`` (None: stay on the current page), wait for every one of ``texts`` and ``min_charts`` rendered
    charts, let it settle, then save a screenshot of the whole page (up to ``max_height`` pixels) to ``out``.
    Returns the page's visible text.

    The whole page is captured by making the viewport as tall as the page (an app that scrolls inside a
    container is taller than its document) and waiting until the layout is still again (text, charts, page
    height and sidebar position unchanged over three polls, no loading skeleton or stale element): capturing
    beyond the viewport instead resizes the page during the capture and catches transitions half-drawn."""
    if url is not None:
        page.call("Page.navigate", url=url)
    deadline = time.monotonic() + timeout
    text = settle(page, texts, min_charts, chart_selector, deadline, url)
    height = min(int(page.evaluate(_HEIGHT_JS) or 0), max_height)
    if height > page.height:
        page.call(
            "Emulation.setDeviceMetricsOverride", width=page.width, height=height, deviceScaleFactor=1, mobile=False
        )
        text = settle(page, texts, min_charts, chart_selector, deadline, url)
    try:
        shot = page.call("Page.captureScreenshot", format="png")
    finally:
        if height > page.height:
            page.call(
                "Emulation.setDeviceMetricsOverride",
                width=page.width,
                height=page.height,
                deviceScaleFactor=1,
                mobile=False,
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(shot["data"]))
    return text


def settle(
    page: Page,
    texts: Sequence[str],
    min_charts: int = 0,
    chart_selector: str = ".js-plotly-plot .main-svg, canvas, svg.recharts-surface",
    deadline: float | None = None,
    url: str | None = None,
) -> str:
    """Wait until the page shows ``texts`` and ``min_charts`` charts and its layout is the same three polls in a
    row (until ``deadline``, a ``time.monotonic()``; default 90 s from now); returns its visible text."""
    deadline = time.monotonic() + 90 if deadline is None else deadline
    text, charts, layout, stable = "", 0, "", 0
    while time.monotonic() < deadline:
        text = page.evaluate("document.body ? document.body.innerText : ''") or ""
        count = page.evaluate(f"document.querySelectorAll({json.dumps(chart_selector)}).length") or 0
        now = page.evaluate(_LAYOUT_JS) or ""
        busy = json.loads(now)[3] if now else 1
        ready = all(t in text for t in texts) and count >= min_charts and not busy
        stable = stable + 1 if ready and count == charts and now == layout else 0
        charts, layout = count, now
        if stable >= 3:  # the same charts and layout three polls in a row: rendering has settled
            return text
        time.sleep(1)
    missing = [t for t in texts if t not in text]
    raise AssertionError(
        f"{url or 'the page'} did not render: missing texts {missing}, {charts} charts < {min_charts}; "
        f"layout {layout}; page text starts {text[:400]!r}"
    )
