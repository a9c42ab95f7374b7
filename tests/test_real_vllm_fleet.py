"""A real vLLM (a CPU build) through the whole fleet: the controller places it, a real agent
process launches it on this machine's CPU, it is ready when vLLM says so, streams through
the router with usage, its own /metrics reach the load records, the autoscaler's inputs,
`llmgw status` and the page; an agent restart adopts it, and `--replicas 0` stops every
process it started. Skips, saying how to get one, where no vLLM is installed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import msgspec
import psutil
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from real_vllm import (
    SERVED,
    cpu_vllm_model,
    leftover_vllm_processes,
    process_tree,
    tiny_hf_model,
    vllm_binary,
    wait_gone,
)
from router_helpers import router_settings, running_router
from serving import serve, sse_events, want
from waiting import until

from llmgw.agent.config import Engines
from llmgw.agent.engines.pidfile import reap_leftover_engines
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.autoscale import engine_saturation
from llmgw.router.proxy import ProxySettings

# a vLLM start takes 30-80 s here; a test of restarts makes three
pytestmark = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "engine-key-0123456789"
NODE = "cpu1"
READY_WITHIN = 300.0  # a vLLM start on 2 busy cores: 30-80 s seen


@pytest.fixture
def vllm_node(tmp_path, nats_server):
    """A real agent process with the real vLLM on its PATH and the engine key in its config;
    whatever vLLM processes the test started are gone when it ends."""
    binary = vllm_binary()  # skips, saying how to get one, where there is none
    began = time.time()
    dirs = host_dirs(tmp_path)
    (dirs["bin"] / "vllm").symlink_to(binary)  # found on PATH, as on a node
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg = agent_config(nats_server.url, dirs, id=NODE)
    engines = Engines(
        listen_host="127.0.0.1",
        poll_interval=0.2,
        backoff_base=3,
        stop_grace=10,
        drain_timeout=20,
        api_key_file=str(key_file),
        on_agent_exit="keep",  # an agent restart leaves its engine for the next to adopt
    )
    cfg = msgspec.structs.replace(cfg, engines=engines)
    node = {"tmp": tmp_path, "log": tmp_path / "agent.log", "cfg": cfg}
    node["path"] = [dirs["bin"], "/usr/bin", "/bin"]
    node["proc"] = start_agent(cfg, tmp_path / "agent.toml", node["path"], node["log"])
    try:
        yield node
    finally:
        stop(node["proc"], timeout=30)
        reap_leftover_engines(dirs["state"], grace=5)  # this agent keeps its engines on exit
        left = leftover_vllm_processes(began)
        assert left == [], f"vLLM processes left behind: {left}"


async def shard_in(bus: Bus, phase: str, *, not_pid: int | None = None):
    got = await bus.list(keys.pattern(keys.SHARDS, NODE), decoder(records.Shard))
    return next(
        (
            e.value
            for e in got.values()
            if e.value.phase == phase and (not_pid is None or e.value.pid != not_pid)
        ),
        None,
    )


def tree_names(pid: int) -> dict[int, str]:
    names = {}
    for p in process_tree(pid):
        try:
            names[p.pid] = p.name()
        except psutil.NoSuchProcess:
            continue
    return names


async def stream_through(url: str, content: str) -> list[dict | str]:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return [d if d == "[DONE]" else json.loads(d) async for d in sse_events(r)]


async def test_a_real_vllm_is_placed_served_measured_adopted_and_stopped_whole(
    bus, nats_settings, nats_server, vllm_node, controller, vllm_tiny_model
):
    await serve(bus, cpu_vllm_model(vllm_tiny_model), 1)
    shard = await until(lambda: shard_in(bus, "ready"), timeout=READY_WITHIN)
    engine = psutil.Process(shard.pid)

    # launched on the CPU as the profile says: its platform, its own core, its KV budget
    env, argv = engine.environ(), engine.cmdline()
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    kv = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert 0.9e9 < kv < 1e9  # 4 GB less the weights and 3 GB of processes
    tree = tree_names(shard.pid)
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(tree.values()), tree

    settings = router_settings(proxy=ProxySettings(engine_api_key=KEY))
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    async with running_router(connect=connect, settings=settings) as r:

        async def routed():
            return r.table.route(SERVED)

        await until(routed, timeout=30)
        # a stream through the router, the client holding no key: the router holds it
        events = await stream_through(r.url, "hello")
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://{shard.endpoint}/v1/models") as direct,
        ):
            assert direct.status == 401  # the engine itself refuses a client without the key

        # a prompt of a few hundred tokens twice: vLLM's prefix cache (blocks of 128 tokens
        # on a CPU) holds the second one's start
        long = " ".join(["the quick brown fox jumps over the lazy dog"] * 25)
        await stream_through(r.url, long)
        await stream_through(r.url, long)
        # a lease carries the engine loads sampled up to two heartbeats (0.2 s here) before
        # it: one written well after the last stream ended says what the idle engine said,
        # not what it said mid-request (running 1, seen once in CI)
        idle_since = time.time() + 3.0

        async def measured():
            lease = await bus.get(keys.lease(NODE), decoder(records.Lease))
            if lease is None or lease.value.time < idle_since:
                return None
            loads = [e for e in lease.value.engines if e.rid == shard.rid]
            return loads[0] if loads and (loads[0].prefix_hits or 0) > 0 else None

        load = await until(measured, timeout=30)
        assert (load.model, load.running, load.waiting) == ("tiny", 0, 0)
        assert load.kv_cache is not None and 0 < load.prefix_hits <= 1

        # the autoscaler's view of the engines is the same numbers
        lease = await bus.get(keys.lease(NODE), decoder(records.Lease))
        health = await bus.get(keys.health(NODE), decoder(records.Health))
        replica = await bus.get(keys.replica("tiny", shard.rid), decoder(records.Replica))
        now = await bus.get(keys.shard(NODE, shard.rid), decoder(records.Shard))
        seen = engine_saturation(
            {NODE: lease.value},
            {NODE: health.value},
            {shard.rid: replica.value},
            {(NODE, shard.rid): now.value},
        )
        assert (seen["tiny"].engines, seen["tiny"].waiting) == (1, 0)

        # `llmgw status` and the page say what the engine said
        status = subprocess.run(
            [sys.executable, "-m", "llmgw.cli", "status", "--nats", nats_server.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert "engine: 0 running, 0 waiting, KV cache " in status.stdout, status.stdout
        assert "prefix cache hits " in status.stdout
        async with aiohttp.ClientSession() as http, http.get(f"{r.url}/fleet/state") as page:
            document = await page.json()
        [model] = [m for m in document["models"] if m["id"] == "tiny"]
        assert model["replicas"][0]["load"]["prefix_hits"] > 0

    # an agent restart adopts the engine: same pid, no new load
    pids = list(tree)
    node = vllm_node
    stop(node["proc"], timeout=30)
    assert engine.is_running()
    node["proc"] = start_agent(node["cfg"], node["tmp"] / "agent.toml", node["path"], node["log"])

    async def adopted():
        text = node["log"].read_text()
        return f"adopted the engine an earlier agent left (pid {shard.pid})" in text

    await until(adopted, timeout=60)
    again = await until(lambda: shard_in(bus, "ready"), timeout=60)
    assert again.pid == shard.pid and engine.is_running()

    # --replicas 0: drained, then every process vLLM started is gone
    await want(bus, "tiny", 0, at=2.0)
    await until(lambda: _no_shard(bus), timeout=60)
    assert wait_gone(pids, within=30) == [], tree_names(shard.pid)


async def _no_shard(bus: Bus) -> bool:
    return not await bus.list(keys.pattern(keys.SHARDS, NODE), lambda b: b)


async def test_a_model_whose_head_size_the_cpu_kernel_refuses_is_refused_before_launch(
    bus, vllm_node, controller, tmp_path
):
    model = tiny_hf_model(tmp_path, head_dim=16)
    await serve(bus, cpu_vllm_model(model), 1)
    shard = await until(lambda: shard_in(bus, "failed"), timeout=60)
    assert shard.reason.startswith(
        f"refused before launch: model {model} has attention heads of size 16; vLLM's CPU "
        "attention kernel takes 32, 64"
    ), shard.reason
    assert shard.gave_up and shard.pid is None


def _signal(pid: int, sig: int) -> None:
    os.kill(pid, sig)


async def test_an_engine_core_or_api_server_killed_is_reported_with_its_output_and_restarted(
    bus, vllm_node, controller, vllm_tiny_model
):
    await serve(bus, cpu_vllm_model(vllm_tiny_model), 1)
    first = await until(lambda: shard_in(bus, "ready"), timeout=READY_WITHIN)
    core = next(pid for pid, name in tree_names(first.pid).items() if name == "VLLM::EngineCore")

    # the EngineCore dies: vLLM's API server says so and exits; restarted after the backoff
    gone = list(tree_names(first.pid))
    _signal(core, signal.SIGKILL)
    failed = await until(lambda: shard_in(bus, "failed"), timeout=60)
    # its cause from vLLM's own output, then the restart policy's decision
    assert re.search(r"while serving \(EngineDeadError: .+\); restart 1 in 3 s$", failed.reason), (
        failed.reason
    )
    tail = "\n".join(failed.output_tail)
    assert "EngineDeadError" in tail or "engine core exited unexpectedly" in tail, tail
    second = await until(lambda: shard_in(bus, "ready", not_pid=first.pid), timeout=READY_WITHIN)
    assert second.restarts == 1
    assert wait_gone(gone, within=10) == []

    # the API server dies: what it left (EngineCore, its worker) is stopped, then restarted
    left = list(tree_names(second.pid))
    _signal(second.pid, signal.SIGKILL)
    failed = await until(lambda: shard_in(bus, "failed"), timeout=60)
    assert failed.reason.startswith("killed by SIGKILL"), failed.reason
    assert wait_gone(left, within=30) == []
    third = await until(lambda: shard_in(bus, "ready", not_pid=second.pid), timeout=READY_WITHIN)
    assert third.restarts == 2

    last = list(tree_names(third.pid))
    await want(bus, "tiny", 0, at=2.0)
    await until(lambda: _no_shard(bus), timeout=60)
    assert wait_gone(last, within=30) == []
