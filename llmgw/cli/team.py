"""`llmgw team`: teams in `teams.<team>` (the operator their one writer): the limits and
models that every key of the team shares, on top of each key's own."""

from __future__ import annotations

import json
import time

import anyio
import click
import msgspec

from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, NatsSettings, decoder
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.key import (
    LIMIT_FIELDS,
    KeyCommandError,
    apply_limits,
    change_record,
    check_name,
    describe_limits,
    ensure_streams,
    limit_options,
    priority_option,
    set_priority,
    split_models,
)
from llmgw.cli.served import allow_unknown_option, check_models

WEIGHT = click.IntRange(1, records.MAX_TEAM_WEIGHT)


def _summary(t: records.Team, members: list[str]) -> dict[str, object]:
    return {
        "team": t.team,
        "models": t.models,
        "limits": msgspec.to_builtins(t.limits),
        "keys": members,
        "created_at": t.created_at,
        "description": t.description,
        "priority": t.priority,
        "weight": t.weight,
    }


@click.group()
def team() -> None:
    """Teams (teams.<team>): limits and models their keys share."""


@team.command("create")
@click.argument("name")
@click.option(
    "--models",
    default=None,
    help="the served names (what clients ask for) its keys may use, comma-separated [all]",
)
@allow_unknown_option
@click.option("--description", default="")
@priority_option("its keys' class, where a key says none")
@click.option(
    "--weight",
    type=WEIGHT,
    default=1,
    show_default=True,
    help="its share of a full fleet against the other teams of its class, in tokens served",
)
@limit_options(what=" (all its keys together)")
@nats_options
def create(
    name,
    models,
    allow_unknown,
    description,
    priority,
    weight,
    nats: NatsSettings,
    bucket: BucketSettings,
    **lim,
) -> None:
    """Create team NAME with limits its keys share."""
    check_name(name, "team")
    record = records.Team(
        team=name,
        models=split_models(models) or [],
        limits=apply_limits(records.Limits(), {f: lim[f] for f in LIMIT_FIELDS}),
        created_at=time.time(),
        description=description,
        priority=set_priority(priority),
        weight=weight,
    )

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            await check_models(bus, record.models, allow_unknown=allow_unknown)
            await ensure_streams(bus)
            if await bus.create(keys.team(name), record) is None:
                raise KeyCommandError(
                    f"team {name!r} exists: change it with `llmgw team set {name} ...`"
                )

    anyio.run(run)
    click.echo(
        f"team {name} created (limits: {describe_limits(record.limits)}; "
        f"priority: {record.priority or 'standard'}; weight: {record.weight})"
    )


async def _teams_and_keys(bus) -> tuple[list[records.Team], dict[str, list[str]]]:
    teams = await bus.list(keys.pattern(keys.TEAMS), decoder(records.Team))
    found = await bus.list(keys.pattern(keys.APIKEYS), decoder(records.ApiKey))
    members: dict[str, list[str]] = {}
    for e in found.values():
        if e.value.team:
            members.setdefault(e.value.team, []).append(e.value.name)
    return sorted((e.value for e in teams.values()), key=lambda t: t.team), members


@team.command("ls")
@json_option
@nats_options
def ls(as_json: bool, nats: NatsSettings, bucket: BucketSettings) -> None:
    """List teams, their limits and how many keys each has."""

    async def run():
        async with open_bus(nats, bucket) as bus:
            return await _teams_and_keys(bus)

    teams, members = anyio.run(run)
    if as_json:
        click.echo(
            json.dumps([_summary(t, sorted(members.get(t.team, []))) for t in teams], indent=2)
        )
        return
    if not teams:
        click.echo("no teams (`llmgw team create NAME`)")
        return
    click.echo(f"{'TEAM':20} {'KEYS':5} {'PRIORITY':10} {'WEIGHT':7} {'MODELS':20} LIMITS")
    for t in teams:
        click.echo(
            f"{t.team:20} {len(members.get(t.team, [])):<5} {t.priority or 'standard':10} "
            f"{t.weight:<7} {','.join(t.models) or 'all':20} {describe_limits(t.limits)}"
        )


@team.command("show")
@click.argument("name")
@json_option
@nats_options
def show(name, as_json: bool, nats: NatsSettings, bucket: BucketSettings) -> None:
    """One team: its limits, models and keys."""
    check_name(name, "team")

    async def run():
        async with open_bus(nats, bucket) as bus:
            return await _teams_and_keys(bus)

    teams, members = anyio.run(run)
    found = next((t for t in teams if t.team == name), None)
    if found is None:
        raise KeyCommandError(f"team {name!r} does not exist (`llmgw team ls`)")
    summary = _summary(found, sorted(members.get(name, [])))
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"team {name}")
    click.echo(f"  limits (all its keys together): {describe_limits(found.limits)}")
    click.echo(f"  models: {', '.join(found.models) or 'all'}")
    click.echo(f"  priority: {found.priority or 'standard'} (its keys' where theirs says none)")
    click.echo(f"  weight: {found.weight}")
    click.echo(f"  keys: {', '.join(summary['keys']) or 'none'}")  # type: ignore[arg-type]


@team.command("set")
@click.argument("name")
@click.option("--models", default=None, help="the served names its keys may use ('' all)")
@allow_unknown_option
@priority_option("its keys' class, where a key says none", none="standard")
@click.option("--weight", type=WEIGHT, default=None, help="its share against its class's teams")
@limit_options(what=" (all its keys together; 'none' removes it)")
@nats_options
def set_(
    name, models, allow_unknown, priority, weight, nats: NatsSettings, bucket: BucketSettings, **lim
) -> None:
    """Change a team's limits, models, class or weight; every router applies them from the
    next request."""
    check_name(name, "team")

    def change(t: records.Team) -> records.Team:
        if models is not None:
            t.models = split_models(models) or []
        if priority is not None:
            t.priority = set_priority(priority)
        if weight is not None:
            t.weight = weight
        t.limits = apply_limits(t.limits, {f: lim[f] for f in LIMIT_FIELDS})
        return t

    async def run() -> records.Team:
        async with open_bus(nats, bucket) as bus:
            await check_models(bus, split_models(models), allow_unknown=allow_unknown)
            return await change_record(bus, keys.team(name), records.Team, change, "team", name)

    t = anyio.run(run)
    click.echo(
        f"team {name}: limits {describe_limits(t.limits)}; priority {t.priority or 'standard'}; "
        f"weight {t.weight}"
    )
