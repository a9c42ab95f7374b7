"""`llmgw status`: the fleet's read model (llmgw/fleetstate), as text or JSON.

Read from the bucket in one pass through the one decoder layer, so a value that does not
read is taken as every reader takes it (its last good value, a cordon, a frozen model) and
said. `--json` is the read model encoded (`llmgw.fleetstate.model.Fleet`): a script asks
`.models["m"].ready` and `.models["m"].why_not`. The text renders it, models first. The
per-fabric weights view is computed from the node inventories with the controller's pure
function, so it is current even when no controller has published `fabrics.<fabric>` yet.
"""

from __future__ import annotations

import time
from collections import Counter

import anyio
import click
import msgspec

from llmgw.allotment import margin
from llmgw.bus import records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.place import rollout_line
from llmgw.controller.fabrics import fabric_view, render_fabrics
from llmgw.fleetstate import build
from llmgw.fleetstate.decode import FleetRecords
from llmgw.fleetstate.model import (
    Allocation,
    Fleet,
    GpuState,
    ModelState,
    NodeState,
    Ops,
    ShardState,
)

GB = 1_000_000_000  # one unit for sizes everywhere a person reads them (docs/bucket.md)


async def gather(bus: Bus, now: float | None = None) -> Fleet:
    """The read model of the bucket as it is now."""
    # said once per Bus, however often it reads; keys and teams too, for what does not read
    r = FleetRecords(skipped=bus.skipped, gateway=True)
    for key, entry in (await bus.list(">", lambda data: data)).items():
        r.apply(key, entry.value, entry.revision)
    return build.fleet(
        r,
        time.time() if now is None else now,
        bucket=bus.bucket.name,
        fabrics=fabric_view(r.nodes.values()),
    )


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GB:.1f}"


def _gpus(n: NodeState) -> str:
    if not n.gpus:
        return {
            "no_library": "none (no NVML)",
            "no_driver": "none (no driver)",
            "disabled": "off (config)",
        }.get(n.gpu_status, f"none ({n.gpu_status}: {n.gpu_detail})")
    names = Counter(g.name for g in n.gpus)
    text = ", ".join(f"{k}x {name}" for name, k in names.items())
    text += f", {n.gpus_free} free"
    shared = sum(1 for g in n.gpus if g.shared)
    if shared:
        text += f", {shared} shared"
    return text + ("" if n.gpu_status == "ok" else f" ({n.gpu_status}: {n.gpu_detail})")


def gpu_line(g: GpuState) -> str:
    """ "GPU 0: in use 0.6 of 80.0 GB (llmgw 0.0, others 0.0, unaccounted 0.6)": the parts
    add up to the whole."""
    return f"{_gpu_name(g)}: {_gpu_use(g)}"


def gpu_lines(gpus: list[GpuState]) -> list[str]:
    """One line per run of GPUs that read alike ("GPU 0-7: ..."): eight idle GPUs are one
    line, not eight. A shared GPU or a MIG device is a line of its own, and a shared one is
    followed by a line per replica on it ("  m r1: 20.0 GB allotted, holds 18.2")."""
    runs: list[tuple[int, int, str]] = []
    lines: list[str] = []

    def flush() -> None:
        lines.extend(
            f"GPU {lo}: {use}" if lo == hi else f"GPU {lo}-{hi}: {use} each" for lo, hi, use in runs
        )
        runs.clear()

    for g in gpus:
        if g.shared or g.mig_profile:
            flush()
            lines.append(gpu_line(g))
            lines.extend(f"  {_share_line(a)}" for a in g.shared)
            continue
        use = _gpu_use(g)
        if runs and runs[-1][2] == use and runs[-1][1] == g.index - 1:
            runs[-1] = (runs[-1][0], g.index, use)
        else:
            runs.append((g.index, g.index, use))
    flush()
    return lines


def _gpu_name(g: GpuState) -> str:
    """ "GPU 0", or a MIG device: "MIG 1g.18gb of GPU 0 (parent GPU-..., 1 slice)" """
    if not g.mig_profile:
        return f"GPU {g.index}"
    slices = f", {g.mig_slices} slice{'s' if g.mig_slices != 1 else ''}" if g.mig_slices else ""
    return f"MIG {g.mig_profile} of GPU {g.index} (parent {g.parent_uuid or '?'}{slices})"


def _gpu_use(g: GpuState) -> str:
    if g.used_bytes is None:
        use = f"in use: not reported, {_gb(g.total_bytes)} GB total"
    else:
        use = (
            f"in use {_gb(g.used_bytes)} of {_gb(g.total_bytes)} GB (llmgw {_gb(g.own_bytes)}, "
            f"others {_gb(g.foreign_bytes)}, unaccounted {_gb(g.unaccounted_bytes)})"
        )
    if g.shared:
        use += (
            f"; shared by {len(g.shared)} replica{'s' if len(g.shared) != 1 else ''}, "
            f"{_gb(g.allotted_bytes)} GB allotted, "
        )
        use += "left " + _left(g.left_bytes)
    if g.out_of_service:
        use += "; out of service"
    elif g.allocated is not None:
        use += f"; allocated to {g.allocated.model} {g.allocated.replica}"
    return use


def _left(left: int | None) -> str:
    """What one more shared replica could be given (llmgw.allotment.room)."""
    if left is None:  # out of service: said after it
        return "none"
    if left < 0:
        return f"none ({_gb(-left)} GB over: others grew, or an engine outgrew its allotment)"
    return f"{_gb(left)} GB"


def _share_line(a: Allocation) -> str:
    """ "m r1: 20.0 GB allotted, holds 18.2" and, over it by more than the margin, so named"""
    line = f"{a.model} {a.replica}: {_gb(a.bytes)} GB allotted"
    if a.used_bytes is not None:
        line += f", holds {_gb(a.used_bytes)}"
    if a.outgrown:
        line += (
            f"; OUTGROWN its allotment by more than the margin ({_gb(margin(a.bytes))} GB); "
            "not stopped"
        )
    return line


def _outgrown(s: ShardState) -> str:
    return (
        f"engine outgrew its GPU allotment: holds {_gb(s.gpu_used_bytes)} GB, given "
        f"{_gb(s.gpu_allotted_bytes)} GB (margin {_gb(margin(s.gpu_allotted_bytes))} GB); "
        "not stopped"
    )


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


# after "ready", the phases worth a count, in the order a replica goes through them
_PHASES = tuple(p for p in records.REPLICA_PHASES if p != "ready")


def _replica_counts(m: ModelState) -> str:
    """ "1/1 ready, 1 draining": a draining replica is going away, not one too many; one the
    controller last saw ready that does not serve now is counted apart."""
    phases = Counter(r.phase for r in m.replicas)
    cut_off = sum(1 for r in m.replicas if r.phase == "ready" and not r.serving)
    return (
        f"{m.ready}/{m.desired} ready"
        + (f", {cut_off} ready but not serving" if cut_off else "")
        + "".join(f", {phases[p]} {p}" for p in _PHASES if phases[p])
    )


UNREADABLE_SHOWN = 20  # keys that do not read, said one a line; --json lists them all
TAIL_SHOWN = 3  # engine output lines shown per failed shard; --json has them all


def _labels(labels: dict[str, list[str]]) -> str:
    return ", ".join(f"{k}={'|'.join(v)}" for k, v in labels.items()) or "none"


def _ops(o: Ops, n: NodeState) -> str:
    parts = []
    if o.state == "draining-by-force":
        parts.append("draining (--force)")
    elif o.state in ("draining", "cordoned"):
        parts.append(o.state)
    if o.gpus_out:
        index = {g.uuid: g.index for g in n.gpus}
        gpus = ", ".join(f"{u} (index {index[u]})" if u in index else u for u in o.gpus_out)
        parts.append(f"GPUs out of service: {gpus}")
    text = "; ".join(parts) or "in service"
    if o.unreadable:
        return text + f" (read so: ops.{n.id} does not read, see above)"
    return text + (f" ({o.reason})" if o.reason else "")


def load_line(e: records.EngineLoad) -> str:
    """ "2 running, 1 waiting, KV cache 12%, prefix cache hits 45%": what the engine's own
    /metrics said (a part it does not report is left out)."""
    parts = []
    if e.running is not None:
        parts.append(f"{e.running} running")
    if e.waiting is not None:
        parts.append(f"{e.waiting} waiting")
    if e.kv_cache is not None:
        parts.append(f"KV cache {e.kv_cache:.0%}")
    if e.prefix_hits is not None:
        parts.append(f"prefix cache hits {e.prefix_hits:.0%}")
    return ", ".join(parts) or "no load reported"


def _model_lines(m: ModelState, now: float) -> list[str]:
    if not m.desired and not m.replicas and m.placement is None and not m.unreadable:
        return [f"  {m.id}: none asked for (`llmgw place {m.id} --replicas N`)"]
    lines = [f"  {m.id}: {_replica_counts(m)}  ({m.mode})"]
    if m.serving:
        lines.append(f"    serving on {', '.join(m.serving)}")
    if m.why_not:
        lines.append(f"    why not: {m.why_not}")
    if m.autoscale is not None:
        lines.append(f"    autoscale: {_scale_line(m.autoscale)}")
    for key in m.unreadable:
        lines.append(f"    unreadable: {key} (see below)")
    ro = m.rollout
    if ro is not None and ro.phase != "complete":
        lines.append("  " + rollout_line(ro).strip().replace("\n", "\n  "))
    for r in m.replicas:
        shards = "/".join(s.phase for s in r.shards) or "-"
        ep = f"  {r.endpoint}" if r.endpoint else ""
        lines.append(f"    {r.rid}  {r.state}  on {', '.join(r.nodes)}  shards {shards}{ep}")
        if r.why:
            lines.append(f"      why: {r.why}")
        if r.load is not None:
            lines.append(f"      engine: {load_line(r.load)}")
        for s in r.shards:
            if s.phase == "validating" and s.reason:  # "waiting: ..." (an expected wait)
                lines.append(f"      {s.node}: {s.reason}")
            if s.phase != "failed":
                continue
            given_up = ", given up" if s.gave_up else ""
            lines.append(
                f"      {s.node}: {s.reason or 'no reason reported'} (restarts {s.restarts}{given_up})"
            )
            tail = [line for line in s.output_tail if line.strip()]
            lines.extend(f"        | {line}" for line in tail[-TAIL_SHOWN:])
        for s in r.shards:
            if s.gpu_outgrown:
                lines.append(f"      {s.node}: {_outgrown(s)}")
    p = m.placement
    if p is not None and p.explanation:
        label = "frozen" if p.frozen else "unplaced" if p.placed < p.desired else "note"
        lines.append(f"    {label}: {p.explanation}")
    return lines


def _node_lines(n: NodeState, now: float) -> list[str]:
    if not n.inventory:
        lines = [f"\n{n.id}  (no inventory)"]
        if n.ops is not None:
            lines.append(f"  ops     {_ops(n.ops, n)}")
        return lines
    beat = _age(now - n.heartbeat_at) if n.heartbeat_at is not None else "never"
    phase = n.phase if n.phase != "unjudged" else "(no controller)"
    lines = [
        f"\n{n.id}  {phase}  {n.address}  heartbeat {beat}",
        f"  RAM     {_gb(n.ram_available_bytes)}/{_gb(n.ram_total_bytes)} GB available",
        f"  CPU     {n.cpu_count}x {n.cpu_model}",
        f"  GPUs    {_gpus(n)}",
    ]
    lines.extend(f"          {line}" for line in gpu_lines(n.gpus))
    lines.append(
        "  engines " + (", ".join(f"{e.name} {e.version or '?'}" for e in n.engines) or "none")
    )
    lines.append(f"  IB      {', '.join(n.ib) or 'none'}")
    lines.append(f"  weights {n.weights}")
    if n.phase_reason and n.phase_since is not None:
        # written when the phase last changed: its age says how old the reason is
        lines.append(f"  health  recorded {_age(now - n.phase_since)}: {n.phase_reason}")
    if n.metrics_error:
        lines.append(f"  metrics {n.metrics_error}")
    if n.from_config:
        lines.append(f"  config  {', '.join(n.from_config)}")
    lines.append(f"  labels  {_labels(n.labels)}")
    if n.ops is not None:
        lines.append(f"  ops     {_ops(n.ops, n)}")
    if n.taints:
        lines.append(f"  taints  {', '.join(n.taints)}")
    return lines


def render(view: Fleet, now: float) -> str:
    lines = [
        f"bucket {view.bucket}: {len(view.models)} model(s), "
        f"{sum(n.inventory for n in view.nodes.values())} node(s)"
    ]
    if view.models:
        lines.append("\nmodels")
    for m in view.models.values():
        lines.extend(_model_lines(m, now))
    if view.unreadable:
        lines.append("\nvalues that do not read (every reader takes them the same way)")
        lines.extend(
            f"  {u.says()}; fix it with the command that writes it, or "
            f"`nats kv del {view.bucket} {u.key}`"
            for u in view.unreadable[:UNREADABLE_SHOWN]
        )
        if len(view.unreadable) > UNREADABLE_SHOWN:
            more = len(view.unreadable) - UNREADABLE_SHOWN
            lines.append(f"  and {more} more (--json lists them all)")
    lines.append("\nnodes")
    for n in view.nodes.values():
        lines.extend(_node_lines(n, now))
    fabrics = render_fabrics(view.fabrics)
    if fabrics:
        lines.append("\nweights per fabric")
        lines.extend("  " + line for line in fabrics)
    skipped = view.skipped
    if skipped.values:
        listed = skipped.keys
        lines.append(
            f"\nskipped {skipped.values} value(s) that do not decode or are not believed, "
            f"in {len(listed)}{'+' if len(listed) >= build.SKIPPED_LISTED else ''} key(s): "
            + ", ".join(listed[:5])
            + (", ..." if len(listed) > 5 else "")
            + " (`nats kv get` one to see it; --json lists more)"
        )
    return "\n".join(lines)


def _scale_line(scale: records.Scale) -> str:
    """ "3 -> 5: 14 in flight over 3 replicas, target 2, for 30 s; now 14 in flight, 0 waiting" """
    line = (
        f"{scale.reason}; now {scale.in_flight} in flight, "
        f"{scale.waiting} waiting over {scale.routers} router(s)"
    )
    if scale.load_s:
        line += f"; last load {scale.load_s:.1f} s"
    if scale.limited:
        line += f"; held back by {scale.limited}"
    return line


@click.command()
@nats_options
@json_option
def status(nats: NatsSettings, bucket: BucketSettings, as_json: bool) -> None:
    """What the fleet runs and has: models first (desired, ready, where, why not), then
    nodes, their hardware, engines, weights and heartbeats."""

    async def run() -> Fleet:
        async with open_bus(nats, bucket) as bus:
            return await gather(bus)

    view = anyio.run(run)
    if as_json:
        click.echo(msgspec.json.format(msgspec.json.encode(view), indent=2))
    else:
        click.echo(render(view, now=time.time()))
