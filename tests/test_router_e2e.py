"""The whole chain: a real agent process runs what the controller placed, with the engine
key from its config file; the router finds the engines in the bucket and reaches them
with the same key, while a client without it is refused by the engine itself."""

from __future__ import annotations

import json

import aiohttp
import pytest
from agent_helpers import start_fake_engine_agent, stop
from router_helpers import SERVED, chat_body, router_settings, running_router
from serving import cpu_model, serve, want
from waiting import until

from llmgw.agent.config import Engines
from llmgw.bus.client import Bus
from llmgw.router.proxy import ProxySettings
from llmgw.sim.fake_engine import write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

KEY = "engine-key-0123456789"


@pytest.fixture
def keyed_node(tmp_path, nats_server):
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    engines = Engines(
        listen_host="127.0.0.1", poll_interval=0.1, drain_timeout=30, api_key_file=str(key_file)
    )
    agent = start_fake_engine_agent(nats_server.url, tmp_path, engines, id="node1")
    yield tmp_path
    stop(agent.proc)


async def test_placed_replicas_are_served_through_the_router_with_the_engine_key(
    bus, nats_settings, keyed_node, controller
):
    gguf = str(write_fake_gguf(keyed_node / "weights" / "tiny.gguf"))
    await serve(bus, cpu_model(gguf, served_name=SERVED), 2)
    settings = router_settings(proxy=ProxySettings(engine_api_key=KEY))
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    async with (
        running_router(connect=connect, settings=settings) as r,
        aiohttp.ClientSession() as http,
    ):

        async def two_ready():
            route = r.table.route(SERVED)
            return route if route and len(route.backends) == 2 else None

        route = await until(two_ready, timeout=30)
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["choices"][0]["message"]["content"]
        engine = route.backends[0]
        direct = f"http://{engine.address}/v1/chat/completions"
        async with http.post(direct, json=chat_body()) as resp:
            assert resp.status == 401  # the engine refuses a client without the key
        async with http.post(
            direct, json=chat_body(), headers={"Authorization": f"Bearer {KEY}"}
        ) as resp:
            assert resp.status == 200
        # the key never reaches the bucket
        for key in [k async for k in _all_keys(bus)]:
            raw = await bus.get_raw(key)
            assert raw is None or KEY.encode() not in raw[0], key

        # one replica fewer: the one drained takes no new request
        await want(bus, "tiny", 1, at=2.0)

        async def one_left():
            got = r.table.route(SERVED)
            return got if got and len(got.backends) == 1 else None

        kept = (await until(one_left, timeout=30)).backends[0].id
        for i in range(5):
            async with http.post(f"{r.url}/v1/chat/completions", json=chat_body(f"q{i}")) as resp:
                assert resp.status == 200
                assert resp.headers["x-llmgw-replica"] == kept
                json.loads(await resp.read())


async def _all_keys(bus: Bus):
    for key in (await bus.list(">", lambda b: b)).keys():
        yield key
