"""The controller: a shell around the reconciler, level-triggered, stateless, safe to kill
at any moment.

It owns the watch (one, of the whole bucket, kept as the view), leadership, the link's
trust, metrics and the cadence (a tick, a full pass every `resync`). Every pass hands the
view and one instant to the reconciler (controller/reconciler.py), which returns what the
bucket should hold as changes, and the one writer (controller/writer.py) applies them:
stamped with the epoch, fenced with the `leader` key (controller/leadership.py), mirrored
into the view, and said. A leader deposed while stalled writes nothing after the takeover. It judges nodes only while its own link to the bucket is trusted
(controller/link.py). Time comes from one clock passed in (controller/clock.py).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import socket
from dataclasses import dataclass, field

import anyio

from llmgw.bus import keys, records
from llmgw.bus.client import RAW, Bus, BusError, Synced, Update, decoder
from llmgw.bus.records import NodePhase
from llmgw.controller import placement
from llmgw.controller.adapters import DemandTracker
from llmgw.controller.autoscale import LOAD_STALE_AFTER_S, Autoscaler, engine_saturation
from llmgw.controller.changes import Change, NodeJudged, ReplicaIs, Restored, Scaled
from llmgw.controller.clock import Clock, Instant, SystemClock, instant
from llmgw.controller.echo import Echo
from llmgw.controller.inputs import hold_recorded_phases
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
from llmgw.controller.reconciler import (
    REFUSED_AFTER_S,
    PassSettings,
    Reconciler,
    health_changes,
    placed_counts,
    scale_changes,
)
from llmgw.controller.view import View
from llmgw.controller.writer import FencedWriter, NotLeading
from llmgw.fleetstate.decode import CONTROLLER_WRITES
from llmgw.metrics_http import MetricsEndpoint

log = logging.getLogger(__name__)

# seconds between the idle heartbeats of the controller's watch: two missed and it is made
# again (the echo of its own writes, controller/echo.py, catches what this does not)
WATCH_HEARTBEAT_S = 1.0
# key families whose change can change a node's phase or what is stored of it
_JUDGED_BY = frozenset((keys.LEASES, keys.NODES, keys.HEALTH))


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
    # a launch its agent refused before launch, and does not try again, standing still
    # this long is a failed start like any other (controller/inputs.py StoppedTrying): the
    # fallback for agents that do not say so themselves (Shard.gave_up at once)
    refused_after: float = REFUSED_AFTER_S
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
        self.echo = Echo()  # its own writes shown back: the watch is live
        self._leader_shown = anyio.Event()  # set at each leader key the watch shows, then new
        self._wrote = 0  # the latest revision of the leader key this controller wrote
        self.leadership = Leadership(self.id, self.instance, self.settings.leader_ttl)
        self.leadership_steps = 0  # times it looked at the leader key: what tests wait on
        self.passes = 0
        self._synced = anyio.Event()
        self._pass_due = True  # something a pass reads changed since the last one
        self._last_pass = float("-inf")  # the clock's time of the last full pass
        self.writer = FencedWriter(bus, self.view, self.leadership, self.link)
        self.reconciler = Reconciler(
            PassSettings(
                port_range=self.settings.port_range,
                recheck_after=self.settings.recheck_after,
                failures=placement.FailurePolicy(
                    self.settings.failure_cooldown, self.settings.failure_nodes
                ),
                refused_after=self.settings.refused_after,
            ),
            self.clock,
        )
        self.metrics = ControllerMetrics(self.view, lambda: self.leading)
        # /metrics: an address another program holds never stops placement (said in the
        # log and on llmgw.events.controller-metrics.<id>, tried again until free)
        self.metrics_endpoint = (
            None
            if self.settings.metrics_listen is None
            else MetricsEndpoint(
                self.metrics.registry,
                self.settings.metrics_listen,
                fix="move it with --metrics-listen HOST:PORT (LLMGW_METRICS_LISTEN), or give none",
                who=f"controller {self.id}",
                on_change=self._metrics_changed,
            )
        )
        self.autoscaler = Autoscaler(self.settings.load_stale_after)
        self.adapter_demand = DemandTracker()  # when each LoRA adapter was last asked for
        self._wake = anyio.Event()  # a cold model's request is waiting: pass now
        # nodes whose lease, inventory or health changed since the last judgement that was
        # written; None: judge every node next (liveness.judge)
        self._touched: set[str] | None = None
        self._judged_all_at = float("-inf")  # the clock's time of the last whole-fleet one

    @property
    def id(self) -> str:
        return self.settings.controller_id

    @property
    def metrics_port(self) -> int | None:
        """Bound, once serving /metrics."""
        return None if self.metrics_endpoint is None else self.metrics_endpoint.port

    @property
    def metrics_error(self) -> str | None:
        """Why /metrics is not served (its address cannot be listened on), or None."""
        return None if self.metrics_endpoint is None else self.metrics_endpoint.error

    async def _metrics_changed(self, problem: str | None) -> None:
        await self.bus.publish_event(
            "controller-metrics",
            keys.sanitize_token(self.id),
            problem or f"controller {self.id} serves /metrics",
            error=problem,
        )

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def fenced_off(self) -> int:
        """Writes the server refused: another controller had taken over."""
        return self.writer.fenced_off

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
                if self.metrics_endpoint is not None:
                    await tg.start(self.metrics_endpoint.run)
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
            self.writer.batches_asked.set()
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
            async for item in self.bus.watch(">", RAW, heartbeat=WATCH_HEARTBEAT_S):
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

    def _wrote_leader_key(self, revision: int) -> None:
        self._wrote = max(self._wrote, revision)
        self.echo.expect(revision, anyio.current_time())  # how long the watch takes is real time

    async def _check_watch(self, *, overdue: bool = False) -> None:
        """A write of its own the watch has not shown within `Echo.within` (or `overdue`
        says so): the watch's consumer stopped delivering (its server died): read the
        bucket again through a new one, judging nothing meanwhile. nats-py would make it
        again only after two missed heartbeats, and the takeover a controller must see
        before it writes waited for it."""
        if not (overdue or self.echo.overdue(anyio.current_time())):
            return
        awaited = self.echo.awaited
        self.echo.forget()
        self.link.resyncing(
            f"the watch has not shown the leader key this controller wrote (revision "
            f"{awaited}) for {self.echo.within:g} s; reading the bucket again"
        )
        await self.bus.restart_watches()

    async def _watch_shows_now(self) -> bool:
        """Whether the watch has shown everything stored until now: a renewal of the leader
        key written now comes back through it (the watch delivers in the order stored).
        If it does not within `Echo.within`, the watch is made again (`_check_watch`)."""
        async with self.writer.lock:
            await self._renew(instant(self.clock))
        if not self.leadership.leading:
            return False
        wrote = self._wrote
        with anyio.move_on_after(self.echo.within):
            # the leadership's own renewals may write the key meanwhile: any revision shown
            # at or past this one will do
            while not self.echo.shows(wrote):
                await self._leader_shown.wait()
            return True
        await self._check_watch(overdue=True)
        return False

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
            self.echo.saw(self.view.leader_rev)
            self._leader_shown.set()
            self._leader_shown = anyio.Event()
            self._wake_once_writable()
        elif family == keys.LOAD:
            parsed = keys.parse(item.key)
            assert parsed is not None
            router = parsed.ids[0]
            self.autoscaler.loads.saw(router, self.view.loads.get(router), now)
            if self.autoscaler.cold_waiting(self.view.loads, now):
                self._wake.set()
            if self._adapter_asked(self.view.loads.get(router)):
                self._pass_due = True  # loaded nowhere, or too busy where it is
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

    def _adapter_asked(self, load: records.RouterLoad | None) -> bool:
        """A router holds a request for a LoRA adapter: placed in this pass, not the next."""
        adapters = self.view.adapters
        return load is not None and any(
            m.waiting > 0 and model in adapters for model, m in load.models.items()
        )

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
            await self._check_watch()
            try:
                async with self.writer.lock:
                    now = instant(self.clock)
                    if self.leadership.leading:
                        await self._renew(now)
                    else:
                        await self._claim(now)
            except BusError as e:  # NATS away: try again next interval
                why = str(e) or type(e).__name__
                self.leadership.step_down(f"cannot renew the leader key: {why}")
                self.link.write_failed(f"the leader key: {why}")
                self.metrics.failed("leadership", "link")
            except Exception as e:  # noqa: BLE001 - a bug: step down (safe), trust the link
                log.exception("bug in the leadership step; stepping down until the next one")
                self.metrics.failed("leadership", "bug")
                self.leadership.step_down(f"a bug in the leadership step: {type(e).__name__}")
            self.leadership_steps += 1
            # one that does not lead looks again within a second: a leader whose renewal
            # failed in an election takes its own key back as soon as the stream answers
            await anyio.sleep(interval if self.leadership.leading else min(interval, 1.0))

    async def _renew(self, now: Instant) -> None:
        renewal = self.leadership.renewal(now.wall)
        if renewal is None:
            return  # it stopped leading meanwhile
        last, record = renewal
        rev = await self.bus.update(keys.leader(), record, last=last)
        if rev is not None:
            self.leadership.renewed(rev)
            self._wrote_leader_key(rev)
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
        assert rev is not None
        self._wrote_leader_key(rev)
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
            # the resync is on the clock: a test moves it, and waits for nothing
            if now.monotonic - self._last_pass >= self.settings.resync:
                due = True
            if due and self.link.may_judge:  # (a health write that hung made it suspect)
                self._pass_due = False
                self._last_pass = now.monotonic
                started = anyio.current_time()  # how long it took is real time
                try:
                    await self.reconcile(now)
                finally:
                    self.metrics.passed(anyio.current_time() - started)
        except NotLeading:
            self._pass_due = True
        except BusError as e:  # the link failed: the next pass starts from the bucket again
            log.warning("reconcile pass failed: %s; retrying", e)
            self._pass_due = True
            self.link.write_failed(str(e))
            self.metrics.failed("reconcile", "link")
        except Exception:  # noqa: BLE001 - a bug, not the link: nodes are still judged
            log.exception("bug in the reconcile pass; it runs again, still judging nodes")
            self.metrics.failed("reconcile", "bug")
            self._pass_due = True

    async def _rewrite_kept(self) -> None:
        """A record of the leader's own whose value does not read (garbled by hand) is kept
        by the view (llmgw/fleetstate/decode.py) and compared as kept, so no change would
        ever write it again: write it back as kept, once per bad revision, so that a reader
        started since reads it too."""
        for key in [k for k in self._rewritten if k not in self.view.unreadable]:
            del self._rewritten[key]  # read again
        restore = []
        for key, bad in list(self.view.unreadable.items()):
            if bad.reading != "kept" or bad.family not in CONTROLLER_WRITES:
                continue
            if self._rewritten.get(key) == bad.revision:
                continue
            value = self.view.value_of(key)
            if value is None:
                continue
            self._rewritten[key] = bad.revision
            restore.append(Change(key, value, Restored(key, bad.revision)))
        if restore:
            await self.writer.apply(restore)

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
        changes = self.autoscaler.decide(
            catalog=self.view.catalog,
            desired=self.view.desired,
            scales=self.view.scales,
            loads=self.view.loads,
            placed=placed_counts(self.view),
            placements=self.view.placements,
            now=now.monotonic,
            wall=now.wall,
            engines=(
                engine_saturation(
                    self.view.leases, self.view.health, self.view.replicas, self.view.shards
                )
                if any(d.auto for d in self.view.desired.values())
                else None
            ),
            adapters={aid: a.base for aid, a in self.view.adapters.items()},
        )
        written = await self.writer.apply(scale_changes(self.view, changes))
        return any(isinstance(c.why, Scaled) for c in written)

    async def _judge_nodes(self, now: Instant) -> bool:
        """Write `health.<node>` where a node's phase changed; True if any did. Judges the
        nodes touched since the last judgement (liveness.judge), the whole fleet when that
        was asked for and every `resync` seconds besides."""
        touched, self._touched = self._touched, set()
        if now.monotonic - self._judged_all_at >= self.settings.resync:
            touched = None
        if touched is None:
            self._judged_all_at = now.monotonic
        changes = self._judgement(now, touched)
        try:
            if changes.declares_silence:
                # no node is declared silent without a round trip
                if await self._check_link():
                    self._grace(now.monotonic)
                # ...nor without the watch that would have seen it move shown to be live:
                # then what it delivered meanwhile is in the view, and all are judged again
                if not self.link.may_judge or not await self._watch_shows_now():
                    self._touched = None  # judged but not written: all again next time
                    return False
                now = instant(self.clock)
                changes = self._judgement(now, None)
            for change in await self.writer.apply(health_changes(changes)):
                if (
                    isinstance(change.why, NodeJudged)
                    and change.why.record.phase != "ready"
                    and self._touched is not None
                ):
                    # its lease may have moved while this was written, when it was still
                    # stored ready (lease_change_matters said no): judged again next tick,
                    # not only when the echo of this write comes back
                    self._touched.add(change.why.record.node)
        except BaseException:
            self._touched = None  # some may not be written: every node again next time
            raise
        return bool(changes.write)

    def _judgement(self, now: Instant, touched: set[str] | None) -> HealthChanges:
        return judge(
            self.view.nodes,
            self.view.health,
            self.view.leases,
            self.tracker,
            now.monotonic,
            now.wall,
            touched,
        )

    # --- reconcile ------------------------------------------------------------------------

    async def reconcile(self, now: Instant) -> None:
        """One placement pass: the reconciler decides, the writer writes."""
        self.passes += 1
        demand = self.adapter_demand.demand(self.autoscaler.summed, self.view.adapters, now.wall)
        decided = self.reconciler.run(
            self.view, self.phases(now.monotonic), now, self.phases, demand=demand
        )
        if decided.again:
            self._pass_due = True
        for change in await self.writer.apply(decided.changes):
            if isinstance(change.why, ReplicaIs):
                r = change.why.replica
                if r.phase == "ready" and change.why.previous in ("placed", "starting"):
                    self.autoscaler.loaded(r.model, self.clock.wall() - r.created_at)
