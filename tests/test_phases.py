"""What a replica's or a shard's phase means, asked of one place (bus/records.py)."""

from __future__ import annotations

from record_helpers import shard

from llmgw.bus import records


def test_a_replica_that_may_serve_counts_toward_desired_and_holds_its_gpus_and_ports():
    assert records.REPLICA_MAY_SERVE <= records.REPLICA_COUNTED
    assert records.REPLICA_COUNTED <= records.REPLICA_HOLDS_GPUS_AND_PORTS


def test_a_replica_going_away_does_not_count_and_a_draining_one_still_holds_its_gpus():
    assert not records.REPLICA_GOING & records.REPLICA_COUNTED
    every = records.REPLICA_GOING | records.REPLICA_COUNTED | records.REPLICA_TERMINAL
    assert every == set(records.REPLICA_PHASES)
    assert "draining" in records.REPLICA_HOLDS_GPUS_AND_PORTS
    assert "stopped" not in records.REPLICA_HOLDS_GPUS_AND_PORTS


def test_a_replica_given_up_on_no_longer_counts_but_holds_its_gpus_until_removed():
    assert "gave-up" in records.REPLICA_TERMINAL
    assert not records.REPLICA_TERMINAL & (records.REPLICA_COUNTED | records.REPLICA_GOING)
    assert "gave-up" in records.REPLICA_HOLDS_GPUS_AND_PORTS
    assert "gave-up" not in records.REPLICA_MAY_SERVE | records.REPLICA_RESERVES_HOST_RAM


def _shard(phase: str, *, gave_up: bool = False) -> records.Shard:
    return shard("n1", "r1", phase, since=0, gave_up=gave_up)


def test_a_shard_given_up_on_makes_its_replica_gave_up_and_a_failed_one_failed():
    replica = records.Replica(
        model="m", rid="r1", profile="p", members=[records.ReplicaMember(node="n1", rank=0)]
    )
    assert records.phase_from_shards(replica, [_shard("failed", gave_up=True)])[0] == "gave-up"
    assert records.phase_from_shards(replica, [_shard("failed")])[0] == "failed"
    assert records.phase_from_shards(replica, [_shard("loading")])[0] == "starting"
    assert records.phase_from_shards(replica, [None])[0] == "placed"
