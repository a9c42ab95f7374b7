"""LoRA adapters end to end with the fake engines: a real agent process finds the adapter
files, a controller places them, the agent loads them on the running vLLM (no restart, no
dropped request) or starts llama-server with them (adding one replaces the replica as a
rollout does), and a router serves each by name."""

from __future__ import annotations

import json

import aiohttp
import anyio
import pytest
from agent_helpers import stop
from autoscale_fleet import replicas_of, serve_auto
from lora_fleet import adapter, add_adapter, add_while_streaming, lora_agent, served, shards_of
from router_helpers import SERVED, StreamingLoad, chat_body, router_settings, running_router
from serving import serve, sse_events
from waiting import until

from llmgw import catalog
from llmgw.bus import keys
from llmgw.bus.client import Bus
from llmgw.sim.disk import write_safetensors_model
from llmgw.sim.fake_engine import write_fake_gguf
from llmgw.sim.tiny_lora import write_gguf_lora, write_peft_adapter

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]

# streams of 20 tokens at 40 a second: half a second in flight each
SLOW = {"FAKE_ENGINE_TOKENS": "20", "FAKE_ENGINE_TOKEN_RATE": "40"}


def vllm_base(model_dir) -> catalog.Model:
    profile = {
        "name": "cpu",
        "engine": "vllm",
        "weights": {"path": str(model_dir)},
        "gpus_per_node": 0,
        "host_ram_gb": 4,
        "adapter_slots": 4,
        "adapter_rank": 8,
        "env": SLOW,
    }
    entry = {"id": "tiny", "served_name": SERVED, "profiles": [profile]}
    return catalog.validate_models({"models": [entry]})[0]


def llama_base(gguf, **entry) -> catalog.Model:
    profile = {
        "name": "cpu",
        "engine": "llama-server",
        "weights": {"path": str(gguf)},
        "gpus_per_node": 0,
        "host_ram_gb": 1,
        "env": SLOW,
    }
    entry = {"id": "tiny", "served_name": SERVED, "profiles": [profile], **entry}
    return catalog.validate_models({"models": [entry]})[0]


def _connect(nats_settings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def stream(url: str, model: str, events: list | None = None) -> list[str]:
    """A streamed chat to `model`: its payloads, [DONE] last; `events` fills as they come."""
    events = [] if events is None else events
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{url}/v1/chat/completions", json=chat_body(model=model, stream=True)
        ) as r:
            assert r.status == 200, await r.text()
            async for data in sse_events(r):
                events.append(data)
    return events


async def test_vllm_loads_adapters_as_it_runs_and_unloads_none_with_requests_in_flight(
    bus, nats_server, nats_settings, tmp_path, controller
):
    shared, models = tmp_path / "adapters", tmp_path / "models"
    for name, rank in (("sql", 8), ("chat", 8), ("big", 16)):
        write_peft_adapter(shared / name, rank=rank)
    agent = lora_agent(nats_server.url, tmp_path / "node1", [shared, models], vllm_cpu=True)
    try:
        write_safetensors_model(models / "tiny")
        await serve(bus, vllm_base(models / "tiny"), 1)
        await add_adapter(bus, adapter("sql", shared / "sql"))
        async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
            await until(served(r, "acme/sql"), timeout=60)
            (first,) = await shards_of(bus)
            base, sql = StreamingLoad(r.url), StreamingLoad(r.url, model="acme/sql")
            stop_load = anyio.Event()
            async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
                tg.start_soon(base.run, http, 2, stop_load)
                tg.start_soon(sql.run, http, 2, stop_load)
                # added while streams run: loaded on the running engine, served by name
                await add_adapter(bus, adapter("chat", shared / "chat"))
                await until(served(r, "acme/chat"), timeout=20)
                events = await stream(r.url, "acme/chat")
                assert {json.loads(e)["model"] for e in events[:-1]} == {"acme/chat"}
                await until(lambda: _true(sql.completed >= 4 and base.completed >= 4), 20)
                stop_load.set()
            assert base.failed == [] and sql.failed == [], (base.failed, sql.failed)

            # removed while one of its streams is in flight: that stream ends whole
            events: list[str] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, r.url, "acme/sql", events)
                await until(lambda: _true(len(events) >= 2), timeout=10)
                await bus.delete(keys.adapter("sql"))
            assert events[-1] == "[DONE]"

            async def unloaded():
                (shard,) = await shards_of(bus)
                return shard.adapters == ["chat"] and shard

            shard = await until(unloaded, timeout=20)
            # loaded and unloaded on one engine: never restarted
            assert (shard.pid, shard.restarts, shard.since) == (first.pid, 0, first.since)

            # a rank over the engine's room: refused once with vLLM's words; its base serves
            await add_adapter(bus, adapter("big", shared / "big", rank=8))

            async def refused():
                (shard,) = await shards_of(bus)
                return shard.adapter_failures

            (failure,) = await until(refused, timeout=20)
            assert failure.adapter == "big"
            assert failure.reason == "LoRA rank 16 is greater than max_lora_rank 8."
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{r.url}/v1/chat/completions", json=chat_body(model="acme/big")
                ) as resp:
                    assert resp.status == 503
                    assert failure.reason in (await resp.json())["error"]["message"]
            assert (await stream(r.url, SERVED))[-1] == "[DONE]"
    finally:
        stop(agent.proc)


async def test_adding_an_adapter_to_llama_server_replaces_the_replica_dropping_no_request(
    bus, nats_server, nats_settings, tmp_path, controller
):
    shared, models = tmp_path / "adapters", tmp_path / "models"
    for name in ("a", "b"):
        write_gguf_lora(shared / f"{name}.gguf", arch="fake")
    gguf = write_fake_gguf(models / "tiny.gguf")
    agent = lora_agent(nats_server.url, tmp_path / "node1", [shared, models])
    try:
        await serve(bus, llama_base(gguf), 1)
        await add_adapter(bus, adapter("a", shared / "a.gguf", rank=4))
        async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
            await until(served(r, "acme/a"), timeout=60)
            base, a = StreamingLoad(r.url), StreamingLoad(r.url, model="acme/a")
            await add_while_streaming(bus, r, adapter("b", shared / "b.gguf", rank=4), [base, a])
            assert base.failed == [] and a.failed == [], (base.failed, a.failed)
            events = await stream(r.url, "acme/b")
            payloads = [json.loads(e) for e in events[:-1]]
            assert {p["model"] for p in payloads} == {"acme/b"}
            text = "".join(
                p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"]
            )
            assert text.startswith("lora1-tok0")  # b, the second of the files it started with
    finally:
        stop(agent.proc)


async def test_an_adapter_file_that_reaches_a_node_after_its_llama_server_started_is_served(
    bus, nats_server, nats_settings, tmp_path, controller
):
    """llama-server takes adapters only at start: a replica started before its node held an
    adapter's file (copied later, or a node placed on before its first scan) served the
    base only, for good, since its launch hash is the catalog's and did not change (seen
    in CI: a real llama-server placed before the agent's scan, the adapter never served).
    It is replaced, and the adapter is served by name."""
    shared, models = tmp_path / "adapters", tmp_path / "models"
    shared.mkdir()
    gguf = write_fake_gguf(models / "tiny.gguf")
    agent = lora_agent(nats_server.url, tmp_path / "node1", [shared, models])
    try:
        await add_adapter(bus, adapter("a", shared / "a.gguf", rank=4))
        await serve(bus, llama_base(gguf), 1)
        async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
            await until(served(r, SERVED), timeout=60)
            (first,) = {s.rid for s in await shards_of(bus)}
            assert r.table.route("acme/a") is None or not r.table.route("acme/a").backends

            write_gguf_lora(shared / "a.gguf", arch="fake")  # the file arrives
            await until(served(r, "acme/a"), timeout=60)
            events = await stream(r.url, "acme/a")
            assert {json.loads(e)["model"] for e in events[:-1]} == {"acme/a"}

            async def replaced() -> bool:  # the first drained and removed
                return first not in {s.rid for s in await shards_of(bus)}

            await until(replaced, timeout=60)
    finally:
        stop(agent.proc)


async def test_a_request_for_an_adapter_of_a_base_scaled_to_zero_is_held_and_served(
    bus, nats_server, nats_settings, tmp_path, controller
):
    shared, models = tmp_path / "adapters", tmp_path / "models"
    write_gguf_lora(shared / "a.gguf", arch="fake")
    gguf = write_fake_gguf(models / "tiny.gguf")
    agent = lora_agent(nats_server.url, tmp_path / "node1", [shared, models])
    try:
        policy = {"min_replicas": 1, "max_replicas": 1, "idle_unload_after": 600}
        base = llama_base(gguf, autoscale=policy)
        await serve_auto(bus, base)  # at zero until a request comes
        await add_adapter(bus, adapter("a", shared / "a.gguf", rank=4))
        async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
            await until(lambda: _true(r.table.route("acme/a") is not None), timeout=20)
            assert await replicas_of(bus) == []
            events = await stream(r.url, "acme/a")  # held while a replica starts with it
            assert events[-1] == "[DONE]"
            assert {json.loads(e)["model"] for e in events[:-1]} == {"acme/a"}
            assert len(await replicas_of(bus)) == 1
    finally:
        stop(agent.proc)


async def _true(value: bool) -> bool:
    return value
