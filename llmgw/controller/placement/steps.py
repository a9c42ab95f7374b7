"""The plan: per model, a list of steps, each a small function with a small result.

Replace replicas on lost nodes, remove surplus, fill, switch profile, explain; models
are handled oldest `desired.updated_at` first.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw.bus.records import REPLICA_COUNTED, Desired, PlacementRecord, Replica
from llmgw.catalog import Model, Profile
from llmgw.controller.placement import explain
from llmgw.controller.placement.explain import Blocked, Refusal
from llmgw.controller.placement.nodes import Need, NodeState, fleet_nodes
from llmgw.controller.placement.pickers import Picker, picker
from llmgw.controller.placement.ports import PortMove, move_taken_ports
from llmgw.controller.placement.record import ModelRecord
from llmgw.controller.placement.snapshot import Snapshot
from llmgw.controller.placement.weights import WeightsNearby


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
    # replicas given another port: theirs was taken by another program after placement
    port_moves: list[PortMove] = field(default_factory=list)


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
        snapshot, fleet_nodes(snapshot), WeightsNearby(snapshot), {r.rid for r in snapshot.replicas}
    )
    # before anything is placed: the ports they move to are then used
    moves = move_taken_ports(snapshot, fleet.nodes)
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
    return Plan(create=create, remove=remove, placements=records, port_moves=moves)


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
    record = ModelRecord(model_id, want, snapshot.now)
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
        phase = snapshot.phase(member.node)
        if phase == "lost":
            return f"node {member.node} is lost"
        if phase is None and member.node not in snapshot.inventories:
            return f"node {member.node} is gone (no inventory, no lease)"
    return None


def _newest_first(replicas: list[Replica]) -> list[Replica]:
    return sorted(replicas, key=lambda r: (r.created_at, r.rid), reverse=True)


def _where(replica: Replica) -> str:
    return ", ".join(m.node for m in sorted(replica.members, key=lambda m: m.rank))
