"""The node's inventory: discovery, with the config's overrides applied on top.

What is written still wins: every override beats discovery and is listed in
`from_config`, so `nats kv get llmgw nodes.<id>` shows which values a person set.
The functions here block (subprocesses, sysfs, NVML): the agent calls them in a worker thread.
The facts come from a `Hardware` the agent is given: the real machine (NVML, files under
`paths.procfs`/`paths.sysfs`, engines on disk) unless a simulated node (llmgw.sim, or
llmgw.sim's recorded NVML) passes its own. The overrides apply on top either way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw import __version__
from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery import (
    address,
    cpu,
    engines,
    gpus,
    identity,
    infiniband,
    memory,
    xid,
)
from llmgw.agent.discovery.ports import read_ports_taken
from llmgw.agent.discovery.processes import HostProcesses
from llmgw.agent.engines.pidfile import read_pidfiles
from llmgw.bus import records
from llmgw.bus.settings import DEFAULT_NATS_URL

log = logging.getLogger(__name__)

GIB = 1 << 30


def _nvml(lookup: gpus.ProcessLookup) -> records.Gpus:
    return gpus.discover_gpus(processes=lookup)


def _nvml_xids(log: xid.XidLog, stop: threading.Event, on_unfit: Callable[[], None]) -> str:
    try:
        import pynvml
    except ImportError as e:
        return f"no Xid watch: pynvml is not installed ({e})"
    return xid.watch_xids(pynvml, log, stop, on_unfit)


def _meminfo(cfg: AgentConfig) -> records.Memory:
    return memory.read_memory(Path(cfg.paths.procfs))


def _cpuinfo(cfg: AgentConfig) -> records.Cpu:
    return cpu.read_cpu(Path(cfg.paths.procfs))


def _sysfs_ib(cfg: AgentConfig) -> list[records.IbAdapter]:
    return infiniband.read_adapters(Path(cfg.paths.sysfs), cfg.fabrics)


def _installed_engines(cfg: AgentConfig) -> list[records.EngineInstall]:
    search = (
        [Path(p) for p in cfg.paths.llama_search_dirs]
        if cfg.paths.llama_search_dirs is not None
        else None
    )
    return engines.probe_engines(
        search_dirs=search, llama_server_path=cfg.node.llama_server, vllm_path=cfg.node.vllm
    )


def _listeners(cfg: AgentConfig) -> records.PortsTaken:
    own = [e.port for e in read_pidfiles(Path(cfg.paths.state_dir))]
    e = cfg.engines
    return read_ports_taken(Path(cfg.paths.procfs), e.port_low, e.port_high, own)


@dataclass(frozen=True)
class Hardware:
    """Where each fact about the node comes from; the defaults read this machine. `gpus`
    answers what NVML would (see discovery.gpus.discover_gpus for what each status means),
    naming the processes it finds with the lookup it is given; `ib` gives each adapter the
    fabric `cfg.fabrics` names; `ports` lists listeners on the engine port range that are
    not this agent's engines; `xids` waits for NVML's Xid events until told to stop
    (discovery.xid.watch_xids; None: nothing to wait for, as on a simulated node)."""

    gpus: Callable[[gpus.ProcessLookup], records.Gpus] = _nvml
    xids: Callable[[xid.XidLog, threading.Event, Callable[[], None]], str] | None = _nvml_xids
    hostname: Callable[[], str] = identity.read_hostname
    memory: Callable[[AgentConfig], records.Memory] = _meminfo
    cpu: Callable[[AgentConfig], records.Cpu] = _cpuinfo
    ib: Callable[[AgentConfig], list[records.IbAdapter]] = _sysfs_ib
    engines: Callable[[AgentConfig], list[records.EngineInstall]] = _installed_engines
    ports: Callable[[AgentConfig], records.PortsTaken] = _listeners


@dataclass(frozen=True)
class Identity:
    node: str
    hostname: str
    address: str


def node_identity(cfg: AgentConfig, hardware: Hardware | None = None) -> Identity:
    hostname = (hardware or Hardware()).hostname()
    node = cfg.node.id or identity.node_id_from_hostname(hostname)
    addr = cfg.node.address or address.address_for_urls(cfg.nats.urls or [DEFAULT_NATS_URL])
    return Identity(node=node, hostname=hostname, address=addr)


def read_memory(cfg: AgentConfig, hardware: Hardware | None = None) -> records.Memory:
    """Read on every heartbeat (a VM given more RAM becomes a candidate without a restart);
    a configured total caps what is reported."""
    mem = (hardware or Hardware()).memory(cfg)
    if cfg.node.ram_total_gb is not None:
        total = int(cfg.node.ram_total_gb * GIB)
        return records.Memory(total_bytes=total, available_bytes=min(mem.available_bytes, total))
    return mem


def read_gpus(cfg: AgentConfig, hardware: Hardware) -> records.Gpus:
    """What NVML says, with the processes holding GPU memory named from /proc and told
    apart: this agent's engines (their pidfiles) or not."""
    if not cfg.node.gpus:
        return records.Gpus(status="disabled", detail="node.gpus = false in the agent config")
    lookup = HostProcesses(Path(cfg.paths.procfs), read_pidfiles(Path(cfg.paths.state_dir)))
    return hardware.gpus(lookup)


def discover(
    cfg: AgentConfig,
    ident: Identity,
    started_at: float,
    weights: records.Weights | None = None,
    hardware: Hardware | None = None,
) -> records.NodeInventory:
    """Everything, each fact on its own: one failing never cuts the others short (the seed's
    missing nvidia-smi stopped discovery before InfiniBand)."""
    hardware = hardware or Hardware()
    return records.NodeInventory(
        node=ident.node,
        hostname=ident.hostname,
        address=ident.address,
        agent_version=__version__,
        started_at=started_at,
        cpu=_safely("cpu", lambda: hardware.cpu(cfg), records.Cpu(count=0)),
        memory=read_memory(cfg, hardware),
        gpus=_safely("gpus", lambda: read_gpus(cfg, hardware), GPUS_FAILED),
        ib=_safely("infiniband", lambda: hardware.ib(cfg), []),
        engines=engines.settle_versions(_safely("engines", lambda: hardware.engines(cfg), []), []),
        weights=weights or records.Weights(),
        ports=_safely("ports", lambda: hardware.ports(cfg), records.PortsTaken()),
        fetch_dir=cfg.weights.fetch_dir,
        from_config=cfg.overrides(),
        updated_at=time.time(),
        labels=dict(cfg.node.labels),
        taints=list(cfg.node.taints),
    )


GPUS_FAILED = records.Gpus(status="error", detail="discovery failed; see the agent log")


def _safely(what, fn, fallback):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - report what failed, keep discovering the rest
        log.exception("discovering %s failed; reporting it as empty", what)
        return fallback


def probe_gpus(cfg: AgentConfig, hardware: Hardware) -> records.Gpus:
    """`read_gpus` as the agent's probes call it: a bug reported as a failed discovery."""
    return _safely("gpus", lambda: read_gpus(cfg, hardware), GPUS_FAILED)


def probe_ports(cfg: AgentConfig, hardware: Hardware) -> records.PortsTaken | None:
    """`hardware.ports`; None when reading failed (a bug: logged), to keep what was reported."""
    return _safely("ports", lambda: hardware.ports(cfg), None)


# Memory moving by less than this is no new fact for placement: written within
# intervals.gpu_report, not at every probe (a loading engine moves it every second)
GPU_MEMORY_STEP = 1_000_000_000


def gpus_changed(before: records.Gpus, after: records.Gpus) -> str | None:
    """Why `after` must be written at once instead of `before`, or None when they differ at
    most by memory moving less than GPU_MEMORY_STEP (or not at all)."""
    if (before.status, before.detail, before.driver_version) != (
        after.status,
        after.detail,
        after.driver_version,
    ) or [g.uuid for g in before.devices] != [g.uuid for g in after.devices]:
        return (
            f"GPUs {before.status} ({len(before.devices)}) -> {after.status} ({len(after.devices)})"
        )
    for old, new in zip(before.devices, after.devices, strict=True):
        if old.errors != new.errors:
            return f"GPU {new.index} memory errors {_errors(old)} -> {_errors(new)}"
        if _holders(old) != _holders(new):
            return f"GPU {new.index} processes {_holders(old)} -> {_holders(new)}"
        before_held, after_held = old.foreign_bytes(), new.foreign_bytes()
        if abs(before_held - after_held) >= GPU_MEMORY_STEP:
            return (
                f"GPU {new.index} memory held by other processes {before_held} -> "
                f"{after_held} bytes"
            )
    return None


def _holders(g: records.Gpu) -> list[tuple[int, bool]]:
    return sorted((p.pid, p.own) for p in g.processes)


def _errors(g: records.Gpu) -> str:
    e = g.errors
    return (
        f"(ecc {e.ecc_uncorrected_volatile}, retired pending {e.retired_pages_pending}, "
        f"remap pending {e.remapped_rows_pending}, remap failed {e.remapping_failed})"
    )


def comparable(inv: records.NodeInventory) -> records.NodeInventory:
    """The inventory minus what changes on its own every beat (available RAM, timestamps):
    nodes.<id> is rewritten only when this differs."""
    import msgspec

    return msgspec.structs.replace(
        inv,
        updated_at=0.0,
        memory=records.Memory(total_bytes=inv.memory.total_bytes, available_bytes=0),
        weights=msgspec.structs.replace(inv.weights, scanned_at=0.0),
    )
