"""What a plan is given: the view of the bucket, its nodes judged, as one placement Snapshot.

One function for the reconcile loop and for `llmgw place --dry-run`, so the two differ
only where the dry run cannot know what the controller knows: the port range it was
started with, and how each lease moved while it watched. The dry run judges nodes as a
controller does at the moment it takes the lead (`phases_at_takeover`) and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from llmgw.bus.records import (
    PORT_IN_USE,
    REPLICA_GOING,
    Desired,
    NodePhase,
    Replica,
    Shard,
    phase_from_shards,
)
from llmgw.catalog import Adapter
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
    shards: Mapping[tuple[str, str], Shard] | None = None,
) -> placement.Snapshot:
    """The plan's input. A frozen model is left out of what is asked for and named in
    `frozen`, so the plan places and removes nothing of it; its replicas stay in (they hold
    GPUs and ports). `now` is wall time:
    what the plan stamps on what it decides. Replicas carry the phase their shards say now
    (the stored one is the previous pass's summary), so that a replica that failed reads
    failed in this decision's lines, not ready. `memo` (the controller's) keeps the fabric
    view while no inventory changes. `shards`: the view's, as the controller reads them (a
    launch its agent stopped trying is read as given up: StoppedTrying)."""
    nodes = view.nodes
    shards = view.shards if shards is None else shards
    memo = memo if memo is not None else placement.InventoryMemo()
    fabrics = memo.of_fleet("fabrics", nodes, lambda: fabric_view(nodes.values()))
    return placement.Snapshot(
        catalog={m: entry for m, entry in view.catalog.items() if m not in frozen},
        desired={m: asked(view, d) for m, d in view.desired.items() if m not in frozen},
        inventories=view.nodes,
        health=phases,
        replicas=[current_phase(r, shards) for r in view.replicas.values()],
        fabrics=fabrics,
        leases=view.leases,
        port_range=port_range,
        now=now,
        shards=shards,
        ops=view.ops,
        rollouts=view.rollouts,
        placements=view.placements,
        failures=failures or placement.FailurePolicy(),
        adapters=adapters_by_base(view),
        frozen={
            m: placement.Frozen(
                f.blocked,
                f.detail,
                view.desired[m].replicas if m in view.desired else None,
            )
            for m, f in frozen.items()
        },
    )


def adapters_by_base(view: View) -> dict[str, list[Adapter]]:
    """Each base model's LoRA adapters, by id."""
    out: dict[str, list[Adapter]] = {}
    for aid in sorted(view.adapters):
        adapter = view.adapters[aid]
        out.setdefault(adapter.base, []).append(adapter)
    return out


def asked(view: View, desired: Desired) -> Desired:
    """What placement is asked for: `desired.<model>`, whose count, for a model `llmgw place
    --auto` switched to the autoscaler, is the leader's `scale.<model>` (until the leader
    has written one, the last fixed count)."""
    scale = view.scales.get(desired.model)
    if not desired.auto or scale is None:
        return desired
    return msgspec.structs.replace(desired, replicas=scale.replicas)


def current_phase(replica: Replica, shards: Mapping[tuple[str, str], Shard]) -> Replica:
    """The replica with the phase its shards give it now (one going away stays so)."""
    if replica.phase in REPLICA_GOING:
        return replica
    members = [shards.get((m.node, replica.rid)) for m in replica.members]
    phase, endpoint = phase_from_shards(replica, members)
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


def stopped_trying(shard: Shard) -> bool:
    """A failed launch its agent does not try again by itself: refused before launch for a
    reason that stays (the agent waits for a new assignment), as opposed to an engine it
    restarts (restarts counted), one it gave up on (gave_up) and a port taken (the
    controller moves the port). Read so only once it has stood still a while
    (StoppedTrying): an error the agent retries reports another phase in between."""
    return (
        shard.phase == "failed"
        and not shard.gave_up
        and shard.restarts == 0
        and shard.pid is None
        and shard.refused != PORT_IN_USE
    )


class StoppedTrying:
    """Launches whose agent stopped trying, read as given up once they stood still for
    `after` seconds of the controller's clock: a replica its agent refuses before launch is
    a failed start like any other (it moves, or waits, explained), not failed for good."""

    def __init__(self, after: float) -> None:
        self.after = after
        self._since: dict[tuple[str, str], tuple[tuple[int, float], float]] = {}

    def shards(
        self, shards: Mapping[tuple[str, str], Shard], now: float
    ) -> Mapping[tuple[str, str], Shard]:
        """`shards`, with those that stopped trying `after` seconds ago marked gave_up."""
        seen: dict[tuple[str, str], tuple[tuple[int, float], float]] = {}
        given_up: dict[tuple[str, str], Shard] = {}
        for k, s in shards.items():
            if not stopped_trying(s):
                continue
            mark = (s.generation, s.since)
            before = self._since.get(k)
            first = before[1] if before is not None and before[0] == mark else now
            seen[k] = (mark, first)
            if now - first >= self.after:
                given_up[k] = msgspec.structs.replace(s, gave_up=True)
        self._since = seen
        if not given_up:
            return shards
        return {**shards, **given_up}
