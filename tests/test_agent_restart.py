"""Restarting or killing the agent does not restart its engines: under streamed load through
the router, an agent restarted (what `systemctl restart` does, and every upgrade) or
SIGKILLed and started again loses no request, its engines keep their PIDs, and their shards
are ready again under the new agent; an engine whose assignment changed meanwhile is
stopped by the new agent and replaced. Real nats-server, agent, engine and router."""

from __future__ import annotations

import signal

import aiohttp
import anyio
import msgspec
import psutil
import pytest
from agent_helpers import start_agent, start_fake_engine_agent, stop
from router_helpers import SERVED, StreamingLoad, running_router
from serving import cpu_model, serve
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines
from llmgw.agent.engines.pidfile import reap_leftover_engines
from llmgw.bus import records
from llmgw.bus.client import Bus, decoder
from llmgw.sim.fake_engine import write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# 20 tokens at 40 a second: a stream lasts half a second
STREAM_ENV = {"FAKE_ENGINE_TOKENS": "20", "FAKE_ENGINE_TOKEN_RATE": "40"}


@pytest.fixture
def node(tmp_path, nats_server):
    engines = Engines(
        listen_host="127.0.0.1",
        poll_interval=0.1,
        stop_grace=3,
        drain_timeout=30,
        # what a systemd restart decides (llmgw/agent/lifetime.py); no systemd here
        on_agent_exit="keep",
    )
    agent = start_fake_engine_agent(nats_server.url, tmp_path, engines, id="node1")
    dirs = agent.dirs
    state = {"cfg": agent.cfg, "path": agent.path, "tmp": tmp_path, "log": agent.log}
    state["proc"] = agent.proc
    yield state
    stop(state["proc"])
    # the agent leaves its engines by design (on_agent_exit = keep): the test must not
    reap_leftover_engines(dirs["state"], grace=2)
    for p in state.get("engines", []):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


async def _replaced(bus: Bus, node: dict, first: records.Shard) -> records.Shard:
    """The ready shard that replaced `first` (another engine), that engine noted for the
    node fixture to kill."""

    async def replaced():
        shards = await _all_ready(bus, 1)
        return shards[0] if shards and shards[0].pid != first.pid else None

    second = await until(replaced, timeout=30)
    node["engines"].append(psutil.Process(second.pid))
    return second


def _model(tmp, **profile) -> catalog.Model:
    gguf = str(write_fake_gguf(tmp / "weights" / "tiny.gguf"))
    return cpu_model(gguf, served_name=SERVED, env=STREAM_ENV, host_ram_gb=1, **profile)


async def _shards(bus: Bus) -> list[records.Shard]:
    got = await bus.list("shards.node1.*", decoder(records.Shard))
    return sorted((e.value for e in got.values()), key=lambda s: s.rid)


async def _all_ready(bus: Bus, n: int) -> list[records.Shard] | None:
    shards = await _shards(bus)
    return shards if len(shards) == n and all(s.phase == "ready" for s in shards) else None


@pytest.mark.parametrize("how", ["restarted", "killed"])
async def test_an_agent_restarted_or_killed_under_load_keeps_its_engines_serving(
    bus, nats_settings, node, controller, how
):
    await serve(bus, _model(node["tmp"]), 2)
    before = await until(lambda: _all_ready(bus, 2), timeout=30)
    engines = [psutil.Process(s.pid) for s in before]
    node["engines"] = engines
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    async with running_router(connect=connect) as r, aiohttp.ClientSession() as http:

        async def both_routed():
            route = r.table.route(SERVED)
            return route is not None and len(route.backends) == 2

        await until(both_routed, timeout=30)
        load, stop_load = StreamingLoad(r.url), anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(load.run, http, 6, stop_load)
            await anyio.sleep(1.5)
            proc = node["proc"]
            proc.send_signal(signal.SIGTERM if how == "restarted" else signal.SIGKILL)
            assert await anyio.to_thread.run_sync(proc.wait, 10) in (0, -signal.SIGKILL)
            assert all(p.is_running() for p in engines)  # serving with no agent at all
            node["proc"] = start_agent(
                node["cfg"], node["tmp"] / "agent.toml", node["path"], node["log"]
            )

            async def adopted_both():
                text = node["log"].read_text()
                return text.count("adopted the engine an earlier agent left") >= 2

            await until(adopted_both, timeout=30)
            await anyio.sleep(1.5)  # load goes on under the new agent
            stop_load.set()
    after = await until(lambda: _all_ready(bus, 2), timeout=10)
    assert load.failed == [] and load.completed >= 20
    assert [s.pid for s in after] == [s.pid for s in before]  # the same engines
    assert all(p.is_running() for p in engines)


async def _away(node) -> None:
    """The agent goes the way `systemctl restart` takes it down: its engines serve on."""
    node["proc"].send_signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(node["proc"].wait, 10) == 0


def _back(node) -> None:
    node["proc"] = start_agent(node["cfg"], node["tmp"] / "agent.toml", node["path"], node["log"])


async def test_a_catalog_edit_made_while_the_agent_was_away_is_rolled_out_with_no_gap(
    bus, node, controller
):
    """The profile changes while no agent runs (a new generation, another command line):
    the new agent adopts the engine still serving, as a running agent keeps it, and the
    controller's rollout replaces it; at no moment is there no ready replica."""
    await serve(bus, _model(node["tmp"]), 1)
    (first,) = await until(lambda: _all_ready(bus, 1), timeout=30)
    old = psutil.Process(first.pid)
    node["engines"] = [old]
    await _away(node)
    assert old.is_running()
    await serve(bus, _model(node["tmp"], extra_args=["--threads", "2"]), 1, at=2.0)

    async def reassigned():
        got = await bus.list("assign.node1.*", decoder(records.Assignment))
        return any(e.value.generation > 1 for e in got.values())

    await until(reassigned, timeout=20)
    _back(node)
    gaps: list[list[str]] = []

    async def rolled_out():
        shards = await _shards(bus)
        ready = [s for s in shards if s.phase == "ready"]
        if not ready:
            gaps.append([f"{s.rid} {s.phase}" for s in shards])
        if len(shards) == 1 and ready and ready[0].pid != first.pid:
            return ready[0]
        return None

    second = await until(rolled_out, timeout=40)
    node["engines"].append(psutil.Process(second.pid))
    log_text = node["log"].read_text()
    assert f"adopted the engine an earlier agent left (pid {first.pid})" in log_text
    assert gaps == []  # one ready replica at every look
    assert _gone(old)  # drained by the rollout, not killed at adoption


async def test_an_engine_its_controller_moved_while_the_agent_was_away_is_replaced(
    bus, node, controller
):
    """The controller gives the replica another port while no agent runs (another program
    was reported on it): the engine left on the old port no longer matches its assignment;
    the new agent stops it and starts the replica where it now belongs."""
    await serve(bus, _model(node["tmp"]), 1)
    (first,) = await until(lambda: _all_ready(bus, 1), timeout=30)
    old = psutil.Process(first.pid)
    node["engines"] = [old]
    await _away(node)
    # what an agent reports when its port was taken before launch (records.PORT_IN_USE)
    refused = msgspec.structs.replace(first, phase="failed", refused=records.PORT_IN_USE)
    await bus.put(f"shards.node1.{first.rid}", refused)

    async def moved():
        got = await bus.get(f"assign.node1.{first.rid}", decoder(records.Assignment))
        return got.value if got and got.value.port != first.port else None

    assignment = await until(moved, timeout=20)
    _back(node)

    second = await _replaced(bus, node, first)
    assert second.port == assignment.port and _gone(old)
    assert (
        f"its assignment moved it (port {first.port} -> {assignment.port})"
        in node["log"].read_text()
    )


async def test_sigint_and_a_plain_sigterm_still_stop_the_engines(bus, node, controller):
    """Ctrl-C is a person stopping everything; a SIGTERM that is not a systemd restart
    (the default policy, and no systemd here) stops the engines with the agent, as before."""
    node["proc"].send_signal(signal.SIGTERM)  # the fixture's agent keeps engines: not this one
    await anyio.to_thread.run_sync(node["proc"].wait, 10)
    default = msgspec.structs.replace(
        node["cfg"],
        engines=msgspec.structs.replace(node["cfg"].engines, on_agent_exit="keep-on-restart"),
    )
    await serve(bus, _model(node["tmp"]), 1)
    previous = None
    for sig in (signal.SIGINT, signal.SIGTERM):
        node["proc"] = start_agent(default, node["tmp"] / "agent.toml", node["path"], node["log"])

        async def a_new_engine_ready(previous=previous):
            shards = await _all_ready(bus, 1)
            return shards[0] if shards and shards[0].pid != previous else None

        shard = await until(a_new_engine_ready, timeout=30)
        previous = shard.pid
        engine = psutil.Process(shard.pid)
        node.setdefault("engines", []).append(engine)
        node["proc"].send_signal(sig)
        assert await anyio.to_thread.run_sync(node["proc"].wait, 10) == 0
        with anyio.fail_after(10):
            while not _gone(engine):
                await anyio.sleep(0.05)
        assert "the engines stop with the agent" in node["log"].read_text()


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_workers_left_when_an_engines_first_process_died_are_stopped_by_the_next_agent(
    bus, node, controller
):
    """The agent is restarted, and while none runs its engine's first process dies; the
    engine's worker lives on, an orphan holding its memory. The next agent proves the worker
    is the engine's by the marker it inherited, stops it, and launches the replica anew."""
    record = node["tmp"] / "engine.json"
    gguf = str(write_fake_gguf(node["tmp"] / "weights" / "tiny.gguf"))
    env = {**STREAM_ENV, "FAKE_ENGINE_WORKERS": "1", "FAKE_ENGINE_RECORD": str(record)}
    await serve(bus, cpu_model(gguf, served_name=SERVED, env=env, host_ram_gb=1), 1)
    (first,) = await until(lambda: _all_ready(bus, 1), timeout=30)
    leader = psutil.Process(first.pid)
    (worker_pid,) = msgspec.json.decode(record.read_bytes())["workers"]
    worker = psutil.Process(worker_pid)
    node["engines"] = [leader, worker]
    await _away(node)
    leader.kill()
    with anyio.fail_after(10):
        while not _gone(leader):
            await anyio.sleep(0.05)
    assert not _gone(worker)  # orphaned
    _back(node)

    await _replaced(bus, node, first)
    with anyio.fail_after(10):
        while not _gone(worker):
            await anyio.sleep(0.05)
