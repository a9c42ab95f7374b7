"""The reconcile loop: level-triggered, stateless, safe to kill at any moment.

Every pass reads the whole view (kept current by one watch of the bucket), computes what
the bucket should hold, and writes only the differences: health per node, the per-fabric
weights view, replicas and their phases, assignments derived from the replicas, and the
placement record with its explanation. Replicas are written before their assignments and
assignments are derived from replicas on every pass, so a controller killed between two
writes finishes the job after its restart instead of duplicating or orphaning anything.
One controller leads through the `leader` key (controller/leadership.py), and every write
it makes is fenced with that key: the server stores it only while the key is still at the
revision this controller gave it, so a leader deposed while stalled writes nothing after
the takeover. It judges nodes only while its own link to the bucket is trusted
(controller/link.py). Time comes from one clock passed in (controller/clock.py).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import anyio
import msgspec

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import (
    BATCH_MAX,
    Bus,
    BusError,
    Fence,
    FencedOff,
    Synced,
    Update,
    ValueTooLarge,
    Write,
    decoder,
)
from llmgw.bus.records import NodePhase
from llmgw.controller import placement
from llmgw.controller.autoscale import (
    LOAD_STALE_AFTER_S,
    Autoscaler,
    engine_saturation,
    scaled_text,
)
from llmgw.controller.clock import Clock, Instant, SystemClock, instant
from llmgw.controller.inputs import hold_recorded_phases, placement_snapshot
from llmgw.controller.leadership import CREATE, Leadership
from llmgw.controller.link import Link, LinkState
from llmgw.controller.liveness import (
    LOST_AFTER_S,
    UNREACHABLE_AFTER_S,
    HealthChanges,
    LivenessTracker,
    judge,
    lease_change_matters,
    node_phases,
)
from llmgw.controller.metrics import ControllerMetrics
from llmgw.controller.view import Freeze, View
from llmgw.fleetstate.decode import CONTROLLER_WRITES
from llmgw.metrics_http import serve_metrics

log = logging.getLogger(__name__)

# key families whose change can change a node's phase or what is stored of it
_JUDGED_BY = frozenset((keys.LEASES, keys.NODES, keys.HEALTH))


class _NotLeading(Exception):
    """Leadership was lost during a pass: stop writing."""


@dataclass(frozen=True)
class ControllerSettings:
    controller_id: str = field(
        default_factory=lambda: f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
    )
    unreachable_after: float = UNREACHABLE_AFTER_S
    lost_after: float = LOST_AFTER_S
    leader_ttl: float = 10.0
    tick: float = 1.0
    resync: float = 10.0  # a full pass at least this often, even with nothing new
    port_range: tuple[int, int] = placement.DEFAULT_PORTS
    # a pass that planned for longer than this judges its chosen nodes again before it
    # places on them
    recheck_after: float = 2.0
    # a node whose agent gave up on a replica is avoided for that launch this long; a
    # launch given up on by this many distinct nodes meanwhile is not placed again
    failure_cooldown: float = placement.FAILURE_COOLDOWN_S
    failure_nodes: int = placement.FAILURE_NODES
    # (host, port) of GET /metrics (llmgw/metrics_http.py); None: not served
    metrics_listen: tuple[str, int] | None = None
    # a router whose load.<router> has not moved for this long counts no more
    load_stale_after: float = LOAD_STALE_AFTER_S


class Controller:
    def __init__(
        self, bus: Bus, settings: ControllerSettings | None = None, clock: Clock | None = None
    ) -> None:
        self.bus = bus
        self.settings = settings or ControllerSettings()
        self.clock = clock or SystemClock()
        self.instance = secrets.token_hex(8)  # tells this process's lease from a namesake's
        self.view = View()
        self._rewritten: dict[str, int] = {}  # key -> the bad revision written over
        self.tracker = LivenessTracker(self.settings.unreachable_after, self.settings.lost_after)
        self.link = Link()
        self.leadership = Leadership(self.id, self.instance, self.settings.leader_ttl)
        self.leadership_steps = 0  # times it looked at the leader key: what tests wait on
        self.passes = 0
        self._synced = anyio.Event()
        self._pass_due = True  # something a pass reads changed since the last one
        self._last_pass = float("-inf")  # event-loop time of the last full pass
        self.fenced_off = 0  # writes the server refused: another controller had taken over
        # One write at a time, renewals included: a write is fenced with the revision the
        # last renewal left, and a cluster's stream leader refuses (without comparing) a
        # conditional write while another on the same key is in flight.
        self._writing = anyio.Lock()
        self._qualifying: dict[str, set[str]] = {}
        self.metrics = ControllerMetrics(self.view, lambda: self.leading)
        self.metrics_port: int | None = None  # bound, once serving /metrics
        self.autoscaler = Autoscaler(self.settings.load_stale_after)
        self._wake = anyio.Event()  # a cold model's request is waiting: pass now
        self._batches_asked = anyio.Event()  # the stream said whether it takes batches
        self._inventories = placement.InventoryMemo()  # what each one says, between passes
        # nodes whose lease, inventory or health changed since the last judgement that was
        # written; None: judge every node next (liveness.judge)
        self._touched: set[str] | None = None
        self._judged_all_at = float("-inf")  # event-loop time of the last whole-fleet one

    @property
    def id(self) -> str:
        return self.settings.controller_id

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def epoch(self) -> int:
        """The number of its latest leadership (records.Leader.epoch)."""
        return self.leadership.epoch

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Controller] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            self.bus.on_reconnected(self._on_reconnected)
            async with anyio.create_task_group() as tg:
                if self.settings.metrics_listen is not None:
                    self.metrics_port = await tg.start(
                        serve_metrics, self.metrics.registry, self.settings.metrics_listen
                    )
                tg.start_soon(self._allow_batches)
                tg.start_soon(self._follow_bucket)
                await self._synced.wait()
                tg.start_soon(self._lead)
                task_status.started(self)
                await self._reconcile_forever()
        finally:
            gc.unfreeze()  # what the first replay froze is collected again once garbage
            with anyio.CancelScope(shield=True):
                await self._resign()

    async def _allow_batches(self) -> None:
        """Many fenced writes at once (a fleet's health at start-up) go in atomic batches
        where the stream allows them; asked once, beside the watch's replay (an identity
        refused the request waits out its timeout without holding anything up)."""
        try:
            why = await self.bus.allow_batches()
        finally:
            self._batches_asked.set()
        if why is not True:
            log.warning(
                "many fenced writes are made one at a time (~3,000/s on one server, ~1,000/s "
                "on a cluster), not in atomic batches: %s",
                why,
            )

    # --- the view -------------------------------------------------------------------------

    async def _follow_bucket(self) -> None:
        # The first replay builds the whole view (10,000 inventories are ~400,000 objects):
        # the cycle collector is paused until it is done, as during a plan (its passes over
        # a growing view were a third of the replay's time), and what the replay built is
        # then frozen out of later collections (until `run` ends): the view's records form
        # no cycles, and reference counting frees each one that a newer value replaces.
        paused = gc.isenabled()
        gc.disable()
        try:
            async for item in self.bus.watch(">", lambda data: data):
                if isinstance(item, Synced):
                    if paused:
                        gc.freeze()
                        gc.enable()
                        paused = False
                    self._synced_again()
                    continue
                self._apply(item)
        finally:
            if paused:
                gc.enable()

    def _synced_again(self) -> None:
        """The watch has delivered the bucket as it is (at start, and after a reconnect)."""
        if not self._synced.is_set():
            hold_recorded_phases(self.view, self.tracker)
            self._touched = None
            self._synced.set()
        if self.link.synced():
            # Back after an outage: this controller saw no lease move while it was away,
            # which says nothing about the nodes. Every node gets a fresh grace period, as
            # after a restart; a network blip must not drain the fleet.
            self._grace(self.clock.monotonic())
        self._pass_due = True

    async def _on_reconnected(self) -> None:
        self.link.disconnected()  # stale until the watch has replayed the bucket

    def _apply(self, item: Update[bytes]) -> None:
        family = self.view.apply(item.key, item.value, item.revision)
        now = self.clock.monotonic()
        node = ""
        if family in _JUDGED_BY:  # keyed by the node
            parsed = keys.parse(item.key)
            assert parsed is not None
            node = parsed.ids[0]
            if self._touched is not None and (
                family != keys.LEASES
                or lease_change_matters(self.view.health.get(node), self.view.leases.get(node))
            ):
                self._touched.add(node)  # its phase is judged at the next tick
        if family == keys.LEASES:
            lease = self.view.leases.get(node)
            if lease is not None:
                self.tracker.observe(node, lease.seq, now)
            else:
                self.tracker.forget(node)
        elif family == keys.LEADER:
            self.leadership.saw(self.view.leader_rev, self.view.leader, now)
            self._wake_once_writable()
        elif family == keys.LOAD:
            parsed = keys.parse(item.key)
            assert parsed is not None
            router = parsed.ids[0]
            self.autoscaler.loads.saw(router, self.view.loads.get(router), now)
            if self.autoscaler.cold_waiting(self.view.loads, now):
                self._wake.set()
        elif family not in (
            None,
            keys.HEALTH,
            keys.PLACEMENT,
            keys.FABRICS,
            keys.ROLLOUT,
            keys.SCALE,
        ):
            self._pass_due = True

    def _wake_once_writable(self) -> None:
        """A pass due since the takeover runs as soon as the view holds the takeover (the
        claim's answer and its echo through the watch come in either order), not a tick
        later: at start, the whole fleet is without health until it does."""
        if self._pass_due and self.leadership.fence(self.view.leader_rev) is not None:
            self._wake.set()

    def _grace(self, now: float) -> None:
        """Every node gets a fresh grace period (LivenessTracker.restart_grace), and so is
        judged again."""
        self.tracker.restart_grace(now)
        self._touched = None

    def phases(self, now: float) -> dict[str, NodePhase]:
        return node_phases(self.view.nodes, self.tracker, now)

    # --- leadership -----------------------------------------------------------------------

    async def _lead(self) -> None:
        interval = self.settings.leader_ttl / 3
        while True:
            try:
                async with self._writing:
                    now = instant(self.clock)
                    if self.leadership.leading:
                        await self._renew(now)
                    else:
                        await self._claim(now)
            except BusError as e:  # NATS away: try again next interval
                why = str(e) or type(e).__name__
                self.leadership.step_down(f"cannot renew the leader key: {why}")
                self.link.write_failed(f"the leader key: {why}")
            except Exception as e:  # noqa: BLE001 - a bug: step down (safe), trust the link
                log.exception("bug in the leadership step; stepping down until the next one")
                self.leadership.step_down(f"a bug in the leadership step: {type(e).__name__}")
            self.leadership_steps += 1
            await anyio.sleep(interval)

    async def _renew(self, now: Instant) -> None:
        renewal = self.leadership.renewal(now.wall)
        if renewal is None:
            return  # it stopped leading meanwhile
        last, record = renewal
        rev = await self.bus.update(keys.leader(), record, last=last)
        if rev is not None:
            self.leadership.renewed(rev)
            return
        # refused: another controller took the key, or a renewal of ours whose answer was
        # lost was stored after all (Leadership.renewal_refused tells which)
        entry = await self.bus.get(keys.leader(), decoder(records.Leader))
        if entry is None:
            self.leadership.renewal_refused(None, None)
        else:
            self.leadership.renewal_refused(entry.revision, entry.value)

    async def _claim(self, now: Instant) -> None:
        takeover = self.leadership.takeover(now.monotonic)
        if takeover is None:
            return
        at = takeover.at
        if at == CREATE:
            # a deleted key still has a revision, its deletion's: the epoch grows from it
            deleted = await self.bus.deleted_at(keys.leader())
            if deleted is None:
                return  # someone holds it now: this controller's view will show whom
            at = deleted
        record = self.leadership.claiming(at, now.wall)
        if at == CREATE:
            rev = await self.bus.create(keys.leader(), record)
        else:
            rev = await self.bus.update(keys.leader(), record, last=at)
        if not self.leadership.claimed(rev):
            return  # another controller was quicker
        # A controller that starts leading judges from now, as after a restart: it may
        # come back from being cut off (JetStream without quorum, a stalled link: no
        # reconnect, so no re-sync) with leases that only look still. Nodes already
        # recorded unreachable or lost stay so until their lease moves. Now is when the
        # claim came back: it may have waited out a stalled link.
        self._grace(self.clock.monotonic())
        hold_recorded_phases(self.view, self.tracker)  # (_grace has every node judged)
        self.autoscaler.reset()  # its windows start now, from the counts in scale.<model>
        self._pass_due = True
        self._wake_once_writable()
        previous = takeover.previous
        log.info(
            "controller %s leads, epoch %d (previous: %s)", self.id, self.epoch, previous or "none"
        )
        await self.bus.publish_event(
            "leader",
            keys.sanitize_token(self.id),
            f"controller {self.id} leads",
            previous=previous,
            epoch=self.epoch,
        )

    def _fence(self) -> Fence:
        """What this controller's writes are fenced with now; _NotLeading when it may not
        write (it does not lead, or its view does not hold its takeover yet)."""
        revision = self.leadership.fence(self.view.leader_rev)
        if revision is None:
            raise _NotLeading
        return Fence(keys.leader(), revision)

    def _require_leading(self) -> None:
        self._fence()

    async def _put(self, key: str, record: msgspec.Struct) -> None:
        await self._fenced(key, lambda fence: self.bus.put(key, record, fence=fence))

    async def _delete(self, key: str) -> None:
        await self._fenced(key, lambda fence: self.bus.delete(key, fence=fence))

    async def _fenced(self, key: str, write: Callable[[Fence], Awaitable[object]]) -> None:
        """Make one write on the condition, checked by the server with the write itself,
        that the leader key is still at the revision this controller last gave it. A leader
        deposed while it was stalled (a paused process, a partitioned link whose bytes
        arrive late) has every later write refused, and stops leading."""
        async with self._writing:
            fence = self._fence()
            try:
                await write(fence)
            except FencedOff as e:
                self.fenced_off += 1
                self.leadership.step_down(
                    f"the server refused its write to {key}: the leader key moved on from "
                    f"revision {e.fence.revision}"
                    + (f" to {e.now_at}" if e.now_at is not None else "")
                    + f" (epoch {self.epoch} is over: another controller took over)"
                )
                raise _NotLeading from None

    async def _resign(self) -> None:
        revision = self.leadership.resign()
        if revision is not None:
            try:
                with anyio.move_on_after(1):
                    # others take over at once
                    await self.bus.delete(keys.leader(), last=revision)
            except Exception:  # noqa: BLE001
                pass

    # --- judging nodes --------------------------------------------------------------------

    async def _reconcile_forever(self) -> None:
        while True:
            if not self.bus.connected:
                self.link.disconnected()
            if self.leadership.leading:
                await self._pass()
            with anyio.move_on_after(self.settings.tick):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def _pass(self) -> None:
        back = self.link.state is LinkState.SUSPECT and await self._check_link()
        # the one "now" of this pass, read after the round trip: judged and stamped by it
        now = instant(self.clock)
        if back:
            self._grace(now.monotonic)
        if not self.link.may_judge:
            return  # the view may be stale: judge nothing
        if self.leadership.fence(self.view.leader_rev) is None:
            # Not leading, or leading and its view does not show its takeover yet: the
            # watch delivers in the order the bucket stored, so once it shows it, the view
            # holds every write the previous leader made before it.
            return
        try:
            changed = await self._judge_nodes(now)
            changed = await self._autoscale(now) or changed
            await self._rewrite_kept()
            due = self._pass_due or changed
            if anyio.current_time() - self._last_pass >= self.settings.resync:
                due = True
            if due and self.link.may_judge:  # (a health write that hung made it suspect)
                self._pass_due = False
                self._last_pass = anyio.current_time()
                try:
                    await self.reconcile(now)
                finally:
                    self.metrics.passed(anyio.current_time() - self._last_pass)
        except _NotLeading:
            self._pass_due = True
        except BusError as e:  # the link failed: the next pass starts from the bucket again
            log.warning("reconcile pass failed: %s; retrying", e)
            self._pass_due = True
            self.link.write_failed(str(e))
        except Exception:  # noqa: BLE001 - a bug, not the link: nodes are still judged
            log.exception("bug in the reconcile pass; it runs again, still judging nodes")
            self._pass_due = True

    async def _rewrite_kept(self) -> None:
        """A record of the leader's own whose value does not read (garbled by hand) is kept
        by the view (llmgw/fleetstate/decode.py) and compared as kept, so no change would
        ever write it again: write it back as kept, once per bad revision, so that a reader
        started since reads it too."""
        for key in [k for k in self._rewritten if k not in self.view.unreadable]:
            del self._rewritten[key]  # read again
        for key, bad in list(self.view.unreadable.items()):
            if bad.reading != "kept" or bad.family not in CONTROLLER_WRITES:
                continue
            if self._rewritten.get(key) == bad.revision:
                continue
            value = self.view.value_of(key)
            if value is None:
                continue
            if "epoch" in value.__struct_fields__:
                value = msgspec.structs.replace(value, epoch=self.epoch)
            self._rewritten[key] = bad.revision
            log.warning(
                "%s (revision %d) does not read: wrote its last good value back", key, bad.revision
            )
            await self._put(key, value)

    async def _check_link(self) -> bool:
        """Before declaring nodes silent, check this controller is not the silent one (a
        stalled link delivers nothing, so every lease looks still): a round trip to the
        server must come back promptly. True when that ends a suspicion: every node then
        gets a fresh grace period (the caller restarts it)."""
        try:
            took: float | None = await self.bus.round_trip(timeout=self.link.stuck_after)
        except Exception:  # noqa: BLE001 - no answer at all
            took = None
        return self.link.round_trip(took)

    async def _autoscale(self, now: Instant) -> bool:
        """Write `scale.<model>` where the autoscaler's count (or what it says) changed, and
        remove it for models no longer autoscaled; True if a count changed."""
        placed: dict[str, int] = {}
        for r in self.view.replicas.values():
            if r.phase in records.REPLICA_COUNTED:
                placed[r.model] = placed.get(r.model, 0) + 1
        changes = self.autoscaler.decide(
            catalog=self.view.catalog,
            desired=self.view.desired,
            scales=self.view.scales,
            loads=self.view.loads,
            placed=placed,
            placements=self.view.placements,
            now=now.monotonic,
            wall=now.wall,
            engines=(
                engine_saturation(self.view.leases, self.view.health, self.view.replicas)
                if any(d.auto for d in self.view.desired.values())
                else None
            ),
        )
        counted = False
        for model, scale in changes.items():
            old = self.view.scales.get(model)
            scale = msgspec.structs.replace(scale, epoch=self.epoch)
            await self._put(keys.scale(model), scale)
            self.view.scales[model] = scale
            if old is None or old.replicas != scale.replicas:
                counted = True
                log.info("%s autoscaled: %s", model, scale.reason)
                await self.bus.publish_event(
                    "scaled", model, f"{model}: {scale.reason}", replicas=scale.replicas
                )
        for model in [
            m
            for m in self.view.scales
            if not (m in self.view.desired and self.view.desired[m].auto)
        ]:
            # switched to a fixed count (or removed): `--auto` later starts from what runs
            await self._delete(keys.scale(model))
            self.view.scales.pop(model, None)
        return counted

    async def _judge_nodes(self, now: Instant) -> bool:
        """Write `health.<node>` where a node's phase changed; True if any did. Judges the
        nodes touched since the last judgement (liveness.judge), the whole fleet when that
        was asked for and every `resync` seconds besides."""
        touched, self._touched = self._touched, set()
        if anyio.current_time() - self._judged_all_at >= self.settings.resync:
            touched = None
        if touched is None:
            self._judged_all_at = anyio.current_time()
        changes = judge(
            self.view.nodes,
            self.view.health,
            self.view.leases,
            self.tracker,
            now.monotonic,
            now.wall,
            touched,
        )
        try:
            if changes.declares_silence:
                # no node is declared silent without a round trip
                if await self._check_link():
                    self._grace(now.monotonic)
                if not self.link.may_judge:
                    self._touched = None  # judged but not written: all again next time
                    return False
            await self._write_health(changes)
        except BaseException:
            self._touched = None  # some may not be written: every node again next time
            raise
        return bool(changes.write)

    async def _write_health(self, changes: HealthChanges) -> None:
        many = len(changes.write) > 20  # a fleet's worth (at start-up): said in one line
        stamped = [msgspec.structs.replace(c.record, epoch=self.epoch) for c in changes.write]
        await self._write_all(
            [Write(keys.health(r.node), r) for r in stamped]
            # decommissioned: its inventory was removed
            + [Write(keys.health(node), None) for node in changes.delete]
        )
        for change, record in zip(changes.write, stamped, strict=True):
            self.view.health[record.node] = record
            if record.phase != "ready" and self._touched is not None:
                # its lease may have moved while this was written, when it was still stored
                # ready (lease_change_matters said no): judged again next tick, not only when the
                # echo of this write comes back
                self._touched.add(record.node)
            level = logging.INFO if record.phase == "ready" else logging.WARNING
            log.log(
                logging.DEBUG if many and record.phase == "ready" else level,
                "node %s: %s -> %s (%s)",
                record.node,
                change.previous or "new",
                record.phase,
                record.reason,
            )
            await self.bus.publish_event(
                f"node-{record.phase}",
                record.node,
                f"node {record.node} is {record.phase}: {record.reason}",
                previous=change.previous,
            )
        if many:
            counts: dict[str, int] = {}
            for c in changes.write:
                counts[c.record.phase] = counts.get(c.record.phase, 0) + 1
            log.info(
                "%d nodes changed phase: %s",
                len(changes.write),
                ", ".join(f"{n} {p}" for p, n in counts.items()),
            )
        for node in changes.delete:
            self.view.health.pop(node, None)

    async def _write_all(self, writes: list[Write]) -> None:
        """Many fenced writes: in atomic batches, one round trip each, where the stream
        allows them (Bus.allow_batches); else one at a time (~3,000 a second on one server,
        ~1,000 on a 3-server cluster). Each batch or write is timed for the link."""
        if not writes:
            return
        await self._batches_asked.wait()  # asked at start, beside the watch's replay
        size = BATCH_MAX if self.bus.batches is True else 1
        for start in range(0, len(writes), size):
            chunk = writes[start : start + size]
            await self._timed(
                self._fenced(
                    chunk[0].key, lambda fence, chunk=chunk: self.bus.write_all(chunk, fence=fence)
                )
            )

    async def _timed(self, write: Awaitable[None]) -> None:
        """A write, its time told to the link: one that hangs makes it suspect."""
        started = anyio.current_time()
        try:
            await write
        finally:
            self.link.wrote(anyio.current_time() - started)

    # --- reconcile ------------------------------------------------------------------------

    def snapshot(self, frozen: Mapping[str, Freeze], now: Instant) -> placement.Snapshot:
        """The plan's input (controller/inputs.py, as `llmgw place --dry-run` builds it)."""
        return placement_snapshot(
            self.view,
            self.phases(now.monotonic),
            frozen,
            port_range=self.settings.port_range,
            now=now.wall,
            failures=placement.FailurePolicy(
                self.settings.failure_cooldown, self.settings.failure_nodes
            ),
            memo=self._inventories,
        )

    async def reconcile(self, now: Instant) -> None:
        self.passes += 1
        frozen = self.view.frozen()
        snap = self.snapshot(frozen, now)
        await self._write_fabrics(snap.fabrics or {})
        # the fleet is built once a pass, for both (and with the cycle collector paused)
        with placement.collector_paused():
            nodes = placement.fleet_nodes(snap, self._inventories)
        # before planning: a node that just started qualifying is placed on in this same pass
        await self._report_qualifying(snap, nodes)
        plan = placement.plan(snap, nodes, self._inventories)
        creates = self._still_placeable(plan.create, now)
        # A frozen model keeps its replicas: a garbled or deleted catalog entry is not a
        # request to remove the model.
        removals = [r for r in plan.remove if r.model not in frozen]
        self._require_leading()  # a pass outlived by its leadership writes nothing more
        await self._move_ports(plan.port_moves)
        for replica in creates:
            replica = msgspec.structs.replace(replica, epoch=self.epoch)
            await self._put(keys.replica(replica.model, replica.rid), replica)
            self.view.replicas[replica.rid] = replica
            where = ", ".join(m.node for m in replica.members)
            log.info("placed %s %s on %s: %s", replica.model, replica.rid, where, replica.reason)
            await self.bus.publish_event(
                "placed",
                replica.model,
                f"{replica.model} {replica.rid} placed on {where}",
                rid=replica.rid,
                nodes=[m.node for m in replica.members],
                reason=replica.reason,
            )
        # the phases first: the plan read them from the shards, so a replacement it counted
        # ready is written ready before the replica it replaces is written draining (the
        # stored ready count never dips in between)
        self._require_leading()
        await self._sync_replica_phases(snap.health)
        for removal in removals:
            replica = self.view.replicas.get(removal.rid)
            if replica is not None and replica.phase not in records.REPLICA_GOING:
                drained = msgspec.structs.replace(
                    replica, phase="draining", reason=removal.reason, epoch=self.epoch
                )
                await self._put(keys.replica(replica.model, replica.rid), drained)
                self.view.replicas[replica.rid] = drained
                log.info("draining %s %s: %s", replica.model, replica.rid, removal.reason)
                await self.bus.publish_event(
                    "draining",
                    replica.model,
                    f"{replica.model} {replica.rid}: {removal.reason}",
                    rid=replica.rid,
                )
        self._require_leading()
        await self._sync_assignments()
        # before the placement records: `llmgw place --wait` reads both once it sees its
        # decision in placement.<model>
        await self._write_rollouts(plan, frozen)
        await self._write_placements(plan, frozen, now)
        new_waiting = [  # a baseline for models now waiting
            model
            for model, rec in self.view.placements.items()
            if rec.placed < rec.desired and model not in self._qualifying
        ]
        self._qualifying.update(placement.qualifying_nodes_by_model(snap, new_waiting))

    async def _move_ports(self, moves: list[placement.PortMove]) -> None:
        """Replicas whose port another program took after placement get the port the plan
        chose; the assignment derived from each follows in this pass."""
        for move in moves:
            replica = msgspec.structs.replace(move.replica, epoch=self.epoch)
            await self._put(keys.replica(replica.model, replica.rid), replica)
            self.view.replicas[replica.rid] = replica
            log.info("%s %s: %s", replica.model, replica.rid, move.why)
            await self.bus.publish_event(
                "port-moved",
                replica.model,
                f"{replica.model} {replica.rid}: {move.why}",
                rid=replica.rid,
            )

    def _still_placeable(
        self, creates: list[records.Replica], now: Instant
    ) -> list[records.Replica]:
        """A plan made from the pass's instant holds only while that instant is recent: a
        pass that took long (60 s once gave 660 replicas to a node dead for 61 s) judges
        the chosen nodes again, now, and leaves a replica whose node is no longer ready to
        the next pass, which places it elsewhere."""
        later = self.clock.monotonic()
        took = later - now.monotonic
        if not creates or took <= self.settings.recheck_after:
            return creates
        phases = self.phases(later)
        kept = []
        for r in creates:
            gone = [m.node for m in r.members if phases.get(m.node) != "ready"]
            if gone:
                log.warning(
                    "the pass took %.1f s: not placing %s %s on %s, no longer ready; the next "
                    "pass places it",
                    took,
                    r.model,
                    r.rid,
                    ", ".join(gone),
                )
                self._pass_due = True
            else:
                kept.append(r)
        return kept

    async def _write_fabrics(self, view: dict[str, records.FabricHoldings]) -> None:
        for name, holdings in view.items():
            if self.view.fabrics.get(name) != holdings:
                await self._put(keys.fabric(name), holdings)
                self.view.fabrics[name] = holdings
        for name in [n for n in self.view.fabrics if n not in view]:
            await self._delete(keys.fabric(name))
            self.view.fabrics.pop(name, None)

    async def _sync_replica_phases(self, phases: dict[str, str]) -> None:
        for rid, replica in list(self.view.replicas.items()):
            shards = [self.view.shards.get((m.node, rid)) for m in replica.members]
            if replica.phase == "draining":
                if all(
                    _member_done(m.node, s, phases)
                    for m, s in zip(replica.members, shards, strict=True)
                ):
                    await self._forget_replica(replica, "drained")
                continue
            phase, endpoint = records.phase_from_shards(replica, shards)
            launch = replica.launch or self._launch_of(replica)
            if (phase, endpoint, launch) != (replica.phase, replica.endpoint, replica.launch):
                updated = msgspec.structs.replace(
                    replica, phase=phase, endpoint=endpoint, launch=launch, epoch=self.epoch
                )
                await self._put(keys.replica(replica.model, rid), updated)
                self.view.replicas[rid] = updated
                if phase == "ready" and replica.phase in ("placed", "starting"):
                    self.autoscaler.loaded(replica.model, self.clock.wall() - replica.created_at)
                if phase != replica.phase and phase in ("ready", "failed", "gave-up"):
                    log.info(
                        "%s %s is %s%s",
                        replica.model,
                        rid,
                        phase,
                        f" at {endpoint}" if endpoint else "",
                    )
                    await self.bus.publish_event(
                        phase,
                        replica.model,
                        f"{replica.model} {rid} is {phase}",
                        rid=rid,
                        endpoint=endpoint,
                    )

    def _launch_of(self, replica: records.Replica) -> str:
        """A replica placed before launches were recorded is taken as running the catalog's."""
        model = self.view.catalog.get(replica.model)
        profile = model.profile(replica.profile) if model else None
        return catalog.launch_hash(model, profile) if model and profile else ""

    async def _write_rollouts(self, plan: placement.Plan, frozen: Mapping[str, Freeze]) -> None:
        for model, ro in plan.rollouts.items():
            if model in self.view.desired:
                ro = msgspec.structs.replace(ro, desired_at=self.view.desired[model].updated_at)
            old = self.view.rollouts.get(model)
            if old is not None and placement.same_rollout(old, ro):
                continue
            ro = msgspec.structs.replace(ro, epoch=self.epoch)
            try:
                await self._put(keys.rollout(model), ro)
            except ValueTooLarge:
                log.exception("bug: the rollout record of %s is too large to write", model)
                continue
            self.view.rollouts[model] = ro
            if old is None or old.phase != ro.phase or not old.current.same(ro.current):
                text = {
                    "progressing": f"rolling out: {ro.old} replica(s) to replace",
                    "stopped": f"stopped: {ro.reason}",
                    "complete": "complete: every replica runs the current revision",
                }[ro.phase]
                log.log(
                    logging.WARNING if ro.phase == "stopped" else logging.INFO,
                    "%s rollout %s",
                    model,
                    text,
                )
                await self.bus.publish_event(
                    f"rollout-{ro.phase}", model, f"{model} rollout {text}", old=ro.old
                )
        placed = {r.model for r in self.view.replicas.values()}
        for model in [
            m
            for m in self.view.rollouts
            if m not in self.view.catalog and m not in frozen and m not in placed
        ]:
            await self._delete(keys.rollout(model))  # the model is gone, and so its history
            self.view.rollouts.pop(model, None)

    async def _forget_replica(self, replica: records.Replica, why: str) -> None:
        for m in replica.members:
            if (m.node, replica.rid) in self.view.assigns:
                await self._delete(keys.assign(m.node, replica.rid))
                self.view.assigns.pop((m.node, replica.rid), None)
        await self._delete(keys.replica(replica.model, replica.rid))
        self.view.replicas.pop(replica.rid, None)
        log.info("removed %s %s: %s", replica.model, replica.rid, why)
        await self.bus.publish_event(
            "removed",
            replica.model,
            f"{replica.model} {replica.rid} removed: {why}",
            rid=replica.rid,
        )

    def _wanted_assignments(self) -> dict[tuple[str, str], records.Assignment]:
        wanted: dict[tuple[str, str], records.Assignment] = {}
        for rid, r in self.view.replicas.items():
            rank0 = next((m for m in r.members if m.rank == 0), r.members[0])
            master = self.view.nodes[rank0.node].address if rank0.node in self.view.nodes else ""
            fabric = _shared_fabric(r, self.view.nodes) if len(r.members) > 1 else None
            action = "drain" if r.phase == "draining" else "run"
            model = self.view.catalog.get(r.model)
            for m in r.members:
                have = self.view.assigns.get((m.node, rid))
                # an invalid or missing entry changes nothing: keep what the agent has
                digest = (
                    _catalog_hash(model)
                    if model is not None
                    else (have.catalog_hash if have else "")
                )
                wanted[(m.node, rid)] = records.Assignment(
                    catalog_hash=digest,
                    model=r.model,
                    rid=rid,
                    profile=r.profile,
                    action=action,
                    generation=0,
                    rank=m.rank,
                    nodes=len(r.members),
                    master_addr=master,
                    gpus=list(m.gpus),
                    port=m.port,
                    fabric=fabric,
                )
        return wanted

    async def _sync_assignments(self) -> None:
        wanted = self._wanted_assignments()
        for (node, rid), want in wanted.items():
            have = self.view.assigns.get((node, rid))
            # the epoch says who wrote it, and is no change by itself
            if have is not None and msgspec.structs.replace(have, generation=0, epoch=0) == want:
                continue
            record = msgspec.structs.replace(
                want, generation=(have.generation + 1) if have else 1, epoch=self.epoch
            )
            await self._put(keys.assign(node, rid), record)
            self.view.assigns[(node, rid)] = record
        for node, rid in [k for k in self.view.assigns if k not in wanted]:
            await self._delete(keys.assign(node, rid))  # its replica is gone: an orphan
            self.view.assigns.pop((node, rid), None)

    async def _write_placements(
        self, plan: placement.Plan, frozen: Mapping[str, Freeze], now: Instant
    ) -> None:
        records_by_model = dict(plan.placements)
        for model, freeze in frozen.items():
            current = self.view.placements.get(model)
            placed = sum(
                1
                for r in self.view.replicas.values()
                if r.model == model and r.phase in records.REPLICA_COUNTED
            )
            records_by_model[model] = placement.frozen_record(
                model,
                freeze.blocked,
                freeze.detail,
                # the last count read (a count that no longer reads leaves it); with none
                # ever read, what runs
                desired=(
                    self.view.desired[model].replicas if model in self.view.desired else placed
                ),
                placed=placed,
                now=now.wall,
                decisions=current.decisions if current else [],
            )
        for model, rec in records_by_model.items():
            if model in self.view.desired:
                rec = msgspec.structs.replace(
                    rec,
                    desired_at=self.view.desired[model].updated_at,
                    scaled=scaled_text(
                        self.view.desired[model],
                        self.view.catalog.get(model),
                        self.view.scales.get(model),
                    ),
                )
            old = self.view.placements.get(model)
            if old is not None and _same_decision(old, rec):
                continue
            try:
                await self._put(keys.placement(model), rec)
            except ValueTooLarge:
                # the record is wrong, not the link: said as the bug it is, the other
                # models' records still written, and nodes still judged
                log.exception("bug: the placement record of %s is too large to write", model)
                continue
            self.view.placements[model] = rec
            if rec.explanation:
                log.info("%s: %d/%d placed; %s", model, rec.placed, rec.desired, rec.explanation)
                await self.bus.publish_event(
                    "unplaced",
                    model,
                    f"{model}: {rec.explanation}",
                    desired=rec.desired,
                    placed=rec.placed,
                    refused=rec.refused,
                )
        for model in [
            m
            for m in self.view.placements
            if m not in records_by_model and m not in self.view.desired
        ]:
            await self._delete(keys.placement(model))
            self.view.placements.pop(model, None)

    async def _report_qualifying(
        self, snap: placement.Snapshot, nodes: dict[str, placement.NodeState]
    ) -> None:
        """Log and publish when a node starts or stops qualifying for a model still waiting:
        the answer to "why was this placed an hour after it was asked for"."""
        waiting = {m for m, p in self.view.placements.items() if p.placed < p.desired}
        for model in list(self._qualifying):
            if model not in waiting:
                del self._qualifying[model]
        with placement.collector_paused():
            qualifying = placement.qualifying_nodes_by_model(snap, waiting, nodes)
        for model in waiting:
            now_q = qualifying[model]
            before = self._qualifying.get(model)
            self._qualifying[model] = now_q
            if before is None:
                continue
            for node in sorted(now_q - before):
                log.info("node %s now qualifies for waiting model %s", node, model)
                await self.bus.publish_event(
                    "node-qualifies", node, f"node {node} now qualifies for {model}", model=model
                )
            for node in sorted(before - now_q):
                log.info("node %s no longer qualifies for waiting model %s", node, model)
                await self.bus.publish_event(
                    "node-unqualifies",
                    node,
                    f"node {node} no longer qualifies for {model}",
                    model=model,
                )


def _catalog_hash(model) -> str:
    return hashlib.sha256(catalog.encode_model(model)).hexdigest()[:16]


def _member_done(node: str, shard: records.Shard | None, phases: dict[str, str]) -> bool:
    if phases.get(node, "lost") == "lost":
        return True  # nothing left to wait for there
    return shard is not None and shard.phase in records.SHARD_ENGINE_GONE


def _shared_fabric(replica: records.Replica, nodes: dict[str, records.NodeInventory]) -> str | None:
    common: set[str] | None = None
    for m in replica.members:
        inv = nodes.get(m.node)
        fabrics = inv.fabrics() if inv else set()
        common = fabrics if common is None else common & fabrics
    return min(common) if common else None


def _same_decision(a: records.PlacementRecord, b: records.PlacementRecord) -> bool:
    # by the data, never the text: free RAM moves at every heartbeat, a decision does not
    return placement.same_decision(a, b)
