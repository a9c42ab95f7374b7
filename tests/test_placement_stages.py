"""plan_model's stages, each alone: named sets of replicas in, named sets out
(controller/placement/steps.py)."""

from __future__ import annotations

from typing import get_args

import msgspec
from test_placement import model, node, replica, snapshot

from llmgw.bus.records import NodeOps, PlacementRecord, Replica
from llmgw.catalog import launch_hash
from llmgw.controller.placement import Frozen, plan
from llmgw.controller.placement.rollout import Outdated
from llmgw.controller.placement.steps import (
    Current,
    asked_of,
    live_replicas,
    roll_or_trim,
    split_given_up,
    split_outdated,
)


def _asked(snap, m, want=1):
    return asked_of(snap, m, snap.desired.get(m.id), want)


def test_live_replicas_leave_out_those_going_away_oldest_first():
    a = replica("ra", [("n1", [0])], created_at=2.0)
    b = replica("rb", [("n1", [1])], created_at=1.0, phase="gave-up")
    going = replica("rc", [("n1", [2])], phase="draining")
    assert [r.rid for r in live_replicas([a, b, going])] == ["rb", "ra"]


def test_split_outdated_tells_current_from_a_changed_launch_and_a_draining_node():
    m = model()
    launch = launch_hash(m, m.profiles[0])
    snap = snapshot(
        [node("n1"), node("n2")], [m], {"m": 3}, ops={"n2": NodeOps(node="n2", state="draining")}
    )
    same = msgspec.structs.replace(replica("ra", [("n1", [0])]), launch=launch)
    changed = msgspec.structs.replace(replica("rb", [("n1", [1])]), launch="other")
    drained = msgspec.structs.replace(replica("rc", [("n2", [0])]), launch=launch)
    split = split_outdated([same, changed, drained], _asked(snap, m), snap)
    assert [r.rid for r in split.current] == ["ra"]
    assert [(o.replica.rid, o.kind) for o in split.outdated] == [
        ("rb", "revision"),
        ("rc", "drain"),
    ]


def test_split_given_up_takes_them_out_of_current_and_outdated_alike():
    ok = replica("ra", [("n1", [0])])
    gave_up = replica("rb", [("n1", [1])], phase="gave-up")
    old_gave_up = replica("rc", [("n1", [2])], phase="gave-up")
    split = split_given_up(Current([ok, gave_up], [Outdated(old_gave_up, "revision", "x")]))
    assert [r.rid for r in split.current] == ["ra"]
    assert split.outdated == []
    assert [r.rid for r in split.given_up] == ["rb", "rc"]


def test_roll_or_trim_removes_surplus_when_nothing_is_outdated_and_starts_what_is_missing():
    m = model()
    a, b = (
        replica("ra", [("n1", [0])], created_at=1.0),
        replica("rb", [("n1", [1])], created_at=2.0),
    )
    trimmed = roll_or_trim(Current([a, b], []), 1, m, halted=False)
    assert [r.rid for r, _ in trimmed.removed] == ["rb"] and trimmed.start == 0
    grown = roll_or_trim(Current([a], []), 3, m, halted=False)
    assert grown.removed == [] and grown.start == 2


def test_roll_or_trim_rolls_while_something_is_outdated():
    m = model()
    old = Outdated(replica("ro", [("n1", [0])]), "revision", "replaced")
    step = roll_or_trim(Current([], [old]), 1, m, halted=False)
    assert step.old == [old.replica] and step.start == 1  # a new one first, then the old drains
    stopped = roll_or_trim(Current([], [old]), 1, m, halted=True)
    assert stopped.start == 0


def test_a_frozen_model_is_decided_by_the_plan_nothing_placed_nothing_removed():
    """The planner, not the loop, keeps a frozen model as it is: `llmgw place --dry-run`
    shows the record the controller writes."""
    running: Replica = replica("rf", [("n1", [0])])
    stored = PlacementRecord(model="m", desired=1, placed=1, decisions=["keep rf on n1"])
    snap = snapshot(
        [node("n1")],
        [],
        {},
        replicas=[running],
        placements={"m": stored},
        frozen={"m": Frozen("invalid-catalog", "profiles[0].name: expected a string", 2)},
    )
    result = plan(snap)
    assert result.create == [] and result.remove == []
    rec = result.placements["m"]
    assert (rec.blocked, rec.desired, rec.placed) == ("invalid-catalog", 2, 1)
    assert rec.decisions == ["keep rf on n1"]
    assert "expected a string" in rec.explanation


def test_a_frozen_model_with_no_count_ever_read_asks_for_what_runs():
    snap = snapshot(
        [node("n1")],
        [],
        {},
        replicas=[replica("rf", [("n1", [0])])],
        frozen={"m": Frozen("catalog-deleted")},
    )
    rec = plan(snap).placements["m"]
    assert (rec.blocked, rec.desired, rec.placed) == ("catalog-deleted", 1, 1)


def test_every_freezing_reason_is_explained_and_read_as_frozen():
    """One list of the reasons that freeze a model (records.FREEZING): the planner's record
    for each is explained in words, and the fleet's read model calls it frozen."""
    from llmgw.bus.records import FREEZING
    from llmgw.controller.placement.explain import Blocked
    from llmgw.fleetstate.build import fleet
    from llmgw.fleetstate.decode import FleetRecords

    assert FREEZING < set(get_args(Blocked))
    for reason in sorted(FREEZING):
        snap = snapshot([node("n1")], [], {}, frozen={"m": Frozen(reason, "what is wrong", 1)})
        rec = plan(snap).placements["m"]
        assert rec.blocked == reason and not rec.explanation.startswith(reason)
        read = FleetRecords(placements={"m": rec})
        assert fleet(read, 0.0).models["m"].placement.frozen
