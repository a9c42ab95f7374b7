"""A router process: the HTTP server, its endpoint table, and what keeps the table true.

Two ways to fill the table:
- from the bucket (`llmgw router --nats URL`): watches of `catalog.*`, `replicas.*.*`,
  `shards.*.*`, `health.*` and `placement.*`. The router starts answering before NATS
  does (503s that say it has not read the fleet yet), and when NATS goes away it keeps
  serving from its last table while the bus reconnects and re-reads the bucket;
- from a catalog file (`llmgw router --catalog FILE`): models with `endpoints = [...]`,
  no NATS at all.

A router fed from the bucket is also the gateway (router/keygate.py): it watches
`apikeys.*` and `teams.*`, and adds to the counter streams and the audit trail in the
background (`Gateway.run`); a static router takes the fixed keys of `--api-keys-file`.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

import anyio

from llmgw import catalog
from llmgw.bus import keys
from llmgw.bus.errors import BusError, StreamMissing
from llmgw.bus.trust import RAW
from llmgw.errors import LlmgwError
from llmgw.fleetstate.decode import FleetRecords
from llmgw.gateway.follow import follow
from llmgw.gateway.gateway import Gateway, GatewaySettings
from llmgw.gateway.streams import StreamsSeen
from llmgw.keyfiles import read_key
from llmgw.router.balancer import Balancer, BalancerSettings
from llmgw.router.flow import FlowControl, FlowSettings
from llmgw.router.gate import Gate
from llmgw.router.hold import Holds, HoldSettings
from llmgw.router.inflight import InFlight
from llmgw.router.keygate import GatewayGate
from llmgw.router.load import LOAD_INTERVAL_S, LoadCounter, LoadPublisher
from llmgw.router.metrics import RouterMetrics
from llmgw.router.page import FleetPage
from llmgw.router.peers import Peers
from llmgw.router.probe import HealthProber
from llmgw.router.proxy import Proxy, ProxySettings
from llmgw.router.refusal import error_body
from llmgw.router.report import REPORT_INTERVAL_S, EngineReports
from llmgw.router.server import HttpLimits, HttpServer, serve
from llmgw.router.table import EndpointTable
from llmgw.router.upstream import UpstreamPool, UpstreamSettings

log = logging.getLogger(__name__)


class StaticKeys:
    """The keys static endpoints take, from their models' `api_key_file`, read once per
    file (a file that cannot be read is said once, and its endpoints get no key: their
    401 then tells the client which engine refused)."""

    def __init__(self) -> None:
        self._read: dict[str, str | None] = {}

    def __call__(self, model: catalog.Model) -> str | None:
        path = model.api_key_file
        if not path:
            return None
        if path not in self._read:
            try:
                self._read[path] = read_key(path, f"api_key_file of model {model.id}")
            except LlmgwError as e:
                log.error("router: %s; its endpoints get no key", e)
                self._read[path] = None
        return self._read[path]


# what the router reads of the bucket to route (never nodes.* or leases.*: big, or
# frequent; the fleet page reads those only while a page is open: router/fleet.py)
WATCHED = (
    keys.pattern(keys.CATALOG),
    keys.pattern(keys.REPLICAS),
    keys.pattern(keys.SHARDS),
    keys.pattern(keys.HEALTH),
    keys.pattern(keys.PLACEMENT),
    keys.pattern(keys.DESIRED),  # which models are autoscaled: their requests may be held
    keys.pattern(keys.SCALE),  # how long their last replica took to load (Retry-After)
)


@dataclass(frozen=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    limits: HttpLimits = field(default_factory=HttpLimits)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    probe_interval: float = 5.0
    probe_timeout: float = 2.0
    # how often each engine is asked what it can take (router/report.py)
    report_interval: float = REPORT_INTERVAL_S
    # SIGTERM: requests in flight get this long to finish before their connections are cut
    shutdown_grace: float = 30.0
    hold: HoldSettings = field(default_factory=HoldSettings)
    # the key this router writes its load in, load.<router_id>; "" = <hostname>-<port>
    router_id: str = ""
    load_interval: float = LOAD_INTERVAL_S
    # keys, limits, metering and audit (a bucket-fed router only)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    # who waits when the engines are full: the router's queue (router/flow.py)
    flow: FlowSettings = field(default_factory=FlowSettings)


class Router:
    def __init__(self, settings: RouterSettings | None = None, gate: Gate | None = None) -> None:
        self.settings = settings or RouterSettings()
        # who may send requests and what they are charged (router/gate.py); None: the
        # settings' client keys, nothing metered
        self.gate = gate
        self.table = EndpointTable(self.settings.proxy.engine_api_key, StaticKeys())
        # the one in-flight account the balancer, /metrics and the load records read
        self.flights = InFlight()
        self.metrics = RouterMetrics(self.flights)
        self.load = LoadCounter(self.flights)
        self.holds = Holds(self.table, self.load, self.settings.hold)
        self.metrics.held_from(lambda: self.holds.held)
        self.balancer = Balancer(self.settings.balancer)
        self.flow = FlowControl(
            self.table, self.balancer, self.flights, self.settings.flow, waits=self.metrics
        )
        self.flow.moved = self.load.urgent.set
        self.flow.handed_back = self._handed_back
        self.load.queue = self.flow
        self.metrics.queue_from(self.flow, self.table)
        self.source = "none"
        self.bus = None  # the Bus, once connected (a bucket-fed router)
        self.proxy: Proxy | None = None
        self.page: FleetPage | None = None
        self.server: HttpServer | None = None
        self.draining = False
        self.gateway: Gateway | None = None  # a bucket-fed router's, made when it serves
        self.streams: StreamsSeen | None = None  # the gateway's streams its adds found missing

    @property
    def router_id(self) -> str:
        """Its id in `load.<router_id>`: as configured, else <hostname>-<port>."""
        if self.settings.router_id:
            return self.settings.router_id
        port = self.server.sockets[0].getsockname()[1] if self.server else self.settings.port
        return keys.sanitize_token(f"{socket.gethostname().split('.')[0]}-{port}")

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def serve_static(
        self,
        models: list[catalog.Model],
        *,
        task_status: anyio.abc.TaskStatus[Router] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """A router-only run: the given models' `endpoints`, no NATS."""
        served = [m for m in models if m.endpoints]
        for m in models:
            if not m.endpoints:
                log.warning(
                    "router: model %s has profiles but no endpoints; a router-only run cannot "
                    "place it (run with --nats to serve placed replicas)",
                    m.id,
                )
        self.table.set_static(served)
        self.flow.reshare()
        self.source = "catalog file"
        await self._serve(None, task_status)

    async def serve_bucket(
        self,
        connect,
        *,
        task_status: anyio.abc.TaskStatus[Router] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve from the bucket; `connect()` returns a connected `Bus` (retrying as it likes)."""
        self.table.synced = False
        self.source = "nats"
        await self._serve(connect, task_status)

    async def _serve(self, connect, task_status) -> None:
        s = self.settings
        if connect is not None and s.proxy.client_api_keys and self.gate is None:
            log.warning(
                "router: --api-keys-file given: its keys are the only ones taken, and the "
                "bucket's (`llmgw key`) with their limits and metering are not used; drop "
                "--api-keys-file to use them"
            )
        elif connect is not None and self.gate is None:
            limits = s.gateway.limits
            self.streams = StreamsSeen(limits.offline, limits.serve_offline_for)
            self.gateway = Gateway(self.router_id, _BusCounter(self), _BusAudit(self), s.gateway)
            self.gate = GatewayGate(self.gateway, self.table.context)
            self.flow.served_tokens = self.gate.served_tokens
            self.flow.team_weight = self.gate.team_weight
            self.metrics.tokens_from(lambda: self.gateway.tokens if self.gateway else {})
            self.metrics.gateway_from(self.streams.state, self._unreadable_keys)
        pool = UpstreamPool(s.upstream)
        probe_pool = UpstreamPool(
            UpstreamSettings(
                connect_timeout=s.probe_timeout,
                read_timeout=s.probe_timeout,
                idle_timeout=s.upstream.idle_timeout,
            )
        )
        self.page = (
            FleetPage(
                self.table,
                self.metrics.ttfb,
                self.health,
                waiting=self.load.waiting,
                queue_wait=self.metrics.queue_wait,
                queued=self.flow.queued_by_standing,
            )
            if s.proxy.page
            else None
        )
        self.proxy = Proxy(
            self.table,
            self.balancer,
            pool,
            self.metrics,
            s.proxy,
            health=self.health,
            page=self.page,
            load=self.load,
            holds=self.holds,
            gate=self.gate,
            flow=self.flow,
        )
        prober = HealthProber(
            self.table,
            probe_pool,
            interval=s.probe_interval,
            timeout=s.probe_timeout,
        )
        self.server = await serve(
            self.proxy.handle,
            s.host,
            s.port,
            limits=s.limits,
            error_body=lambda status, message: error_body(status, message),
            on_overrun=self.metrics.overruns.inc,
        )
        log.info("router listening on %s", self.url)
        if self.gateway is not None:
            self.gateway.router = self.router_id  # its port is known now
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.sweep_forever)
                tg.start_soon(probe_pool.sweep_forever)
                tg.start_soon(prober.run)
                tg.start_soon(
                    EngineReports(
                        self.table, probe_pool, self.flow.reshare, interval=s.report_interval
                    ).run
                )
                tg.start_soon(self._count_endpoints)
                tg.start_soon(self._reshare_every, s.load_interval)
                if self.page is not None:
                    tg.start_soon(self.page.watch.run, lambda: self.bus)
                if connect is not None:
                    tg.start_soon(self._follow_bucket, connect)
                task_status.started(self)
        finally:
            with anyio.CancelScope(shield=True):
                await self.server.aclose()  # every connection's clean-up has run
            pool.close_idle()
            probe_pool.close_idle()

    async def shutdown(self, grace: float | None = None) -> int:
        """Stop accepting, close idle connections and let the requests in flight finish,
        for up to `grace` seconds (the settings' shutdown_grace by default); what is still
        running then is cut: its client sees the answer end early, and its engine stops.
        Returns how many connections were cut. The caller then cancels `serve_*`."""
        grace = self.settings.shutdown_grace if grace is None else grace
        assert self.server is not None
        self.draining = True
        # a request held for a cold model, or waiting for room, never reached an engine:
        # answered now (503, retry), not after the grace with a bare EOF
        self.holds.stop()
        self.flow.stop()
        busy = sum(1 for c in self.server.connections if not c.idle)
        log.info(
            "router stops accepting; %d connection(s) busy, given up to %g s to finish",
            busy,
            grace,
        )
        cut = await self.server.shutdown(grace)
        if cut:
            log.warning(
                "router: %d connection(s) still busy after the %g s grace were cut; their "
                "clients got an incomplete answer (raise --shutdown-grace to wait longer)",
                cut,
                grace,
            )
        else:
            log.info("router: every request in flight finished")
        return cut

    def health(self) -> dict[str, object]:
        """What GET /health adds to {"status": "ok"}."""
        out: dict[str, object] = {
            "source": self.source,
            "draining": self.draining,
            "models": len(self.table.known_names()),
            "models_ready": len(self.table.served_names()),
        }
        if self.source == "nats":
            if self.bus is None:
                out["nats"] = "connecting"
            else:
                out["nats"] = "connected" if self.bus.connected else "reconnecting"
            out["bucket_read"] = self.table.synced
        if self.streams is not None and self.streams.missing:
            out["streams_missing"] = sorted(self.streams.missing)
        return out

    def _unreadable_keys(self) -> dict[tuple[str, str], int]:
        """(family, reading) -> keys of apikeys.* / teams.* whose newest value does not read."""
        return self.gateway.table.unreadable_counts() if self.gateway is not None else {}

    async def _count_endpoints(self) -> None:
        while True:
            # per model and replica, kept while the table knows them (and "" for requests
            # that reached no replica)
            alive = {("", "")} | {(b.model, b.id) for b in self.table.backends()}
            for name in self.table.known_names():
                route = self.table.route(name)
                if route is not None:
                    self.metrics.endpoints.labels(route.model).set(len(route.backends))
                    alive.add((route.model, ""))
            self.metrics.forget_except(alive)
            await anyio.sleep(self.settings.probe_interval)

    def _handed_back(self) -> None:
        self.load.handover.set()
        self.load.urgent.set()

    async def _reshare_every(self, interval: float) -> None:
        """The split of engines between routers, again: a router gone quiet stops counting
        without a record to say so."""
        while True:
            self.flow.reshare()
            await anyio.sleep(interval)

    async def _follow_loads(self, bus) -> None:
        """The other routers' load records: their demand, by which the engines are split."""
        from llmgw.bus.client import Synced

        seen = FleetRecords(families=frozenset({keys.LOAD}))
        peers = self.flow.peers
        assert peers is not None
        async for item in bus.watch(keys.pattern(keys.LOAD), RAW):
            if isinstance(item, Synced):
                continue
            seen.apply(item.key, item.value, item.revision)
            parsed = keys.parse(item.key)
            router = parsed.ids[0] if parsed is not None else ""
            if router and router != peers.me:
                changed = peers.saw(router, seen.loads.get(router))
                if changed is None or changed:
                    self.flow.reshare(changed)

    async def _follow_bucket(self, connect) -> None:
        from llmgw.bus.client import Synced

        bus = self.bus = await connect()
        synced: set[str] = set()
        self.flow.peers = Peers(self.router_id)
        try:
            async with anyio.create_task_group() as tg:
                publisher = LoadPublisher(
                    self.load,
                    self.router_id,
                    self.settings.load_interval,
                    written=self.flow.written,
                )
                tg.start_soon(publisher.run, bus)
                tg.start_soon(self._follow_loads, bus)
                for pattern in WATCHED:
                    tg.start_soon(self._follow, bus, pattern, synced, Synced)
                if self.gateway is not None:
                    tg.start_soon(follow, bus, self.gateway)
                    tg.start_soon(self.gateway.run)
        finally:
            with anyio.CancelScope(shield=True):
                if self.gateway is not None:
                    # what was metered and audited since the last flush, if NATS takes it
                    with anyio.move_on_after(2):
                        await self.gateway.flush()
                await bus.close()

    async def _follow(self, bus, pattern: str, synced: set[str], synced_type) -> None:
        async for item in bus.watch(pattern, RAW):
            if isinstance(item, synced_type):
                synced.add(pattern)
                if not self.table.synced and len(synced) == len(WATCHED):
                    self.table.synced = True
                    self.table.rebuild()
                    self.holds.changed()
                    self.flow.reshare()
                    log.info(
                        "router: read the bucket: %d model(s), %d with a ready engine",
                        len(self.table.known_names()),
                        len(self.table.served_names()),
                    )
                continue
            self.table.apply(item.key, item.value, item.revision)
            self.holds.changed()
            if self.table.synced:  # not once a key while the bucket is first read
                self.flow.reshare()


class _BusCounter:
    """The streams beside the bucket (usage counters, limits) on the router's Bus, once it is
    connected; which streams are missing is told to the router's StreamsSeen."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def _on_bus(self, call, stream: str):
        from llmgw.bus.counters import Counters

        bus = self._router.bus
        if bus is None:
            raise BusError("the router is not connected to NATS yet")
        seen = self._router.streams
        try:
            answer = await call(Counters(bus))
        except StreamMissing as e:
            if seen is not None:
                seen.lacking(e.stream)
            raise
        if seen is not None and seen.missing:
            seen.found(stream)
        return answer

    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        from llmgw.bus.counters import stream_of

        return await self._on_bus(lambda c: c.add(subject, delta, msg_id), stream_of(subject))

    async def claim(
        self, window_subject: str, holder: str, mine: int, asked: int, limit: int
    ) -> tuple[int, int]:
        return await self._on_bus(
            lambda c: c.claim(window_subject, holder, mine, asked, limit), keys.LIMITS_STREAM
        )

    async def hold(self, window_subject: str, holder: str, units: int) -> None:
        await self._on_bus(lambda c: c.hold(window_subject, holder, units), keys.LIMITS_STREAM)


class _BusAudit:
    """The audit trail on the router's Bus, once it is connected."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def append(self, batch) -> None:
        from llmgw.bus.counters import AuditTrail

        bus = self._router.bus
        if bus is None:
            raise BusError("the router is not connected to NATS yet")
        seen = self._router.streams
        try:
            await AuditTrail(bus).append(batch)
        except StreamMissing as e:
            if seen is not None:
                seen.lacking(e.stream)
            raise
        if seen is not None and seen.missing:
            seen.found(keys.AUDIT_STREAM)
