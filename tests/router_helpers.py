"""Real fake engines and an in-process router, for the router's tests.

`FakeEngines` starts `llmgw.sim.fake_engine` processes (llama-server's flags and HTTP) on
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

import aiohttp
import anyio
import msgspec
import pytest

from llmgw import catalog
from llmgw.bus.server import free_port
from llmgw.router.balancer import BalancerSettings
from llmgw.router.proxy import ProxySettings
from llmgw.router.service import Router, RouterSettings
from llmgw.sim.fake_engine import write_fake_gguf

SERVED = "tiny-chat"

# one small model on CPU, served as SERVED (its records are written by hand in tests)
TINY_CPU_MODEL = catalog.validate_models(
    {
        "models": [
            {
                "id": "tiny",
                "served_name": SERVED,
                "profiles": [
                    {
                        "name": "cpu",
                        "engine": "llama-server",
                        "weights": {"path": "/models/tiny.gguf"},
                        "gpus_per_node": 0,
                    }
                ],
            }
        ]
    }
)[0]


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
        kind: str = "llama-server",
    ) -> FakeEngine:
        """A fake engine as llama-server (by default) or as vLLM (`kind="vllm"`)."""
        model = self.directory / "model.gguf"
        if not model.exists():
            write_fake_gguf(model)
        port = free_port()
        log_path = self.directory / f"engine-{port}.log"
        engine_args = (
            ["llama-server", "-m", str(model), "--port", str(port), "--alias", served]
            + ["--metrics", "-np", "8"]
            if kind == "llama-server"
            else ["vllm", "serve", str(model), "--host", "127.0.0.1", "--port", str(port)]
            + ["--served-model-name", served]
        )
        argv = [sys.executable, "-m", "llmgw.sim.fake_engine", *engine_args, *args]
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
    gate=None,
) -> AsyncIterator[Router]:
    """A router in this event loop: static `models`, or the bucket through `connect()`."""
    r = Router(settings or router_settings(), gate=gate)
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


class RetryingClient:
    """What a client behind two routers does: round robin, and a request that met a
    connection error before any answer is sent again to the other router. A stream that
    breaks after its answer began is lost: that is what must never happen."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.completed = 0
        self.retried = 0
        self.lost: list[str] = []
        self._next = 0

    async def one(self, http: aiohttp.ClientSession, n: int) -> None:
        for attempt in range(20):
            url = self.urls[(self._next + attempt) % len(self.urls)]
            try:
                resp = await http.post(
                    f"{url}/v1/chat/completions", json=chat_body(f"req {n}", stream=True)
                )
            except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError):
                self.retried += 1
                await anyio.sleep(0.05)
                continue
            try:
                async with resp:
                    body = await resp.read()
            except aiohttp.ClientError as e:
                self.lost.append(f"request {n} via {url}: {e!r}")
                return
            if resp.status != 200 or not body.rstrip().endswith(b"data: [DONE]"):
                self.lost.append(f"request {n} via {url}: {resp.status} {body[-80:]!r}")
            else:
                self.completed += 1
            return
        self.lost.append(f"request {n}: no router took it in 20 attempts")

    async def run(self, http: aiohttp.ClientSession, workers: int, stop: anyio.Event) -> None:
        counter = iter(range(1_000_000))

        async def worker() -> None:
            while not stop.is_set():
                self._next += 1
                await self.one(http, next(counter))

        async with anyio.create_task_group() as tg:
            for _ in range(workers):
                tg.start_soon(worker)


class StreamingLoad:
    """Clients streaming chat completions through a router, each one request after another;
    every failure kept (a status that is not 200, a stream that does not end with [DONE], a
    connection error)."""

    def __init__(self, url: str, model: str = SERVED, **body: object) -> None:
        self.url = url
        self.model = model
        self.body = body  # more of the request: max_tokens, say
        self.completed = 0
        self.failed: list[str] = []

    async def run(self, http: aiohttp.ClientSession, workers: int, stop: anyio.Event) -> None:
        async def worker(w: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                body = chat_body(
                    f"worker {w} request {n}", stream=True, model=self.model, **self.body
                )
                try:
                    async with http.post(f"{self.url}/v1/chat/completions", json=body) as resp:
                        data = await resp.read()
                    if resp.status != 200 or not data.rstrip().endswith(b"data: [DONE]"):
                        self.failed.append(f"{resp.status}: {data[-120:]!r}")
                    else:
                        self.completed += 1
                except aiohttp.ClientError as e:
                    self.failed.append(repr(e))

        async with anyio.create_task_group() as tg:
            for w in range(workers):
                tg.start_soon(worker, w)


def tiny_model(parallel: int | None = None) -> catalog.Model:
    """TINY_CPU_MODEL, its profile running `parallel` requests at once (None: not said)."""
    profile = msgspec.structs.replace(TINY_CPU_MODEL.profiles[0], parallel=parallel)
    return msgspec.structs.replace(TINY_CPU_MODEL, profiles=[profile])


async def place_replica(bus, engine: FakeEngine, model: catalog.Model, rid: str = "r1") -> None:
    """`model` in the catalog and `engine` serving it as replica `rid`, ready on node n1
    (the records the controller and the agent would write)."""
    from llmgw.bus import keys, records

    replica = records.Replica(
        model=model.id,
        rid=rid,
        profile=model.profiles[0].name,
        members=[records.ReplicaMember(node="n1", rank=0, port=engine.port)],
        phase="ready",
        endpoint=engine.endpoint,
    )
    await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    await bus.put(keys.replica(model.id, rid), replica)
    await bus.put(
        keys.shard("n1", rid),
        records.Shard(
            node="n1",
            rid=rid,
            model=model.id,
            generation=1,
            phase="ready",
            since=time.time(),
            endpoint=engine.endpoint,
            served_name=model.served_name,
        ),
    )


async def put_key(bus, name: str, **fields: object) -> str:
    """A key in the bucket as `llmgw key create` writes it; its secret."""
    from llmgw.bus import keys, records
    from llmgw.gateway import credentials

    secret = credentials.new_secret(name)
    record = records.ApiKey(name=name, secrets=[credentials.hash_secret(secret)], **fields)
    await bus.put(keys.apikey(name), record)
    return secret
