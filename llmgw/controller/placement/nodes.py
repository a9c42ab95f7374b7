"""The fleet as placement sees it: what each node has left, and taking from it.

Accounting: GPUs by UUID, ports per node and host RAM, across the replicas in the
snapshot (what each phase holds is said in bus/records.py) and those placed earlier in
the same plan: `take` gives a placed member its GPUs and port and takes them off the node.

And the GPUs and ports as they really are, whatever llmgw assigned: a GPU whose memory
another program holds has that much less (`NodeState.held`), a GPU unschedulable takes no
new replica while the node's other GPUs still do (`NodeState.unschedulable`, fed by
`mark_unschedulable` from NVML's fault counters and from an operator's cordon of one GPU),
and a port another program listens on is used (the agent lists it, or a launch was refused
for it: `ports_refused`). What an inventory says is worked out once per inventory
(`InventoryMemo`), not at every pass.

Sharing (a profile's `share_gpus`): a shared replica is given `gpu_memory_gb` of one GPU
(its member's `gpu_bytes`). A GPU takes one more when its memory, less what llmgw allotted
there, less what other programs hold (NVML), less SHARE_HEADROOM, covers the allotment
(`NodeState.room`). A GPU is either shared or given whole: exclusive replicas never land
on a GPU a shared one holds (it is in `used_gpus`), nor shared ones on an exclusive's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

# SHARE_HEADROOM: the rule is allotment.room, named here too for the filters and pickers
from llmgw.allotment import SHARE_HEADROOM as SHARE_HEADROOM
from llmgw.allotment import room, taken
from llmgw.bus.records import (
    PORT_IN_USE,
    REPLICA_HOLDS_GPUS_AND_PORTS,
    REPLICA_RESERVES_HOST_RAM,
    Gpu,
    GpuErrors,
    GpuNamed,
    NodeInventory,
    NodePhase,
    ReplicaMember,
)
from llmgw.catalog import Profile
from llmgw.controller.placement.explain import GB
from llmgw.controller.placement.snapshot import Snapshot
from llmgw.labels import node_labels, sanitize_value

T = TypeVar("T")


def gpu_is(gpu: Gpu, model: str | None) -> bool:
    """Whether `gpu` is what a profile's gpu_model asks for: its MIG profile ("1g.18gb"),
    or its name as NVML gives it or as its gpu.model label reads it ("H100-80GB-HBM3")."""
    if model is None:
        return True
    return model in (gpu.mig_profile, gpu.name, sanitize_value(gpu.name))


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """Why one GPU takes no new replica: a constant key (GpuNamed.why: "ecc-uncorrected",
    "retired-pages-pending", "row-remap-pending", "row-remap-failed", or GPU_CORDONED: an operator's) and
    what it counts. Replicas already on it are not moved by this."""

    why: str
    count: int | None = None


# an operator's `llmgw node cordon NODE --gpu N` (ops.<node>.gpus_out)
GPU_CORDONED = "cordoned"


def nvml_fault(gpu: Gpu) -> Unschedulable | None:
    """A fault NVML reports that makes the GPU unfit until it is reset: an Xid event that
    says so (llmgw/xids.py: NVLink, fallen off the bus, GSP, ...), an uncorrected ECC
    error (the process that hit it was killed, Xid 48), memory rows or pages waiting for a
    reset to be remapped or retired, or a row remapping that failed (it needs service)."""
    e = gpu.errors
    if e.xid is not None:
        return Unschedulable("xid", e.xid)
    if e.ecc_uncorrected_volatile:
        return Unschedulable("ecc-uncorrected", e.ecc_uncorrected_volatile)
    if e.remapping_failed:
        return Unschedulable("row-remap-failed")
    if e.remapped_rows_pending:
        return Unschedulable("row-remap-pending")
    if e.retired_pages_pending:
        return Unschedulable("retired-pages-pending")
    return None


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
    # replicas per model with a member here (a dict: a Counter per node per pass was a
    # third of building a 10,000-node fleet)
    models: dict[str, int]
    # GPU UUID -> why it takes no new replica (mark_unschedulable)
    unschedulable: dict[str, Unschedulable] = field(default_factory=dict)
    # GPU UUID -> bytes of its memory processes that are not llmgw's engines hold
    held: dict[str, int] = field(default_factory=dict)
    # the operator's intent and the node's taints (`with_operations`)
    cordon: str = ""  # "cordoned" or "draining": nothing new goes here
    taints: frozenset[str] = frozenset()  # the agent config's and the operator's
    gpus_out: frozenset[str] = frozenset()  # out of service: never given to a new replica
    # GPU UUID -> bytes allotted to the shared replicas there, and how many they are (such a
    # GPU is in used_gpus too: no exclusive replica is given it)
    allotted: dict[str, int] = field(default_factory=dict)
    sharing: dict[str, int] = field(default_factory=dict)
    _labels: Mapping[str, frozenset[str]] | None = None

    @property
    def labels(self) -> Mapping[str, frozenset[str]]:
        """Discovered and configured labels, computed when a selector first asks: most
        profiles have none, and at 10,000 nodes computing them all doubled a quiet pass."""
        if self._labels is None:
            self._labels = node_labels(self.inventory)
        return self._labels

    def free_gpus(self, min_bytes: int = 0, model: str | None = None) -> list[Gpu]:
        """Not used by any replica, as large as `min_bytes`, and of `model` (gpu_is)."""
        if model is not None:
            return [g for g in self.free_gpus(min_bytes) if gpu_is(g, model)]
        if min_bytes <= self.smallest_gpu:
            return self.free
        return [g for g in self.free if g.memory_total_bytes >= min_bytes]

    def schedulable_gpus(self, min_bytes: int = 0, model: str | None = None) -> list[Gpu]:
        """`free_gpus`, less the unschedulable ones."""
        free = self.free_gpus(min_bytes, model)
        if not self.unschedulable:
            return free
        return [g for g in free if g.uuid not in self.unschedulable]

    def usable_gpus(self, min_bytes: int = 0, model: str | None = None) -> list[Gpu]:
        """`schedulable_gpus` that still have `min_bytes` once other programs' memory is
        taken off, those nobody else holds first: what a replica is given."""
        ok = self.schedulable_gpus(min_bytes, model)
        if not self.held:
            return ok
        fits = [g for g in ok if self.has_room(g, min_bytes)]
        return sorted(fits, key=lambda g: (g.uuid in self.held, g.index))

    def has_room(self, gpu: Gpu, min_bytes: int) -> bool:
        """Whether `gpu` has `min_bytes` left beside what other programs hold. A profile
        that says no size (0) gets only a GPU nobody else holds: the engine may take it all
        (vLLM takes 90% of it by default)."""
        held = self.held.get(gpu.uuid, 0)
        return not held or (min_bytes > 0 and gpu.memory_total_bytes - held >= min_bytes)

    def room(self, gpu: Gpu) -> int:
        """Bytes a shared replica could still be given on `gpu`: its memory less llmgw's
        allotments there, other programs' memory and SHARE_HEADROOM."""
        return room(
            gpu.memory_total_bytes, self.allotted.get(gpu.uuid, 0), self.held.get(gpu.uuid, 0)
        )

    def shareable_gpus(self, model: str | None = None) -> list[Gpu]:
        """GPUs a shared replica may go to, room or not: healthy, of `model`, and either
        free or shared already (not an exclusive replica's)."""
        return [
            g
            for g in self.gpus
            if (g.uuid not in self.used_gpus or g.uuid in self.allotted)
            and g.uuid not in self.unschedulable
            and gpu_is(g, model)
        ]

    def best_shared_fit(self, need: Need) -> tuple[Gpu, int] | None:
        """The GPU a shared replica of `need` goes to here, and the room it leaves there:
        a GPU shared already first, then the least room left (best fit), so that whole GPUs
        stay free for exclusive profiles and big allotments; None when none has room."""
        best: tuple[tuple[bool, int, int], Gpu, int] | None = None
        for g in self.shareable_gpus(need.profile.gpu_model):
            left = self.room(g) - need.gpu_bytes
            if left < 0:
                continue
            key = (g.uuid not in self.allotted, left, g.index)
            if best is None or key < best[0]:
                best = (key, g, left)
        return None if best is None else (best[1], best[2])

    def free_port(self, lo: int, hi: int) -> int | None:
        port = lo
        while port in self.used_ports:
            port += 1
        return port if port <= hi else None

    def free_port_after(self, port: int, lo: int, hi: int) -> int | None:
        """The first free port above `port`, going round to `lo`: a replica moved off a port
        found taken never goes back to one it was just moved off."""
        above = self.free_port(max(port + 1, lo), hi)
        return above if above is not None else self.free_port(lo, hi)


def mark_unschedulable(node: NodeState, uuid: str, why: Unschedulable) -> None:
    """The one way a GPU becomes unschedulable; the first reason given stays."""
    node.unschedulable.setdefault(uuid, why)


def held_by_others(node: str, gpu: Gpu) -> GpuNamed:
    """The GPU, and the memory processes that are not llmgw's hold on it, named for a
    person by the process holding most."""
    foreign = [p for p in gpu.processes if not p.own]  # listed first, largest first
    top = foreign[0] if foreign else None
    unlisted = gpu.processes_unlisted if len(foreign) == len(gpu.processes) else 0
    return GpuNamed(
        node=node,
        gpu=gpu.index,
        why="held",
        bytes=gpu.foreign_bytes(),
        pid=top.pid if top else None,
        process=top.name if top else "",
        others=max(len(foreign) - 1, 0) + unlisted,
        mig_profile=gpu.mig_profile,
    )


def shared_named(node: NodeState, gpu: Gpu) -> GpuNamed:
    """A GPU a shared replica found too full, named with what fills it: llmgw's allotments
    there and other programs' memory (as held_by_others names them)."""
    held = msgspec.structs.replace(
        held_by_others(node.id, gpu),
        why="shared",
        total_bytes=gpu.memory_total_bytes,
        allotted_bytes=node.allotted.get(gpu.uuid, 0),
        replicas=node.sharing.get(gpu.uuid, 0),
    )
    return held


_NO_FAULT = GpuErrors()  # what an agent that reads no counters, or a sound GPU before them, says


def _as_reported(
    gpus: Iterable[Gpu],
) -> tuple[tuple[tuple[str, Unschedulable], ...], tuple[tuple[str, int], ...]]:
    faults, held = [], []
    for g in gpus:
        if g.errors != _NO_FAULT:
            fault = nvml_fault(g)
            if fault is not None:
                faults.append((g.uuid, fault))
        if g.processes or g.unlisted_foreign_bytes:  # else nothing is held (foreign_bytes)
            foreign = g.foreign_bytes()
            if foreign > 0:
                held.append((g.uuid, foreign))
    return tuple(faults), tuple(held)


@dataclass(frozen=True, slots=True)
class _Fixed:
    """What a node's inventory alone says, the same at every pass until it changes."""

    gpus: list[Gpu]  # index order; never changed in place
    smallest_gpu: int
    largest_gpu: int
    engines: frozenset[str]
    fabrics: frozenset[str]
    faults: tuple[tuple[str, Unschedulable], ...]  # NVML's, by GPU UUID
    held: tuple[tuple[str, int], ...]  # foreign memory, by GPU UUID
    ports: tuple[int, ...]  # another program listens there

    @classmethod
    def of(cls, inv: NodeInventory) -> _Fixed:
        gpus = sorted(inv.gpus.devices, key=lambda g: g.index)
        sizes = [g.memory_total_bytes for g in gpus]
        faults, held = _as_reported(gpus)
        return cls(
            gpus=gpus,
            smallest_gpu=min(sizes, default=0),
            largest_gpu=max(sizes, default=0),
            engines=frozenset(e.name for e in inv.engines),
            fabrics=frozenset(inv.fabrics()),
            faults=faults,
            held=held,
            ports=tuple(inv.ports.ports),
        )


class InventoryMemo:
    """`fleet_nodes`' work on each inventory, kept from one pass to the next by whoever
    keeps the inventories (the controller): done again only for a node whose inventory
    changed, which is a new value. At 10,000 nodes it was most of building the fleet (the
    IB adapters' states alone, 9,000 nodes with adapters, over half)."""

    def __init__(self) -> None:
        self._by_node: dict[str, tuple[NodeInventory, _Fixed]] = {}
        # the whole fleet's: what is derived from all the inventories together (the fabric
        # view, where weights are), kept while every inventory is the very one it was
        self._fleet: dict[str, NodeInventory] = {}
        self._of_fleet: dict[str, object] = {}

    def fixed(self, node_id: str, inv: NodeInventory) -> _Fixed:
        got = self._by_node.get(node_id)
        if got is not None and got[0] is inv:
            return got[1]
        fixed = _Fixed.of(inv)
        self._by_node[node_id] = (inv, fixed)
        return fixed

    def of_fleet(
        self, what: str, inventories: Mapping[str, NodeInventory], build: Callable[[], T]
    ) -> T:
        """`build()`, or what it gave for `what` while `inventories` held these very
        values: the view replaces a record that changes and never changes one in place, so
        an identity check a node (1 ms at 10,000) stands for comparing them (the fabric
        view alone took 30 ms a pass)."""
        if len(inventories) != len(self._fleet) or any(
            self._fleet.get(node) is not inv for node, inv in inventories.items()
        ):
            self._fleet = dict(inventories)
            self._of_fleet.clear()
        if what not in self._of_fleet:
            self._of_fleet[what] = build()
        return self._of_fleet[what]  # type: ignore[return-value]

    def keep_only(self, nodes: Mapping[str, NodeInventory]) -> None:
        """Forget nodes without an inventory any more."""
        if len(self._by_node) > len(nodes):
            for gone in [n for n in self._by_node if n not in nodes]:
                del self._by_node[gone]


def ports_refused(snapshot: Snapshot) -> dict[str, set[int]]:
    """Per node, the ports of shards whose launch was refused because another program
    listens there (the agent's next probe will list them too)."""
    refused: dict[str, set[int]] = {}
    for (node, _), shard in snapshot.shards.items():
        if shard.refused == PORT_IN_USE:
            refused.setdefault(node, set()).add(shard.port)
    return refused


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


def fleet_nodes(snapshot: Snapshot, memo: InventoryMemo | None = None) -> dict[str, NodeState]:
    """Every node with an inventory, less what the snapshot's replicas hold. `memo` keeps
    what each inventory says between passes (the controller's)."""
    memo = memo if memo is not None else InventoryMemo()
    memo.keep_only(snapshot.inventories)
    nodes: dict[str, NodeState] = {}
    for node_id in sorted(snapshot.inventories):
        inv = snapshot.inventories[node_id]
        lease = snapshot.leases.get(node_id)
        memory = lease.memory if lease is not None else inv.memory
        fixed = memo.fixed(node_id, inv)
        node = nodes[node_id] = NodeState(
            id=node_id,
            inventory=inv,
            phase=snapshot.phase(node_id),
            gpus=fixed.gpus,
            used_gpus=set(),
            free=fixed.gpus,
            smallest_gpu=fixed.smallest_gpu,
            largest_gpu=fixed.largest_gpu,
            engines=fixed.engines,
            ram_free=memory.available_bytes,
            used_ports=set(fixed.ports),
            fabrics=fixed.fabrics,
            models={},
        )
        for uuid, fault in fixed.faults:  # NVML's first: the first reason given stays
            mark_unschedulable(node, uuid, fault)
        node.held.update(fixed.held)
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
            if member.gpu_bytes:  # a shared replica: its allotment, from its own record,
                # or what its engine holds when it outgrew that (its agent says, shard record)
                shard = snapshot.shards.get((member.node, replica.rid))
                grown = shard.gpu_used_bytes if shard is not None else None
                share = taken(member.gpu_bytes, grown)
                for uuid in member.gpus:
                    node.allotted[uuid] = node.allotted.get(uuid, 0) + share
                    node.sharing[uuid] = node.sharing.get(uuid, 0) + 1
            node.used_ports.add(member.port)
            node.models[replica.model] = node.models.get(replica.model, 0) + 1
            if reserve:
                node.ram_free -= int(profile.host_ram_gb * GB)
    for node in nodes.values():
        if node.used_gpus:
            node.free = [g for g in node.gpus if g.uuid not in node.used_gpus]
    for node_id, ports in ports_refused(snapshot).items():
        if node_id in nodes:
            nodes[node_id].used_ports.update(ports)
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
        node.cordon = "draining" if ops.drain else "cordoned" if ops.cordoned else ""
        node.gpus_out = frozenset(ops.gpus_out)
        for gpu in node.gpus:
            if gpu.uuid in node.gpus_out:
                # through the same place as NVML's faults, so the explanation names the GPU
                mark_unschedulable(node, gpu.uuid, Unschedulable(GPU_CORDONED))
    return nodes


def take(node: NodeState, need: Need, rank: int) -> ReplicaMember:
    """A member of a new replica on `node`: its GPUs (or, shared, its allotment of one),
    port and RAM are taken off the node."""
    allotment = 0
    if need.profile.share_gpus:
        fit = node.best_shared_fit(need)
        assert fit is not None  # the shared_gpu_memory filter passed
        gpus, allotment = [fit[0]], need.gpu_bytes
        uuid = fit[0].uuid
        node.allotted[uuid] = node.allotted.get(uuid, 0) + allotment
        node.sharing[uuid] = node.sharing.get(uuid, 0) + 1
    else:
        gpus = node.usable_gpus(need.gpu_bytes, need.profile.gpu_model)
        gpus = gpus[: need.profile.gpus_per_node]
    port = node.free_port(*need.ports)
    assert port is not None  # the free_port filter passed
    node.used_gpus.update(g.uuid for g in gpus)
    node.free = [g for g in node.free if g.uuid not in node.used_gpus]
    node.used_ports.add(port)
    node.ram_free -= need.ram_bytes
    node.models[need.model] = node.models.get(need.model, 0) + 1
    return ReplicaMember(
        node=node.id, rank=rank, gpus=[g.uuid for g in gpus], port=port, gpu_bytes=allotment
    )
