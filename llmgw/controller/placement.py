"""Placement: which replicas of which model run where, as a pure function of a snapshot.

`plan(snapshot)` reads the whole desired and observed state and returns what to create,
what to remove and, per model, a record that explains it. No I/O, no clock: the
reconcile loop builds the Snapshot, calls plan, and writes the result; running it again
on the same snapshot gives the same plan.

Shaped like the Kubernetes scheduler: FILTERS (each returns None or a Refusal) decide
whether a node can take a replica, then the scores in `Rank` order the nodes that can.
Each model's plan is a list of steps: replace replicas on lost nodes, remove surplus,
fill, switch profile, explain. An unplaced replica's explanation is the count of nodes
per reason (controller/explain.py): "0/6 nodes fit: 3 lost, 2 no vllm, 1 short of free
GPUs (2 free, needs 4)".

Rules kept here (docs/placement.md says why for each):
- weights nearby is a preference, never a filter; a node that never looked for weights
  ranks exactly like one that looked and found nothing;
- a placed replica on a ready or unreachable node is never moved to chase a better
  score; replicas on lost nodes are replaced; surplus replicas go newest first;
- resources held by replicas in the snapshot and by those placed earlier in the same
  plan are accounted for (GPUs by UUID, host RAM, ports).
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from llmgw.bus.records import (
    REPLICA_COUNTED,
    REPLICA_HOLDS_GPUS_AND_PORTS,
    REPLICA_RESERVES_HOST_RAM,
    Desired,
    FabricHoldings,
    Gpu,
    Health,
    Lease,
    NodeInventory,
    NodePhase,
    PlacementRecord,
    Replica,
    ReplicaMember,
)
from llmgw.catalog import Model, Profile
from llmgw.controller import explain
from llmgw.controller.explain import GB, Blocked, Refusal
from llmgw.controller.fabrics import fabric_view

DEFAULT_PORTS = (18000, 18999)

same_decision = explain.same_decision  # what the loop compares before rewriting a record


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


@dataclass(frozen=True, slots=True)
class Removal:
    model: str
    rid: str
    reason: str


@dataclass(frozen=True)
class Plan:
    create: list[Replica]
    remove: list[Removal]
    placements: dict[str, PlacementRecord]


# --- the fleet as placement sees it: what each node has left -----------------------------


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

    @classmethod
    def of(cls, model: str, profile: Profile, ports: tuple[int, int]) -> Need:
        return cls(
            model,
            profile,
            int(profile.gpu_memory_gb * GB),
            int(profile.host_ram_gb * GB),
            ports,
            profile.weights.held_key(),
        )


def _phase(value: NodePhase | Health | None) -> NodePhase | None:
    return value.phase if isinstance(value, Health) else value


def _fleet(snapshot: Snapshot) -> dict[str, NodeState]:
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
            phase=_phase(snapshot.health.get(node_id)),
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
    return nodes


def _take(node: NodeState, need: Need, rank: int) -> ReplicaMember:
    gpus = node.free_gpus(need.gpu_bytes)[: need.profile.gpus_per_node]
    port = node.free_port(*need.ports)
    assert port is not None  # the free_port filter passed
    node.used_gpus.update(g.uuid for g in gpus)
    node.free = [g for g in node.free if g.uuid not in node.used_gpus]
    node.used_ports.add(port)
    node.ram_free -= need.ram_bytes
    node.models[need.model] += 1
    return ReplicaMember(node=node.id, rank=rank, gpus=[g.uuid for g in gpus], port=port)


# --- filters: each one rule, None when the node fits ---------------------------------------


def node_ready(node: NodeState, need: Need) -> Refusal | None:
    if node.phase == "ready":
        return None
    return Refusal("no-lease" if node.phase is None else node.phase)


def engine_installed(node: NodeState, need: Need) -> Refusal | None:
    if need.profile.engine not in node.engines:
        return Refusal("no-engine", detail=need.profile.engine)
    return None


def on_active_fabric(node: NodeState, need: Need) -> Refusal | None:
    # multi-node engines talk NCCL over InfiniBand; the management network is far too slow
    if need.profile.nodes > 1 and not node.fabrics:
        return Refusal("no-fabric")
    return None


_NO_GPUS = {"no_driver": "no-gpu-driver", "error": "gpu-discovery-failed"}


def enough_gpus(node: NodeState, need: Need) -> Refusal | None:
    wanted = need.profile.gpus_per_node
    if wanted == 0:
        return None
    if not node.gpus:
        return Refusal(_NO_GPUS.get(node.inventory.gpus.status, "no-gpus"))
    if need.gpu_bytes > node.largest_gpu:  # no waiting will fix this one
        return Refusal("gpu-memory", needs=need.gpu_bytes, has=node.largest_gpu)
    usable = len(node.free_gpus(need.gpu_bytes))
    if usable < wanted:
        return Refusal("gpus", needs=wanted, has=usable)
    return None


def enough_ram(node: NodeState, need: Need) -> Refusal | None:
    if node.ram_free < need.ram_bytes:
        return Refusal("ram", needs=need.ram_bytes, has=max(node.ram_free, 0))
    return None


def free_port(node: NodeState, need: Need) -> Refusal | None:
    if node.free_port(*need.ports) is None:
        lo, hi = need.ports
        return Refusal("ports", detail=f"{lo}-{hi}")
    return None


Filter = Callable[[NodeState, Need], Refusal | None]
# The first refusal is the one the explanation reports, so the order goes from what says
# most about the node to what placements use up: a lost node is reported lost, not short of
# RAM; what the node is (engine, fabric, GPU model) comes before what waiting may free up
# (free GPUs, RAM, ports), so a person sees first what no amount of waiting will fix.
FILTERS: tuple[Filter, ...] = (
    node_ready,
    engine_installed,
    on_active_fabric,
    enough_gpus,
    enough_ram,
    free_port,
)


def fit(node: NodeState, need: Need) -> Refusal | None:
    """The first filter that refuses the node, or None when it fits."""
    for check in FILTERS:
        refusal = check(node, need)
        if refusal is not None:
            return refusal
    return None


# --- scores: a bigger number is a better node ---------------------------------------------


class WeightsNearby:
    """Where each model's weights are, per node and per fabric, built once per plan.

    From the snapshot's fabric view, or `fabric_view` of its inventories when it has none
    (a node on no fabric is its own island). Only `models` matter,
    never `looked`: a node that never looked must rank with one that found nothing, or
    enabling weights discovery on one node would drain every other.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self.on_node: dict[str, dict[str, str]] = defaultdict(dict)  # node -> key -> store
        self.by_path: dict[str, dict[str, str]] = defaultdict(dict)  # node -> path -> store
        self.in_fabric: dict[str, set[str]] = defaultdict(set)  # fabric -> keys
        self.fabrics_of: dict[str, list[str]] = defaultdict(list)  # node -> fabrics
        for node_id, inv in snapshot.inventories.items():
            for held in inv.weights.models:
                self.on_node[node_id].setdefault(held.key, held.store.identity)
                self.by_path[node_id].setdefault(held.path, held.store.identity)
        view = snapshot.fabrics
        if view is None:
            view = fabric_view(snapshot.inventories.values())
        for name, holdings in view.items():
            for node_id in holdings.nodes:
                self.fabrics_of[node_id].append(name)
            for held in holdings.models:
                self.in_fabric[name].add(held.key)
                for copy in held.copies:  # a share seen by a node that did not scan it
                    for node_id in copy.nodes:
                        self.on_node[node_id].setdefault(held.key, copy.store)

    def _store(self, node: str, need: Need) -> str | None:
        held = self.on_node.get(node)
        store = held.get(need.weights_key) if held else None
        path = need.profile.weights.path
        if store is None and path is not None and node in self.by_path:
            store = self.by_path[node].get(path)
        return store

    def _fabric(self, node: str, need: Need) -> str | None:
        for name in self.fabrics_of.get(node, ()):
            if need.weights_key in self.in_fabric.get(name, ()):
                return name
        return None

    def level(self, node: str, need: Need) -> int:
        """2: on the node or a share it sees; 1: elsewhere in its fabric; 0: nowhere near."""
        if self._store(node, need) is not None:
            return 2
        return 1 if self._fabric(node, need) is not None else 0

    def describe(self, node: str, need: Need) -> str:
        store = self._store(node, need)
        if store is not None:
            where = "on node" if store.startswith("local:") else "on a share the node sees"
            return f"weights {where} ({store})"
        ref = need.profile.weights
        if ref.path is not None:
            # the engine is given the path as it is: nothing fetches a path
            return f"weights path {ref.path} not reported by this node (the engine reads it there)"
        fetched = f"the engine fetches {ref.source or ref.key}"
        fabric = self._fabric(node, need)
        if fabric is not None:
            return f"weights elsewhere in fabric {fabric}, not on this node ({fetched})"
        return f"no copy of the weights nearby ({fetched})"


def weights_nearby(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    return weights.level(node.id, need)


def packing(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # Fewest GPUs left free after placing: fill partly used nodes first, so whole nodes stay
    # free for replicas that need all 8 GPUs (and CPU replicas prefer nodes without GPUs).
    return need.profile.gpus_per_node - len(node.free)


def spread(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # among equally packed nodes, one node going down should take as few replicas as possible
    return -node.models[need.model]


class Rank(NamedTuple):
    """How good a node is for one need: the scores, each higher-is-better and compared in
    this order, then the node id so that ties always break the same way."""

    weights: int  # weights_nearby
    packing: int
    spread: int
    node: str

    @property
    def order(self) -> tuple[int, int, int, str]:
        """Sort key, best first."""
        return (-self.weights, -self.packing, -self.spread, self.node)


def rank(node: NodeState, need: Need, weights: WeightsNearby) -> Rank:
    return Rank(
        weights=weights_nearby(node, need, weights),
        packing=packing(node, need, weights),
        spread=spread(node, need, weights),
        node=node.id,
    )


def _why_here(node: NodeState, need: Need, weights: WeightsNearby) -> str:
    text = weights.describe(node.id, need)
    total, used = len(node.gpus), len(node.used_gpus)
    if need.profile.gpus_per_node == 0:
        return f"{text}; CPU profile"
    if used:
        return f"{text}; packs node with {used} of {total} GPUs used"
    return f"{text}; node has all {total} GPUs free"


# --- pickers: the best node (or nodes) for the next replica of one profile -----------------


@dataclass(frozen=True, slots=True)
class Pick:
    members: list[ReplicaMember]
    why: str


class Picker(Protocol):
    def pick(self) -> Pick | None:
        """Take the best place for one more replica, or None when there is none left."""

    def refusals(self) -> dict[str, Refusal]:
        """Why each node that cannot take one more replica cannot."""


class SingleNodePicker:
    """All nodes are judged once; afterwards only the node just used changes (within one
    plan resources only shrink), so it alone is judged again."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self.heap: list[tuple[int, int, int, str]] = []  # Rank.order: the node id last
        for node in nodes.values():
            order = self._judge(node)
            if order is not None:
                self.heap.append(order)
        heapq.heapify(self.heap)

    def _judge(self, node: NodeState) -> tuple[int, int, int, str] | None:
        refusal = fit(node, self.need)
        if refusal is not None:
            self.refused[node.id] = refusal
            return None
        return rank(node, self.need, self.weights).order

    def pick(self) -> Pick | None:
        if not self.heap:
            return None
        node = self.nodes[heapq.heappop(self.heap)[-1]]
        why = _why_here(node, self.need, self.weights)
        member = _take(node, self.need, rank=0)
        order = self._judge(node)
        if order is not None:
            heapq.heappush(self.heap, order)
        return Pick([member], why)

    def refusals(self) -> dict[str, Refusal]:
        return dict(self.refused)


class MultiNodePicker:
    """N nodes in ONE fabric: NCCL runs over InfiniBand, and fabrics are not connected."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self.fitting: dict[str, Rank] = {}
        for node in nodes.values():
            self._judge(node)

    def _judge(self, node: NodeState) -> None:
        refusal = fit(node, self.need)
        if refusal is None:
            self.fitting[node.id] = rank(node, self.need, self.weights)
        else:
            self.fitting.pop(node.id, None)
            self.refused[node.id] = refusal

    def _by_fabric(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = defaultdict(list)
        for node_id in self.fitting:
            for name in self.nodes[node_id].fabrics:
                groups[name].append(node_id)
        return groups

    def pick(self) -> Pick | None:
        count = self.need.profile.nodes
        best: tuple | None = None
        for name, members in self._by_fabric().items():
            if len(members) < count:
                continue
            chosen = heapq.nsmallest(
                count, (self.fitting[n] for n in members), key=lambda r: r.order
            )
            weights_total = sum(r.weights for r in chosen)
            capacity = sum(len(self.nodes[n].free) for n in members)
            # best weights across the chosen nodes, then most free capacity, then the name
            key = (-weights_total, -capacity, name)
            if best is None or key < best[0]:
                best = (key, name, [r.node for r in chosen])
        if best is None:
            return None
        _, fabric, chosen_ids = best
        why = _why_here(self.nodes[chosen_ids[0]], self.need, self.weights)
        members = [
            _take(self.nodes[node_id], self.need, rank) for rank, node_id in enumerate(chosen_ids)
        ]
        for node_id in chosen_ids:
            self._judge(self.nodes[node_id])
        return Pick(members, f"{count} nodes in fabric {fabric}; rank 0: {why}")

    def refusals(self) -> dict[str, Refusal]:
        """Per node, counting nodes that fit alone but whose fabric is too small."""
        out = dict(self.refused)
        groups = self._by_fabric()
        for node_id in self.fitting:
            name, size = max(
                ((n, len(groups[n])) for n in sorted(self.nodes[node_id].fabrics)),
                key=lambda item: item[1],
            )
            out[node_id] = Refusal(
                "fabric-size", needs=self.need.profile.nodes, has=size, detail=name
            )
        return out


def picker(nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> Picker:
    if need.profile.nodes > 1:
        return MultiNodePicker(nodes, need, weights)
    return SingleNodePicker(nodes, need, weights)


# --- the plan: per model, a list of steps ----------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """What every model's steps share within one plan: the nodes (their resources shrink as
    replicas are placed), where weights are, and the rids already taken."""

    snapshot: Snapshot
    nodes: dict[str, NodeState]
    weights: WeightsNearby
    taken: set[str]


@dataclass(frozen=True, slots=True)
class Sorted:
    """What a step keeps, and what it removes with the reason."""

    kept: list[Replica]
    removed: list[tuple[Replica, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelPlan:
    create: list[Replica]
    remove: list[Removal]
    record: PlacementRecord


@dataclass(frozen=True, slots=True)
class Filled:
    """Replicas placed by the fill step; per profile tried, why each node refused the next."""

    created: list[Replica]
    refusals: list[tuple[str, dict[str, Refusal]]]


def plan(snapshot: Snapshot) -> Plan:
    """Decide replicas to create and remove for every model, with the reasons."""
    fleet = Fleet(
        snapshot, _fleet(snapshot), WeightsNearby(snapshot), {r.rid for r in snapshot.replicas}
    )
    by_model: dict[str, list[Replica]] = defaultdict(list)
    for replica in snapshot.replicas:
        by_model[replica.model].append(replica)

    create: list[Replica] = []
    remove: list[Removal] = []
    records: dict[str, PlacementRecord] = {}
    # earliest request first: when GPUs are short, the model asked for first gets them
    models = sorted(
        set(snapshot.desired) | set(by_model) | set(snapshot.catalog),
        key=lambda m: (snapshot.desired[m].updated_at if m in snapshot.desired else 0.0, m),
    )
    for model_id in models:
        outcome = plan_model(fleet, model_id, by_model.get(model_id, []))
        if outcome is not None:
            create.extend(outcome.create)
            remove.extend(outcome.remove)
            records[model_id] = outcome.record
    return Plan(create=create, remove=remove, placements=records)


def plan_model(fleet: Fleet, model_id: str, current: list[Replica]) -> ModelPlan | None:
    """One model's steps. None when there is nothing to say: not asked for, nothing running."""
    snapshot = fleet.snapshot
    model = snapshot.catalog.get(model_id)
    desired = snapshot.desired.get(model_id)
    want = desired.replicas if desired is not None else 0
    live = sorted(
        (r for r in current if r.phase in REPLICA_COUNTED), key=lambda r: (r.created_at, r.rid)
    )
    if not live and desired is None:
        return None
    record = _Record(model_id, want, snapshot.now)
    lines = _Lines()

    blocked = blocked_model(model, desired)
    if blocked is not None:
        reason, detail = blocked
        if reason == "unknown-profile":  # keep what runs, place nothing, say why
            return ModelPlan([], [], record.blocked(reason, detail, len(live), lines.text))
        text = explain.render(record.blocked(reason, detail, 0, []))
        removals = lines.removed((r, text) for r in _newest_first(live))
        return ModelPlan([], removals, record.blocked(reason, detail, 0, lines.text))

    assert model is not None
    profiles = _profiles(model, desired)
    allowed = {p.name for p in profiles}

    runnable = replace_lost(snapshot, model, live)
    right = [r for r in runnable.kept if r.profile in allowed]
    switching = [r for r in runnable.kept if r.profile not in allowed]
    surplus = remove_surplus(right, want)
    filled = fill(fleet, model_id, profiles, want - len(surplus.kept))
    switched = switch_profile(switching, surplus.kept, want, allowed)

    removals = lines.removed(runnable.removed) + lines.removed(surplus.removed)
    lines.add(f"keep {r.rid} on {_where(r)} ({r.phase})" for r in surplus.kept)
    lines.add(f"place {r.rid} on {_where(r)}: {r.reason}" for r in filled.created)
    removals += lines.removed(switched.removed)
    lines.add(f"keep {r.rid} on {_where(r)} until the new profile is ready" for r in switched.kept)

    placed = len(surplus.kept) + len(filled.created)
    rec = record.placed(placed, len(fleet.nodes), filled.refusals, lines.text)
    if placed < want:
        short = want - placed
        lines.add([f"{short} replica{'s' if short != 1 else ''} not placed: {rec.explanation}"])
    return ModelPlan(filled.created, removals, rec)


def blocked_model(model: Model | None, desired: Desired | None) -> tuple[Blocked, str] | None:
    """Why nothing of the model can be placed at all, or None."""
    if model is None:
        return "not-in-catalog", ""
    if not model.profiles:
        return "static-endpoints", ""
    if desired is not None and desired.profile and model.profile(desired.profile) is None:
        return "unknown-profile", desired.profile
    return None


def _profiles(model: Model, desired: Desired | None) -> list[Profile]:
    if desired is not None and desired.profile:
        chosen = model.profile(desired.profile)
        assert chosen is not None  # blocked_model refused an unknown one
        return [chosen]
    return list(model.profiles)


def replace_lost(snapshot: Snapshot, model: Model, live: list[Replica]) -> Sorted:
    """A replica with a member on a lost node, or whose profile left the catalog, is
    removed (and so replaced by the fill step); a multi-node replica goes whole."""
    kept, removed = [], []
    for replica in live:
        gone = _gone_node(snapshot, replica)
        if gone is not None:
            removed.append((replica, f"{gone}; replaced"))
        elif model.profile(replica.profile) is None:
            removed.append((replica, f"profile '{replica.profile}' is no longer in the catalog"))
        else:
            kept.append(replica)
    return Sorted(kept, removed)


def remove_surplus(replicas: list[Replica], want: int) -> Sorted:
    """More than desired: the newest go first."""
    extra = _newest_first(replicas)[: max(len(replicas) - want, 0)]
    going = {r.rid for r in extra}
    why = "desired is 0: draining" if want == 0 else f"desired lowered to {want}"
    return Sorted([r for r in replicas if r.rid not in going], [(r, why) for r in extra])


def fill(fleet: Fleet, model_id: str, profiles: list[Profile], missing: int) -> Filled:
    """Place each missing replica with the first profile (in catalog order) that
    fits somewhere. A profile that found no node stays exhausted: resources only shrink
    within a plan."""
    pickers: list[tuple[Profile, Picker]] = []
    created: list[Replica] = []
    for _ in range(missing):
        found = _place_one(fleet, model_id, profiles, pickers)
        if found is None:
            break
        created.append(found)
    if len(created) == missing:
        return Filled(created, [])  # nothing to explain
    return Filled(created, [(p.name, pk.refusals()) for p, pk in pickers])


def _place_one(
    fleet: Fleet, model_id: str, profiles: list[Profile], pickers: list[tuple[Profile, Picker]]
) -> Replica | None:
    snapshot = fleet.snapshot
    for i, profile in enumerate(profiles):
        if i == len(pickers):
            need = Need.of(model_id, profile, snapshot.port_range)
            pickers.append((profile, picker(fleet.nodes, need, fleet.weights)))
        found = pickers[i][1].pick()
        if found is None:
            continue
        return Replica(
            model=model_id,
            rid=_new_rid(model_id, fleet.taken, snapshot.now),
            profile=profile.name,
            members=found.members,
            phase="placed",
            created_at=snapshot.now,
            reason=found.why,
        )
    return None


def switch_profile(old: list[Replica], new: list[Replica], want: int, allowed: set[str]) -> Sorted:
    """Replicas of a profile no longer wanted stay until the wanted profile serves
    the full count ready; then they go, newest first."""
    ready = sum(1 for r in new if r.phase == "ready")
    if want == 0 or ready >= want:
        why = f"replaced by profile {'/'.join(sorted(allowed))}"
        return Sorted([], [(r, why) for r in _newest_first(old)])
    return Sorted(_newest_first(old))


@dataclass(frozen=True, slots=True)
class _Record:
    """The last step, explain: the PlacementRecord, its text rendered from its data. `decisions` is
    the steps' list of lines, which may still grow ("not placed: <explanation>")."""

    model: str
    desired: int
    now: float

    def blocked(
        self, reason: Blocked, detail: str, placed: int, decisions: list[str]
    ) -> PlacementRecord:
        rec = PlacementRecord(
            model=self.model,
            desired=self.desired,
            placed=placed,
            blocked=reason,
            blocked_detail=detail,
        )
        return self._done(rec, decisions)

    def placed(
        self,
        placed: int,
        judged: int,
        refusals: list[tuple[str, dict[str, Refusal]]],
        decisions: list[str],
    ) -> PlacementRecord:
        rec = PlacementRecord(model=self.model, desired=self.desired, placed=placed)
        if placed < self.desired:
            rec.judged = judged
            rec.refused = [
                g for profile, by_node in refusals for g in explain.group(profile, by_node)
            ]
        return self._done(rec, decisions)

    def _done(self, rec: PlacementRecord, decisions: list[str]) -> PlacementRecord:
        rec.explanation = explain.render(rec)
        rec.decided_at = self.now
        rec.decisions = decisions
        return rec


class _Lines:
    """The record's decision lines, one per thing decided, in the order the steps ran."""

    def __init__(self) -> None:
        self.text: list[str] = []

    def add(self, lines: Iterable[str]) -> None:
        self.text.extend(lines)

    def removed(self, removed: Iterable[tuple[Replica, str]]) -> list[Removal]:
        out = []
        for replica, why in removed:
            self.text.append(f"remove {replica.rid} on {_where(replica)}: {why}")
            out.append(Removal(replica.model, replica.rid, why))
        return out


def frozen_record(
    model: str,
    blocked: Blocked,
    detail: str,
    desired: int,
    placed: int,
    now: float,
    decisions: list[str],
) -> PlacementRecord:
    """The record for a model the loop leaves exactly as it is, nothing placed and nothing
    removed: its catalog entry is invalid, or was deleted while replicas are desired."""
    return _Record(model, desired, now).blocked(blocked, detail, placed, decisions)


def _new_rid(model: str, taken: set[str], now: float) -> str:
    # Deterministic for a snapshot, and never an id in use: an old shard record under a
    # reused rid would be mistaken for the new replica's.
    n = 0
    while True:
        digest = hashlib.sha256(f"{model}\0{now!r}\0{n}".encode()).hexdigest()
        rid = "r" + digest[:10]
        if rid not in taken:
            taken.add(rid)
            return rid
        n += 1


def _gone_node(snapshot: Snapshot, replica: Replica) -> str | None:
    """The first member node that is lost (or unknown to the fleet altogether)."""
    for member in replica.members:
        phase = _phase(snapshot.health.get(member.node))
        if phase == "lost":
            return f"node {member.node} is lost"
        if phase is None and member.node not in snapshot.inventories:
            return f"node {member.node} is gone (no inventory, no lease)"
    return None


def _newest_first(replicas: list[Replica]) -> list[Replica]:
    return sorted(replicas, key=lambda r: (r.created_at, r.rid), reverse=True)


def _where(replica: Replica) -> str:
    return ", ".join(m.node for m in sorted(replica.members, key=lambda m: m.rank))


# --- who qualifies now: the loop reports changes for waiting models ------------------------


def qualifying_nodes(snapshot: Snapshot, model: str, profile: str | None = None) -> set[str]:
    """Nodes that pass every filter for the model's profile (the desired one, else any of
    them) right now. The loop compares this between passes to log and publish when a
    node starts or stops qualifying for a waiting model."""
    return _qualifying(snapshot, model, profile, _fleet(snapshot))


def qualifying_nodes_by_model(snapshot: Snapshot, models: Iterable[str]) -> dict[str, set[str]]:
    """`qualifying_nodes` of several models with the fleet built once per call, not once per
    model: building it is O(nodes), ~45 ms at 2,000 nodes (bench/reconcile.py --waiting)."""
    models = list(models)
    fleet = _fleet(snapshot) if models else {}
    return {m: _qualifying(snapshot, m, None, fleet) for m in models}


def _qualifying(
    snapshot: Snapshot, model: str, profile: str | None, nodes: Mapping[str, NodeState]
) -> set[str]:
    entry = snapshot.catalog.get(model)
    if entry is None or not entry.profiles:
        return set()
    desired = snapshot.desired.get(model)
    name = profile or (desired.profile if desired is not None else None)
    profiles = [entry.profile(name)] if name else entry.profiles
    out: set[str] = set()
    for p in profiles:
        if p is None:
            continue
        need = Need.of(model, p, snapshot.port_range)
        out.update(n.id for n in nodes.values() if fit(n, need) is None)  # fit only reads
    return out
