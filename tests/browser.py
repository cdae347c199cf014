"""A headless Chromium driven over its DevTools protocol (the system's /usr/bin/chromium: nothing is
downloaded), for the tests that look at the dashboard in a real browser."""
from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import httpx

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


class Browser:
    """One headless browser with one page; `evaluate` runs JavaScript in it and returns the value."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1600) -> None:
        from websockets.sync.client import connect

        self._stack = contextlib.ExitStack()
        # Chromium's helper processes can outlive the main one for a moment and still write to the
        # profile: its removal must not fail the test run (a teardown error once did, 2026-12-01).
        self._profile = tempfile.TemporaryDirectory(prefix="minivllm-chromium-", ignore_cleanup_errors=True)
        self.proc = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--window-size={width},{height}",
             f"--user-data-dir={self._profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        port = self._devtools_port()
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
        self._ws = self._stack.enter_context(connect(pages[0]["webSocketDebuggerUrl"], max_size=2**26))
        self._ids = itertools.count(1)

    def _devtools_port(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(m.group(1))
            if not line and self.proc.poll() is not None:
                break
        self.close()
        raise RuntimeError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; events that arrive meanwhile are dropped."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float) -> Any:
        """Poll `expression` until it is truthy (one that throws, as while the page loads, is false)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.evaluate(f"(() => {{ try {{ return ({expression}); }} catch {{ return null; }} }})()"):
                return value
            time.sleep(0.25)
        raise TimeoutError(f"still false after {timeout} s: {expression}")

    def screenshot(self, path: str) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        self._stack.close()
        with contextlib.suppress(ProcessLookupError):  # its own session: the helpers go with it
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stderr.close()
        self._profile.cleanup()
