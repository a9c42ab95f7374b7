"""What a plan is given: the view of the bucket, its nodes judged, as one placement Snapshot.

One function for the reconcile loop and for `llmgw place --dry-run`, so the two differ
only where the dry run cannot know what the controller knows: the port range it was
started with, and how each lease moved while it watched. The dry run judges nodes as a
controller does at the moment it takes the lead (`phases_at_takeover`) and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.bus.records import NodePhase
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
) -> placement.Snapshot:
    """The plan's input. A frozen model is left out of what is asked for, so nothing is
    placed for it; its replicas stay in (they hold GPUs and ports). `now` is wall time:
    what the plan stamps on what it decides."""
    return placement.Snapshot(
        catalog={m: entry for m, entry in view.catalog.items() if m not in frozen},
        desired={m: d for m, d in view.desired.items() if m not in frozen},
        inventories=view.nodes,
        health=phases,
        replicas=list(view.replicas.values()),
        fabrics=fabric_view(view.nodes.values()),
        leases=view.leases,
        port_range=port_range,
        shards=view.shards,
        now=now,
    )


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
