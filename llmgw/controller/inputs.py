"""What a plan is given: the view of the bucket, its nodes judged, as one placement Snapshot.

One function for the reconcile loop and for `llmgw place --dry-run`, so the two differ
only where the dry run cannot know what the controller knows: the port range it was
started with, and how each lease moved while it watched. The dry run judges nodes as a
controller does at the moment it takes the lead (`phases_at_takeover`) and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from llmgw.bus.records import REPLICA_GOING, Desired, NodePhase, Replica, phase_from_shards
from llmgw.controller import placement
from llmgw.controller.fabrics import fabric_view
from llmgw.controller.liveness import LivenessTracker, node_phases
from llmgw.controller.view import Freeze, View


def placement_snapshot(
    view: View,
    phases: Mapping[str, NodePhase],
    frozen: Mapping[str, Freeze],
    *,
    port_range: tuple[int, int],
    now: float,
    failures: placement.FailurePolicy | None = None,
    memo: placement.InventoryMemo | None = None,
) -> placement.Snapshot:
    """The plan's input. A frozen model is left out of what is asked for and named in
    `frozen`, so the plan places and removes nothing of it; its replicas stay in (they hold
    GPUs and ports). `now` is wall time:
    what the plan stamps on what it decides. Replicas carry the phase their shards say now
    (the stored one is the previous pass's summary), so that a replica that failed reads
    failed in this decision's lines, not ready. `memo` (the controller's) keeps the fabric
    view while no inventory changes."""
    nodes = view.nodes
    memo = memo if memo is not None else placement.InventoryMemo()
    fabrics = memo.of_fleet("fabrics", nodes, lambda: fabric_view(nodes.values()))
    return placement.Snapshot(
        catalog={m: entry for m, entry in view.catalog.items() if m not in frozen},
        desired={m: asked(view, d) for m, d in view.desired.items() if m not in frozen},
        inventories=view.nodes,
        health=phases,
        replicas=[current_phase(r, view) for r in view.replicas.values()],
        fabrics=fabrics,
        leases=view.leases,
        port_range=port_range,
        now=now,
        shards=view.shards,
        ops=view.ops,
        rollouts=view.rollouts,
        placements=view.placements,
        failures=failures or placement.FailurePolicy(),
        frozen={
            m: placement.Frozen(
                f.blocked,
                f.detail,
                view.desired[m].replicas if m in view.desired else None,
            )
            for m, f in frozen.items()
        },
    )


def asked(view: View, desired: Desired) -> Desired:
    """What placement is asked for: `desired.<model>`, whose count, for a model `llmgw place
    --auto` switched to the autoscaler, is the leader's `scale.<model>` (until the leader
    has written one, the last fixed count)."""
    scale = view.scales.get(desired.model)
    if not desired.auto or scale is None:
        return desired
    return msgspec.structs.replace(desired, replicas=scale.replicas)


def current_phase(replica: Replica, view: View) -> Replica:
    """The replica with the phase its shards give it now (one going away stays so)."""
    if replica.phase in REPLICA_GOING:
        return replica
    shards = [view.shards.get((m.node, replica.rid)) for m in replica.members]
    phase, endpoint = phase_from_shards(replica, shards)
    if (phase, endpoint) == (replica.phase, replica.endpoint):
        return replica
    return msgspec.structs.replace(replica, phase=phase, endpoint=endpoint)


def hold_recorded_phases(view: View, tracker: LivenessTracker) -> None:
    """Nodes recorded unreachable or lost (by a previous leader) stay at least so until
    their lease moves: a controller that starts, or takes the lead, gives every node a
    fresh grace period, so it never declares the fleet lost; but the grace period must
    never place replicas on a node that was already dead."""
    for node, h in view.health.items():
        lease = view.leases.get(node)
        tracker.hold(node, h.phase, lease.seq if lease else None)


def phases_at_takeover(view: View) -> dict[str, NodePhase]:
    """Every node's phase as a controller judges it at the moment it takes the lead, when
    it has seen no lease move yet: recorded unreachable or lost, it stays so; otherwise
    ready while it has a lease, unreachable without one."""
    tracker = LivenessTracker()
    for node, lease in view.leases.items():
        tracker.observe(node, lease.seq, 0.0)
    hold_recorded_phases(view, tracker)
    return node_phases(view.nodes, tracker, 0.0)
