"""A vLLM replica spanning two nodes of one InfiniBand fabric, end to end: two agent
processes (GPUs from a recorded NVML, adapters from a recorded sysfs tree), the controller
places ranks 0 and 1 in one fabric, rank 0 serves the API and rank 1 runs headless,
each with its own GPUs and that fabric's adapters for NCCL."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from samples.infiniband import FABRIC_MAP, FILES, LINKS
from samples.sysfs import write_tree
from serving import serve
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines
from llmgw.bus import keys, records
from llmgw.bus.client import decoder
from llmgw.sim.fake_engine import install_fake_engines

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

NODES = {
    "gpu-a": "127.0.0.1",
    "gpu-b": "127.0.0.2",
}  # two hosts on one machine: two loopback addresses


@pytest.fixture
def fleet(tmp_path, nats_server):
    procs, records_at = [], {}
    for node, address in NODES.items():
        root = tmp_path / node
        dirs = host_dirs(root)
        write_tree(dirs["sysfs"], FILES, LINKS)
        install_fake_engines(dirs["bin"])
        cfg = agent_config(nats_server.url, dirs, id=node, address=address, gpus=True)
        cfg = msgspec.structs.replace(
            cfg,
            fabrics=FABRIC_MAP,
            engines=Engines(listen_host=address, poll_interval=0.1, backoff_base=5),
        )
        records_at[node] = root / "engine.json"
        procs.append(
            start_agent(
                cfg,
                root / "agent.toml",
                [dirs["bin"], "/usr/bin", "/bin"],
                root / "agent.log",
                env_extra={"FAKE_ENGINE_RECORD": str(records_at[node])},
                simulate=["--recorded-nvml", f"count=2,node={node}"],
            )
        )
    yield records_at
    for p in procs:
        stop(p)


async def test_two_node_replica_runs_rank0_serving_and_rank1_headless_in_one_fabric(
    bus, fleet, controller
):
    model = catalog.validate_models(
        {
            "models": [
                {
                    "id": "big",
                    "served_name": "org/big-70b",
                    "profiles": [
                        {
                            "name": "pp2",
                            "engine": "vllm",
                            "weights": {"source": "hf://org/big-70b"},
                            "gpus_per_node": 2,
                            "gpu_memory_gb": 80,
                            "nodes": 2,
                        }
                    ],
                }
            ]
        }
    )[0]
    await serve(bus, model, 1)

    async def ready_replica():
        got = await bus.list("replicas.big.*", decoder(records.Replica))
        reps = [e.value for e in got.values() if e.value.phase == "ready"]
        return reps[0] if reps else None

    replica = await until(ready_replica)
    by_rank = {m.rank: m for m in replica.members}
    assert {m.node for m in replica.members} == set(NODES)
    rank0, rank1 = by_rank[0], by_rank[1]
    assert replica.endpoint == f"{NODES[rank0.node]}:{rank0.port}"

    fabric = (
        await bus.get(keys.assign(rank1.node, replica.rid), decoder(records.Assignment))
    ).value.fabric
    assert fabric in ("ib-a", "ib-b")  # both nodes are on both; one fabric is chosen
    hca = {"ib-a": "mlx5_0", "ib-b": "mlx5_1"}[fabric]  # only the ACTIVE adapter of that fabric

    # A headless rank is ready as soon as its process is alive, which can be before the
    # fake engine has written what it was started with: wait for both records.
    async def launched(node: str) -> dict | None:
        path = fleet[node]
        return json.loads(path.read_text()) if path.exists() else None

    head = await until(lambda: launched(rank0.node))
    worker = await until(lambda: launched(rank1.node))
    for rec, member in ((head, rank0), (worker, rank1)):
        args = rec["args"]
        assert args[:2] == ["serve", "org/big-70b"]
        assert args[args.index("--nnodes") + 1] == "2"
        assert args[args.index("--node-rank") + 1] == str(member.rank)
        assert args[args.index("--master-addr") + 1] == NODES[rank0.node]
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(member.gpus)
        assert all(g.startswith(f"GPU-{member.node}-") for g in member.gpus)  # its own node's GPUs
        assert rec["env"]["NCCL_IB_HCA"] == hca
    assert "--headless" in worker["args"] and "--headless" not in head["args"]

    body = {"model": "org/big-70b", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{replica.endpoint}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"]
