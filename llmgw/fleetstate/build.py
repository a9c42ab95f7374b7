"""The read model built from the one decoder layer's tables: pure, no I/O.

`fleet(records, now)` is what `llmgw status` prints and encodes, and what the fleet page's
document is made of. Every rule a reader needs to say "is model X ready, and if not why"
is here once, or asked of the one place that holds it: which replicas serve (the router's
own rule, fleetstate/serving.py), what a model's count is (an autoscaled one's is the
autoscaler's), which blocks freeze a model.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from llmgw import allotment
from llmgw.bus import keys, records
from llmgw.fleetstate.decode import FleetRecords
from llmgw.fleetstate.model import (
    UNJUDGED,
    Allocation,
    Engine,
    Fleet,
    GpuState,
    Member,
    ModelState,
    NodeState,
    Ops,
    Placement,
    Process,
    ReplicaState,
    ShardState,
    Skipped,
)
from llmgw.fleetstate.serving import serving
from llmgw.labels import node_labels

SKIPPED_LISTED = 50  # keys of skipped values listed; the rest counted
WHY_NOT_REPLICAS = 5  # replicas named in a model's why_not; the rest counted


def fleet(
    r: FleetRecords,
    now: float,
    *,
    bucket: str = "",
    fabrics: Mapping[str, records.FabricHoldings] | None = None,
    labels: bool = True,
) -> Fleet:
    """The read model. `fabrics`: the weights per fabric when the caller computed them from
    the inventories (`llmgw status`), else the controller's `fabrics.*`. `labels` False
    leaves each node's labels out (the page shows none; they are a fifth of its build)."""
    fabrics = dict(r.fabrics if fabrics is None else fabrics)
    held = gpus_held(r)
    fabric_of = _fabric_groups(r)
    running: dict[str, list[str]] = {}
    for (node, rid), shard in sorted(r.shards.items()):
        rep = r.replicas.get(rid)
        # the rid its key names (a reader trusts the key), the model its replica names
        running.setdefault(node, []).append(
            f"{rep.model if rep else shard.model} {rid} {shard.phase}"
        )
    nodes = {
        node: node_state(
            node, r, now, held, fabric_of.get(node, ""), running.get(node, []), labels=labels
        )
        for node in sorted(set(r.nodes) | set(r.ops))
    }
    by_model: dict[str, list[records.Replica]] = {}
    for rep in sorted(r.replicas.values(), key=lambda rep: rep.rid):
        by_model.setdefault(rep.model, []).append(rep)
    # a key that does not read names no model by itself (200 garbage keys are not models)
    names = set(r.catalog) | set(r.desired) | set(r.placements) | set(by_model)
    models = {m: model_state(m, r, now, by_model.get(m, [])) for m in sorted(names)}
    return Fleet(
        bucket=bucket,
        now=now,
        models=models,
        nodes=nodes,
        fabrics={k: fabrics[k] for k in sorted(fabrics)},
        unreadable=sorted(r.unreadable.values(), key=lambda u: u.key),
        skipped=Skipped(values=r.skipped.count, keys=sorted(r.skipped.keys)[:SKIPPED_LISTED]),
    )


_MODEL_FAMILIES = frozenset(
    {keys.CATALOG, keys.DESIRED, keys.PLACEMENT, keys.ROLLOUT, keys.SCALE, keys.REPLICAS}
)


# --- nodes -----------------------------------------------------------------------------------


def gpus_held(r: FleetRecords) -> dict[tuple[str, str], list[Allocation]]:
    """(node, GPU uuid) -> what llmgw gave it to: the replica holding it, and the bytes its
    profile asked per GPU (the whole GPU when it asked none; llmgw gives engines whole GPUs),
    or the shared replicas on it (share_gpus), each with its allotment and what its engine
    holds there (its shard record)."""
    out: dict[tuple[str, str], list[Allocation]] = {}
    for rep in sorted(r.replicas.values(), key=lambda rep: rep.rid):
        if rep.phase not in records.REPLICA_HOLDS_GPUS_AND_PORTS:
            continue
        model = r.catalog.get(rep.model)
        profile = model.profile(rep.profile) if model else None
        asked = int(profile.gpu_memory_gb * 1e9) if profile and profile.gpu_memory_gb else 0
        for m in rep.members:
            shard = r.shards.get((m.node, rep.rid)) if m.gpu_bytes else None
            for uuid in m.gpus:
                out.setdefault((m.node, uuid), []).append(
                    Allocation(
                        model=rep.model,
                        replica=rep.rid,
                        bytes=m.gpu_bytes,
                        whole=False,
                        shared=True,
                        used_bytes=shard.gpu_used_bytes if shard else None,
                        outgrown=bool(shard and shard.gpu_outgrown),
                    )
                    if m.gpu_bytes
                    else Allocation(model=rep.model, replica=rep.rid, bytes=asked, whole=not asked)
                )
    return out


def _fabric_groups(r: FleetRecords) -> dict[str, str]:
    """node -> the fabric it is shown under: the controller's fabrics.<fabric> that lists it
    (not an island; the first name wins), else the first active fabric its inventory names."""
    out: dict[str, str] = {}
    for name, f in sorted(r.fabrics.items(), reverse=True):
        if not f.island:
            out.update(dict.fromkeys(f.nodes, name))
    for node, inv in r.nodes.items():
        if node not in out:
            out[node] = min(inv.fabrics(), default="")
    return out


def gpu_state(g: records.Gpu, allocations: list[Allocation], out_of_service: bool) -> GpuState:
    own = sum(p.used_bytes or 0 for p in g.processes if p.own)
    foreign = g.foreign_bytes()
    used = g.memory_used_bytes
    # the parts add up to the whole: what no listed process holds is shown as such
    unaccounted = max(used - own - foreign, 0) if used is not None else 0
    shared = [a for a in allocations if a.shared]
    allocated = next((a for a in allocations if not a.shared), None)
    if allocated is not None and allocated.whole:
        allocated = msgspec.structs.replace(allocated, bytes=g.memory_total_bytes)
    allotted = sum(allotment.taken(a.bytes, a.used_bytes) for a in shared)
    left = None
    if allocated is None and not out_of_service:
        left = allotment.room(g.memory_total_bytes, allotted, foreign)
    return GpuState(
        index=g.index,
        name=g.name,
        uuid=g.uuid,
        total_bytes=g.memory_total_bytes,
        used_bytes=used,
        own_bytes=own,
        foreign_bytes=foreign,
        unaccounted_bytes=unaccounted,
        processes=[
            Process(pid=p.pid, name=p.name, used_bytes=p.used_bytes, own=p.own) for p in g.processes
        ],
        allocated=allocated,
        out_of_service=out_of_service,
        shared=shared,
        allotted_bytes=allotted,
        left_bytes=left,
        mig_profile=g.mig_profile,
        parent_uuid=g.parent_uuid,
        mig_slices=g.mig_slices,
    )


def ops_state(o: records.NodeOps, unreadable: str = "") -> Ops:
    return Ops(
        state=o.state,
        cordoned=o.unschedulable,
        drain=o.drain,
        reason=o.reason,
        gpus_out=list(o.gpus_out),
        taints=list(o.taints),
        unreadable=unreadable,
    )


def node_state(
    node: str,
    r: FleetRecords,
    now: float,
    held: Mapping[tuple[str, str], list[Allocation]],
    fabric: str,
    running: list[str],
    *,
    labels: bool = True,
) -> NodeState:
    o = r.ops.get(node)
    bad_ops = r.unreadable.get(keys.ops(node))
    ops = None if o is None else ops_state(o, bad_ops.says() if bad_ops else "")
    inv = r.nodes.get(node)
    if inv is None:
        return NodeState(id=node, inventory=False, ops=ops)
    lease, health = r.leases.get(node), r.health.get(node)
    memory = lease.memory if lease else inv.memory
    out = set(o.gpus_out) if o else set()
    gpus = [gpu_state(g, held.get((node, g.uuid), []), g.uuid in out) for g in inv.gpus.devices]
    taints = [f"{t} (agent)" for t in inv.taints] + [
        f"{t} (operator)" for t in (o.taints if o else [])
    ]
    return NodeState(
        id=node,
        inventory=True,
        hostname=inv.hostname,
        address=inv.address,
        phase=health.phase if health else UNJUDGED,
        phase_since=health.since if health else None,
        phase_reason=health.reason if health else "",
        heartbeat_at=lease.time if lease else None,
        ram_total_bytes=memory.total_bytes,
        ram_available_bytes=memory.available_bytes,
        cpu_count=inv.cpu.count,
        cpu_model=inv.cpu.model,
        gpu_status=inv.gpus.status,
        gpu_detail=inv.gpus.detail,
        gpus=gpus,
        gpus_free=sum(
            1 for g in gpus if g.allocated is None and not g.shared and not g.out_of_service
        ),
        engines=[Engine(name=e.name, version=e.version) for e in inv.engines],
        ib=[_ib(a) for a in inv.ib],
        weights=_weights(inv.weights),
        from_config=list(inv.from_config),
        labels={k: sorted(v) for k, v in sorted(node_labels(inv).items())} if labels else {},
        taints=taints,
        running=running,
        ops=ops,
        metrics_error=getattr(inv, "metrics_error", None),
        fabric=fabric,
    )


def _ib(a: records.IbAdapter) -> str:
    layer = " RoCE" if any(p.link_layer == "Ethernet" for p in a.ports) else ""
    return f"{a.name}:{a.fabric or '(no fabric)'} {'up' if a.active else 'down'}{layer}"


def _weights(w: records.Weights) -> str:
    if not w.looked:
        return "not configured to look (fetch dir only)"
    return f"{len(w.models)} model(s) in {', '.join(d.path for d in w.dirs)}"


# --- models ----------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """ "20 s", "3 min", "2.0 h" """
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def replica_state(rep: records.Replica, r: FleetRecords, now: float) -> ReplicaState:
    health = {m.node: h for m in rep.members if (h := r.health.get(m.node)) is not None}
    # the router's rule, asked the same way (fleetstate/serving.py)
    verdict = serving(rep, r.shards, {node: h.phase for node, h in health.items()})
    members, notes = [], []
    for m in sorted(rep.members, key=lambda m: m.rank):
        h = health.get(m.node)
        phase = h.phase if h is not None else UNJUDGED
        since = h.since if h is not None else None
        members.append(Member(node=m.node, rank=m.rank, node_phase=phase, node_since=since))
        if h is not None and phase != "ready":  # said even where it still serves
            notes.append(
                f"node {m.node} {phase}" + (f" for {duration(now - since)}" if since else "")
            )
    if verdict.why is not None and verdict.why.why not in ("phase", "node"):
        notes.append(verdict.why.says())  # an engine restarting, not reported yet, ...
    shards = [
        ShardState(
            node=m.node,
            phase=s.phase,
            reason=s.reason,
            restarts=s.restarts,
            gave_up=s.gave_up,
            output_tail=list(s.output_tail),
            gpu_used_bytes=s.gpu_used_bytes,
            gpu_allotted_bytes=s.gpu_allotted_bytes,
            gpu_outgrown=s.gpu_outgrown,
        )
        for m in sorted(rep.members, key=lambda m: m.node)
        if (s := r.shards.get((m.node, rep.rid))) is not None
    ]
    failure = "; ".join(
        f"{s.node}: {s.reason or 'no reason reported'} (restarts {s.restarts}"
        + (", given up)" if s.gave_up else ")")
        for s in shards
        if s.phase == "failed"
    )
    return ReplicaState(
        rid=rep.rid,
        profile=rep.profile,
        phase=rep.phase,
        endpoint=rep.endpoint,
        nodes=[m.node for m in members],
        members=members,
        shards=shards,
        serving=verdict.ok,
        state=", ".join([rep.phase, *notes]),
        why=rep.reason if rep.phase in records.REPLICA_GOING else "",
        failure=failure,
        load=engine_load(rep, r),
    )


def engine_load(rep: records.Replica, r: FleetRecords) -> records.EngineLoad | None:
    """Its rank-0 engine's own load, from its node's lease (rank 0 serves the API)."""
    head = next((m.node for m in rep.members if m.rank == 0), None)
    lease = r.leases.get(head) if head is not None else None
    return next((e for e in lease.engines if e.rid == rep.rid), None) if lease else None


def desired_count(
    desired: records.Desired | None, p: records.PlacementRecord | None, scale: records.Scale | None
) -> int:
    """The count a model is asked for: the autoscaler's for an autoscaled model (until it has
    decided, the controller's last); with no desired.<model> that reads, the controller's."""
    fallback = p.desired if p else 0
    if desired is None:
        return fallback
    if desired.auto:
        return scale.replicas if scale else (p.desired if p else desired.replicas)
    return desired.replicas


def model_state(
    model: str,
    r: FleetRecords,
    now: float,
    replicas: list[records.Replica],
) -> ModelState:
    cat = r.catalog.get(model)
    desired = r.desired.get(model)
    p = r.placements.get(model)
    scale = r.scales.get(model)
    auto = desired is not None and desired.auto
    want = desired_count(desired, p, scale)
    states = [replica_state(rep, r, now) for rep in replicas]
    serves = [s for s in states if s.serving]
    unreadable = [
        u
        for u in r.unreadable.values()
        if u.family in _MODEL_FAMILIES and u.key.split(".")[1] == model
    ]
    placement = None
    if p is not None:
        placement = Placement(
            desired=p.desired,
            placed=p.placed,
            unplaced=max(p.desired - p.placed, p.waiting, 0),
            waiting=p.waiting,
            judged=p.judged,
            blocked=p.blocked,
            frozen=p.blocked in records.FREEZING,
            explanation=p.explanation,
            refused=list(p.refused),
            decided_at=p.decided_at,
        )
    return ModelState(
        id=model,
        served_name=cat.served_name if cat else "",
        in_catalog=cat is not None,
        mode="autoscaled" if auto else "fixed",
        desired=want,
        ready=len(serves),
        serving=sorted({n for s in serves for n in s.nodes}),
        why_not=""
        if len(serves) >= want
        else _why_not(model, cat is not None, want, states, placement, unreadable),
        replicas=states,
        placement=placement,
        rollout=r.rollouts.get(model),
        autoscale=scale if auto else None,
        unreadable=sorted(u.key for u in unreadable),
    )


def _why_not(model, in_catalog, want, states, placement, unreadable) -> str:
    parts = [u.says() for u in sorted(unreadable, key=lambda u: u.key)]
    if not in_catalog:
        parts.append(f"{model} is not in the catalog (`llmgw catalog apply FILE`)")
    if (
        placement is not None
        and placement.explanation
        and (placement.frozen or placement.unplaced or placement.blocked)
    ):
        parts.append(placement.explanation)
    waiting = [s for s in states if not s.serving and s.phase not in records.REPLICA_GOING]
    for s in waiting[:WHY_NOT_REPLICAS]:
        parts.append(f"{s.rid} {s.state}" + (f": {s.failure}" if s.failure else ""))
    if len(waiting) > WHY_NOT_REPLICAS:
        parts.append(f"{len(waiting) - WHY_NOT_REPLICAS} more replica(s) not serving")
    if not parts:
        parts.append(
            "no controller has decided yet"
            if placement is None
            else f"{placement.placed}/{want} placed"
        )
    return "; ".join(parts)
