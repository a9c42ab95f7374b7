from __future__ import annotations

import pytest

from llmgw.controller.liveness import LivenessTracker


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


def test_transitions_report_each_change_once_with_reason():
    tracker = LivenessTracker(unreachable_after=15, lost_after=60)
    tracker.observe("node01", 3, 0.0)
    tracker.observe("node02", 9, 0.0)
    first = tracker.transitions(0.0)
    assert [(t.node, t.previous, t.phase) for t in first] == [
        ("node01", None, "ready"),
        ("node02", None, "ready"),
    ]
    tracker.observe("node02", 10, 10.0)
    assert tracker.transitions(10.0) == []
    went = tracker.transitions(20.0)
    assert [(t.node, t.previous, t.phase) for t in went] == [("node01", "ready", "unreachable")]
    assert went[0].reason == "lease seq 3 has not moved for 20 s (unreachable after 15 s)"
    assert tracker.transitions(21.0) == []
    lost = tracker.transitions(65.0)
    assert [(t.node, t.phase) for t in lost] == [("node01", "lost"), ("node02", "unreachable")]
    tracker.observe("node01", 1, 80.0)
    back = tracker.transitions(80.0)
    assert [(t.node, t.previous, t.phase, t.seq) for t in back] == [
        ("node01", "lost", "ready", 1),
        ("node02", "unreachable", "lost", 10),
    ]


def test_forgotten_node_has_no_phase():
    tracker = LivenessTracker()
    tracker.observe("node01", 1, 0.0)
    tracker.forget("node01")
    assert tracker.phases(1.0) == {}
    assert tracker.phase("node01", 1.0) is None


def test_lost_must_come_after_unreachable():
    with pytest.raises(ValueError, match="unreachable_after"):
        LivenessTracker(unreachable_after=60, lost_after=15)
