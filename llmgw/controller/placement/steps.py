"""The plan: per model, a list of steps, each a small function with a small result.

A frozen model keeps what it has, said why. Otherwise its replicas are split into named
sets and passed through stages, each a small function: lost and kept (replace_lost);
current and outdated (split_outdated); a rollout whose new replicas fail stops
(stop_failing); live and given up (split_given_up, judge_given_up: moved, or kept to show
a launch that fails everywhere); outdated replaced one batch at a time (rollout.py) or
else surplus removed (roll_or_trim); filled (fill); drained by force what has nowhere to
go (drain_by_force); explained. Models are handled oldest `desired.updated_at` first.
"""

from __future__ import annotations

import gc
import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from llmgw.bus.records import (
    REPLICA_COUNTED,
    REPLICA_TERMINAL,
    Desired,
    PlacementRecord,
    Replica,
    Rollout,
)
from llmgw.catalog import Model, Profile, launch_hash
from llmgw.controller.adapters import started_without
from llmgw.controller.placement import explain, failures, rollout
from llmgw.controller.placement.explain import Blocked, Refusal
from llmgw.controller.placement.filters import could_run
from llmgw.controller.placement.nodes import InventoryMemo, Need, NodeState, fleet_nodes
from llmgw.controller.placement.pickers import Picker, picker
from llmgw.controller.placement.ports import PortMove, move_taken_ports
from llmgw.controller.placement.record import ModelRecord, frozen_record
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
    rollouts: dict[str, Rollout] = field(default_factory=dict)


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
    rollout: Rollout | None = None


@dataclass(frozen=True, slots=True)
class Filled:
    """Replicas placed by the fill step; per profile tried, why each node refused the next."""

    created: list[Replica]
    refusals: list[tuple[str, dict[str, Refusal]]]


def plan(
    snapshot: Snapshot,
    nodes: dict[str, NodeState] | None = None,
    memo: InventoryMemo | None = None,
) -> Plan:
    """Decide replicas to create and remove for every model, with the reasons. `nodes`:
    `fleet_nodes(snapshot)` when the caller built it already (and nothing changed it):
    the plan takes resources off them as it places. `memo`: the caller's InventoryMemo,
    which keeps where weights are while no inventory changes."""
    with collector_paused():
        memo = memo if memo is not None else InventoryMemo()
        nodes = nodes if nodes is not None else fleet_nodes(snapshot, memo)
        # built from the inventories and the fabric view, which follows from them
        weights = memo.of_fleet("weights", snapshot.inventories, lambda: WeightsNearby(snapshot))
        return _plan(snapshot, nodes, weights)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a plan runs. A plan allocates a great many
    short-lived objects (a node state per node, a rank per node per profile) that form no
    cycles, so reference counting frees them all; left on, the collector's full passes walk
    every record of the fleet's snapshot several times a plan: 30-40% of a plan's time at
    10,000 nodes (bench/placement.py). Back on afterwards, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(snapshot: Snapshot, nodes: dict[str, NodeState], weights: WeightsNearby) -> Plan:
    fleet = Fleet(snapshot, nodes, weights, {r.rid for r in snapshot.replicas})
    # before anything is placed: the ports they move to are then used
    moves = move_taken_ports(snapshot, fleet.nodes)
    by_model: dict[str, list[Replica]] = defaultdict(list)
    for replica in snapshot.replicas:
        by_model[replica.model].append(replica)

    create: list[Replica] = []
    remove: list[Removal] = []
    records: dict[str, PlacementRecord] = {}
    rollouts: dict[str, Rollout] = {}
    # earliest request first: when GPUs are short, the model asked for first gets them
    models = sorted(
        set(snapshot.desired) | set(by_model) | set(snapshot.catalog) | set(snapshot.frozen),
        key=lambda m: (snapshot.desired[m].updated_at if m in snapshot.desired else 0.0, m),
    )
    for model_id in models:
        outcome = plan_model(fleet, model_id, by_model.get(model_id, []))
        if outcome is not None:
            create.extend(outcome.create)
            remove.extend(outcome.remove)
            records[model_id] = outcome.record
            if outcome.rollout is not None:
                rollouts[model_id] = outcome.rollout
    return Plan(
        create=create, remove=remove, placements=records, rollouts=rollouts, port_moves=moves
    )


@dataclass(frozen=True, slots=True)
class Asked:
    """What the catalog, the count and the operator ask of one model in this plan."""

    model: Model
    want: int
    profiles: list[Profile]  # those it may be placed with, in catalog order
    launches: dict[str, str]  # profile -> launch hash
    draining: set[str]  # nodes the operator drains
    forced: set[str]  # of those, drained by force

    @property
    def allowed(self) -> set[str]:
        return {p.name for p in self.profiles}


@dataclass(frozen=True, slots=True)
class Current:
    """A model's kept replicas split by what the catalog asks: `current` runs what it asks
    for, `outdated` must be replaced one batch at a time (rollout.py), `given_up` an agent
    gave up on (failures.py)."""

    current: list[Replica]
    outdated: list[rollout.Outdated]
    given_up: list[Replica] = field(default_factory=list)


def plan_model(fleet: Fleet, model_id: str, current: list[Replica]) -> ModelPlan | None:
    """One model's stages, each taking and giving named sets of replicas (as Nomad's
    reconciler): lost and kept; current and outdated; failing (a rollout stops); live and
    given up; started, kept and drained (the rollout or the surplus); filled; drained by
    force; explained. None when there is nothing to say: not asked for, nothing running."""
    snapshot = fleet.snapshot
    live = live_replicas(current)
    if model_id in snapshot.frozen:
        return frozen_plan(snapshot, model_id, live)
    model = snapshot.catalog.get(model_id)
    desired = snapshot.desired.get(model_id)
    if not live and desired is None:
        return None
    want = desired.replicas if desired is not None else 0
    record = ModelRecord(model_id, want, snapshot.now)
    lines = _Lines()
    blocked = blocked_model(model, desired)
    if blocked is not None:
        return blocked_plan(record, lines, blocked, live)
    assert model is not None
    asked = asked_of(snapshot, model, desired, want)

    lost = replace_lost(snapshot, live)
    split = split_outdated(lost.kept, asked, snapshot)
    stored = snapshot.rollouts.get(model_id)
    target = rollout.revision(model, desired, asked.profiles, asked.launches, snapshot.now)
    revising = any(o.kind == "revision" for o in split.outdated)
    stuck = revising and rollout.stopped(stored, target)
    new, stopped, failed = stop_failing(
        snapshot, model_id, split.current, revising=revising, stuck=stuck
    )
    halted = stuck or failed is not None
    split = split_given_up(Current(new, split.outdated))
    crashes = judge_given_up(fleet, model_id, asked, split.given_up)
    usable = [p for p in asked.profiles if asked.launches[p.name] not in crashes.broken]
    step = roll_or_trim(split, want, model, halted=halted)
    filled = fill(
        fleet,
        model_id,
        usable,
        step.start,
        launches=asked.launches,
        avoid={p.name: crashes.avoid(asked.launches[p.name]) for p in usable},
    )
    short = step.start - len(filled.created)
    kept_old, by_force = drain_by_force(fleet, step.old, filled, short, asked.forced)
    moves = moved_elsewhere(crashes, filled.created)
    shown, scaled_away = keep_to_show(crashes, want)

    removals = lines.removed(moves) + lines.removed(lost.removed) + lines.removed(stopped)
    removals += lines.removed(step.removed) + lines.removed(by_force) + lines.removed(scaled_away)
    lines.add(f"keep {r.rid} on {_where(r)} ({_phase(snapshot, r)})" for r in step.new)
    until = "the rollout is stopped" if halted else "until its replacement is ready"
    lines.add(f"keep {r.rid} on {_where(r)} ({_phase(snapshot, r)}): {until}" for r in kept_old)
    lines.add(
        f"keep {r.rid} on {_where(r)} (gave up): profile {r.profile} fails everywhere it was tried"
        for r in shown
    )
    lines.add(f"place {r.rid} on {_where(r)}: {r.reason}" for r in filled.created)

    updated = step.new + filled.created
    kept_ids = {r.rid for r in kept_old}
    ro = rollout.record(
        model,
        stored,
        target,
        want=want,
        updated=updated,
        old=sum(1 for o in split.outdated if o.kind == "revision" and o.replica.rid in kept_ids),
        failed=failed,
        now=snapshot.now,
    )
    placed = len(updated) + len(kept_old)
    rec = record.placed(
        placed,
        len(fleet.nodes),
        filled.refusals,
        lines.text,
        waiting=short,
        failures=crashes.failures,
        broken=[p.name for p in asked.profiles if asked.launches[p.name] in crashes.broken],
        rollout="" if ro.phase == "complete" else ro.phase,
        rollout_detail=ro.reason if ro.phase == "stopped" else "",
        rollout_tail=ro.output_tail[-ROLLOUT_TAIL_SAID:] if ro.phase == "stopped" else [],
    )
    if placed < want:
        n = want - placed
        lines.add([f"{n} replica{'s' if n != 1 else ''} not placed: {rec.explanation}"])
    return ModelPlan(filled.created, removals, rec, ro)


def live_replicas(current: list[Replica]) -> list[Replica]:
    """Those counted or given up on, oldest first: the others are going already."""
    return sorted(
        (r for r in current if r.phase in REPLICA_COUNTED | REPLICA_TERMINAL),
        key=lambda r: (r.created_at, r.rid),
    )


def frozen_plan(snapshot: Snapshot, model_id: str, live: list[Replica]) -> ModelPlan:
    """A frozen model (Snapshot.frozen): nothing placed, nothing removed, and a record
    saying why, with the last count read (with none ever read, what runs)."""
    frozen = snapshot.frozen[model_id]
    placed = sum(1 for r in live if r.phase in REPLICA_COUNTED)
    stored = snapshot.placements.get(model_id)
    rec = frozen_record(
        model_id,
        frozen.blocked,
        frozen.detail,
        desired=frozen.desired if frozen.desired is not None else placed,
        placed=placed,
        now=snapshot.now,
        decisions=stored.decisions if stored else [],
    )
    return ModelPlan([], [], rec)


def blocked_plan(
    record: ModelRecord, lines: _Lines, blocked: tuple[Blocked, str], live: list[Replica]
) -> ModelPlan:
    """Nothing of the model can be placed: an unknown profile keeps what runs, anything
    else removes it."""
    reason, detail = blocked
    if reason == "unknown-profile":  # keep what runs, place nothing, say why
        counted = [r for r in live if r.phase in REPLICA_COUNTED]
        return ModelPlan([], [], record.blocked(reason, detail, len(counted), lines.text))
    text = explain.render(record.blocked(reason, detail, 0, []))
    removals = lines.removed((r, text) for r in _newest_first(live))
    return ModelPlan([], removals, record.blocked(reason, detail, 0, lines.text))


def asked_of(snapshot: Snapshot, model: Model, desired: Desired | None, want: int) -> Asked:
    profiles = _profiles(model, desired)
    return Asked(
        model=model,
        want=want,
        profiles=profiles,
        launches={
            p.name: launch_hash(model, p, snapshot.adapters.get(model.id, ()))
            for p in model.profiles
        },
        draining={n for n, o in snapshot.ops.items() if o.drain},
        forced={n for n, o in snapshot.ops.items() if o.drain and o.force},
    )


def split_outdated(kept: list[Replica], asked: Asked, snapshot: Snapshot) -> Current:
    """Current (what the catalog asks for as it runs) and outdated (another profile, a
    changed launch, a draining node, a llama-server started without adapters its node
    holds)."""
    allowed = asked.allowed
    current: list[Replica] = []
    outdated: list[rollout.Outdated] = []
    mine = snapshot.adapters.get(asked.model.id, ())
    for r in kept:
        profile = asked.model.profile(r.profile)
        engine = profile.engine if profile is not None else ""
        missing = started_without(r, engine, mine, snapshot.inventories, snapshot.shards)
        why = rollout.outdated(
            r, asked.model, allowed, asked.launches, asked.draining, started_without=missing
        )
        (current.append(r) if why is None else outdated.append(why))
    return Current(current, outdated)


def split_given_up(split: Current) -> Current:
    """Those an agent gave up on, current or outdated, taken out into `given_up`."""
    given_up = [
        r
        for r in split.current + [o.replica for o in split.outdated]
        if r.phase in REPLICA_TERMINAL
    ]
    return Current(
        [r for r in split.current if r.phase not in REPLICA_TERMINAL],
        [o for o in split.outdated if o.replica.phase not in REPLICA_TERMINAL],
        given_up,
    )


def judge_given_up(
    fleet: Fleet, model_id: str, asked: Asked, given_up: list[Replica]
) -> failures.Crashes:
    """Replicas given up on: moved, unless their launch fails everywhere it was tried."""
    snapshot = fleet.snapshot
    stored = snapshot.placements.get(model_id)
    return failures.crashes(
        ((r, r.launch or asked.launches.get(r.profile, "")) for r in given_up),
        snapshot.shards,
        stored,
        now=snapshot.now,
        cooldown=snapshot.failures.cooldown,
        nodes=snapshot.failures.nodes,
        # judged only when there is a failure to weigh: it reads every node
        eligible={
            asked.launches[p.name]: _could_run_on(fleet, model_id, p, snapshot.port_range)
            for p in asked.profiles
        }
        if given_up or _failed_lately(stored)
        else None,
    )


def keep_to_show(
    crashes: failures.Crashes, want: int
) -> tuple[list[Replica], list[tuple[Replica, str]]]:
    """Replicas of a launch that fails everywhere stay where they failed, to show why, but
    no more of them than the model is asked for: scaled down (to 0, or below them), the
    rest go like any surplus. Those kept, and those removed with why."""
    stay = [r for r, _ in crashes.stay]
    keep = max(want, 0)
    why = f"scaled down to {keep}: it had given up (its profile fails everywhere it was tried)"
    return stay[:keep], [(r, why) for r in stay[keep:]]


def roll_or_trim(split: Current, want: int, model: Model, *, halted: bool) -> rollout.Roll:
    """Outdated replicas are replaced a batch at a time (rollout.roll); with none, surplus
    replicas go (newest first) and what is missing is started."""
    if split.outdated:
        return rollout.roll(
            split.outdated, split.current, want, model.surge, model.max_unavailable, stopped=halted
        )
    surplus = remove_surplus(split.current, want)
    return rollout.Roll(surplus.kept, [], surplus.removed, want - len(surplus.kept))


def stop_failing(
    snapshot: Snapshot, model_id: str, new: list[Replica], *, revising: bool, stuck: bool
) -> tuple[list[Replica], list[tuple[Replica, str]], rollout.Failing | None]:
    """A rollout whose new replicas fail stops, and they go; the old ones keep serving.
    The new replicas kept, those removed with why, and the failure that stops it now (None
    when it was stopped already, or nothing fails)."""
    bad = [rollout.Failing(r, s) for r in new if (s := rollout.failing(r, snapshot.shards))]
    if not (revising and bad):
        return new, [], None
    text = "rollout stopped: " + rollout.stop_text(model_id, bad[0])
    going = {f.replica.rid for f in bad}
    kept = [r for r in new if r.rid not in going]
    return kept, [(f.replica, text) for f in bad], None if stuck else bad[0]


def drain_by_force(
    fleet: Fleet, old: list[Replica], filled: Filled, short: int, forced: set[str]
) -> tuple[list[Replica], list[tuple[Replica, str]]]:
    """`llmgw node drain --force`: an old replica on such a node whose replacement found no
    node drains anyway. The old replicas kept, and those drained with why."""
    kept = list(old)
    if not (short > 0 and forced):
        return kept, []
    why = explain.render_refusals(len(fleet.nodes), filled.refusals)
    going = [r for r in kept if any(m.node in forced for m in r.members)][:short]
    for r in going:
        kept.remove(r)
    return kept, [(r, f"drained by force: nowhere else to place it ({why})") for r in going]


def moved_elsewhere(crashes: failures.Crashes, created: list[Replica]) -> list[tuple[Replica, str]]:
    """Replicas given up on, removed, each saying where its successor went (the first
    replicas placed in this plan): "failed 5 times on node05 (...); moved to node06"."""
    out = []
    for i, (r, f) in enumerate(crashes.move):
        to = _where(created[i]) if i < len(created) else ""
        failures.moved(crashes, r.rid, to)
        where = f"moved to {to}" if to else "not placed elsewhere yet"
        text = explain.failure_text(f)
        out.append((r, f"failed {f.restarts + 1} times on {f.node} ({text}); {where}"))
    return out


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


def _failed_lately(stored: PlacementRecord | None) -> bool:
    return stored is not None and bool(stored.failures)


ROLLOUT_TAIL_SAID = 5  # engine lines a stopped rollout's placement record carries


def _could_run_on(fleet: Fleet, model_id: str, profile: Profile, ports: tuple[int, int]) -> int:
    """Nodes that could run `profile` at all, whatever runs on them now: what a launch must
    fail on before the profile, not the nodes, is taken for the problem on a small fleet."""
    need = Need.of(model_id, profile, ports)
    return sum(1 for node in fleet.nodes.values() if could_run(node, need))


def replace_lost(snapshot: Snapshot, live: list[Replica]) -> Sorted:
    """A replica with a member on a lost node is removed (and so replaced by the fill step);
    a multi-node replica goes whole."""
    kept, removed = [], []
    for replica in live:
        gone = _gone_node(snapshot, replica)
        if gone is not None:
            removed.append((replica, f"{gone}; replaced"))
        else:
            kept.append(replica)
    return Sorted(kept, removed)


def remove_surplus(replicas: list[Replica], want: int) -> Sorted:
    """More than desired: the newest go first."""
    extra = _newest_first(replicas)[: max(len(replicas) - want, 0)]
    going = {r.rid for r in extra}
    why = "desired is 0: draining" if want == 0 else f"desired lowered to {want}"
    return Sorted([r for r in replicas if r.rid not in going], [(r, why) for r in extra])


def fill(
    fleet: Fleet,
    model_id: str,
    profiles: list[Profile],
    missing: int,
    *,
    launches: dict[str, str] | None = None,
    avoid: dict[str, frozenset[str]] | None = None,
) -> Filled:
    """Place each missing replica with the first profile (in catalog order) that
    fits somewhere. A profile that found no node stays exhausted: resources only shrink
    within a plan. `avoid`: per profile, nodes where its launch was given up on lately."""
    pickers: list[tuple[Profile, Picker]] = []
    created: list[Replica] = []
    for _ in range(missing):
        found = _place_one(fleet, model_id, profiles, pickers, launches or {}, avoid or {})
        if found is None:
            break
        created.append(found)
    if len(created) == missing:
        return Filled(created, [])  # nothing to explain
    return Filled(created, [(p.name, pk.refusals()) for p, pk in pickers])


def _place_one(
    fleet: Fleet,
    model_id: str,
    profiles: list[Profile],
    pickers: list[tuple[Profile, Picker]],
    launches: dict[str, str],
    avoid: dict[str, frozenset[str]],
) -> Replica | None:
    snapshot = fleet.snapshot
    for i, profile in enumerate(profiles):
        launch = launches.get(profile.name, "")
        if i == len(pickers):
            need = Need.of(
                model_id,
                profile,
                snapshot.port_range,
                launch=launch,
                avoid=avoid.get(profile.name, frozenset()),
            )
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
            launch=launch,
        )
    return None


def _phase(snapshot: Snapshot, replica: Replica) -> str:
    """The replica's phase as its shards say it, with the reason of a failed one: the record's
    lines agree with what `llmgw status` shows."""
    if replica.phase != "failed":
        return replica.phase
    for m in replica.members:
        s = snapshot.shards.get((m.node, replica.rid))
        if s is not None and s.phase == "failed" and s.reason:
            return f"failed on {m.node}: {s.reason}"
    return "failed"


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
