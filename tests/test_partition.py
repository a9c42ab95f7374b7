"""One node cut off from NATS (only it: a proxy between its agent and the server is cut)
for longer than lost_after, while its engine keeps serving; then healed. The fleet must
end with the model ready again on that node, nothing failed, nothing left behind."""

from __future__ import annotations

import anyio
import pytest
from agent_helpers import start_fake_engine_agent, stop
from controller_helpers import quick_controller
from links import ProxyLink
from serving import cpu_model, serve, stream_chat
from waiting import until

from llmgw.agent.config import Engines
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.loop import Controller
from llmgw.sim.fake_engine import write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def _shards(bus: Bus) -> list[records.Shard]:
    got = await bus.list("shards.node1.*", decoder(records.Shard))
    return [e.value for e in got.values()]


async def test_node_cut_off_past_lost_after_serves_throughout_and_ends_ready_again(
    bus, nats_server, tmp_path, engine_ports
):
    link = ProxyLink(nats_server.port)
    await link.start()
    engines = Engines(
        listen_host="127.0.0.1",
        backoff_base=0.2,
        backoff_cap=2,
        poll_interval=0.1,
        stop_grace=3,
        drain_timeout=10,
    )
    agent = start_fake_engine_agent(link.url, tmp_path, engines, id="node1").proc
    settings = quick_controller(engine_ports, unreachable_after=1.0, lost_after=3.0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(bus, settings).run)
            gguf = write_fake_gguf(tmp_path / "weights" / "tiny.gguf")
            await serve(bus, cpu_model(str(gguf), host_ram_gb=1), 1)
            first = await until(lambda: _ready(bus))
            await link.cut()  # node1 alone loses NATS; its engine does not notice
            await until(lambda: _health_is(bus, "node1", "lost"), timeout=30)
            events = await stream_chat(f"http://{first.endpoint}", "tiny-chat")
            assert events[-1] == "[DONE]"  # still serving
            await link.heal()

            async def settled():
                shards = await _shards(bus)
                reps = await bus.list("replicas.tiny.*", decoder(records.Replica))
                live = [e.value for e in reps.values()]
                done = (
                    len(live) == 1
                    and live[0].phase == "ready"
                    and [s.phase for s in shards] == ["ready"]
                )
                return (live[0], shards[0]) if done else None

            replica, shard = await until(settled, timeout=60)
            tg.cancel_scope.cancel()
    finally:
        stop(agent)
        await link.cut()
    # the node was declared lost, so its replica was replaced (on the same node: it is the
    # only one); the new engine waited for the old one instead of failing on its port
    assert replica.rid != first.rid  # it was replaced
    assert shard.rid == replica.rid and shard.endpoint == replica.endpoint
    assert f"{replica.rid} waits for {first.rid} to stop" in (tmp_path / "agent.log").read_text()
    assert "refused before launch" not in (tmp_path / "agent.log").read_text()


async def _health_is(bus: Bus, node: str, phase: str) -> bool:
    h = await bus.get(keys.health(node), decoder(records.Health))
    return h is not None and h.value.phase == phase


async def _ready(bus: Bus) -> records.Shard | None:
    return next((s for s in await _shards(bus) if s.phase == "ready"), None)
