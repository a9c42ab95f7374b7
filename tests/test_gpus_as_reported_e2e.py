"""GPUs as they really are, from an agent process to placement: recorded NVML answers
(memory another program holds, uncorrected ECC errors, an Xid event delivered while the
agent runs) go through the real discovery, the agent's report and the controller, and
decide which GPU a replica gets and what the explanation names."""

from __future__ import annotations

import pytest
from agent_helpers import start_fake_engine_agent, stop
from serving import serve
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines
from llmgw.bus import keys, records
from llmgw.bus.client import decoder
from llmgw.sim.nvml import FOREIGN_PID

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# 4 H100s (80 GB): GPU 0 has 60 GB held by another program, GPU 1 counts 2 uncorrected ECC
# errors, GPU 2 falls off the bus (Xid 79) while the agent watches; GPU 3 is sound
RECORDING = "count=4,node=g1,held=0:60,ecc=1:2,xid=2:79"


@pytest.fixture
def agent(tmp_path, nats_server):
    engines = Engines(listen_host="127.0.0.1")
    simulate = ["--recorded-nvml", RECORDING]
    agent = start_fake_engine_agent(
        nats_server.url, tmp_path, engines, simulate=simulate, id="g1", gpus=True
    )
    yield agent.log
    stop(agent.proc)


def _model() -> catalog.Model:
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": "m",
                    "served_name": "org/m-8b",
                    "profiles": [
                        {
                            "name": "one",
                            "engine": "vllm",
                            "weights": {"source": "hf://org/m-8b"},
                            "gpus_per_node": 1,
                            "gpu_memory_gb": 40,
                        }
                    ],
                }
            ]
        }
    )[0]


async def test_reported_gpu_faults_and_foreign_memory_decide_placement_and_are_named(
    bus, agent, controller
):
    async def xid_reported():
        got = await bus.get(keys.node("g1"), decoder(records.NodeInventory))
        if got is None:
            return None
        devices = got.value.gpus.devices
        return devices if len(devices) == 4 and devices[2].errors.xid == 79 else None

    devices = await until(xid_reported, timeout=30)
    assert devices[1].errors.ecc_uncorrected_volatile == 2
    assert [(p.pid, p.own) for p in devices[0].processes] == [(FOREIGN_PID, False)]

    await serve(bus, _model(), 2)

    async def decided():
        got = await bus.get(keys.placement("m"), decoder(records.PlacementRecord))
        return got.value if got and got.value.placed == 1 and got.value.desired == 2 else None

    record = await until(decided, timeout=30)
    replicas = await bus.list("replicas.m.*", decoder(records.Replica))
    (placed,) = [e.value for e in replicas.values()]
    # the only sound GPU with room: not the held one, not the ECC one, not the Xid one
    assert placed.members[0].gpus == ["GPU-g1-3"]
    # the second replica waits, and why names the program holding GPU 0's memory
    assert f"GPU 0 of g1: 60 GB held by pid {FOREIGN_PID}" in record.explanation
    assert "not llmgw's" in record.explanation
    assert "Xid 79 (fallen off the bus); out of service until it is reset" in agent.read_text()
