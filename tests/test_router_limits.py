"""Hostile input at the router: a process cannot be locked out by idle connections (it
raises its open-file limit to the hard one, holds client connections below it with a
reserve for its own engine connections and probes, and closes the oldest idle connection
to make room); JSON nested too deep is a 400; what clients are shown can be kept from
them; the engine timeout is a setting; credentials in an endpoint URL are refused."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest
from raw_engine import Action, RawEngine, answer
from router_helpers import SERVED, chat_body, fake_engines, router_settings, running_router

from llmgw import catalog
from llmgw.bus.server import free_port
from llmgw.router.proxy import ProxySettings
from llmgw.router.upstream import UpstreamSettings

LLMGW = [sys.executable, "-m", "llmgw.cli"]


def _limit_files(n: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return preexec


def test_probes_are_served_while_thousands_of_idle_connections_are_held(tmp_path):
    idle = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < idle + 512:
        pytest.skip(f"this process may open only {hard} files")
    if soft < idle + 512:
        resource.setrlimit(resource.RLIMIT_NOFILE, (idle + 512, hard))
    with fake_engines(tmp_path) as fleet:
        engine = fleet.start()
        cat = tmp_path / "static.toml"
        cat.write_text(
            f'[[models]]\nid = "tiny"\nserved_name = "{SERVED}"\nendpoints = ["{engine.url}"]\n'
        )
        port = free_port()
        log_path = tmp_path / "router.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [*LLMGW, "--log-level", "INFO", "router", "--catalog", str(cat)]
                + ["--listen", f"127.0.0.1:{port}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_limit_files(1024),  # as under `ulimit -n 1024`, hard limit too
            )
        held: list[socket.socket] = []
        try:
            deadline = time.monotonic() + 20
            while "router listening" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            assert "open-file limit 1024: holds 384 client connections" in log_path.read_text()
            for _ in range(idle):  # connected, and never a byte
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)
            served = 0
            for i in range(20):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
                    served += r.status == 200
                body = json.dumps(
                    {"model": SERVED, "messages": [{"role": "user", "content": f"q{i}"}]}
                ).encode()
                req = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=10) as r:
                    served += r.status == 200
            assert served == 40
            assert "Too many open files" not in log_path.read_text()
        finally:
            for s in held:
                s.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, log_path.read_text()


# --- hostile requests and what the router shows, in process -------------------------------


def _model_of(engine) -> catalog.Model:
    return catalog.Model(id="tiny", served_name=SERVED, endpoints=[engine.url])


@pytest.mark.anyio
async def test_json_nested_a_thousand_deep_is_a_400_not_a_traceback(caplog):
    deep = b'{"model": "tiny-chat", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    async with RawEngine(lambda seen, e: Action(answer(b"{}"))) as engine:
        async with running_router([_model_of(engine)]) as r, aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions",
                data=deep,
                headers={"content-type": "application/json"},
            ) as resp:
                assert resp.status == 400
                assert "too deeply" in (await resp.json())["error"]["message"]
    assert "Traceback" not in caplog.text and "RecursionError" not in caplog.text


@pytest.mark.anyio
async def test_the_replica_header_and_metrics_can_be_kept_from_clients():
    settings = router_settings(
        proxy=ProxySettings(
            replica_header=False, metrics="keyed", client_api_keys=frozenset({"k1"})
        )
    )
    good = {"Authorization": "Bearer k1"}
    async with RawEngine(lambda seen, e: Action(answer(b"{}"))) as engine:
        async with running_router([_model_of(engine)], settings=settings) as r:
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{r.url}/v1/chat/completions", json=chat_body(), headers=good
                ) as resp:
                    assert resp.status == 200 and "x-llmgw-replica" not in resp.headers
                async with http.get(f"{r.url}/metrics") as resp:
                    assert resp.status == 401
                async with http.get(f"{r.url}/metrics", headers=good) as resp:
                    assert resp.status == 200
        off = router_settings(proxy=ProxySettings(metrics="off"))
        async with running_router([_model_of(engine)], settings=off) as r:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{r.url}/metrics") as resp:
                    assert resp.status == 404
                async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
                    assert resp.headers["x-llmgw-replica"] == engine.url  # shown by default


@pytest.mark.anyio
async def test_the_engine_timeout_is_a_setting():
    async def silent(writer) -> None:
        await asyncio.sleep(30)

    settings = router_settings(upstream=UpstreamSettings(read_timeout=0.5))
    async with RawEngine(
        lambda seen, e: Action(silent) if seen.method == b"POST" else Action(answer(b"{}"))
    ) as engine:
        async with running_router([_model_of(engine)], settings=settings) as r:
            async with aiohttp.ClientSession() as http:
                started = time.monotonic()
                async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
                    assert resp.status == 502
                    assert "sent nothing for 0.5 s" in (await resp.json())["error"]["message"]
                assert time.monotonic() - started < 5


def test_a_router_refuses_an_endpoint_with_credentials_without_showing_them(tmp_path):
    cat = tmp_path / "static.toml"
    cat.write_text(
        '[[models]]\nid = "tiny"\nserved_name = "tiny-chat"\n'
        'endpoints = ["http://admin:hunter2@127.0.0.1:9"]\n'
    )
    out = subprocess.run(
        [*LLMGW, "router", "--catalog", str(cat), "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
    )
    assert out.returncode == 1
    assert "credentials in an endpoint URL are never sent" in out.stderr
    assert "hunter2" not in out.stderr + out.stdout
