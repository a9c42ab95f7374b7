"""A controller whose /metrics address another program holds goes on placing (issue 30):
a real `llmgw controller` process, a real nats-server, a port held by a socket of this
test. It exited at start with an OSError."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

import anyio
import pytest
from test_controller import _apply, _model, _replicas, _sim
from waiting import until

from llmgw.bus import records
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.sim.bare import inventory

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def _true(check):
    """`check` for `until`, which awaits its condition."""

    async def cond():
        return check()

    return cond


def _held() -> socket.socket:
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    return other


async def test_a_metrics_port_held_by_another_program_never_stops_placement(
    bus, nats_server, tmp_path
):
    events: list[records.Event] = []

    async def on_event(msg) -> None:
        events.append(records.decode(msg.data, records.Event))

    await bus.subscribe("llmgw.events.controller-metrics.>", on_event)
    log_path = tmp_path / "controller.log"
    with _held() as other, open(log_path, "ab") as log:
        port = other.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw.cli",
                "controller",
                "--nats",
                nats_server.url,
                "--id",
                "ctl1",
                "--metrics-listen",
                f"127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            async with anyio.create_task_group() as tg:
                await _sim(bus, tg, inventory("n01", gpus=8))
                await _apply(bus, _model(), 2)

                async def placed() -> list[records.Replica] | None:
                    reps = await _replicas(bus)
                    return reps if len(reps) == 2 else None

                await until(placed, timeout=30)
                tg.cancel_scope.cancel()
            assert proc.poll() is None, log_path.read_text()
            said = (
                f"metrics port 127.0.0.1:{port} is in use by another program; move it with "
                "--metrics-listen HOST:PORT (LLMGW_METRICS_LISTEN), or give none"
            )
            await until(_true(lambda: events), timeout=10)
            assert [(e.subject, e.data["error"]) for e in events] == [("ctl1", said)]
            assert said in log_path.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0, log_path.read_text()


async def test_a_metrics_port_freed_later_is_served(bus, monkeypatch):
    """The controller in this process, trying the address again quickly."""
    from llmgw import metrics_http

    monkeypatch.setattr(metrics_http, "METRICS_RETRY_S", 0.1)
    other = _held()
    port = other.getsockname()[1]
    ctl = Controller(
        bus,
        ControllerSettings(controller_id="c1", leader_ttl=1, metrics_listen=("127.0.0.1", port)),
    )
    async with anyio.create_task_group() as tg:
        try:
            await tg.start(ctl.run)
            assert ctl.metrics_port is None
            assert ctl.metrics_error is not None and f"127.0.0.1:{port}" in ctl.metrics_error
            other.close()  # the other program goes away

            await until(_true(lambda: ctl.metrics_port == port), timeout=10)
            assert ctl.metrics_error is None
            text = await anyio.to_thread.run_sync(
                lambda: (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
            )
            assert "llmgw_controller" in text
        finally:
            other.close()
            tg.cancel_scope.cancel()
