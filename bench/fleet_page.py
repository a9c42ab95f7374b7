"""What the fleet page's document costs the router to build, at fleet size.

    .venv/bin/python bench/fleet_page.py            # 200 nodes x 8 GPUs, 40 models
    .venv/bin/python bench/fleet_page.py 1000 100   # nodes, models

The router builds the document (llmgw/router/fleet.py: fleet_state, then JSON) in a worker
thread, at most every 0.5 s and only while a page polls. Printed beside its baseline, measured
in the same run: encoding the same records as they are stored (the least any page showing
them must do), and the ratio.
"""

from __future__ import annotations

import sys
import time

import msgspec

from llmgw import catalog
from llmgw.bus import records
from llmgw.fleetstate.decode import FleetRecords
from llmgw.router.fleet import encode_state, fleet_state
from llmgw.sim.bare import inventory


def _fleet(nodes: int, models: int) -> FleetRecords:
    r = FleetRecords()
    for i in range(nodes):
        node = f"node{i:04d}"
        inv = inventory(node, gpus=8, fabric=f"ib-{i // 50}", held=[("org/m0", "nfs:filer:/m")])
        devices = [
            msgspec.structs.replace(
                g,
                memory_used_bytes=40 * 10**9,
                processes=[
                    records.GpuProcess(
                        pid=1000 + g.index, name="vllm", used_bytes=40 * 10**9, own=True
                    )
                ],
            )
            for g in inv.gpus.devices
        ]
        r.nodes[node] = msgspec.structs.replace(
            inv, gpus=msgspec.structs.replace(inv.gpus, devices=devices)
        )
        r.leases[node] = records.Lease(
            node=node, seq=1, time=time.time(), started_at=0.0, memory=inv.memory
        )
        r.health[node] = records.Health(node=node, phase="ready", since=0.0)
    for m in range(models):
        mid = f"model{m:03d}"
        r.catalog[mid] = catalog.validate_models(
            {
                "models": [
                    {
                        "id": mid,
                        "profiles": [
                            {
                                "name": "p",
                                "engine": "vllm",
                                "weights": {"source": f"hf://org/{mid}"},
                                "gpus_per_node": 4,
                            }
                        ],
                    }
                ]
            }
        )[0]
        r.desired[mid] = records.Desired(model=mid, replicas=10)
        for k in range(8):
            node = f"node{(m * 8 + k) // 2 % nodes:04d}"
            rid = f"r{m:03d}{k}"
            first = (m * 8 + k) % 2 * 4
            gpus = [f"GPU-{node}-{g:02d}" for g in range(first, first + 4)]
            r.replicas[rid] = records.Replica(
                model=mid,
                rid=rid,
                profile="p",
                members=[records.ReplicaMember(node=node, rank=0, gpus=gpus, port=18000 + k)],
                phase="ready",
                endpoint=f"10.0.0.1:{18000 + k}",
            )
            r.shards[(node, rid)] = records.Shard(
                node=node, rid=rid, model=mid, generation=1, phase="ready", since=0.0
            )
        r.placements[mid] = records.PlacementRecord(
            model=mid,
            desired=10,
            placed=8,
            judged=nodes,
            refused=[records.RefusedNodes(profile="p", reason="gpus", nodes=nodes, needs=4)],
            explanation=f"0/{nodes} nodes fit: {nodes} short of free GPUs",
        )
    return r


def _time(fn, rounds: int) -> float:
    fn()
    began = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - began) / rounds


def main() -> None:
    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    models = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    r = _fleet(nodes, models)
    stored = [
        *r.nodes.values(),
        *r.leases.values(),
        *r.health.values(),
        *r.replicas.values(),
        *r.shards.values(),
        *r.placements.values(),
    ]
    encoder = msgspec.json.Encoder()
    rounds = 20
    baseline = _time(lambda: encoder.encode(stored), rounds)
    body = encode_state(fleet_state(r, {}, time.time(), {}))
    build = _time(lambda: encode_state(fleet_state(r, {}, time.time(), {})), rounds)
    print(
        f"fleet page document: {nodes} nodes x 8 GPUs, {models} models, {len(r.replicas)} replicas"
    )
    print(f"  records encoded as stored (baseline): {baseline * 1000:7.1f} ms")
    print(
        f"  page document built and encoded:      {build * 1000:7.1f} ms ({len(body) / 1e6:.2f} MB)"
    )
    print(f"  ratio: {build / baseline:.1f}x the baseline")


if __name__ == "__main__":
    main()
