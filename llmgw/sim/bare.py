"""Bare simulated nodes: the records an agent writes, on a real bus, without the agent.

A SimNode writes `nodes.<id>` and heartbeats `leases.<id>` the way an agent does, so the
controller and the CLI can be exercised (and benchmarked) at fleet size on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
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
    ram_gb: float | None = None,
    engines: Iterable[str] = ("llama-server", "vllm"),
    fabric: str | None = None,
    fabrics: Iterable[str | None] = (),
    address: str | None = None,
    held: Iterable[tuple[str, str]] = (),
    models: Iterable[records.HeldModel] = (),
    looked: bool = False,
    started_at: float | None = None,
) -> records.NodeInventory:
    """The inventory a node's agent would write: `gpus` H100s of `gpu_gb` (decimal GB, as
    sold), RAM in GiB (or decimal `ram_gb`), the engines installed, IB adapters on `fabric`
    (or one adapter per entry of `fabrics`, None meaning not configured), and the weights it
    holds: `held` (model key, store identity) pairs, or `models` as they are."""
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
    active = records.IbPort(port=1, state="ACTIVE", phys_state="LinkUp", link_layer="InfiniBand")
    on = [fabric] if fabric else list(fabrics)
    ib = [records.IbAdapter(name=f"mlx5_{i}", fabric=f, ports=[active]) for i, f in enumerate(on)]
    weights = [
        records.HeldModel(
            key=key,
            format="safetensors",
            path=f"/models/{key}",
            bytes=1,
            files=1,
            store=records.Store(
                kind="local" if store.startswith("local:") else "shared", identity=store
            ),
        )
        for key, store in held
    ] + list(models)
    ram = int(ram_gb * 1e9) if ram_gb is not None else int(ram_gib * GIB)
    return records.NodeInventory(
        node=node,
        hostname=node,
        address=address or "127.0.0.1",
        agent_version="sim",
        started_at=time.time() if started_at is None else started_at,
        cpu=records.Cpu(count=64, model="sim"),
        memory=records.Memory(total_bytes=ram, available_bytes=ram),
        gpus=records.Gpus(status="ok" if gpus else "no_library", devices=devices),
        ib=ib,
        engines=[
            records.EngineInstall(name=e, path=f"/usr/bin/{e}", version="sim") for e in engines
        ],
        weights=records.Weights(looked=looked or bool(weights), models=weights),
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
