"""`llmgw controller`: a controller process (several may run; one leads)."""

from __future__ import annotations

import logging

import anyio
import click

from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import nats_options, until_signalled
from llmgw.controller.liveness import LOST_AFTER_S, UNREACHABLE_AFTER_S
from llmgw.controller.placement.snapshot import FAILURE_COOLDOWN_S, FAILURE_NODES
from llmgw.metrics_http import CONTROLLER_PORT, MetricsListenError, parse_listen


@click.command()
@nats_options
@click.option("--id", "controller_id", default=None, help="controller id (default: hostname-pid)")
@click.option(
    "--unreachable-after",
    type=click.FloatRange(min=0, min_open=True),
    default=UNREACHABLE_AFTER_S,
    show_default=True,
    help="seconds without a heartbeat before a node is unreachable",
)
@click.option(
    "--lost-after",
    type=click.FloatRange(min=0, min_open=True),
    default=LOST_AFTER_S,
    show_default=True,
    help="seconds without a heartbeat before a node is lost and its replicas move",
)
@click.option(
    "--failure-cooldown",
    type=click.FloatRange(min=0),
    default=FAILURE_COOLDOWN_S,
    show_default=True,
    help="seconds a node whose agent gave up on a replica is avoided for that launch",
)
@click.option(
    "--failure-nodes",
    type=click.IntRange(min=1),
    default=FAILURE_NODES,
    show_default=True,
    help="distinct nodes giving up on one launch within the cool-down: the profile is broken",
)
@click.option(
    "--metrics-listen",
    envvar="LLMGW_METRICS_LISTEN",
    default="",
    help=f"HOST:PORT to serve GET /metrics on, e.g. 0.0.0.0:{CONTROLLER_PORT} [default: none]; "
    "a port another program holds is logged and tried again every 30 s, placement goes on",
)
def controller(
    nats: NatsSettings,
    bucket: BucketSettings,
    controller_id,
    unreachable_after,
    lost_after,
    failure_cooldown,
    failure_nodes,
    metrics_listen,
) -> None:
    """Run a controller (several may run; one leads)."""
    from llmgw.controller.loop import Controller, ControllerSettings

    logging.getLogger("llmgw").setLevel(logging.INFO)
    given = dict(
        unreachable_after=unreachable_after,
        lost_after=lost_after,
        failure_cooldown=failure_cooldown,
        failure_nodes=failure_nodes,
    )
    if metrics_listen:
        try:
            given["metrics_listen"] = parse_listen(metrics_listen, "--metrics-listen")
        except MetricsListenError as e:
            raise click.BadParameter(str(e)) from None
    if controller_id:
        given["controller_id"] = controller_id
    settings = ControllerSettings(**given)

    async def run() -> None:
        # a service: it waits for NATS (and JetStream) like for any outage, saying so
        async with await Bus.connect(nats, bucket) as bus:
            await until_signalled(Controller(bus, settings).run)

    anyio.run(run)
