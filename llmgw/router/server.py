"""The router's HTTP/1.1 server: asyncio protocols and httptools' parser (llhttp, as in uvicorn).

Why not aiohttp's server: a proxy spends most of its time in the HTTP layer, and aiohttp's
request and response objects cost more than all of the routing. Measured here
(docs/performance.md): the same proxy logic reached about 2.9k requests/s under aiohttp's
server and client, against an engine that answers in 20 us, and much more on these
protocols. The parser is llhttp, the one Node.js uses; this module only keeps connections,
limits and back-pressure.

What it does, and no more:
- keep-alive (HTTP/1.1, and HTTP/1.0 with `Connection: keep-alive`), pipelined requests
  answered in order, `Expect: 100-continue`;
- limits: request head size and header count (431), body size (413, refused from
  Content-Length before the body is read), a request must arrive complete within
  `idle_timeout` of the connection going idle (slow or silent clients are closed);
- responses either whole (`Response.send`) or streamed (`start`/`write`/`end`, chunked
  when the length is unknown), each `write` waiting while the client's socket is full, so
  a slow reader holds back its upstream instead of filling memory;
- a client that goes away cancels its handler at once: the proxy's `finally` then closes
  the upstream connection, which is how an engine learns to stop generating.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


@dataclass(frozen=True)
class HttpLimits:
    max_body: int = 16 * 1024 * 1024  # 413 above this (images as base64 make big chat bodies)
    max_head: int = 64 * 1024  # request line and headers together; 431 above
    max_headers: int = 100
    # a complete request must arrive within this of the connection going idle; also the
    # keep-alive time, which must exceed that of any proxy in front (nginx: 60-75 s)
    idle_timeout: float = 75.0
    max_pipelined: int = 16  # requests queued on one connection before reading pauses


class Request:
    __slots__ = ("method", "target", "path", "headers", "body", "keep_alive", "http_11")

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.path = b""
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased
        self.body = b""
        self.keep_alive = True
        self.http_11 = True

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (`name` in lower case)."""
        for k, v in self.headers:
            if k == name:
                return v
        return None


class _Refusal:
    """A request refused by the server itself (too large, malformed): answered in order,
    then the connection closes."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


Handler = Callable[[Request, "Response"], Awaitable[None]]
# builds the body of an error the server answers itself: (status, message) -> JSON bytes
ErrorBody = Callable[[int, str], bytes]


class Response:
    """Where a handler writes its answer: `send()` once, or `start()`, `write()`..., `end()`."""

    __slots__ = ("_proto", "_head_only", "_chunked", "_close", "_head", "started", "ended")

    def __init__(self, proto: HttpServerProtocol, request: Request) -> None:
        self._proto = proto
        self._head_only = request.method == b"HEAD"
        self._chunked = False
        # the status line and headers, held back to leave in one write with the first body
        # bytes: one system call a small answer, not two
        self._head = b""
        # a streamed answer of unknown length to an HTTP/1.0 client ends by closing
        self._close = not request.keep_alive
        self.started = False
        self.ended = False

    @property
    def keeps_connection(self) -> bool:
        return not self._close

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        await self.start(status, ((b"content-type", content_type), *headers), len(body))
        if body:
            await self.write(body)
        await self.end()

    async def start(
        self,
        status: int,
        headers: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]],
        length: int | None,
    ) -> None:
        """Send the status line and headers. `length` None streams the body (chunked)."""
        assert not self.started, "response already started"
        self.started = True
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in headers]
        if length is not None:
            lines.append(b"content-length: %d\r\n" % length)
        elif self._proto.request_http_11:
            self._chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        else:
            self._close = True
        if self._close:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        self._head = b"".join(lines)

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        proto = self._proto
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        if self._head:
            data, self._head = self._head + data, b""
        proto.write(data)
        if proto.write_paused:
            await proto.drain()

    async def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        tail = b"0\r\n\r\n" if self._chunked and not self._head_only else b""
        if self._head or tail:
            self._proto.write(self._head + tail)
            self._head = b""

    def flush(self) -> None:
        """Send the head now (a stream whose first bytes may take a while)."""
        if self._head:
            self._proto.write(self._head)
            self._head = b""


class HttpServerProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, handler: Handler, limits: HttpLimits, error_body: ErrorBody) -> None:
        self._handler = handler
        self._limits = limits
        self._error_body = error_body
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[Request | _Refusal] = collections.deque()
        self._req: Request | None = None
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_size = 0
        self._task: asyncio.Task[None] | None = None
        self._next: asyncio.Future[None] | None = None  # set when a request is queued
        self._busy = False  # a request is being answered
        self._idle: asyncio.TimerHandle | None = None
        self._stopped_reading = False
        self._read_paused = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self.lost = False
        self.request_http_11 = True

    # --- the transport ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment] (uvloop's is not a subclass)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._stopped_reading:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(501, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Stop):
                return  # a limit was hit: the refusal is queued already
            log.exception("HTTP parser callback failed")
            self._refuse(500, "internal error while reading the request")
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")

    def eof_received(self) -> bool | None:
        # EOF is a client gone, not a half-close (HTTP clients do not half-close, and one
        # that closed while its request was being generated must cancel it): close.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_idle()
        if self._task is not None:
            self._task.cancel()  # the client is gone: stop the upstream work at once
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("client disconnected"))
            self._drain.exception()  # retrieved: nobody may be waiting any more

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("client disconnected")
        if self.write_paused:
            if self._drain is None or self._drain.done():
                self._drain = self._loop.create_future()
            await self._drain

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.lost:
            self._transport.write(data)

    # --- parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._req = Request()
        self._body = []
        self._body_size = 0
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        assert self._req is not None
        self._req.target += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self._req is not None
        self._count_head(len(name) + len(value))
        if len(self._req.headers) >= self._limits.max_headers:
            self._stop(431, f"more than {self._limits.max_headers} headers")
        self._req.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        req = self._req
        assert req is not None
        req.method = self._parser.get_method()
        req.path = req.target.split(b"?", 1)[0]
        req.keep_alive = self._parser.should_keep_alive()
        req.http_11 = self._parser.get_http_version() == "1.1"
        length = req.header(b"content-length")
        if length is not None and length.isdigit() and int(length) > self._limits.max_body:
            self._stop(
                413,
                f"request body of {int(length)} bytes is over the limit of {self._limits.max_body}",
            )
        if (req.header(b"expect") or b"").lower() == b"100-continue" and req.http_11:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._limits.max_body:
            self._stop(413, f"request body is over the limit of {self._limits.max_body} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        req = self._req
        assert req is not None
        self._req = None
        req.body = b"".join(self._body) if len(self._body) != 1 else self._body[0]
        self._body = []
        self._enqueue(req)

    # --- requests in order -----------------------------------------------------------------

    def _count_head(self, n: int) -> None:
        self._head_size += n
        if self._head_size > self._limits.max_head:
            self._stop(431, f"request head is over the limit of {self._limits.max_head} bytes")

    def _stop(self, status: int, message: str) -> None:
        self._refuse(status, message)
        raise _Stop

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` after the requests before it, then close: what follows on this
        connection cannot be trusted to be framed right."""
        self._stopped_reading = True
        self._req = None
        self._enqueue(_Refusal(status, self._error_body(status, message)))

    def _enqueue(self, item: Request | _Refusal) -> None:
        self._cancel_idle()
        self._queue.append(item)
        if len(self._queue) > self._limits.max_pipelined and not self._read_paused:
            self._read_paused = True
            assert self._transport is not None
            self._transport.pause_reading()
        if self._task is None:
            # one task a connection, for its whole life (a task a request costs more)
            self._task = self._loop.create_task(self._answer_queue())
        elif self._next is not None and not self._next.done():
            self._next.set_result(None)

    async def _answer_queue(self) -> None:
        try:
            while not self.lost:
                if not self._queue:
                    self._busy = False
                    self._arm_idle()
                    self._next = self._loop.create_future()
                    await self._next
                    continue
                self._busy = True
                item = self._queue.popleft()
                if self._read_paused and len(self._queue) <= self._limits.max_pipelined // 2:
                    self._read_paused = False
                    assert self._transport is not None
                    self._transport.resume_reading()
                if isinstance(item, _Refusal):
                    self.request_http_11 = True
                    self.write(
                        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                        % (item.status, _REASONS.get(item.status, b""), len(item.body), item.body)
                    )
                    self._close()
                    return
                if not await self._answer(item):
                    self._close()
                    return
        except asyncio.CancelledError:
            if not self.lost:
                raise  # the server is stopping; a lost client is simply done
        finally:
            self._busy = False

    async def _answer(self, req: Request) -> bool:
        """Run the handler for one request; True when the connection can carry another."""
        self.request_http_11 = req.http_11
        resp = Response(self, req)
        try:
            await self._handler(req, resp)
        except (asyncio.CancelledError, ConnectionError):
            if self.lost:
                return False  # the client went away; nothing to answer
            raise
        except Exception:  # noqa: BLE001 - a bug in a handler must not take the server down
            log.exception("handler failed for %s %r", req.method.decode(), req.target)
            if resp.started:
                return False  # half an answer: closing tells the client it is incomplete
            await resp.send(500, self._error_body(500, "internal error in the router"))
            return resp.keeps_connection
        if not resp.started:
            log.error("handler gave no answer to %s %r", req.method.decode(), req.target)
            await resp.send(500, self._error_body(500, "internal error in the router"))
        elif not resp.ended:
            return False
        return resp.keeps_connection

    def _close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _arm_idle(self) -> None:
        self._cancel_idle()
        self._idle = self._loop.call_later(self._limits.idle_timeout, self._on_idle)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _on_idle(self) -> None:
        self._idle = None
        if not self._busy and not self._queue:
            self._close()  # silent, or too slow to send a whole request


class _Stop(Exception):
    """Raised from a parser callback to stop reading a request that broke a limit."""


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: HttpLimits | None = None,
    error_body: ErrorBody,
    backlog: int = 4096,
) -> asyncio.Server:
    """Start listening; the caller closes the returned server."""
    lim = limits or HttpLimits()
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: HttpServerProtocol(handler, lim, error_body),
        host,
        port,
        backlog=backlog,
        reuse_address=True,
    )
