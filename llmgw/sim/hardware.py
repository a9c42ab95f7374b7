"""A simulated node's hardware: what the agent's discovery is answered with.

The agent asks its `Hardware` (llmgw.agent.inventory) for each fact; a simulated node
answers from its current `NodeSpec`, which the simulator replaces when the fleet file
changes. GPUs go through the real `discover_gpus`, asking a recorded NVML
(llmgw.sim.nvml) of the model and memory the file names; RAM is read on every
heartbeat, as on a real node, so a node given more RAM is seen at its next lease.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pynvml

from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery.gpus import ProcessLookup, discover_gpus
from llmgw.agent.inventory import Hardware
from llmgw.bus import records
from llmgw.sim.engines import SimulatedEngine
from llmgw.sim.fleet import NodeSpec
from llmgw.sim.nvml import RecordedNvml

GIB = 1 << 30
_UP = records.IbPort(
    port=1,
    state="ACTIVE",
    phys_state="LinkUp",
    rate="400 Gb/sec (4X NDR)",
    rate_gbps=400.0,
    link_layer="InfiniBand",
)
_DOWN = records.IbPort(port=1, state="DOWN", phys_state="Disabled", link_layer="InfiniBand")


class SimulatedHardware:
    """One node's answers; `spec` is replaced by the simulator when the file changes."""

    def __init__(
        self,
        spec: NodeSpec,
        installs: dict[str, records.EngineInstall],
        engines: Callable[[], Iterable[SimulatedEngine]] = tuple,
    ) -> None:
        self.spec = spec
        self._installs = installs
        self._engines = engines  # the node's running engines, whose GPU memory NVML lists

    def hardware(self) -> Hardware:
        return Hardware(
            gpus=self.gpus,
            hostname=lambda: self.spec.name,
            memory=self.memory,
            cpu=self.cpu,
            ib=self.ib,
            engines=self.engines,
            ports=self.ports,
            xids=None,  # a simulated GPU has no faults to wait for
        )

    def gpus(self, lookup: ProcessLookup) -> records.Gpus:
        g = self.spec.gpus
        if g.count == 0:  # as on a node without NVIDIA's driver: no library to load
            nvml = RecordedNvml(count=0, init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        else:
            nvml = RecordedNvml(
                count=g.count,
                node=self.spec.name,
                name=g.name,
                memory_total=int(g.memory_gb * 1e9),
                mig={int(i): list(p) for i, p in g.mig.items()},
            )
            lookup = self._list_engines(nvml, lookup)
        return discover_gpus(nvml, lookup)

    def _list_engines(self, nvml: RecordedNvml, lookup: ProcessLookup) -> ProcessLookup:
        """The node's simulated engines as NVML lists processes: each holding what it
        would on the GPUs (or MIG devices) it was given, under a pid of its own that is
        the agent's (an engine of its own group)."""
        devices = nvml.devices()
        totals = {uuid: total for uuid, (_, _, total) in devices.items()}
        names: dict[int, str] = {}
        for engine in self._engines():
            for uuid, held in engine.gpu_held(totals).items():
                index, slot, _ = devices[uuid]
                holder = (engine.pid, held)
                if slot is None:
                    nvml.processes.setdefault(index, []).append(holder)
                else:
                    nvml.mig_processes.setdefault((index, slot), []).append(holder)
                names[engine.pid] = engine.kind
        return _EnginesAreOwn(lookup, names) if names else lookup

    def memory(self, cfg: AgentConfig) -> records.Memory:
        total = int(self.spec.ram_gb * GIB)
        return records.Memory(total_bytes=total, available_bytes=total)

    def cpu(self, cfg: AgentConfig) -> records.Cpu:
        return records.Cpu(count=self.spec.cpus, model="simulated")

    def ib(self, cfg: AgentConfig) -> list[records.IbAdapter]:
        # the fabric is configuration on a real node too (cfg.fabrics), never discovered
        return [
            records.IbAdapter(
                name=a.adapter,
                node_guid=f"sim:{self.spec.name}:{a.adapter}",
                fabric=cfg.fabrics.get(a.adapter),
                ports=[_UP if a.state == "up" else _DOWN],
            )
            for a in self.spec.ib
        ]

    def engines(self, cfg: AgentConfig) -> list[records.EngineInstall]:
        return sorted(
            (self._installs[e] for e in self.spec.engines if e in self._installs),
            key=lambda e: e.name,
        )

    def ports(self, cfg: AgentConfig) -> records.PortsTaken:
        # each node has a loopback address of its own: nothing else listens there
        return records.PortsTaken(low=cfg.engines.port_low, high=cfg.engines.port_high)


class _EnginesAreOwn:
    """`lookup`, with the simulated engines' pids named and known as the agent's own."""

    def __init__(self, lookup: ProcessLookup, engines: dict[int, str]) -> None:
        self.lookup, self.engines = lookup, engines

    def name(self, pid: int) -> str:
        return self.engines.get(pid) or self.lookup.name(pid)

    def own(self, pid: int) -> bool:
        return pid in self.engines or self.lookup.own(pid)

    def engine(self, pid: int) -> int | None:
        return pid if pid in self.engines else self.lookup.engine(pid)
