"""Autoscaling end to end: three agent processes (three hosts on one machine, one loopback
address each) run the fake engine, a controller leads, routers serve from the bucket, and
clients' load moves the replica count: up within seconds of a burst, down after the down
window with drains, to zero when idle and back at the first request, which waits and then
succeeds (streamed too); one that cannot wait gets 503 with Retry-After; two routers' load
is summed once; a controller taking over in the middle of a scale-up places no surplus.
Windows are short here (a second or two); docs/placement.md gives the real defaults."""

from __future__ import annotations

import re

import aiohttp
import anyio
import pytest
from agent_helpers import NODES, start_agents, stop_agents
from autoscale_fleet import (
    Phases,
    Streams,
    autoscaled_model,
    controller_settings,
    replicas_of,
    serve_auto,
)
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import SERVED, chat_body, router_settings, running_router
from serving import sse_events
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.loop import Controller
from llmgw.router.hold import HoldSettings

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def fleet(tmp_path, nats_server):
    procs = start_agents(nats_server.url, tmp_path)
    yield tmp_path
    stop_agents(procs)


@pytest.fixture
async def controller(nats_settings, engine_ports):
    b = await Bus.connect(nats_settings, give_up_after=5)
    async with anyio.create_task_group() as tg:
        await tg.start(Controller(b, controller_settings("c1", engine_ports)).run)
        yield
        tg.cancel_scope.cancel()
    await b.close()


def _model(tmp_path, **kw):
    return autoscaled_model(tmp_path / "weights", **kw)


async def _scale(bus: Bus) -> records.Scale | None:
    got = await bus.get(keys.scale("tiny"), decoder(records.Scale))
    return got.value if got else None


async def _nodes_ready(bus: Bus) -> None:
    async def every_node_ready():
        got = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
        return sum(e.value.phase == "ready" for e in got.values()) == len(NODES)

    await until(every_node_ready, timeout=30)


def _ready(router, n: int):
    async def check():
        route = router.table.route(SERVED)
        return route is not None and len(route.backends) == n

    return check


def _connect(nats_settings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def test_a_burst_scales_up_and_its_end_scales_down_after_the_window_with_drains(
    bus, nats_settings, fleet, controller
):
    await _nodes_ready(bus)
    await serve_auto(bus, _model(fleet))
    phases = Phases(bus)
    stop_watch = anyio.Event()
    async with (
        running_router(connect=_connect(nats_settings), settings=router_settings()) as router,
        anyio.create_task_group() as outer,
    ):
        outer.start_soon(phases.run, stop_watch)
        await until(_ready(router, 1), timeout=60)  # min_replicas
        streams = Streams([router.url])
        stop_load = anyio.Event()
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            tg.start_soon(streams.run, http, 6, stop_load)
            # 6 in flight, target 1, at most 3: a panic scale-up to the ceiling
            await until(_ready(router, 3), timeout=60)
            done = streams.completed
            await until(lambda: _true(streams.completed >= done + 12), timeout=30)
            stop_load.set()
        scale = await _scale(bus)
        assert scale is not None and scale.limited == "max_replicas 3", scale
        # the burst arrives over a second or so: straight to 3, or by way of 2
        assert re.match(
            r"[12] -> 3: [\d.]+ in flight( and \d+ waiting)? over [12] replicas?, target 1",
            scale.reason,
        )
        # the load ended: back to the floor once the down window passed, by draining
        await until(_ready(router, 1), timeout=60)

        async def one_left():
            reps = await replicas_of(bus)
            return len(reps) == 1 and reps[0].phase == "ready"

        await until(one_left, timeout=60)
        stop_watch.set()
    assert streams.failed == [], streams.failed[:5]
    assert len(streams.replicas) == 3, streams.replicas  # the new replicas took traffic
    removed = [
        rid
        for rid, seen in phases.seen.items()
        if rid not in {r.rid for r in await replicas_of(bus)}
    ]
    assert len(removed) == 2, phases.seen
    assert all("draining" in phases.seen[rid] for rid in removed), phases.seen
    placement = (await bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))).value
    # the load's end comes over a second or so too: a window whose samples still hold the
    # tail of the load (a mean of 1-2 in flight) takes the most they asked, 2, and the next
    # window the rest; straight to 1, or by way of 2
    assert re.match(
        r"[23] -> 1: 0 in flight over [23] replicas, target 1, for 2 s", placement.scaled
    ), placement.scaled


async def _true(value: bool) -> bool:
    return value


async def _cold(bus: Bus, router) -> None:
    """Scaled to zero: no replica left, and /v1/models lists the model as cold."""

    async def none_left():
        scale = await _scale(bus)
        return scale is not None and scale.replicas == 0 and not await replicas_of(bus)

    await until(none_left, timeout=60)

    async def listed_cold():
        async with aiohttp.ClientSession() as http, http.get(f"{router.url}/v1/models") as r:
            listed = (await r.json())["data"]
        return [(m["id"], m.get("cold")) for m in listed] == [(SERVED, True)]

    await until(listed_cold, timeout=10)


async def test_a_cold_models_first_requests_wait_for_a_replica_and_succeed_streamed_too(
    bus, nats_settings, fleet, controller
):
    await _nodes_ready(bus)
    # no request for 1 s: to zero; each replica takes a second to load
    await serve_auto(bus, _model(fleet, idle_unload_after=1, env={"FAKE_ENGINE_LOAD_SECONDS": "1"}))
    async with running_router(
        connect=_connect(nats_settings), settings=router_settings()
    ) as router:
        await _cold(bus, router)
        events: list[str] = []

        async def streamed():
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{router.url}/v1/chat/completions", json=chat_body(stream=True)) as r,
            ):
                assert r.status == 200, await r.text()
                async for data in sse_events(r):
                    events.append(data)

        async def plain():
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{router.url}/v1/chat/completions", json=chat_body()) as r,
            ):
                assert r.status == 200, await r.text()
                return await r.json()

        answers = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(streamed)

            async def keep():
                answers.append(await plain())

            tg.start_soon(keep)
        assert events[-1] == "[DONE]" and len(events) > 2, events
        assert answers[0]["choices"][0]["message"]["content"], answers
        scale = await _scale(bus)
        # two requests waiting, target 1: two replicas
        assert scale is not None and scale.replicas == 2, scale
        assert (
            scale.reason
            == "0 -> 2: cold start, 0 in flight and 2 waiting over 0 replicas, target 1"
        )
        assert scale.load_s >= 1.0, scale  # measured: the engine's second of loading at least


@pytest.mark.parametrize("bounds", ["router", "model"])
async def test_a_request_that_cannot_wait_gets_503_with_retry_after_and_a_full_hold_429(
    bus, nats_settings, fleet, controller, bounds
):
    """One request held at most: by the router's --hold-max, or by the model's own
    autoscale.hold_max over the router's default (256)."""
    await _nodes_ready(bus)
    own = {"hold_max": 1, "hold_timeout": 30} if bounds == "model" else {}
    model = _model(fleet, idle_unload_after=1, env={"FAKE_ENGINE_LOAD_SECONDS": "3"}, **own)
    await serve_auto(bus, model)
    hold = HoldSettings(max_held=1, max_wait=30) if bounds == "router" else HoldSettings()
    settings = router_settings(hold=hold)
    async with (
        running_router(connect=_connect(nats_settings), settings=settings) as router,
        aiohttp.ClientSession() as http,
    ):
        await _cold(bus, router)
        async with http.post(
            f"{router.url}/v1/chat/completions",
            json=chat_body(),
            headers={"x-llmgw-max-wait": "0"},
        ) as r:
            assert r.status == 503
            assert int(r.headers["retry-after"]) >= 1
            error = (await r.json())["error"]
        assert error["code"] == "model_cold"
        assert f"model {SERVED!r} is cold" in error["message"]
        assert "the client does not wait" in error["message"]
        # it asked for a replica all the same
        await until(lambda: _scaled_to(bus, 1), timeout=30)

        # one held (its replica loads for 3 s), the next finds the hold full
        async def held():
            async with http.post(f"{router.url}/v1/chat/completions", json=chat_body()) as r:
                return r.status

        statuses = []
        async with anyio.create_task_group() as tg:

            async def first():
                statuses.append(await held())

            tg.start_soon(first)
            await until(lambda: _true(router.holds.held.get("tiny", 0) == 1), timeout=10)
            # the router's /metrics says so too, as Prometheus reads it
            async with http.get(f"{router.url}/metrics") as r:
                families = text_string_to_metric_families(await r.text())
                held = {
                    s.labels["model"]: s.value
                    for f in families
                    if f.name == "llmgw_router_held"
                    for s in f.samples
                }
            assert held == {"tiny": 1}
            async with http.post(f"{router.url}/v1/chat/completions", json=chat_body()) as r:
                assert r.status == 429, await r.text()
                assert "hold queue is full" in (await r.json())["error"]["message"]
                assert int(r.headers["retry-after"]) >= 1
        assert statuses == [200]


async def _scaled_to(bus: Bus, n: int) -> bool:
    scale = await _scale(bus)
    return scale is not None and scale.replicas == n


async def test_two_routers_load_is_summed_once(bus, nats_settings, fleet, controller):
    await _nodes_ready(bus)
    # long streams: four always in flight, two through each router; target 1, at most 6
    model = _model(
        fleet,
        max_replicas=6,
        scale_up_after=30,  # no stable-window scale-up meanwhile: the panic alone moves it
        env={"FAKE_ENGINE_TOKENS": "400", "FAKE_ENGINE_TOKEN_RATE": "100"},
    )
    await serve_auto(bus, model)
    async with (
        running_router(connect=_connect(nats_settings), settings=router_settings()) as a,
        running_router(connect=_connect(nats_settings), settings=router_settings()) as b,
    ):
        await until(_ready(a, 1), timeout=60)
        await until(_ready(b, 1), timeout=60)
        streams = Streams([a.url, b.url])
        stop_load = anyio.Event()
        seen: list[records.Scale] = []
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            tg.start_soon(streams.run, http, 4, stop_load)

            async def summed():
                scale = await _scale(bus)
                if scale is not None and scale.routers == 2:
                    seen.append(scale)
                return scale is not None and scale.replicas == 4 and scale.routers == 2

            await until(summed, timeout=60)
            stop_load.set()
    assert streams.failed == [], streams.failed[:5]
    # 4 in flight wants 4 replicas: counted twice it would be 8, and 6 (the ceiling)
    assert all(s.in_flight <= 4 and s.replicas <= 4 for s in seen), seen
    assert re.match(r"\d -> 4: [\d.]+ in flight over \d replicas?, target 1", seen[-1].reason)


@pytest.mark.parametrize("how", ["stops", "dies"])
async def test_a_controller_taking_over_during_a_scale_up_places_no_surplus(
    bus, nats_settings, fleet, how, engine_ports
):
    """The leader stops (and resigns), or dies without a word as SIGKILL leaves it (its
    lease expires), while the replicas it scaled up are still loading."""
    # replicas load for 2 s: the takeover comes while the new ones load
    await serve_auto(bus, _model(fleet, env={"FAKE_ENGINE_LOAD_SECONDS": "2"}))
    phases = Phases(bus)
    stop_all = anyio.Event()
    a_bus = await Bus.connect(nats_settings, give_up_after=5)
    b_bus = await Bus.connect(nats_settings, give_up_after=5)
    try:
        async with anyio.create_task_group() as tg:
            a_scope = anyio.CancelScope()

            async def run_a():
                a = Controller(a_bus, controller_settings("a", engine_ports))
                if how == "dies":

                    async def says_nothing() -> None:
                        pass  # a process killed hard resigns nothing: its lease just expires

                    a._resign = says_nothing  # type: ignore[method-assign]
                with a_scope:
                    await a.run()

            tg.start_soon(run_a)
            await until(lambda: _leader_is(bus, "a"), timeout=20)
            await _nodes_ready(bus)  # health is the leader's to write
            b = Controller(b_bus, controller_settings("b", engine_ports))
            await tg.start(b.run)
            tg.start_soon(phases.run, stop_all)
            async with running_router(
                connect=_connect(nats_settings), settings=router_settings()
            ) as router:
                await until(_ready(router, 1), timeout=60)
                streams = Streams([router.url])
                stop_load = anyio.Event()
                async with aiohttp.ClientSession() as http, anyio.create_task_group() as load:
                    load.start_soon(streams.run, http, 6, stop_load)

                    async def scaling_up():
                        reps = await replicas_of(bus)
                        return (
                            await _scaled_to(bus, 3)
                            and len(reps) == 3
                            and any(r.phase != "ready" for r in reps)
                        )

                    await until(scaling_up, timeout=60)
                    a_scope.cancel()  # the leader goes away mid scale-up
                    await until(lambda: _true(b.leading), timeout=20)
                    await until(_ready(router, 3), timeout=60)
                    done = streams.completed
                    await until(lambda: _true(streams.completed >= done + 6), timeout=30)
                    stop_load.set()
            stop_all.set()
            tg.cancel_scope.cancel()
    finally:
        await a_bus.close()
        await b_bus.close()
    assert streams.failed == [], streams.failed[:5]
    assert phases.most_counted == 3, phases.seen  # never a fourth replica
    assert len(phases.seen) == 3, phases.seen


async def _leader_is(bus: Bus, name: str) -> bool:
    got = await bus.get(keys.leader(), decoder(records.Leader))
    return got is not None and got.value.holder == name


async def test_engines_that_say_they_are_saturated_scale_the_model_up_with_no_router(
    bus, fleet, controller
):
    """No router sees any load; the engine itself reports its KV cache 95% full on its
    /metrics. Through the agent's heartbeat it reaches the leader, which adds a replica and
    says why, with the engine's figure."""
    await _nodes_ready(bus)
    await serve_auto(bus, _model(fleet, env={"FAKE_ENGINE_KV_USAGE": "0.95"}))

    async def reported():
        got = await bus.list(keys.pattern(keys.LEASES), decoder(records.Lease))
        loads = [e for entry in got.values() for e in entry.value.engines]
        return loads if loads and loads[0].kv_cache == 0.95 else None

    (load,) = await until(reported, timeout=30)
    assert load.model == "tiny" and load.running == 0 and load.waiting == 0

    async def two():
        s = await _scale(bus)
        return s if s is not None and s.replicas >= 2 else None

    scale = await until(two, timeout=30)
    # 1 -> 2 (or, if the new replica's engine already spoke too, 2 -> 3)
    assert re.match(r"(1 -> 2|2 -> 3): 0 in flight over [12] replicas?, target 1, ", scale.reason)
    assert "an engine's KV cache 95% full (over 80%)" in scale.reason
