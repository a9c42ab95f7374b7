"""`llmgw usage`: tokens and requests per key, team, model and hour or day, from the usage
counters routers add to (llmgw/gateway/metering.py)."""

from __future__ import annotations

import json
import time

import anyio
import click

from llmgw.bus import keys
from llmgw.bus.client import BucketSettings, NatsSettings
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.key import parse_duration
from llmgw.gateway.metering import KINDS, UsageRow, hour_token, parse_usage_subject


def summarize(
    rows: list[UsageRow], *, since: float, by: str, key=None, team=None, model=None
) -> list[dict[str, object]]:
    """Rows summed per period (hour or day), team, key and model, oldest first."""
    first = hour_token(since)
    table: dict[tuple[str, str | None, str | None, str], dict[str, int]] = {}
    for r in rows:
        if r.hour < first or (key and r.key != key) or (team and r.team != team):
            continue
        if model and r.model != model:
            continue
        period = r.hour if by == "hour" else r.hour[:8]
        counts = table.setdefault((period, r.team, r.key, r.model), dict.fromkeys(KINDS, 0))
        counts[r.kind] += r.value
    return [
        {"period": p, "team": t, "key": k, "model": m, **counts}
        for (p, t, k, m), counts in sorted(table.items(), key=lambda i: tuple(str(x) for x in i[0]))
    ]


def _period(p: str) -> str:
    return f"{p[:4]}-{p[4:6]}-{p[6:8]}" + (f" {p[8:]}:00" if len(p) > 8 else "")


@click.command()
@click.option("--key", default=None, help="only this key")
@click.option("--team", default=None, help="only this team")
@click.option("--model", default=None, help="only this model (as clients name it)")
@click.option("--since", default="7d", show_default=True, help="how far back: 24h, 7d, 30d")
@click.option("--by", type=click.Choice(["day", "hour"]), default="day", show_default=True)
@json_option
@nats_options
def usage(key, team, model, since, by, as_json: bool, nats: NatsSettings, bucket: BucketSettings):
    """Tokens (prompt, completion, cached) and requests, per key, team, model and day or hour."""
    start = time.time() - parse_duration(since, "--since")
    # narrowed by subject where it can be: llmgw.usage.<hour>.<team>.<key>.<model>.<kind>
    # then <router> (counts from before they were per router have none: `>` takes both)
    subject = ".".join(
        (
            keys.USAGE_ROOT,
            "*",
            keys.check_token(team, "team") if team else "*",
            keys.check_token(key, "key") if key else "*",
            keys.name_token(model) if model else "*",
            ">",
        )
    )

    async def run():
        from llmgw.bus.counters import Counters

        async with open_bus(nats, bucket) as bus:
            return await Counters(bus).totals(subject)

    totals = anyio.run(run)
    rows = [r for s, v in totals.items() if (r := parse_usage_subject(s, v)) is not None]
    out = summarize(rows, since=start, by=by, key=key, team=team, model=model)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    if not out:
        click.echo(f"no usage since {since} ago")
        return
    click.echo(
        f"{by.upper():16} {'TEAM':12} {'KEY':16} {'MODEL':20} {'REQUESTS':>9} {'PROMPT':>10} "
        f"{'COMPLETION':>10} {'CACHED':>9}"
    )
    for r in out:
        click.echo(
            f"{_period(str(r['period'])):16} {r['team'] or '-':12} {r['key'] or '-':16} "
            f"{r['model']:20} {r['requests']:>9} {r['prompt']:>10} {r['completion']:>10} "
            f"{r['cached']:>9}"
        )
