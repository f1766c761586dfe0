"""Headless Chromium for tests that render pages (the audit report, the documentation site)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess

import pytest
from PIL import Image


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe: records every request, failure and console
    message of a page load, evaluates JavaScript, and takes a full-page screenshot."""

    def __init__(self, exe: str, user_data: str):
        cmd_r, self._cmd_w = os.pipe()  # Chromium reads commands on fd 3
        self._evt_r, evt_w = os.pipe()  # and writes replies and events on fd 4

        def wire():
            a, b = os.dup(cmd_r), os.dup(evt_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            f"--user-data-dir={user_data}",
            "--remote-debugging-pipe",
            "--window-size=1400,1000",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            [exe, *flags], preexec_fn=wire, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(cmd_r)
        os.close(evt_w)
        self._buf, self._id, self.events = b"", 0, []
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        for domain in ("Network", "Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=True)

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._evt_r, 1 << 16)
            if not chunk:
                raise EOFError("chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: bool = False) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def load(self, url: str) -> None:
        """Open ``url`` and wait for its load event (not an earlier page's)."""
        start = len(self.events)
        self.call("Page.navigate", {"url": url}, session=True)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events[start:]):
            self.events.append(self._read())

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        return result["result"]["value"]

    def screenshot(self) -> Image.Image:
        size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        shot = self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
            },
            session=True,
        )
        return Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (EOFError, OSError):
            pass
        self.proc.wait(timeout=30)
        os.close(self._cmd_w)
        os.close(self._evt_r)


def chromium() -> str:
    """The Chromium executable, or the test skipped."""
    for name in ("chromium", "chromium-browser"):
        if exe := shutil.which(name):
            return exe
    pytest.skip("Chromium is not installed (.ci/run installs it: apt-get install chromium)")
