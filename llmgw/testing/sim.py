"""Simulated nodes: real records on a real bus, without real hardware.

A SimNode writes `nodes.<id>` and heartbeats `leases.<id>` the way an agent does, so the
controller and the CLI can be exercised (and benchmarked) at fleet size on one machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
import msgspec

from llmgw.bus import keys, records
from llmgw.bus.client import Bus

GIB = 1 << 30


def inventory(
    node: str,
    *,
    gpus: int = 8,
    gpu_gb: float = 80,
    ram_gib: float = 512,
    engines: tuple[str, ...] = ("llama-server", "vllm"),
    fabric: str | None = None,
    address: str | None = None,
) -> records.NodeInventory:
    devices = [
        records.Gpu(
            index=i,
            name="NVIDIA H100 80GB HBM3",
            uuid=f"GPU-{node}-{i:02d}",
            memory_total_bytes=int(gpu_gb * 1e9),
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            compute_capability="9.0",
        )
        for i in range(gpus)
    ]
    ib = []
    if fabric:
        ib = [
            records.IbAdapter(
                name="mlx5_0",
                fabric=fabric,
                ports=[
                    records.IbPort(
                        port=1, state="ACTIVE", phys_state="LinkUp", link_layer="InfiniBand"
                    )
                ],
            )
        ]
    return records.NodeInventory(
        node=node,
        hostname=node,
        address=address or "127.0.0.1",
        agent_version="sim",
        started_at=time.time(),
        cpu=records.Cpu(count=64, model="sim"),
        memory=records.Memory(total_bytes=int(ram_gib * GIB), available_bytes=int(ram_gib * GIB)),
        gpus=records.Gpus(status="ok" if gpus else "no_library", devices=devices),
        ib=ib,
        engines=[
            records.EngineInstall(name=e, path=f"/usr/bin/{e}", version="sim") for e in engines
        ],
    )


@dataclass
class SimNode:
    bus: Bus
    inv: records.NodeInventory
    heartbeat: float = 0.2
    seq: int = 0
    alive: bool = True
    started_at: float = field(default_factory=time.time)

    @property
    def node(self) -> str:
        return self.inv.node

    async def register(self) -> None:
        await self.bus.put(keys.node(self.node), self.inv)
        await self.beat()

    async def beat(self) -> None:
        self.seq += 1
        await self.bus.put(
            keys.lease(self.node),
            records.Lease(
                node=self.node,
                seq=self.seq,
                time=time.time(),
                started_at=self.started_at,
                memory=self.inv.memory,
            ),
        )

    async def set_ram(self, gib: float) -> None:
        mem = records.Memory(total_bytes=int(gib * GIB), available_bytes=int(gib * GIB))
        self.inv = msgspec.structs.replace(self.inv, memory=mem)
        await self.bus.put(keys.node(self.node), self.inv)
        await self.beat()

    async def run(self) -> None:
        """Heartbeat while `alive`; setting alive False is a node that died."""
        while True:
            if self.alive:
                await self.beat()
            await anyio.sleep(self.heartbeat)
