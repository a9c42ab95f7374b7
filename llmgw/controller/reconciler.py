"""The reconciler: what the bucket should hold, computed from the view and a time, returned
as changes (controller/changes.py) for the writer to apply. No I/O: a pass is tested by
the changes it returns, as placement is by its plan.

Three stages, each its own call, in the order the loop runs them: nodes judged (health),
the autoscaler's counts (scale), and the placement pass: fabrics, replicas created and
moved, their phases, those drained, the assignments derived from the replicas, rollouts and
placement records. Replicas come before their assignments and assignments are derived from
replicas on every pass, so a controller killed between two writes finishes the job after
its restart instead of duplicating or orphaning anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.records import NodePhase
from llmgw.controller import adapters, placement
from llmgw.controller.autoscale import scaled_text
from llmgw.controller.changes import (
    Change,
    Derived,
    Draining,
    NodeJudged,
    NodesJudged,
    Notice,
    NotPlacedNow,
    Placed,
    PortMoved,
    Qualifies,
    Removed,
    ReplicaIs,
    RolloutIs,
    Scaled,
    Unplaced,
    mirror,
)
from llmgw.controller.clock import Clock, Instant
from llmgw.controller.inputs import StoppedTrying, adapters_by_base, placement_snapshot
from llmgw.controller.liveness import HealthChanges
from llmgw.controller.view import Freeze, View

REFUSED_AFTER_S = 30.0
MANY_JUDGED = 20  # more phase changes at once than this are a fleet's worth: said in one line


def health_changes(judged: HealthChanges) -> list[Change | Notice]:
    """`health.<node>` where a node's phase changed, and deleted for a decommissioned one."""
    quiet = len(judged.write) > MANY_JUDGED
    out: list[Change | Notice] = [
        Change(keys.health(c.record.node), c.record, NodeJudged(c.record, c.previous, quiet))
        for c in judged.write
    ]
    out += [Change(keys.health(node), None, Derived("health")) for node in judged.delete]
    if quiet:
        counts: dict[str, int] = {}
        for c in judged.write:
            counts[c.record.phase] = counts.get(c.record.phase, 0) + 1
        out.append(Notice(NodesJudged(counts)))
    return out


def scale_changes(view: View, decided: Mapping[str, records.Scale]) -> list[Change]:
    """`scale.<model>` where the autoscaler decided anew (said when its count moved), and
    deleted for models no longer autoscaled: `--auto` later starts from what runs."""
    out = []
    for model, scale in decided.items():
        old = view.scales.get(model)
        counted = old is None or old.replicas != scale.replicas
        out.append(Change(keys.scale(model), scale, Scaled(scale) if counted else Derived("scale")))
    out += [
        Change(keys.scale(m), None, Derived("scale"))
        for m in view.scales
        if not (m in view.desired and view.desired[m].auto)
    ]
    return out


def placed_counts(view: View) -> dict[str, int]:
    """Each model's replicas that count toward its desired count."""
    placed: dict[str, int] = {}
    for r in view.replicas.values():
        if r.phase in records.REPLICA_COUNTED:
            placed[r.model] = placed.get(r.model, 0) + 1
    return placed


@dataclass(frozen=True, slots=True)
class PassSettings:
    port_range: tuple[int, int] = placement.DEFAULT_PORTS
    # a pass that planned for longer than this judges its chosen nodes again
    recheck_after: float = 2.0
    failures: placement.FailurePolicy = field(default_factory=placement.FailurePolicy)
    # a launch its agent stopped trying (refused before launch) standing still this long
    # is read as given up: moved, or waits, explained
    refused_after: float = REFUSED_AFTER_S
    # where LoRA adapters are loaded, and the churn budget (controller/adapters.py)
    adapter_policy: adapters.AdapterPolicy = field(default_factory=adapters.AdapterPolicy)


@dataclass(frozen=True)
class Pass:
    changes: list[Change | Notice]
    again: bool = False  # a replica was held back: the next tick runs another pass


class _Pending:
    """The pass's own copy of the tables it writes, each change stored as decided: every
    step reads what the steps before it decided, as the bucket holds it once written."""

    def __init__(self, view: View) -> None:
        self.view = view  # read only: its tables change as the writer stores each change
        self.fabrics = dict(view.fabrics)
        self.replicas = dict(view.replicas)
        self.assigns = dict(view.assigns)
        self.placements = dict(view.placements)
        self.rollouts = dict(view.rollouts)
        self.changes: list[Change | Notice] = []

    def put(self, key: str, record: msgspec.Struct, why) -> None:
        self.changes.append(Change(key, record, why))
        mirror(self, key, record)

    def delete(self, key: str, why) -> None:
        self.changes.append(Change(key, None, why))
        mirror(self, key, None)

    def say(self, why) -> None:
        self.changes.append(Notice(why))


class Reconciler:
    """The placement pass. It keeps, between passes, only what makes them cheaper or says
    what changed: the memo of what each inventory says, and which nodes qualified for each
    waiting model."""

    def __init__(self, settings: PassSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock  # read again after planning: how long the plan took
        self.inventories = placement.InventoryMemo()
        self.qualifying: dict[str, set[str]] = {}
        self.stopped = StoppedTrying(settings.refused_after)

    def snapshot(
        self,
        view: View,
        phases: Mapping[str, NodePhase],
        frozen: Mapping[str, Freeze],
        now: Instant,
        shards: Mapping[tuple[str, str], records.Shard] | None = None,
    ) -> placement.Snapshot:
        """The plan's input (controller/inputs.py, as `llmgw place --dry-run` builds it)."""
        return placement_snapshot(
            view,
            phases,
            frozen,
            port_range=self.settings.port_range,
            now=now.wall,
            failures=self.settings.failures,
            memo=self.inventories,
            shards=shards,
        )

    def run(
        self,
        view: View,
        phases: Mapping[str, NodePhase],
        now: Instant,
        judge_again: Callable[[float], Mapping[str, NodePhase]] | None = None,
        demand: Mapping[str, adapters.Demand] | None = None,
    ) -> Pass:
        """One pass over the whole view at `now`. `judge_again(monotonic)`: every node's
        phase at a later moment, for a plan that took long (default: as `phases`).
        `demand`: each LoRA adapter's, from the routers' loads (controller/adapters.py)."""
        pending = _Pending(view)
        frozen = view.frozen()
        # the shards as this pass reads them: a launch its agent stopped trying, given up
        shards = self.stopped.shards(view.shards, now.monotonic)
        snap = self.snapshot(view, phases, frozen, now, shards)
        self._fabrics(pending, snap.fabrics or {})
        # the fleet is built once a pass, for both (and with the cycle collector paused)
        with placement.collector_paused():
            nodes = placement.fleet_nodes(snap, self.inventories)
        # before planning: a node that just started qualifying is placed on in this same pass
        self._report_qualifying(pending, snap, nodes)
        plan = placement.plan(snap, nodes, self.inventories)
        creates, again = self._still_placeable(pending, plan.create, now, judge_again)
        for move in plan.port_moves:
            pending.put(
                keys.replica(move.replica.model, move.replica.rid),
                move.replica,
                PortMoved(move.replica, move.why),
            )
        for replica in creates:
            pending.put(keys.replica(replica.model, replica.rid), replica, Placed(replica))
        # the phases first: the plan read them from the shards, so a replacement it counted
        # ready is written ready before the replica it replaces is written draining (the
        # stored ready count never dips in between)
        self._replica_phases(pending, snap.health, shards)
        for removal in plan.remove:
            replica = pending.replicas.get(removal.rid)
            if replica is not None and replica.phase not in records.REPLICA_GOING:
                drained = msgspec.structs.replace(replica, phase="draining", reason=removal.reason)
                pending.put(
                    keys.replica(replica.model, replica.rid),
                    drained,
                    Draining(drained, removal.reason),
                )
        self._assignments(pending, shards, now.wall, demand or {})
        # before the placement records: `llmgw place --wait` reads both once it sees its
        # decision in placement.<model>
        self._rollouts(pending, plan, frozen)
        self._placements(pending, plan)
        new_waiting = [  # a baseline for models now waiting
            model
            for model, rec in pending.placements.items()
            if rec.placed < rec.desired and model not in self.qualifying
        ]
        self.qualifying.update(placement.qualifying_nodes_by_model(snap, new_waiting))
        return Pass(pending.changes, again)

    def _fabrics(self, pending: _Pending, view: dict[str, records.FabricHoldings]) -> None:
        for name, holdings in view.items():
            if pending.fabrics.get(name) != holdings:
                pending.put(keys.fabric(name), holdings, Derived("fabric"))
        for name in [n for n in pending.fabrics if n not in view]:
            pending.delete(keys.fabric(name), Derived("fabric"))

    def _still_placeable(
        self,
        pending: _Pending,
        creates: list[records.Replica],
        now: Instant,
        judge_again: Callable[[float], Mapping[str, NodePhase]] | None,
    ) -> tuple[list[records.Replica], bool]:
        """A plan made from the pass's instant holds only while that instant is recent: a
        pass that took long (60 s once gave 660 replicas to a node dead for 61 s) judges
        the chosen nodes again, now, and leaves a replica whose node is no longer ready to
        the next pass, which places it elsewhere."""
        later = self.clock.monotonic()
        took = later - now.monotonic
        if not creates or took <= self.settings.recheck_after or judge_again is None:
            return creates, False
        phases = judge_again(later)
        kept = []
        for r in creates:
            gone = tuple(m.node for m in r.members if phases.get(m.node) != "ready")
            if gone:
                pending.say(NotPlacedNow(r, took, gone))
            else:
                kept.append(r)
        return kept, len(kept) < len(creates)

    def _replica_phases(
        self,
        pending: _Pending,
        phases: Mapping[str, str],
        read: Mapping[tuple[str, str], records.Shard],
    ) -> None:
        view = pending.view
        for rid, replica in list(pending.replicas.items()):
            shards = [read.get((m.node, rid)) for m in replica.members]
            if replica.phase == "draining":
                if all(
                    _member_done(m.node, s, phases)
                    for m, s in zip(replica.members, shards, strict=True)
                ):
                    self._forget(pending, replica, "drained")
                continue
            phase, endpoint = records.phase_from_shards(replica, shards)
            launch = replica.launch or _launch_of(view, replica)
            if (phase, endpoint, launch) != (replica.phase, replica.endpoint, replica.launch):
                updated = msgspec.structs.replace(
                    replica, phase=phase, endpoint=endpoint, launch=launch
                )
                said = phase != replica.phase and phase in ("ready", "failed", "gave-up")
                pending.put(
                    keys.replica(replica.model, rid),
                    updated,
                    ReplicaIs(updated, replica.phase) if said else Derived("replica"),
                )

    def _forget(self, pending: _Pending, replica: records.Replica, why: str) -> None:
        for m in replica.members:
            if (m.node, replica.rid) in pending.assigns:
                pending.delete(keys.assign(m.node, replica.rid), Derived("assignment"))
        pending.delete(keys.replica(replica.model, replica.rid), Removed(replica, why))

    def _assignments(
        self,
        pending: _Pending,
        shards: Mapping[tuple[str, str], records.Shard],
        wall: float,
        demand: Mapping[str, adapters.Demand],
    ) -> None:
        view = pending.view
        lora = adapters.plan(
            catalog=view.catalog,
            adapters=adapters_by_base(view),
            nodes=view.nodes,
            shards=shards,
            replicas=pending.replicas,
            assigns=pending.assigns,
            demand=demand,
            now=wall,
            policy=self.settings.adapter_policy,
            frozen=view.unreadable_of(keys.ADAPTERS),
        )
        wanted = wanted_assignments(view, pending.replicas, pending.assigns, lora)
        for (node, rid), want in wanted.items():
            have = pending.assigns.get((node, rid))
            # the epoch says who wrote it, and is no change by itself
            if have is not None and msgspec.structs.replace(have, generation=0, epoch=0) == want:
                continue
            record = msgspec.structs.replace(want, generation=(have.generation + 1) if have else 1)
            pending.put(keys.assign(node, rid), record, Derived("assignment"))
        for node, rid in [k for k in pending.assigns if k not in wanted]:
            # its replica is gone: an orphan
            pending.delete(keys.assign(node, rid), Derived("assignment"))

    def _rollouts(
        self, pending: _Pending, plan: placement.Plan, frozen: Mapping[str, Freeze]
    ) -> None:
        view = pending.view
        for model, ro in plan.rollouts.items():
            if model in view.desired:
                ro = msgspec.structs.replace(ro, desired_at=view.desired[model].updated_at)
            old = pending.rollouts.get(model)
            if old is not None and placement.same_rollout(old, ro):
                continue
            said = placement.rollout_news(old, ro)
            pending.put(keys.rollout(model), ro, RolloutIs(ro) if said else Derived("rollout"))
        placed = {r.model for r in pending.replicas.values()}
        for model in [
            m
            for m in pending.rollouts
            if m not in view.catalog and m not in frozen and m not in placed
        ]:
            # the model is gone, and so its history
            pending.delete(keys.rollout(model), Derived("rollout"))

    def _placements(self, pending: _Pending, plan: placement.Plan) -> None:
        view = pending.view
        # a frozen model's record is the plan's too (placement.Frozen): the plan keeps
        # its replicas, as a garbled or deleted catalog entry is no request to remove it
        records_by_model = plan.placements
        for model, rec in records_by_model.items():
            if model in view.desired:
                rec = msgspec.structs.replace(
                    rec,
                    desired_at=view.desired[model].updated_at,
                    scaled=scaled_text(
                        view.desired[model], view.catalog.get(model), view.scales.get(model)
                    ),
                )
            old = pending.placements.get(model)
            # by the data, never the text: free RAM moves at every heartbeat, a decision
            # does not
            if old is not None and placement.same_decision(old, rec):
                continue
            why = Unplaced(rec) if rec.explanation else Derived("placement")
            pending.put(keys.placement(model), rec, why)
        for model in [
            m for m in pending.placements if m not in records_by_model and m not in view.desired
        ]:
            pending.delete(keys.placement(model), Derived("placement"))

    def _report_qualifying(
        self,
        pending: _Pending,
        snap: placement.Snapshot,
        nodes: dict[str, placement.NodeState],
    ) -> None:
        """Say when a node starts or stops qualifying for a model still waiting: the answer
        to "why was this placed an hour after it was asked for"."""
        waiting = {m for m, p in pending.placements.items() if p.placed < p.desired}
        for model in list(self.qualifying):
            if model not in waiting:
                del self.qualifying[model]
        with placement.collector_paused():
            qualifying = placement.qualifying_nodes_by_model(snap, waiting, nodes)
        for model in waiting:
            now_q = qualifying[model]
            before = self.qualifying.get(model)
            self.qualifying[model] = now_q
            if before is None:
                continue
            for node in sorted(now_q - before):
                pending.say(Qualifies(node, model, True))
            for node in sorted(before - now_q):
                pending.say(Qualifies(node, model, False))


def wanted_assignments(
    view: View,
    replicas: Mapping[str, records.Replica],
    assigns: Mapping[tuple[str, str], records.Assignment],
    lora: Mapping[str, adapters.Given] | None = None,
) -> dict[tuple[str, str], records.Assignment]:
    """Every assignment the replicas ask for (generation and epoch left 0); `lora`: each
    replica's LoRA room and adapters (controller/adapters.py; its rank 0 serves them)."""
    wanted: dict[tuple[str, str], records.Assignment] = {}
    for rid, r in replicas.items():
        rank0 = next((m for m in r.members if m.rank == 0), r.members[0])
        master = view.nodes[rank0.node].address if rank0.node in view.nodes else ""
        fabric = _shared_fabric(r, view.nodes) if len(r.members) > 1 else None
        action = "drain" if r.phase == "draining" else "run"
        model = view.catalog.get(r.model)
        for m in r.members:
            have = assigns.get((m.node, rid))
            # an invalid or missing entry changes nothing: keep what the agent has
            digest = (
                _catalog_hash(model) if model is not None else (have.catalog_hash if have else "")
            )
            given = (lora or {}).get(rid)
            wanted[(m.node, rid)] = records.Assignment(
                lora=given.room if given else None,
                adapters=given.adapters if given and m.rank == 0 else [],
                catalog_hash=digest,
                model=r.model,
                rid=rid,
                profile=r.profile,
                action=action,
                generation=0,
                rank=m.rank,
                nodes=len(r.members),
                master_addr=master,
                gpus=list(m.gpus),
                port=m.port,
                fabric=fabric,
            )
    return wanted


def _launch_of(view: View, replica: records.Replica) -> str:
    """A replica placed before launches were recorded is taken as running the catalog's."""
    model = view.catalog.get(replica.model)
    profile = model.profile(replica.profile) if model else None
    if model is None or profile is None:
        return ""
    mine = [a for a in view.adapters.values() if a.base == model.id]
    return catalog.launch_hash(model, profile, sorted(mine, key=lambda a: a.id))


def _catalog_hash(model) -> str:
    return hashlib.sha256(catalog.encode_model(model)).hexdigest()[:16]


def _member_done(node: str, shard: records.Shard | None, phases: Mapping[str, str]) -> bool:
    if phases.get(node, "lost") == "lost":
        return True  # nothing left to wait for there
    return shard is not None and shard.phase in records.SHARD_ENGINE_GONE


def _shared_fabric(
    replica: records.Replica, nodes: Mapping[str, records.NodeInventory]
) -> str | None:
    common: set[str] | None = None
    for m in replica.members:
        inv = nodes.get(m.node)
        fabrics = inv.fabrics() if inv else set()
        common = fabrics if common is None else common & fabrics
    return min(common) if common else None
