"""This node's shards: one `LocalShard` per `assign.<node>.<rid>`, each running its engine.

`NodeShards` follows the watch of this node's assignments and keeps one `LocalShard` per
replica placed here. Each reconciles its replica in one loop: leave alone what already
matches (same generation), validate then start what is assigned to run, drain then stop
what is marked drain/stop or removed, then forget it. Every engine transition is written to
`shards.<node>.<rid>` and published on `llmgw.events.shard-<phase>.<node>`. A profile is
validated before anything is launched, because an engine refuses a bad one only after
minutes of loading.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import anyio

from llmgw import catalog
from llmgw.agent.config import AgentConfig
from llmgw.agent.cores import CoreAccount
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.launcher import EngineLauncher, ProcessLauncher
from llmgw.agent.engines.pidfile import (
    EngineProcess,
    Refusal,
    leader_alive,
    leftover_engines,
    stop_engine,
)
from llmgw.agent.engines.validate import NodeFacts, Problem, prepare_launch
from llmgw.agent.lifetime import own_scope
from llmgw.agent.lora import LoraSync, adopted_files
from llmgw.agent.lora import started_with as lora_started_with
from llmgw.agent.supervisor import EngineSupervisor, PhaseChange, SupervisorTiming
from llmgw.allotment import held_to_allotment
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, Synced, decoder
from llmgw.bus.kept import KeptWrites

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThisNode:
    """What every shard on this node uses: the bus, the agent's config, the node's current
    inventory, the API key engines are started with and how they are started (processes,
    unless a simulated node serves them itself)."""

    bus: Bus
    cfg: AgentConfig
    inventory: Callable[[], records.NodeInventory]
    engine_api_key: str | None = None
    launcher: EngineLauncher = field(default_factory=ProcessLauncher)
    cores: CoreAccount = field(default_factory=CoreAccount.of_this_process)
    # this node's shard records, written again until they land (NodeShards runs it)
    writes: KeptWrites = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "writes", KeptWrites(self.bus))

    @property
    def name(self) -> str:
        return self.inventory().node

    @property
    def state_dir(self) -> Path:
        return Path(self.cfg.paths.state_dir)

    def timing(self) -> SupervisorTiming:
        e = self.cfg.engines
        # cancel_grace < 1 s: an agent told to stop stops within a second, engines with it
        return SupervisorTiming(
            readiness_timeout=e.readiness_timeout,
            poll_interval=e.poll_interval,
            backoff_base=e.backoff_base,
            backoff_cap=e.backoff_cap,
            max_failed_starts=e.max_failed_starts,
            stop_grace=e.stop_grace,
            cancel_grace=0.7,
            drain_timeout=e.drain_timeout,
        )

    def facts(self) -> NodeFacts:
        inv = self.inventory()
        return NodeFacts(gpus=inv.gpus.devices, engines=inv.engines)

    async def launch_for(self, a: records.Assignment) -> tuple[LaunchSpec | None, list[Problem]]:
        """The launch `a` asks for, from its catalog entry; else why there is none."""
        entry = await self.bus.get(
            keys.catalog(a.model), lambda b: catalog.decode_model(b, a.model)
        )
        if entry is None:
            return None, [Problem(f"catalog.{a.model} is missing or invalid; nothing to launch")]
        profile = entry.value.profile(a.profile)
        if profile is None:
            return None, [Problem(f"model {a.model} has no profile {a.profile!r} in the catalog")]
        spec = launch_spec(self.cfg, self.inventory(), entry.value, profile, a)
        if profile.cpu_cores and not spec.gpu_uuids:
            cores = self.cores.take(a.rid, profile.cpu_cores)
            if cores is None:
                return None, [Problem(self.cores.shortage(profile.cpu_cores), transient=True)]
            spec = dataclasses.replace(spec, cpu_cores=cores)
        return dataclasses.replace(spec, api_key=self.engine_api_key), []

    def launch_prefix(self, rid: str, generation: int) -> Callable[[], list[str]]:
        """What the engine's command line is run under: under systemd, a scope of its own
        in llmgw-engines.slice, so that stopping or restarting the agent's unit (which
        kills what is left in its cgroup) leaves the engine alone (docs/engines.md). Asked
        at every start: a scope's name is new each time (a stray process of an earlier
        start can keep that start's scope alive, and systemd refuses a name in use)."""
        if not own_scope(self.cfg.engines.own_scope, os.environ, shutil.which("systemd-run")):
            return list

        def prefix() -> list[str]:
            started = int(time.time() * 1000)
            return [
                "systemd-run",
                "--scope",
                "--quiet",
                "--collect",
                f"--unit=llmgw-engine-{rid}-{generation}-{started}",
                "--slice=llmgw-engines.slice",
                "--",
            ]

        return prefix

    async def refused(self, refusal: Refusal) -> None:
        """Say what the agent would not act on: in its log, and as an event
        (`llmgw.events.agent-left-alone.<node>` for processes it left running,
        `agent-pidfile-refused.<node>` for a pidfile it would not read)."""
        log.warning("%s", refusal.line)
        kind = "agent-left-alone" if refusal.what == "processes" else "agent-pidfile-refused"
        await self.bus.publish_event(kind, self.name, refusal.line)

    async def stop_leftover(self, record: EngineProcess, why: str, grace: float) -> None:
        """Stop an engine an earlier agent left (only what is proven to be it), saying so."""
        stopped = await anyio.to_thread.run_sync(stop_engine, self.state_dir, record, why, grace)
        log.warning("%s", stopped.line)
        if stopped.left_alone is not None:
            await self.refused(stopped.left_alone)

    async def put(self, shard: records.Shard) -> None:
        try:
            await self.writes.put(keys.shard(shard.node, shard.rid), shard)
        except Exception as e:  # noqa: BLE001 - not the link (a bug, a refusal): said
            log.warning("could not write shards.%s.%s: %s", shard.node, shard.rid, e)


class NodeShards:
    """Follows `assign.<node>.>` and keeps one `LocalShard` per replica, in its task group.
    What concerns more than one replica is here: leftover engines reaped before anything
    starts, a new engine waiting for an old one on the same port or GPUs, shard records
    whose assignment is gone, and reporting every shard again after a reconnect."""

    def __init__(
        self,
        bus: Bus,
        cfg: AgentConfig,
        inventory: Callable[[], records.NodeInventory],
        *,
        engine_api_key: str | None = None,
        launcher: EngineLauncher | None = None,
    ) -> None:
        self.node = ThisNode(bus, cfg, inventory, engine_api_key, launcher or ProcessLauncher())
        self._shards: dict[str, LocalShard] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        # engines an earlier agent left running, by rid, until adopted or stopped
        self._leftovers: dict[str, EngineProcess] = {}

    def shard_records(self) -> list[records.Shard]:
        """The shard records of this node's replicas, as last written."""
        return [s.record for s in self._shards.values() if s.record is not None]

    def leave_engines_running(self) -> None:
        """The agent is being restarted: its engines serve on, and the next agent adopts
        them (call before cancelling `run`)."""
        for shard in self._shards.values():
            if shard.engine is not None:
                shard.engine.supervisor.leave_running()

    async def run(self) -> None:
        # An earlier agent (restarted, or killed hard) may have left engines running: each
        # is adopted by its replica if it still matches the assignment, and stopped
        # otherwise, before anything is launched on its GPUs or port.
        found, notes = await anyio.to_thread.run_sync(leftover_engines, self.node.state_dir)
        for refusal in notes:
            await self.node.refused(refusal)
        self._leftovers = {r.rid: r for r in found}
        for record in found:  # before any launch takes them
            self.node.cores.keep(record.rid, record.cpu_cores)
        if found:
            log.info(
                "found %d engine(s) left by an earlier agent: %s",
                len(found),
                ", ".join(f"{r.rid} (pid {r.pid})" for r in found),
            )
        bus = self.node.bus
        bus.on_reconnected(self.report_all)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.node.writes.run)
            async for item in bus.watch(
                keys.pattern(keys.ASSIGN, self.node.name), decoder(records.Assignment)
            ):
                if isinstance(item, Synced):
                    # (re)read all assignments: shard records of replicas that were removed
                    # while this agent was down or cut off have no owner left but us; and
                    # left engines no assignment claims go
                    tg.start_soon(self._remove_stale_shards)
                    tg.start_soon(self._stop_unclaimed_leftovers)
                    continue
                self._assigned(item.key.rsplit(".", 1)[1], item.value)

    async def engine_loads(self, within: float) -> list[records.EngineLoad]:
        """What each serving engine says of its own load, asked of all at once, each given
        `within` seconds (one that does not answer is left out)."""
        loads: list[records.EngineLoad] = []

        async def ask(shard: LocalShard, engine: _Engine) -> None:
            with anyio.move_on_after(within):
                g = await engine.supervisor.gauges()
                if g is not None:
                    loads.append(
                        records.EngineLoad(
                            rid=shard.rid,
                            model=engine.assignment.model,
                            running=g.running,
                            waiting=g.waiting,
                            kv_cache=g.kv_cache,
                            prefix_hits=g.prefix_hits,
                        )
                    )

        async with anyio.create_task_group() as tg:
            for shard in list(self._shards.values()):
                if shard.engine is not None:
                    tg.start_soon(ask, shard, shard.engine)
        return sorted(loads, key=lambda e: e.rid)[: records.MAX_LEASE_ENGINES]

    async def hold_to_allotments(self, inv: records.NodeInventory) -> None:
        """After a GPU probe: each shared engine's memory on its GPU against its allotment,
        in its shard record when it moved by a GB or crossed the margin
        (llmgw/allotment.py). An engine over it is named and logged, not stopped."""
        gpus = {g.uuid: g for g in inv.gpus.devices}
        for shard in list(self._shards.values()):
            engine, record = shard.engine, shard.record
            if engine is None or record is None or not engine.spec.gpu_shared:
                continue
            gpu = gpus.get(engine.spec.gpu_uuids[0]) if engine.spec.gpu_uuids else None
            allotted = int((engine.spec.gpu_memory_gb or 0) * 1e9)
            held = None if gpu is None else held_to_allotment(record, gpu, allotted)
            if held is None:
                continue
            if held.gpu_outgrown and not record.gpu_outgrown:
                log.warning(
                    "%s %s: its engine holds %.1f GB of GPU %s, more than the %.1f GB it was "
                    "given; not stopped",
                    record.model,
                    record.rid,
                    (held.gpu_used_bytes or 0) / 1e9,
                    gpu.uuid if gpu else "?",
                    allotted / 1e9,
                )
            shard.record = held
            await self.node.put(held)

    async def report_all(self) -> None:
        """After a NATS outage: the engines kept running; say so again."""
        for shard in list(self._shards.values()):
            await shard.report_again()

    def _assigned(self, rid: str, want: records.Assignment | None) -> None:
        shard = self._shards.get(rid)
        if shard is None or shard.state is ShardState.GONE:
            if want is None:
                return  # nothing here to stop or forget
            shard = LocalShard(
                rid, self.node, self._wait_for_overlapping_engines, self._claim_leftover
            )
            self._shards[rid] = shard
            assert self._tg is not None
            self._tg.start_soon(self._run_shard, shard)
        shard.assign(want)

    async def _run_shard(self, shard: LocalShard) -> None:
        try:
            await shard.run()
        finally:
            if self._shards.get(shard.rid) is shard:
                del self._shards[shard.rid]
                self.node.cores.give_back(shard.rid)  # its engine is gone with it

    def _claim_leftover(self, rid: str) -> EngineProcess | None:
        return self._leftovers.pop(rid, None)

    async def _stop_unclaimed_leftovers(self) -> None:
        for rid in [r for r in self._leftovers if r not in self._shards]:
            record = self._leftovers.pop(rid)
            await self.node.stop_leftover(
                record, "no assignment names it any more", self.node.cfg.engines.stop_grace
            )
            self.node.cores.give_back(rid)

    async def _remove_stale_shards(self) -> None:
        bus, node = self.node.bus, self.node.name
        try:
            stored = await bus.list(keys.pattern(keys.SHARDS, node), lambda b: b)
            for key in stored:
                shard = self._shards.get(key.rsplit(".", 1)[1])
                if shard is None or shard.state is ShardState.GONE:
                    await bus.delete(key)
                    log.info("removed %s: its assignment is gone", key)
        except Exception as e:  # noqa: BLE001 - tried again at the next re-read
            log.warning("could not remove stale shard records: %s", e)

    async def _wait_for_overlapping_engines(self, rid: str, spec: LaunchSpec) -> None:
        """An engine of a replica being removed may still hold the port or GPUs the new one
        is given (a node back after being declared lost gets its model placed again on the
        same resources): let it finish stopping first, bounded."""
        for other in list(self._shards.values()):
            engine = other.engine
            if other.rid == rid or engine is None or not _overlaps(spec, engine.spec):
                continue
            if other.wanted is not None and other.wanted.action == "run":
                continue  # a real conflict: validation says so
            e = self.node.cfg.engines
            log.info("%s waits for %s to stop (same port or GPUs)", rid, other.rid)
            with anyio.move_on_after(e.drain_timeout + e.stop_grace + 10):
                await engine.done.wait()


# --- one replica on this node -----------------------------------------------------------------


class ShardState(Enum):
    """What a `LocalShard` is doing about its assignment. Its engine, while it has one, is
    `LocalShard.engine`; the phase the engine reports is in its record."""

    IDLE = "idle"  # no engine: none launched yet, refused, stopped as assigned, or it failed
    LAUNCHING = "launching"  # reading its launch, waiting for overlapping engines, validating
    RUNNING = "running"  # its supervisor runs the engine of this generation
    STOPPING = "stopping"  # its engine drains or stops
    RETRYING = "retrying"  # a refusal that clears by itself, or an error: looks again soon
    GONE = "gone"  # no assignment, no engine, no record: its owner drops it


_SS = ShardState

# Every move a LocalShard makes (`LocalShard._to`; anything else is a bug, ShardStateError).
# An engine is started only from LAUNCHING, or from IDLE or RETRYING to adopt one an
# earlier agent left so as to drain it; it is replaced only after STOPPING; an error or a
# transient refusal is RETRYING from wherever the look was.
SHARD_MOVES: dict[ShardState, frozenset[ShardState]] = {
    _SS.IDLE: frozenset({_SS.LAUNCHING, _SS.RUNNING, _SS.STOPPING, _SS.RETRYING, _SS.GONE}),
    _SS.LAUNCHING: frozenset({_SS.RUNNING, _SS.IDLE, _SS.RETRYING, _SS.GONE}),
    _SS.RUNNING: frozenset({_SS.STOPPING, _SS.IDLE, _SS.RETRYING}),
    _SS.STOPPING: frozenset({_SS.IDLE, _SS.LAUNCHING, _SS.RETRYING, _SS.GONE}),
    _SS.RETRYING: frozenset({_SS.IDLE, _SS.LAUNCHING, _SS.RUNNING, _SS.STOPPING, _SS.GONE}),
    _SS.GONE: frozenset(),
}


class ShardStateError(RuntimeError):
    """A move a LocalShard never makes: a bug in this module."""


def check_shard_move(old: ShardState, new: ShardState) -> ShardState:
    """`new`, when a LocalShard may move from `old` to it (staying put is no move);
    ShardStateError otherwise."""
    if new is not old and new not in SHARD_MOVES[old]:
        raise ShardStateError(f"shard state {old.value} -> {new.value} is not a move it makes")
    return new


@dataclass
class _Engine:
    assignment: records.Assignment
    spec: LaunchSpec
    supervisor: EngineSupervisor
    done: anyio.Event = field(default_factory=anyio.Event)
    # LoRA adapters: vLLM's, loaded while it runs; llama-server's left out at launch
    lora: LoraSync | None = None
    lora_refused: list[records.AdapterFailure] = field(default_factory=list)
    lora_changed: anyio.Event = field(default_factory=anyio.Event)

    def adapters(self) -> tuple[list[str], list[records.AdapterFailure]]:
        """What its shard record says of LoRA: the adapters it serves, and those refused."""
        if self.lora is not None:
            return self.lora.served(), self.lora.failures()
        # llama-server's in its --lora order, the index a request names ("": a file of an
        # adopted engine its assignment no longer names)
        return [aid for aid, _ in self.spec.lora_files], list(self.lora_refused)

    def look_at_adapters(self) -> None:
        self.lora_changed.set()


WaitForRoom = Callable[[str, LaunchSpec], Awaitable[None]]


class LocalShard:
    """This node's part of one replica: the assignment it is given, the engine it runs for
    it, its shard record and the loop that reconciles them. `assign()` from the watch,
    `run()` in a task group until the replica is gone from this node (state GONE)."""

    def __init__(
        self,
        rid: str,
        node: ThisNode,
        wait_for_room: WaitForRoom,
        claim_leftover: Callable[[str], EngineProcess | None] = lambda rid: None,
    ) -> None:
        self.rid = rid
        self._claim_leftover = claim_leftover
        self.node = node
        self.wanted: records.Assignment | None = None
        self.engine: _Engine | None = None
        self.record: records.Shard | None = None
        self.state = ShardState.IDLE
        self._wait_for_room = wait_for_room
        self._changed = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        # the engine an earlier agent left for this replica, until adopted or stopped
        self._leftover: EngineProcess | None = None

    def assign(self, want: records.Assignment | None) -> None:
        """The latest assignment (None: deleted); the loop looks at it at once, or as soon
        as it is done with what it is doing (a long drain)."""
        self.wanted = want
        self._changed.set()

    async def report_again(self) -> None:
        if self.record is not None:
            await self.node.put(self.record)

    async def run(self) -> None:
        """Reconcile until the replica is gone. On an error (NATS away, a full disk) or a
        transient refusal (its port still held by an engine being stopped) it looks again
        with a growing delay. One replica's trouble never ends the agent: the other engines
        keep serving. Its engine's supervisor runs in its task group: cancelling this stops
        the engine (SIGTERM, then SIGKILL after the supervisor's cancel grace)."""
        retry = RetryDelay()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            while True:
                self._changed = changed = anyio.Event()
                try:
                    again = await self._look()
                except Exception as e:  # noqa: BLE001
                    log.exception("reconciling %s failed; retrying in %g s", self.rid, retry.delay)
                    await self._report_trouble(e)
                    again = True
                if self.state is ShardState.GONE:
                    return
                if changed.is_set():
                    retry.reset()  # something new arrived meanwhile: look again at once
                    continue
                if again:
                    self._to(ShardState.RETRYING)
                with anyio.move_on_after(retry.delay if again else math.inf):
                    await changed.wait()
                if changed.is_set():
                    retry.reset()
                else:
                    retry.waited()

    async def _look(self) -> bool:
        """One decision; True when it should be tried again later. Only `run`'s loop calls
        it, so decisions for one replica never overlap; other replicas go on meanwhile."""
        want, running = self.wanted, self.engine
        if running is None and self._leftover is None:
            # claimed whatever the assignment says: an engine left while its replica was
            # being drained or removed is this replica's to drain, never nobody's
            self._leftover = self._claim_leftover(self.rid)
        step = next_step(want, running.assignment if running is not None else None)
        if step is Step.LEAVE:
            self._to(ShardState.RUNNING)
            return False
        if step is Step.FORGET:
            if running is not None:
                await self._stop(running, drain=True)
            await self._stop_leftover("its assignment is gone")
            await self._forget()
            # gone only while nothing is assigned: from then on an assignment for this rid
            # goes to a new LocalShard (`NodeShards._assigned`)
            self._to(ShardState.GONE if self.wanted is None else ShardState.IDLE)
            return False
        assert want is not None
        if step is Step.STOP:
            if running is None and self._leftover is not None:
                running = await self._adopt_to_stop(want)
            if running is not None:
                running.assignment = want
                await self._stop(running, drain=want.action == "drain")
            await self._report(want, "stopped", reason=f"assignment says {want.action}")
            self._to(ShardState.IDLE)
            return False
        spec, problems = await self.node.launch_for(want)
        if running is not None:
            healthy = self.record is not None and self.record.phase != "failed"
            if keeps_launch(spec, running.spec, healthy=healthy):
                if spec != running.spec:
                    log.info(
                        "%s %s: catalog changed; the running engine keeps its launch "
                        "until replaced",
                        want.model,
                        self.rid,
                    )
                running.assignment = want
                running.supervisor.keep_for(want.generation)
                running.look_at_adapters()
                await self._report(want, self.record.phase if self.record else "starting")
                self._to(ShardState.RUNNING)
                return False
            await self._stop(running, drain=True)
        self._to(ShardState.LAUNCHING)
        if self._leftover is not None:
            if spec is None:
                # nothing to judge it by (its catalog entry does not read): it serves on,
                # and is judged when the entry or the assignment changes
                await self._report(
                    want,
                    "failed",
                    reason=f"{problems[0].reason}; the engine an earlier agent left "
                    "serves on until its catalog entry reads",
                )
                self._to(ShardState.IDLE)
                return False
            leftover, self._leftover = self._leftover, None
            why = await self._not_adoptable(leftover, want, spec)
            if not why:
                log.info(
                    "%s %s: adopted the engine an earlier agent left (pid %d)",
                    want.model,
                    self.rid,
                    leftover.pid,
                )
                self._start(want, spec, adopt=leftover)
                return False
            await self._stop_leftover(why, leftover)
        if spec is not None:
            await self._wait_for_room(self.rid, spec)
        was = self.record
        if not (was and was.phase == "validating" and was.generation == want.generation):
            await self._report(want, "validating")  # a wait already said stays said
        if spec is not None and not problems:
            spec, problems = await anyio.to_thread.run_sync(prepare_launch, spec, self.node.facts())
        if problems:
            reason = "; ".join(p.reason for p in problems)
            if all(p.transient for p in problems):
                # an expected wait (a port, or GPU memory, an engine being stopped still
                # holds): no failure, so no rollout stops on it and nothing reads "failed";
                # still validating, saying what it waits for, and tried again
                await self._report(
                    want, "validating", reason=WAITING + reason, refused=refused_key(problems)
                )
                return True
            log.error("%s %s refused before launch: %s", want.model, self.rid, reason)
            # the rest wait for a new assignment or catalog entry: this node gives up on
            # this launch, and says so at once (gave_up), so the controller moves or
            # explains the replica now instead of after its refused_after rule
            # (controller/inputs.py StoppedTrying)
            await self._report(
                want,
                "failed",
                reason=f"refused before launch: {reason}",
                refused=refused_key(problems),
                gave_up=True,
            )
            self._to(ShardState.IDLE)
            return False
        assert spec is not None
        refused: list[records.AdapterFailure] = []
        if spec.lora_files:
            held = {h.path.rstrip("/"): h for h in self.node.inventory().weights.adapters}
            spec, refused = await anyio.to_thread.run_sync(
                lora_started_with, spec, want.adapters, held
            )
        self._start(want, spec, lora_refused=refused)
        return False

    async def _not_adoptable(
        self, leftover: EngineProcess, want: records.Assignment, spec: LaunchSpec
    ) -> str:
        """Why the engine an earlier agent left does not serve `want` ("" when it does): its
        first process must still be the command it was started with (pid, start time and
        command line read back from /proc), and its assignment must still be the one it
        serves (`adoption`)."""
        if not await anyio.to_thread.run_sync(leader_alive, leftover):
            return "its first process is gone or is another program now"
        return adoption(leftover, want, spec)

    async def _adopt_to_stop(self, want: records.Assignment) -> _Engine | None:
        """The engine an earlier agent left for a replica now to be drained or stopped:
        adopted, so that a drain lets its requests finish, when it is still the engine it
        was and still where its assignment puts it; else stopped. The engine, or None."""
        leftover, self._leftover = self._leftover, None
        assert leftover is not None
        spec, problems = await self.node.launch_for(want)
        why = problems[0].reason if spec is None else ""
        if spec is not None:
            why = await self._not_adoptable(leftover, want, spec)
        if why or spec is None:
            await self._stop_leftover(why, leftover)
            return None
        log.info(
            "%s %s: adopted the engine an earlier agent left (pid %d) to %s it",
            want.model,
            self.rid,
            leftover.pid,
            want.action,
        )
        self._start(want, spec, adopt=leftover)
        return self.engine

    async def _stop_leftover(self, why: str, leftover: EngineProcess | None = None) -> None:
        """Stop the engine an earlier agent left for this replica (SIGTERM, then SIGKILL
        after the stop grace), saying why in the log."""
        if leftover is None:
            leftover, self._leftover = self._leftover, None
        if leftover is None:
            return
        await self.node.stop_leftover(
            leftover, f"not adopted: {why}", self.node.cfg.engines.stop_grace
        )

    def _start(
        self,
        want: records.Assignment,
        spec: LaunchSpec,
        *,
        adopt: EngineProcess | None = None,
        lora_refused: Sequence[records.AdapterFailure] = (),
    ) -> None:
        log_dir = self.node.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)

        async def on_phase(change: PhaseChange) -> None:
            if engine.lora is not None:
                if change.phase == "starting":
                    engine.lora.engine_restarted()  # a new process has nothing loaded
                elif change.phase == "ready":
                    engine.look_at_adapters()
            # "starting" carries the argv (in the log file already); "ready" says "ready"
            quiet = change.phase == "starting" or change.reason == change.phase
            await self._report(
                engine.assignment,
                change.phase,
                reason="" if quiet else change.reason,
                tail=change.tail if change.phase == "failed" else [],
                restarts=change.restarts,
                pid=change.pid,
                gave_up=change.gave_up,
                refused=change.refused,
            )

        supervisor = EngineSupervisor(
            spec,
            shard=f"{self.node.name}.{self.rid}",
            on_phase=on_phase,
            log_path=log_dir / f"{self.rid}.log",
            state_dir=self.node.state_dir,
            timing=self.node.timing(),
            adopt=adopt,
            generation=want.generation,
            launch_prefix=self.node.launch_prefix(self.rid, want.generation),
            launcher=self.node.launcher,
        )
        if adopt is not None and spec.lora_files:
            # llama-server's ids are its start's: read back from its command line
            spec = dataclasses.replace(spec, lora_files=adopted_files(adopt.argv, want.adapters))
        engine = _Engine(want, spec, supervisor, lora_refused=list(lora_refused))
        if spec.lora is not None and not spec.headless:
            engine.lora = LoraSync(supervisor.ask)
        self.engine = engine
        assert self._tg is not None
        self._tg.start_soon(self._supervise, engine)
        if engine.lora is not None:
            self._tg.start_soon(self._keep_adapters, engine)
        self._to(ShardState.RUNNING)

    async def _keep_adapters(self, engine: _Engine) -> None:
        """vLLM's adapters kept to its assignment while it runs: at every new assignment,
        when it becomes ready, and every second while one waits to be unloaded."""
        assert engine.lora is not None
        while not engine.done.is_set():
            engine.lora_changed = changed = anyio.Event()
            if self.record is not None and self.record.phase == "ready" and engine is self.engine:
                try:
                    if await engine.lora.sync(engine.assignment.adapters):
                        await self._report(engine.assignment, "ready")
                except Exception:  # noqa: BLE001 - this engine's adapters only; looked at again
                    log.exception("%s: keeping its LoRA adapters failed", self.rid)
            with anyio.move_on_after(1.0 if engine.lora.pending else 30.0):
                await changed.wait()

    async def _supervise(self, engine: _Engine) -> None:
        try:
            await engine.supervisor.run()
        except Exception as e:  # noqa: BLE001 - e.g. the state dir is full: this engine only
            log.exception("supervising %s failed", self.rid)
            with anyio.CancelScope(shield=True):
                await self._report(engine.assignment, "failed", reason=f"supervision failed: {e}")
        finally:
            engine.done.set()
            if self.engine is engine:
                self.engine = None
                if self.state is ShardState.RUNNING:
                    self._to(ShardState.IDLE)

    async def _stop(self, engine: _Engine, *, drain: bool) -> None:
        self._to(ShardState.STOPPING)
        if drain:
            await engine.supervisor.drain()
        else:
            await engine.supervisor.stop()
        await engine.done.wait()

    async def _forget(self) -> None:
        if self.record is not None:
            self.record = None
            try:
                await self.node.writes.delete(keys.shard(self.node.name, self.rid))
            except Exception as e:  # noqa: BLE001 - removed when the assignments are re-read
                log.warning("could not delete shards.%s.%s: %s", self.node.name, self.rid, e)

    async def _report_trouble(self, e: Exception) -> None:
        want = self.wanted
        if want is None or self.engine is not None:
            return
        try:
            await self._report(want, "failed", reason=f"{e or type(e).__name__}; retrying")
        except Exception:  # noqa: BLE001 - NATS away: re-reported on reconnect
            pass

    async def _report(
        self,
        a: records.Assignment,
        phase: str,
        *,
        reason: str = "",
        tail: list[str] | None = None,
        restarts: int | None = None,
        pid: int | None = None,
        gave_up: bool = False,
        refused: str = "",
    ) -> None:
        inv = self.node.inventory()
        old = self.record
        waited = old is not None and old.reason.startswith(WAITING)
        engine = self.engine
        served, lora_failures = engine.adapters() if engine is not None else ([], [])
        shard = next_shard(
            old,
            ShardEvent(
                node=inv.node,
                rid=self.rid,
                assignment=a,
                phase=phase,
                at=time.time(),
                endpoint=f"{inv.address}:{a.port}" if phase == "ready" and a.rank == 0 else None,
                served_name=engine.spec.served_name if engine is not None else None,
                reason=reason,
                tail=tail or (),
                restarts=restarts,
                pid=pid,
                gave_up=gave_up,
                refused=refused,
                adapters=tuple(served),
                adapter_failures=tuple(lora_failures),
            ),
        )
        self.record = shard
        await self.node.put(shard)
        # a phase entered, or a wait begun (said once, not at every look)
        if old is None or old.phase != phase or (reason.startswith(WAITING) and not waited):
            level = logging.WARNING if phase == "failed" else logging.INFO
            log.log(
                level, "%s %s: %s%s", a.model, self.rid, phase, f" ({reason})" if reason else ""
            )
            await self.node.bus.publish_event(
                f"shard-{phase}",
                inv.node,
                f"{a.model} {self.rid} on {inv.node}: {phase}",
                rid=self.rid,
                model=a.model,
                reason=reason,
                endpoint=shard.endpoint,
            )

    def _to(self, state: ShardState) -> None:
        """The one way the state changes: the move must be in SHARD_MOVES (a bug otherwise).
        The phase the replica's engine is in is its record's, reported by `_report`."""
        check_shard_move(self.state, state)
        if state is not self.state:
            log.debug("%s: %s -> %s", self.rid, self.state.value, state.value)
        self.state = state


# --- what a replica does next: pure ------------------------------------------------------------


class Step(Enum):
    LEAVE = "leave"  # its engine runs this generation already
    FORGET = "forget"  # the assignment is deleted: drain what runs, delete the record
    STOP = "stop"  # the assignment says drain or stop
    LAUNCH = "launch"  # a new generation to run: launch it, or keep the engine (`keeps_launch`)


def next_step(want: records.Assignment | None, running: records.Assignment | None) -> Step:
    """What to do about `want` (None: deleted) while an engine runs `running` (None: none)."""
    if want is None:
        return Step.FORGET
    if running is not None and running.generation == want.generation:
        return Step.LEAVE
    if want.action in ("drain", "stop"):
        return Step.STOP
    return Step.LAUNCH


def adoption(leftover: EngineProcess, want: records.Assignment, spec: LaunchSpec) -> str:
    """Why an engine an earlier agent left, still alive, does not serve `want`, or "" when
    it does. The same rule as a running agent's (`keeps_launch`): it serves its assignment
    until the controller moves it (other GPUs, another port or rank) or makes it anew. An
    edit of the catalog alone (a new generation, another command line) does not stop it:
    the controller's rollout replaces it with no gap, where stopping it at adoption would
    take every old replica of the node down at once."""
    if leftover.generation > want.generation:
        return (
            f"it was started for generation {leftover.generation} of an assignment now at "
            f"generation {want.generation}: the assignment was made anew"
        )
    have, now = leftover.place, place_of(spec)
    if have != now:
        moved = [
            f"{name} {a if not isinstance(a, tuple) else ','.join(a) or 'none'} -> "
            f"{b if not isinstance(b, tuple) else ','.join(b) or 'none'}"
            for name, a, b in zip(_PLACE_NAMES, have, now, strict=True)
            if a != b
        ]
        return f"its assignment moved it ({'; '.join(moved)})"
    return ""


def keeps_launch(new: LaunchSpec | None, running: LaunchSpec, *, healthy: bool) -> bool:
    """Whether a running engine stays for a new generation of its assignment: nothing it sees
    changed, or only the catalog did and it is not failing (editing a profile does not
    restart a fleet: a serving engine keeps its launch until it is replaced; a failing one
    is launched again with the new one)."""
    return new == running or (healthy and new is not None and _same_place(new, running))


# the reason of a launch that waits for what clears by itself (a port or GPU memory an
# engine being stopped still holds): said while validating, never as a failure
WAITING = "waiting: "


@dataclass
class RetryDelay:
    """How long a replica waits before it looks again after a transient refusal or an error:
    `first`, doubling up to `cap` while nothing new arrives; anything new starts it over."""

    first: float = 1.0
    cap: float = 60.0
    delay: float = field(init=False)

    def __post_init__(self) -> None:
        self.delay = self.first

    def waited(self) -> None:
        """The delay passed and nothing new arrived."""
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        self.delay = self.first


# --- the shard record, from what happened -----------------------------------------------------


@dataclass(frozen=True)
class ShardEvent:
    """One thing that happened to a shard: a phase it entered, with what is known now.
    None in `served_name`, `restarts` or `pid` means "not known here": keep the old value."""

    node: str
    rid: str
    assignment: records.Assignment
    phase: str
    at: float  # unix seconds
    endpoint: str | None = None
    served_name: str | None = None  # the running engine's; None when no engine runs
    reason: str = ""
    tail: Sequence[str] = ()
    restarts: int | None = None
    pid: int | None = None
    gave_up: bool = False
    refused: str = ""  # Shard.refused
    # the LoRA adapters its engine serves now, and those it would not take
    adapters: Sequence[str] = ()
    adapter_failures: Sequence[records.AdapterFailure] = ()


def refused_key(problems: Sequence[Problem]) -> str:
    """The key a refused launch is reported with: one the controller acts on (the port is
    taken) when every problem is that one, else "" (the controller can do nothing)."""
    found = {p.refused for p in problems}
    return found.pop() if len(found) == 1 else ""


def next_shard(old: records.Shard | None, event: ShardEvent) -> records.Shard:
    """The shard record after `event`. Each field is the event's, except four that keep the
    old value unless the event says otherwise:
    - `since` moves only when the phase changes;
    - `served_name` is the running engine's, else the old one (a stopped engine's name is
      still the name it served);
    - `restarts` is kept unless the event counts them;
    - `pid` is kept unless the event gives one, or the engine is gone (stopped, failed)."""
    a = event.assignment
    if event.served_name is not None:
        served = event.served_name
    else:
        served = old.served_name if old is not None else ""
    if event.restarts is not None:
        restarts = event.restarts
    else:
        restarts = old.restarts if old is not None else 0
    if event.pid is not None:
        pid: int | None = event.pid
    else:
        pid = old.pid if old is not None and event.phase not in records.SHARD_ENGINE_GONE else None
    return records.Shard(
        node=event.node,
        rid=event.rid,
        model=a.model,
        generation=a.generation,
        phase=event.phase,  # type: ignore[arg-type]
        since=event.at if old is None or old.phase != event.phase else old.since,
        endpoint=event.endpoint,
        served_name=served,
        reason=event.reason,
        output_tail=list(event.tail),
        restarts=restarts,
        pid=pid,
        gave_up=event.gave_up,
        port=a.port,
        refused=event.refused,
        adapters=list(event.adapters),
        adapter_failures=list(event.adapter_failures),
        # a shared engine's memory, as last read, while it runs (hold_to_allotments)
        **(
            {}
            if old is None or pid is None
            else {
                "gpu_used_bytes": old.gpu_used_bytes,
                "gpu_allotted_bytes": old.gpu_allotted_bytes,
                "gpu_outgrown": old.gpu_outgrown,
            }
        ),
    )


def _overlaps(a: LaunchSpec, b: LaunchSpec) -> bool:
    # engines sharing a GPU (share_gpus) each have their allotment of it: not an overlap
    shared = a.gpu_shared and b.gpu_shared
    return a.port == b.port or (not shared and bool(set(a.gpu_uuids) & set(b.gpu_uuids)))


_PLACE_NAMES = ("GPUs", "port", "rank", "nodes", "rank 0 at")


def place_of(spec: LaunchSpec) -> tuple[tuple[str, ...], int, int, int, str]:
    """What the controller decided for a launch, as opposed to the catalog: its GPUs, port,
    rank, node count and rank 0's address (`EngineProcess.place` for a running engine)."""
    return (tuple(spec.gpu_uuids), spec.port, spec.rank, spec.nodes, spec.master_addr or "")


def _same_place(a: LaunchSpec, b: LaunchSpec) -> bool:
    return place_of(a) == place_of(b)


def launch_spec(
    cfg: AgentConfig,
    inv: records.NodeInventory,
    model: catalog.Model,
    profile: catalog.Profile,
    a: records.Assignment,
) -> LaunchSpec:
    """The one place a catalog profile + an assignment + this node become an engine launch."""
    install = inv.engine(profile.engine)
    weights_path, source = None, None
    ref = profile.weights
    if ref.path is not None:
        weights_path = ref.path
    elif ref.key is not None:
        held = next((m for m in inv.weights.models if m.key == ref.key), None)
        weights_path, source = (
            (held.path, None) if held else (None, ref.key)
        )  # not here: the engine fetches it
    else:
        source = ref.source
    hcas = tuple(
        sorted(ad.name for ad in inv.ib if a.fabric and ad.fabric == a.fabric and ad.active)
    )
    return LaunchSpec(
        served_name=model.served_name,
        engine=profile.engine,
        binary=install.path if install else profile.engine,
        port=a.port,
        host=cfg.engines.listen_host,
        weights_path=weights_path,
        download_source=source,
        fetch_dir=inv.fetch_dir,
        gpu_uuids=tuple(a.gpus),
        gpu_memory_gb=profile.gpu_memory_gb or None,
        gpu_shared=profile.share_gpus,
        gpu_total_bytes=next(
            (g.memory_total_bytes for g in inv.gpus.devices if g.uuid in a.gpus), 0
        ),
        context=profile.context,
        parallel=profile.parallel,
        host_ram_bytes=int(profile.host_ram_gb * 1e9),
        extra_args=tuple(profile.extra_args),
        env=dict(profile.env),
        nodes=a.nodes,
        rank=a.rank,
        master_addr=a.master_addr,
        ib_hcas=hcas,
        host_ip=inv.address if a.nodes > 1 else None,
        lora=a.lora if profile.engine == "vllm" else None,
        # llama-server's are all asked for here; those it can take are kept at launch
        # (agent/lora.py started_with)
        lora_files=(
            tuple((e.id, e.path) for e in a.adapters) if profile.engine == "llama-server" else ()
        ),
    )
