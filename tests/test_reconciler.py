"""The reconciler's passes, without NATS: a pass takes the view and a time and returns its
changes as data (controller/reconciler.py); these tests assert on what it returns."""

from __future__ import annotations

import typing

import msgspec
from import_helpers import loaded
from record_helpers import shard
from test_placement import model

from llmgw.bus import keys
from llmgw.bus.records import (
    Desired,
    FabricHoldings,
    Health,
    Lease,
    Replica,
    ReplicaMember,
)
from llmgw.controller.changes import (
    SAID,
    Change,
    Derived,
    Draining,
    NodeJudged,
    NodesJudged,
    Notice,
    Placed,
    Removed,
    RolloutIs,
    Why,
    mirror,
    said,
    stamped,
)
from llmgw.controller.clock import Instant, ManualClock
from llmgw.controller.liveness import HealthChange, HealthChanges
from llmgw.controller.reconciler import PassSettings, Reconciler, health_changes
from llmgw.controller.view import View
from llmgw.sim.bare import inventory

NOW = Instant(monotonic=100.0, wall=1000.0)


def _view(nodes: list[str], *, replicas: int = 1) -> View:
    view = View()
    for name in nodes:
        view.nodes[name] = inventory(name, gpus=1, started_at=0.0)
        view.leases[name] = Lease(
            node=name, seq=1, time=0.0, started_at=0.0, memory=view.nodes[name].memory
        )
    m = model(key="org/m")
    view.catalog["m"] = m
    view.desired["m"] = Desired(model="m", replicas=replicas, updated_at=5.0)
    return view


def _run(view: View, phases: dict[str, str] | None = None):
    phases = phases or {n: "ready" for n in view.nodes}
    reconciler = Reconciler(PassSettings(), ManualClock())
    return reconciler.run(view, phases, NOW)


def _writes(changes) -> list[Change]:
    return [c for c in changes if isinstance(c, Change)]


def test_a_pass_returns_the_replica_before_its_assignment_and_then_the_placement_record():
    view = _view(["gpu-a"])
    changes = [c for c in _writes(_run(view).changes) if not c.key.startswith(keys.FABRICS)]
    kinds = [(keys.parse(c.key).prefix, type(c.why)) for c in changes]
    assert kinds == [
        (keys.REPLICAS, Placed),
        (keys.ASSIGN, Derived),
        (keys.ROLLOUT, Derived),  # a first placement: no rollout to announce
        (keys.PLACEMENT, Derived),
    ]
    replica = changes[0].record
    assert isinstance(replica, Replica) and [m.node for m in replica.members] == ["gpu-a"]
    assert changes[1].key == keys.assign("gpu-a", replica.rid)


def test_a_first_placement_announces_no_rollout_and_the_end_of_one_says_how_many_are_ready():
    """It logged "rollout complete: every replica runs the current revision" at a model's
    first pass, while 0 of 1 replica was placed."""
    view = _view(["gpu-a"])
    (first,) = [c for c in _writes(_run(view).changes) if c.key == keys.rollout("m")]
    assert isinstance(first.why, Derived) and first.record.phase == "complete"
    view.rollouts["m"] = msgspec.structs.replace(first.record, phase="progressing", old=1)
    (ended,) = [c for c in _writes(_run(view).changes) if isinstance(c.why, RolloutIs)]
    announced = said(ended.why)
    assert announced is not None and announced.text == (
        "m rollout complete: no replica of an older revision left; 0/1 of the current one ready"
    )


def test_a_pass_changes_nothing_in_the_view_it_reads():
    view = _view(["gpu-a"])
    _run(view)
    assert view.replicas == {} and view.assigns == {} and view.placements == {}


def test_a_pass_over_the_view_its_changes_made_changes_nothing():
    """Level-triggered: once what a pass decided is stored, the same pass again is idle."""
    view = _view(["gpu-a", "gpu-b"], replicas=2)
    for c in _writes(_run(view).changes):
        mirror(view, c.key, c.record)
    assert len(view.replicas) == 2
    assert _writes(_run(view).changes) == []


def test_a_replica_on_a_lost_node_is_drained_and_replaced_elsewhere():
    view = _view(["gpu-a", "gpu-b"])
    for c in _writes(_run(view, {"gpu-a": "ready", "gpu-b": "lost"}).changes):
        mirror(view, c.key, c.record)
    (rid,) = view.replicas
    gone = "gpu-a"
    changes = _writes(_run(view, {gone: "lost", "gpu-b": "ready"}).changes)
    drained = [c for c in changes if isinstance(c.why, Draining)]
    placed = [c for c in changes if isinstance(c.why, Placed)]
    assert [c.key for c in drained] == [keys.replica("m", rid)]
    assert drained[0].record.phase == "draining" and "lost" in drained[0].why.reason
    assert [m.node for m in placed[0].record.members] == ["gpu-b"]
    # the drained one's assignment says drain, in the same pass
    assign = next(c for c in changes if c.key == keys.assign(gone, rid))
    assert assign.record.action == "drain"


def test_a_drained_replica_whose_node_is_lost_is_removed_with_its_assignment():
    view = _view(["gpu-a"], replicas=0)
    r = Replica(
        model="m",
        rid="r1",
        profile="p",
        members=[ReplicaMember(node="gpu-a", rank=0, gpus=[], port=18000)],
        phase="draining",
    )
    view.replicas["r1"] = r
    for c in _writes(_run(view, {"gpu-a": "lost"}).changes):
        mirror(view, c.key, c.record)
    assert view.replicas == {}
    changes = _writes(_run(view, {"gpu-a": "lost"}).changes)
    assert not any(isinstance(c.why, Removed) for c in changes)


def test_fabrics_the_fleet_no_longer_has_are_deleted():
    view = _view(["gpu-a"])
    view.fabrics["gone"] = FabricHoldings(fabric="gone", nodes=[])
    changes = _writes(_run(view).changes)
    assert Change(keys.fabric("gone"), None, Derived("fabric")) in changes


def test_a_fleets_worth_of_judgements_is_said_quietly_and_in_one_line():
    def judged(n: int) -> HealthChanges:
        return HealthChanges(
            write=[
                HealthChange(Health(node=f"n{i}", phase="ready", since=0.0), None) for i in range(n)
            ]
        )

    few = health_changes(judged(3))
    assert all(isinstance(c, Change) and not c.why.quiet for c in few)
    many = health_changes(judged(21))
    assert all(c.why.quiet for c in many if isinstance(c, Change))
    assert many[-1] == Notice(NodesJudged({"ready": 21}))
    assert said(many[0].why).level < said(few[0].why).level


def test_every_reason_has_its_row_in_the_one_table():
    assert set(SAID) == set(typing.get_args(Why))


def test_the_epoch_is_stamped_only_on_records_that_carry_one():
    health = Health(node="a", phase="ready", since=0.0)
    assert stamped(health, 7).epoch == 7
    fabric = FabricHoldings(fabric="f", nodes=[])
    assert msgspec.structs.asdict(stamped(fabric, 7)) == msgspec.structs.asdict(fabric)


def test_a_judged_node_is_said_with_its_previous_phase():
    h = Health(node="a", phase="unreachable", since=0.0, reason="no heartbeat for 20 s")
    s = said(NodeJudged(h, "ready"))
    assert s.text == "node a: ready -> unreachable (no heartbeat for 20 s)"
    assert s.event.kind == "node-unreachable" and s.event.data == {"previous": "ready"}


def test_the_reconciler_imports_nothing_that_talks_to_nats():
    talking = ("llmgw.bus.client", "llmgw.controller.loop", "llmgw.controller.writer")
    assert loaded("llmgw.controller.reconciler", packages=("nats",), modules=talking) == []


def test_a_launch_refused_before_launch_is_a_failed_start_once_its_agent_stops_trying():
    """The agent refuses a launch it cannot run and waits for a new assignment: before, the
    replica stayed failed for good. Once that stands still for refused_after, it is given up
    and moves, its node avoided for that launch."""
    view = _view(["gpu-a", "gpu-b"])
    reconciler = Reconciler(PassSettings(refused_after=30.0), ManualClock())
    phases = {"gpu-a": "ready", "gpu-b": "ready"}
    changes = _writes(reconciler.run(view, {"gpu-a": "ready"}, NOW).changes)
    for c in changes:
        mirror(view, c.key, c.record)
    (replica,) = view.replicas.values()
    (member,) = replica.members
    view.shards[(member.node, replica.rid)] = shard(
        member.node,
        replica.rid,
        "failed",
        since=5.0,
        reason="refused before launch: fetch dir /var/lib/llmgw/fetch is not writable",
    )

    def at(seconds: float) -> list[Change]:
        now = Instant(monotonic=NOW.monotonic + seconds, wall=NOW.wall + seconds)
        return _writes(reconciler.run(view, phases, now).changes)

    assert not any(isinstance(c.why, Draining) for c in at(1.0))  # it may still try
    later = at(31.0)
    (drained,) = [c for c in later if isinstance(c.why, Draining)]
    assert drained.key == keys.replica("m", replica.rid)
    assert "failed 1 times on gpu-a (refused before launch: fetch dir" in drained.why.reason
    (placed,) = [c for c in later if isinstance(c.why, Placed)]
    assert [m.node for m in placed.record.members] == ["gpu-b"]


def test_an_agent_that_reports_again_is_still_trying():
    view = _view(["gpu-a"])
    reconciler = Reconciler(PassSettings(refused_after=30.0), ManualClock())
    for c in _writes(reconciler.run(view, {"gpu-a": "ready"}, NOW).changes):
        mirror(view, c.key, c.record)
    (replica,) = view.replicas.values()
    key = ("gpu-a", replica.rid)
    for i in range(5):  # an error it retries: a new report (since) every 10 s
        view.shards[key] = shard("gpu-a", replica.rid, "failed", since=i * 10.0)
        now = Instant(monotonic=NOW.monotonic + i * 10.0, wall=NOW.wall + i * 10.0)
        changes = _writes(reconciler.run(view, {"gpu-a": "ready"}, now).changes)
        assert not any(isinstance(c.why, Draining) for c in changes)
