"""Node liveness from lease movement, measured on the controller's own clock.

Pure: the reconcile loop feeds what it saw (`observe(node, seq, now)`) with `now` from
its monotonic clock, and asks for phases. A lease that stops moving makes its node
unreachable (no new placements, its replicas stay) and later lost (its replicas are
placed elsewhere). `health_changes` turns the phases into the `health.<node>` records to
write.

The agent's clock is never used: nodes' clocks drift, and a lease's wall time says
nothing about when this controller last saw it change. A node first seen by this
controller process counts from that moment, so a controller restart gives the whole
fleet a fresh grace period instead of declaring it lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from llmgw.bus.records import HEARTBEAT_S, Health, Lease, NodePhase

UNREACHABLE_AFTER_S = 3 * HEARTBEAT_S  # three missed heartbeats
LOST_AFTER_S = 60.0

_SEVERITY: dict[NodePhase, int] = {"ready": 0, "unreachable": 1, "lost": 2}


@dataclass(slots=True)
class _Seen:
    seq: int
    moved_at: float  # when this controller saw seq change, or first saw the node


@dataclass(frozen=True, slots=True)
class _Held:
    phase: NodePhase
    seq: int | None  # the lease's seq when held; None: no lease then


class LivenessTracker:
    """Decides ready / unreachable / lost per node from when each lease last moved."""

    def __init__(
        self, unreachable_after: float = UNREACHABLE_AFTER_S, lost_after: float = LOST_AFTER_S
    ) -> None:
        if not 0 < unreachable_after < lost_after:
            raise ValueError(
                f"liveness: need 0 < unreachable_after ({unreachable_after}) "
                f"< lost_after ({lost_after})"
            )
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self._seen: dict[str, _Seen] = {}
        self._held: dict[str, _Held] = {}

    def observe(self, node: str, seq: int, now: float) -> None:
        """Record the lease sequence seen for `node` at `now`. Any change counts as
        movement: a sequence that goes backwards is an agent that restarted."""
        seen = self._seen.get(node)
        if seen is None or seen.seq != seq:
            # to the end: `_seen` stays in the order leases last moved (`now` never goes
            # back), so the ones standing still are always at its front (`still`)
            self._seen.pop(node, None)
            self._seen[node] = _Seen(seq, now)
        held = self._held.get(node)
        if held is not None and held.seq != seq:
            del self._held[node]  # it moved: judged on its own again

    def hold(self, node: str, phase: NodePhase, seq: int | None) -> None:
        """`node` is recorded `phase` by an earlier judgement (a previous controller): it stays
        at least that bad until its lease moves from `seq`. A fresh grace period then never
        places replicas on a node that was already dead."""
        if phase != "ready":
            self._held[node] = _Held(phase, seq)

    def restart_grace(self, now: float) -> None:
        """Every node counts as having moved `now`: after this controller was cut off (it saw
        nothing, which says nothing about the nodes), as after a restart."""
        for seen in self._seen.values():
            seen.moved_at = now

    def still(self, now: float) -> list[str]:
        """Nodes whose lease has stood still for `unreachable_after` or longer, longest
        first: the front of `_seen`, however large the fleet behind it."""
        cutoff = now - self.unreachable_after
        out = []
        for node, seen in self._seen.items():
            if seen.moved_at > cutoff:
                break
            out.append(node)
        return out

    def forget(self, node: str) -> None:
        """The node's lease was deleted (node decommissioned): stop tracking it."""
        self._seen.pop(node, None)

    def phase(self, node: str, now: float) -> NodePhase | None:
        """None: no lease seen and nothing held."""
        return self.phases_of((node,), now, missing=None)[node]

    def phases(self, now: float) -> dict[str, NodePhase]:
        return self.phases_of(sorted(self._seen), now)

    def phases_of(
        self, nodes: Iterable[str], now: float, missing: NodePhase | None = "unreachable"
    ) -> dict[str, NodePhase | None]:
        """The phase of each of `nodes` (`missing` for one with no lease seen and nothing
        held), in one loop: the controller asks it for the whole fleet every tick, and a
        call or two per node was a tenth of its time at 10,000 nodes."""
        seen_of, held_of = self._seen.get, self._held.get
        unreachable_after, lost_after = self.unreachable_after, self.lost_after
        out: dict[str, NodePhase | None] = {}
        for node in nodes:
            seen = seen_of(node)
            judged: NodePhase | None
            if seen is None:
                judged = None
            else:
                still = now - seen.moved_at
                judged = (
                    "lost"
                    if still >= lost_after
                    else "unreachable"
                    if still >= unreachable_after
                    else "ready"
                )
            held = held_of(node)
            if held is not None and (judged is None or _SEVERITY[held.phase] > _SEVERITY[judged]):
                judged = held.phase
            out[node] = judged if judged is not None else missing
        return out

    def reason(self, node: str, now: float) -> str:
        phase = self.phase(node, now)
        held = self._held.get(node)
        if held is not None and held.phase == phase:
            return f"recorded {phase} before this controller started; waiting for its lease to move"
        seen = self._seen.get(node)
        if seen is None:
            return "no heartbeat seen"
        still = now - seen.moved_at
        if phase == "ready":
            return f"lease seq {seen.seq} moved {still:.0f} s ago"
        limit = self.lost_after if phase == "lost" else self.unreachable_after
        return f"lease seq {seen.seq} has not moved for {still:.0f} s ({phase} after {limit:g} s)"


def node_phases(nodes: Iterable[str], tracker: LivenessTracker, now: float) -> dict[str, NodePhase]:
    """The phase of every node with an inventory; one with no lease yet is unreachable."""
    return tracker.phases_of(nodes, now)  # type: ignore[return-value]  # never None here


@dataclass(frozen=True, slots=True)
class HealthChange:
    record: Health
    previous: NodePhase | None  # None: the node had no health record


@dataclass(frozen=True)
class HealthChanges:
    write: list[HealthChange] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)  # nodes whose inventory was removed

    @property
    def declares_silence(self) -> bool:
        """Whether any node is to be written unreachable or lost: a judgement that needs this
        controller's own link checked first."""
        return any(c.record.phase != "ready" for c in self.write)


def lease_change_matters(stored: Health | None, lease: Lease | None) -> bool:
    """Whether a change of a node's lease can change what is stored of it. A lease that
    moves keeps its node ready, so not while it is stored ready; a lease gone (deleted, or
    a value that does not read) makes any node unreachable. Thousands of leases move every
    second; only these make their node one to judge again."""
    return lease is None or stored is None or stored.phase != "ready"


def judge(
    nodes: Mapping[str, object],
    stored: Mapping[str, Health],
    leases: Mapping[str, Lease],
    tracker: LivenessTracker,
    now: float,
    wall: float,
    touched: Iterable[str] | None = None,
) -> HealthChanges:
    """The health records to write and delete for the nodes with an inventory (`nodes`).

    `touched`: the nodes whose inventory or health record changed since the last judgement
    whose changes were all written, and those whose lease changed where
    `lease_change_matters`. Only they and the nodes whose lease stands still can have a
    phase other than the stored one, so only they are judged (the controller judges every
    tick: at 10,000 nodes, the whole fleet every second was a tenth of its time). None:
    every node; needed after a grace period and after a hold (either changes phases
    without touching a node), at start, and now and then as a safety net."""
    if touched is None:
        return health_changes(node_phases(nodes, tracker, now), stored, leases, tracker, now, wall)
    candidates = set(touched).union(tracker.still(now))
    judged = sorted(n for n in candidates if n in nodes)
    gone = sorted(n for n in candidates if n not in nodes and n in stored)
    phases = node_phases(judged, tracker, now)
    return health_changes(phases, stored, leases, tracker, now, wall, gone=gone)


def health_changes(
    phases: Mapping[str, NodePhase],
    stored: Mapping[str, Health],
    leases: Mapping[str, Lease],
    tracker: LivenessTracker,
    now: float,
    wall: float,
    *,
    gone: Iterable[str] | None = None,
) -> HealthChanges:
    """The `health.<node>` records to write (phases that differ from the stored ones) and
    to delete (nodes without an inventory any more: `gone`, or when None, every stored node
    `phases` leaves out). `now` is the tracker's clock, `wall` the records' timestamp."""
    write = []
    for node, phase in phases.items():
        old = stored.get(node)
        if old is not None and old.phase == phase:
            continue
        lease = leases.get(node)
        record = Health(
            node=node,
            phase=phase,
            since=wall,
            reason=tracker.reason(node, now),
            last_seq=lease.seq if lease else 0,
        )
        write.append(HealthChange(record, old.phase if old else None))
    if gone is None:
        gone = [n for n in stored if n not in phases]
    return HealthChanges(write=write, delete=list(gone))
