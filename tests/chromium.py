"""Headless Chromium driven over the DevTools protocol, for tests of the fleet page.

Debian's `chromium` package, started with --remote-debugging-port and spoken to over its
websocket (aiohttp's client): no driver binary, no selenium, nothing beyond what the tests
already use. `find_chromium()` says where it is; tests skip without it, except where
LLMGW_REQUIRE_CHROMIUM=1 (CI) makes its absence a failure.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from llmgw.bus.server import free_port

REQUIRE = "LLMGW_REQUIRE_CHROMIUM"


def find_chromium() -> str:
    """The browser's path, or a skip (a failure under LLMGW_REQUIRE_CHROMIUM=1)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    why = "no chromium on PATH (Debian: apt-get install chromium)"
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{why}, and {REQUIRE}=1 says it must be there")
    pytest.skip(why)


def artifacts_dir() -> Path:
    """Where screenshots go: $LLMGW_TEST_ARTIFACTS, default <repo>/test-artifacts."""
    default = Path(__file__).resolve().parent.parent / "test-artifacts"
    path = Path(os.environ.get("LLMGW_TEST_ARTIFACTS", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


class Tab:
    """One page, spoken to with DevTools commands."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        await self._ws.send_str(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = await self._ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"DevTools connection ended: {msg.type}")
            data = json.loads(msg.data)
            if data.get("id") == n:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        got = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    async def until(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll a JavaScript expression until it is truthy; its value."""
        with anyio.fail_after(timeout):
            while True:
                value = await self.evaluate(expression)
                if value:
                    return value
                await anyio.sleep(0.1)

    async def screenshot(self, path: Path) -> Path:
        got = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(got["data"]))
        return path


@asynccontextmanager
async def browser(tmp: Path, width: int = 1400, height: int = 1000):
    """Headless Chromium with a fresh profile; yields a function opening a Tab at a URL."""
    port = free_port()
    proc = subprocess.Popen(
        [
            find_chromium(),
            "--headless",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--remote-debugging-address=127.0.0.1",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "chromium.log").open("wb"),
    )
    try:
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{port}"
            with anyio.fail_after(30):
                while True:
                    try:
                        async with http.get(f"{base}/json/version") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"chromium exited with {proc.returncode}: "
                            + (tmp / "chromium.log").read_text()[-2000:]
                        )
                    await anyio.sleep(0.1)

            @asynccontextmanager
            async def open_tab(url: str):
                async with http.put(f"{base}/json/new?{url}") as r:
                    target = await r.json()
                async with http.ws_connect(
                    target["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024
                ) as ws:
                    tab = Tab(ws)
                    await tab.call("Page.enable")
                    await tab.call("Runtime.enable")
                    yield tab

            yield open_tab
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
