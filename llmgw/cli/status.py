"""`llmgw status`: the fleet as the bucket holds it, as text or JSON.

Gathered from the bucket in one pass; the per-fabric weights view is computed from the
node inventories with the controller's pure function, so it is current even when no
controller has published `fabrics.<fabric>` yet.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import anyio
import click
import msgspec

from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.place import rollout_line
from llmgw.controller.fabrics import fabric_view, render_fabrics
from llmgw.labels import node_labels

GIB = 1 << 30
_SKIPPED_LISTED = 50
# blocked reasons that leave a model exactly as it is (controller/view.py Freeze)
_FROZEN = ("invalid-catalog", "invalid-desired", "catalog-deleted")


async def gather(bus: Bus) -> dict[str, Any]:
    nodes = await bus.list(keys.pattern(keys.NODES), decoder(records.NodeInventory))
    leases = await bus.list(keys.pattern(keys.LEASES), decoder(records.Lease))
    health = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
    replicas = await bus.list(keys.pattern(keys.REPLICAS), decoder(records.Replica))
    shards = await bus.list(keys.pattern(keys.SHARDS), decoder(records.Shard))
    placements = await bus.list(keys.pattern(keys.PLACEMENT), decoder(records.PlacementRecord))
    desired = await bus.list(keys.pattern(keys.DESIRED), decoder(records.Desired))
    ops = await bus.list(keys.pattern(keys.OPS), decoder(records.NodeOps))
    rollouts = await bus.list(keys.pattern(keys.ROLLOUT), decoder(records.Rollout))
    scales = await bus.list(keys.pattern(keys.SCALE), decoder(records.Scale))
    inventories = [e.value for e in nodes.values()]
    by_node = {
        inv.node: {
            "inventory": msgspec.to_builtins(inv),
            "lease": msgspec.to_builtins(leases[keys.lease(inv.node)].value)
            if keys.lease(inv.node) in leases
            else None,
            "health": msgspec.to_builtins(health[keys.health(inv.node)].value)
            if keys.health(inv.node) in health
            else None,
            "ops": msgspec.to_builtins(ops[keys.ops(inv.node)].value)
            if keys.ops(inv.node) in ops
            else None,
            "labels": {k: sorted(v) for k, v in sorted(node_labels(inv).items())},
        }
        for inv in inventories
    }
    return {
        "bucket": bus.bucket.name,
        "nodes": by_node,
        "fabrics": {k: msgspec.to_builtins(v) for k, v in fabric_view(inventories).items()},
        "desired": {e.value.model: msgspec.to_builtins(e.value) for e in desired.values()},
        "replicas": [msgspec.to_builtins(e.value) for e in replicas.values()],
        "shards": [msgspec.to_builtins(e.value) for e in shards.values()],
        "placement": {e.value.model: msgspec.to_builtins(e.value) for e in placements.values()},
        "rollouts": {e.value.model: msgspec.to_builtins(e.value) for e in rollouts.values()},
        "scales": {e.value.model: msgspec.to_builtins(e.value) for e in scales.values()},
        # the operator's intent about nodes that report no inventory (yet, or any more)
        "ops": {
            e.value.node: msgspec.to_builtins(e.value)
            for e in ops.values()
            if e.value.node not in by_node
        },
        # values every list above left out, not decoding or not believed (said in the log)
        "skipped": {
            "values": bus.skipped.count,
            "keys": sorted(bus.skipped.keys)[:_SKIPPED_LISTED],
        },
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.0f}"


def _gpus(g: dict[str, Any]) -> str:
    devices = g["devices"]
    if not devices:
        return {
            "no_library": "none (no NVML)",
            "no_driver": "none (no driver)",
            "disabled": "off (config)",
        }.get(g["status"], f"none ({g['status']}: {g['detail']})")
    names: dict[str, int] = {}
    for d in devices:
        names[d["name"]] = names.get(d["name"], 0) + 1
    text = ", ".join(f"{n}x {name}" for name, n in names.items())
    return text + ("" if g["status"] == "ok" else f" ({g['status']}: {g['detail']})")


def _engines(engines: list[dict[str, Any]]) -> str:
    return ", ".join(f"{e['name']} {e['version'] or '?'}" for e in engines) or "none"


def _ib(ib: list[dict[str, Any]]) -> str:
    parts = []
    for a in ib:
        state = "up" if any(p["state"].upper() == "ACTIVE" for p in a["ports"]) else "down"
        layer = " RoCE" if any(p["link_layer"] == "Ethernet" for p in a["ports"]) else ""
        parts.append(f"{a['name']}:{a['fabric'] or '(no fabric)'} {state}{layer}")
    return ", ".join(parts) or "none"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


# after "ready", the phases worth a count, in the order a replica goes through them
_PHASES = tuple(p for p in records.REPLICA_PHASES if p != "ready")


def _replica_counts(replicas: list[dict[str, Any]], want: int) -> str:
    """ "1/1 ready, 1 draining": a draining replica is going away, not one too many."""
    phases = Counter(r["phase"] for r in replicas)
    return f"{phases['ready']}/{want} ready" + "".join(
        f", {phases[p]} {p}" for p in _PHASES if phases[p]
    )


TAIL_SHOWN = 3  # engine output lines shown per failed shard; --json has them all


def _failed_shards(shards: list[dict[str, Any]]) -> list[str]:
    """A failed shard's reason and its engine's last lines: what a person needs first."""
    out = []
    for s in sorted(shards, key=lambda s: s["node"]):
        if s["phase"] != "failed":
            continue
        given_up = ", given up" if s.get("gave_up") else ""
        out.append(
            f"      {s['node']}: {s.get('reason') or 'no reason reported'} "
            f"(restarts {s.get('restarts', 0)}{given_up})"
        )
        tail = [line for line in s.get("output_tail") or [] if line.strip()]
        out.extend(f"        | {line}" for line in tail[-TAIL_SHOWN:])
    return out


def _labels(labels: dict[str, list[str]]) -> str:
    return ", ".join(f"{k}={'|'.join(v)}" for k, v in labels.items()) or "none"


def _ops(o: dict[str, Any], inv: dict[str, Any] | None) -> str:
    parts = []
    state = o.get("state", "in-service")  # records.NodeOps: the old booleans read into it
    if state in ("draining", "draining-by-force"):
        parts.append("draining" + (" (--force)" if state == "draining-by-force" else ""))
    elif state == "cordoned":
        parts.append("cordoned")
    if o.get("gpus_out"):
        index = {g["uuid"]: g["index"] for g in (inv or {}).get("gpus", {}).get("devices", [])}
        gpus = ", ".join(f"{u} (index {index[u]})" if u in index else u for u in o["gpus_out"])
        parts.append(f"GPUs out of service: {gpus}")
    text = "; ".join(parts) or "in service"
    return text + (f" ({o['reason']})" if o.get("reason") else "")


def render(view: dict[str, Any], now: float) -> str:
    lines = [f"bucket {view['bucket']}: {len(view['nodes'])} node(s)"]
    for node_id, n in sorted(view["nodes"].items()):
        inv, lease, health = n["inventory"], n["lease"], n["health"]
        mem = lease["memory"] if lease else inv["memory"]
        beat = _age(now - lease["time"]) if lease else "never"
        phase = health["phase"] if health else "(no controller)"
        lines.append(f"\n{node_id}  {phase}  {inv['address']}  heartbeat {beat}")
        lines.append(
            f"  RAM     {_gib(mem['available_bytes'])}/{_gib(mem['total_bytes'])} GiB available"
        )
        lines.append(f"  CPU     {inv['cpu']['count']}x {inv['cpu']['model']}")
        lines.append(f"  GPUs    {_gpus(inv['gpus'])}")
        lines.append(f"  engines {_engines(inv['engines'])}")
        lines.append(f"  IB      {_ib(inv['ib'])}")
        w = inv["weights"]
        if w["looked"]:
            lines.append(
                f"  weights {len(w['models'])} model(s) in {', '.join(d['path'] for d in w['dirs'])}"
            )
        else:
            lines.append("  weights not configured to look (fetch dir only)")
        if health and health.get("reason"):
            # written when the phase last changed: its age says how old the reason is
            lines.append(f"  health  recorded {_age(now - health['since'])}: {health['reason']}")
        if inv["from_config"]:
            lines.append(f"  config  {', '.join(inv['from_config'])}")
        lines.append(f"  labels  {_labels(n.get('labels') or {})}")
        taints = [f"{t} (agent)" for t in inv.get("taints", [])]
        if n.get("ops"):
            lines.append(f"  ops     {_ops(n['ops'], inv)}")
            taints += [f"{t} (operator)" for t in n["ops"]["taints"]]
        if taints:
            lines.append(f"  taints  {', '.join(taints)}")
    for node_id, o in sorted((view.get("ops") or {}).items()):
        lines.append(f"\n{node_id}  (no inventory)\n  ops     {_ops(o, None)}")
    fabrics = render_fabrics(
        {k: msgspec.convert(v, records.FabricHoldings) for k, v in view["fabrics"].items()}
    )
    if fabrics:
        lines.append("\nweights per fabric")
        lines.extend("  " + line for line in fabrics)
    models = sorted(
        set(view["desired"]) | set(view["placement"]) | {r["model"] for r in view["replicas"]}
    )
    if models:
        lines.append("\nmodels")
    for model in models:
        p = view["placement"].get(model)
        # desired.<model> may not read (the model is then frozen): the controller's count
        want = view["desired"].get(model, {}).get("replicas", p["desired"] if p else 0)
        mine = [r for r in view["replicas"] if r["model"] == model]
        auto = view["desired"].get(model, {}).get("auto", False)
        scale = (view.get("scales") or {}).get(model)
        if auto:
            want = scale["replicas"] if scale else (p["desired"] if p else want)
        mode = "autoscaled" if auto else "fixed"
        lines.append(f"  {model}: {_replica_counts(mine, want)}  ({mode})")
        if auto and scale:
            lines.append(f"    autoscale: {_scale_line(scale)}")
        ro = (view.get("rollouts") or {}).get(model)
        if ro and ro["phase"] != "complete":
            ro_struct = msgspec.convert(ro, records.Rollout)
            lines.append("  " + rollout_line(ro_struct).strip().replace("\n", "\n  "))
        for r in sorted(mine, key=lambda r: r["rid"]):
            where = ", ".join(m["node"] for m in r["members"])
            shards = [s for s in view["shards"] if s["rid"] == r["rid"]]
            shard_phases = [s["phase"] for s in shards]
            ep = f"  {r['endpoint']}" if r.get("endpoint") else ""
            lines.append(
                f"    {r['rid']}  {r['phase']}  on {where}  shards {'/'.join(shard_phases) or '-'}{ep}"
            )
            if r["phase"] in records.REPLICA_GOING and r.get("reason"):
                lines.append(f"      why: {r['reason']}")
            lines.extend(_failed_shards(shards))
        if p and p.get("explanation"):
            if p.get("blocked") in _FROZEN:
                label = "frozen"
            elif p["placed"] < p["desired"]:
                label = "unplaced"
            else:
                label = "note"
            lines.append(f"    {label}: {p['explanation']}")
    skipped = view.get("skipped") or {}
    if skipped.get("values"):
        keys_ = skipped["keys"]
        lines.append(
            f"\nskipped {skipped['values']} value(s) that do not decode or are not believed, "
            f"in {len(keys_)}{'+' if len(keys_) >= _SKIPPED_LISTED else ''} key(s): "
            + ", ".join(keys_[:5])
            + (", ..." if len(keys_) > 5 else "")
            + " (`nats kv get` one to see it; --json lists more)"
        )
    return "\n".join(lines)


def _scale_line(scale: dict[str, Any]) -> str:
    """ "3 -> 5: 14 in flight over 3 replicas, target 2, for 30 s; now 14 in flight, 0 waiting" """
    line = (
        f"{scale['reason']}; now {scale.get('in_flight', 0)} in flight, "
        f"{scale.get('waiting', 0)} waiting over {scale.get('routers', 0)} router(s)"
    )
    if scale.get("load_s"):
        line += f"; last load {scale['load_s']:.1f} s"
    if scale.get("limited"):
        line += f"; held back by {scale['limited']}"
    return line


@click.command()
@nats_options
@json_option
def status(nats: NatsSettings, bucket: BucketSettings, as_json: bool) -> None:
    """What the fleet has: nodes, their hardware, engines, weights and heartbeats."""

    async def run() -> dict[str, Any]:
        async with open_bus(nats, bucket) as bus:
            return await gather(bus)

    view = anyio.run(run)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True))
    else:
        click.echo(render(view, now=time.time()))
