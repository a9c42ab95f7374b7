"""Who waits when the fleet is full, through real routers fed by a real nats-server and real
(fake) engines: requests past an engine's slots wait at the router and leave by class; a
client cannot raise its class; waits are bounded per class and refused with a reason (in
the audit trail too); shares of an engine move between routers as routers come and go."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import anyio
import pytest
from router_helpers import (
    StreamingLoad,
    chat_body,
    place_replica,
    put_key,
    router_settings,
    running_router,
    static_model,
    tiny_model,
)
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import AuditTrail, ensure_streams
from llmgw.router.flow import FlowSettings

pytestmark = pytest.mark.anyio

# a stream of 10 s: what holds an engine's slot until the test lets it go
SLOW = {"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_RATE": "40"}
QUICK = 2  # max_tokens of a request that is over in 50 ms on that engine


def _connect(nats_settings: NatsSettings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


def _auth(secret: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"} if secret else {}


@contextlib.asynccontextmanager
async def _router(nats_settings: NatsSettings, bus: Bus, engine, parallel: int, **settings):
    await place_replica(bus, engine, tiny_model(parallel))
    s = router_settings(**settings)
    async with running_router(connect=_connect(nats_settings), settings=s) as r:
        await until(lambda: _async(r.table.served_names()), timeout=10)
        yield r


async def _async(value: object) -> object:
    return value


def _depth(r) -> int:
    q = r.flow.queues.get("tiny")
    return q.depth if q is not None else 0


async def _blocked(http: aiohttp.ClientSession, r, secret: str) -> aiohttp.ClientResponse:
    """A stream holding one of the engine's slots until the test closes it."""
    resp = await http.post(
        f"{r.url}/v1/chat/completions", json=chat_body("hold", stream=True), headers=_auth(secret)
    )
    assert resp.status == 200
    await resp.content.readline()
    return resp


async def _known(r, *names: str) -> bool:
    table = r.gateway.table
    return all(table.key(n) is not None for n in names)


async def _leaving_order(
    r, secrets: dict[str, str], arriving: list[str], asks: dict | None = None
) -> list[str]:
    """With the engine's one slot held, requests of each key in `arriving` wait at the router
    in that order (`asks`: extra headers and body of a key's request); the slot freed, the
    order they are answered in (one at a time)."""
    done: list[str] = []
    async with aiohttp.ClientSession() as http:
        blocker = await _blocked(http, r, secrets["web"])

        async def one(name: str) -> None:
            headers, extra = (asks or {}).get(name, ({}, {}))
            async with http.post(
                f"{r.url}/v1/chat/completions",
                json=chat_body(name, max_tokens=QUICK, **extra),
                headers={**_auth(secrets[name]), **headers},
            ) as resp:
                assert resp.status == 200, await resp.text()
            done.append(name)

        async with anyio.create_task_group() as tg:
            for n, name in enumerate(arriving, start=1):
                tg.start_soon(one, name)
                await until(lambda n=n: _async(_depth(r) == n), timeout=5)
            blocker.close()  # the slot frees: they leave one by one
    return done


async def test_requests_past_an_engine_s_slots_wait_at_the_router_and_leave_by_class(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    engine = engines.start(SLOW, "-np", "1")
    await bus.put(keys.team("batch"), records.Team(team="batch", priority="sheddable"))
    secrets = {
        "web": await put_key(bus, "web"),
        "batch": await put_key(bus, "batch", team="batch"),  # sheddable from its team
        "ops": await put_key(bus, "ops", priority="critical"),
    }
    async with _router(nats_settings, bus, engine, parallel=1) as r:
        await until(lambda: _known(r, *secrets), timeout=5)
        # they arrive sheddable first, critical last; each waits at the router, not at the
        # engine (which runs one and would defer the rest in arrival order)
        assert await _leaving_order(r, secrets, ["batch", "web", "ops"]) == ["ops", "web", "batch"]
        metrics = r.metrics.render().decode()
        assert 'llmgw_router_engine_capacity{model="tiny",replica="r1"} 1.0' in metrics
        waited = (
            'llmgw_router_queue_wait_seconds_count{class="sheddable",model="tiny",team="batch"}'
        )
        assert waited in metrics
        # the fleet page: its queue by class and team, how many wait and how long they waited
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{r.url}/fleet/state", headers=_auth(secrets["web"])) as resp:
                state = await resp.json()
        (tiny,) = [m for m in state["models"] if m["id"] == "tiny"]
        queue = {(q["class"], q["team"]): q for q in tiny["load"]["queue"]}
        assert queue["sheddable", "batch"]["waiting"] == 0
        assert queue["sheddable", "batch"]["wait"]["count"] == 1
        assert queue["critical", ""]["wait"]["count"] == 1
        assert tiny["load"]["share"] == 1


async def test_a_client_can_lower_its_class_but_never_raise_it(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    engine = engines.start(SLOW, "-np", "1")
    secrets = {
        "batch": await put_key(bus, "batch", priority="sheddable"),
        "web": await put_key(bus, "web"),
        "polite": await put_key(bus, "polite"),
    }
    asks = {
        # a sheddable key asking for more, both ways a client can: it stays sheddable
        "batch": ({"x-llmgw-priority": "critical"}, {"service_tier": "priority"}),
        # a standard key asking for less (OpenAI's flex tier): it is sheddable
        "polite": ({}, {"service_tier": "flex"}),
    }
    async with _router(nats_settings, bus, engine, parallel=1) as r:
        await until(lambda: _known(r, *secrets), timeout=5)
        order = await _leaving_order(r, secrets, ["batch", "polite", "web"], asks)
        # standard first; the two sheddable ones in the order they came
        assert order == ["web", "batch", "polite"]


async def _audited(bus: Bus, reason: str, n: int) -> list[records.AuditRecord] | None:
    """The audit trail's records refused for `reason`, once there are `n`."""
    found = []
    async with contextlib.aclosing(AuditTrail(bus).read(since=time.time() - 120)) as it:
        async for rec in it:
            if rec.refused == reason:
                found.append(rec)
    return found if len(found) >= n else None


async def test_waits_are_bounded_per_class_and_each_refusal_says_why_to_client_and_audit(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    engine = engines.start(SLOW, "-np", "1")
    secrets = {
        "batch": await put_key(bus, "batch", priority="sheddable"),
        "web": await put_key(bus, "web"),
    }
    flow = FlowSettings(max_wait=(60.0, 0.3, 0.3))
    async with _router(nats_settings, bus, engine, parallel=1, flow=flow) as r:
        await until(lambda: _known(r, *secrets), timeout=5)
        async with aiohttp.ClientSession() as http:
            blocker = await _blocked(http, r, secrets["web"])
            answers = {}
            for name in secrets:
                async with http.post(
                    f"{r.url}/v1/chat/completions",
                    json=chat_body(name, max_tokens=QUICK),
                    headers=_auth(secrets[name]),
                ) as resp:
                    answers[name] = (resp.status, resp.headers.copy(), await resp.json())
            blocker.close()
        for name, (status, cls) in {"batch": (429, "sheddable"), "web": (503, "standard")}.items():
            got, headers, body = answers[name]
            assert got == status
            assert int(headers["retry-after"]) >= 1
            assert headers["x-llmgw-refused"] == "queue_timeout"
            assert headers["x-llmgw-priority"] == cls
            assert body["error"]["code"] == "queue_timeout"
            assert f"this {cls} request waited 0.3 s" in body["error"]["message"]
        trail = await until(lambda: _audited(bus, "queue_timeout", 2), timeout=5)
        assert sorted((t.key, t.status) for t in trail) == [("batch", 429), ("web", 503)]


async def test_a_full_queue_makes_the_newest_of_a_lower_class_give_way(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    engine = engines.start(SLOW, "-np", "1")
    secrets = {
        "batch": await put_key(bus, "batch", priority="sheddable"),
        "web": await put_key(bus, "web"),
        "ops": await put_key(bus, "ops", priority="critical"),
    }
    flow = FlowSettings(max_queued=1)
    async with _router(nats_settings, bus, engine, parallel=1, flow=flow) as r:
        await until(lambda: _known(r, *secrets), timeout=5)
        answers: dict[str, tuple[int, str | None]] = {}
        async with aiohttp.ClientSession() as http:
            blocker = await _blocked(http, r, secrets["web"])

            async def one(name: str) -> None:
                async with http.post(
                    f"{r.url}/v1/chat/completions",
                    json=chat_body(name, max_tokens=QUICK),
                    headers=_auth(secrets[name]),
                ) as resp:
                    answers[name] = (resp.status, resp.headers.get("x-llmgw-refused"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "batch")
                await until(lambda: _async(_depth(r) == 1), timeout=5)
                tg.start_soon(one, "ops")  # the batch request gives way to it
                await until(lambda: _async("batch" in answers), timeout=5)
                tg.start_soon(one, "web")  # nothing below standard waits: it is refused
                await until(lambda: _async("web" in answers), timeout=5)
                blocker.close()
        assert answers == {
            "batch": (429, "queue_full"),
            "web": (503, "queue_full"),
            "ops": (200, None),
        }


def _share(r) -> int | None:
    (b,) = [b for b in r.table.backends() if b.routable]
    return b.share


async def _engine_holds(http: aiohttp.ClientSession, engine) -> int:
    """Requests the engine holds, running and deferred (its own /metrics)."""
    async with http.get(f"{engine.url}/metrics") as resp:
        text = await resp.text()
    held = 0
    for line in text.splitlines():
        if line.startswith(("llamacpp:requests_processing", "llamacpp:requests_deferred")):
            held += int(float(line.split()[-1]))
    return held


async def test_an_engine_is_split_between_routers_and_its_share_moves_as_routers_come_and_go(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    # 4 slots; streams of 2 s, so that places turn over while the routers' shares move
    engine = engines.start(
        {"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_RATE": "200"}, "-np", "4"
    )
    await place_replica(bus, engine, tiny_model(4))
    most = 0
    loads = {"ra": StreamingLoad(""), "rb": StreamingLoad("")}

    def settings(router_id: str):
        return router_settings(router_id=router_id)

    async with (
        aiohttp.ClientSession() as http,
        running_router(connect=_connect(nats_settings), settings=settings("ra")) as a,
        anyio.create_task_group() as tg,
    ):
        stop_a = anyio.Event()
        loads["ra"].url = a.url
        await until(lambda: _async(a.table.served_names()), timeout=10)
        tg.start_soon(loads["ra"].run, http, 6, stop_a)

        async def sample() -> None:
            nonlocal most
            while True:
                most = max(most, await _engine_holds(http, engine))
                await anyio.sleep(0.02)

        tg.start_soon(sample)
        async with running_router(connect=_connect(nats_settings), settings=settings("rb")) as b:
            loads["rb"].url = b.url
            await until(lambda: _async(b.table.served_names()), timeout=10)
            stop_b = anyio.Event()
            async with anyio.create_task_group() as tgb:
                tgb.start_soon(loads["rb"].run, http, 6, stop_b)
                # the same demand at each (one class, no team): half the engine each
                await until(lambda: _async(_share(a) == 2 and _share(b) == 2), timeout=10)
                stop_b.set()  # its load first, then the router, which deletes its load key
        await until(lambda: _async(_share(a) == 4 and a.flights.model("tiny") == 4), timeout=10)
        # a router that appears, asking as much, and then falls silent without deleting its
        # key (killed): counted while its record moves, and not once it has stopped moving
        ghost = records.RouterLoad(
            router="ghost",
            seq=1,
            at=time.time(),
            models={"tiny": records.ModelLoad(demand={"standard": {"": 6}})},
        )
        await bus.put(keys.load("ghost"), ghost)
        await until(lambda: _async(_share(a) == 2), timeout=10)
        await until(lambda: _async(_share(a) == 4), timeout=10)
        stop_a.set()
        tg.cancel_scope.cancel()
    assert loads["ra"].failed == [] and loads["rb"].failed == []
    # while shares moved, what the routers together sent the engine: its capacity, and at
    # most the share that moved (a router's requests already sent are never called back)
    assert 4 <= most <= 4 + 2


async def test_without_a_profile_the_router_learns_an_engine_s_slots_and_holds_the_rest(engines):
    engine = engines.start(SLOW, "-np", "2")  # a static endpoint: no profile says its slots
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        (b,) = r.table.backends()
        await until(lambda: _async(b.slots == 2), timeout=10)  # its /slots lists two
        streams = [await _blocked(http, r, "") for _ in range(2)]
        third = asyncio.ensure_future(
            http.post(f"{r.url}/v1/chat/completions", json=chat_body("third", max_tokens=QUICK))
        )
        await until(lambda: _async(_depth(r) == 1), timeout=5)
        assert engine.in_flight() == 2  # the third waits at the router, not in the engine
        streams[0].close()
        async with await third as resp:
            assert resp.status == 200
        streams[1].close()
