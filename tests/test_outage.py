"""A whole NATS outage: every server of a 3-server cluster SIGKILLed at once, for longer than
the controller's lost_after, while two routers serve keyed and limited requests, two agents
run engines and a controller leads. Then the servers start again on their stores, and nobody
does anything else.

Routers keep serving what they know (the replicas of their table, the keys they read),
limited keys from the shares they hold and then 503 limits_unavailable; agents keep their
engines; and everything rejoins by itself: the controller leads again without judging a node
lost (every node gets a fresh grace period), no replica is placed again, the routers' usage
reaches the counters exactly once, a key made after the outage is served and a replica
placed after it starts. The times are shortened (lost_after 8 s, an outage of 15 s); the
routers' own limits are their defaults (keys and limits served 600 s without NATS).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import anyio
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from controller_helpers import quick_controller
from local_cluster import LocalCluster
from router_helpers import SERVED, chat_body, router_settings, running_router
from serving import cpu_model, serve, want
from test_router_gateway import _auth, _key, _usage
from waiting import until

from llmgw.agent.config import Engines, Nats
from llmgw.bus import records
from llmgw.bus.client import BucketSettings, Bus, BusError, NatsSettings, decoder
from llmgw.bus.counters import StreamPlan, ensure_streams
from llmgw.controller.loop import Controller
from llmgw.gateway.gateway import GatewaySettings
from llmgw.gateway.limiter import LimitSettings
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

pytestmark = pytest.mark.anyio

OUTAGE_S = 15.0
NODES = {"node1": "127.0.0.2", "node2": "127.0.0.3"}
RPM = 120  # carol's requests a minute: her routers hold shares of 12 when NATS goes


@dataclass
class Answer:
    router: int
    key: str
    phase: str  # before, outage, after
    at: float
    status: int
    code: str | None


@dataclass
class Load:
    routers: list
    secrets: dict[str, str]
    phase: str = "before"
    answers: list[Answer] = field(default_factory=list)
    stop: anyio.Event = field(default_factory=anyio.Event)

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            for i in range(len(self.routers)):
                for key in self.secrets:
                    tg.start_soon(self._client, http, i, key)

    async def _client(self, http: aiohttp.ClientSession, i: int, key: str) -> None:
        url = f"{self.routers[i].url}/v1/chat/completions"
        while not self.stop.is_set():
            phase, at = self.phase, time.time()
            async with http.post(url, json=chat_body(), headers=_auth(self.secrets[key])) as r:
                body = await r.json(content_type=None)
            code = (body.get("error") or {}).get("code") if r.status != 200 else None
            self.answers.append(Answer(i, key, phase, at, r.status, code))
            await anyio.sleep(0.05)

    def of(self, key: str, phase: str | None = None) -> list[Answer]:
        return [a for a in self.answers if a.key == key and phase in (None, a.phase)]


def _cluster_settings(cluster: LocalCluster) -> NatsSettings:
    # reconnects within a second or two once a server is back (the default backoff grows to
    # 30 s over a long outage: the agents keep theirs)
    return NatsSettings(urls=cluster.urls, connect_timeout=1, backoff_base=0.2, backoff_cap=2)


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_a_whole_nats_outage_is_served_through_and_rejoined_without_an_operator(
    tmp_path, engine_ports
):
    cluster = LocalCluster(tmp_path / "cluster").start_all()
    settings = _cluster_settings(cluster)
    engines = Engines(poll_interval=0.1, backoff_base=0.2, backoff_cap=2, stop_grace=3)
    agents = {}
    try:
        async with await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=30) as bus:
            await ensure_streams(bus, StreamPlan(replicas=3))
            for node, address in NODES.items():
                agents[node] = _agent(cluster, tmp_path / node, engines, node, address)
            secrets = {
                "alice": await _key(bus, "alice"),
                "carol": await _key(bus, "carol", limits=records.Limits(rpm=RPM)),
            }
            gguf = str(write_fake_gguf(tmp_path / "weights" / "tiny.gguf"))
            async with anyio.create_task_group() as tg:
                controller = Controller(
                    await Bus.connect(settings, give_up_after=30),
                    quick_controller(engine_ports, unreachable_after=3, lost_after=8),
                )
                await tg.start(controller.run)
                await serve(bus, cpu_model(gguf, host_ram_gb=1), 2)
                before = await until(lambda: _ready_shards(bus, 2), timeout=60)
                await _through_the_outage(cluster, bus, settings, secrets, before)
                await want(bus, "tiny", 3, at=2.0)  # placed after the outage: it starts
                await until(lambda: _ready_shards(bus, 3), timeout=60)
                assert controller.leading
                tg.cancel_scope.cancel()
            await controller.bus.close()
    finally:
        for agent in agents.values():
            stop(agent)
        cluster.stop()


def _agent(cluster: LocalCluster, root, engines: Engines, node: str, address: str):
    """An agent process with the fake engines, given every server's URL."""
    dirs = host_dirs(root)
    install_fake_engines(dirs["bin"])
    cfg = msgspec.structs.replace(
        agent_config(cluster.urls[0], dirs, id=node, address=address),
        nats=Nats(urls=list(cluster.urls)),
        engines=msgspec.structs.replace(engines, listen_host=address),
    )
    return start_agent(cfg, root / "agent.toml", [dirs["bin"], "/usr/bin", "/bin"], root / "log")


async def _through_the_outage(cluster, bus: Bus, settings: NatsSettings, secrets, before):
    router = router_settings(
        gateway=GatewaySettings(limits=LimitSettings(share=0.1)), probe_interval=0.5
    )
    connect = lambda: Bus.connect(settings, give_up_after=None)  # noqa: E731
    async with (
        running_router(connect=connect, settings=router) as a,
        running_router(connect=connect, settings=router) as b,
    ):
        routers = [a, b]
        for r in routers:
            await until(lambda r=r: _serves(r, 2), timeout=30)
        load = Load(routers, secrets)
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run)
            await until(lambda: _async(len(load.of("carol", "before")) >= 10), timeout=30)
            cluster.kill_all()
            load.phase = "outage"
            await anyio.sleep(OUTAGE_S)
            # the agents kept their engines, and the routers their tables
            assert {s.pid for s in before.values()} <= _running_pids()
            for i in range(len(cluster.servers)):
                cluster.start(i)
            load.phase = "after"
            cluster.wait_healthy()
            # the controller leads again and no node was judged lost: the same replicas,
            # the same engines, all ready
            after = await until(lambda: _ready_shards(bus, 2), timeout=90)
            assert {(k, s.pid) for k, s in after.items()} == {(k, s.pid) for k, s in before.items()}
            for r in routers:
                await until(lambda r=r: _async(r.table.synced and r.bus.connected), timeout=60)
            # carol is admitted again once the routers claim from the counters
            await until(lambda: _async(_admitted_since(load, "carol", "after") >= 4), timeout=60)
            dave = await _key(bus, "dave")  # a key made after the outage: both routers read it
            for r in routers:
                await until(lambda r=r: _status(r, dave, 200), timeout=30)
            load.stop.set()
        for r in routers:
            await until(lambda r=r: _async(not r.gateway.meter.pending()), timeout=30)
        usage = await _usage(bus)

    outage = load.of("alice", "outage")
    assert outage and {a.status for a in outage} == {200}, Counter(a.status for a in outage)
    refused = [a for a in load.of("carol") if a.status != 200]
    assert {(a.status, a.code) for a in refused} <= {(503, "limits_unavailable")}
    # carol never passed her limit in any minute, the outage's included
    per_minute = Counter(int(a.at // 60) for a in load.of("carol") if a.status == 200)
    assert max(per_minute.values()) <= RPM, per_minute
    # every request admitted was metered once, those served while NATS was away included
    for key in ("alice", "carol"):
        admitted = sum(1 for a in load.of(key) if a.status == 200)
        assert usage.get((key, SERVED, "requests"), 0) == admitted, key


def _admitted_since(load: Load, key: str, phase: str) -> int:
    return sum(1 for a in load.of(key, phase) if a.status == 200)


async def _status(r, secret: str, status: int) -> bool:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{r.url}/v1/chat/completions", json=chat_body(), headers=_auth(secret)) as resp,
    ):
        return resp.status == status


async def _serves(r, replicas: int) -> bool:
    route = r.table.route(SERVED)
    return route is not None and len(route.backends) == replicas


async def _ready_shards(bus: Bus, n: int) -> dict[str, records.Shard] | None:
    try:
        got = await bus.list("shards.*.*", decoder(records.Shard))
    except BusError:
        return None
    shards = {k: e.value for k, e in got.items()}
    if len(shards) == n and all(s.phase == "ready" and s.pid for s in shards.values()):
        return shards
    return None


def _running_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.process_iter() if p.is_running()}


async def _async(value: object) -> object:
    return value


def test_a_router_serves_known_keys_and_held_limits_for_ten_minutes_without_nats_by_default():
    # the promise of docs/reliability.md: a whole NATS outage of 10 minutes is served through
    gateway = GatewaySettings()
    assert gateway.serve_known_for >= 600
    assert gateway.limits.offline == "serve" and gateway.limits.serve_offline_for >= 600
