"""The simulator: one real agent per node of a fleet file, in this process, kept as the file says.

Each node is `llmgw.agent.service.Agent` (registration, leases, weights scans, assignment
watching, the supervisor) given a `SimulatedHardware` and the `SimulatedEngines` launcher,
and a config as onboarding would write it: the node's id, its own loopback address
(127.P.X.Y: engines of different nodes never clash on a port, and the router reaches
each at the address its node reports), its fabrics, its weights directories. Nodes share
`connections` NATS connections (round robin), or have one each (0), as real agents do.

The file is polled (`poll` seconds); a change is applied live and logged: RAM is seen at
the node's next lease, engines, GPUs and weights at a rescan it is asked for at once, IB
adapters, labels and taints (configuration on a real node) restart that node's agent; a
node removed from the file or set `state = "dead"` stops (its lease stops moving, its
engines go with it), a new or revived one starts. A file that no longer parses is
reported and the fleet runs on as it was.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import msgspec

from llmgw.agent import config as agent_config
from llmgw.agent.discovery.engines import probe_engines
from llmgw.agent.service import Agent
from llmgw.bus import records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.errors import LlmgwError
from llmgw.sim.disk import SimDisk
from llmgw.sim.engines import SimulatedEngines
from llmgw.sim.fleet import (
    Fleet,
    FleetError,
    NodeSpec,
    Sim,
    parse_fleet_bytes,
    read_fleet_bytes,
)
from llmgw.sim.hardware import SimulatedHardware

log = logging.getLogger("llmgw.sim")

DAY = 86_400.0
NODES_PER_PROCESS = 254 * 256  # loopback addresses 127.P.0.1 .. 127.P.255.254


class SimError(LlmgwError):
    """The simulator cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class Part:
    """Which of the file's nodes this process runs: those whose name hashes to `index` of
    `count` (so adding a node never moves another to a different process)."""

    index: int = 0
    count: int = 1

    def holds(self, node: str) -> bool:
        return self.count == 1 or zlib.crc32(node.encode()) % self.count == self.index


@dataclass
class RunningNode:
    spec: NodeSpec
    address: str
    hardware: SimulatedHardware
    agent: Agent | None = None
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Simulator:
    def __init__(
        self,
        path: Path,
        nats: NatsSettings,
        bucket: BucketSettings,
        data_dir: Path,
        *,
        connections: int = 1,
        part: Part = Part(),
        poll: float = 1.0,
    ) -> None:
        if connections < 0:
            raise SimError(f"--connections {connections}: give 0 (one per node) or more")
        self.path = path
        self.nats = nats
        self.bucket = bucket
        self.disk = SimDisk(data_dir)
        self.connections = connections
        self.part = part
        self.poll = poll
        self.fleet: Fleet | None = None
        self.nodes: dict[str, RunningNode] = {}  # every node of this part seen, by name
        self._buses: list[Bus] = []
        self._seq = 0  # addresses handed out
        self._installs: dict[str, records.EngineInstall] = {}
        self._engines: SimulatedEngines | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._digest = b""

    # --- running -----------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Simulator] = anyio.TASK_STATUS_IGNORED
    ):
        data = read_fleet_bytes(self.path)  # bounded; a bad file at start is the command's error
        fleet = parse_fleet_bytes(data, self.path)
        self._digest = _digest(data)
        await anyio.to_thread.run_sync(self._prepare_disk)
        for _ in range(self.connections):
            self._buses.append(await Bus.connect(self.nats, self.bucket, give_up_after=30))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._engines = SimulatedEngines(fleet.sim)
                await tg.start(self._engines.run)
                self._apply(fleet)
                mine = len([n for n in fleet.nodes if self.part.holds(n)])
                log.info("fleet %s: %d nodes started", self.path, mine)
                task_status.started(self)
                await self._follow_file()
        finally:
            with anyio.CancelScope(shield=True):
                for bus in self._buses:
                    await bus.close()

    def _prepare_disk(self) -> None:
        try:
            self.disk.reset()
        except FileExistsError as e:
            raise SimError(str(e)) from None
        bins = self.disk.install_engines()
        found = probe_engines(
            path_env="",
            search_dirs=[],
            llama_server_path=str(bins["llama-server"]),
            vllm_path=str(bins["vllm"]),
        )
        self._installs = {e.name: e for e in found}

    async def _follow_file(self) -> None:
        while True:
            await anyio.sleep(self.poll)
            try:
                data = await anyio.to_thread.run_sync(read_fleet_bytes, self.path)
            except FleetError as e:
                log.warning("%s; the fleet runs on as it is", e)
                continue
            digest = _digest(data)
            if digest == self._digest:
                continue
            self._digest = digest
            try:
                fleet = parse_fleet_bytes(data, self.path)
            except FleetError as e:
                log.error("%s; the fleet runs on as it was", e)
                continue
            log.info("fleet %s changed", self.path)
            self._apply(fleet)

    # --- applying the file -------------------------------------------------------------

    def _apply(self, fleet: Fleet) -> None:
        old = self.fleet
        self.fleet = fleet
        assert self._engines is not None
        if old is not None and old.sim != fleet.sim:
            log.info(
                "fleet: [sim] changed: engines started from now on use it; heartbeat applies "
                "to nodes started from now on"
            )
        self._engines.behaviour = fleet.sim
        rescan: set[str] = set()
        for share, held in fleet.shares.items():
            before = old.shares.get(share) if old is not None else None
            if before is None or (before.models, before.adapters) != (held.models, held.adapters):
                self.disk.hold_share(share, held.models, held.adapters)
                if old is not None:
                    log.info(
                        "share %s: models %s, %d adapter(s)",
                        share,
                        held.models,
                        sum(len(a.files()) for a in held.adapters),
                    )
                    rescan |= {n for n, r in self.nodes.items() if share in r.spec.mounts}
        for name, running in list(self.nodes.items()):
            spec = fleet.nodes.get(name)
            if spec is None or spec.state == "dead":
                if running.agent is not None:
                    why = "removed from the file" if spec is None else 'state = "dead"'
                    log.info("node %s: dead (%s): its lease stops, its engines with it", name, why)
                    self._stop(running)
                if spec is not None:
                    running.spec = spec
                continue
        for name, spec in fleet.nodes.items():
            if not self.part.holds(name) or spec.state == "dead":
                continue
            running = self.nodes.get(name)
            if running is None:
                running = self._new_node(spec)
                if old is not None:
                    log.info("node %s: new, at %s", name, running.address)
                self._start(running, fleet.sim)
                continue
            if running.agent is None:
                log.info("node %s: up again", name)
                running.spec = spec
                running.hardware.spec = spec
                self.disk.hold(self.disk.weights_dir(name), spec.models, spec.adapters)
                self._start(running, fleet.sim)
                continue
            changes = _changes(running.spec, spec)
            if not changes:
                continue
            log.info("node %s: %s", name, "; ".join(changes))
            before, running.spec = running.spec, spec
            running.hardware.spec = spec
            if (before.models, before.adapters) != (spec.models, spec.adapters):
                self.disk.hold(self.disk.weights_dir(name), spec.models, spec.adapters)
            if _needs_restart(before, spec):
                log.info("node %s: agent restarted (its configuration changed)", name)
                self._stop(running)
                self._start(running, fleet.sim)
            elif _needs_rescan(before, spec):
                rescan.add(name)
        for name in sorted(rescan):
            agent = self.nodes[name].agent
            if agent is not None:
                assert self._tg is not None
                self._tg.start_soon(_rescan, agent)

    def _new_node(self, spec: NodeSpec) -> RunningNode:
        if self._seq >= NODES_PER_PROCESS:
            raise SimError(
                f"more than {NODES_PER_PROCESS} nodes in one process; spread them with --processes"
            )
        n = self._seq
        self._seq += 1
        address = f"127.{self.part.index + 1}.{n // 254}.{n % 254 + 1}"
        self.disk.hold(self.disk.weights_dir(spec.name), spec.models, spec.adapters)
        hardware = SimulatedHardware(spec, self._installs, lambda: self._engines_on(address))
        running = RunningNode(spec, address, hardware)
        self.nodes[spec.name] = running
        return running

    def _start(self, node: RunningNode, sim: Sim) -> None:
        assert self._tg is not None
        bus = self._buses[self._seq_of(node) % len(self._buses)] if self._buses else None
        cfg = self.agent_config(node, sim)
        assert self._engines is not None
        node.agent = Agent(
            cfg,
            hardware=node.hardware.hardware(),
            launcher=self._engines,
            bus=bus,
            config_path=f"{self.path} (node {node.spec.name})",
        )
        node.scope = anyio.CancelScope()
        self._tg.start_soon(_run_agent, node.agent, node.scope, node.spec.name)

    def _engines_on(self, address: str) -> list:
        return self._engines.on(address) if self._engines is not None else []

    def _seq_of(self, node: RunningNode) -> int:
        _, _, x, y = node.address.split(".")
        return int(x) * 254 + int(y) - 1

    def _stop(self, node: RunningNode) -> None:
        node.scope.cancel()
        node.agent = None

    def agent_config(self, node: RunningNode, sim: Sim) -> agent_config.AgentConfig:
        """The config onboarding would write for this node: its id, address, fabrics and
        weights directories; probes that only the file can change are left to rescans."""
        spec, disk = node.spec, self.disk
        dirs = [str(disk.weights_dir(spec.name))] if spec.models or spec.adapters else []
        dirs += [str(disk.share_dir(s)) for s in spec.mounts]
        state = disk.node_dir(spec.name)
        n = self.nats
        return agent_config.AgentConfig(
            nats=agent_config.Nats(
                urls=list(n.urls),
                tls_ca=n.tls_ca,
                tls_cert=n.tls_cert,
                tls_key=n.tls_key,
                bucket=self.bucket.name,
                bucket_replicas=self.bucket.replicas,
            ),
            node=agent_config.Node(
                id=spec.name,
                address=node.address,
                labels=dict(spec.labels),
                taints=list(spec.taints),
            ),
            fabrics={a.adapter: a.fabric for a in spec.ib if a.fabric is not None},
            weights=agent_config.Weights(
                dirs=dirs, fetch_dir=str(state / "fetched"), scan_interval=DAY
            ),
            intervals=agent_config.Intervals(
                heartbeat=sim.heartbeat,
                engine_probe=DAY,
                gpu_probe=sim.gpu_probe,  # engines' GPU memory moves (llmgw.sim.hardware)
                port_probe=DAY,
            ),
            engines=agent_config.Engines(
                listen_host=node.address,
                own_scope="never",
                on_agent_exit="stop",
                poll_interval=0.2,
                stop_grace=1.0,
                drain_timeout=30.0,
                backoff_base=1.0,
            ),
            paths=agent_config.Paths(state_dir=str(state / "state")),
        )


async def _run_agent(agent: Agent, scope: anyio.CancelScope, name: str) -> None:
    with scope:
        try:
            await agent.run()
        except Exception:  # noqa: BLE001 - one node's bug must not end the fleet
            log.exception("node %s: its agent failed", name)


async def _rescan(agent: Agent) -> None:
    try:
        await agent.rescan()
    except Exception:  # noqa: BLE001 - not started yet, or stopping: its start scans anyway
        log.debug("rescan of a node failed", exc_info=True)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_RESTART = ("ib", "labels", "taints")
_RESCAN = ("gpus", "engines", "mounts", "models", "adapters", "cpus")


def _changes(before: NodeSpec, after: NodeSpec) -> list[str]:
    out = []
    for name in before.__struct_fields__:
        a, b = getattr(before, name), getattr(after, name)
        if a != b:
            out.append(f"{name} {_show(a)} -> {_show(b)}")
    return out


def _show(value: object) -> str:
    return (
        msgspec.json.encode(value).decode()
        if not isinstance(value, str | float | int)
        else str(value)
    )


def _needs_restart(before: NodeSpec, after: NodeSpec) -> bool:
    return any(getattr(before, f) != getattr(after, f) for f in _RESTART)


def _needs_rescan(before: NodeSpec, after: NodeSpec) -> bool:
    return any(getattr(before, f) != getattr(after, f) for f in _RESCAN)
