"""The fleet as placement sees it: what each node has left, and taking from it.

Accounting: GPUs by UUID, ports per node and host RAM, across the replicas in the
snapshot (what each phase holds is said in bus/records.py) and those placed earlier in
the same plan: `take` gives a placed member its GPUs and port and takes them off the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.bus.records import (
    REPLICA_HOLDS_GPUS_AND_PORTS,
    REPLICA_RESERVES_HOST_RAM,
    Gpu,
    NodeInventory,
    NodePhase,
    ReplicaMember,
)
from llmgw.catalog import Profile
from llmgw.controller.placement.explain import GB
from llmgw.controller.placement.snapshot import Snapshot
from llmgw.labels import node_labels


@dataclass(slots=True)
class NodeState:
    id: str
    inventory: NodeInventory
    phase: NodePhase | None
    gpus: list[Gpu]
    used_gpus: set[str]
    free: list[Gpu]  # not used by any replica, index order; kept in step with used_gpus
    smallest_gpu: int  # bytes: when a profile needs no more, no GPU needs checking
    largest_gpu: int  # bytes: when a profile needs more, no GPU here will ever do
    engines: frozenset[str]
    ram_free: int  # bytes: available, minus what not-yet-running replicas will take
    used_ports: set[int]
    fabrics: frozenset[str]  # fabrics with an active IB port here
    models: Counter[str]  # replicas per model with a member here
    # the operator's intent and the node's taints (`with_operations`)
    unschedulable: str = ""  # "cordoned" or "draining": nothing new goes here
    taints: frozenset[str] = frozenset()  # the agent config's and the operator's
    gpus_out: frozenset[str] = frozenset()  # out of service: never given to a new replica
    _labels: Mapping[str, frozenset[str]] | None = None

    @property
    def labels(self) -> Mapping[str, frozenset[str]]:
        """Discovered and configured labels, computed when a selector first asks: most
        profiles have none, and at 10,000 nodes computing them all doubled a quiet pass."""
        if self._labels is None:
            self._labels = node_labels(self.inventory)
        return self._labels

    def free_gpus(self, min_bytes: int = 0) -> list[Gpu]:
        if min_bytes <= self.smallest_gpu:
            return self.free
        return [g for g in self.free if g.memory_total_bytes >= min_bytes]

    def free_port(self, lo: int, hi: int) -> int | None:
        port = lo
        while port in self.used_ports:
            port += 1
        return port if port <= hi else None


@dataclass(frozen=True, slots=True)
class Need:
    """One profile's demands on one node, in the units the filters compare."""

    model: str
    profile: Profile
    gpu_bytes: int
    ram_bytes: int
    ports: tuple[int, int]
    weights_key: str  # as agents report held weights
    launch: str = ""  # llmgw.catalog.launch_hash of the profile
    avoid: frozenset[str] = frozenset()  # nodes where this launch was given up on lately

    @classmethod
    def of(
        cls,
        model: str,
        profile: Profile,
        ports: tuple[int, int],
        *,
        launch: str = "",
        avoid: frozenset[str] = frozenset(),
    ) -> Need:
        return cls(
            model,
            profile,
            int(profile.gpu_memory_gb * GB),
            int(profile.host_ram_gb * GB),
            ports,
            profile.weights.held_key(),
            launch,
            avoid,
        )


def fleet_nodes(snapshot: Snapshot) -> dict[str, NodeState]:
    """Every node with an inventory, less what the snapshot's replicas hold."""
    nodes: dict[str, NodeState] = {}
    for node_id in sorted(snapshot.inventories):
        inv = snapshot.inventories[node_id]
        lease = snapshot.leases.get(node_id)
        memory = lease.memory if lease is not None else inv.memory
        gpus = sorted(inv.gpus.devices, key=lambda g: g.index)
        sizes = [g.memory_total_bytes for g in gpus]
        nodes[node_id] = NodeState(
            id=node_id,
            inventory=inv,
            phase=snapshot.phase(node_id),
            gpus=gpus,
            used_gpus=set(),
            free=gpus,
            smallest_gpu=min(sizes, default=0),
            largest_gpu=max(sizes, default=0),
            engines=frozenset(e.name for e in inv.engines),
            ram_free=memory.available_bytes,
            used_ports=set(),
            fabrics=frozenset(inv.fabrics()),
            models=Counter(),
        )
    for replica in snapshot.replicas:
        if replica.phase not in REPLICA_HOLDS_GPUS_AND_PORTS:
            continue
        model = snapshot.catalog.get(replica.model)
        profile = model.profile(replica.profile) if model else None
        reserve = profile is not None and replica.phase in REPLICA_RESERVES_HOST_RAM
        for member in replica.members:
            node = nodes.get(member.node)
            if node is None:
                continue
            node.used_gpus.update(member.gpus)
            node.used_ports.add(member.port)
            node.models[replica.model] += 1
            if reserve:
                node.ram_free -= int(profile.host_ram_gb * GB)
    for node in nodes.values():
        node.free = [g for g in node.gpus if g.uuid not in node.used_gpus]
    return with_operations(nodes, snapshot)


def with_operations(nodes: dict[str, NodeState], snapshot: Snapshot) -> dict[str, NodeState]:
    """Each node's taints, and the operator's intent (ops.<node>): cordoned or
    draining, its taints beside the agent's, and GPUs out of service, which leave the free
    list as if used (a replica already on one keeps it)."""
    for node in nodes.values():
        ops = snapshot.ops.get(node.id)
        node.taints = frozenset(node.inventory.taints) | frozenset(ops.taints if ops else ())
        if ops is None:
            continue
        node.unschedulable = "draining" if ops.drain else "cordoned" if ops.cordoned else ""
        node.gpus_out = frozenset(ops.gpus_out)
        node.free = [g for g in node.free if g.uuid not in node.gpus_out]
    return nodes


def take(node: NodeState, need: Need, rank: int) -> ReplicaMember:
    """A member of a new replica on `node`: its GPUs, port and RAM are taken off the node."""
    gpus = node.free_gpus(need.gpu_bytes)[: need.profile.gpus_per_node]
    port = node.free_port(*need.ports)
    assert port is not None  # the free_port filter passed
    node.used_gpus.update(g.uuid for g in gpus)
    node.free = [g for g in node.free if g.uuid not in node.used_gpus]
    node.used_ports.add(port)
    node.ram_free -= need.ram_bytes
    node.models[need.model] += 1
    return ReplicaMember(node=node.id, rank=rank, gpus=[g.uuid for g in gpus], port=port)
