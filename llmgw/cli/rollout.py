"""`llmgw rollout status` and `llmgw rollout undo`: a model's rollout as the controller records
it in `rollout.<model>`, and going back to the revision that ran before. Undo writes what the
operator writes anyway, `catalog.<model>` (the earlier content of its profiles) and, after a
profile switch, `desired.<model>`; the controller then rolls it out like any change."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import click
import msgspec

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.place import catalog_model, follow_placement, rollout_line
from llmgw.errors import LlmgwError
from llmgw.fleetstate.decode import read_once


class RolloutError(LlmgwError):
    """Nothing to show or go back to."""


@click.group()
def rollout() -> None:
    """A model's rollouts (rollout.<model> keys): where one stands, going back."""


async def _read(bus: Bus, key: str) -> Any:
    """`key`'s value as every reader reads it (llmgw/fleetstate/decode.py); one that does
    not read is said as `llmgw status` says it, and nothing is done from it."""
    value, problem = read_once(key, await bus.get_raw(key))
    if problem is not None:
        raise RolloutError(
            f"{problem.says()}. Nothing was done from it; fix it with the command that writes "
            f"it, or `nats kv del {bus.bucket.name} {key}`"
        )
    return value


async def _rollout(bus: Bus, model: str) -> records.Rollout:
    ro = await _read(bus, keys.rollout(model)) if keys.is_token(model) else None
    if ro is None:
        # a model that does not exist is said so, not told to be placed
        await catalog_model(bus, model)
        raise RolloutError(
            f"no rollout recorded for {model!r}: a controller records one once the model is "
            "placed (`llmgw place`)"
        )
    return ro


def _revision(rev: records.Revision) -> str:
    profiles = ", ".join(f"{p.name} (launch {p.launch})" for p in rev.profiles)
    chosen = f"profile {rev.profile}" if rev.profile else "the catalog's profiles in order"
    return f"{chosen}: {profiles}"


def render_status(ro: records.Rollout, replicas: list[records.Replica], now: float) -> list[str]:
    launches = {p.name: p.launch for p in ro.current.profiles}
    lines = [
        f"{ro.model}: rollout {ro.phase}",
        f"  revision   {_revision(ro.current)}, since {now - ro.current.since:.0f}s",
        f"  replicas   {ro.updated}/{ro.desired} updated, {ro.ready} ready, {ro.old} old "
        f"(surge {ro.surge}, max_unavailable {ro.max_unavailable})",
    ]
    if ro.phase == "stopped":
        lines.append(rollout_line(ro).strip())
    for r in sorted(replicas, key=lambda r: r.rid):
        current = launches.get(r.profile) in (r.launch, None) or not r.launch
        which = "current" if current and r.profile in launches else "old"
        where = ", ".join(m.node for m in r.members)
        lines.append(f"    {r.rid} {r.phase} on {where}: profile {r.profile} ({which})")
    if ro.history:
        lines.append("  history (`llmgw rollout undo` goes back to the last)")
        for rev in ro.history:
            lines.append(f"    {_revision(rev)}")
    return lines


@rollout.command("status")
@click.argument("model")
@nats_options
@json_option
def status(model: str, nats: NatsSettings, bucket: BucketSettings, as_json: bool) -> None:
    """Where MODEL's rollout stands: its revision, replicas new and old, why it stopped."""

    async def run():
        async with open_bus(nats, bucket) as bus:
            ro = await _rollout(bus, model)
            got = await bus.list(keys.pattern(keys.REPLICAS, model), decoder(records.Replica))
            return ro, [e.value for e in got.values()]

    ro, replicas = anyio.run(run)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(ro), indent=2, sort_keys=True))
        return
    for line in render_status(ro, replicas, time.time()):
        click.echo(line)


def previous(ro: records.Rollout) -> records.Revision:
    """The last revision before the current one that ran everywhere."""
    earlier = [rev for rev in ro.history if not rev.same(ro.current)]
    if not earlier:
        raise RolloutError(
            f"{ro.model} has no earlier revision to go back to: only one that ran on every "
            "replica is kept"
        )
    return earlier[-1]


def undone(entry: catalog.Model, rev: records.Revision) -> catalog.Model:
    """The catalog entry with the profiles of `rev` as they were, validated as any entry."""
    raw = msgspec.to_builtins(entry)
    profiles = list(raw.get("profiles", []))
    for p in rev.profiles:
        at = next((i for i, old in enumerate(profiles) if old.get("name") == p.name), None)
        if at is None:
            profiles.append(dict(p.content))
        else:
            profiles[at] = dict(p.content)
    raw["profiles"] = profiles
    raw["served_name"] = rev.served_name or entry.served_name
    try:
        return catalog.validate_models({"models": [raw]})[0]
    except catalog.CatalogError as e:
        raise RolloutError(f"the earlier revision is no longer a valid entry: {e}") from None


@rollout.command("undo")
@click.argument("model")
@click.option("--wait", is_flag=True, help="follow the rollout back to its end")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="seconds --wait follows for"
)
@nats_options
def undo(model: str, wait: bool, timeout: float, nats: NatsSettings, bucket: BucketSettings):
    """Go back to MODEL's previous revision: its profiles' content and the profile chosen."""

    async def run() -> int:
        async with open_bus(nats, bucket) as bus:
            ro = await _rollout(bus, model)
            rev = previous(ro)
            # both read before anything is written: one that does not read stops it all
            entry: catalog.Model | None = await _read(bus, keys.catalog(model))
            desired: records.Desired | None = await _read(bus, keys.desired(model))
            if entry is None:
                raise RolloutError(f"{model} is not in the catalog")
            back = undone(entry, rev)
            if back != entry:
                await bus.put(keys.catalog(model), catalog.encode_model(back))
                click.echo(f"catalog.{model}: profiles back to {_revision(rev)}")
            since = desired.updated_at if desired is not None else 0.0
            if desired is not None and desired.profile != rev.profile:
                since = time.time()
                chosen = msgspec.structs.replace(desired, profile=rev.profile, updated_at=since)
                await bus.put(keys.desired(model), chosen)
                click.echo(f"desired.{model}: profile {rev.profile or '(the first that fits)'}")
            if not wait:
                return 0
            deadline = time.monotonic() + timeout
            while not (await _rollout(bus, model)).current.same(rev):
                if time.monotonic() > deadline:
                    click.echo("  no controller has taken the change yet: is one running?")
                    return 2
                await anyio.sleep(0.2)
            return await follow_placement(
                bus, model, since, wait=True, timeout=deadline - time.monotonic(), echo=click.echo
            )

    raise SystemExit(anyio.run(run))
