"""The simulator's shareable GPUs and MIG devices: a fleet file's MIG layout is what its
agents discover, and its engines' GPU memory is what NVML lists, as the agent's own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.sim import fake_engine
from llmgw.sim.engines import SIM_GGUF_BYTES, SIM_KV_BYTES_PER_TOKEN, SimulatedEngine
from llmgw.sim.fleet import FleetError, Sim, parse_fleet
from llmgw.sim.hardware import SimulatedHardware
from llmgw.sim.nvml import H200_MIG

FLEET = """
[[nodes]]
name = "h200"
gpus = { count = 2, name = "NVIDIA H200", memory_gb = 150.75, mig = { "0" = ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"] } }
"""


class _Nobody:
    def name(self, pid: int) -> str:
        return ""

    def own(self, pid: int) -> bool:
        return False

    def engine(self, pid: int) -> int | None:
        return None


def _engine(argv: list[str], gpu: str) -> SimulatedEngine:
    engine = SimulatedEngine(
        argv, Sim(), os.open(os.devnull, os.O_WRONLY), {"CUDA_VISIBLE_DEVICES": gpu}
    )
    parse = fake_engine.parse_vllm if engine.kind == "vllm" else fake_engine.parse_llama
    engine.ns = parse(argv[1:])
    return engine


def test_a_fleet_files_mig_layout_is_discovered_and_its_engines_memory_listed_as_own():
    (spec,) = parse_fleet(FLEET, Path("fleet.toml")).nodes.values()
    engines = [
        _engine(
            [
                "llama-server",
                "-m",
                "/w/m.gguf",
                "--host",
                "127.1.0.1",
                "--port",
                "18001",
                "-c",
                "8192",
            ],
            "MIG-h200-0-2",
        ),
        _engine(
            [
                "vllm",
                "serve",
                "/w/m",
                "--host",
                "127.1.0.1",
                "--port",
                "18002",
                "--gpu-memory-utilization",
                "0.132",
            ],
            "GPU-h200-1",
        ),
    ]
    gpus = SimulatedHardware(spec, {}, lambda: engines).gpus(_Nobody())

    assert [(g.mig_profile, g.uuid) for g in gpus.devices] == [
        ("3g.71gb", "MIG-h200-0-0"),
        ("2g.35gb", "MIG-h200-0-1"),
        ("1g.18gb", "MIG-h200-0-2"),
        ("1g.18gb", "MIG-h200-0-3"),
        ("", "GPU-h200-1"),
    ]
    small, whole = gpus.devices[2], gpus.devices[4]
    assert small.memory_total_bytes == H200_MIG["1g.18gb"][0]
    assert [(p.name, p.own, p.engine, p.used_bytes) for p in small.processes] == [
        ("llama-server", True, engines[0].pid, SIM_GGUF_BYTES + 8192 * SIM_KV_BYTES_PER_TOKEN)
    ]
    assert [(p.name, p.own, p.used_bytes) for p in whole.processes] == [
        ("vllm", True, int(int(150.75e9) * 0.132))
    ]
    assert small.foreign_bytes() == whole.foreign_bytes() == 0  # the agent's own engines


@pytest.mark.parametrize(
    ("mig", "message"),
    [
        ('{ "0" = ["1g.10gb"] }', "'1g.10gb' is not a MIG profile of the simulated H200"),
        ('{ "2" = ["1g.18gb"] }', "key 'gpus.mig.2': not the index of one of its 2 GPUs"),
        ('{ "0" = ["4g.71gb", "4g.71gb"] }', "key 'gpus.mig.0': 8 slices; a card has 7"),
    ],
)
def test_a_mig_layout_no_card_could_have_is_refused_naming_the_key(mig, message):
    text = FLEET.replace('{ "0" = ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"] }', mig)
    with pytest.raises(FleetError, match=message):
        parse_fleet(text, Path("fleet.toml"))


# --- the whole way: controller, simulated agents and engines, the bucket ------------------

SHARED_FLEET = """
[sim]
heartbeat = 0.2
load_seconds = 0.1
gpu_probe = 0.2

[[nodes]]
name = "h200"
gpus = { count = 1, name = "NVIDIA H200", memory_gb = 150.75 }
engines = ["vllm"]
models = ["org/small"]
"""


@pytest.mark.anyio
async def test_shared_replicas_run_on_one_gpu_and_their_engines_memory_reaches_the_bucket(
    tmp_path, nats_settings
):
    import anyio
    from waiting import until

    from llmgw import catalog
    from llmgw.bus import keys, records
    from llmgw.bus.client import BucketSettings, Bus, decoder
    from llmgw.controller.loop import Controller, ControllerSettings
    from llmgw.sim.simulator import Simulator

    (model,) = catalog.validate_models(
        {
            "models": [
                {
                    "id": "small",
                    "profiles": [
                        {
                            "name": "p",
                            "engine": "vllm",
                            "weights": {"key": "org/small"},
                            "gpus_per_node": 1,
                            "gpu_memory_gb": 20,
                            "share_gpus": True,
                        }
                    ],
                }
            ]
        }
    )
    path = tmp_path / "fleet.toml"
    path.write_text(SHARED_FLEET)
    settings = ControllerSettings(unreachable_after=1, lost_after=2.5, leader_ttl=1, tick=0.05)
    sim = Simulator(path, nats_settings, BucketSettings(), tmp_path / "sim", poll=0.1)
    async with await Bus.connect(nats_settings, give_up_after=5) as bus:
        await bus.put(keys.catalog("small"), catalog.encode_model(model))
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(bus, settings).run)
            await tg.start(sim.run)
            await bus.put(keys.desired("small"), records.Desired(model="small", replicas=3))

            async def ready() -> list[records.Replica] | None:
                found = await bus.list(
                    keys.pattern(keys.REPLICAS, "small"), decoder(records.Replica)
                )
                reps = [e.value for e in found.values()]
                return reps if len([r for r in reps if r.phase == "ready"]) == 3 else None

            replicas = await until(ready, timeout=30)
            members = [r.members[0] for r in replicas]
            assert {(m.gpus[0], m.gpu_bytes) for m in members} == {("GPU-h200-0", 20 * 10**9)}

            async def listed() -> list[records.GpuProcess] | None:
                entry = await bus.get(keys.node("h200"), decoder(records.NodeInventory))
                procs = entry.value.gpus.devices[0].processes if entry else []
                return procs if len(procs) == 3 else None

            procs = await until(listed, timeout=30)

            # `llmgw status` of the simulated fleet shows the GPU shared by the three
            from llmgw.cli.status import gather, gpu_lines

            async def shown() -> list[str] | None:
                lines = gpu_lines((await gather(bus)).nodes["h200"].gpus)
                held = all("holds" in line for line in lines[1:])
                return lines if "(llmgw 59.7," in lines[0] and held else None  # listed

            lines = await until(shown, timeout=30)
            tg.cancel_scope.cancel()
    assert lines[0].endswith("; shared by 3 replicas, 60.0 GB allotted, left 89.8 GB")
    # each replica says what its engine holds against its allotment, as on real GPUs (a
    # simulated engine had no pid, so none ever did)
    assert (
        sorted(line.split(":", 1)[1] for line in lines[1:]) == [" 20.0 GB allotted, holds 19.9"] * 3
    )
    # each engine was launched with its allotment's share of the card, and holds that much
    share = int(int(150.75e9) * 0.132)
    assert [(p.name, p.own, p.used_bytes) for p in procs] == [("vllm", True, share)] * 3
