"""The router's request handler: OpenAI routes in, a chosen engine's answer out, unchanged.

Bodies go to the engine as they came and its answer comes back as it goes: the engine's
status, its error body, and a stream relayed chunk by chunk as each arrives (never
buffered whole). The request is framed anew for the engine (its own Content-Length, the
few headers worth passing on), so nothing of the client's framing reaches an engine.
A request is sent a second time, to another engine, only when nothing of it reached the
first (its connection could not be made; counted in llmgw_router_retries_total); once an
engine may have read it, its failure is the client's answer (502), because generating
twice is not harmless.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw import priority
from llmgw.gateway.gateway import CHARS_PER_TOKEN
from llmgw.priority import ASK_HEADER, Standing
from llmgw.router.balancer import Balancer
from llmgw.router.flow import FlowControl
from llmgw.router.gate import Gate, KeyListGate, Later, Ticket
from llmgw.router.hold import MAX_WAIT_HEADER, Holds
from llmgw.router.inflight import Flight
from llmgw.router.load import LoadCounter
from llmgw.router.metrics import CONTENT_TYPE as METRICS_TYPE
from llmgw.router.metrics import RouterMetrics
from llmgw.router.page import FleetPage
from llmgw.router.refusal import Refusal, retry_after
from llmgw.router.request import Affinity, BadRequest, Parsed, parse
from llmgw.router.server import Request, Response
from llmgw.router.table import Backend, EndpointTable, Route
from llmgw.router.upstream import ConnectFailed, UpstreamConnection, UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """What a proxied route's body is, for reading its model and affinity key."""

    affinity: Affinity = Affinity.NONE


# Every OpenAI-style route llama-server or vLLM serves for a model. Each is proxied the same
# way (routing, affinity, holding for a cold model, the gate); an engine that does not serve
# one answers for itself (its 404 reaches the client).
_PROXIED = {
    b"/v1/chat/completions": RouteSpec(Affinity.CHAT),
    b"/v1/completions": RouteSpec(Affinity.PROMPT),
    b"/v1/embeddings": RouteSpec(),
    # vLLM's Responses API
    b"/v1/responses": RouteSpec(Affinity.RESPONSES),
    # rerank: llama-server (/v1/rerank, /rerank, /v1/reranking, /reranking), vLLM (/v1/rerank,
    # /rerank, /v2/rerank)
    b"/v1/rerank": RouteSpec(),
    b"/rerank": RouteSpec(),
    b"/v2/rerank": RouteSpec(),
    b"/v1/reranking": RouteSpec(),
    b"/reranking": RouteSpec(),
    # vLLM's score, pooling and classification
    b"/v1/score": RouteSpec(),
    b"/score": RouteSpec(),
    b"/pooling": RouteSpec(),
    b"/classify": RouteSpec(),
    # vLLM's audio: multipart/form-data bodies, the model in a form field
    b"/v1/audio/transcriptions": RouteSpec(),
    b"/v1/audio/translations": RouteSpec(),
    # both engines' tokenizer, and llama-server's fill-in-the-middle
    b"/tokenize": RouteSpec(),
    b"/detokenize": RouteSpec(),
    b"/infill": RouteSpec(Affinity.INFILL),
}
# client headers worth passing on; Authorization never is (the client's key is not the
# engine's), nor anything about this hop
_FORWARDED = (b"content-type", b"accept", b"x-request-id", b"traceparent", b"tracestate")
_NOT_RELAYED = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"content-length",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"upgrade",
        b"date",
        b"server",
    )
)
_GATEWAY_FAILURES = (502, 503, 504)


@dataclass(frozen=True)
class ProxySettings:
    engine_api_key: str | None = None  # sent to engines as a bearer token
    client_api_keys: frozenset[str] = frozenset()  # empty: clients need no key
    session_header: str = "x-session-id"
    # x-llmgw-replica on every proxied answer: which replica (or static URL) served it
    replica_header: bool = True
    # /metrics: "public" (no key, for Prometheus), "keyed" (a client key, when keys are
    # configured), "off" (404)
    metrics: str = "public"
    # the fleet page at / (llmgw/router/page.py): what runs where; off: 404
    page: bool = True
    # who may read the page's document (/fleet/state: every node's address, every engine's
    # endpoint): "keyed" (a client key, once any key exists: a fleet locked with keys is
    # not shown to whoever reaches it) or "public"; the page's files hold no fleet data
    page_access: str = "keyed"


class Proxy:
    """The request handler. A proxied request goes through small steps, each returning a
    value or a Refusal: authenticate and admit (the gate), parse, route, pick (holding for
    a cold model), send, relay. `_admit` runs those before an engine, `_forward` those with
    one; `_refuse` is the one place a Refusal is answered."""

    def __init__(
        self,
        table: EndpointTable,
        balancer: Balancer,
        pool: UpstreamPool,
        metrics: RouterMetrics,
        settings: ProxySettings | None = None,
        health: Callable[[], dict[str, object]] = dict,
        page: FleetPage | None = None,
        load: LoadCounter | None = None,
        holds: Holds | None = None,
        gate: Gate | None = None,
        flow: FlowControl | None = None,
    ) -> None:
        self.table = table
        self.load = load or LoadCounter(metrics.flights)
        self.flights = self.load.in_flight
        self.holds = holds
        self.balancer = balancer
        self.flow = flow or FlowControl(table, balancer, self.flights)
        self.pool = pool
        self.metrics = metrics
        self.settings = settings or ProxySettings()
        self.gate: Gate = gate or KeyListGate(self.settings.client_api_keys)
        self._health = health
        self._page = page
        self._session = self.settings.session_header.lower().encode()

    async def handle(self, req: Request, resp: Response) -> None:
        spec = _PROXIED.get(req.path)
        if spec is not None:
            await self._proxy(req, resp, spec)
        elif req.path == b"/v1/models" and req.method in (b"GET", b"HEAD"):
            who = self.gate.authenticate(req)
            if isinstance(who, Refusal):
                await self._refuse(resp, who)
            else:
                await resp.send(200, self._models(who))
        elif req.path == b"/health" and req.method in (b"GET", b"HEAD"):
            state = self._health()
            # a router shutting down says so, for a load balancer in front still asking
            draining = bool(state.pop("draining", False))
            body = json.dumps({"status": "draining" if draining else "ok", **state}).encode()
            await resp.send(503 if draining else 200, body)
        elif (
            req.path == b"/metrics"
            and req.method in (b"GET", b"HEAD")
            and self.settings.metrics != "off"
        ):
            who = self.gate.authenticate(req) if self.settings.metrics == "keyed" else None
            if isinstance(who, Refusal):
                await self._refuse(resp, who)
            else:
                await resp.send(200, self.metrics.render(), content_type=METRICS_TYPE)
        elif (
            self._page is not None
            and req.method in (b"GET", b"HEAD")
            and self._page.serves(req.path)
        ):
            keyed = self.settings.page_access == "keyed" and self._page.holds_data(req.path)
            who = self.gate.authenticate(req) if keyed else None
            if isinstance(who, Refusal):
                await self._refuse(resp, who)
            else:
                await self._page.handle(req, resp)
        else:
            await self._refuse(
                resp,
                Refusal(
                    404,
                    f"no route {req.method.decode(errors='replace')} "
                    f"{req.path.decode(errors='replace')}: this router serves POST "
                    f"{', '.join(p.decode() for p in _PROXIED)} and GET /v1/models, /health, "
                    "/metrics and the fleet page at /",
                ),
            )

    def _models(self, who: object) -> bytes:
        # a cold model (autoscaled to zero, or its first replica loading) is listed too: a
        # request for it waits for a replica; a key sees only the models it may use
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
            for name in self.gate.models(who, self.table.served_names())
        ] + [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "cold": True}
            for name in self.gate.models(who, self.table.cold_names())
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _refuse(self, resp: Response, refusal: Refusal) -> None:
        """The one place a request is answered without an engine."""
        series = self.metrics.replica(refusal.model, refusal.replica)
        if refusal.kind:
            series.failed(refusal.kind)
        series.answered(refusal.status)
        await resp.send(refusal.status, refusal.body(), headers=refusal.headers)

    # --- proxying: the steps ------------------------------------------------------------------

    async def _proxy(self, req: Request, resp: Response, spec: RouteSpec) -> None:
        admitted = self._admit(req, spec)
        if isinstance(admitted, Refusal):
            await self._refuse(resp, admitted)
            return
        parsed, route, ticket, standing = admitted
        if type(ticket) is Later:
            ticket = await ticket.wait
            if isinstance(ticket, Refusal):
                await self._refuse(resp, ticket)
                return
        outcome: Refusal | Relayed = Relayed(0, "client_disconnect")
        try:
            outcome = await self._forward(req, resp, parsed, route, ticket, standing)
            if isinstance(outcome, Refusal):
                if ticket is not None:
                    headers = outcome.headers + ticket.answering(outcome.replica)
                    await self._refuse(resp, dataclasses.replace(outcome, headers=headers))
                else:
                    await self._refuse(resp, outcome)
        finally:
            if ticket is not None:
                if isinstance(outcome, Refusal):
                    ticket.settle(outcome.status, outcome.kind or "refused", outcome.code)
                else:
                    ticket.settle(outcome.status, outcome.outcome)

    def _admit(
        self, req: Request, spec: RouteSpec
    ) -> tuple[Parsed, Route, Ticket | Later | None, Standing] | Refusal:
        """The steps before an engine: who sends it, what it asks for, whether it may, and
        where it stands when the engines are full."""
        if req.method != b"POST":
            return Refusal(405, "use POST")
        who = self.gate.authenticate(req)
        if isinstance(who, Refusal):
            return who
        parsed = self._parse(req, spec)
        if isinstance(parsed, Refusal):
            return parsed
        route = self._route(parsed, who)
        if isinstance(route, Refusal):
            return route
        ticket = self.gate.admit(who, parsed, route.model, req)
        if isinstance(ticket, Refusal):
            return ticket
        return parsed, route, ticket, self.gate.standing(who)

    async def _forward(
        self,
        req: Request,
        resp: Response,
        parsed: Parsed,
        route: Route,
        ticket: Ticket | None,
        standing: Standing,
    ) -> Refusal | Relayed:
        """The steps with an engine: its place at one (waiting for room, or holding for a
        cold model), send, relay."""
        placed = await self._place(req, parsed, route, standing)
        if isinstance(placed, Refusal):
            return placed
        route, flight = placed
        with flight:
            return await self._send_and_relay(req, resp, parsed, route, flight, ticket)

    async def _place(
        self, req: Request, parsed: Parsed, route: Route, standing: Standing
    ) -> tuple[Route, Flight] | Refusal:
        """The request's place at an engine of its model: at once where one has room, else
        when the router's queue lets it go (router/flow.py); for a cold model, once a
        replica is ready."""
        cls = priority.lowered(
            standing.priority, priority.asked(req.first.get(ASK_HEADER), req.body)
        )
        tokens = -(-parsed.prompt_bytes // CHARS_PER_TOKEN)  # its prompt, as the gate estimates it
        took = self.flow.take(route, standing, cls, parsed.affinity, tokens)
        if took is None:
            picked = await self._pick(req, parsed, route)
            if isinstance(picked, Refusal):
                return picked
            route = picked[0]
            took = self.flow.take(route, standing, cls, parsed.affinity, tokens)
            if took is None:  # gone again meanwhile
                return self._no_replica(parsed, route)
        if isinstance(took, Flight):
            return route, took
        waited = await self.flow.wait(route, took, req.header(MAX_WAIT_HEADER))
        if isinstance(waited, Refusal):
            return waited
        return route, waited

    def _parse(self, req: Request, spec: RouteSpec) -> Parsed | Refusal:
        try:
            return parse(
                req.body,
                affinity=spec.affinity,
                session=req.header(self._session),
                content_type=req.header(b"content-type"),
            )
        except BadRequest as e:
            return Refusal(400, str(e), kind="bad_request")

    def _route(self, parsed: Parsed, who: object) -> Route | Refusal:
        route = self.table.route(parsed.model)
        if route is not None:
            return route
        if not self.table.synced:
            return Refusal(
                503,
                "the router has not read the fleet's state from NATS yet; try again shortly",
                code="not_ready",
                kind="no_replica",
                headers=retry_after(2),
            )
        # a key is shown the models it may use, as GET /v1/models shows it
        known = self.table.known_names()
        names = ", ".join(self.gate.models(who, known)) or (
            "none you may use" if known else "none yet"
        )
        return Refusal(
            404,
            f"model {parsed.model!r} does not exist; models: {names}",
            code="model_not_found",
            kind="unknown_model",
            param="model",
        )

    async def _pick(
        self, req: Request, parsed: Parsed, route: Route
    ) -> tuple[Route, Backend] | Refusal:
        """The engine for the request; for a cold model, held until one is ready."""
        backend = self.balancer.pick(route.backends, parsed.affinity, time.monotonic())
        if backend is not None:
            return route, backend
        if self.holds is not None:
            held = await self.holds.hold(
                parsed.model,
                route.model,
                req.header(MAX_WAIT_HEADER),
                lambda r: self.balancer.pick(r.backends, parsed.affinity, time.monotonic()),
            )
            if held is not None:
                return held
        return self._no_replica(parsed, route)

    @staticmethod
    def _no_replica(parsed: Parsed, route: Route) -> Refusal:
        return Refusal(
            503,
            f"model {parsed.model!r} has no ready replica: {route.why_none}",
            code="no_ready_replica",
            kind="no_replica",
            model=route.model,
            headers=retry_after(5),
        )

    async def _send_and_relay(
        self,
        req: Request,
        resp: Response,
        parsed: Parsed,
        route: Route,
        flight: Flight,
        ticket: Ticket | None,
    ) -> Refusal | Relayed:
        """Send to the flight's engine (to a second engine only when the first could not be
        reached: nothing of the request was sent) and relay its answer. The request holds
        its one in-flight account, `flight`, until the end of its answer."""
        head = self._forwarded_head(req)
        started = time.monotonic()
        backend = flight.backend
        for attempt in (0, 1):
            try:
                conn = await self.pool.send(
                    backend.host,
                    backend.port,
                    self._request(backend, req, head),
                    tls=backend.tls,
                )
            except ConnectFailed as e:
                self._count_failure(backend, str(e))
                self.metrics.replica(route.model, backend.id).failed("connect")
                other = self.balancer.pick(
                    route.backends, parsed.affinity, time.monotonic(), exclude=backend
                )
                if attempt == 0 and other is not None:
                    log.info("router: %s; sending the request to %s instead", e, other.id)
                    self.metrics.retries.labels(route.model).inc()
                    flight.move(other)
                    backend = other
                    continue
                return Refusal(
                    502,
                    f"no engine of model {parsed.model!r} could be reached: {e}",
                    code="engine_unreachable",
                    model=route.model,
                    replica=backend.id,
                )
            return await self._relay(backend, conn, resp, started, ticket)
        raise AssertionError("unreachable")  # the second attempt returns

    def _forwarded_head(self, req: Request) -> bytes:
        if req.repeated:  # every value of a name given more than once, in order
            pairs = [(n, v) for n, v in req.headers if n in _FORWARDED]
        else:  # the common case: a lookup a forwarded name, not a pass over every header
            first = req.first
            pairs = [(n, first[n]) for n in _FORWARDED if n in first]
        lines = [b"%s: %s\r\n" % pair for pair in pairs]
        if b"content-type" not in req.first:
            lines.append(b"content-type: application/json\r\n")
        return b"".join(lines)

    @staticmethod
    def _request(b: Backend, req: Request, head: bytes) -> bytes:
        return b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
            b.path_prefix.encode(),
            req.target,
            b.host_header,
            len(req.body),
            b.auth,
            head,
            req.body,
        )

    async def _relay(
        self,
        b: Backend,
        conn: UpstreamConnection,
        resp: Response,
        started: float,
        ticket: Ticket | None,
    ) -> Refusal | Relayed:
        series = self.metrics.replica(b.model, b.id)
        model = b.model
        relayed = False
        try:
            try:
                status, headers = await conn.response_head()
            except UpstreamFailed as e:
                # Never sent again, to this engine or another: it may have read the request.
                self._count_failure(b, str(e))
                if e.before_answer:
                    series.failed("closed_before_answer")
                return Refusal(
                    502,
                    f"engine {b.id} of model {model!r} at {b.address} failed before answering: {e}",
                    code="engine_failed",
                    kind="upstream",
                    model=model,
                    replica=b.id,
                )
            if status in _GATEWAY_FAILURES:
                self._count_failure(b, f"answered {status}")
            else:
                self.balancer.succeeded(b, time.monotonic())
            out, length = _relayed_headers(headers, b.id if self.settings.replica_header else None)
            if ticket is not None:
                out += ticket.answering(b.id)
                if ticket.rewrites:
                    length = None
            await resp.start(status, out, length)
            if not conn.has_body_ready:
                resp.flush()  # the body may take a while (a stream before its first token)
            # handed on as it arrives, from the engine connection's own callback (no task
            # woken a chunk); a ticket reads each piece on the way (and may change it)
            write = resp.write_now if ticket is None else _metered(ticket, resp.write_now)

            def first() -> None:
                took = time.monotonic() - started
                series.ttfb.observe(took)
                self.load.first_token(model, took)

            try:
                await conn.relay(write, resp.drain, first)
            except UpstreamFailed as e:
                return self._failed_mid_answer(b, status, e)
            except OverLimit:
                # a limit refuses the stream more tokens: as an engine's failure mid-answer,
                # the client's connection closes before the end
                series.failed("over_limit")
                return Relayed(status, "over_limit")
            relayed = True
            self.pool.release(conn)
            await resp.end()
            series.answered(status)
            return Relayed(status, "ok")
        except (asyncio.CancelledError, ConnectionError):
            series.failed("client_disconnect")
            raise
        finally:
            if not relayed:
                conn.abort()  # the engine sees its client leave and stops generating

    def _failed_mid_answer(self, b: Backend, status: int, e: UpstreamFailed) -> Relayed:
        """The client already has part of the answer: the only honest signal left is to
        close its connection before the answer is complete."""
        self._count_failure(b, str(e))
        self.metrics.replica(b.model, b.id).failed("upstream")
        log.warning("router: engine %s (%s) failed mid-answer: %s", b.id, b.address, e)
        return Relayed(status, "upstream")

    def _count_failure(self, b: Backend, why: str) -> None:
        if self.balancer.failed(b, time.monotonic(), why):
            self.metrics.ejections.labels(b.model, b.id).inc()  # rare: no cached series


class OverLimit(Exception):
    """A ticket ended the answer: a limit refuses the stream more tokens."""


def _metered(ticket: Ticket, write: Callable[[bytes, bool], bool]) -> Callable[[bytes, bool], bool]:
    """`write` with each piece read by `ticket` first (what it gives back is relayed)."""
    chunk = ticket.chunk

    def metered(data: bytes, last: bool) -> bool:
        relayed = chunk(data, last)
        if relayed is None:
            raise OverLimit
        return write(relayed, last)

    return metered


class Relayed:
    """An engine's answer went to the client (whole, or cut by the engine: `outcome`)."""

    __slots__ = ("status", "outcome")

    def __init__(self, status: int, outcome: str) -> None:
        self.status = status
        self.outcome = outcome  # "ok", or the error kind that cut it


def _relayed_headers(
    headers: list[tuple[bytes, bytes]], replica: str | None
) -> tuple[list[tuple[bytes, bytes]], int | None]:
    out: list[tuple[bytes, bytes]] = []
    length: int | None = None
    chunked = False
    sse = False
    for name, value in headers:
        if name == b"content-length":
            length = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            chunked = True
        elif name not in _NOT_RELAYED:
            out.append((name, value))
            if name == b"content-type" and value.startswith(b"text/event-stream"):
                sse = True
    if sse:
        # nginx in front buffers a stream unless told not to
        out.append((b"x-accel-buffering", b"no"))
    if replica is not None:
        out.append((b"x-llmgw-replica", replica.encode()))
    return out, None if chunked else length
