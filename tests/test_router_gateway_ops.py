"""The gateway's operations at real routers: streams that do not exist yet, keys and teams
written by hand that do not read, and limits across two routers while NATS goes away and
comes back (the router's server in this process, fed by a real nats-server and fake
engines; helpers shared with tests/test_router_gateway.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import aiohttp
import anyio
import msgspec
import pytest
from router_helpers import SERVED, chat_body, fake_engines, router_settings, running_router
from test_router_gateway import (
    _clear_of_a_minute_s_end,
    _connect,
    _is,
    _key,
    _place,
    _post,
    _served,
    _status,
    _usage,
)
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import ensure_streams
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.cli.status import gather, render
from llmgw.gateway import credentials
from llmgw.gateway.gateway import GatewaySettings
from llmgw.gateway.limiter import LimitSettings

pytestmark = pytest.mark.anyio

LLMGW = [sys.executable, "-m", "llmgw.cli"]
STREAMS = [keys.AUDIT_STREAM, keys.LIMITS_STREAM, keys.USAGE_STREAM]


@pytest.fixture
def engines(tmp_path):
    with fake_engines(tmp_path) as fleet:
        yield fleet


def _settings(**limits: object):
    return router_settings(gateway=GatewaySettings(limits=LimitSettings(**limits)))  # type: ignore[arg-type]


async def _get(r, path: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{r.url}{path}") as resp:
            assert resp.status == 200
            return await resp.text()


def _gauges(text: str, name: str) -> dict[str, float]:
    """The series of one gauge in /metrics text: its labels -> value."""
    return {
        line[len(name) : line.rindex(" ")]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


async def _streams(bus: Bus) -> list[str]:
    return sorted([n async for n in _stream_names(bus)])


async def _stream_names(bus: Bus):
    for name in STREAMS:
        try:
            await bus.js.stream_info(name)
        except Exception:  # noqa: BLE001 - not found
            continue
        yield name


def _operator(*args: str, nats: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return subprocess.run(
        [*LLMGW, *args, "--nats", nats], capture_output=True, text=True, timeout=60, env=env
    )


# --- the streams ----------------------------------------------------------------------------


@pytest.mark.parametrize("offline", ["serve", "refuse"])
async def test_keys_written_by_hand_without_the_streams_say_so_and_follow_limits_offline(
    bus: Bus, nats_server: EmbeddedNats, nats_settings: NatsSettings, engines, offline: str
) -> None:
    await _place(bus, engines.start())
    limited = await _key(bus, "alice", limits=records.Limits(rpm=100))
    free = await _key(bus, "bob")
    settings = _settings(offline=offline)
    async with running_router(connect=_connect(nats_settings), settings=settings) as r:
        await until(lambda: _served(r), timeout=10)
        await until(lambda: _is(_status(r, free), 200), timeout=5)  # a key without limits
        status, headers, body = await _post(r, chat_body(), limited)
        assert status == 503 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "limits_unavailable"
        assert "LLMGW_LIMITS does not exist" in body["error"]["message"]
        assert "llmgw key ls" in body["error"]["message"]

        async def missing() -> dict[str, float] | None:
            got = _gauges(await _get(r, "/metrics"), "llmgw_router_streams_missing")
            return got if set(got.values()) == {1.0} else None

        # every stream is found missing: the claim, the usage counted, the audit records
        assert len(await until(missing, timeout=5)) == 3
        health = await _get(r, "/health")
        assert all(s in health for s in STREAMS) and "streams_missing" in health

        # the fix the router names, run as the operator
        out = _operator("key", "ls", nats=nats_server.url)
        assert out.returncode == 0, out.stderr
        assert "made streams" in out.stderr and "alice" in out.stdout
        assert await _streams(bus) == STREAMS
        await until(lambda: _is(_status(r, limited), 200), timeout=5)

        async def found() -> bool:
            got = _gauges(await _get(r, "/metrics"), "llmgw_router_streams_missing")
            return set(got.values()) == {0.0}

        await until(found, timeout=5)
        assert "streams_missing" not in await _get(r, "/health")
        # what bob used while the stream was missing waited in the router, and is counted now
        usage = await until(lambda: _usage(bus), timeout=5)
        assert usage.get(("bob", "tiny-chat", "requests"), 0) >= 1


async def test_up_makes_the_streams_so_a_key_written_by_hand_finds_them(tmp_path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*LLMGW, "up", "--port", str(port), "--data-dir", str(tmp_path / "data")]
            + ["--no-agent", "--no-router"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        with anyio.fail_after(30):
            while "controller running" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                await anyio.sleep(0.1)
        assert "made streams LLMGW_LIMITS, LLMGW_USAGE, LLMGW_AUDIT" in log.read_text()
        settings = NatsSettings(urls=(f"nats://127.0.0.1:{port}",), name="test")
        b = await Bus.connect(settings, give_up_after=5)
        try:
            assert await _streams(b) == STREAMS
        finally:
            await b.close()
    finally:
        proc.terminate()
        proc.wait(30)


# --- keys and teams that do not read ---------------------------------------------------------


async def _unreadable(r) -> dict[str, float]:
    return _gauges(await _get(r, "/metrics"), "llmgw_router_unreadable_keys")


async def test_a_garbled_key_keeps_its_last_good_limits_and_one_never_read_is_refused(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    await _place(bus, engines.start())
    alice = await _key(bus, "alice", limits=records.Limits(rpm=2), models=[SERVED])
    async with running_router(connect=_connect(nats_settings), settings=_settings()) as a:
        await until(lambda: _served(a), timeout=10)
        await _clear_of_a_minute_s_end()
        await until(lambda: _is(_status(a, alice), 200), timeout=5)
        # by hand: the wrong type where the limits go, and a new key that never read
        revision = await bus.put(keys.apikey("alice"), b'{"name": "alice", "limits": "none"}')
        carol = credentials.new_secret("carol")
        carol_hash = msgspec.json.encode(credentials.hash_secret(carol)).decode()
        await bus.put(
            keys.apikey("carol"),
            f'{{"name": "carol", "secrets": [{carol_hash}], "limits": {{"rpm": "lots"}}}}'.encode(),
        )
        kept_and_refused = {
            '{family="apikeys",reading="kept"}': 1.0,
            '{family="apikeys",reading="refused"}': 1.0,
        }
        await until(lambda: _is(_unreadable(a), kept_and_refused), timeout=5)
        # alice works with her old limit (2 a minute, one spent) and her old models
        assert await _status(a, alice) == 200
        status, _, body = await _post(a, chat_body(), alice)
        assert status == 429 and "key alice" in body["error"]["message"]
        status, _, body = await _post(a, chat_body(), carol)
        assert status == 401 and "carol cannot be checked" in body["error"]["message"]

        # a router started since never read alice's good value: neither key grants anything,
        # and the garbled keys still make keys required
        async with running_router(connect=_connect(nats_settings), settings=_settings()) as b:
            await until(lambda: _served(b), timeout=10)
            assert await _status(b, None) == 401
            assert await _status(b, alice) == 401
            assert await _status(b, carol) == 401
        view = await gather(bus)
        said = {u.key: u.says() for u in view.unreadable}
        assert "the key is refused (401)" in said[keys.apikey("alice")]
        assert f"revision {revision}" in said[keys.apikey("alice")]
        assert "apikeys.carol" in render(view, time.time())
        # a good value again: read at once
        await _key(bus, "carol")
        await until(lambda: _is(_unreadable(a), {'{family="apikeys",reading="kept"}': 1.0}))


async def test_a_garbled_team_keeps_its_last_good_limits_and_one_never_read_refuses_its_keys(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    await _place(bus, engines.start())
    await bus.put(keys.team("ml"), records.Team(team="ml", limits=records.Limits(rpm=2)))
    dave = await _key(bus, "dave", team="ml")
    async with running_router(connect=_connect(nats_settings), settings=_settings()) as a:
        await until(lambda: _served(a), timeout=10)
        await _clear_of_a_minute_s_end()
        await until(lambda: _is(_status(a, dave), 200), timeout=5)
        # a limit below zero: decodes, and is not believed
        await bus.put(keys.team("ml"), b'{"team": "ml", "limits": {"rpm": -1}}')
        kept = {'{family="teams",reading="kept"}': 1.0}
        await until(lambda: _is(_unreadable(a), kept), timeout=5)
        assert await _status(a, dave) == 200
        status, _, body = await _post(a, chat_body(), dave)
        assert status == 429 and "team ml" in body["error"]["message"]

        async with running_router(connect=_connect(nats_settings), settings=_settings()) as b:
            await until(lambda: _served(b), timeout=10)
            status, _, body = await _post(b, chat_body(), dave)
            assert status == 403 and body["error"]["code"] == "team_unreadable"
            assert "llmgw team show ml" in body["error"]["message"]
            refused = {'{family="teams",reading="refused"}': 1.0}
            assert await _unreadable(b) == refused
        said = {u.key: u.says() for u in (await gather(bus)).unreadable}
        assert "the team's keys are refused (403)" in said[keys.team("ml")]
