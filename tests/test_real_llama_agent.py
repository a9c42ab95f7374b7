"""The agent runs a REAL llama-server through its adapter: placed by the controller,
validated, launched, loaded, streaming; refusals before launch; a load failure's real
output in the failed shard. Skips (with how to build one) where no llama-server exists."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from real_llama import llama_server_binary, tiny_gguf
from serving import cpu_model, serve
from waiting import until

from llmgw.agent.config import Engines
from llmgw.bus import records
from llmgw.bus.client import Bus, decoder

pytestmark = [pytest.mark.anyio, pytest.mark.llama]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def node(tmp_path, nats_server):
    binary = llama_server_binary()  # skips, saying how to build one, where there is none
    dirs = host_dirs(tmp_path)
    (dirs["bin"] / "llama-server").symlink_to(binary)  # found on PATH, as on a node
    cfg = agent_config(nats_server.url, dirs, id="cpu1")
    cfg = msgspec.structs.replace(
        cfg,
        engines=Engines(listen_host="127.0.0.1", poll_interval=0.1, backoff_base=5, stop_grace=3),
    )
    path = [dirs["bin"], "/usr/bin", "/bin"]
    state = {"tmp": tmp_path, "log": tmp_path / "agent.log", "cfg": cfg, "path": path}
    state["proc"] = start_agent(cfg, tmp_path / "agent.toml", path, state["log"])
    yield state
    stop(state["proc"])


async def _place(bus: Bus, gguf: str) -> None:
    await serve(bus, cpu_model(gguf, served_name="tiny-random", context=4096, parallel=1), 1)


async def _shard(bus: Bus, phase: str):
    got = await bus.list("shards.cpu1.*", decoder(records.Shard))
    return next((e.value for e in got.values() if e.value.phase == phase), None)


async def test_real_llama_server_is_launched_loads_and_streams_a_chat(
    bus, node, controller, tiny_model
):
    await _place(bus, str(tiny_model))
    shard = await until(lambda: _shard(bus, "ready"))
    body = {
        "model": "tiny-random",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hello"}],
    }
    chunks = []
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{shard.endpoint}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: "):
                chunks.append(line[6:].strip().decode())
    assert chunks[-1] == "[DONE]"
    assert any(
        json.loads(c)["choices"] and json.loads(c)["choices"][0]["delta"].get("content")
        for c in chunks[:-1]
    )


async def test_missing_model_file_is_refused_before_launch(bus, node, controller):
    await _place(bus, str(node["tmp"] / "not-downloaded.gguf"))
    shard = await until(lambda: _shard(bus, "failed"))
    assert (
        shard.reason.startswith("refused before launch: weights file")
        and "does not exist" in shard.reason
    )
    assert shard.pid is None and shard.output_tail == []


async def test_truncated_gguf_is_refused_before_launch_not_after_loading(
    bus, node, controller, tiny_model
):
    cut = node["tmp"] / "half-downloaded.gguf"
    cut.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    await _place(bus, str(cut))
    shard = await until(lambda: _shard(bus, "failed"))
    assert "is not complete" in shard.reason and shard.pid is None


async def test_a_gguf_the_engine_refuses_leaves_its_output_tail_in_the_failed_shard(
    bus, node, controller, tiny_model
):
    # complete and well-formed, so it passes validation, but of an architecture llama.cpp
    # does not know: only the engine can refuse it, and its words must reach the operator
    data = bytearray(tiny_model.read_bytes())
    key = b"general.architecture"
    at = data.index(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    assert data[at : at + 5] == b"llama"
    data[at : at + 5] = b"llamz"
    bogus = node["tmp"] / "bogus-arch.gguf"
    bogus.write_bytes(bytes(data))
    await _place(bus, str(bogus))
    shard = await until(lambda: _shard(bus, "failed"))
    tail = "\n".join(shard.output_tail)
    assert "unknown model architecture: 'llamz'" in tail, tail  # llama.cpp's own words
    assert "exited with code" in shard.reason and "while loading" in shard.reason
    assert len(tail) <= 8192 and len(shard.output_tail) <= 64


@pytest.mark.parametrize("how", ["restarted", "killed"])
async def test_a_restarted_or_killed_agent_leaves_the_real_llama_server_serving_under_load(
    bus, nats_settings, node, controller, tiny_model, how
):
    """llama-server outlives an agent restarted the way systemd restarts it (SIGTERM) or
    killed hard (SIGKILL), keeps its pid and serves streamed requests through the router the
    whole time; the next agent adopts it without loading the model again."""
    import signal

    import anyio
    import psutil
    from router_helpers import StreamingLoad, running_router

    from llmgw.agent.engines.pidfile import reap_leftover_engines

    await _place(bus, str(tiny_model))
    first = await until(lambda: _shard(bus, "ready"))
    keep = msgspec.structs.replace(
        node["cfg"], engines=msgspec.structs.replace(node["cfg"].engines, on_agent_exit="keep")
    )
    stop(node["proc"])  # the fixture's agent stops its engine: start one that keeps it
    node["proc"] = start_agent(keep, node["tmp"] / "agent.toml", node["path"], node["log"])
    second = await until(lambda: _new_ready(bus, first.pid), timeout=60)
    engine = psutil.Process(second.pid)
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    try:
        async with running_router(connect=connect) as r, aiohttp.ClientSession() as http:

            async def routed():
                return r.table.route("tiny-random") is not None

            await until(routed, timeout=30)
            load = StreamingLoad(r.url, "tiny-random", max_tokens=8)
            stop_load = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(load.run, http, 3, stop_load)
                await anyio.sleep(1.0)
                node["proc"].send_signal(signal.SIGTERM if how == "restarted" else signal.SIGKILL)
                code = await anyio.to_thread.run_sync(node["proc"].wait, 10)
                assert code in (0, -signal.SIGKILL)
                assert engine.is_running()  # serving with no agent at all
                await anyio.sleep(1.0)
                node["proc"] = start_agent(
                    keep, node["tmp"] / "agent.toml", node["path"], node["log"]
                )

                async def adopted():
                    text = node["log"].read_text()
                    return f"adopted the engine an earlier agent left (pid {second.pid})" in text

                await until(adopted, timeout=30)
                await anyio.sleep(1.0)  # load goes on under the new agent
                stop_load.set()
        again = await until(lambda: _shard(bus, "ready"))
        assert load.failed == [] and load.completed >= 10
        assert again.pid == second.pid and engine.is_running()
    finally:
        node["proc"].send_signal(signal.SIGTERM)
        node["proc"].wait(10)
        # this agent leaves its engine by design (on_agent_exit = keep): the test must not
        reap_leftover_engines(node["tmp"] / "state", grace=2)


async def _new_ready(bus: Bus, old_pid: int | None):
    s = await _shard(bus, "ready")
    return s if s is not None and s.pid != old_pid else None
