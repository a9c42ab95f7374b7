"""What a replica's or a shard's phase means, asked of one place (bus/records.py)."""

from __future__ import annotations

from llmgw.bus import records


def test_a_replica_that_may_serve_counts_toward_desired_and_holds_its_gpus_and_ports():
    assert records.REPLICA_MAY_SERVE <= records.REPLICA_COUNTED
    assert records.REPLICA_COUNTED <= records.REPLICA_HOLDS_GPUS_AND_PORTS


def test_a_replica_going_away_does_not_count_and_a_draining_one_still_holds_its_gpus():
    assert not records.REPLICA_GOING & records.REPLICA_COUNTED
    assert records.REPLICA_GOING | records.REPLICA_COUNTED == set(records.REPLICA_PHASES)
    assert "draining" in records.REPLICA_HOLDS_GPUS_AND_PORTS
    assert "stopped" not in records.REPLICA_HOLDS_GPUS_AND_PORTS
