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
        ("llama-server", True, engines[0].gpu_pid, SIM_GGUF_BYTES + 8192 * SIM_KV_BYTES_PER_TOKEN)
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
