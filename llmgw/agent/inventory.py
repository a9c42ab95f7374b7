"""The node's inventory: discovery, with the config's overrides applied on top.

What is written still wins: every override beats discovery and is listed in
`from_config`, so `nats kv get llmgw nodes.<id>` shows which values a person set.
The functions here block (subprocesses, sysfs, NVML): the agent calls them in a worker thread.
Hardware facts that are not files under `paths.procfs`/`paths.sysfs` come from a `Hardware`
the agent is given: the real machine unless a simulated node (llmgw.testing) passes its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw import __version__
from llmgw.agent.config import AgentConfig
from llmgw.agent.discovery import address, cpu, engines, gpus, identity, infiniband, memory
from llmgw.bus import records
from llmgw.bus.settings import DEFAULT_NATS_URL

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """Where the hardware facts not read from files come from. `gpus` answers what NVML
    would (see discovery.gpus.discover_gpus for what each status means)."""

    gpus: Callable[[], records.Gpus] = gpus.discover_gpus


@dataclass(frozen=True)
class Identity:
    node: str
    hostname: str
    address: str


def node_identity(cfg: AgentConfig) -> Identity:
    hostname = identity.read_hostname()
    node = cfg.node.id or identity.node_id_from_hostname(hostname)
    addr = cfg.node.address or address.address_for_urls(cfg.nats.urls or [DEFAULT_NATS_URL])
    return Identity(node=node, hostname=hostname, address=addr)


def read_memory(cfg: AgentConfig) -> records.Memory:
    """Read on every heartbeat (a VM given more RAM becomes a candidate without a restart);
    a configured total caps what is reported."""
    mem = memory.read_memory(Path(cfg.paths.procfs))
    if cfg.node.ram_total_gb is not None:
        total = int(cfg.node.ram_total_gb * GIB)
        return records.Memory(total_bytes=total, available_bytes=min(mem.available_bytes, total))
    return mem


def read_gpus(cfg: AgentConfig, hardware: Hardware) -> records.Gpus:
    if not cfg.node.gpus:
        return records.Gpus(status="disabled", detail="node.gpus = false in the agent config")
    return hardware.gpus()


def read_engines(cfg: AgentConfig) -> list[records.EngineInstall]:
    search = (
        [Path(p) for p in cfg.paths.llama_search_dirs]
        if cfg.paths.llama_search_dirs is not None
        else None
    )
    return engines.probe_engines(
        search_dirs=search, llama_server_path=cfg.node.llama_server, vllm_path=cfg.node.vllm
    )


def read_ib(cfg: AgentConfig) -> list[records.IbAdapter]:
    return infiniband.read_adapters(Path(cfg.paths.sysfs), cfg.fabrics)


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
        cpu=_safely("cpu", lambda: cpu.read_cpu(Path(cfg.paths.procfs)), records.Cpu(count=0)),
        memory=read_memory(cfg),
        gpus=_safely(
            "gpus",
            lambda: read_gpus(cfg, hardware),
            records.Gpus(status="error", detail="discovery failed; see the agent log"),
        ),
        ib=_safely("infiniband", lambda: read_ib(cfg), []),
        engines=_safely("engines", lambda: read_engines(cfg), []),
        weights=weights or records.Weights(),
        fetch_dir=cfg.weights.fetch_dir,
        from_config=cfg.overrides(),
        updated_at=time.time(),
        labels=dict(cfg.node.labels),
        taints=list(cfg.node.taints),
    )


def _safely(what, fn, fallback):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - report what failed, keep discovering the rest
        log.exception("discovering %s failed; reporting it as empty", what)
        return fallback


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
