"""The shard record an agent writes, from what happened to the engine: no bus, no engine."""

from __future__ import annotations

from dataclasses import replace

import msgspec

from llmgw.agent.shards import ShardEvent, next_shard
from llmgw.bus import records

ASSIGNMENT = records.Assignment(
    model="tiny", rid="r1", profile="default", action="run", generation=3, port=8080
)


def event(phase: str, at: float, **kw: object) -> ShardEvent:
    return ShardEvent(node="n1", rid="r1", assignment=ASSIGNMENT, phase=phase, at=at, **kw)


def test_a_first_event_makes_a_whole_record_from_the_assignment() -> None:
    shard = next_shard(None, event("validating", 10.0))
    assert (shard.node, shard.rid, shard.model, shard.generation) == ("n1", "r1", "tiny", 3)
    assert (shard.phase, shard.since, shard.served_name, shard.restarts, shard.pid) == (
        "validating",
        10.0,
        "",
        0,
        None,
    )


def test_since_moves_only_when_the_phase_changes() -> None:
    loading = next_shard(None, event("loading", 10.0))
    assert next_shard(loading, event("loading", 20.0, reason="still")).since == 10.0
    assert next_shard(loading, event("ready", 30.0)).since == 30.0


def test_served_name_is_the_running_engines_else_the_last_one_known() -> None:
    running = next_shard(None, event("ready", 1.0, served_name="org/tiny"))
    assert running.served_name == "org/tiny"
    # the engine is gone (stopped): the record still says what it served
    assert next_shard(running, event("stopped", 2.0)).served_name == "org/tiny"


def test_restarts_are_kept_unless_the_event_counts_them() -> None:
    crashed = next_shard(None, event("failed", 1.0, restarts=2))
    assert next_shard(crashed, event("loading", 2.0)).restarts == 2
    assert next_shard(crashed, event("loading", 2.0, restarts=3)).restarts == 3


def test_pid_is_kept_while_the_engine_lives_and_dropped_when_it_is_gone() -> None:
    loading = next_shard(None, event("loading", 1.0, pid=4242))
    assert next_shard(loading, event("ready", 2.0)).pid == 4242
    assert next_shard(loading, event("ready", 2.0, pid=4343)).pid == 4343
    assert next_shard(loading, event("failed", 3.0)).pid is None
    assert next_shard(loading, event("stopped", 3.0)).pid is None


def test_everything_else_is_the_events_own() -> None:
    old = next_shard(None, event("failed", 1.0, reason="boom", tail=("line",)))
    newer = msgspec.structs.replace(ASSIGNMENT, generation=4)
    ready = next_shard(
        old, replace(event("ready", 2.0, endpoint="10.0.0.5:8080"), assignment=newer)
    )
    assert (ready.endpoint, ready.reason, ready.output_tail, ready.generation) == (
        "10.0.0.5:8080",
        "",
        [],
        4,
    )


def test_a_launch_refused_only_for_its_taken_port_says_so_and_the_next_event_clears_it() -> None:
    from llmgw.agent.engines.validate import Problem
    from llmgw.agent.shards import refused_key

    taken = Problem("port 8080 is in use", transient=True, refused=records.PORT_IN_USE)
    assert refused_key([taken]) == records.PORT_IN_USE
    # moving the port would not help when something else is wrong too
    assert refused_key([taken, Problem("weights missing")]) == ""
    assert refused_key([Problem("weights missing")]) == ""

    refused = next_shard(None, event("failed", 1.0, refused=refused_key([taken])))
    assert (refused.refused, refused.port) == (records.PORT_IN_USE, 8080)
    moved = msgspec.structs.replace(ASSIGNMENT, generation=4, port=8081)
    again = next_shard(refused, replace(event("validating", 2.0), assignment=moved))
    assert (again.refused, again.port) == ("", 8081)
