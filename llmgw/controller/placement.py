"""Placement: which replicas of which model run where, as a pure function of a snapshot.

`plan(snapshot)` reads the whole desired and observed state and returns what to create,
what to remove and, per model, a record that explains it. No I/O, no clock: the
reconcile loop builds the Snapshot, calls plan, and writes the result; running it again
on the same snapshot gives the same plan.

Shaped like the Kubernetes scheduler: FILTERS (each returns None or a FitReason) decide
whether a node can take a replica, then SCORES rank the nodes that can. An unplaced
replica's explanation is the count of nodes per reason: "0/6 nodes fit: 3 lost, 2 no
vllm, 1 has 2 of 8 GPUs free (needs 4)".

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

from llmgw.bus.records import (
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
from llmgw.controller.fabrics import fabric_view

DEFAULT_PORTS = (18000, 18999)
GB = 1_000_000_000  # catalog sizes are 10^9 bytes, like the "80GB" on the card

# Replica phases whose engine is going away: they still hold their GPUs and ports (the
# engine drains before it stops) but no longer count toward the desired number.
_GOING = frozenset({"draining", "stopped"})
# Not yet running: their engine has not taken its host RAM yet, so it is reserved here.
_NOT_RUNNING = frozenset({"placed", "starting"})


@dataclass(frozen=True, slots=True)
class FitReason:
    """Why a node cannot take a replica: `key` groups counts in PlacementRecord.reasons,
    `text` is what a person reads ("has 2 of 8 GPUs free (needs 4)")."""

    key: str
    text: str


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
        nodes[node_id] = NodeState(
            id=node_id,
            inventory=inv,
            phase=_phase(snapshot.health.get(node_id)),
            gpus=gpus,
            used_gpus=set(),
            free=gpus,
            smallest_gpu=min((g.memory_total_bytes for g in gpus), default=0),
            engines=frozenset(e.name for e in inv.engines),
            ram_free=memory.available_bytes,
            used_ports=set(),
            fabrics=frozenset(inv.fabrics()),
            models=Counter(),
        )
    for replica in snapshot.replicas:
        if replica.phase == "stopped":
            continue
        model = snapshot.catalog.get(replica.model)
        profile = model.profile(replica.profile) if model else None
        reserve = profile is not None and replica.phase in _NOT_RUNNING
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


def _gb(n: float) -> str:
    return f"{max(n, 0) / GB:.1f}".removesuffix(".0")


def node_ready(node: NodeState, need: Need) -> FitReason | None:
    if node.phase == "ready":
        return None
    if node.phase is None:
        return FitReason("no-lease", "no lease seen")
    return FitReason(node.phase, node.phase)


def engine_installed(node: NodeState, need: Need) -> FitReason | None:
    engine = need.profile.engine
    if engine not in node.engines:
        return FitReason(f"no-{engine}", f"no {engine}")
    return None


_NO_GPU_TEXT = {"no_driver": "no GPU driver", "error": "GPU discovery failed"}


def enough_gpus(node: NodeState, need: Need) -> FitReason | None:
    wanted = need.profile.gpus_per_node
    if wanted == 0:
        return None
    if not node.gpus:
        return FitReason("no-gpus", _NO_GPU_TEXT.get(node.inventory.gpus.status, "no GPUs"))
    free = node.free
    if len(free) < wanted:
        return FitReason("gpus", f"has {len(free)} of {len(node.gpus)} GPUs free (needs {wanted})")
    big = len(node.free_gpus(need.gpu_bytes))
    if big < wanted:
        if big == 0:
            largest = max(g.memory_total_bytes for g in free)
            text = f"GPUs have {_gb(largest)} GB (needs {_gb(need.gpu_bytes)})"
        else:
            text = f"has {big} free GPUs with {_gb(need.gpu_bytes)} GB (needs {wanted})"
        return FitReason("gpu-memory", text)
    return None


def enough_ram(node: NodeState, need: Need) -> FitReason | None:
    if node.ram_free < need.ram_bytes:
        return FitReason(
            "ram", f"has {_gb(node.ram_free)} GB RAM free (needs {_gb(need.ram_bytes)})"
        )
    return None


def free_port(node: NodeState, need: Need) -> FitReason | None:
    if node.free_port(*need.ports) is None:
        lo, hi = need.ports
        return FitReason("ports", f"no free port in {lo}-{hi}")
    return None


def on_active_fabric(node: NodeState, need: Need) -> FitReason | None:
    # multi-node engines talk NCCL over InfiniBand; the management network is far too slow
    if need.profile.nodes > 1 and not node.fabrics:
        return FitReason("no-fabric", "not on an active IB fabric")
    return None


Filter = Callable[[NodeState, Need], FitReason | None]
FILTERS: tuple[Filter, ...] = (
    node_ready,
    engine_installed,
    enough_gpus,
    enough_ram,
    free_port,
    on_active_fabric,
)


def fit(node: NodeState, need: Need) -> FitReason | None:
    """The first filter that refuses the node, or None when it fits."""
    for check in FILTERS:
        reason = check(node, need)
        if reason is not None:
            return reason
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
        fabric = self._fabric(node, need)
        if fabric is not None:
            return f"weights elsewhere in fabric {fabric}"
        return "no weights nearby (the engine fetches them)"


def weights_nearby(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    return weights.level(node.id, need)


def packing(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # Fewest GPUs left free after placing: fill partly used nodes first, so whole nodes stay
    # free for replicas that need all 8 GPUs (and CPU replicas prefer nodes without GPUs).
    return need.profile.gpus_per_node - len(node.free)


def spread(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # among equally packed nodes, one node going down should take as few replicas as possible
    return -node.models[need.model]


Score = Callable[[NodeState, Need, WeightsNearby], int]
SCORES: tuple[Score, ...] = (weights_nearby, packing, spread)


def rank_key(node: NodeState, need: Need, weights: WeightsNearby) -> tuple:
    """Sort key, smallest first: the scores in order (higher better), then the node id so
    that ties always break the same way."""
    return (*[-score(node, need, weights) for score in SCORES], node.id)


def _why_here(node: NodeState, need: Need, weights: WeightsNearby) -> str:
    text = weights.describe(node.id, need)
    total, used = len(node.gpus), len(node.used_gpus)
    if need.profile.gpus_per_node == 0:
        return f"{text}; CPU profile"
    if used:
        return f"{text}; packs node with {used} of {total} GPUs used"
    return f"{text}; node has all {total} GPUs free"


# --- pickers: the best node (or nodes) for the next replica of one profile -----------------


class _SingleNodePicker:
    """All nodes are judged once; afterwards only the node just used changes (within one
    plan resources only shrink), so it alone is judged again."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, FitReason] = {}
        self.heap: list[tuple] = []
        for node in nodes.values():
            self._judge(node)
        heapq.heapify(self.heap)

    def _judge(self, node: NodeState) -> None:
        reason = fit(node, self.need)
        if reason is None:
            self.heap.append(rank_key(node, self.need, self.weights))
        else:
            self.refused[node.id] = reason

    def pick(self) -> tuple[list[ReplicaMember], str] | None:
        if not self.heap:
            return None
        node = self.nodes[heapq.heappop(self.heap)[-1]]
        why = _why_here(node, self.need, self.weights)
        member = _take(node, self.need, rank=0)
        reason = fit(node, self.need)
        if reason is None:
            heapq.heappush(self.heap, rank_key(node, self.need, self.weights))
        else:
            self.refused[node.id] = reason
        return [member], why


class _MultiNodePicker:
    """N nodes in ONE fabric: NCCL runs over InfiniBand, and fabrics are not connected."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, FitReason] = {}
        self.fitting: dict[str, tuple] = {}  # node -> rank key
        for node in nodes.values():
            self._judge(node)

    def _judge(self, node: NodeState) -> None:
        reason = fit(node, self.need)
        if reason is None:
            self.fitting[node.id] = rank_key(node, self.need, self.weights)
        else:
            self.fitting.pop(node.id, None)
            self.refused[node.id] = reason

    def _by_fabric(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = defaultdict(list)
        for node_id in self.fitting:
            for name in self.nodes[node_id].fabrics:
                groups[name].append(node_id)
        return groups

    def pick(self) -> tuple[list[ReplicaMember], str] | None:
        count = self.need.profile.nodes
        best: tuple | None = None
        for name, members in self._by_fabric().items():
            if len(members) < count:
                continue
            chosen = heapq.nsmallest(count, (self.fitting[n] for n in members))
            weights_total = -sum(k[0] for k in chosen)
            capacity = sum(len(self.nodes[n].free) for n in members)
            # best weights across the chosen nodes, then most free capacity, then the name
            key = (-weights_total, -capacity, name)
            if best is None or key < best[0]:
                best = (key, name, [k[-1] for k in chosen])
        if best is None:
            return None
        _, fabric, chosen_ids = best
        why = _why_here(self.nodes[chosen_ids[0]], self.need, self.weights)
        members = [
            _take(self.nodes[node_id], self.need, rank) for rank, node_id in enumerate(chosen_ids)
        ]
        for node_id in chosen_ids:
            self._judge(self.nodes[node_id])
        return members, f"{count} nodes in fabric {fabric}; rank 0: {why}"

    @property
    def refused_all(self) -> dict[str, FitReason]:
        """Per node reasons, counting nodes that fit alone but whose fabric is too small."""
        out = dict(self.refused)
        groups = self._by_fabric()
        for node_id in self.fitting:
            name, size = max(
                ((n, len(groups[n])) for n in sorted(self.nodes[node_id].fabrics)),
                key=lambda item: item[1],
            )
            out[node_id] = FitReason(
                "fabric-size",
                f"on {name} with {size} fitting node{'s' if size != 1 else ''} "
                f"(needs {self.need.profile.nodes})",
            )
        return out


def _picker(nodes: dict[str, NodeState], need: Need, weights: WeightsNearby):
    if need.profile.nodes > 1:
        return _MultiNodePicker(nodes, need, weights)
    return _SingleNodePicker(nodes, need, weights)


def _refusals(picker) -> dict[str, FitReason]:
    return picker.refused_all if isinstance(picker, _MultiNodePicker) else picker.refused


# --- explanations ---------------------------------------------------------------------------


def explain(total: int, refused: Mapping[str, FitReason]) -> tuple[str, dict[str, int]]:
    """("0/6 nodes fit: 3 lost, 2 no vllm, 1 has 2 of 8 GPUs free (needs 4)", reasons):
    same texts grouped, most nodes first, then by text, so the line never changes order."""
    texts = Counter(r.text for r in refused.values())
    keys = Counter(r.key for r in refused.values())
    fit_count = total - len(refused)
    head = f"{fit_count}/{total} nodes fit"
    if total == 0:
        return f"{head}: no node has reported an inventory", {}
    parts = [f"{n} {text}" for text, n in sorted(texts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return (f"{head}: " + ", ".join(parts)) if parts else head, dict(sorted(keys.items()))


# --- the plan -------------------------------------------------------------------------------


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


def plan(snapshot: Snapshot) -> Plan:
    """Decide replicas to create and remove for every model, with the reasons."""
    nodes = _fleet(snapshot)
    weights = WeightsNearby(snapshot)
    taken = {r.rid for r in snapshot.replicas}
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
        record = _plan_model(snapshot, model_id, by_model.get(model_id, []), nodes, weights, taken)
        if record is None:
            continue
        made, dropped, placement = record
        create.extend(made)
        remove.extend(dropped)
        if placement is not None:
            records[model_id] = placement
    return Plan(create=create, remove=remove, placements=records)


def _plan_model(
    snapshot: Snapshot,
    model_id: str,
    current: list[Replica],
    nodes: dict[str, NodeState],
    weights: WeightsNearby,
    taken: set[str],
) -> tuple[list[Replica], list[Removal], PlacementRecord | None] | None:
    model = snapshot.catalog.get(model_id)
    desired = snapshot.desired.get(model_id)
    want = desired.replicas if desired is not None else 0
    live = [r for r in current if r.phase not in _GOING]
    if not live and desired is None:
        return None
    decisions: list[str] = []
    removals: list[Removal] = []

    def record(placed: int, explanation: str = "", reasons: dict[str, int] | None = None):
        return PlacementRecord(
            model=model_id,
            desired=want,
            placed=placed,
            explanation=explanation,
            reasons=reasons or {},
            decided_at=snapshot.now,
            decisions=decisions,
        )

    def drop(replica: Replica, why: str) -> None:
        removals.append(Removal(model_id, replica.rid, why))
        decisions.append(f"remove {replica.rid} on {_where(replica)}: {why}")

    refusal: str | None = None
    if model is None:
        refusal = f"model '{model_id}' is not in the catalog"
    elif not model.profiles:
        refusal = f"model '{model_id}' is served from static endpoints, not placed"
    elif desired is not None and desired.profile and model.profile(desired.profile) is None:
        names = ", ".join(p.name for p in model.profiles)
        refusal = f"profile '{desired.profile}' is not in model '{model_id}' (profiles: {names})"
    if refusal is not None:
        if model is None or not model.profiles:
            for replica in _newest_first(live):
                drop(replica, refusal)
            return [], removals, record(0, refusal, {"catalog": 1})
        # an unknown desired profile: keep what runs, place nothing, say why
        return [], removals, record(len(live), refusal, {"unknown-profile": 1})

    assert model is not None
    profiles = (
        [model.profile(desired.profile)]
        if desired is not None and desired.profile
        else list(model.profiles)
    )
    allowed = {p.name for p in profiles if p is not None}

    kept: list[Replica] = []
    for replica in sorted(live, key=lambda r: (r.created_at, r.rid)):
        gone = _gone_node(snapshot, replica)
        if gone is not None:
            drop(replica, f"{gone}; replaced")
        elif model.profile(replica.profile) is None:
            drop(replica, f"profile '{replica.profile}' is no longer in the catalog")
        else:
            kept.append(replica)
    right = [r for r in kept if r.profile in allowed]
    switching = [r for r in kept if r.profile not in allowed]

    for replica in _newest_first(right)[: max(len(right) - want, 0)]:
        drop(replica, "desired is 0: draining" if want == 0 else f"desired lowered to {want}")
        right.remove(replica)
    for replica in right:
        decisions.append(f"keep {replica.rid} on {_where(replica)} ({replica.phase})")

    made: list[Replica] = []
    missing = want - len(right)
    pickers: list = []
    for _ in range(missing):
        placed = _place_one(snapshot, model_id, profiles, nodes, weights, pickers, taken)
        if placed is None:
            break
        made.append(placed)
        decisions.append(f"place {placed.rid} on {_where(placed)}: {placed.reason}")

    # a profile switch: the old replicas go once the new profile serves the full count
    ready = sum(1 for r in right if r.phase == "ready")
    for replica in _newest_first(switching):
        if want == 0 or ready >= want:
            drop(replica, f"replaced by profile {'/'.join(sorted(allowed))}")
        else:
            decisions.append(
                f"keep {replica.rid} on {_where(replica)} until the new profile is ready"
            )

    placed_count = len(right) + len(made)
    if placed_count >= want:
        return made, removals, record(placed_count)
    explanation, reasons = _explain_pickers(len(nodes), profiles, pickers)
    short = want - placed_count
    decisions.append(f"{short} replica{'s' if short != 1 else ''} not placed: {explanation}")
    return made, removals, record(placed_count, explanation, reasons)


def _place_one(
    snapshot: Snapshot,
    model_id: str,
    profiles: list[Profile],
    nodes: dict[str, NodeState],
    weights: WeightsNearby,
    pickers: list,
    taken: set[str],
) -> Replica | None:
    """Place one replica with the first profile (in catalog order) that fits somewhere.
    A profile that found no node stays exhausted: resources only shrink within a plan."""
    for i, profile in enumerate(profiles):
        if i == len(pickers):
            pickers.append(_picker(nodes, Need.of(model_id, profile, snapshot.port_range), weights))
        found = pickers[i].pick()
        if found is None:
            continue
        members, why = found
        return Replica(
            model=model_id,
            rid=_new_rid(model_id, taken, snapshot.now),
            profile=profile.name,
            members=members,
            phase="placed",
            created_at=snapshot.now,
            reason=why,
        )
    return None


def _explain_pickers(
    total: int, profiles: list[Profile], pickers: list
) -> tuple[str, dict[str, int]]:
    if len(profiles) == 1:
        return explain(total, _refusals(pickers[0]))
    lines, reasons = [], {}
    for profile, picker in zip(profiles, pickers, strict=False):
        text, counts = explain(total, _refusals(picker))
        lines.append(f"profile {profile.name}: {text}")
        reasons.update({f"{profile.name}:{k}": n for k, n in counts.items()})
    return "; ".join(lines), reasons


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
