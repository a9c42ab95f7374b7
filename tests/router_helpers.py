"""Real fake engines and an in-process router, for the router's tests.

`FakeEngines` starts `llmgw.testing.fake_engine` processes (llama-server's flags and HTTP) on
free ports; `running_router` runs a `Router` in the test's event loop, fed either static
endpoints or the bucket; `EngineState` reads what an engine itself says is in flight.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from llmgw import catalog
from llmgw.bus.server import free_port
from llmgw.router.balancer import BalancerSettings
from llmgw.router.proxy import ProxySettings
from llmgw.router.service import Router, RouterSettings
from llmgw.testing.fake_engine import write_fake_gguf

SERVED = "tiny-chat"


@dataclass
class FakeEngine:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def in_flight(self) -> int:
        """What the engine itself reports (llama-server's requests_processing gauge)."""
        status, body = self.get("/metrics")
        assert status == 200, body
        for line in body.decode().splitlines():
            if line.startswith("llamacpp:requests_processing"):
                return int(float(line.split()[-1]))
        raise AssertionError(f"no requests_processing in {body!r}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class FakeEngines:
    directory: Path
    started: list[FakeEngine] = field(default_factory=list)

    def start(
        self,
        env: dict[str, str] | None = None,
        *args: str,
        served: str = SERVED,
        wait: bool = True,
    ) -> FakeEngine:
        model = self.directory / "model.gguf"
        if not model.exists():
            write_fake_gguf(model)
        port = free_port()
        log_path = self.directory / f"engine-{port}.log"
        argv = [
            sys.executable,
            "-m",
            "llmgw.testing.fake_engine",
            "llama-server",
            "-m",
            str(model),
            "--port",
            str(port),
            "--alias",
            served,
            "--metrics",
            "-np",
            "8",
            *args,
        ]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
            )
        engine = FakeEngine(proc, port, log_path)
        self.started.append(engine)
        if wait:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    pytest.fail(f"fake engine exited: {log_path.read_text()}")
                try:
                    if engine.get("/health")[0] == 200:
                        return engine
                except OSError:
                    pass
                time.sleep(0.05)
            pytest.fail(f"fake engine not ready: {log_path.read_text()}")
        return engine

    def stop_all(self) -> None:
        for e in self.started:
            e.stop()


@contextlib.contextmanager
def fake_engines(directory: Path) -> Iterator[FakeEngines]:
    fleet = FakeEngines(directory)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def static_model(*engines: FakeEngine, model_id: str = "tiny", served: str = SERVED):
    return catalog.Model(id=model_id, served_name=served, endpoints=[e.url for e in engines])


def router_settings(**overrides) -> RouterSettings:
    """Quick to react; affinity, keys and limits as the test says."""
    balancer = overrides.pop("balancer", BalancerSettings())
    proxy = overrides.pop("proxy", ProxySettings())
    return RouterSettings(
        host="127.0.0.1",
        port=0,
        balancer=balancer,
        proxy=proxy,
        probe_interval=overrides.pop("probe_interval", 0.2),
        **overrides,
    )


@contextlib.asynccontextmanager
async def running_router(
    models: list[catalog.Model] | None = None,
    *,
    connect=None,
    settings: RouterSettings | None = None,
) -> AsyncIterator[Router]:
    """A router in this event loop: static `models`, or the bucket through `connect()`."""
    r = Router(settings or router_settings())
    async with anyio.create_task_group() as tg:
        if connect is not None:
            await tg.start(r.serve_bucket, connect)
        else:
            await tg.start(r.serve_static, models or [])
        try:
            yield r
        finally:
            tg.cancel_scope.cancel()


def chat_body(content: str = "hi", *, stream: bool = False, **extra) -> dict:
    return {
        "model": SERVED,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        **extra,
    }
