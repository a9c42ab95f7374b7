from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.bus.records import Health, Lease, Memory
from llmgw.controller.echo import Echo
from llmgw.controller.liveness import (
    LivenessTracker,
    health_changes,
    judge,
    lease_change_matters,
    node_phases,
)


def _moving(tracker: LivenessTracker, node: str, start: float, until: float, every: float = 5.0):
    seq, t = 1, start
    while t <= until:
        tracker.observe(node, seq, t)
        seq, t = seq + 1, t + every


def test_node_whose_lease_moves_stays_ready():
    tracker = LivenessTracker()
    _moving(tracker, "node01", 0.0, 300.0)
    assert tracker.phases(301.0) == {"node01": "ready"}


def test_lease_that_stops_moving_goes_unreachable_then_lost():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 7, 100.0)
    # seeing the same seq again is not movement
    tracker.observe("node01", 7, 110.0)
    assert tracker.phase("node01", 114.9) == "ready"
    assert tracker.phase("node01", 115.0) == "unreachable"
    assert tracker.phase("node01", 159.9) == "unreachable"
    assert tracker.phase("node01", 160.0) == "lost"


def test_lease_moving_again_brings_lost_node_back_to_ready():
    tracker = LivenessTracker()
    tracker.observe("node01", 7, 0.0)
    assert tracker.phase("node01", 100.0) == "lost"
    tracker.observe("node01", 8, 100.0)
    assert tracker.phase("node01", 100.0) == "ready"


def test_sequence_going_backwards_counts_as_movement_after_agent_restart():
    tracker = LivenessTracker()
    tracker.observe("node01", 500, 0.0)
    tracker.observe("node01", 1, 20.0)  # agent restarted: seq starts over
    assert tracker.phase("node01", 30.0) == "ready"


def test_controller_restart_gives_stale_fleet_a_fresh_grace_period():
    # A new controller process sees leases that last moved long ago (by the agents'
    # wall clocks). It counts from when IT first saw them: nobody is lost at once.
    restarted = LivenessTracker(unreachable_after=15, lost_after=60)
    for node in ("node01", "node02", "node03"):
        restarted.observe(node, 1234, 5000.0)
    assert set(restarted.phases(5000.0).values()) == {"ready"}
    # node01 and node02 are alive and heartbeat; node03 really is dead
    restarted.observe("node01", 1235, 5005.0)
    restarted.observe("node02", 1235, 5005.0)
    restarted.observe("node01", 1236, 5055.0)
    restarted.observe("node02", 1236, 5055.0)
    assert restarted.phases(5060.0) == {"node01": "ready", "node02": "ready", "node03": "lost"}


def test_reason_says_how_long_a_lease_stood_still():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 3, 0.0)
    assert tracker.reason("node01", 4.0) == "lease seq 3 moved 4 s ago"
    assert tracker.reason("node01", 20.0) == (
        "lease seq 3 has not moved for 20 s (unreachable after 15 s)"
    )
    assert tracker.reason("node01", 65.0) == "lease seq 3 has not moved for 65 s (lost after 60 s)"
    assert tracker.reason("node02", 65.0) == "no heartbeat seen"


def test_node_recorded_lost_before_a_restart_stays_lost_until_its_lease_moves():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 7, 100.0)  # a fresh grace period: it would read ready
    tracker.hold("node01", "lost", 7)
    tracker.observe("node01", 7, 101.0)  # the same seq again is not movement
    assert tracker.phase("node01", 102.0) == "lost"
    assert tracker.reason("node01", 102.0) == (
        "recorded lost before this controller started; waiting for its lease to move"
    )
    tracker.observe("node01", 8, 103.0)
    assert tracker.phase("node01", 103.0) == "ready"


def test_a_held_phase_never_hides_a_worse_judgement():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 7, 0.0)
    tracker.hold("node01", "unreachable", 7)
    assert tracker.phase("node01", 1.0) == "unreachable"
    assert tracker.phase("node01", 61.0) == "lost"
    tracker.hold("node02", "lost", None)  # recorded lost, no lease at all
    assert tracker.phase("node02", 61.0) == "lost"
    tracker.observe("node02", 1, 62.0)
    assert tracker.phase("node02", 62.0) == "ready"


def test_health_changes_write_only_changed_phases_and_delete_removed_nodes():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 3, 0.0)
    tracker.observe("node02", 9, 0.0)
    tracker.observe("node02", 10, 10.0)
    stored = {
        "node01": Health(node="node01", phase="ready", since=1.0),
        "node02": Health(node="node02", phase="ready", since=1.0),
        "gone": Health(node="gone", phase="lost", since=1.0),
    }
    leases = {n: _lease(n, s) for n, s in (("node01", 3), ("node02", 10))}
    nodes = ["node01", "node02", "node03"]  # node03: an inventory, never a lease
    changes = health_changes(
        node_phases(nodes, tracker, 20.0), stored, leases, tracker, 20.0, wall=5000.0
    )
    assert [(c.record.node, c.previous, c.record.phase) for c in changes.write] == [
        ("node01", "ready", "unreachable"),
        ("node03", None, "unreachable"),
    ]
    first = changes.write[0].record
    assert (first.since, first.last_seq) == (5000.0, 3)
    assert first.reason == "lease seq 3 has not moved for 20 s (unreachable after 15 s)"
    assert changes.write[1].record.reason == "no heartbeat seen"
    assert changes.delete == ["gone"]
    assert changes.declares_silence
    calm = health_changes(node_phases(["node02"], tracker, 20.0), {}, leases, tracker, 20.0, 1.0)
    assert [c.record.phase for c in calm.write] == ["ready"] and not calm.declares_silence


def _lease(node: str, seq: int) -> Lease:
    return Lease(
        node=node,
        seq=seq,
        time=0.0,
        started_at=0.0,
        memory=Memory(total_bytes=1, available_bytes=1),
    )


def test_forgotten_node_has_no_phase():
    tracker = LivenessTracker()
    tracker.observe("node01", 1, 0.0)
    tracker.forget("node01")
    assert tracker.phases(1.0) == {}
    assert tracker.phase("node01", 1.0) is None


def test_lost_must_come_after_unreachable():
    with pytest.raises(ValueError, match="unreachable_after"):
        LivenessTracker(unreachable_after=60, lost_after=15)


@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["observe", "hold", "forget", "grace"]),
            st.sampled_from(["a", "b", "c", "d"]),
            st.integers(0, 3),  # seq
            st.sampled_from(["ready", "unreachable", "lost"]),
            st.floats(0, 200, allow_nan=False),
        ),
        max_size=30,
    ),
    now=st.floats(0, 400, allow_nan=False),
)
def test_the_fleets_phases_follow_lease_movement_and_holds(events, now) -> None:
    """Against a plain model of the rules: a node is ready until its lease has stood still
    for 15 s, unreachable until 30 s, then lost; a held phase stays until the lease moves
    from the held seq and is never hidden by a better judgement; a node with no lease seen
    is unreachable in the fleet's phases and has no phase of its own."""
    tracker = LivenessTracker(unreachable_after=15, lost_after=30)
    seen: dict[str, tuple[int, float]] = {}  # node -> (seq, when it moved)
    held: dict[str, tuple[str, int | None]] = {}
    for what, node, seq, phase, at in sorted(events, key=lambda e: e[4]):
        if what == "observe":
            tracker.observe(node, seq, at)
            if node not in seen or seen[node][0] != seq:
                seen[node] = (seq, at)
            if node in held and held[node][1] != seq:
                del held[node]
        elif what == "hold":
            tracker.hold(node, phase, seq if seq else None)
            if phase != "ready":
                held[node] = (phase, seq if seq else None)
        elif what == "forget":
            tracker.forget(node)
            seen.pop(node, None)
        else:
            tracker.restart_grace(at)
            seen = {n: (s, at) for n, (s, _) in seen.items()}
    severity = {"ready": 0, "unreachable": 1, "lost": 2}

    def expected(node: str):
        judged = None
        if node in seen:
            still = now - seen[node][1]
            judged = "lost" if still >= 30 else "unreachable" if still >= 15 else "ready"
        if node in held and (judged is None or severity[held[node][0]] > severity[judged]):
            judged = held[node][0]
        return judged

    nodes = ["a", "b", "c", "d", "e"]
    assert tracker.phases_of(nodes, now) == {n: expected(n) or "unreachable" for n in nodes}
    assert {n: tracker.phase(n, now) for n in nodes} == {n: expected(n) for n in nodes}


@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(
                ["observe", "observe", "forget", "add", "add", "remove", "edit", "hold", "grace"]
                + ["judge"] * 4
            ),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 3),  # seq
            st.sampled_from(["ready", "unreachable", "lost"]),
            st.floats(0, 200, allow_nan=False),
        ),
        max_size=40,
    )
)
def test_judging_only_the_touched_nodes_stores_what_judging_the_whole_fleet_stores(events):
    """The controller judges, each tick, only the nodes whose inventory or health record
    changed since its last judgement, or whose lease moved while not stored ready or was
    deleted, and
    those standing still; a world
    that judges every node each time must end with the same phases stored after every
    judgement, whatever happened in between."""
    tracker = LivenessTracker(unreachable_after=15, lost_after=30)
    inventories: dict[str, object] = {}
    leases: dict[str, Lease] = {}
    whole: dict[str, Health] = {}  # stored by the world that judges every node
    part: dict[str, Health] = {}  # stored by the one that judges the touched ones
    touched: set[str] | None = None

    def store(stored: dict[str, Health], changes) -> None:
        for c in changes.write:
            stored[c.record.node] = c.record
        for node in changes.delete:
            stored.pop(node, None)

    # and then time passes with nothing happening: nodes go unreachable, then lost
    later = [("judge", "", 0, "ready", 200.0 + k) for k in (0, 10, 20, 40)]
    for what, node, seq, phase, at in sorted(events, key=lambda e: e[4]) + later:
        if what == "judge":
            store(whole, judge(inventories, whole, leases, tracker, at, at))
            store(part, judge(inventories, part, leases, tracker, at, at, touched))
            touched = set()
            assert {n: h.phase for n, h in part.items()} == {n: h.phase for n, h in whole.items()}
            continue
        if what in ("hold", "grace"):
            if what == "hold":
                tracker.hold(node, phase, seq or None)
            else:
                tracker.restart_grace(at)
            touched = None  # as the controller asks after either
            continue
        if what in ("observe", "forget"):  # a lease moved, or was deleted
            if what == "observe":
                leases[node] = _lease(node, seq)
                tracker.observe(node, seq, at)
            else:
                leases.pop(node, None)
                tracker.forget(node)
            if not lease_change_matters(part.get(node), leases.get(node)):
                continue  # the controller does not judge the node again for this
        elif what == "add":
            inventories[node] = object()
        elif what == "remove":
            inventories.pop(node, None)
        else:  # a health record changed under the controller (its own write's echo, a hand)
            for stored in (whole, part):
                stored[node] = Health(node=node, phase=phase, since=at)
        if touched is not None:
            touched.add(node)


def test_a_lease_that_moves_goes_behind_those_standing_still():
    # `still` reads only the front of the tracker's nodes, in the order their leases last
    # moved: a node that moved must leave its place, or the ones behind it are never seen
    tracker = LivenessTracker(unreachable_after=15, lost_after=30)
    tracker.observe("a", 1, 0.0)
    tracker.observe("b", 1, 1.0)
    tracker.observe("c", 1, 2.0)
    tracker.observe("a", 2, 10.0)  # moved: now the freshest
    tracker.observe("c", 1, 11.0)  # the same seq: it did not move
    assert tracker.still(15.5) == []
    assert tracker.still(17.0) == ["b", "c"]
    assert tracker.still(25.0) == ["b", "c", "a"]
    tracker.restart_grace(30.0)
    assert tracker.still(44.9) == [] and tracker.still(45.0) == ["b", "c", "a"]


def test_a_lease_deleted_from_a_node_stored_ready_is_judged_at_the_next_tick():
    # a moving lease keeps its node ready, so the controller skips it when stored ready;
    # a lease that goes away (deleted, or a value that does not read) never is
    tracker = LivenessTracker(unreachable_after=15, lost_after=30)
    nodes, leases = {"a": object()}, {"a": _lease("a", 1)}
    tracker.observe("a", 1, 0.0)
    stored = {c.record.node: c.record for c in judge(nodes, {}, leases, tracker, 1.0, 1.0).write}
    assert stored["a"].phase == "ready"
    tracker.observe("a", 2, 2.0)
    leases["a"] = _lease("a", 2)
    assert not lease_change_matters(stored["a"], leases["a"])
    leases.pop("a")
    tracker.forget("a")
    assert lease_change_matters(stored["a"], None)
    changes = judge(nodes, stored, leases, tracker, 3.0, 3.0, {"a"})
    assert [(c.record.node, c.record.phase) for c in changes.write] == [("a", "unreachable")]


# --- the watch's echo (controller/echo.py) ------------------------------------------------------


def test_a_write_of_its_own_not_shown_back_within_the_bound_makes_the_watch_overdue():
    echo = Echo(within=5.0)
    echo.expect(10, now=100.0)
    assert not echo.overdue(104.9)
    assert echo.overdue(105.1)
    echo.saw(10)
    assert echo.shows(10) and not echo.overdue(200.0)  # shown: nothing awaited any more


def test_a_later_revision_shown_answers_the_write_awaited_and_an_earlier_one_does_not():
    echo = Echo(within=5.0)
    echo.expect(10, now=100.0)
    echo.expect(7, now=101.0)  # an older write answered late changes nothing
    echo.saw(9)
    assert echo.awaited == 10 and not echo.shows(10)
    echo.saw(12)
    assert echo.awaited == 0 and echo.shows(10) and echo.shows(12)


def test_a_write_the_watch_showed_before_its_own_answer_came_is_not_awaited():
    # the server sends the write's answer and the watch's delivery in no set order: a
    # controller waited 5 s for an echo it had already seen, and made its watch again
    echo = Echo(within=5.0)
    echo.saw(10)
    echo.expect(10, now=100.0)
    assert not echo.overdue(200.0) and echo.awaited == 0 and echo.shows(10)


def test_a_write_answered_by_a_later_ones_echo_is_shown():
    # one renewal awaited while the leadership's own renewal writes the key again
    echo = Echo(within=5.0)
    echo.expect(10, now=100.0)
    echo.expect(11, now=100.5)
    echo.saw(11)
    assert echo.shows(10) and not echo.overdue(200.0)


def test_a_watch_made_again_awaits_nothing_until_the_next_write():
    echo = Echo(within=5.0)
    echo.expect(10, now=100.0)
    echo.forget()
    assert not echo.overdue(1000.0)
