"""`llmgw audit`: the audit trail, one JSON record per request (no prompt or completion
text), from the stream routers append to; `--retention` sets how long it is kept."""

from __future__ import annotations

import time

import anyio
import click

from llmgw.bus import records
from llmgw.bus.client import BucketSettings, NatsSettings
from llmgw.cli.common import nats_options, open_bus
from llmgw.cli.key import ensure_streams, parse_duration


@click.command()
@click.option("--key", default=None, help="only this key's requests")
@click.option("--since", default="1h", show_default=True, help="from how long ago: 10m, 1h, 7d")
@click.option("--follow", "-f", is_flag=True, help="then print new records as they come")
@click.option(
    "--retention", default=None, help="keep records this long from now on (90d), and exit"
)
@nats_options
def audit(key, since, follow, retention, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Print the audit trail as JSON lines: time, key, team, model, replica, status, tokens,
    time to first token, duration, client address."""

    async def run() -> None:
        from llmgw.bus.counters import AuditTrail, set_audit_retention

        async with open_bus(nats, bucket) as bus:
            await ensure_streams(bus)
            if retention is not None:
                seconds = parse_duration(retention, "--retention")
                await set_audit_retention(bus, seconds)
                click.echo(f"audit records are now kept {retention}")
                return
            start = time.time() - parse_duration(since, "--since")
            async for record in AuditTrail(bus).read(since=start, key=key, follow=follow):
                click.echo(records.encode(record).decode())

    anyio.run(run)
