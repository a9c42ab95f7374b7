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
    Freezing,
    Health,
    Lease,
    NodeInventory,
    NodeOps,
    NodePhase,
    PlacementRecord,
    Replica,
    Rollout,
    Shard,
)
from llmgw.catalog import Adapter, Model

DEFAULT_PORTS = ENGINE_PORTS  # the agents report listeners on the same range by default

# A node that gave up on a replica is avoided for that model's launch for 30 minutes: long
# enough that a replica does not bounce between two bad nodes every few minutes (an agent
# gives up only after several failed starts, themselves minutes apart with its backoff), short
# enough that a node fixed without anyone saying so (a driver reloaded, a disk cleaned) is
# used again within the hour. Failing on 3 distinct nodes within that time says the profile,
# not the nodes, is the problem.
FAILURE_COOLDOWN_S = 1800.0
FAILURE_NODES = 3


@dataclass(frozen=True)
class FailurePolicy:
    cooldown: float = FAILURE_COOLDOWN_S  # seconds a node that failed a launch is avoided
    nodes: int = FAILURE_NODES  # distinct nodes failing one launch: the profile is broken


@dataclass(frozen=True, slots=True)
class Frozen:
    """A model whose replicas stay exactly as they are, nothing placed and nothing removed,
    because its intent cannot be trusted to say what is wanted: `blocked` is the record's
    reason (one of records.FREEZING), `detail` what is wrong, `desired` the last count read
    (None: none ever read)."""

    blocked: Freezing
    detail: str = ""
    desired: int | None = None


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
    now: float = 0.0  # created_at / decided_at of what this plan produces
    # (node, rid) -> the agents' shards: why a replica failed, whether its agent gave up, a
    # launch refused because its port was taken (the port move)
    shards: Mapping[tuple[str, str], Shard] = field(default_factory=dict)
    # node -> the operator's intent (cordon, drain, GPUs out of service, taints)
    ops: Mapping[str, NodeOps] = field(default_factory=dict)
    # what this plan wrote before, as stored: a stopped rollout stays stopped until its
    # revision changes; a node that failed a launch is avoided until its cool-down ends
    rollouts: Mapping[str, Rollout] = field(default_factory=dict)
    placements: Mapping[str, PlacementRecord] = field(default_factory=dict)
    failures: FailurePolicy = field(default_factory=FailurePolicy)
    # models left as they are (left out of `catalog` and `desired`): the plan says why
    frozen: Mapping[str, Frozen] = field(default_factory=dict)
    # base model id -> its LoRA adapters (what they make of its launch: catalog.launch_hash)
    adapters: Mapping[str, Sequence[Adapter]] = field(default_factory=dict)

    def phase(self, node: str) -> NodePhase | None:
        """The node's phase; None when it has none (no lease judged, or not in the fleet)."""
        value = self.health.get(node)
        return value.phase if isinstance(value, Health) else value
