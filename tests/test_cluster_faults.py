"""One server of a 3-server JetStream cluster fails while a fleet runs on it: killed, paused
(`docker pause`), cut off from everything, or cut off from the other servers only while its
clients still reach it (`docker network disconnect`). The cluster runs
in containers (tests/cluster_helpers.py), the bucket has 3 replicas, and two agent processes
with fake engines, a controller and a router use it, each connected with all three URLs.

The fault hits the server that leads the bucket's stream and serves the controller's
connection: the worst place, chosen on purpose so that each run tests the same thing. While
that server is still down, reads and writes must resume within the cluster's election time,
from a client of a surviving server and from the controller's own connection; every agent's
heartbeat must move again and the controller must lead again. The router answers every chat
completion throughout. Once the server is back it catches up, and then nothing is lost: every
key is there at its revision or a later one, every acknowledged write reads back, no replica
was placed again or moved, no engine restarted.

With LLMGW_RELIABILITY_LOG=FILE, each test appends what it measured to FILE, from which
tools/reliability_table.py renders docs/reliability.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import anyio
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from cluster_helpers import NatsCluster, require_docker
from reliability_log import record
from router_helpers import SERVED, chat_body, router_settings, running_router
from serving import cpu_model, serve
from waiting import until

from llmgw.agent.config import Engines, Intervals, Nats
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, Update, decoder
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.router.service import Router
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(300)]

STREAM = f"KV_{keys.DEFAULT_BUCKET}"
# nats-server elects a new stream leader within its longest election timeout (9 s) of the
# old one going silent; a client learns of it at its next request after the one in flight
# times out (5 s). The rest is room for two busy cores.
RECOVERY_BOUND_S = 30.0
# A server cut off from its peers alone must first notice it (a metadata leader there answers
# until it has lost its quorum for a while); its clients then hear silence for 10 s before
# they leave it (llmgw/bus/connection.py: CUT_OFF_AFTER), after a request that timed out (5 s).
CUT_OFF_BOUND_S = 45.0
NODES = {"node1": "127.0.0.1", "node2": "127.0.0.2"}  # two hosts on one machine


@pytest.fixture
def cluster():
    reason = require_docker()
    if reason:
        pytest.skip(reason)
    c = NatsCluster().start()
    try:
        yield c
    finally:
        c.stop()


@dataclass
class Fleet:
    cluster: NatsCluster
    settings: NatsSettings  # all three URLs
    target: str  # the server the fault hits: it leads the stream and serves `control`
    control: Bus  # the controller's connection
    far: Bus  # a client of another server: what the test reads and watches through
    controller: Controller
    router: Router
    agents: dict[str, object]


async def _connect(settings: NatsSettings, bucket: BucketSettings | None = None) -> Bus:
    return await Bus.connect(settings, bucket, give_up_after=60)


async def _connect_away_from(settings: NatsSettings, cluster: NatsCluster, server: str) -> Bus:
    """A client given all three URLs that happens to be on another server than `server`
    (nats-py picks one at random: ask again until it is)."""
    for _ in range(30):
        bus = await _connect(settings)
        if cluster.by_port(bus.nc.connected_url.port).name != server:
            return bus
        await bus.close()
    raise AssertionError(f"30 connections in a row landed on {server}")


async def _stream_leader(bus: Bus) -> str | None:
    info = await _quietly(bus.js.stream_info(STREAM))  # may go unanswered while it elects
    return info.cluster.leader if info is not None and info.cluster else None


async def _lead_stream_from(bus: Bus, server: str) -> None:
    """Move the bucket's stream leader to `server` (nats-server >= 2.11 takes a preference)."""
    for _ in range(10):
        if await _stream_leader(bus) == server:
            return
        await bus.nc.request(
            f"$JS.API.STREAM.LEADER.STEPDOWN.{STREAM}",
            json.dumps({"placement": {"preferred": server}}).encode(),
            timeout=5,
        )
        await until(lambda: _stream_leader(bus), timeout=30)
    raise AssertionError(f"the stream leader did not move to {server}")


def _start_agents(cluster: NatsCluster, tmp_path) -> dict[str, object]:
    procs = {}
    for node, address in NODES.items():
        root = tmp_path / node
        dirs = host_dirs(root)
        install_fake_engines(dirs["bin"])
        cfg = agent_config(cluster.urls[0], dirs, id=node, address=address)
        cfg = msgspec.structs.replace(
            cfg,
            nats=Nats(urls=list(cluster.urls)),
            # heartbeats finer than the 5 s default measure recovery finer; the controller
            # judges liveness with its defaults
            intervals=Intervals(heartbeat=1.0, engine_probe=5.0),
            engines=Engines(listen_host=address, poll_interval=0.1, stop_grace=3, drain_timeout=10),
        )
        procs[node] = start_agent(
            cfg, root / "agent.toml", [dirs["bin"], "/usr/bin", "/bin"], root / "agent.log"
        )
    return procs


async def _ready(fleet_bus: Bus, router: Router) -> bool:
    reps = await fleet_bus.list("replicas.tiny.*", decoder(records.Replica))
    if len(reps) != 2 or any(e.value.phase != "ready" for e in reps.values()):
        return False
    return await _chat(router) == 200


async def _chat(router: Router) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{router.url}/v1/chat/completions",
            json=chat_body("hi"),
            timeout=aiohttp.ClientTimeout(total=10),
        ) as resp,
    ):
        await resp.read()
        return resp.status


@pytest.fixture
async def fleet(cluster, tmp_path) -> AsyncIterator[Fleet]:
    settings = NatsSettings(urls=cluster.urls, name="fault-test", healthy_after=1.0)
    first = await _connect(settings, BucketSettings(replicas=3))  # creates the bucket, R3
    control = await _connect(settings)
    target = cluster.by_port(control.nc.connected_url.port).name
    far = await _connect_away_from(settings, cluster, target)
    await first.close()
    info = await far.js.stream_info(STREAM)
    assert info.config.num_replicas == 3
    await _lead_stream_from(far, target)
    agents = _start_agents(cluster, tmp_path)
    gguf = str(write_fake_gguf(tmp_path / "weights" / "tiny.gguf"))
    await serve(far, cpu_model(gguf, served_name=SERVED), 2)
    # Liveness as shipped (unreachable after 15 s, lost after 60 s): whether a NATS fault
    # makes the controller move replicas is part of what is tested. Quick passes only.
    controller = Controller(control, ControllerSettings(tick=0.05, resync=0.5))
    router_connect = lambda: _connect(settings)  # noqa: E731 - any server
    try:
        async with (
            anyio.create_task_group() as tg,
            running_router(connect=router_connect, settings=router_settings()) as router,
        ):
            await tg.start(controller.run)
            await until(lambda: _ready(far, router), timeout=60)
            yield Fleet(cluster, settings, target, control, far, controller, router, agents)
            tg.cancel_scope.cancel()
    finally:
        for proc in agents.values():
            stop(proc)
        await far.close()
        await control.close()


# --- what runs during the fault ------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    started: float
    ended: float
    ok: bool


@dataclass
class Probe:
    """Through one connection, writes a new key over and over, and reads the last one written
    back over and over; records when each attempt started and ended and whether it worked. A write
    that timed out may still have been stored (NATS says nothing either way): only
    acknowledged ones must read back."""

    bus: Bus
    name: str
    puts: list[Attempt] = field(default_factory=list)
    gets: list[Attempt] = field(default_factory=list)
    acked: dict[str, bytes] = field(default_factory=dict)
    last: tuple[str, bytes] | None = None

    async def write(self) -> None:
        i = 0
        while True:
            i += 1
            key, value = f"probe.{self.name}.{i}", f"{self.name} write {i}".encode()
            started = time.monotonic()
            try:
                await self.bus.put(key, value)
                self.acked[key] = value
                self.last = (key, value)
                self.puts.append(Attempt(started, time.monotonic(), True))
            except Exception:  # noqa: BLE001 - the outage is what is measured
                self.puts.append(Attempt(started, time.monotonic(), False))
            await anyio.sleep(0.05)

    async def read(self) -> None:
        while True:
            if self.last is None:
                await anyio.sleep(0.05)
                continue
            key, value = self.last
            started = time.monotonic()
            got = await _quietly(self.bus.get_raw(key))
            ok = got is not None and got[0] == value
            self.gets.append(Attempt(started, time.monotonic(), ok))
            await anyio.sleep(0.05)


def _working_again(attempts: list[Attempt], since: float) -> float | None:
    """Seconds from `since` until the attempts begun after it worked for good: the end of the
    first success to end after the last failure did (of the first success, when none
    failed); None while the last to end failed."""
    ended = sorted((a for a in attempts if a.started >= since), key=lambda a: a.ended)
    failed = [i for i, a in enumerate(ended) if not a.ok]
    rest = ended[failed[-1] + 1 :] if failed else ended
    back = next((a.ended for a in rest if a.ok), None)
    return None if back is None else back - since


def _first_success(attempts: list[Attempt], since: float) -> float | None:
    """Seconds from `since` to the start of the first attempt, begun after it, that worked."""
    return next((a.started - since for a in attempts if a.ok and a.started >= since), None)


@dataclass
class Chats:
    statuses: list[int] = field(default_factory=list)

    async def run(self, router: Router) -> None:
        while True:
            try:
                self.statuses.append(await _chat(router))
            except Exception:  # noqa: BLE001 - no answer at all counts as a failure too
                self.statuses.append(0)
            await anyio.sleep(0.05)


@dataclass
class Heartbeats:
    """When each agent's lease, and the controller's leader key, first moved after `since`."""

    bus: Bus
    since: float
    revisions: dict[str, int]
    moved: dict[str, float] = field(default_factory=dict)

    async def run(self) -> None:
        while len(self.moved) < len(self.revisions):
            for key, rev in self.revisions.items():
                if key in self.moved:
                    continue
                got = await _quietly(self.bus.get_raw(key))
                if got is not None and got[1] > rev:
                    self.moved[key] = time.monotonic() - self.since
            await anyio.sleep(0.05)


async def _quietly(op: Awaitable):
    try:
        return await op
    except Exception:  # noqa: BLE001 - the next poll asks again
        return None


async def _watch_replicas(bus: Bus, seen: dict[str, list[records.ReplicaMember]]) -> None:
    """Every replica placed while it runs, with where it was placed first."""
    async for item in bus.watch("replicas.>", decoder(records.Replica)):
        if isinstance(item, Update) and item.value is not None:
            seen.setdefault(item.key, item.value.members)


async def _watch_health(bus: Bus, seen: set[tuple[str, str]]) -> None:
    """Every (node, phase) the controller wrote while it runs."""
    async for item in bus.watch("health.*", decoder(records.Health)):
        if isinstance(item, Update) and item.value is not None:
            seen.add((item.value.node, item.value.phase))


# --- the checks ------------------------------------------------------------------------------


async def _bucket(bus: Bus) -> dict[str, tuple[bytes, int]]:
    got = await bus.list(">", lambda data: data)
    return {k: (e.value, e.revision) for k, e in got.items()}


async def _stream_whole(bus: Bus, server: str) -> bool:
    """The stream has a leader and `server` among its peers, every peer current."""
    info = await _quietly(bus.js.stream_info(STREAM))
    if info is None or not info.cluster or not info.cluster.leader:
        return False
    peers = [info.cluster.leader, *(p.name for p in info.cluster.replicas or [])]
    current = all(p.current and not p.offline for p in info.cluster.replicas or [])
    return len(peers) == 3 and server in peers and current


@dataclass(frozen=True)
class Fault:
    does: str  # what is done to the server, as a command
    undoes: str  # what brings it back
    inject: Callable[[NatsCluster, str], None]
    undo: Callable[[NatsCluster, str], None]
    bound_s: float = RECOVERY_BOUND_S  # how long everything may take to work again


KILL = Fault("`docker kill`", "`docker start`", NatsCluster.kill, NatsCluster.restart)
PAUSE = Fault("`docker pause`", "`docker unpause`", NatsCluster.pause, NatsCluster.unpause)
ISOLATE = Fault(
    "`docker network disconnect` from both networks (the other servers' and the clients')",
    "`docker network connect`",
    NatsCluster.isolate,
    NatsCluster.rejoin,
)
CUT_FROM_PEERS = Fault(
    "`docker network disconnect` from the other servers' network only (clients still reach it)",
    "`docker network connect`",
    NatsCluster.cut_from_peers,
    NatsCluster.rejoin_peers,
    bound_s=CUT_OFF_BOUND_S,
)


class NotRecovered(AssertionError):
    """Reads, writes, heartbeats or leadership did not resume within the fault's bound."""


async def _survive(fleet: Fleet, fault: Fault, request: pytest.FixtureRequest) -> None:
    """Inject `fault` into the fleet's target server, check everything the module docstring
    promises, and record what was measured (also when it did not recover: that is a finding)."""
    f = fleet
    before = await _bucket(f.far)
    shards_before = {
        k: msgspec.json.decode(v, type=records.Shard)
        for k, (v, _) in before.items()
        if k.startswith("shards.")
    }
    replicas_before = {
        k: msgspec.json.decode(v, type=records.Replica).members
        for k, (v, _) in before.items()
        if k.startswith("replicas.")
    }
    assert len(replicas_before) == 2 and len(shards_before) == 2
    near, far = Probe(f.control, "near"), Probe(f.far, "far")
    chats = Chats()
    replicas_seen: dict[str, list[records.ReplicaMember]] = {}
    health_seen: set[tuple[str, str]] = set()
    rejoined = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_watch_replicas, f.far, replicas_seen)
        tg.start_soon(_watch_health, f.far, health_seen)
        for probe in (near, far):
            tg.start_soon(probe.write)
            tg.start_soon(probe.read)
        tg.start_soon(chats.run, f.router)
        await until(lambda: _all_ok(near, far, chats))
        chats_before = len(chats.statuses)

        await anyio.to_thread.run_sync(fault.inject, f.cluster, f.target)
        since = time.monotonic()
        beats = Heartbeats(f.far, since, {k: before[k][1] for k in _HEARTBEATS})
        tg.start_soon(beats.run)

        def recovered() -> dict[str, float | None]:
            """Seconds from the fault until each thing worked again (None: not yet)."""
            got: dict[str, float | None] = {}
            for p, where in ((near, "the server hit"), (far, "another server")):
                got[f"writes via {where}"] = _working_again(p.puts, since)
                got[f"reads via {where}"] = _working_again(p.gets, since)
            got["agents' heartbeats"] = _slowest(beats, [keys.lease(n) for n in NODES])
            got["the controller's leader lease"] = (
                beats.moved.get(keys.leader()) if f.controller.leading else None
            )
            return got

        with anyio.move_on_after(fault.bound_s):
            await until(lambda: _async(None not in recovered().values()), fault.bound_s + 5)
        times = recovered()
        if None not in times.values():
            # all of that while the server was still down
            assert not (await anyio.to_thread.run_sync(f.cluster.servers[f.target].healthy))
            await anyio.to_thread.run_sync(fault.undo, f.cluster, f.target)
            undone = time.monotonic()
            await until(lambda: _stream_whole(f.far, f.target), timeout=60)
            rejoined = time.monotonic() - undone
            whole = time.monotonic()
            await until(lambda: _all_ok(near, far, chats, after=whole))
        tg.cancel_scope.cancel()

    during = chats.statuses[chats_before:]
    row = dict(
        fault=fault.does,
        undo=fault.undoes,
        bound_s=fault.bound_s,
        recovered_s=[(k, None if v is None else round(v, 1)) for k, v in times.items()],
        rejoined_s=None if rejoined is None else round(rejoined, 1),
        chats=len(during),
        chats_ok=sum(s == 200 for s in during),
        keys=len(before),
        acked=len(near.acked) + len(far.acked),
        replicas=len(replicas_before),
    )
    still = [k for k, v in times.items() if v is None]
    if still:
        record(request.node.nodeid, **row)
        raise NotRecovered(
            f"{fault.bound_s:.0f} s after the fault on {f.target}, still nothing from: "
            + ", ".join(still)
        )

    # The router answered every request, through the fault and after.
    assert during and all(s == 200 for s in during), f"router answers: {during}"
    # No replica was placed again, moved, or restarted; the nodes never stopped being ready.
    assert replicas_seen == replicas_before
    after = await _bucket(f.far)
    for key, shard in shards_before.items():
        now = msgspec.json.decode(after[key][0], type=records.Shard)
        assert (now.phase, now.pid, now.restarts) == (shard.phase, shard.pid, shard.restarts), key
    assert health_seen == {(n, "ready") for n in NODES}
    # Nothing was lost: every key is there at its revision or a later one...
    gone = [k for k in before if k not in after]
    back = [k for k, (_, rev) in before.items() if k in after and after[k][1] < rev]
    assert not gone and not back, f"lost: {gone}; went back: {back}"
    # ...and every acknowledged write reads back, asked through the server that was hit
    # (whose copy of the stream is current again: _stream_whole).
    alone = NatsSettings(urls=(f.cluster.servers[f.target].url,), name="fault-test-check")
    async with Bus.open(alone, give_up_after=30) as check:
        # a server that has just rejoined may still say "JetStream system temporarily
        # unavailable" (503) now and then for a while, its stream copy current or not: a read
        # that gets no answer is asked again, an answer is what counts
        async def answered(key: str) -> tuple[tuple[bytes, int] | None]:
            try:
                return (await check.get_raw(key),)  # (None,): answered that it is absent
            except Exception:  # noqa: BLE001 - no answer yet
                return None

        for probe in (near, far):
            for key, value in probe.acked.items():
                (got,) = await until(lambda: answered(key), timeout=30)  # noqa: B023
                assert got is not None and got[0] == value, f"{key}: {got}"
    record(request.node.nodeid, **row)


_HEARTBEATS = [*(keys.lease(n) for n in NODES), keys.leader()]


def _slowest(beats: Heartbeats, watched: list[str]) -> float | None:
    if any(k not in beats.moved for k in watched):
        return None
    return max(beats.moved[k] for k in watched)


async def _async(value: bool) -> bool:
    return value


def _attempts(*probes: Probe) -> list[list[Attempt]]:
    return [a for p in probes for a in (p.puts, p.gets)]


async def _all_ok(near: Probe, far: Probe, chats: Chats, after: float = 0.0) -> bool:
    """Every probe has written and read, and the router answered, since `after`."""
    return all(_first_success(a, after) is not None for a in _attempts(near, far)) and any(
        s == 200 for s in chats.statuses[-3:]
    )


# --- the faults ------------------------------------------------------------------------------


async def test_a_killed_server_costs_an_election_and_loses_nothing(fleet, request):
    await _survive(fleet, KILL, request)


async def test_a_paused_server_is_left_by_its_clients_and_loses_nothing(fleet, request):
    await _survive(fleet, PAUSE, request)


async def test_a_server_cut_off_from_the_network_costs_an_election_and_loses_nothing(
    fleet, request
):
    await _survive(fleet, ISOLATE, request)


async def test_a_server_cut_off_from_the_other_servers_is_left_by_its_clients(fleet, request):
    await _survive(fleet, CUT_FROM_PEERS, request)
