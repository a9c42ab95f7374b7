"""The router fed by the bucket (a real nats-server): which engines take requests as replicas,
shards and node health change, and what happens while NATS is away.

Records are written here as the controller and agents would write them, so each rule is
tested on its own; tests/test_router_e2e.py runs the whole chain with real agents."""

from __future__ import annotations

import time

import aiohttp
import msgspec
import pytest
from record_helpers import shard
from router_helpers import (
    SERVED,
    TINY_CPU_MODEL,
    chat_body,
    router_settings,
    running_router,
)
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus
from llmgw.router.balancer import BalancerSettings

pytestmark = pytest.mark.anyio

NO_AFFINITY = BalancerSettings(affinity_load_factor=0)


async def _place(bus: Bus, rid: str, node: str, engine, *, phase="ready", shard_phase="ready"):
    """A one-node replica of tiny on `node`, its shard in `shard_phase` at `engine`."""
    replica = records.Replica(
        model="tiny",
        rid=rid,
        profile="cpu",
        members=[records.ReplicaMember(node=node, rank=0, port=engine.port)],
        phase=phase,
        endpoint=engine.endpoint if phase == "ready" else None,
    )
    await bus.put(keys.replica("tiny", rid), replica)
    await _shard(bus, node, rid, engine, shard_phase)


async def _shard(bus: Bus, node: str, rid: str, engine, phase="ready", **fields):
    shard = records.Shard(
        node=node,
        rid=rid,
        model="tiny",
        generation=1,
        phase=phase,
        since=time.time(),
        endpoint=engine.endpoint if phase == "ready" else None,
        served_name=SERVED,
        **fields,
    )
    await bus.put(keys.shard(node, rid), shard)


def _connect(nats_settings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def _served_by(r, *, n: int = 1) -> set[str]:
    """The replicas that answer `n` requests now."""
    out = set()
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            async with http.post(f"{r.url}/v1/chat/completions", json=chat_body(f"q{i}")) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
                out.add(resp.headers["x-llmgw-replica"])
    return out


def _routable(r) -> set[str]:
    route = r.table.route(SERVED)
    return {b.id for b in route.backends} if route else set()


async def _routes_become(r, ids: set[str]) -> None:
    async def check():
        return _routable(r) == ids

    await until(check, timeout=10)


async def test_serves_ready_replicas_and_follows_the_bucket(bus, nats_settings, engines):
    a, b = engines.start(), engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", a)
    settings = router_settings(balancer=NO_AFFINITY)
    async with running_router(connect=_connect(nats_settings), settings=settings) as r:
        await _routes_become(r, {"r1"})
        assert await _served_by(r) == {"r1"}
        await _place(bus, "r2", "n2", b)
        await _routes_become(r, {"r1", "r2"})
        assert await _served_by(r, n=20) == {"r1", "r2"}
        await bus.delete(keys.replica("tiny", "r1"))  # removed: its shard is now an orphan
        await _routes_become(r, {"r2"})
        assert await _served_by(r, n=5) == {"r2"}
        async with aiohttp.ClientSession() as http, http.get(f"{r.url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [SERVED]


async def test_a_draining_replica_finishes_its_stream_and_takes_no_new_request(
    bus, nats_settings, engines
):
    slow = engines.start({"FAKE_ENGINE_TOKENS": "60", "FAKE_ENGINE_TOKEN_RATE": "20"})
    other = engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", slow)
    settings = router_settings(balancer=NO_AFFINITY)
    async with (
        running_router(connect=_connect(nats_settings), settings=settings) as r,
        aiohttp.ClientSession() as http,
    ):
        await _routes_become(r, {"r1"})
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body(stream=True)) as stream:
            assert stream.headers["x-llmgw-replica"] == "r1"
            await stream.content.readany()
            await _place(bus, "r2", "n2", other)
            replica = (await bus.get(keys.replica("tiny", "r1"), _decode_replica)).value
            await bus.put(
                keys.replica("tiny", "r1"), msgspec.structs.replace(replica, phase="draining")
            )
            await _routes_become(r, {"r2"})
            assert await _served_by(r, n=10) == {"r2"}
            assert slow.in_flight() == 1  # still streaming from the draining replica
            rest = await stream.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        assert rest.count(b"tok59 ") == 1


def _decode_replica(data: bytes) -> records.Replica:
    return records.decode(data, records.Replica)


async def test_lost_nodes_orphans_and_unready_shards_take_no_request(bus, nats_settings, engines):
    a, b, stray = engines.start(), engines.start(), engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", a)
    await _place(bus, "r2", "n2", b)
    # an orphan: a ready shard of r2 on a node that is not r2's member (its replica moved)
    await _shard(bus, "n3", "r2", stray)
    settings = router_settings(balancer=NO_AFFINITY)
    async with running_router(connect=_connect(nats_settings), settings=settings) as r:
        await _routes_become(r, {"r1", "r2"})
        served = {b_.address for b_ in r.table.route(SERVED).backends}
        assert stray.endpoint not in served
        await bus.put(keys.health("n1"), records.Health(node="n1", phase="lost", since=time.time()))
        await _routes_become(r, {"r2"})
        await bus.put(
            keys.health("n1"), records.Health(node="n1", phase="ready", since=time.time())
        )
        await _routes_become(r, {"r1", "r2"})
        await _shard(bus, "n2", "r2", b, phase="loading")
        await _routes_become(r, {"r1"})
        assert await _served_by(r, n=5) == {"r1"}


async def test_a_shard_is_owned_by_its_key_not_by_what_its_value_claims(
    bus, nats_settings, engines
):
    real, impostor = engines.start(), engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", real, shard_phase="loading")
    # n9 writes its own key, claiming to be n1's ready shard of r1
    spoof = shard("n1", "r1", "ready", model="tiny", since=time.time(), endpoint=impostor.endpoint)
    await bus.put(keys.shard("n9", "r1"), spoof)
    async with running_router(connect=_connect(nats_settings)) as r:
        await until(lambda: _true(r.table.synced), timeout=10)
        assert _routable(r) == set()


async def _true(v: bool) -> bool:
    return v


async def test_no_ready_replica_answers_503_with_the_placement_explanation(
    bus, nats_settings, engines
):
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await bus.put(
        keys.placement("tiny"),
        records.PlacementRecord(
            model="tiny", desired=1, placed=0, explanation="0/2 nodes fit: 2 lost"
        ),
    )
    async with (
        running_router(connect=_connect(nats_settings)) as r,
        aiohttp.ClientSession() as http,
    ):
        await until(lambda: _true(r.table.synced), timeout=10)
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 503
            assert resp.headers["retry-after"]
            err = (await resp.json())["error"]
        assert err["code"] == "no_ready_replica"
        assert "0/2 nodes fit: 2 lost" in err["message"]
        async with http.get(f"{r.url}/v1/models") as resp:
            assert (await resp.json())["data"] == []  # nothing to send to


async def test_before_the_bucket_is_read_requests_get_503_saying_so(tmp_path):
    from llmgw.bus.client import NatsSettings
    from llmgw.bus.server import free_port

    nowhere = NatsSettings(urls=(f"nats://127.0.0.1:{free_port()}",), connect_timeout=0.2)
    async with (
        running_router(connect=_connect(nowhere)) as r,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 503
            assert "not read the fleet's state" in (await resp.json())["error"]["message"]
        async with http.get(f"{r.url}/health") as resp:
            health = await resp.json()
        assert health["nats"] == "connecting" and health["bucket_read"] is False


async def test_keeps_serving_while_nats_is_down_and_follows_again_after(
    bus, nats_settings, nats_server, engines
):
    a, b = engines.start(), engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", a)
    settings = router_settings(balancer=NO_AFFINITY)
    async with running_router(connect=_connect(nats_settings), settings=settings) as r:
        await _routes_become(r, {"r1"})
        nats_server.stop()
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{r.url}/health") as resp:
                health = await resp.json()
        assert await _served_by(r, n=5) == {"r1"}  # from the last table
        nats_server.start()
        writer = await Bus.connect(nats_settings, give_up_after=10)
        try:
            await _place(writer, "r2", "n2", b)
            await _routes_become(r, {"r1", "r2"})  # watching again
        finally:
            await writer.close()
        assert await _served_by(r, n=20) == {"r1", "r2"}
    assert health["status"] == "ok"


async def test_garbled_values_keep_the_last_catalog_and_drop_the_shard(bus, nats_settings, engines):
    a, b = engines.start(), engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await _place(bus, "r1", "n1", a)
    await _place(bus, "r2", "n2", b)
    async with running_router(connect=_connect(nats_settings)) as r:
        await _routes_become(r, {"r1", "r2"})
        await bus.put(keys.catalog("tiny"), b'{"id": "tiny", "served_name": 42}')
        await bus.put(keys.shard("n2", "r2"), b"\x00garbage")
        await _routes_become(r, {"r1"})
        assert await _served_by(r, n=3) == {"r1"}  # the model is still known by its name


async def _refused(r, http) -> str:
    """The router's 503 for a request now: its message."""
    async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
        assert resp.status == 503, await resp.text()
        return (await resp.json())["error"]["message"]


async def test_status_says_a_replica_serves_exactly_when_the_router_sends_it_requests(
    bus, nats_settings, engines
):
    """After an engine crash, while its agent restarted it and no controller ran, `llmgw
    status` said 1/1 ready and the router answered 503. A replica on a node declared
    unreachable serves (its engine answers the router directly) and status says so; one on
    a node declared lost is refused by both."""
    from llmgw.cli.status import gather, render

    a = engines.start()
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    await bus.put(keys.desired("tiny"), records.Desired(model="tiny", replicas=1))
    ready = records.Health(node="n1", phase="ready", since=time.time())
    await bus.put(keys.health("n1"), ready)
    await _place(bus, "r1", "n1", a)
    async with (
        running_router(connect=_connect(nats_settings)) as r,
        aiohttp.ClientSession() as http,
    ):
        await _routes_become(r, {"r1"})
        assert "  tiny: 1/1 ready  (fixed)" in render(await gather(bus), now=time.time())

        # the engine crashed: its agent restarts it; the replica's record still says ready
        await _shard(bus, "n1", "r1", a, phase="starting", restarts=1)
        await _routes_become(r, set())
        text = render(await gather(bus), now=time.time())
        assert "  tiny: 0/1 ready, 1 ready but not serving  (fixed)" in text
        assert "    why not: r1 ready, engine on n1 starting" in text
        assert "r1 engine on n1 starting" in await _refused(r, http)

        # the engine is back, its node no longer heard from: its engine still answers the
        # router, which sends it requests, and status says so beside the node's phase
        await _shard(bus, "n1", "r1", a)
        await bus.put(keys.health("n1"), msgspec.structs.replace(ready, phase="unreachable"))
        await _routes_become(r, {"r1"})
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200, await resp.text()
        fleet = await gather(bus)
        (replica,) = fleet.models["tiny"].replicas
        assert replica.serving and replica.state.startswith("ready, node n1 unreachable")

        # the node declared lost: its replica is refused (it is placed elsewhere)
        await bus.put(keys.health("n1"), msgspec.structs.replace(ready, phase="lost"))
        await _routes_become(r, set())
        assert "r1 node n1 lost" in await _refused(r, http)
        (replica,) = (await gather(bus)).models["tiny"].replicas
        assert not replica.serving and replica.state.startswith("ready, node n1 lost")

        await bus.put(keys.health("n1"), ready)
        await _routes_become(r, {"r1"})
        assert (await gather(bus)).models["tiny"].ready == 1
