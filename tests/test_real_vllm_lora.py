"""LoRA adapters on a real vLLM (a CPU build) through the whole fleet: a real agent process
finds PEFT adapters made at test time for the tiny model, starts vLLM with LoRA room, and
loads an adapter added while streams run on the running engine (no restart, no request
dropped), served by name through the router; a rank over the room is refused once with
vLLM's own words while the base serves on; an adapter removed is unloaded. Skips, saying how
to get one, where no vLLM is installed."""

from __future__ import annotations

import json
import time

import aiohttp
import anyio
import pytest
from agent_helpers import stop
from lora_fleet import adapter, add_adapter, lora_agent, served, shards_of
from real_vllm import SERVED, cpu_vllm_model, leftover_vllm_processes, vllm_binary
from router_helpers import StreamingLoad, router_settings, running_router
from serving import serve, sse_events
from waiting import until

from llmgw.agent.engines.pidfile import reap_leftover_engines
from llmgw.bus import keys
from llmgw.bus.client import Bus
from llmgw.sim.tiny_lora import write_peft_adapter

pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

READY_WITHIN = 300.0  # a vLLM start on 2 busy cores: 30-80 s seen


@pytest.fixture
def vllm_lora_node(tmp_path, nats_server, vllm_tiny_model):
    binary = vllm_binary()  # skips, saying how to get one, where there is none
    began = time.time()
    shared = tmp_path / "adapters"
    for name, rank in (("sql", 8), ("chat", 8), ("big", 16)):
        # hidden 128 and 2 layers: the tiny model's (llmgw/sim/tiny_hf.py)
        write_peft_adapter(shared / name, rank=rank, base=str(vllm_tiny_model))
    bin_dir = tmp_path / "node1" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "vllm").symlink_to(binary)  # found on PATH, as on a node
    agent = lora_agent(
        nats_server.url,
        tmp_path / "node1",
        [shared, vllm_tiny_model.parent],
        bin_dir=bin_dir,
    )
    try:
        yield shared, agent
    finally:
        stop(agent.proc, timeout=30)
        reap_leftover_engines(agent.dirs["state"], grace=5)
        left = leftover_vllm_processes(began, under=tmp_path)
        assert left == [], f"vLLM processes left behind: {left}"


def _connect(nats_settings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def chat(url: str, model: str) -> tuple[int, list[dict]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=body) as r,
    ):
        if r.status != 200:
            return r.status, [{"error": await r.text()}]
        return 200, [json.loads(d) async for d in sse_events(r) if d != "[DONE]"]


async def test_an_adapter_added_while_streams_run_is_loaded_on_the_running_vllm(
    bus, nats_settings, controller, vllm_tiny_model, vllm_lora_node
):
    shared, _ = vllm_lora_node
    model = cpu_vllm_model(vllm_tiny_model, adapter_slots=4, adapter_rank=8)
    await serve(bus, model, 1)
    await add_adapter(bus, adapter("sql", shared / "sql"))
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(served(r, "acme/sql"), timeout=READY_WITHIN)
        (first,) = await shards_of(bus)
        status, events = await chat(r.url, "acme/sql")
        assert status == 200 and {e["model"] for e in events} == {"acme/sql"}, events

        load = StreamingLoad(r.url, model=SERVED, max_tokens=32)
        stop_load = anyio.Event()
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            tg.start_soon(load.run, http, 2, stop_load)
            await until(lambda: _true(load.completed >= 2), timeout=60)
            added = time.monotonic()
            await add_adapter(bus, adapter("chat", shared / "chat"))
            while (await chat(r.url, "acme/chat"))[0] != 200:
                await anyio.sleep(0.05)
            took = time.monotonic() - added
            done = load.completed
            await until(lambda: _true(load.completed >= done + 2), timeout=60)
            stop_load.set()
        print(f"an adapter added while streams ran was served by name {took:.2f} s later")
        assert load.failed == [], load.failed[:3]
        (shard,) = await shards_of(bus)
        assert (shard.pid, shard.restarts, shard.since) == (first.pid, 0, first.since)
        assert sorted(shard.adapters) == ["chat", "sql"]

        # a rank over the engine's room: refused once, in vLLM's words; the base serves on
        await add_adapter(bus, adapter("big", shared / "big", rank=8))

        async def refused():
            (s,) = await shards_of(bus)
            return s.adapter_failures

        (failure,) = await until(refused, timeout=60)
        print(f"vLLM refused the rank-16 adapter: {failure.reason}")
        assert "LoRA rank 16 is greater than max_lora_rank 8" in failure.reason
        assert (await chat(r.url, SERVED))[0] == 200

        # removed: unloaded from the running engine
        await bus.delete(keys.adapter("sql"))

        async def unloaded():
            (s,) = await shards_of(bus)
            return s.adapters == ["chat"]

        await until(unloaded, timeout=60)  # routers send it there no more, at once

        async def listed():
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{first.endpoint}/v1/models") as resp:
                    return {m["id"] for m in (await resp.json())["data"]} == {SERVED, "acme/chat"}

        await until(listed, timeout=30)  # and once it runs nothing for it, vLLM unloads it


async def _true(value: bool) -> bool:
    return value
