"""llmgw against a 3-server JetStream cluster of real nats-server processes on this host:
waiting for JetStream while the cluster forms, the bucket's copies, and the fence that
keeps a deposed controller's writes out, as the cluster's stream leader applies it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator

import anyio
import psutil
import pytest
from agent_helpers import start_fake_engine_agent, stop
from controller_helpers import quick_controller
from local_cluster import LocalCluster
from serving import cpu_model, serve
from waiting import until

from llmgw.agent.config import Engines
from llmgw.bus import keys, records
from llmgw.bus.client import (
    BucketSettings,
    Bus,
    BusError,
    Fence,
    FencedOff,
    NatsSettings,
    Update,
    Write,
    decoder,
)
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.sim.bare import SimNode, inventory
from llmgw.sim.fake_engine import write_fake_gguf

pytestmark = pytest.mark.anyio


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path / "cluster")
    try:
        yield c
    finally:
        c.stop()


def _settings(*urls: str) -> NatsSettings:
    # quick answers: a JetStream that does not answer within connect_timeout is "not ready"
    return NatsSettings(urls=urls, connect_timeout=0.5, backoff_base=0.1, backoff_cap=0.5)


@pytest.mark.slow  # the cluster elects its JetStream leader 0.3 to 9 s after it has a quorum
async def test_a_controller_started_before_jetstream_is_ready_waits_and_then_leads(cluster, caplog):
    cluster.start(0)  # alone: no meta leader, so no JetStream yet
    settings = ControllerSettings(controller_id="c", leader_ttl=1, tick=0.05, resync=0.5)
    started = anyio.Event()

    async def controller() -> None:
        # as `llmgw controller --bucket-replicas 3` does: no give_up_after, it waits
        async with await Bus.connect(_settings(cluster.urls[0]), BucketSettings(replicas=3)) as b:
            started.set()
            await Controller(b, settings).run()

    async with anyio.create_task_group() as tg:
        tg.start_soon(controller)
        waiting = f"JetStream not ready on {cluster.urls[0]}: waiting"
        await until(lambda: _true(waiting in caplog.text))
        assert not started.is_set()
        cluster.start(1)
        cluster.start(2)
        await started.wait()
        async with await Bus.connect(_settings(*cluster.urls), give_up_after=20) as probe:
            leader = await until(lambda: probe.get(keys.leader(), decoder(records.Leader)))
            info = await probe.js.stream_info("KV_llmgw")
        tg.cancel_scope.cancel()
    assert leader.value.holder == "c"
    assert info.config.num_replicas == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def _true(value: object) -> bool:
    return bool(value)


async def test_a_bucket_of_one_copy_on_a_cluster_is_warned_about_naming_the_fix(cluster, caplog):
    for i in range(3):
        cluster.start(i)
    caplog.set_level(logging.WARNING, logger="llmgw")
    settings = _settings(*cluster.urls)
    async with await Bus.connect(settings, BucketSettings(name="one"), give_up_after=20):
        pass
    created = caplog.text
    caplog.clear()
    async with await Bus.connect(settings, BucketSettings(name="one"), give_up_after=20):
        pass
    found = caplog.text
    caplog.clear()
    async with await Bus.connect(
        settings, BucketSettings(name="three", replicas=3), give_up_after=20
    ) as bus:
        info = await bus.js.stream_info("KV_three")
    assert "bucket one on NATS cluster c: creating it with replicas=1" in created
    assert "bucket one on NATS cluster c: it has replicas=1" in found
    for text in (created, found):
        assert "give every component --bucket-replicas 3" in text
        assert "`nats stream edit KV_one --replicas 3`" in text
    assert caplog.text == "" and info.config.num_replicas == 3


@pytest.mark.slow
async def test_an_agent_started_before_any_controller_waits_for_the_bucket_and_never_makes_it(
    cluster, tmp_path
):
    """The first agent of a fresh cluster made the bucket with one copy, and every
    controller given --bucket-replicas 3 then refused to start: an agent waits for it."""
    import msgspec
    import nats
    from agent_helpers import agent_config, host_dirs, start_agent, stop
    from waiting import until_logged

    from llmgw.agent.config import Nats

    for i in range(3):
        cluster.start(i)
    dirs = host_dirs(tmp_path / "node1")
    cfg = agent_config(cluster.urls[0], dirs, id="node1")
    cfg = msgspec.structs.replace(cfg, nats=Nats(urls=list(cluster.urls)))
    log = tmp_path / "agent.log"
    agent = start_agent(cfg, tmp_path / "agent.toml", [dirs["bin"]], log)
    try:
        until_logged(agent, log, "bucket llmgw does not exist", timeout=30)
        assert "an agent never makes it: a controller" in log.read_text()
        nc = await nats.connect(list(cluster.urls))
        try:
            with pytest.raises(nats.js.errors.NotFoundError):
                await nc.jetstream().stream_info("KV_llmgw")  # the agent made nothing
        finally:
            await nc.close()
        settings = ControllerSettings(controller_id="c", leader_ttl=1, tick=0.05, resync=0.5)
        # as `llmgw controller --bucket-replicas 3` does
        async with (
            await Bus.connect(
                _settings(*cluster.urls), BucketSettings(replicas=3), give_up_after=20
            ) as bus,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(Controller(bus, settings).run)
            node = await until(
                lambda: bus.get(keys.node("node1"), decoder(records.NodeInventory)), timeout=30
            )
            info = await bus.js.stream_info("KV_llmgw")
            tg.cancel_scope.cancel()
    finally:
        stop(agent)
    assert node.value.node == "node1"  # the agent carried on once the bucket was there
    assert info.config.num_replicas == 3


@contextlib.asynccontextmanager
async def _old_and_new_leader(cluster) -> AsyncIterator[tuple[Bus, Bus, int]]:
    """Three servers and two clients, `old` holding the leader key: (old, new, its revision)."""
    for i in range(3):
        cluster.start(i)
    settings = _settings(*cluster.urls)
    async with (
        await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=20) as old,
        await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=20) as new,
    ):
        held = await old.put(keys.leader(), records.Leader(holder="old", since=1, renewed_at=1))
        yield old, new, held


async def _take_over(new: Bus, held: int) -> int:
    # a takeover's compare-and-set is refused, without comparing, while one of the fenced
    # writes is in flight on the stream leader: it tries again, as a controller does at its
    # next step
    taker = records.Leader(holder="new", since=2, renewed_at=2)
    while (rev := await new.update(keys.leader(), taker, last=held)) is None:
        await anyio.sleep(0.01)
    return rev


async def test_on_a_cluster_a_fenced_write_lands_before_a_takeover_or_not_at_all(cluster):
    async with _old_and_new_leader(cluster) as (old, new, held):
        fence = Fence(keys.leader(), held)
        outcomes: dict[int, int | FencedOff] = {}

        async def write(i: int) -> None:
            try:
                outcomes[i] = await old.put(keys.health(f"n{i}"), _health(f"n{i}"), fence=fence)
            except FencedOff as e:
                outcomes[i] = e

        # one controller's writes go one at a time: so do these, with the takeover racing
        async with anyio.create_task_group() as tg:

            async def writes() -> None:
                for i in range(150):
                    await write(i)

            tg.start_soon(writes)
            await until(lambda: _true(len(outcomes) >= 20))
            took_over_at = await _take_over(new, held)
        landed = {i: o for i, o in outcomes.items() if isinstance(o, int)}
        refused = {i: o for i, o in outcomes.items() if isinstance(o, FencedOff)}
    assert landed and refused, "the takeover did not land among the writes"
    assert max(landed.values()) < took_over_at, "a fenced write landed after the takeover"
    assert min(refused) > max(landed)  # once refused, every later one is refused too
    assert all(e.now_at is not None and e.now_at >= took_over_at for e in refused.values())


async def test_on_a_cluster_a_batch_of_fenced_writes_lands_whole_before_a_takeover_or_not_at_all(
    cluster,
):
    async with _old_and_new_leader(cluster) as (old, new, held):
        assert await old.allow_batches() is True
        fence = Fence(keys.leader(), held)
        outcomes: dict[int, bool] = {}  # batch: landed, or refused

        async def batches() -> None:
            for b in range(60):
                writes = [Write(keys.health(f"b{b}-{i}"), _health(f"b{b}-{i}")) for i in range(50)]
                try:
                    await old.write_all(writes, fence=fence)
                    outcomes[b] = True
                except FencedOff:
                    outcomes[b] = False

        async with anyio.create_task_group() as tg:
            tg.start_soon(batches)
            await until(lambda: _true(len(outcomes) >= 5))
            took_over_at = await _take_over(new, held)
        stored = await new.list(keys.pattern(keys.HEALTH), decoder(records.Health))
    landed = sorted(b for b, ok in outcomes.items() if ok)
    refused = sorted(b for b, ok in outcomes.items() if not ok)
    assert landed and refused, "the takeover did not land among the batches"
    assert max(landed) < min(refused)  # once refused, every later batch is refused too
    for b in range(60):
        revisions = [stored[k].revision for k in stored if k.startswith(f"health.b{b}-")]
        # each batch whole or not at all, and none stored after the takeover
        assert len(revisions) == (50 if b in landed else 0), b
        assert all(r < took_over_at for r in revisions)


def _health(node: str) -> records.Health:
    return records.Health(node=node, phase="ready", since=1.0)


@pytest.mark.slow
async def test_a_read_through_a_server_just_restarted_never_gets_its_stale_copy(cluster):
    """A watch's consumer may be placed on any server holding the stream, and reads that
    server's copy: one just restarted is behind until it has caught up. Every listing
    taken through it, from its first second on, holds what the bucket holds."""
    cluster.start_all()
    settings = _settings(*cluster.urls)
    stale: list[tuple[int, int, int]] = []  # (round, listing, keys behind)
    async with await Bus.connect(settings, BucketSettings(replicas=3), give_up_after=30):
        pass
    for round_ in range(2):
        leader = await until(lambda: _async(cluster.stream_leader("KV_llmgw")), timeout=30)
        down = next(i for i, s in enumerate(cluster.servers) if s.name != leader)
        others = _settings(*(u for i, u in enumerate(cluster.urls) if i != down))
        cluster.kill(down)
        value = json.dumps({"round": round_, "pad": "x" * 300}).encode()
        async with await Bus.connect(others, give_up_after=30) as w:
            for start in range(0, 2000, 200):
                async with anyio.create_task_group() as tg:
                    for k in range(start, start + 200):
                        tg.start_soon(w.put, f"nodes.n{k}", value)
        cluster.start(down)
        alone = _settings(cluster.urls[down])

        async def listing(n: int, round_: int = round_, alone: NatsSettings = alone) -> None:
            async with await Bus.connect(alone, give_up_after=30) as r:
                got = await r.list("nodes.>", lambda b: json.loads(b)["round"])
            behind = sum(1 for v in got.values() if v.value != round_) + 2000 - len(got)
            if behind:
                stale.append((round_, n, behind))

        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(listing, n)
    assert not stale, f"listings through the restarted server were behind: {stale}"


async def _async(value: object) -> object:
    return value


@pytest.mark.slow
async def test_a_shard_record_not_written_while_the_stream_had_no_leader_is_written_after(
    cluster, tmp_path, engine_ports
):
    """A stream without a leader does not disconnect the clients of the servers still up:
    their writes time out, and no reconnect follows. An agent that restarted a killed
    engine meanwhile left its shard `failed` with the dead engine's pid for good (the
    router answered 503 while the new engine served)."""
    cluster.start_all()
    here = _settings(cluster.urls[0])  # the agent's and the controller's server stays up
    gguf = str(write_fake_gguf(tmp_path / "weights" / "tiny.gguf"))
    engines = Engines(
        listen_host="127.0.0.1", poll_interval=0.1, backoff_base=0.2, backoff_cap=1, stop_grace=3
    )
    agent = start_fake_engine_agent(cluster.urls[0], tmp_path / "node1", engines, id="node1")
    try:
        async with (
            await Bus.connect(here, BucketSettings(replicas=3), give_up_after=30) as bus,
            anyio.create_task_group() as tg,
        ):
            await tg.start(Controller(bus, quick_controller(engine_ports, lost_after=300)).run)
            await serve(bus, cpu_model(gguf, host_ram_gb=1), 1)
            first = await until(lambda: _ready_shard(bus), timeout=60)
            cluster.kill(1)
            cluster.kill(2)
            await until(lambda: _write_fails(bus), timeout=30)
            readies = agent.log.read_text().count(": ready")
            os.kill(first.pid, signal.SIGKILL)
            # the new engine serves, and its `ready` could not be written
            await until(
                lambda: _async(agent.log.read_text().count(": ready") > readies), timeout=60
            )
            cluster.start(1)
            cluster.start(2)

            async def replaced() -> records.Shard | None:
                shard = await _ready_shard(bus)
                return shard if shard is not None and shard.pid != first.pid else None

            second = await until(replaced, timeout=60)
            tg.cancel_scope.cancel()
        assert psutil.pid_exists(second.pid) and not psutil.pid_exists(first.pid)
    finally:
        stop(agent.proc)


async def _ready_shard(bus: Bus) -> records.Shard | None:
    try:
        got = await bus.list("shards.node1.*", decoder(records.Shard))
    except BusError:
        return None
    shards = [e.value for e in got.values()]
    return shards[0] if len(shards) == 1 and shards[0].phase == "ready" else None


async def _write_fails(bus: Bus) -> bool:
    try:
        await bus.put("probe.write", b"1")
    except BusError:
        return True
    return False


@pytest.mark.slow
async def test_no_node_is_judged_unreachable_because_the_controllers_watch_went_silent(cluster):
    """The controller's watch is a consumer on one of the servers that hold the stream,
    not necessarily its own: when that server dies the watch goes silent while the
    controller's connection, writes and round trips are fine, and every lease looked still
    (a ready node was judged unreachable 10.7 s after a server died that led nothing and
    held none of the controller's connections)."""
    cluster.start_all()
    near = _settings(cluster.urls[0])  # the controller's server and the node's stay up
    settings = ControllerSettings(
        controller_id="c", unreachable_after=1.5, lost_after=60, leader_ttl=3, tick=0.05
    )
    async with (
        await Bus.connect(near, BucketSettings(replicas=3), give_up_after=30) as bus,
        anyio.create_task_group() as tg,
    ):
        node = SimNode(bus, inventory("n1", gpus=1))
        await node.register()
        tg.start_soon(_beat, node)
        for _ in range(20):  # until its watch is on a server that is neither its own nor the
            # stream's leader
            async with await Bus.connect(near, give_up_after=30) as own:
                scope = anyio.CancelScope()

                async def lead(own: Bus = own, scope: anyio.CancelScope = scope) -> None:
                    with scope:
                        await Controller(own, settings).run()

                tg.start_soon(lead)
                await until(lambda: _phase_is(bus, "n1", "ready"), timeout=30)
                host = await until(lambda: _watch_host(bus), timeout=30)
                leader = cluster.stream_leader("KV_llmgw")
                if host not in (leader, cluster.servers[0].name):
                    phases = await _phases_after_killing(cluster, bus, host)
                    scope.cancel()
                    break
                scope.cancel()
        else:
            pytest.fail("the controller's watch never landed on a server that leads nothing")
        tg.cancel_scope.cancel()
    assert phases == {"ready"}, f"n1 was judged {phases} while it beat throughout"


async def _beat(node: SimNode) -> None:
    while True:
        with contextlib.suppress(BusError):
            await node.beat()
        await anyio.sleep(0.2)


async def _phase_is(bus: Bus, node: str, phase: str) -> bool:
    entry = await bus.get(keys.health(node), decoder(records.Health))
    return entry is not None and entry.value.phase == phase


async def _watch_host(bus: Bus) -> str | None:
    """The server of the whole bucket's watch (the controller's: no one else watches it;
    those of the controllers stopped before have nobody bound to them)."""
    for info in await bus.js.consumers_info("KV_llmgw"):
        watched = info.config.filter_subject == "$KV.llmgw.>"
        if watched and info.push_bound and info.cluster is not None:
            return info.cluster.leader
    return None


async def _phases_after_killing(cluster: LocalCluster, bus: Bus, host: str) -> set[str]:
    """Kill `host`, and the phases n1's health shows for the next 12 s."""
    seen: set[str] = set()
    cluster.kill(cluster.index(host))
    watch = bus.watch(keys.health("n1"), decoder(records.Health))
    async with contextlib.aclosing(watch):
        with anyio.move_on_after(12):
            async for item in watch:
                if isinstance(item, Update) and item.value is not None:
                    seen.add(item.value.phase)
    return seen
