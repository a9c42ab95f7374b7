"""LoRA adapters on a REAL llama-server through the whole fleet: GGUF LoRA files made at test
time for the tiny model (llmgw/sim/tiny_lora.py), found by a real agent process, given to
llama-server at start and applied per request by the router, each served by its own name;
the base answers as a llama-server without adapters does; adding an adapter replaces the
replica as a rollout does while streams run, dropping none. Skips, saying how to build one,
where no llama-server exists."""

from __future__ import annotations

import http.client
import json

import aiohttp
import pytest
from agent_helpers import stop
from lora_fleet import adapter, add_adapter, add_while_streaming, lora_agent, served
from real_llama import llama_server_binary, serving_tiny_model, tiny_gguf
from router_helpers import SERVED, StreamingLoad, chat_body, router_settings, running_router
from serving import serve
from test_lora_e2e import llama_base
from waiting import until

from llmgw.agent.engines.pidfile import reap_leftover_engines
from llmgw.bus.client import Bus
from llmgw.sim.tiny_lora import write_gguf_lora

pytestmark = [pytest.mark.anyio, pytest.mark.llama, pytest.mark.slow, pytest.mark.timeout(300)]

# greedy and short: the same prompt gives the same answer on every engine of the same weights
GREEDY = {"max_tokens": 8, "temperature": 0, "seed": 1, "cache_prompt": False}


@pytest.fixture
def llama_lora_node(tmp_path, nats_server):
    binary = llama_server_binary()  # skips, saying how to build one, where there is none
    models, shared = tmp_path / "models", tmp_path / "adapters"
    models.mkdir()
    gguf = tiny_gguf(models)
    for seed, name in enumerate(("a", "b"), start=1):
        # nonzero weights of the tiny model's shapes: applied, they change its answer
        write_gguf_lora(shared / f"{name}.gguf", arch="llama", seed=seed)
    bin_dir = tmp_path / "node1" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "llama-server").symlink_to(binary)  # found on PATH, as on a node
    agent = lora_agent(nats_server.url, tmp_path / "node1", [shared, models], bin_dir=bin_dir)
    try:
        yield gguf, shared
    finally:
        stop(agent.proc, timeout=30)
        reap_leftover_engines(agent.dirs["state"], grace=5)


def _connect(nats_settings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def answer(url: str, model: str) -> tuple[str, str]:
    """A greedy chat's (model, content) as the client sees them."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/chat/completions", json=chat_body(model=model, **GREEDY)) as r,
    ):
        assert r.status == 200, await r.text()
        body = await r.json()
    return body["model"], body["choices"][0]["message"]["content"]


def plain_answer(gguf, tmp_path) -> str:
    """What the tiny model answers on a llama-server started with no adapters."""
    with serving_tiny_model(gguf, tmp_path) as server:
        body = json.dumps(chat_body(model="tiny", **GREEDY))
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        return json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]


async def test_real_llama_server_serves_gguf_adapters_by_name_and_adding_one_drops_no_request(
    bus, nats_settings, controller, llama_lora_node, tmp_path
):
    gguf, shared = llama_lora_node
    plain = plain_answer(gguf, tmp_path)
    await add_adapter(bus, adapter("a", shared / "a.gguf", rank=4))
    await serve(bus, llama_base(gguf), 1)
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(served(r, "acme/a"), timeout=60)
        # the base answers as it does with no adapter; the adapter, by its name, otherwise
        assert await answer(r.url, SERVED) == (SERVED, plain)
        name, with_a = await answer(r.url, "acme/a")
        assert name == "acme/a" and with_a != plain

        base, a = StreamingLoad(r.url, max_tokens=16), StreamingLoad(r.url, "acme/a", max_tokens=16)
        await add_while_streaming(bus, r, adapter("b", shared / "b.gguf", rank=4), [base, a])
        assert base.failed == [] and a.failed == [], (base.failed, a.failed)
        assert base.completed > 0 and a.completed > 0

        # the new replica: each adapter by its own name and alone, the base as it was
        assert await answer(r.url, SERVED) == (SERVED, plain)
        assert await answer(r.url, "acme/a") == ("acme/a", with_a)
        name, with_b = await answer(r.url, "acme/b")
        assert name == "acme/b" and with_b not in (plain, with_a)
