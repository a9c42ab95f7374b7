"""The router's HTTP/1.1 server: asyncio protocols and httptools' parser (llhttp, as in uvicorn).

Why not aiohttp's server: a proxy spends most of its time in the HTTP layer, and aiohttp's
request and response objects cost more than all of the routing. Measured here
(docs/performance.md): the same proxy logic reached about 2.9k requests/s under aiohttp's
server and client, against an engine that answers in 20 us, and much more on these
protocols. The parser is llhttp, the one Node.js uses, in its strict mode: it refuses
obs-fold, duplicate Content-Length, Content-Length beside Transfer-Encoding and bad chunk
sizes, which is what closes the doors request smuggling uses. This module keeps
connections, limits, framing and back-pressure.

What it does, and no more:
- keep-alive (HTTP/1.1, and HTTP/1.0 with `Connection: keep-alive`, answered in kind),
  pipelined requests answered in order, `Expect: 100-continue` answered when that
  request's turn comes (417 for any other expectation);
- `Upgrade` (h2c, websocket) is ignored, as RFC 9110 allows: the request is answered over
  HTTP/1.1 and the connection goes on; CONNECT is answered and the connection closed;
- limits: the request head in raw bytes while it arrives (431; httptools would otherwise
  gather one endless header value whole before calling back), header count (431), body
  size (413, refused from Content-Length before the body is read), bodies queued behind a
  busy connection (reading pauses), connections (the oldest idle one is closed to make
  room, else 503), a request head must arrive within `head_timeout` of its first byte and
  the next request within `idle_timeout` of the connection going idle, and a client that takes nothing of its answer for `send_timeout` is closed;
- responses whole (`Response.send`) or streamed (`start`/`write`/`end`), framed as RFC 9112
  says: no body and no chunking for HEAD, 1xx, 204 and 304; Content-Length held to what
  was declared (a handler writing past it is a bug: logged, counted, and the connection
  closed, never the body cut quietly to fit); chunked when the length is unknown; each `write` waits while the client's
  socket is full, so a slow reader holds back its upstream instead of filling memory;
- one `RequestCycle` per request (its head, body and answer), apart from the connection
  that owns the socket, the parser and the order of answers (uvicorn's shape);
- a client that goes away cancels its handler at once: the proxy's `finally` then closes
  the upstream connection, which is how an engine learns to stop generating;
- `HttpServer.shutdown(grace)`: stop accepting, close idle connections, let the requests
  in flight finish with `connection: close`, and cut what is left when the grace is over.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import http
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
# how long a connection closed after an error or at shutdown keeps reading (and dropping)
# what the client still sends, so that its unread bytes do not turn our FIN into a reset
# that destroys the answer it has not read yet (nginx's lingering_close)
LINGER = 2.0


@dataclass(frozen=True)
class HttpLimits:
    max_body: int = 16 * 1024 * 1024  # 413 above this (images as base64 make big chat bodies)
    max_head: int = 64 * 1024  # request line and headers together, in raw bytes; 431 above
    max_headers: int = 100
    # a complete request must arrive within this of the connection going idle; also the
    # keep-alive time, which must exceed that of any proxy in front (nginx: 60-75 s)
    idle_timeout: float = 75.0
    # from a request's first byte to the end of its head: a slow or stalled head (slowloris)
    # holds a connection no cap can take back, as it is not idle
    head_timeout: float = 10.0
    # a client that takes none of its answer for this long is closed, freeing the engine's
    # slot it holds (nginx's send_timeout is 60 s too)
    send_timeout: float = 60.0
    max_pipelined: int = 16  # requests queued on one connection before reading pauses
    max_pipelined_bytes: int = 16 * 1024 * 1024  # their bodies, together
    max_connections: int = 10_000


class Request:
    __slots__ = (
        "method",
        "target",
        "path",
        "headers",
        "first",
        "repeated",
        "body",
        "keep_alive",
        "http_11",
        "client",
    )

    def __init__(self, client: str = "") -> None:
        self.client = client  # the peer's address, host:port (the audit record's)
        self.method = b""
        self.target = b""
        self.path = b""
        self.headers: list[tuple[bytes, bytes]] = []  # names lower-cased, in order
        # each name's first value: a header is read in one lookup, not a scan of them all
        # (an SDK sends a dozen and more; each scan of them cost more than its parse)
        self.first: dict[bytes, bytes] = {}
        self.repeated = False  # some name came twice or more
        self.body = b""
        self.keep_alive = True
        self.http_11 = True

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (`name` in lower case)."""
        return self.first.get(name)


class _Refusal:
    """A request refused by the server itself (too large, malformed): answered in order,
    then the connection closes."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class BodyOverrun(Exception):
    """A handler wrote more than the Content-Length it declared: a bug. Its answer is not
    cut to fit (that would pass for complete): the connection closes instead, and the
    overrun is logged and counted."""


class RequestCycle:
    """One request on a connection (uvicorn's RequestResponseCycle): its head and body as
    they are read, whether a `100 Continue` is owed to it, and then its answer. The
    connection (HttpConnection) owns the socket, the parser and the order of answers;
    nothing of one request lives on it."""

    __slots__ = ("request", "_parts", "body_size", "head_size", "continue_owed")

    def __init__(self, client: str = "") -> None:
        self.request = Request(client)
        self._parts: list[bytes] = []
        self.body_size = 0
        self.head_size = 0  # request line and headers, as the parser hands them over
        self.continue_owed = False  # expects 100-continue, not yet sent

    def add_body(self, data: bytes) -> int:
        """A piece of the body; returns the size so far."""
        self._parts.append(data)
        self.body_size += len(data)
        return self.body_size

    def read(self) -> Request:
        """The request is read whole."""
        parts, self._parts = self._parts, []
        self.request.body = b"".join(parts) if len(parts) != 1 else parts[0]
        self.continue_owed = False  # the body came anyway
        return self.request

    async def answer(self, conn: HttpConnection, handler: Handler, error_body: ErrorBody) -> bool:
        """Run the handler for this request; True when the connection can carry another."""
        req = self.request
        resp = Response(conn, req)
        try:
            await handler(req, resp)
        except asyncio.CancelledError:
            if conn.lost:
                return False  # the client went away; nothing to answer
            raise
        except BodyOverrun:
            return False  # said and counted where it happened; closing tells the client
        except Exception as e:  # noqa: BLE001 - a bug in a handler must not take the server down
            if conn.lost and isinstance(e, ConnectionError):
                return False  # the client went away while it was being answered
            # A ConnectionError while the client is still here is a bug like any other
            # (an upstream error that escaped): it must not leave the connection mute.
            log.exception("handler failed for %s %r", req.method.decode(), req.target)
            if resp.started:
                return False  # half an answer: closing tells the client it is incomplete
            await resp.send(500, error_body(500, "internal error in the router"))
            return resp.keeps_connection
        if not resp.started:
            log.error("handler gave no answer to %s %r", req.method.decode(), req.target)
            await resp.send(500, error_body(500, "internal error in the router"))
        return resp.keeps_connection


Handler = Callable[[Request, "Response"], Awaitable[None]]
# builds the body of an error the server answers itself: (status, message) -> JSON bytes
ErrorBody = Callable[[int, str], bytes]


# How an answer's body is framed (ints, not an enum: compared on every write)
_NONE = 0  # HEAD, 1xx, 204, 304: a head and nothing after it
_LENGTH = 1  # Content-Length, held to
_CHUNKED = 2
_CLOSE = 3  # HTTP/1.0 and no length: the body ends when the connection does
# statuses whose answer ends with its head, whatever its headers say (RFC 9112 section 6.3);
# a HEAD's answer too
_NO_BODY = frozenset((*range(100, 200), 204, 304))


class Response:
    """Where a handler writes its answer: `send()` once, or `start()`, `write()`..., `end()`."""

    __slots__ = (
        "_conn",
        "_request",
        "_keep_alive",
        "_framing",
        "_remaining",
        "_head",
        "started",
        "ended",
    )

    def __init__(self, conn: HttpConnection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._keep_alive = request.keep_alive
        self._framing = _NONE
        self._remaining = 0  # of a declared length
        # the status line and headers, held back to leave in one write with the first body
        # bytes: one system call a small answer, not two
        self._head = b""
        self.started = False
        self.ended = False

    @property
    def keeps_connection(self) -> bool:
        """The connection can carry the next request: keep-alive was agreed and the answer
        was framed completely."""
        return self._keep_alive and self.ended and not self._remaining

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
        request = self._request
        keep = self._keep_alive and not self._conn.closing  # shutting down: the last answer
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
        lines += [b"%s: %s\r\n" % kv for kv in headers]
        if status in _NO_BODY or request.method == b"HEAD":
            # a HEAD or 304 may say the length a GET would have had; a 1xx or 204 never
            if length is not None and status >= 200 and status != 204:
                lines.append(b"content-length: %d\r\n" % length)
        elif length is not None:
            self._framing = _LENGTH
            self._remaining = length
            lines.append(b"content-length: %d\r\n" % length)
        elif request.http_11:
            self._framing = _CHUNKED
            lines.append(b"transfer-encoding: chunked\r\n")
        else:
            self._framing = _CLOSE
            keep = False
        if not keep:
            self._keep_alive = False
            lines.append(b"connection: close\r\n\r\n")
        elif not request.http_11:
            lines.append(b"connection: keep-alive\r\n\r\n")  # HTTP/1.0 keeps it only when told
        else:
            lines.append(b"\r\n")
        self._head = b"".join(lines)

    async def write(self, data: bytes, *, last: bool = False) -> None:
        """A piece of the body; `last`: the answer ends with it (`end` in the same write).
        Waits while the client's socket is full."""
        if not self.write_now(data, last):
            await self._conn.flow.drain()

    def write_now(self, data: bytes, last: bool = False) -> bool:
        """`write` without waiting: False while the client's socket is full (then wait for
        `drain` before writing more)."""
        framing = self._framing
        if framing == _CHUNKED:
            if data:  # (an empty chunk would end the body)
                data = b"%x\r\n%s\r\n" % (len(data), data)
            if last:
                data += b"0\r\n\r\n"
        elif framing == _LENGTH:
            if len(data) > self._remaining:
                self._overrun(len(data))
            self._remaining -= len(data)
        elif framing == _NONE:
            data = b""
        if last:
            self.ended = True
        if self._head:
            data, self._head = self._head + data, b""
        conn = self._conn
        if data:
            conn.write(data)
        return not conn.flow.write_paused

    async def drain(self) -> None:
        """Wait until the client's socket takes more (after `write_now` said False)."""
        await self._conn.flow.drain()

    async def end(self) -> None:
        """The answer is complete. Shorter than its declared length, it is not: the
        connection is then closed, which is how the client learns that."""
        if self.ended:
            return
        self.ended = True
        if self._framing == _CHUNKED:
            self._conn.write(self._head + b"0\r\n\r\n")
            self._head = b""
        elif self._head:
            self._conn.write(self._head)
            self._head = b""

    def _overrun(self, size: int) -> None:
        request = self._request
        log.error(
            "the answer to %s %r is longer than its Content-Length: %d bytes written where "
            "%d remained; its connection is closed rather than the answer cut to fit",
            request.method.decode(errors="replace"),
            request.target,
            size,
            self._remaining,
        )
        self._conn.overrun()
        self._keep_alive = False
        self.flush()  # what was declared is incomplete: the client sees it end early
        raise BodyOverrun(f"{size} bytes written where {self._remaining} remained")

    def flush(self) -> None:
        """Send the head now (a stream whose first bytes may take a while)."""
        if self._head:
            self._conn.write(self._head)
            self._head = b""


class FlowControl:
    """A connection's back-pressure, both ways (uvicorn's FlowControl): reading paused while
    too many pipelined requests wait, writing paused while the client's socket is full and
    the answer's writer waiting for it to drain, for at most `send_timeout` (then the
    connection is dropped: its handler is cancelled, and with it the engine's request).
    It holds the transport, never the connection (no cycle for the collector to find)."""

    __slots__ = (
        "_transport",
        "_loop",
        "_send_timeout",
        "_drained",
        "_send_timer",
        "_lost",
        "read_paused",
        "write_paused",
    )

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, send_timeout: float
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._send_timeout = send_timeout
        self._drained: asyncio.Future[None] | None = None  # what a paused writer awaits
        self._send_timer: asyncio.TimerHandle | None = None  # the client takes nothing
        self._lost = False
        self.read_paused = False
        self.write_paused = False

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.stop()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait while the client's socket is full; raises ConnectionResetError once the
        client is gone."""
        if self._lost:
            raise ConnectionResetError("client disconnected")
        if self.write_paused:
            if self._drained is None or self._drained.done():
                self._drained = self._loop.create_future()
            if self._send_timer is None:
                self._send_timer = self._loop.call_later(self._send_timeout, self._stuck)
            await self._drained

    def lost(self) -> None:
        """The client is gone: a writer waiting to drain learns it."""
        self._lost = True
        self.stop()
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("client disconnected"))
            self._drained.exception()  # retrieved: nobody may be waiting any more

    def stop(self) -> None:
        """No more send timeout (the client took its bytes, or the connection closes)."""
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _stuck(self) -> None:
        self._send_timer = None
        log.info(
            "closing a client that took none of its answer for %g s (send timeout)",
            self._send_timeout,
        )
        self._transport.abort()


class _Reading(enum.Enum):
    """Where the parser is in the request it reads (for the raw head count)."""

    BETWEEN = "between"  # no request begun
    HEAD = "head"  # request line and headers arriving
    BODY = "body"


_BETWEEN, _HEAD, _BODY = _Reading.BETWEEN, _Reading.HEAD, _Reading.BODY


class Deadline:
    """A connection's one clock on its client: the next request within the keep-alive time
    of going idle, a head within `head_timeout` of its first byte, a closing connection's
    linger. `timed` says which part of a request it times (BETWEEN: none, or the wait for
    the next one). Cancelled, it lets go of its callback (no cycle through the
    connection)."""

    __slots__ = ("_loop", "_handle", "_callback", "timed")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._callback: Callable[[], None] | None = None
        self.timed = _BETWEEN

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, timeout: float, callback: Callable[[], None], timed: _Reading = _BETWEEN) -> None:
        """Run `callback` in `timeout` seconds, unless cancelled or armed again first."""
        if self._handle is not None:
            self._handle.cancel()
        self._callback = callback
        self._handle = self._loop.call_later(timeout, self._expire)
        self.timed = timed

    def cancel(self) -> None:
        self.timed = _BETWEEN
        if self._handle is not None:
            self._handle.cancel()
            self._handle = self._callback = None

    def _expire(self) -> None:
        callback, self._handle, self._callback = self._callback, None, None
        self.timed = _BETWEEN
        if callback is not None:
            callback()


class HttpConnection(asyncio.Protocol):
    """One client connection: its requests are read by the parser callbacks into a queue,
    and answered in order by one task, owned by this connection for its whole life. Its
    back-pressure is its `flow` (FlowControl); each request is a RequestCycle."""

    flow: FlowControl  # from connection_made on

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._handler = server.handler
        self._limits = server.limits
        self._error_body = server.error_body
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._reading = _Reading.BETWEEN
        self._messages = 0  # requests read completely so far
        self._raw_head = 0  # raw bytes of the head being read, counted while it arrives
        self._queue: collections.deque[RequestCycle | _Refusal] = collections.deque()
        self._cycle: RequestCycle | None = None  # the request being read
        self._last: Request | None = None  # the request read last (an Upgrade names it)
        self.task: asyncio.Task[None] | None = None
        self._next: asyncio.Future[None] | None = None  # set when a request is queued
        self._busy = False  # a request is being answered
        self._deadline = Deadline(self._loop)
        self._discarding = False  # closed for reading: what arrives is dropped
        self.lost = False
        self.closing = False  # the server is shutting down: answer what is begun, then close
        self.peer = ""  # host:port of the client

    # --- the transport ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment] (uvloop's is not a subclass)
        self.flow = FlowControl(self._transport, self._loop, self._limits.send_timeout)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        if not self._server.admit(self):
            return
        self._went_idle()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        reading, messages = self._reading, self._messages
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self._upgraded(data, e.args[0] if e.args else len(data))
            return
        except httptools.HttpParserCallbackError as e:
            if isinstance(e.__context__, _Stop):
                return  # a limit was hit: the refusal is queued already
            log.exception("HTTP parser callback failed")
            self._refuse(500, "internal error while reading the request")
            return
        except httptools.HttpParserError as e:
            self._refuse(400, f"malformed HTTP request: {e}")
            return
        reading_now = self._reading
        if reading_now is _Reading.BETWEEN:
            return  # the common case: whole requests in this chunk (or none begun)
        # A request is still arriving. Its timer is armed only now, when it is known to
        # span chunks: most requests arrive in one, and a timer a request costs.
        if reading_now is not self._deadline.timed:
            self._arm_for(reading_now)
        if reading_now is _Reading.HEAD:
            # httptools hands over a header only once its value is complete, and holds it
            # meanwhile: count the head's raw bytes as they come. A head that began after
            # other bytes of this chunk is counted from the next chunk on (the callbacks
            # count its complete parts), so at most one read more than the limit is held.
            if self._messages == messages and reading is _Reading.HEAD:
                self._raw_head += len(data)
            elif self._messages == messages and reading is _Reading.BETWEEN:
                self._raw_head = len(data)
            else:
                self._raw_head = 0
            if self._raw_head > self._limits.max_head:
                self._refuse(
                    431, f"request head is over the limit of {self._limits.max_head} bytes"
                )

    def eof_received(self) -> bool | None:
        # EOF is a client gone, not a half-close (HTTP clients do not half-close, and one
        # that closed while its request was being generated must cancel it): close.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timers()
        self._server.forget(self)
        if self.task is not None:
            self.task.cancel()  # the client is gone: stop the upstream work at once
        self.flow.lost()
        # The parser holds this connection's callbacks: a cycle that only the collector
        # would free, and its full passes over thousands of dead connections stalled the
        # loop for tens of milliseconds under load. Dropped, the connection goes at once.
        self._parser = None

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.lost:
            self._transport.write(data)

    def overrun(self) -> None:
        """A handler wrote past its answer's declared length (Response.write says so)."""
        self._server.overruns += 1
        self._server.on_overrun()

    @property
    def idle(self) -> bool:
        """Between requests: nothing being answered, queued or read."""
        return not self._busy and not self._queue and self._reading is _Reading.BETWEEN

    # --- parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._server.busy(self)
        self._reading = _HEAD
        self._cycle = RequestCycle(self.peer)

    def on_url(self, url: bytes) -> None:
        assert self._cycle is not None
        self._cycle.request.target += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        cycle = self._cycle
        assert cycle is not None
        # _count_head, inline: called for every header of every request
        cycle.head_size += len(name) + len(value)
        if cycle.head_size > self._limits.max_head:
            self._count_head(0)  # says which limit, and stops
        request = cycle.request
        if len(request.headers) >= self._limits.max_headers:
            self._stop(431, f"more than {self._limits.max_headers} headers")
        name = name.lower()
        request.headers.append((name, value))
        first = request.first  # (inline: called for every header of every request)
        if name in first:
            request.repeated = True
        else:
            first[name] = value

    def on_headers_complete(self) -> None:
        cycle = self._cycle
        assert cycle is not None
        req = cycle.request
        self._reading = _BODY
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
        expect = req.header(b"expect")
        if expect is not None and req.http_11:  # HTTP/1.0 has no expectations (RFC 9110)
            if expect.lower() != b"100-continue":
                self._stop(417, "the only expectation this server meets is 100-continue")
            if not self._busy and not self._queue:
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                cycle.continue_owed = True  # after the answers before it, not inside them

    def on_body(self, body: bytes) -> None:
        assert self._cycle is not None
        if self._cycle.add_body(body) > self._limits.max_body:
            self._stop(413, f"request body is over the limit of {self._limits.max_body} bytes")

    def on_message_complete(self) -> None:
        cycle = self._cycle
        assert cycle is not None
        self._cycle = None
        self._last = cycle.read()
        self._reading = _BETWEEN
        self._messages += 1
        self._enqueue(cycle)

    # --- requests in order -----------------------------------------------------------------

    def _upgraded(self, data: bytes, offset: int) -> None:
        """llhttp stops after a request asking for a protocol upgrade (read whole and
        queued already). CONNECT turns the rest of the connection into a tunnel, which
        this server never opens: answered, then closed. Any other Upgrade is ignored
        (RFC 9110 section 7.8) and reading goes on with a fresh parser."""
        req = self._last
        if req is None or req.method == b"CONNECT":
            if req is not None:
                req.keep_alive = False
            self._discarding = True
            return
        self._parser = httptools.HttpRequestParser(self)
        if offset < len(data):
            self.data_received(data[offset:])

    def _count_head(self, n: int) -> None:
        cycle = self._cycle
        assert cycle is not None
        cycle.head_size += n
        if cycle.head_size > self._limits.max_head:
            limit = self._limits.max_head
            if not cycle.request.headers:
                self._stop(414, f"request target is over the limit of {limit} bytes")
            self._stop(431, f"request head is over the limit of {limit} bytes")

    def _stop(self, status: int, message: str) -> None:
        self._refuse(status, message)
        raise _Stop

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` after the requests before it, then close: what follows on this
        connection cannot be trusted to be framed right."""
        self._discarding = True
        self._cycle = None
        self._reading = _Reading.BETWEEN
        self._enqueue(_Refusal(status, self._error_body(status, message)))

    def _enqueue(self, item: RequestCycle | _Refusal) -> None:
        self._deadline.cancel()
        queue = self._queue
        queue.append(item)
        if len(queue) > 1 and not self.flow.read_paused and self._pipelined_too_much():
            self.flow.pause_reading()
        if self.task is None:
            # one task a connection, for its whole life (a task a request costs more)
            self.task = self._loop.create_task(self._answer_queue())
        elif self._next is not None and not self._next.done():
            self._next.set_result(None)

    def _pipelined_too_much(self, fraction: int = 1) -> bool:
        """More requests (or bytes of their bodies) queued than a connection may hold, or
        than `1/fraction` of that. Only pipelining clients queue: counted only then."""
        limits, queue = self._limits, self._queue
        if len(queue) > limits.max_pipelined // fraction:
            return True
        queued = sum(c.body_size for c in queue if isinstance(c, RequestCycle))
        return queued > limits.max_pipelined_bytes // fraction

    async def _answer_queue(self) -> None:
        try:
            while not self.lost:
                queue = self._queue
                if not queue:
                    self._busy = False
                    between = self._reading is _BETWEEN
                    if self.closing and between:
                        self._linger_close()
                        return
                    cycle = self._cycle
                    if cycle is not None and cycle.continue_owed:
                        cycle.continue_owed = False
                        self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    if between:
                        self._went_idle()
                    elif not self._deadline.armed:
                        # a pipelined request half here: its time runs from now on
                        self._arm_for(self._reading)
                    self._next = self._loop.create_future()
                    await self._next
                    continue
                self._busy = True
                item = queue.popleft()
                if self.flow.read_paused and not self._pipelined_too_much(fraction=2):
                    self.flow.resume_reading()
                if isinstance(item, _Refusal):
                    self.write(
                        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                        % (item.status, _REASONS.get(item.status, b""), len(item.body), item.body)
                    )
                    self._linger_close()
                    return
                keep = await item.answer(self, self._handler, self._error_body)
                if not keep or self.closing:
                    self._linger_close()
                    return
        except asyncio.CancelledError:
            if not self.lost:
                raise  # the server is stopping; a lost client is simply done
        finally:
            self._busy = False

    # --- closing ---------------------------------------------------------------------------

    def shut_down(self) -> None:
        """The server is stopping: an idle connection closes now; a busy one ends its
        current answer with `connection: close` (if not begun) and then closes."""
        self.closing = True
        if self.idle:
            self._linger_close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def abort_after_write(self) -> None:
        """Refused before its first request: what was written leaves, then it closes."""
        self._linger_close()

    def _linger_close(self) -> None:
        """Close after what was written has left: send FIN, drop what the client still
        sends for up to LINGER seconds, then close (an abrupt close with unread bytes makes
        the kernel reset the connection, and the client may lose the answer it was sent)."""
        self._discarding = True
        self._cancel_timers()
        t = self._transport
        if t is None or t.is_closing():
            return
        self.flow.resume_reading()
        try:
            if t.can_write_eof():
                t.write_eof()
            else:
                t.close()
                return
        except OSError:
            t.close()
            return
        self._deadline.arm(LINGER, t.close)

    def _went_idle(self) -> None:
        """Close the connection unless a whole request is queued within the keep-alive time."""
        self._server.went_idle(self)
        self._deadline.arm(self._limits.idle_timeout, self._idle_timed_out)

    def _arm_for(self, reading: _Reading) -> None:
        """Time the request now arriving: its head, or its body (within the keep-alive time)."""
        limits = self._limits
        timeout = limits.head_timeout if reading is _Reading.HEAD else limits.idle_timeout
        self._deadline.arm(timeout, self._idle_timed_out, reading)

    def _cancel_timers(self) -> None:
        self._deadline.cancel()
        self.flow.stop()

    def _idle_timed_out(self) -> None:
        if not self._busy and not self._queue and self._transport is not None:
            self._transport.close()  # silent, or too slow to send a whole request


class _Stop(Exception):
    """Raised from a parser callback to stop reading a request that broke a limit."""


class HttpServer:
    """The listening socket and every connection it accepted: what `shutdown` drains."""

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits,
        error_body: ErrorBody,
        on_overrun: Callable[[], None] = lambda: None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.error_body = error_body
        # an answer written past its declared length (a handler's bug): counted here, and
        # told to the caller (the router's metric)
        self.overruns = 0
        self.on_overrun = on_overrun
        self.connections: set[HttpConnection] = set()
        self._idle: dict[HttpConnection, None] = {}  # in the order they went idle
        self._server: asyncio.AbstractServer | None = None
        self._emptied: asyncio.Event | None = None
        self.refused = 0  # connections refused for want of room (for tests and metrics)
        self.closing = False

    async def listen(self, host: str, port: int, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), host, port, backlog=backlog, reuse_address=True
        )

    @property
    def sockets(self):
        assert self._server is not None
        return self._server.sockets

    # --- what connections tell it -----------------------------------------------------------

    def admit(self, conn: HttpConnection) -> bool:
        if self.closing:
            conn.abort()  # accepted just before the listener closed
            return False
        if len(self.connections) >= self.limits.max_connections:
            if self._idle:
                oldest = next(iter(self._idle))
                self._idle.pop(oldest)
                oldest.abort()  # a kept-alive connection doing nothing makes room
                self.connections.discard(oldest)
            else:
                self.refused += 1
                conn.write(_too_many(self.error_body, self.limits.max_connections))
                conn.abort_after_write()
                return False
        self.connections.add(conn)
        return True

    def went_idle(self, conn: HttpConnection) -> None:
        self._idle[conn] = None  # (only admitted connections get here)

    def busy(self, conn: HttpConnection) -> None:
        self._idle.pop(conn, None)

    def forget(self, conn: HttpConnection) -> None:
        self.connections.discard(conn)
        self._idle.pop(conn, None)
        if self._emptied is not None and not self.connections:
            self._emptied.set()

    # --- stopping ------------------------------------------------------------------------------

    async def shutdown(self, grace: float) -> int:
        """Stop accepting, close idle connections, let every request in flight finish for
        up to `grace` seconds, then cut what is left. Returns how many connections were
        still busy (their answers cut short) when the grace ran out."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        self._emptied = asyncio.Event()
        for conn in list(self.connections):
            conn.shut_down()
        if self.connections:
            try:
                async with asyncio.timeout(grace):
                    await self._emptied.wait()
            except TimeoutError:
                pass
        cut = len(self.connections)
        await self.aclose()
        return cut

    async def aclose(self) -> None:
        """Close everything now, and wait for the connections' tasks to finish their
        clean-up (the proxy closes its engine connections there)."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            conn.abort()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        """Stop listening and drop every connection, without waiting."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()


def _too_many(error_body: ErrorBody, limit: int) -> bytes:
    body = error_body(
        503,
        f"this router holds {limit} connections, all busy; retry shortly, or raise "
        "--max-connections (each takes a file descriptor)",
    )
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: HttpLimits | None = None,
    error_body: ErrorBody,
    backlog: int = 4096,
    on_overrun: Callable[[], None] = lambda: None,
) -> HttpServer:
    """Start listening; the caller shuts the returned server down (or closes it)."""
    server = HttpServer(handler, limits or HttpLimits(), error_body, on_overrun)
    await server.listen(host, port, backlog)
    return server
