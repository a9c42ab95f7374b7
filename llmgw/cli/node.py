"""`llmgw node`: the operator's intent about a node, in `ops.<node>` (the operator its one
writer; `nodes.<node>` is the agent's): cordon and uncordon, drain, GPUs out of service,
taints. The controller reads it at every pass and after every restart."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import click
import msgspec

from llmgw import labels
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.cli.common import did_you_mean, nats_options, open_bus
from llmgw.cli.place import PollReader
from llmgw.errors import LlmgwError
from llmgw.fleetstate.decode import read_once


class NodeOpsError(LlmgwError):
    """`llmgw node` cannot say this: a GPU the node does not have, a taint that is no name."""


class UnknownNode(NodeOpsError):
    """A node id no inventory names (a typo, most often): nothing is written."""

    exit_code = 2


@click.group()
def node() -> None:
    """Take a node, or one of its GPUs, out of service and back (ops.<node> keys)."""


async def read_ops(bus: Bus, node_id: str) -> records.NodeOps:
    """ops.<node> read as every reader reads it (llmgw/fleetstate/decode.py): one that does
    not read is said, and taken as a cordon (what `llmgw status` shows), never as absent,
    which would put the node back in service. A change starts from that reading."""
    keys.check_token(node_id, "node id")
    key = keys.ops(node_id)
    ops, problem = read_once(key, await bus.get_raw(key))
    if problem is None:
        return ops if ops is not None else records.NodeOps(node=node_id)
    click.echo(f"{problem.says()}; what is written now starts from that reading")
    reason = f"taken as cordoned: revision {problem.revision} of {key} did not read"
    return msgspec.structs.replace(ops, reason=reason)


async def write_ops(bus: Bus, ops: records.NodeOps) -> None:
    """Write the record, or delete it once it asks for nothing."""
    if ops == records.NodeOps(node=ops.node, updated_at=ops.updated_at, reason=ops.reason):
        await bus.delete(keys.ops(ops.node))
        return
    await bus.put(keys.ops(ops.node), msgspec.structs.replace(ops, updated_at=time.time()))


async def _inventory(bus: Bus, node_id: str) -> records.NodeInventory | None:
    entry = await bus.get(keys.node(node_id), decoder(records.NodeInventory))
    return entry.value if entry is not None else None


async def known_node(
    bus: Bus, node_id: str, *, yet_to_join: bool, verb: str
) -> tuple[records.NodeOps, records.NodeInventory | None]:
    """ops.<node> and nodes.<node>, refusing a node that neither names: `cordon h100-a-1`
    (a typo of h100-a-01) wrote ops.h100-a-1, exited 0 and cordoned nothing. A node yet to
    join is named on purpose (`yet_to_join`, --force); one with an ops record is known."""
    keys.check_token(node_id, "node id")
    inv = await _inventory(bus, node_id)
    if inv is not None or yet_to_join or await bus.get_raw(keys.ops(node_id)) is not None:
        return await read_ops(bus, node_id), inv
    reported = await bus.list(keys.pattern(keys.NODES), lambda data: data)
    known = sorted(key.split(".", 1)[1] for key in reported)
    how = (
        f"`llmgw node {verb} {node_id} --force`"
        if verb != "drain"
        else f"`llmgw node cordon {node_id} --force` (a node yet to join has nothing to drain)"
    )
    raise UnknownNode(
        f"no node {node_id!r} has reported to this bucket, so nothing was written; "
        f"{did_you_mean(node_id, known, 'nodes')}. For a node yet to join, {how}"
    )


def resolve_gpu(inv: records.NodeInventory | None, node_id: str, given: str) -> str:
    """A GPU given by its NVML index or UUID, as the UUID placement gives engines."""
    devices = inv.gpus.devices if inv is not None else []
    found = next(
        (g for g in devices if given == g.uuid or (given.isdigit() and int(given) == g.index)),
        None,
    )
    if found is not None:
        return found.uuid
    if inv is None and not given.isdigit():
        return given  # a UUID of a node not reporting now: taken as given
    listed = ", ".join(f"{g.index} ({g.uuid})" for g in devices) or "none reported"
    raise NodeOpsError(
        f"node {node_id} has no GPU {given!r} (its GPUs: {listed}); give an index or a UUID "
        "from `llmgw status`"
    )


def _say(ops: records.NodeOps, inv: records.NodeInventory | None) -> str:
    parts = []
    if ops.drain:
        parts.append("draining" + (" (--force)" if ops.force else ""))
    elif ops.cordoned:
        parts.append("cordoned")
    if ops.gpus_out:
        parts.append(f"GPUs out of service: {', '.join(ops.gpus_out)}")
    if ops.taints:
        parts.append(f"taints: {', '.join(ops.taints)}")
    state = "; ".join(parts) or "in service"
    missing = "" if inv is not None else " (no inventory: its agent has not reported)"
    return f"ops.{ops.node}: {state}{missing}"


def _reason_option(fn):
    return click.option("--reason", default=None, help="why, for `llmgw status`")(fn)


def _force_option(fn):
    return click.option(
        "--force",
        "yet_to_join",
        is_flag=True,
        help="NODE has not joined yet: write its ops record anyway (without it, a node no "
        "inventory names is refused as a typo)",
    )(fn)


def _change(
    nats: NatsSettings,
    bucket: BucketSettings,
    node_id: str,
    change: Callable[[records.NodeOps, records.NodeInventory | None], None],
    *,
    yet_to_join: bool,
    verb: str,
) -> None:
    """Read ops.<node>, change it, write it back (or delete it), and say what it is now."""

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            ops, inv = await known_node(bus, node_id, yet_to_join=yet_to_join, verb=verb)
            change(ops, inv)
            await write_ops(bus, ops)
            click.echo(_say(ops, inv))

    anyio.run(run)


@node.command("cordon")
@click.argument("node_id", metavar="NODE")
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    help="only this GPU (NVML index or UUID; repeatable): out of service, the node stays",
)
@_reason_option
@_force_option
@nats_options
def cordon(node_id, gpus, reason, yet_to_join, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Place nothing new on NODE (its replicas stay), or take one of its GPUs out of service."""

    def change(ops: records.NodeOps, inv: records.NodeInventory | None) -> None:
        if gpus:
            out = [resolve_gpu(inv, node_id, g) for g in gpus]
            ops.gpus_out = sorted(set(ops.gpus_out) | set(out))
        else:
            if ops.state == "in-service":  # a draining node stays draining
                ops.state = "cordoned"
        ops.reason = reason if reason is not None else ops.reason

    _change(nats, bucket, node_id, change, yet_to_join=yet_to_join, verb="cordon")


@node.command("uncordon")
@click.argument("node_id", metavar="NODE")
@click.option("--gpu", "gpus", multiple=True, help="only this GPU back in service (index or UUID)")
@_force_option
@nats_options
def uncordon(node_id, gpus, yet_to_join, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Place on NODE again (ends a cordon or a drain), or bring one of its GPUs back."""

    def change(ops: records.NodeOps, inv: records.NodeInventory | None) -> None:
        if gpus:
            back = {resolve_gpu(inv, node_id, g) for g in gpus}
            ops.gpus_out = [g for g in ops.gpus_out if g not in back]
        else:
            ops.state = "in-service"
            ops.reason = ""

    _change(nats, bucket, node_id, change, yet_to_join=yet_to_join, verb="uncordon")


@node.command("taint")
@click.argument("node_id", metavar="NODE")
@click.argument("taint")
@_force_option
@nats_options
def taint(node_id, taint, yet_to_join, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Keep off NODE every profile that does not list TAINT in its tolerations."""
    problem = labels.key_problem(taint)
    if problem:
        raise NodeOpsError(problem.replace("label name", "taint name"))

    def change(ops: records.NodeOps, inv: records.NodeInventory | None) -> None:
        ops.taints = sorted(set(ops.taints) | {taint})

    _change(nats, bucket, node_id, change, yet_to_join=yet_to_join, verb="taint")


@node.command("untaint")
@click.argument("node_id", metavar="NODE")
@click.argument("taint")
@_force_option
@nats_options
def untaint(node_id, taint, yet_to_join, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Remove a taint the operator set (those of the agent config stay)."""

    def change(ops: records.NodeOps, inv: records.NodeInventory | None) -> None:
        ops.taints = [t for t in ops.taints if t != taint]

    _change(nats, bucket, node_id, change, yet_to_join=yet_to_join, verb="untaint")


@node.command("drain")
@click.argument("node_id", metavar="NODE")
@click.option(
    "--force",
    is_flag=True,
    help="also drain the replicas that cannot be placed elsewhere (they are then down)",
)
@click.option("--wait", is_flag=True, help="follow until no replica is left on NODE")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="seconds --wait follows for"
)
@_reason_option
@nats_options
def drain(
    node_id, force, wait, timeout, reason, nats: NatsSettings, bucket: BucketSettings
) -> None:
    """Cordon NODE and move its replicas elsewhere: each new one ready before the old drains."""

    async def run() -> int:
        async with open_bus(nats, bucket) as bus:
            ops, inv = await known_node(bus, node_id, yet_to_join=False, verb="drain")
            ops.state = "draining-by-force" if force else "draining"
            ops.reason = reason if reason is not None else ops.reason
            await write_ops(bus, ops)
            click.echo(_say(ops, inv))
            if not wait:
                await _say_what_moves(bus, node_id, force)
                return 0
            return await follow_drain(bus, node_id, force=force, timeout=timeout, echo=click.echo)

    raise SystemExit(anyio.run(run))


async def _say_what_moves(bus: Bus, node_id: str, force: bool) -> None:
    """Without --wait: the replicas on the node now, and what happens to those that have
    nowhere else to go."""
    here = sorted(
        (
            r
            for r in await PollReader(bus).list(keys.pattern(keys.REPLICAS), records.Replica)
            if any(m.node == node_id for m in r.members) and r.phase not in records.REPLICA_GOING
        ),
        key=lambda r: (r.model, r.rid),
    )
    for r in here:
        click.echo(f"  {r.model} {r.rid} on {node_id}: to be replaced elsewhere, then drained")
    if not here:
        click.echo(f"  no replica on {node_id}")
    elif force:
        click.echo(
            "  one that no other node can take is drained anyway (--force) and is then down: "
            f"`llmgw status` names it 'drained by force', `llmgw node drain {node_id} --wait` "
            "follows"
        )
    else:
        click.echo(
            "  one that no other node can take stays where it is: `llmgw node drain "
            f"{node_id} --wait` follows and names it"
        )


async def follow_drain(
    bus: Bus,
    node_id: str,
    *,
    force: bool = False,
    timeout: float,
    echo: Callable[[str], None],
    poll: float = 0.2,
    settle: float = 3.0,
) -> int:
    """Follow the replicas on `node_id` until none is left (0); 1 when the ones left have
    nowhere else to go (without --force: with it they drain too), naming them; 2 when the
    time is up."""
    reader = PollReader(bus)
    shown: dict[str, str] = {}
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        here = [
            r
            for r in await reader.list(keys.pattern(keys.REPLICAS), records.Replica)
            if any(m.node == node_id for m in r.members)
        ]
        for r in sorted(here, key=lambda r: (r.model, r.rid)):
            line = f"  {r.model} {r.rid} on {node_id}: {r.phase}" + (
                f" ({r.reason})" if r.phase in records.REPLICA_GOING and r.reason else ""
            )
            if shown.get(r.rid) != line:
                shown[r.rid] = line
                echo(line)
        if not here:
            echo(f"  no replica left on {node_id}")
            return 0
        staying = [r for r in here if r.phase not in records.REPLICA_GOING]
        if staying and not force and time.monotonic() - started >= settle:
            stuck = []
            for r in staying:
                p = await reader.get(keys.placement(r.model), records.PlacementRecord)
                if p is not None and p.waiting and p.explanation:
                    stuck.append(f"  {r.model} {r.rid} cannot be placed elsewhere: {p.explanation}")
            if stuck and len(stuck) == len(staying):
                for line in stuck:
                    echo(line)
                echo(
                    f"  `llmgw node drain {node_id} --force` drains them anyway (they are then "
                    "down until a node can take them)"
                )
                return 1
        await anyio.sleep(poll)
    echo(f"  replicas still on {node_id} after {timeout:g} s")
    return 2
