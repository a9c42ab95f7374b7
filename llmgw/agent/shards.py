"""Running what the node is assigned: one engine supervisor per `assign.<node>.<rid>`.

Watches only this node's assignments and reconciles each: start what is assigned to run,
drain then stop what is marked drain/stop or removed, leave alone what already matches
(same generation). Every engine transition is written to `shards.<node>.<rid>` and
published on `llmgw.events.shard-<phase>.<node>`. A profile is validated before anything
is launched, because an engine refuses a bad one only after minutes of loading.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from llmgw import catalog
from llmgw.agent.config import AgentConfig
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.pidfile import reap_leftover_engines
from llmgw.agent.engines.validate import NodeFacts, Problem, validate_launch
from llmgw.agent.supervisor import EngineSupervisor, PhaseChange, SupervisorTiming
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, Synced, decoder

log = logging.getLogger(__name__)


@dataclass
class _Engine:
    assignment: records.Assignment
    spec: LaunchSpec
    supervisor: EngineSupervisor
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


class ShardManager:
    def __init__(
        self,
        bus: Bus,
        cfg: AgentConfig,
        inventory: Callable[[], records.NodeInventory],
        *,
        engine_api_key: str | None = None,
    ) -> None:
        self.bus = bus
        self.cfg = cfg
        self.engine_api_key = engine_api_key
        self._inventory = inventory
        self.shards: dict[str, records.Shard] = {}
        self._engines: dict[str, _Engine] = {}
        self._assignments: dict[str, records.Assignment] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        # replicas whose reconcile loop is running -> set when something new arrives for it
        self._again: dict[str, anyio.Event] = {}

    @property
    def node(self) -> str:
        return self._inventory().node

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
            stop_grace=e.stop_grace,
            cancel_grace=0.7,
            drain_timeout=e.drain_timeout,
        )

    async def run(self) -> None:
        # An earlier agent killed hard may have left engines holding GPUs and ports: stop
        # them before launching anything, so nothing runs twice.
        for line in await anyio.to_thread.run_sync(reap_leftover_engines, self.state_dir, 10.0):
            log.warning("%s", line)
        self.bus.on_reconnected(self.report_all)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            async for item in self.bus.watch(
                keys.pattern(keys.ASSIGN, self.node), decoder(records.Assignment)
            ):
                if isinstance(item, Synced):
                    # (re)read all assignments: shard records of replicas that were removed
                    # while this agent was down or cut off have no owner left but us
                    tg.start_soon(self._remove_stale_shards)
                    continue
                rid = item.key.rsplit(".", 1)[1]
                if item.value is None:
                    self._assignments.pop(rid, None)
                else:
                    self._assignments[rid] = item.value
                tg.start_soon(self._reconcile, rid)

    async def report_all(self) -> None:
        """After a NATS outage: the engines kept running; say so again."""
        for shard in list(self.shards.values()):
            await self._put(shard)

    # --- one assignment ----------------------------------------------------------------

    async def _reconcile(self, rid: str) -> None:
        """Reconcile one assignment, in one loop per replica: an event that arrives while
        the loop is busy (a long drain) or waiting makes it run once more with the latest
        assignment. On an error (NATS away, a full disk) or a transient refusal (its port
        still held by an engine being stopped) it tries again with a growing delay. One
        replica's trouble never ends the agent: the other engines keep serving."""
        if rid in self._again:
            self._again[rid].set()
            return
        delay = 1.0
        try:
            while True:
                self._again[rid] = changed = anyio.Event()
                try:
                    retry = await self._reconcile_once(rid)
                except Exception as e:  # noqa: BLE001
                    log.exception("reconciling %s failed; retrying in %g s", rid, delay)
                    await self._report_trouble(rid, e)
                    retry = True
                if changed.is_set():
                    delay = 1.0  # something new arrived meanwhile: look again at once
                    continue
                if not retry or (rid not in self._assignments and rid not in self._engines):
                    return
                with anyio.move_on_after(delay):
                    await changed.wait()
                delay = 1.0 if changed.is_set() else min(delay * 2, 60.0)
        finally:
            self._again.pop(rid, None)

    async def _report_trouble(self, rid: str, e: Exception) -> None:
        want = self._assignments.get(rid)
        if want is None or rid in self._engines:
            return
        try:
            await self._report(rid, want, "failed", reason=f"{e or type(e).__name__}; retrying")
        except Exception:  # noqa: BLE001 - NATS away: re-reported on reconnect
            pass

    async def _reconcile_once(self, rid: str) -> bool:
        """One decision; True when it should be tried again later. Only `_reconcile`'s loop
        calls it, so decisions for one replica never overlap; other replicas go on meanwhile."""
        want = self._assignments.get(rid)
        running = self._engines.get(rid)
        if want is None:
            if running is not None:
                await self._stop(rid, running, drain=True)
            await self._forget(rid)
            return False
        if running is not None and running.assignment.generation == want.generation:
            return False
        if want.action in ("drain", "stop"):
            if running is not None:
                running.assignment = want
                await self._stop(rid, running, drain=want.action == "drain")
            await self._report(rid, want, "stopped", reason=f"assignment says {want.action}")
            return False
        spec, problems = await self._launch_spec(want)
        if running is not None:
            healthy = rid in self.shards and self.shards[rid].phase != "failed"
            if spec == running.spec or (
                healthy and spec is not None and _same_place(spec, running.spec)
            ):
                # Nothing the engine sees changed, or only the catalog did: a serving
                # engine keeps its launch until it is replaced (editing a profile does
                # not restart a fleet); a failing one is relaunched with the new one.
                if spec != running.spec:
                    log.info(
                        "%s %s: catalog changed; the running engine keeps its launch "
                        "until replaced",
                        want.model,
                        rid,
                    )
                running.assignment = want
                await self._report(
                    rid, want, self.shards[rid].phase if rid in self.shards else "starting"
                )
                return False
            await self._stop(rid, running, drain=True)
        if spec is not None:
            await self._wait_for_overlapping_engines(rid, spec)
        await self._report(rid, want, "validating")
        if spec is not None and not problems:
            problems = await anyio.to_thread.run_sync(validate_launch, spec, self._facts())
        if problems:
            reason = "; ".join(p.reason for p in problems)
            log.error("%s %s refused before launch: %s", want.model, rid, reason)
            await self._report(rid, want, "failed", reason=f"refused before launch: {reason}")
            # only when every problem clears by itself; the rest wait for a new assignment
            # or catalog entry
            return all(p.transient for p in problems)
        assert spec is not None
        self._start(rid, want, spec)
        return False

    def _start(self, rid: str, want: records.Assignment, spec: LaunchSpec) -> None:
        log_dir = self.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)

        async def on_phase(change: PhaseChange) -> None:
            engine = self._engines.get(rid)
            current = engine.assignment if engine else want
            # "starting" carries the argv (in the log file already); "ready" says "ready"
            quiet = change.phase == "starting" or change.reason == change.phase
            await self._report(
                rid,
                current,
                change.phase,
                reason="" if quiet else change.reason,
                tail=change.tail if change.phase == "failed" else [],
                restarts=change.restarts,
                pid=change.pid,
            )

        supervisor = EngineSupervisor(
            spec,
            shard=f"{self.node}.{rid}",
            on_phase=on_phase,
            log_path=log_dir / f"{rid}.log",
            state_dir=self.state_dir,
            timing=self.timing(),
        )
        engine = _Engine(want, spec, supervisor)
        self._engines[rid] = engine

        async def run() -> None:
            try:
                with engine.scope:
                    await supervisor.run()
            except Exception as e:  # noqa: BLE001 - e.g. the state dir is full: this engine only
                log.exception("supervising %s failed", rid)
                with anyio.CancelScope(shield=True):
                    await self._report(
                        rid, engine.assignment, "failed", reason=f"supervision failed: {e}"
                    )
            finally:
                engine.done.set()
                if self._engines.get(rid) is engine:
                    del self._engines[rid]

        assert self._tg is not None
        self._tg.start_soon(run)

    async def _stop(self, rid: str, engine: _Engine, *, drain: bool) -> None:
        if drain:
            await engine.supervisor.drain()
        else:
            await engine.supervisor.stop()
        await engine.done.wait()

    async def _forget(self, rid: str) -> None:
        if self.shards.pop(rid, None) is not None:
            try:
                await self.bus.delete(keys.shard(self.node, rid))
            except Exception as e:  # noqa: BLE001 - removed when the assignments are re-read
                log.warning("could not delete shards.%s.%s: %s", self.node, rid, e)

    async def _remove_stale_shards(self) -> None:
        try:
            stored = await self.bus.list(keys.pattern(keys.SHARDS, self.node), lambda b: b)
            for key in stored:
                rid = key.rsplit(".", 1)[1]
                if (
                    rid not in self._assignments
                    and rid not in self._engines
                    and rid not in self.shards
                ):
                    await self.bus.delete(key)
                    log.info("removed %s: its assignment is gone", key)
        except Exception as e:  # noqa: BLE001 - tried again at the next re-read
            log.warning("could not remove stale shard records: %s", e)

    async def _wait_for_overlapping_engines(self, rid: str, spec: LaunchSpec) -> None:
        """An engine of a replica being removed may still hold the port or GPUs the new one
        is given (a node back after being declared lost gets its model placed again on the
        same resources): let it finish stopping first, bounded."""
        for other_rid, other in list(self._engines.items()):
            if other_rid == rid or not _overlaps(spec, other.spec):
                continue
            other_want = self._assignments.get(other_rid)
            if other_want is not None and other_want.action == "run":
                continue  # a real conflict: validation says so
            e = self.cfg.engines
            log.info("%s waits for %s to stop (same port or GPUs)", rid, other_rid)
            with anyio.move_on_after(e.drain_timeout + e.stop_grace + 10):
                await other.done.wait()

    # --- building the launch ----------------------------------------------------------------

    def _facts(self) -> NodeFacts:
        inv = self._inventory()
        return NodeFacts(gpus=inv.gpus.devices, engines=inv.engines)

    async def _launch_spec(self, a: records.Assignment) -> tuple[LaunchSpec | None, list[Problem]]:
        entry = await self.bus.get(
            keys.catalog(a.model), lambda b: catalog.decode_model(b, a.model)
        )
        if entry is None:
            return None, [Problem(f"catalog.{a.model} is missing or invalid; nothing to launch")]
        profile = entry.value.profile(a.profile)
        if profile is None:
            return None, [Problem(f"model {a.model} has no profile {a.profile!r} in the catalog")]
        spec = launch_spec(self.cfg, self._inventory(), entry.value, profile, a)
        return dataclasses.replace(spec, api_key=self.engine_api_key), []

    # --- reporting ----------------------------------------------------------------------------

    async def _report(
        self,
        rid: str,
        a: records.Assignment,
        phase: str,
        *,
        reason: str = "",
        tail: list[str] | None = None,
        restarts: int | None = None,
        pid: int | None = None,
    ) -> None:
        inv = self._inventory()
        old = self.shards.get(rid)
        engine = self._engines.get(rid)
        shard = next_shard(
            old,
            ShardEvent(
                node=inv.node,
                rid=rid,
                assignment=a,
                phase=phase,
                at=time.time(),
                endpoint=f"{inv.address}:{a.port}" if phase == "ready" and a.rank == 0 else None,
                served_name=engine.spec.served_name if engine is not None else None,
                reason=reason,
                tail=tail or (),
                restarts=restarts,
                pid=pid,
            ),
        )
        endpoint = shard.endpoint
        self.shards[rid] = shard
        await self._put(shard)
        if old is None or old.phase != phase:
            level = logging.WARNING if phase == "failed" else logging.INFO
            log.log(level, "%s %s: %s%s", a.model, rid, phase, f" ({reason})" if reason else "")
            await self.bus.publish_event(
                f"shard-{phase}",
                inv.node,
                f"{a.model} {rid} on {inv.node}: {phase}",
                rid=rid,
                model=a.model,
                reason=reason,
                endpoint=endpoint,
            )

    async def _put(self, shard: records.Shard) -> None:
        try:
            await self.bus.put(keys.shard(shard.node, shard.rid), shard)
        except Exception as e:  # noqa: BLE001 - re-reported after the reconnect
            log.warning("could not write shards.%s.%s: %s", shard.node, shard.rid, e)


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
    )


def _overlaps(a: LaunchSpec, b: LaunchSpec) -> bool:
    return a.port == b.port or bool(set(a.gpu_uuids) & set(b.gpu_uuids))


# what the controller decided, as opposed to the catalog: same GPUs, port and ranks
_place = operator.attrgetter("gpu_uuids", "port", "rank", "nodes", "master_addr")


def _same_place(a: LaunchSpec, b: LaunchSpec) -> bool:
    return _place(a) == _place(b)


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
        context=profile.context,
        parallel=profile.parallel,
        extra_args=tuple(profile.extra_args),
        env=dict(profile.env),
        nodes=a.nodes,
        rank=a.rank,
        master_addr=a.master_addr,
        ib_hcas=hcas,
        host_ip=inv.address if a.nodes > 1 else None,
    )
