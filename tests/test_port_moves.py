"""A port another program took after placement is the node's, not the profile's: the replica
is given another port (controller/placement/ports.py), and nothing else judges it failed."""

from __future__ import annotations

import msgspec
from record_helpers import shard
from test_placement import _fleet, _rolling, _running, _with, snapshot

from llmgw.bus.records import PORT_IN_USE
from llmgw.controller.placement import plan


def test_a_new_revision_refused_its_port_by_another_program_moves_and_the_rollout_goes_on():
    before, after = _rolling(), _rolling(env={"X": "new"})
    old = _running(before, "r1", "r2", "r3")
    new = msgspec.structs.replace(
        plan(snapshot(_fleet(), [after], {"m": 3}, replicas=old)).create[0], phase="failed"
    )
    m = new.members[0]
    refused = shard(
        m.node,
        new.rid,
        "failed",
        since=0,
        reason=f"refused before launch: port {m.port} on 127.0.0.1 is in use by another process",
        port=m.port,
        refused=PORT_IN_USE,
    )
    snap = snapshot(_fleet(), [after], {"m": 3}, replicas=[*old, new])
    result = plan(_with(snap, shards={(m.node, new.rid): refused}))

    assert result.rollouts["m"].phase == "progressing", result.rollouts["m"].reason
    assert result.remove == []  # neither the new replica nor an old one goes
    (move,) = result.port_moves
    assert move.replica.rid == new.rid and move.replica.members[0].port > m.port
