"""Headless Chromium driven over the Chrome DevTools Protocol: a websocket and JSON, no automation package.

Enough to use a web app as a user does: open a page, wait until the app has rendered something, run
JavaScript in it, type into the focused element (real key input, so the app's own handlers see it) and
take a full-page screenshot. The browser runs with a fresh profile and no network except what the page asks for.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import ClientConnection, connect

CHROMIUM = Path("/usr/bin/chromium")
# Headless, and quiet on a closed network (without the background-networking flags Chromium's connections are
# refused many at a time); tests/test_ui.py's --dump-dom runs use the same.
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_FLAGS = (*HEADLESS_FLAGS, "--remote-debugging-port=0")  # Chromium picks a free port, writes DevToolsActivePort


class Page:
    """One tab of the browser."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=120))
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                return message["result"]

    def js(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression evaluated in the page (promises are awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:200]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120) -> Any:
        """The first truthy value of `expression`, polled; the app renders from API calls, slowly on a busy host.
        An expression that throws counts as not yet (the page may be between documents)."""
        deadline = time.monotonic() + timeout
        error = None
        while time.monotonic() < deadline:
            try:
                value = self.js(expression)
            except AssertionError as e:
                value, error = None, e
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout} s waiting for {expression} ({error})\n{self.text()[-3000:]}")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        """What the page shows as text."""
        return self.js("document.body ? document.body.innerText : ''") or ""

    def type_text(self, text: str) -> None:
        """Enter `text` into the focused element in one input event, as a paste does. (Sent a character at a time
        without a keyboard's pauses, "0.0001" reached a Vue number input as "0": the app re-rendered the field
        between the events.)"""
        self.call("Input.insertText", text=text)

    def settle(self, quiet_s: float = 2.0, timeout: float = 120) -> str:
        """The page's text once it has stopped changing for `quiet_s` (an app that renders field by field)."""
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            text = self.text()
            if text != last:
                last, since = text, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return text
            time.sleep(0.25)
        raise AssertionError(f"the page kept changing for {timeout} s")

    def screenshot(self, path: Path, max_height: int = 12000) -> Path:
        """A PNG of the whole page: the window is made as tall as the tallest scrolling content first (the UI
        scrolls an inner pane, so the document alone is one window high)."""
        width, height = self.js(
            "[window.innerWidth, Math.max(...[...document.querySelectorAll('*')].map(e => e.scrollHeight))]"
        )
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=min(height, max_height),
            deviceScaleFactor=1,
            mobile=False,
        )
        try:
            data = self.call("Page.captureScreenshot", format="png")["data"]
        finally:
            self.call("Emulation.clearDeviceMetricsOverride")
        path.write_bytes(base64.b64decode(data))
        print(f"screenshot: {path}")
        return path


@contextmanager
def chromium(profile: Path, width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A headless Chromium with a fresh profile in `profile`; yields its first tab and ends the browser after."""
    if not CHROMIUM.is_file():
        pytest.fail("Chromium is missing: apt-get install -y chromium (.ci/run installs it before the tests)")
    profile.mkdir(parents=True, exist_ok=True)
    cmd = [str(CHROMIUM), *_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(profile / "chromium.log").open("wb"))
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, (profile / "chromium.log").read_text()[-2000:]
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        tabs = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        url = next(t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page")
        with connect(url, max_size=None, open_timeout=30) as ws:
            yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
