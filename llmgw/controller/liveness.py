"""Node liveness from lease movement, measured on the controller's own clock.

Pure: the reconcile loop feeds what it saw (`observe(node, seq, now)`) with `now` from
its monotonic clock, and asks for phases. A lease that stops moving makes its node
unreachable (no new placements, its replicas stay) and later lost (its replicas are
placed elsewhere).

The agent's clock is never used: nodes' clocks drift, and a lease's wall time says
nothing about when this controller last saw it change. A node first seen by this
controller process counts from that moment, so a controller restart gives the whole
fleet a fresh grace period instead of declaring it lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.bus.records import NodePhase

HEARTBEAT_S = 5.0
UNREACHABLE_AFTER_S = 3 * HEARTBEAT_S  # three missed heartbeats
LOST_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class Transition:
    """A node's phase changed (`previous` None: first seen by this controller)."""

    node: str
    previous: NodePhase | None
    phase: NodePhase
    reason: str
    seq: int
    at: float  # the controller's clock


@dataclass(slots=True)
class _Seen:
    seq: int
    moved_at: float  # when this controller saw seq change, or first saw the node


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
        self._reported: dict[str, NodePhase] = {}

    def observe(self, node: str, seq: int, now: float) -> None:
        """Record the lease sequence seen for `node` at `now`. Any change counts as
        movement: a sequence that goes backwards is an agent that restarted."""
        seen = self._seen.get(node)
        if seen is None or seen.seq != seq:
            self._seen[node] = _Seen(seq, now)

    def restart_grace(self, now: float) -> None:
        """Every node counts as having moved `now`: after this controller was cut off (it saw
        nothing, which says nothing about the nodes), as after a restart."""
        for seen in self._seen.values():
            seen.moved_at = now

    def forget(self, node: str) -> None:
        """The node's lease was deleted (node decommissioned): stop tracking it."""
        self._seen.pop(node, None)
        self._reported.pop(node, None)

    def phase(self, node: str, now: float) -> NodePhase | None:
        seen = self._seen.get(node)
        if seen is None:
            return None
        still = now - seen.moved_at
        if still >= self.lost_after:
            return "lost"
        if still >= self.unreachable_after:
            return "unreachable"
        return "ready"

    def phases(self, now: float) -> dict[str, NodePhase]:
        return {node: self.phase(node, now) for node in sorted(self._seen)}  # type: ignore[misc]

    def reason(self, node: str, now: float) -> str:
        seen = self._seen.get(node)
        if seen is None:
            return "no lease seen by this controller"
        still = now - seen.moved_at
        phase = self.phase(node, now)
        if phase == "ready":
            return f"lease seq {seen.seq} moved {still:.0f} s ago"
        limit = self.lost_after if phase == "lost" else self.unreachable_after
        return f"lease seq {seen.seq} has not moved for {still:.0f} s ({phase} after {limit:g} s)"

    def transitions(self, now: float) -> list[Transition]:
        """Phases that changed since the previous call (every node on the first call),
        in node order; the loop writes `health.<node>` and publishes an event for each."""
        out: list[Transition] = []
        for node, phase in self.phases(now).items():
            previous = self._reported.get(node)
            if previous == phase:
                continue
            self._reported[node] = phase
            out.append(
                Transition(node, previous, phase, self.reason(node, now), self._seen[node].seq, now)
            )
        return out
