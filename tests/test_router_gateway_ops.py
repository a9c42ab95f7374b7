"""The gateway's operations at real routers: streams that do not exist yet, keys and teams
written by hand that do not read, and limits across two routers while NATS goes away and
comes back (the router's server in this process, fed by a real nats-server and fake
engines; helpers shared with tests/test_router_gateway.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp
import anyio
import msgspec
import pytest
from router_helpers import SERVED, chat_body, fake_engines, router_settings, running_router
from test_router_gateway import (
    _async,
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
from llmgw.bus.counters import Counters, ensure_streams
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
    bus: Bus, nats_settings: NatsSettings, engines, caplog: pytest.LogCaptureFixture
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
        # refused as a wrong secret is, word for word: a 401 never tells that a name exists;
        # the router's log names the key for its operator
        status, _, body = await _post(a, chat_body(), carol)
        assert status == 401 and body["error"]["message"].startswith("incorrect API key")
        assert "carol" not in json.dumps(body)
        assert any("API key carol" in m and "does not read" in m for m in caplog.messages), (
            caplog.messages
        )

        # a router started since never read alice's good value: neither key grants anything,
        # and the garbled keys still make keys required
        async with running_router(connect=_connect(nats_settings), settings=_settings()) as b:
            await until(lambda: _served(b), timeout=10)
            assert await _status(b, None) == 401
            assert await _status(b, alice) == 401
            assert await _status(b, carol) == 401
        view = await gather(bus)
        said = {u.key: u.says() for u in view.unreadable}
        assert "one that did not refuses the key (401)" in said[keys.apikey("alice")]
        assert f"revision {revision}" in said[keys.apikey("alice")]
        assert "apikeys.carol" in render(view, time.time())
        # a good value again: read at once
        await _key(bus, "carol")
        await until(lambda: _is(_unreadable(a), {'{family="apikeys",reading="kept"}': 1.0}))


async def test_a_key_over_the_size_limit_counts_as_a_key_that_does_not_read(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    """A value past the size a router reads (a bucket made by hand without a value limit,
    a server allowing large messages) is refused like a garbled one, never taken as absent:
    the fleet's only key too big to read must not open the fleet to every client."""
    await _place(bus, engines.start())
    big = records.ApiKey(
        name="alice",
        secrets=[credentials.hash_secret(credentials.new_secret("alice"))],
        description="x" * 3000,
    )
    await bus.put(keys.apikey("alice"), big)

    async def connect() -> Bus:
        reader = await Bus.connect(nats_settings, give_up_after=None)
        reader.max_value_bytes = 2000  # what this router reads at most
        return reader

    async with running_router(connect=connect, settings=_settings()) as r:
        await until(lambda: _served(r), timeout=10)
        refused = {'{family="apikeys",reading="refused"}': 1.0}
        await until(lambda: _is(_unreadable(r), refused), timeout=5)
        assert await _status(r, None) == 401  # keys stay required
        # a key it read good before, grown past the limit: its last good value is kept
        bob = await _key(bus, "bob")
        await until(lambda: _is(_status(r, bob), 200), timeout=5)
        grown = records.ApiKey(
            name="bob",
            secrets=[credentials.hash_secret(credentials.new_secret("bob"))],
            description="x" * 3000,
        )
        await bus.put(keys.apikey("bob"), grown)
        both = {**refused, '{family="apikeys",reading="kept"}': 1.0}
        await until(lambda: _is(_unreadable(r), both), timeout=5)
        assert await _status(r, bob) == 200


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
        assert "not refuses the team's keys (403)" in said[keys.team("ml")]


# --- limits across two routers while NATS is stopped and started again ------------------------


@dataclass
class _Answer:
    key: str
    router: int
    # when it was sent: before, cut (NATS stopped), known (the routers know it), after (NATS
    # started again)
    phase: str
    status: int
    code: str | None
    retry_after: str | None


class _Load:
    """Clients sending one key's requests in a loop to each of the routers, recording every
    answer with the phase it was sent in."""

    def __init__(self, routers: list, secrets: dict[str, str], per_router: int) -> None:
        self.routers, self.secrets, self.per_router = routers, secrets, per_router
        self.phase = "before"
        self.answers: list[_Answer] = []
        self.stop = anyio.Event()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for name in self.secrets:
                for i, _ in enumerate(self.routers):
                    for _ in range(self.per_router):
                        tg.start_soon(self._client, name, i)

    async def _client(self, name: str, i: int) -> None:
        url = f"{self.routers[i].url}/v1/chat/completions"
        headers = {"authorization": f"Bearer {self.secrets[name]}"}
        async with aiohttp.ClientSession() as http:
            while not self.stop.is_set():
                phase = self.phase
                async with http.post(url, json=chat_body(), headers=headers) as resp:
                    body = await resp.json()
                    code = (body.get("error") or {}).get("code")
                    retry = resp.headers.get("retry-after")
                    self.answers.append(_Answer(name, i, phase, resp.status, code, retry))
                if resp.status != 200:
                    await anyio.sleep(0.01)  # refused at once: do not spin

    def admitted(self, key: str, phase: str | None = None, router: int | None = None) -> int:
        return sum(
            1
            for a in self.answers
            if a.key == key
            and a.status == 200
            and (phase is None or a.phase == phase)
            and (router is None or a.router == router)
        )

    def of(self, key: str, phase: str, router: int) -> list[_Answer]:
        return [a for a in self.answers if (a.key, a.phase, a.router) == (key, phase, router)]


def _rpm(r, key: str):
    return r.gateway.limiter._budgets[f"{keys.LIMITS_ROOT}.key.{key}.rpm"]


@pytest.mark.parametrize("offline", ["serve", "refuse"])
async def test_limits_hold_across_two_routers_under_load_while_nats_is_stopped_and_started(
    bus: Bus, nats_server: EmbeddedNats, nats_settings: NatsSettings, engines, offline: str
) -> None:
    await ensure_streams(bus)
    await _place(bus, engines.start())
    # alice's shares (5% of 300: 15) run out while NATS is away; carol's (5,000) cannot, so
    # what stops her router is --limits-offline-for
    secrets = {
        "alice": await _key(bus, "alice", limits=records.Limits(rpm=300)),
        "carol": await _key(bus, "carol", limits=records.Limits(rpm=100_000)),
    }
    bob = await _key(bus, "bob")  # no limits: to see that a router has read the keys
    offline_for = 1.5
    settings = _settings(share=0.05, offline=offline, serve_offline_for=offline_for)
    async with (
        running_router(connect=_connect(nats_settings), settings=settings) as a,
        running_router(connect=_connect(nats_settings), settings=settings) as b,
    ):
        routers = [a, b]
        for r in routers:
            await until(lambda r=r: _served(r), timeout=10)
            await until(lambda r=r: _is(_status(r, bob), 200), timeout=5)
        for r in routers:
            await until(lambda r=r: _async(not r.gateway.meter.pending()), timeout=5)
        before = await _usage(bus)
        await _clear_of_a_minute_s_end(needs=40)
        window = int(time.time() // 60)
        load = _Load(routers, secrets, per_router=4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run)
            await until(lambda: _async(load.admitted("alice") >= 100), timeout=10)

            load.phase = "cut"
            nats_server.stop()  # this loop waits until it has exited
            spent = {key: [_rpm(r, key).spent for r in routers] for key in secrets}
            # once a router knows it is cut off (it looks every 0.2 s, or a claim fails)
            await until(lambda: _async(all(r.gateway.limiter.offline_since for r in routers)))
            load.phase = "known"
            await anyio.sleep(offline_for + 1.0)
            # what each router held unspent while cut off: granted by the counter (a claim
            # answered as the server went is among it) and not spent before the cut
            unspent = {
                key: [_rpm(r, key).granted - spent[key][i] for i, r in enumerate(routers)]
                for key in secrets
            }

            nats_server.start()
            load.phase = "after"
            for i in range(len(routers)):
                await until(lambda i=i: _async(load.admitted("carol", "after", i) >= 5), timeout=15)
            await until(lambda: _async(load.of("alice", "after", 0)[5:]), timeout=5)
            load.stop.set()
        assert int(time.time() // 60) == window  # the whole run in one minute

        cut = [a for a in load.answers if a.phase in ("cut", "known") and a.status != 200]
        assert cut and {(x.status, x.code, x.retry_after) for x in cut} == {
            (503, "limits_unavailable", "1")
        }
        # while cut off, each router spent only what it held unspent when NATS went away
        for key in secrets:
            for i in range(len(routers)):
                during = load.admitted(key, "cut", i) + load.admitted(key, "known", i)
                assert during <= unspent[key][i]
        if offline == "refuse":  # from when it knew, nothing
            assert load.admitted("alice", "known") == load.admitted("carol", "known") == 0
        else:
            # and only for --limits-offline-for: carol's routers still held shares when
            # they stopped admitting her
            for i in range(len(routers)):
                assert unspent["carol"][i] > load.admitted("carol", "known", i)
                assert {x.status for x in load.of("carol", "known", i)[-5:]} == {503}

        # NATS is back: the counters hold what the routers were granted, no more, no less
        for r in routers:
            await until(lambda r=r: _async(not r.gateway.limiter.owing()), timeout=10)
            await until(lambda r=r: _async(not r.gateway.meter.pending()), timeout=10)
        counters = Counters(bus_again := await Bus.connect(nats_settings, give_up_after=10))
        try:
            for key in secrets:
                budgets = [_rpm(r, key) for r in routers]
                assert {x.window for x in budgets} == {window}
                total = await counters.held(f"{keys.LIMITS_ROOT}.key.{key}.rpm.{window}")
                assert total == sum(x.granted for x in budgets)
                assert load.admitted(key) == sum(x.spent for x in budgets) <= total
            assert load.admitted("alice") <= 300
            # every admitted request metered once: those counted while NATS was away included
            usage = await _usage(bus_again)
            for key in secrets:
                metered = usage[key, SERVED, "requests"] - before.get((key, SERVED, "requests"), 0)
                assert metered == load.admitted(key)
        finally:
            await bus_again.close()
