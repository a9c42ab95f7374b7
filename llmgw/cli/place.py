"""`llmgw place`: write desired.<model>, then show what the controller decides (or, with
--dry-run, what it would decide from the bucket as it is now)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import click
import msgspec

from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.bus.trust import MAX_REPLICAS
from llmgw.catalog import Model, decode_model
from llmgw.cli.common import nats_options, open_bus
from llmgw.cli.served import catalog_models, unknown_model_id
from llmgw.controller import placement
from llmgw.controller.inputs import phases_at_takeover, placement_snapshot
from llmgw.controller.view import View
from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)


class PlacingError(LlmgwError):
    """`llmgw place` cannot ask for this: the model or profile is not in the catalog."""


async def catalog_model(bus: Bus, model: str) -> Model:
    """The catalog entry of the model id `model`; else UnknownModel saying what was meant
    (a served name given for the id, a typo of an id)."""
    entry = None
    if keys.is_token(model):
        entry = await bus.get(keys.catalog(model), lambda b: decode_model(b, model))
    if entry is not None:
        return entry.value
    raise unknown_model_id(model, await catalog_models(bus))


async def _check_model(bus: Bus, model: str, profile: str | None, *, auto: bool = False) -> None:
    entry = await catalog_model(bus, model)
    if profile and entry.profile(profile) is None:
        names = ", ".join(p.name for p in entry.profiles) or "none: static endpoints"
        raise PlacingError(f"model {model!r} has no profile {profile!r} (profiles: {names})")
    if auto and entry.autoscale is None:
        raise PlacingError(
            f"model {model!r} has no autoscale policy in the catalog: add an [models.autoscale] "
            "table (min_replicas, max_replicas, target_in_flight, ...; docs/placement.md) and "
            "apply it, or give a fixed count with --replicas N"
        )


async def write_desired(
    bus: Bus, model: str, replicas: int, profile: str | None, *, auto: bool = False
) -> float:
    """Write `desired.<model>`: a fixed count, or (`auto`) the autoscaler's. Switching to
    auto keeps the last fixed count in the record: it is what runs until the leader decides."""
    await _check_model(bus, model, profile, auto=auto)
    now = time.time()
    if auto:
        old = await bus.get(keys.desired(model), decoder(records.Desired))
        replicas = old.value.replicas if old is not None else 0
    await bus.put(
        keys.desired(model),
        records.Desired(model=model, replicas=replicas, profile=profile, updated_at=now, auto=auto),
    )
    return now


async def load_view(bus: Bus) -> View:
    view = View()
    for key, entry in (await bus.list(">", lambda b: b)).items():
        view.apply(key, entry.value, entry.revision)
    return view


async def dry_run_plan(bus: Bus, model: str, replicas: int, profile: str | None) -> list[str]:
    await _check_model(bus, model, profile)
    view = await load_view(bus)
    now = time.time()
    view.desired[model] = records.Desired(
        model=model, replicas=replicas, profile=profile, updated_at=now
    )
    # the write replaces a count that did not read (`invalid` is a copy: pop the record)
    view.unreadable.pop(keys.desired(model), None)
    # the controller's own code, given what a dry run cannot know from the bucket: the
    # controller's port range, and how leases moved (it judges as at a takeover)
    snap = placement_snapshot(
        view,
        phases_at_takeover(view),
        view.frozen(),
        port_range=placement.DEFAULT_PORTS,
        now=now,
    )
    plan = placement.plan(snap)
    lo, hi = snap.port_range
    lines = [
        f"dry run: {model} x{replicas} (nothing written)",
        f"  assumed: ports {lo}-{hi}, the controller's default (one started with another range"
        " places on other ports)",
        "  assumed: nodes as a controller taking the lead now judges them: one recorded"
        " unreachable or lost stays so, any other is ready while it has a lease (a dry run"
        " does not watch leases move)",
    ]
    rec = plan.placements.get(model)
    for r in plan.create:
        if r.model == model:
            # no rid: the controller names its replicas from its own clock when it places them
            lines.append(f"  would place a replica on {_members(r)}: {r.reason}")
    for rm in plan.remove:
        if rm.model == model:
            lines.append(f"  would remove {rm.rid}: {rm.reason}")
    for move in plan.port_moves:
        if move.replica.model == model:
            lines.append(f"  would move {move.replica.rid}: {move.why}")
    if rec is not None:
        lines.append(
            f"  {rec.placed}/{rec.desired} placed"
            + (f"; {rec.explanation}" if rec.explanation else "")
        )
    return lines


def _members(r: records.Replica) -> str:
    return ", ".join(
        f"{m.node} (rank {m.rank}, {len(m.gpus)} GPU, port {m.port})" for m in r.members
    )


async def follow_placement(
    bus: Bus,
    model: str,
    since: float,
    *,
    wait: bool,
    timeout: float,
    echo: Callable[[str], None],
    poll: float = 0.2,
) -> int:
    """Print the controller's decision on the desired.<model> written at `since` (it echoes
    that value back in `desired_at`); with `wait`, follow until all replicas are ready and
    a rollout, if one runs, is complete (exit 0), or the controller explains why not, a
    stopped rollout included (exit 1)."""
    shown: dict[str, str] = {}
    last_explanation = None
    last_rollout = None
    deadline = time.monotonic() + (timeout if wait else 5.0)
    decided = False
    reader = PollReader(bus)
    while time.monotonic() < deadline:
        p = await reader.get(keys.placement(model), records.PlacementRecord)
        reps = await reader.list(f"{keys.REPLICAS}.{model}.*", records.Replica)
        ro = await reader.get(keys.rollout(model), records.Rollout)
        if p is not None and p.desired_at == since:
            decided = True
        if decided and ro is not None and ro.phase != "complete":
            said = rollout_line(ro)
            if said != last_rollout:
                last_rollout = said
                echo(said)
            if ro.phase == "stopped" and wait:
                return 1
        if decided:
            for r in sorted(reps, key=lambda r: r.rid):
                line = f"  {r.rid} {r.phase} on {_members(r)}" + (
                    f" at {r.endpoint}" if r.endpoint else ""
                )
                if shown.get(r.rid) != line:
                    first = r.rid not in shown
                    shown[r.rid] = line
                    echo(line + (f"\n      why: {r.reason}" if r.reason and first else ""))
            if p and p.explanation and p.explanation != last_explanation:
                last_explanation = p.explanation
                echo(f"  {p.placed}/{p.desired} placed: {p.explanation}")
            live = [r for r in reps if r.phase in records.REPLICA_COUNTED]
            if p and not wait:
                return 0
            if p and p.desired == 0 and wait:
                if not reps:  # drained, then removed
                    echo("  all replicas removed")
                    return 0
            elif (
                p
                and p.desired == len(live)
                and all(r.phase == "ready" for r in live)
                and (ro is None or ro.phase == "complete")
            ):
                echo(f"  {len(live)}/{p.desired} ready")
                return 0
            if p and p.explanation and p.placed < p.desired:
                return 1
        await anyio.sleep(poll)
    if not decided:
        echo("  no controller has decided yet: is one running? (`llmgw up` or `llmgw controller`)")
    return 0 if not wait else 2


def rollout_line(ro: records.Rollout) -> str:
    """ "  rollout progressing: 1/3 updated (1 ready), 2 old" """
    if ro.phase == "stopped":
        tail = "".join(f"\n      | {line}" for line in ro.output_tail[-5:])
        return f"  rollout stopped: {ro.reason}{tail}"
    return (
        f"  rollout {ro.phase}: {ro.updated}/{ro.desired} updated ({ro.ready} ready), "
        f"{ro.old} old (surge {ro.surge}, max_unavailable {ro.max_unavailable})"
    )


T = TypeVar("T")


class PollReader:
    """Reads for a loop that polls the same keys: a value that does not decode is logged
    once per revision, not at every poll (the bus logs at every read)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.said: set[tuple[str, int]] = set()

    async def get(self, key: str, type_: type[T]) -> T | None:
        raw = await self.bus.get_raw(key)
        return None if raw is None else self._decode(key, raw[0], raw[1], type_)

    async def list(self, pattern: str, type_: type[T]) -> list[T]:
        entries = await self.bus.list(pattern, lambda data: data)
        values = (self._decode(k, e.value, e.revision, type_) for k, e in entries.items())
        return [v for v in values if v is not None]

    def _decode(self, key: str, data: bytes, revision: int, type_: type[T]) -> T | None:
        try:
            return records.decode(data, type_)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if (key, revision) not in self.said:
                self.said.add((key, revision))
                log.warning(
                    "skipping %s (revision %d): value does not decode: %s; "
                    "fix it or remove it with `nats kv del <bucket> %s`",
                    key,
                    revision,
                    e,
                    key,
                )
            return None


def _within_bound(replicas: int) -> int:
    if replicas > MAX_REPLICAS:
        raise click.BadParameter(
            f"{replicas:,} replicas of one model: at most {MAX_REPLICAS:,} (the bound every "
            "reader of desired.<model> holds it to: more engines than a fleet runs is a "
            "typo, and a controller freezes a model asked for more)",
            param_hint="'--replicas'",
        )
    return replicas


@click.command()
@click.argument("model")
@click.option(
    "--replicas",
    type=click.IntRange(min=0),
    default=None,
    callback=lambda ctx, param, n: None if n is None else _within_bound(n),
    help=f"a fixed count, which switches autoscaling off (0 removes them; at most "
    f"{MAX_REPLICAS:,})",
)
@click.option(
    "--auto",
    is_flag=True,
    help="the count follows the load, as the model's catalog autoscale policy says",
)
@click.option("--profile", default=None, help="catalog profile (default: the first that fits)")
@click.option(
    "--wait",
    is_flag=True,
    help="follow until every replica is ready or the controller explains why not",
)
@click.option(
    "--dry-run", is_flag=True, help="compute the plan from the current bucket; write nothing"
)
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="seconds --wait follows for"
)
@nats_options
def place(
    model,
    replicas,
    auto,
    profile,
    wait,
    dry_run,
    timeout,
    nats: NatsSettings,
    bucket: BucketSettings,
) -> None:
    """Ask for N replicas of MODEL (or, --auto, as many as its load needs), then show where
    they go and why."""
    if (replicas is None) == (not auto):
        raise click.UsageError("give either --replicas N (a fixed count) or --auto")
    if auto and dry_run:
        raise click.UsageError("--dry-run takes a fixed count: --replicas N")

    async def run() -> int:
        async with open_bus(nats, bucket) as bus:
            if dry_run:
                for line in await dry_run_plan(bus, model, replicas, profile):
                    click.echo(line)
                return 0
            written_at = await write_desired(bus, model, replicas or 0, profile, auto=auto)
            count = "autoscaled" if auto else f"{replicas} replica(s)"
            click.echo(f"desired.{model}: {count}" + (f", profile {profile}" if profile else ""))
            return await follow_placement(
                bus, model, written_at, wait=wait, timeout=timeout, echo=click.echo
            )

    raise SystemExit(anyio.run(run))
