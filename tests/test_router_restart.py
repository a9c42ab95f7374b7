"""Restarting routers drops no stream: SIGTERM on `llmgw router` (and Ctrl-C on `llmgw up`)
stops accepting, lets what is in flight finish within the grace, then exits; and a rolling
restart of two routers under streamed load, behind a client that retries connection
errors, loses no request. What the operations checks ("no request dropped") rely on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anyio
import pytest
from autoscale_fleet import autoscaled_model, serve_auto
from router_helpers import SERVED, FakeEngine, RetryingClient, chat_body
from waiting import until, until_logged

from llmgw.bus.server import free_port

pytestmark = pytest.mark.anyio

LLMGW = [sys.executable, "-m", "llmgw.cli"]
# 30 tokens at 20 a second: a stream lasts 1.5 s
STREAM = {"FAKE_ENGINE_TOKENS": "30", "FAKE_ENGINE_TOKEN_RATE": "20"}


class RouterProcess:
    """`llmgw router --catalog FILE` as a user runs it, on a port of its own."""

    def __init__(
        self, catalog: Path | None, logs: Path, port: int | None = None, *args: str
    ) -> None:
        self.catalog, self.logs, self.args = catalog, logs, args
        self.port = port or free_port()
        self.starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.logs / f"router-{self.port}-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    *LLMGW,
                    "--log-level",
                    "INFO",
                    "router",
                    *(("--catalog", str(self.catalog)) if self.catalog else ()),
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    *self.args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        until_logged(self.proc, self.log, "router listening")

    def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _catalog(path: Path, *engines: FakeEngine) -> Path:
    urls = ", ".join(f'"{e.url}"' for e in engines)
    path.write_text(f'[[models]]\nid = "tiny"\nserved_name = "{SERVED}"\nendpoints = [{urls}]\n')
    return path


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


async def _stream(http: aiohttp.ClientSession, url: str, content: str) -> list[str]:
    """One streamed chat completion, read whole: its tokens, or an exception."""
    tokens = []
    async with http.post(
        f"{url}/v1/chat/completions", json=chat_body(content, stream=True)
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    tokens.append(delta)
            elif line.strip() == b"data: [DONE]":
                return tokens
    raise AssertionError(f"the stream ended without [DONE] after {len(tokens)} tokens")


async def test_sigterm_lets_a_stream_in_flight_finish_whole_and_refuses_new_connections(
    engines, tmp_path
):
    engine = engines.start(STREAM)
    router = RouterProcess(_catalog(tmp_path / "static.toml", engine), tmp_path)
    router.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with anyio.create_task_group() as tg:
                result: dict[str, list[str]] = {}

                async def client() -> None:
                    result["tokens"] = await _stream(http, router.url, "in flight")

                tg.start_soon(client)
                await anyio.sleep(0.5)  # the stream has begun
                router.terminate()
                await anyio.sleep(0.3)
                assert _refused(router.port)  # no new connection once it drains
                assert router.proc is not None and router.proc.poll() is None  # still serving
        assert result["tokens"] == [f"tok{i} " for i in range(30)]  # whole
        assert router.wait(10) == 0
        log = router.log.read_text()
        assert "every request in flight finished" in log
    finally:
        router.stop()


async def test_past_the_grace_a_stream_is_cut_and_the_router_says_so(engines, tmp_path):
    engine = engines.start({"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_RATE": "20"})
    router = RouterProcess(
        _catalog(tmp_path / "static.toml", engine), tmp_path, None, "--shutdown-grace", "0.5"
    )
    router.start()
    try:
        async with aiohttp.ClientSession() as http:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    failed: list[BaseException] = []

                    async def client() -> None:
                        try:
                            await _stream(http, router.url, "too long")
                        except (aiohttp.ClientError, AssertionError) as e:
                            failed.append(e)

                    tg.start_soon(client)
                    await anyio.sleep(0.5)
                    started = time.monotonic()
                    router.terminate()
        assert failed, "a 20 s stream outlived a 0.5 s grace"
        assert router.wait(10) == 0
        assert time.monotonic() - started < 5
        assert "still busy after the 0.5 s grace were cut" in router.log.read_text()
        await anyio.sleep(0.5)
        assert engine.in_flight() == 0  # the engine saw its client go, and stopped
    finally:
        router.stop()


async def test_a_request_held_for_a_cold_model_gets_503_at_once_on_sigterm(
    tmp_path, bus, nats_server
):
    """It never reached an engine: waiting out the grace for a replica, then a bare EOF on
    its POST, told the client nothing. It is answered at once, to be sent again."""
    await serve_auto(bus, autoscaled_model(tmp_path / "weights"))  # no agent: stays cold
    router = RouterProcess(None, tmp_path, None, "--nats", nats_server.url)
    router.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            answer: dict[str, object] = {}
            await until(lambda: _listed_cold(http, router.url), timeout=20)  # bucket read

            async def held() -> None:
                async with http.post(f"{router.url}/v1/chat/completions", json=chat_body()) as resp:
                    answer["status"] = resp.status
                    answer["retry_after"] = resp.headers.get("retry-after")
                    answer["error"] = (await resp.json())["error"]

            async with anyio.create_task_group() as tg:
                tg.start_soon(held)
                await until(lambda: _held(http, router.url), timeout=20)
                router.terminate()
        assert answer["status"] == 503, answer
        assert answer["retry_after"] == "1"
        error = answer["error"]
        assert isinstance(error, dict) and error["code"] == "router_shutting_down"
        assert "never reached an engine" in error["message"]
        assert router.wait(10) == 0
        assert "every request in flight finished" in router.log.read_text()
    finally:
        router.stop()


async def _held(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/metrics") as resp:
        return 'llmgw_router_held{model="tiny"} 1.0' in await resp.text()


async def _listed_cold(http: aiohttp.ClientSession, url: str) -> bool:
    async with http.get(f"{url}/v1/models") as resp:
        return [(m["id"], m.get("cold")) for m in (await resp.json())["data"]] == [(SERVED, True)]


@pytest.mark.slow
async def test_a_rolling_restart_of_two_routers_under_streamed_load_loses_no_request(
    engines, tmp_path
):
    a, b = engines.start(STREAM), engines.start(STREAM)
    catalog = _catalog(tmp_path / "static.toml", a, b)
    routers = [RouterProcess(catalog, tmp_path), RouterProcess(catalog, tmp_path)]
    for r in routers:
        r.start()
    client = RetryingClient([r.url for r in routers])
    stop = anyio.Event()
    try:
        async with aiohttp.ClientSession() as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.run, http, 8, stop)
                await anyio.sleep(2)  # streams in flight through both
                for r in routers:
                    r.terminate()
                    assert await anyio.to_thread.run_sync(r.wait, 30) == 0
                    await anyio.to_thread.run_sync(r.start)  # the same port, a new process
                    await anyio.sleep(1.5)
                stop.set()
    finally:
        for r in routers:
            r.stop()
    assert client.lost == []
    assert client.completed >= 20
    assert all(r.starts == 2 for r in routers)
    for r in routers:
        first_run = r.logs / f"router-{r.port}-1.log"
        assert "every request in flight finished" in first_run.read_text()


async def test_ctrl_c_on_llmgw_up_lets_its_routers_streams_finish(engines, tmp_path):
    engine = engines.start(STREAM)
    nats_port, router_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            [
                *LLMGW,
                "up",
                "--no-agent",
                "--port",
                str(nats_port),
                "--data-dir",
                str(tmp_path / "data"),
                "--router-listen",
                f"127.0.0.1:{router_port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    router = f"http://127.0.0.1:{router_port}"
    try:
        until_logged(up, log, "router listening", timeout=30)
        applied = subprocess.run(
            [*LLMGW, "catalog", "apply", str(_catalog(tmp_path / "static.toml", engine))],
            env={**env, "LLMGW_NATS": f"nats://127.0.0.1:{nats_port}"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert applied.returncode == 0, applied.stderr
        async with aiohttp.ClientSession() as http:
            with anyio.fail_after(20):
                while True:
                    async with http.get(f"{router}/v1/models") as resp:
                        if [m["id"] for m in (await resp.json())["data"]] == [SERVED]:
                            break
                    await anyio.sleep(0.1)
            async with anyio.create_task_group() as tg:
                result: dict[str, list[str]] = {}

                async def client() -> None:
                    result["tokens"] = await _stream(http, router, "in flight")

                tg.start_soon(client)
                await anyio.sleep(0.5)
                up.send_signal(signal.SIGINT)  # Ctrl-C
                await anyio.sleep(0.3)
                assert _refused(router_port)
        assert result["tokens"] == [f"tok{i} " for i in range(30)]
        assert up.wait(20) == 0, log.read_text()
        assert "every request in flight finished" in log.read_text()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
