"""What a plan is given: the whole desired and observed state, as one value.

The reconcile loop and `llmgw place --dry-run` build it with the same function
(controller/inputs.py); placement only reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.bus.records import (
    ENGINE_PORTS,
    Desired,
    FabricHoldings,
    Health,
    Lease,
    NodeInventory,
    NodePhase,
    Replica,
    Shard,
)
from llmgw.catalog import Model

DEFAULT_PORTS = ENGINE_PORTS  # the agents report listeners on the same range by default


@dataclass(frozen=True)
class Snapshot:
    catalog: Mapping[str, Model]
    desired: Mapping[str, Desired]
    inventories: Mapping[str, NodeInventory]
    health: Mapping[str, NodePhase | Health]  # node -> phase (from the LivenessTracker)
    replicas: Sequence[Replica] = ()
    # fabric view (controller/fabrics.py); None = derive weights holdings from inventories
    fabrics: Mapping[str, FabricHoldings] | None = None
    # latest leases: their RAM reading is fresher than the inventory's
    leases: Mapping[str, Lease] = field(default_factory=dict)
    port_range: tuple[int, int] = DEFAULT_PORTS
    # what the agents say of their shards, by (node, rid): a launch refused because its
    # port was taken moves the replica to another port (placement/ports.py)
    shards: Mapping[tuple[str, str], Shard] = field(default_factory=dict)
    now: float = 0.0  # created_at / decided_at of what this plan produces

    def phase(self, node: str) -> NodePhase | None:
        """The node's phase; None when it has none (no lease judged, or not in the fleet)."""
        value = self.health.get(node)
        return value.phase if isinstance(value, Health) else value
