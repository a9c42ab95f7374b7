"""The bounds a limit keeps where a request or a window ends at a bad moment: places in flight
held across a minute boundary by one router are never taken by another, and a client that
leaves while its request waits for a claim takes nothing with it. Real routers (or their
limiters) against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import anyio
import pytest
from raw_engine import Action, RawEngine, answer
from router_helpers import chat_body, router_settings, running_router
from test_gateway_limits import T0, Clock, _admitted, _burst, _key, router
from test_router_gateway import _place
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import Counters, ensure_streams
from llmgw.gateway import credentials
from llmgw.gateway.refusals import Refusal
from llmgw.gateway.usage import Usage

pytestmark = pytest.mark.anyio


@pytest.fixture
async def streams(bus: Bus) -> Bus:
    await ensure_streams(bus)
    return bus


async def test_places_held_across_a_minute_boundary_are_not_taken_by_another_router(
    streams: Bus, nats_settings: NatsSettings
) -> None:
    """Router a holds three long streams under max_parallel=3 from minute w; router b, in
    minute w+1 and w+2, finds every place taken; once a's streams end, b gets them."""
    secret = credentials.new_secret("k1")
    clock = Clock()
    async with (
        router(nats_settings, clock, _key(secret, max_parallel=3)) as (_, a),
        router(nats_settings, clock, _key(secret, max_parallel=3)) as (_, b),
    ):
        held = _admitted(await _burst([a], 3, secret))
        assert len(held) == 3
        for minute in (1, 2):
            clock.now = T0 + 60 * minute  # the next minute: a's places are on its counter too
            refused = await b.admit(authorization=f"Bearer {secret}", model="m")
            assert isinstance(refused, Refusal), f"b admitted a 4th in flight in minute +{minute}"
            assert refused.type == "requests_in_flight"
            await a.flush()  # a's loop: its places claimed on the minute after this one
        for h in held:
            h.finish(status=200, usage=Usage(1, 1))
        await a.flush()  # a holds none: every place goes back, on both windows
        again = _admitted(await _burst([b], 3, secret))
        assert len(again) == 3


async def test_a_router_that_stops_carrying_frees_its_places_two_minutes_later(
    streams: Bus, nats_settings: NatsSettings
) -> None:
    """A router that crashed holding places keeps them claimed for at most the window it
    claimed ahead: two minutes later another router has them all."""
    secret = credentials.new_secret("k1")
    clock = Clock()
    async with router(nats_settings, clock, _key(secret, max_parallel=2)) as (_, b):
        async with router(nats_settings, clock, _key(secret, max_parallel=2)) as (_, a):
            assert len(_admitted(await _burst([a], 2, secret))) == 2
        # a is gone (its requests never settled, its loop never ran again)
        clock.now = T0 + 60
        assert isinstance(await b.admit(authorization=f"Bearer {secret}", model="m"), Refusal)
        clock.now = T0 + 120
        assert len(_admitted(await _burst([b], 2, secret))) == 2


async def test_what_one_router_writes_of_its_own_can_lift_no_limit_on_the_others(
    streams: Bus, nats_settings: NatsSettings
) -> None:
    """A router (its identity may write only its own subjects) writes a huge negative, then
    garbage, as what it holds of a window: the other routers still admit exactly the limit
    between them (was: one counter per window, and a router adding -1000 to it lifted the
    key's limit on every router)."""
    secret = credentials.new_secret("k1")
    clock = Clock()
    window = f"{keys.LIMITS_ROOT}.key.k1.rpm.{int(T0 // 60)}"
    counters = Counters(streams)
    async with (
        router(nats_settings, clock, _key(secret, rpm=20), share=0.05) as (_, a),
        router(nats_settings, clock, _key(secret, rpm=20), share=0.05) as (_, b),
    ):
        first = _admitted(await _burst([a, b], 10, secret))
        await counters.hold(window, "rogue.1", -1000)
        await streams.nc.publish(f"{window}.rogue.2", b"-5e9")
        await streams.nc.publish(f"{window}.rogue.3", b'{"held": -7}')
        await streams.nc.flush()
        rest = _admitted(await _burst([a, b], 40, secret))
        assert len(first) + len(rest) == 20
        assert await counters.held(window) == 20


class GatedClaims:
    """The limits stream, whose claims wait until `open` is set: a claim pending for as
    long as the test wants."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.open = asyncio.Event()
        self.waiting = 0

    async def claim(self, *args):
        if not self.open.is_set():
            self.waiting += 1
            await self.open.wait()
        return await self.inner.claim(*args)

    async def hold(self, *args) -> None:
        await self.inner.hold(*args)


async def test_a_client_that_leaves_while_its_claim_is_pending_takes_no_place_with_it(
    streams: Bus, nats_settings: NatsSettings
) -> None:
    """max_parallel=2: a request that waits for a token claim (its place in flight at hand)
    is abandoned by its client; afterwards the key still gets two requests in flight."""
    release = asyncio.Event()
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    body = json.dumps({"choices": [{"message": {"content": "x"}}], "usage": usage}).encode()

    async def held_answer(writer) -> None:
        await release.wait()
        writer.write(answer(body))

    def script(seen, engine) -> Action:
        if seen.method == b"POST":
            return Action(held_answer)
        return Action(answer(b"{}"))

    secret = credentials.new_secret("k1")
    key = records.ApiKey(
        name="k1",
        secrets=[credentials.hash_secret(secret)],
        limits=records.Limits(max_parallel=2, tpm=100_000),
    )
    headers = {"authorization": f"Bearer {secret}"}
    async with RawEngine(script) as engine:
        await _place(streams, engine)
        await streams.put(keys.apikey("k1"), key)
        connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
        async with running_router(connect=connect, settings=router_settings()) as r:
            await until(lambda: _async(bool(r.table.served_names())), timeout=10)
            await until(lambda: _async(r.gateway is not None and r.gateway.enabled), timeout=10)
            async with aiohttp.ClientSession() as http:
                release.set()  # a first request: both limits claimed, a share ahead
                async with http.post(
                    f"{r.url}/v1/chat/completions", json=chat_body(max_tokens=10), headers=headers
                ) as resp:
                    assert resp.status == 200, await resp.text()
                release.clear()
                gated = GatedClaims(r.gateway.limiter.counter)
                r.gateway.limiter.counter = gated
                # a request reserving more tokens than the share held: a claim, held pending
                leaving = asyncio.ensure_future(
                    http.post(
                        f"{r.url}/v1/chat/completions",
                        json=chat_body(max_tokens=5000),
                        headers=headers,
                    )
                )
                await until(lambda: _async(gated.waiting > 0), timeout=10)
                leaving.cancel()  # the client leaves while its claim is pending
                with contextlib.suppress(asyncio.CancelledError):
                    await leaving
                await anyio.sleep(0.2)  # the router sees the connection close
                gated.open.set()  # the claim is answered after all
            async with aiohttp.ClientSession() as http:

                async def one() -> int:
                    async with http.post(
                        f"{r.url}/v1/chat/completions",
                        json=chat_body(max_tokens=10),
                        headers=headers,
                    ) as resp:
                        await resp.read()
                        return resp.status

                first = asyncio.ensure_future(one())
                second = asyncio.ensure_future(one())
                await until(
                    lambda: _async(len(engine.posts()) >= 3 or first.done() or second.done()),
                    timeout=10,
                )
                await anyio.sleep(0.3)  # both in flight at once (or one refused)
                release.set()
                assert [await first, await second] == [200, 200]


async def _async(value: object) -> object:
    return value
