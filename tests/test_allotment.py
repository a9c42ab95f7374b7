"""A shared engine against its allotment, as the bucket's records say (llmgw/allotment.py)."""

from __future__ import annotations

import msgspec
from record_helpers import shard

from llmgw.allotment import outgrown
from llmgw.bus.records import GpuProcess, Replica, ReplicaMember
from llmgw.sim.bare import inventory

GB = 1_000_000_000


def _setup(worker_gb: float, leader_gb: float = 0.5):
    inv = inventory("h1", gpus=2, gpu_gb=141)
    procs = [
        GpuProcess(pid=4949, name="python3", used_bytes=65 * GB),  # not llmgw's: never counted
        GpuProcess(pid=7001, name="vllm", used_bytes=int(leader_gb * GB), own=True, engine=7001),
        GpuProcess(
            pid=7050, name="VllmWorker", used_bytes=int(worker_gb * GB), own=True, engine=7001
        ),
        GpuProcess(pid=8001, name="llama-server", used_bytes=30 * GB, own=True, engine=8001),
    ]
    gpu = msgspec.structs.replace(inv.gpus.devices[0], processes=procs)
    inv = msgspec.structs.replace(
        inv, gpus=msgspec.structs.replace(inv.gpus, devices=[gpu, inv.gpus.devices[1]])
    )
    replicas = [
        Replica(
            model=model,
            rid=rid,
            profile="p",
            members=[
                ReplicaMember(node="h1", rank=0, gpus=[gpu.uuid], port=port, gpu_bytes=20 * GB)
            ],
            phase="ready",
        )
        for model, rid, port in (("small", "r1", 18001), ("other", "r2", 18002))
    ]
    shards = {
        ("h1", rid): shard("h1", rid, "ready", since=0, pid=pid)
        for rid, pid in (("r1", 7001), ("r2", 8001))
    }
    return {"h1": inv}, replicas, shards


def test_an_engine_over_its_allotment_beyond_the_margin_is_named_by_its_groups_memory():
    # r1's engine: leader 0.5 + worker 21 = 21.5 GB of 20 given, within 2 GB of margin;
    # r2's llama-server holds 30 GB of 20: named, with what it holds and was given
    (named,) = outgrown(*_setup(worker_gb=21))
    assert (named.rid, named.pid, named.used_bytes, named.allotted_bytes) == (
        "r2",
        8001,
        30 * GB,
        20 * GB,
    )
    assert named.text() == (
        "other r2 on h1: engine pid 8001 holds 30.0 GB of GPU GPU-h1-00, given 20 GB "
        "(margin 2.0 GB); not stopped"
    )
    # the worker grew: its engine (the group, not the leader alone) is over now
    assert sorted(o.rid for o in outgrown(*_setup(worker_gb=22))) == ["r1", "r2"]


def test_the_shard_record_says_what_its_engine_holds_and_only_news_rewrites_it():
    from llmgw.allotment import held_to_allotment

    invs, _, shards = _setup(worker_gb=10)
    gpu = invs["h1"].gpus.devices[0]
    first = held_to_allotment(shards[("h1", "r1")], gpu, 20 * GB)
    assert (first.gpu_used_bytes, first.gpu_allotted_bytes, first.gpu_outgrown) == (
        int(10.5 * GB),
        20 * GB,
        False,
    )
    assert held_to_allotment(first, gpu, 20 * GB) is None  # nothing new: not rewritten
    drifted, _, _ = _setup(worker_gb=10.4)
    assert held_to_allotment(first, drifted["h1"].gpus.devices[0], 20 * GB) is None
    grown, _, _ = _setup(worker_gb=23)
    over = held_to_allotment(first, grown["h1"].gpus.devices[0], 20 * GB)
    assert over.gpu_outgrown and over.gpu_used_bytes == int(23.5 * GB)
    assert over.phase == "ready"  # named, not stopped
    gone = msgspec.structs.replace(first, pid=None)
    assert held_to_allotment(gone, gpu, 20 * GB) is None


def test_what_a_shard_record_says_of_its_engines_memory_lasts_while_the_engine_runs():
    from llmgw.agent.shards import ShardEvent, next_shard
    from llmgw.bus.records import Assignment

    a = Assignment(model="m", rid="r1", profile="p", action="run", generation=1, port=18001)
    said = shard(
        "h1",
        "r1",
        "loading",
        since=0,
        pid=7001,
        gpu_used_bytes=23 * GB,
        gpu_allotted_bytes=20 * GB,
        gpu_outgrown=True,
    )

    def event(phase: str) -> ShardEvent:
        return ShardEvent(node="h1", rid="r1", assignment=a, phase=phase, at=1.0)

    ready = next_shard(said, event("ready"))
    assert (ready.gpu_used_bytes, ready.gpu_outgrown) == (23 * GB, True)
    stopped = next_shard(said, event("stopped"))
    assert (stopped.gpu_used_bytes, stopped.gpu_outgrown) == (None, False)
