"""A shared engine against its allotment, as the bucket's records say (llmgw/allotment.py)."""

from __future__ import annotations

import msgspec

from llmgw.allotment import outgrown
from llmgw.bus.records import GpuProcess, Replica, ReplicaMember, Shard
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
        ("h1", rid): Shard(
            node="h1", rid=rid, model="m", generation=1, phase="ready", since=0, pid=pid
        )
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
