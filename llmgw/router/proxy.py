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
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.router.balancer import Balancer
from llmgw.router.hold import MAX_WAIT_HEADER, Holds, Refused
from llmgw.router.load import LoadCounter
from llmgw.router.metrics import CONTENT_TYPE as METRICS_TYPE
from llmgw.router.metrics import ReplicaSeries, RouterMetrics
from llmgw.router.page import FleetPage
from llmgw.router.request import BadRequest, parse
from llmgw.router.server import Request, Response
from llmgw.router.table import Backend, EndpointTable
from llmgw.router.upstream import ConnectFailed, UpstreamConnection, UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)

# path -> (chat, embeddings)
_PROXIED = {
    b"/v1/chat/completions": (True, False),
    b"/v1/completions": (False, False),
    b"/v1/embeddings": (False, True),
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
    # the fleet page at / (llmgw/router/page.py): what runs where, for whoever reaches the
    # router; off: 404
    page: bool = True


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> bytes:
    """OpenAI's error shape, which its client libraries read."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return json.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}
    ).encode()


class Proxy:
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
    ) -> None:
        self.table = table
        self.load = load or LoadCounter()
        self.holds = holds
        self.balancer = balancer
        self.pool = pool
        self.metrics = metrics
        self.settings = settings or ProxySettings()
        self._health = health
        self._page = page
        self._client_keys = {b"Bearer " + k.encode() for k in self.settings.client_api_keys}
        self._session = self.settings.session_header.lower().encode()

    async def handle(self, req: Request, resp: Response) -> None:
        route = _PROXIED.get(req.path)
        if route is not None:
            if req.method != b"POST":
                await self._fail(resp, 405, "use POST", "", kind=None)
            elif self._client_keys and req.header(b"authorization") not in self._client_keys:
                await self._fail(resp, 401, "missing or unknown API key", "", kind="unauthorized")
            else:
                await self._proxy(req, resp, *route)
        elif req.path == b"/v1/models" and req.method in (b"GET", b"HEAD"):
            if self._client_keys and req.header(b"authorization") not in self._client_keys:
                await self._fail(resp, 401, "missing or unknown API key", "", kind="unauthorized")
            else:
                await resp.send(200, self._models())
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
            if (
                self.settings.metrics == "keyed"
                and self._client_keys
                and req.header(b"authorization") not in self._client_keys
            ):
                await self._fail(resp, 401, "missing or unknown API key", "", kind="unauthorized")
            else:
                await resp.send(200, self.metrics.render(), content_type=METRICS_TYPE)
        elif (
            self._page is not None
            and req.method in (b"GET", b"HEAD")
            and self._page.serves(req.path)
        ):
            await self._page.handle(req, resp)
        else:
            await self._fail(
                resp,
                404,
                f"no route {req.method.decode(errors='replace')} {req.path.decode(errors='replace')}: "
                "this router serves POST /v1/chat/completions, /v1/completions, /v1/embeddings "
                "and GET /v1/models, /health, /metrics and the fleet page at /",
                "",
                kind=None,
            )

    def _models(self) -> bytes:
        # a cold model (autoscaled to zero, or its first replica loading) is listed too: a
        # request for it waits for a replica
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
            for name in self.table.served_names()
        ] + [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "cold": True}
            for name in self.table.cold_names()
        ]
        return json.dumps({"object": "list", "data": data}).encode()

    async def _fail(
        self,
        resp: Response,
        status: int,
        message: str,
        model: str,
        *,
        kind: str | None,
        code: str | None = None,
        param: str | None = None,
        backend: Backend | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        series = self.metrics.replica(model, backend.id if backend else "")
        if kind:
            series.failed(kind)
        series.answered(status)
        await resp.send(
            status, error_body(status, message, code=code, param=param), headers=headers
        )

    # --- proxying ---------------------------------------------------------------------------

    async def _proxy(self, req: Request, resp: Response, chat: bool, embeddings: bool) -> None:
        try:
            parsed = parse(
                req.body, chat=chat, embeddings=embeddings, session=req.header(self._session)
            )
        except BadRequest as e:
            await self._fail(resp, 400, str(e), "", kind="bad_request")
            return
        route = self.table.route(parsed.model)
        if route is None and not self.table.synced:
            await self._fail(
                resp,
                503,
                "the router has not read the fleet's state from NATS yet; try again shortly",
                "",
                kind="no_replica",
                code="not_ready",
                headers=((b"retry-after", b"2"),),
            )
            return
        if route is None:
            names = ", ".join(self.table.known_names()) or "none yet"
            await self._fail(
                resp,
                404,
                f"model {parsed.model!r} does not exist; models: {names}",
                "",
                kind="unknown_model",
                code="model_not_found",
                param="model",
            )
            return
        now = time.monotonic()
        backend = self.balancer.pick(route.backends, parsed.affinity, now)
        if backend is None and self.holds is not None and self.table.autoscaled(route.model):
            held = await self.holds.wait(
                parsed.model,
                route.model,
                req.header(MAX_WAIT_HEADER),
                lambda r: self.balancer.pick(r.backends, parsed.affinity, time.monotonic()),
            )
            if isinstance(held, Refused):
                await self._fail(
                    resp,
                    held.status,
                    held.message,
                    route.model,
                    kind="no_replica",
                    code=held.code,
                    headers=((b"retry-after", str(held.retry_after).encode()),),
                )
                return
            route, backend = held
            now = time.monotonic()
        if backend is None:
            await self._fail(
                resp,
                503,
                f"model {parsed.model!r} has no ready replica: {route.why_none}",
                route.model,
                kind="no_replica",
                code="no_ready_replica",
                headers=((b"retry-after", b"5"),),
            )
            return
        head = self._forwarded_head(req)
        for attempt in (0, 1):
            try:
                conn = await self._send(backend, req, head)
            except ConnectFailed as e:
                self._count_failure(backend, str(e))
                self.metrics.replica(route.model, backend.id).failed("connect")
                other = self.balancer.pick(route.backends, parsed.affinity, now, exclude=backend)
                if attempt == 0 and other is not None:
                    log.info("router: %s; sending the request to %s instead", e, other.id)
                    self.metrics.retries.labels(route.model).inc()
                    backend = other
                    continue
                await self._fail(
                    resp,
                    502,
                    f"no engine of model {parsed.model!r} could be reached: {e}",
                    route.model,
                    kind=None,
                    code="engine_unreachable",
                    backend=backend,
                )
                return
            break
        series = self.metrics.replica(route.model, backend.id)
        self.load.started(route.model)
        try:
            await self._relay(backend, conn, resp, series, now)
        finally:
            backend.in_flight -= 1
            series.finished()
            self.load.finished(route.model)

    def _forwarded_head(self, req: Request) -> bytes:
        lines = []
        has_type = False
        for name, value in req.headers:
            if name in _FORWARDED:
                has_type = has_type or name == b"content-type"
                lines.append(b"%s: %s\r\n" % (name, value))
        if not has_type:
            lines.append(b"content-type: application/json\r\n")
        return b"".join(lines)

    async def _send(self, b: Backend, req: Request, head: bytes) -> UpstreamConnection:
        data = b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s%s\r\n%s" % (
            b.path_prefix.encode(),
            req.target,
            b.host_header,
            len(req.body),
            b.auth,
            head,
            req.body,
        )
        series = self.metrics.replica(b.model, b.id)
        b.in_flight += 1
        series.started()
        try:
            return await self.pool.send(b.host, b.port, data, tls=b.tls)
        except BaseException:
            b.in_flight -= 1
            series.finished()
            raise

    async def _relay(
        self,
        b: Backend,
        conn: UpstreamConnection,
        resp: Response,
        series: ReplicaSeries,
        started: float,
    ) -> None:
        relayed = False
        model = series.model
        try:
            try:
                status, headers = await conn.response_head()
            except UpstreamFailed as e:
                # Never sent again, to this engine or another: it may have read the request.
                self._count_failure(b, str(e))
                if e.before_answer:
                    series.failed("closed_before_answer")
                await self._fail(
                    resp,
                    502,
                    f"engine {b.id} of model {model!r} at {b.address} failed before answering: {e}",
                    model,
                    kind="upstream",
                    code="engine_failed",
                    backend=b,
                )
                return
            if status in _GATEWAY_FAILURES:
                self._count_failure(b, f"answered {status}")
            else:
                self.balancer.succeeded(b, time.monotonic())
            out, length = _relayed_headers(headers, b.id if self.settings.replica_header else None)
            await resp.start(status, out, length)
            if not conn.has_body_ready:
                resp.flush()  # the body may take a while (a stream before its first token)
            first = True
            try:
                async for chunk in conn.body():
                    if first:
                        first = False
                        series.ttfb.observe(time.monotonic() - started)
                        self.load.first_token(model, time.monotonic() - started)
                    await resp.write(chunk)
            except UpstreamFailed as e:
                # The client already has part of the answer: the only honest signal left is to
                # close its connection before the answer is complete.
                self._count_failure(b, str(e))
                series.failed("upstream")
                log.warning("router: engine %s (%s) failed mid-answer: %s", b.id, b.address, e)
                return
            if first:
                series.ttfb.observe(time.monotonic() - started)
            relayed = True
            self.pool.release(conn)
            await resp.end()
            series.answered(status)
        except (asyncio.CancelledError, ConnectionError):
            series.failed("client_disconnect")
            raise
        finally:
            if not relayed:
                conn.abort()  # the engine sees its client leave and stops generating

    def _count_failure(self, b: Backend, why: str) -> None:
        if self.balancer.failed(b, time.monotonic(), why):
            self.metrics.ejections.labels(b.model, b.id).inc()  # rare: no cached series


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
