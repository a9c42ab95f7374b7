"""An agent whose /metrics address another program holds keeps its node in service: a real
agent process, a real nats-server, a port held by a socket of this test."""

from __future__ import annotations

import socket

import anyio
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from waiting import until

from llmgw.agent.config import Metrics
from llmgw.bus import keys, records
from llmgw.bus.client import decoder

pytestmark = pytest.mark.anyio


async def test_a_metrics_port_held_by_another_program_never_takes_the_node_out_of_service(
    bus, nats_server, tmp_path
):
    """It exited right after registering, leaving its node record behind."""
    dirs = host_dirs(tmp_path)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        cfg = msgspec.structs.replace(
            agent_config(nats_server.url, dirs, id="m1"),
            metrics=Metrics(listen=f"127.0.0.1:{port}"),
        )
        config_path = tmp_path / "agent.toml"
        proc = start_agent(cfg, config_path, [dirs["bin"]], tmp_path / "agent.log")
        try:

            async def inventory() -> records.NodeInventory | None:
                entry = await bus.get(keys.node("m1"), decoder(records.NodeInventory))
                return entry.value if entry and entry.value.metrics_error else None

            inv = await until(inventory, timeout=20)
            assert inv.metrics_error == (
                f"metrics port 127.0.0.1:{port} is in use by another program; set "
                f"metrics.listen in {config_path}"
            )

            async def seq() -> int:
                entry = await bus.get(keys.lease("m1"), decoder(records.Lease))
                return entry.value.seq if entry else 0

            first = await seq()
            await anyio.sleep(1.5)  # heartbeats every 0.2 s
            assert await seq() > first + 3
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            log = (tmp_path / "agent.log").read_text()
            assert f"metrics port 127.0.0.1:{port} is in use by another program" in log
        finally:
            assert stop(proc) == 0


async def test_a_metrics_port_freed_later_is_served_and_the_error_cleared(
    bus, nats_server, tmp_path, monkeypatch
):
    """The agent in this process, trying the address again quickly."""
    import urllib.request

    from llmgw import metrics_http
    from llmgw.agent.service import Agent

    monkeypatch.setattr(metrics_http, "METRICS_RETRY_S", 0.1)
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    cfg = msgspec.structs.replace(
        agent_config(nats_server.url, host_dirs(tmp_path), id="m2"),
        metrics=Metrics(listen=f"127.0.0.1:{port}"),
    )
    agent = Agent(cfg, config_path="/etc/llmgw/agent.toml")

    async def metrics_error() -> str | None:
        entry = await bus.get(keys.node("m2"), decoder(records.NodeInventory))
        return entry.value.metrics_error if entry else None

    async with anyio.create_task_group() as tg:
        try:
            await tg.start(agent.run)
            said = await until(metrics_error, timeout=10)
            assert said == (
                f"metrics port 127.0.0.1:{port} is in use by another program; set "
                "metrics.listen in /etc/llmgw/agent.toml"
            )
            assert agent.metrics_port is None
            other.close()  # the other program goes away

            async def cleared() -> bool:
                return await metrics_error() is None and agent.metrics_port == port

            await until(cleared, timeout=10)
            text = await anyio.to_thread.run_sync(
                lambda: (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
            )
            assert 'llmgw_agent_node{node="m2"} 1.0' in text
        finally:
            other.close()
            tg.cancel_scope.cancel()
