"""`llmgw controller`: a controller process (several may run; one leads)."""

from __future__ import annotations

import logging

import anyio
import click

from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import nats_options, option_group, until_signalled
from llmgw.controller.liveness import LOST_AFTER_S, UNREACHABLE_AFTER_S
from llmgw.controller.placement.snapshot import FAILURE_COOLDOWN_S, FAILURE_NODES
from llmgw.metrics_http import CONTROLLER_PORT, MetricsListenError, parse_listen


@click.command()
@nats_options
@click.option("--id", "controller_id", default=None, help="controller id (default: hostname-pid)")
@option_group(
    *(
        click.option(flag, type=kind, default=default, show_default=True, help=text)
        for flag, kind, default, text in (
            (
                "--unreachable-after",
                click.FloatRange(min=0, min_open=True),
                UNREACHABLE_AFTER_S,
                "seconds without a heartbeat before a node is unreachable",
            ),
            (
                "--lost-after",
                click.FloatRange(min=0, min_open=True),
                LOST_AFTER_S,
                "seconds without a heartbeat before a node is lost and its replicas move",
            ),
            (
                "--failure-cooldown",
                click.FloatRange(min=0),
                FAILURE_COOLDOWN_S,
                "seconds a node whose agent gave up on a replica is avoided for that launch",
            ),
            (
                "--failure-nodes",
                click.IntRange(min=1),
                FAILURE_NODES,
                "distinct nodes giving up on one launch within the cool-down: the profile is "
                "broken",
            ),
        )
    )
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
