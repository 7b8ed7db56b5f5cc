"""A small driver for headless Chromium over the DevTools protocol.

It speaks to the browser through the pipe that `--remote-debugging-pipe`
opens (file descriptors 3 and 4, messages separated by NUL bytes), so it
needs no WebSocket library and no port. It records what a test needs to
judge a page: console errors, uncaught exceptions and every request that
leaves the file.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--window-size=1400,1000",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(Exception):
    """The browser died, or did not answer in time."""


class Chromium:
    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="oomkit-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # The shell puts the two pipe ends on the descriptors Chromium
        # expects, by way of spare ones, since either end may already be 3 or 4.
        r, w = to_browser_r, from_browser_w
        script = f'exec 198<&{r} 199>&{w}; exec {r}<&- {w}>&-; exec 3<&198 4>&199 198<&- 199>&-; exec "$@"'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, "chromium", binary, *FLAGS, "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", "about:blank"],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=None if os.environ.get("OOMKIT_BROWSER_LOG") else subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - the browser may be gone already; it is killed next
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("Chromium did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium exited (code {self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 60) -> dict[str, Any]:
        self._next_id += 1
        mid = self._next_id
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == mid:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e["method"] == method and e.get("sessionId") == session:
                return self.events.pop(i)
        while True:
            e = self._read_message(deadline)
            if "method" not in e:
                continue
            if e["method"] == method and e.get("sessionId") == session:
                return e
            self.events.append(e)


class Page:
    """One tab, with what it logged since it was opened."""

    def __init__(self, browser: Chromium) -> None:
        self.b = browser
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = browser.send("Target.attachToTarget",
                                    {"targetId": target, "flatten": True})["sessionId"]
        self.target = target
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        return self.b.send(method, params, session=self.session, timeout=timeout)

    def open(self, path: str, timeout: float = 120) -> None:
        self.send("Page.navigate", {"url": "file://" + os.path.abspath(path)})
        self.b.wait_event("Page.loadEventFired", self.session, timeout=timeout)

    def evaluate(self, expr: str, timeout: float = 60) -> Any:
        r = self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, timeout=timeout)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expr)
            if value:
                return value
            time.sleep(0.05)
        raise BrowserError(f"timed out waiting for {expr}")

    def _mine(self) -> list[dict[str, Any]]:
        # Pull in whatever arrived meanwhile, without waiting.
        self.evaluate("0")
        return [e for e in self.b.events if e.get("sessionId") == self.session]

    def console_errors(self) -> list[str]:
        out = []
        for e in self._mine():
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append(str(d.get("exception", {}).get("description") or d.get("text")))
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(p["entry"].get("text", ""))
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self._mine()
                if e["method"] == "Network.requestWillBeSent"]

    def screenshot(self, out: str) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        with open(out, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.b.send("Target.closeTarget", {"targetId": self.target})
        except BrowserError:
            pass
