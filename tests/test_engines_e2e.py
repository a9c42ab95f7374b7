"""End to end: controller places, the agent validates and launches the engine through the
adapter's real argv (the fake engine on PATH), reports every transition, and the engine
serves. Real nats-server, real agent process, real engine processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket

import anyio
import msgspec
import psutil
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from controller_helpers import quick_controller
from record_helpers import shard
from serving import cpu_model, serve, stream_chat, want
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines, Intervals
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.loop import Controller
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def _quick_engines(**extra) -> Engines:
    """Engines on loopback, restarted and polled quickly."""
    return Engines(
        listen_host="127.0.0.1",
        backoff_base=0.2,
        backoff_cap=5,
        poll_interval=0.1,
        stop_grace=3,
        **extra,
    )


@pytest.fixture
def node(tmp_path, nats_server):
    dirs = host_dirs(tmp_path)
    install_fake_engines(dirs["bin"])
    cfg = agent_config(nats_server.url, dirs, id="node1")
    cfg = msgspec.structs.replace(cfg, engines=_quick_engines(drain_timeout=30))
    path = [dirs["bin"], "/usr/bin", "/bin"]
    proc = start_agent(cfg, tmp_path / "agent.toml", path, tmp_path / "agent.log")
    state = {
        "dirs": dirs,
        "proc": proc,
        "log": tmp_path / "agent.log",
        "tmp": tmp_path,
        "cfg": cfg,
        "path": path,
    }
    yield state
    stop(state["proc"])


def _catalog(tmp_path, *, path: str | None = None, env: dict | None = None) -> catalog.Model:
    gguf = path or str(write_fake_gguf(tmp_path / "weights" / "tiny.gguf"))
    return cpu_model(gguf, env=env, host_ram_gb=1)


async def _shard(bus: Bus, phase: str | None = None):
    got = await bus.list("shards.node1.*", decoder(records.Shard))
    shards = [e.value for e in got.values()]
    if phase is None:
        return shards
    return next((s for s in shards if s.phase == phase), None)


class Events:
    def __init__(self) -> None:
        self.items: list[records.Event] = []

    async def on_message(self, msg) -> None:
        self.items.append(records.decode(msg.data, records.Event))

    def kinds(self, prefix: str = "shard-") -> list[str]:
        return [e.kind for e in self.items if e.kind.startswith(prefix)]


async def test_placed_replica_is_validated_launched_loaded_ready_and_streams(bus, node, controller):
    events = Events()
    await bus.subscribe("llmgw.events.>", events.on_message)
    await serve(bus, _catalog(node["tmp"], env={"FAKE_ENGINE_LOAD_SECONDS": "1"}), 1)
    shard = await until(lambda: _shard(bus, "ready"))
    assert shard.endpoint.endswith(str((await _replica(bus)).members[0].port))
    assert shard.served_name == "tiny-chat"
    chunks = await stream_chat(f"http://{shard.endpoint}", "tiny-chat")
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
    assert (
        "content" in json.loads(chunks[0])["choices"][0]["delta"]
        or json.loads(chunks[1])["choices"][0]["delta"]
    )
    assert events.kinds()[:4] == [
        "shard-validating",
        "shard-starting",
        "shard-loading",
        "shard-ready",
    ]
    rep = await until(lambda: _replica(bus, "ready"))
    assert rep.endpoint == shard.endpoint


async def _replica(bus, phase=None):
    got = await bus.list("replicas.tiny.*", decoder(records.Replica))
    reps = [e.value for e in got.values()]
    if not reps:
        return None
    if phase and reps[0].phase != phase:
        return None
    return reps[0]


async def test_bad_profile_fails_validation_and_nothing_is_launched(bus, node, controller):
    events = Events()
    await bus.subscribe("llmgw.events.>", events.on_message)
    record = node["tmp"] / "launched.json"
    model = _catalog(
        node["tmp"], path=str(node["tmp"] / "no-such.gguf"), env={"FAKE_ENGINE_RECORD": str(record)}
    )
    await serve(bus, model, 1)

    # the agent gives up on that launch at once (the refusal stays until the profile
    # changes): the controller moves the replica or, as here with no other node, says why
    async def refused() -> records.Failure | None:
        got = await bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))
        failures = got.value.failures if got else []
        return next((f for f in failures if f.node == "node1"), None)

    failure = await until(refused)
    assert failure.reason.startswith("refused before launch:")
    assert "no-such.gguf" in failure.reason
    assert failure.restarts == 0
    # the agent's one decision for that assignment: refused, given up, no engine; a launch
    # would have reported "starting" before it
    (shard,) = await _shard(bus)
    assert (shard.phase, shard.gave_up, shard.pid) == ("failed", True, None)
    assert "shard-starting" not in events.kinds(), "the engine was launched despite the refusal"
    assert not record.exists()


async def test_engine_crashing_while_loading_reports_its_output_and_retries_with_growing_delays(
    bus, node, controller
):
    model = _catalog(node["tmp"], env={"FAKE_ENGINE_FAIL_LOAD": "CUDA out of memory (simulated)"})
    await serve(bus, model, 1)

    async def failed_twice():
        s = await _shard(bus, "failed")
        return s if s and s.restarts >= 3 else None

    shard = await until(failed_twice, timeout=30)
    assert any("CUDA out of memory (simulated)" in line for line in shard.output_tail)
    assert len("\n".join(shard.output_tail)) <= 8192 and len(shard.output_tail) <= 64
    # "restart N in D s": the delays grow
    log_text = node["log"].read_text()
    delays = [
        float(part.split(" in ")[1].split(" s")[0])
        for part in log_text.split("restart ")[1:]
        if " in " in part
    ]
    assert delays[:3] == sorted(delays[:3]) and delays[2] > delays[0]


async def test_drain_waits_for_an_in_flight_streaming_request(bus, node, controller):
    model = _catalog(node["tmp"], env={"FAKE_ENGINE_TOKENS": "30", "FAKE_ENGINE_TOKEN_RATE": "15"})
    await serve(bus, model, 1)
    shard = await until(lambda: _shard(bus, "ready"))
    async with anyio.create_task_group() as tg:
        result: dict[str, list[str]] = {}
        arrived: list[str] = []

        async def stream():
            result["chunks"] = await stream_chat(
                f"http://{shard.endpoint}", "tiny-chat", events=arrived
            )

        async def in_flight():
            return len(arrived) >= 2  # tokens are coming: the request is in flight (2 s of them)

        tg.start_soon(stream)
        await until(in_flight)
        await want(bus, "tiny", 0, at=2.0)
        await until(lambda: _shard(bus, "draining"))
        assert "chunks" not in result  # still streaming while draining
    assert result["chunks"][-1] == "[DONE]"  # finished, not cut off
    tokens = [
        c for c in result["chunks"][:-1] if json.loads(c)["choices"][0]["delta"].get("content")
    ]
    assert len(tokens) == 30  # every token arrived: the engine was not stopped under it

    async def all_gone():
        return (await _shard(bus)) == [] and await _replica(bus) is None

    await until(all_gone)


async def test_nats_restart_while_serving_engines_keep_answering_and_the_agent_re_reports(
    bus, node, controller, nats_server
):
    await serve(bus, _catalog(node["tmp"]), 1)
    shard = await until(lambda: _shard(bus, "ready"))
    before = (await bus.get(keys.shard("node1", shard.rid), decoder(records.Shard))).revision
    nats_server.stop()
    chunks = await stream_chat(
        f"http://{shard.endpoint}", "tiny-chat"
    )  # no NATS: the engine still serves
    assert chunks[-1] == "[DONE]"
    nats_server.start()

    async def re_reported():
        e = await bus.get(keys.shard("node1", shard.rid), decoder(records.Shard))
        return e if e and e.revision > before and e.value.phase == "ready" else None

    await until(re_reported, timeout=30)


async def test_agent_sigterm_stops_its_engines_with_it(bus, node, controller):
    await serve(bus, _catalog(node["tmp"]), 1)
    shard = await until(lambda: _shard(bus, "ready"))
    engine = psutil.Process(shard.pid)
    node["proc"].send_signal(signal.SIGTERM)
    assert node["proc"].wait(timeout=5) == 0  # well within systemd's stop timeout: no SIGKILL
    assert not _alive(engine), "the engine outlived the agent"


async def test_agent_killed_hard_its_successor_adopts_the_engine_it_left_serving(
    bus, node, controller
):
    """SIGKILL, the OOM killer, a crash: the agent cannot stop its engines. They serve on
    (their own session), and the next agent adopts each that still matches its assignment,
    instead of loading the model again (it used to stop it and start another)."""
    await serve(bus, _catalog(node["tmp"]), 1)
    first = await until(lambda: _shard(bus, "ready"))
    engine = psutil.Process(first.pid)
    node["proc"].send_signal(signal.SIGKILL)  # no chance to stop its engines
    node["proc"].wait(5)
    try:
        assert _alive(engine)
        url = f"http://{first.endpoint}"
        assert (await stream_chat(url, "tiny-chat", max_tokens=2))[-1] == "[DONE]"
        node["proc"] = start_agent(
            node["cfg"], node["tmp"] / "agent.toml", node["path"], node["log"]
        )
        await until(
            lambda: _log_says(
                node["log"], f"adopted the engine an earlier agent left (pid {first.pid})"
            )
        )
        again = await until(lambda: _shard(bus, "ready"))
        assert again.pid == first.pid and _alive(engine)
        assert (await stream_chat(url, "tiny-chat", max_tokens=2))[-1] == "[DONE]"
    finally:
        if _alive(engine) and node["proc"].poll() is not None:
            os.killpg(engine.pid, signal.SIGKILL)


async def _log_says(path, text: str) -> bool:
    return text in path.read_text()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_fixing_a_refused_profile_in_the_catalog_launches_it(bus, node, controller):
    bad = _catalog(node["tmp"], path=str(node["tmp"] / "typo.gguf"))
    await serve(bus, bad, 1)
    await until(lambda: _shard(bus, "failed"))
    fixed = _catalog(node["tmp"])  # the operator corrects the path and applies again
    await bus.put(keys.catalog("tiny"), catalog.encode_model(fixed))
    ready = await until(lambda: _shard(bus, "ready"))
    assert "refused" not in ready.reason
    # a changed launch is a new revision: the refused replica is replaced by one of the
    # fixed profile (its agent may launch it again meanwhile; it drains once that is ready)
    launch = catalog.launch_hash(fixed, fixed.profiles[0])

    async def only_the_fixed_one():
        reps = await bus.list("replicas.tiny.*", decoder(records.Replica))
        live = [e.value for e in reps.values()]
        return len(live) == 1 and live[0].launch == launch and live[0].phase == "ready"

    await until(only_the_fixed_one)


async def test_new_replica_on_the_port_of_one_being_drained_waits_for_it_instead_of_failing(
    bus, node, engine_ports
):
    # A node back after being declared lost: its old replica is drained while the new one
    # is placed on the same port. No controller here: the assignments are written as it would.
    model = _catalog(node["tmp"])
    await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    port = engine_ports[0]

    def assignment(rid: str, action: str, generation: int) -> records.Assignment:
        return records.Assignment(
            model="tiny", rid=rid, profile="cpu", action=action, generation=generation, port=port
        )

    await bus.put(keys.assign("node1", "rold"), assignment("rold", "run", 1))
    await until(lambda: _shard(bus, "ready"))
    await bus.put(keys.assign("node1", "rold"), assignment("rold", "drain", 2))
    await bus.put(keys.assign("node1", "rnew"), assignment("rnew", "run", 1))

    async def new_ready():
        got = await bus.get(keys.shard("node1", "rnew"), decoder(records.Shard))
        return got.value if got and got.value.phase == "ready" else None

    shard = await until(new_ready)
    assert shard.endpoint.endswith(f":{port}")
    text = node["log"].read_text()
    assert "rnew waits for rold to stop (same port or GPUs)" in text


async def test_shard_record_of_an_assignment_removed_while_the_agent_was_down_is_removed(bus, node):
    # a shard record whose assignment no longer exists (deleted while this agent was away)
    await bus.put(
        keys.shard("node1", "rgone"),
        shard("node1", "rgone", "ready", model="tiny", endpoint="127.0.0.1:1"),
    )
    stop(node["proc"])
    node["proc"] = start_agent(node["cfg"], node["tmp"] / "agent.toml", node["path"], node["log"])

    async def gone():
        return await bus.get(keys.shard("node1", "rgone"), decoder(records.Shard)) is None

    await until(gone)


async def test_a_replica_that_cannot_start_for_a_local_error_fails_alone_and_the_agent_keeps_serving(
    bus, node, engine_ports
):
    model = _catalog(node["tmp"])
    await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    low = engine_ports[0]
    await bus.put(
        keys.assign("node1", "rok"),
        records.Assignment(
            model="tiny", rid="rok", profile="cpu", action="run", generation=1, port=low
        ),
    )
    ok = await until(lambda: _shard(bus, "ready"))
    logs = node["dirs"]["state"] / "logs"
    moved = logs.with_name("logs.real")
    logs.rename(moved)
    logs.write_text("not a directory")  # the engine log dir cannot be made: an OSError at launch
    try:
        await bus.put(
            keys.assign("node1", "rbad"),
            records.Assignment(
                model="tiny", rid="rbad", profile="cpu", action="run", generation=1, port=low + 1
            ),
        )

        async def bad_failed():
            got = await bus.get(keys.shard("node1", "rbad"), decoder(records.Shard))
            return got.value if got and got.value.phase == "failed" else None

        bad = await until(bad_failed)
        assert "logs" in bad.reason and "retrying" in bad.reason
        assert node["proc"].poll() is None  # the agent is still running
        chunks = await stream_chat(
            f"http://{ok.endpoint}", "tiny-chat"
        )  # and so is the other engine
        assert chunks[-1] == "[DONE]"
    finally:
        logs.unlink()
        moved.rename(logs)

    async def bad_recovered():  # retried with backoff once the problem is gone
        got = await bus.get(keys.shard("node1", "rbad"), decoder(records.Shard))
        return got.value if got and got.value.phase == "ready" else None

    await until(bad_recovered, timeout=30)


# --- ports as they really are: another program on a port of the engine range -------------


@contextlib.asynccontextmanager
async def _ranged_node(
    nats_server, nats_settings, tmp_path, ports: tuple[int, int], *, sees_listeners: bool
):
    """The agent (engines on `ports`, probed every 0.2 s) and a leading controller on the same
    range. With `sees_listeners` its /proc/net is this machine's, so it sees the sockets
    the test opens; without, a recorded tree with none, as if they opened after its probe."""
    dirs = host_dirs(tmp_path)
    install_fake_engines(dirs["bin"])
    if sees_listeners:
        (dirs["procfs"] / "net").symlink_to("/proc/net")  # read as the agent's own netns
    cfg = agent_config(nats_server.url, dirs, id="node1")
    cfg = msgspec.structs.replace(
        cfg,
        intervals=Intervals(heartbeat=0.2, engine_probe=0.3, port_probe=0.2),
        engines=_quick_engines(port_low=ports[0], port_high=ports[1]),
    )
    proc = start_agent(
        cfg, tmp_path / "agent.toml", [dirs["bin"], "/usr/bin", "/bin"], tmp_path / "agent.log"
    )
    settings = quick_controller(ports)
    b = await Bus.connect(nats_settings, give_up_after=5)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(b, settings).run)
            yield dirs
            tg.cancel_scope.cancel()
    finally:
        await b.close()
        stop(proc)


async def _assignment(bus: Bus, rid: str) -> records.Assignment:
    got = await bus.get(keys.assign("node1", rid), decoder(records.Assignment))
    return got.value


async def test_a_port_another_program_listens_on_is_never_assigned(
    bus, nats_server, nats_settings, tmp_path, engine_ports
):
    low = engine_ports[0]
    with socket.socket() as other:  # a service of the node, on the first engine port
        other.bind(("0.0.0.0", low))
        other.listen()
        async with _ranged_node(
            nats_server, nats_settings, tmp_path, engine_ports, sees_listeners=True
        ):

            async def reported():
                inv = await bus.get(keys.node("node1"), decoder(records.NodeInventory))
                return inv is not None and inv.value.ports.ports == [low]

            await until(reported)
            await serve(bus, _catalog(tmp_path), 1)
            shard = await until(lambda: _shard(bus, "ready"))
            assert shard.port == low + 1 and shard.endpoint == f"127.0.0.1:{low + 1}"
            # never given the taken port, not even once: a move would have raised it
            assert (await _assignment(bus, shard.rid)).generation == 1


async def test_a_port_taken_between_placement_and_launch_ends_with_the_replica_on_another(
    bus, nats_server, nats_settings, tmp_path, engine_ports
):
    events = Events()
    await bus.subscribe("llmgw.events.>", events.on_message)
    low = engine_ports[0]
    with socket.socket() as other:
        other.bind(("127.0.0.1", low))
        other.listen()
        async with _ranged_node(
            nats_server, nats_settings, tmp_path, engine_ports, sees_listeners=False
        ):
            await serve(bus, _catalog(tmp_path), 1)
            rep = await until(lambda: _replica(bus, "ready"), timeout=30)
            assert rep.members[0].port == low + 1 and rep.endpoint == f"127.0.0.1:{low + 1}"
            assert (
                f"port {low} on node1 was taken by another program, moved to {low + 1}"
                in rep.reason
            )
            assert (await _assignment(bus, rep.rid)).generation == 2
            shard = await until(lambda: _shard(bus, "ready"))
            assert (shard.port, shard.refused) == (low + 1, "")
            assert "port-moved" in events.kinds("port-")
            waited = [
                e
                for e in events.items
                if e.kind == "shard-validating"
                and e.data["reason"].startswith(f"waiting: port {low} ")
            ]
            assert waited, "the agent waited for the taken port before the move"
            assert not [e for e in events.items if e.kind == "shard-failed"]
