"""Connections from the router to engines: HTTP/1.1 keep-alive pools on asyncio protocols.

One pool per router, one list of idle connections per engine, no limit on how many are
open: every request in flight holds one, and a cap would queue requests inside the router
(a competitor's proxy lost two thirds of its throughput at 256 concurrent requests to a
default pool of 100). Idle connections are closed after `idle_timeout`, shorter than the
engines' own keep-alive (llama-server's and uvicorn's are 5 s), so the router rarely
sends on a connection the engine is closing; one the engine has closed is noticed at once
(its protocol sees the EOF) and never reused.

A connection carries one request at a time and is in one `Phase`; the next request goes
on it only once both sides are done with the last one (the answer read completely, the
engine keeping the connection), as httpcore's connection does. It is never reused after
an answer that came chunked or ended with the connection: those are streams, and
llama-server closes its connection after every stream although its headers promise
keep-alive; a new connection costs a fraction of a millisecond beside a generation.

Failures come in two kinds, because only one can be retried safely:
- `ConnectFailed`: nothing was sent (refused, unreachable, connect timeout); the proxy
  may try another engine.
- `UpstreamFailed`: the request was sent and no complete answer came back. Whether the
  engine read it cannot be known (an engine that read a request and then died looks, from
  here, exactly like one that closed a kept-alive connection just before it arrived), so
  it is never sent again: generating twice is not harmless.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import ssl
import time
from dataclasses import dataclass

import httptools


class ConnectFailed(Exception):
    """Nothing was sent to the engine: trying another one is safe."""


class UpstreamFailed(Exception):
    """The engine got the request (or may have) and did not answer it completely.
    `before_answer`: not one byte of the answer came back."""

    def __init__(self, message: str, *, before_answer: bool = False) -> None:
        super().__init__(message)
        self.before_answer = before_answer


@dataclass(frozen=True)
class UpstreamSettings:
    connect_timeout: float = 3.0
    # the longest an engine may stay silent in the middle of a request (llama-server pings
    # open streams every 30 s; its own --timeout is 600 s)
    read_timeout: float = 600.0
    idle_timeout: float = 4.0
    max_idle_per_endpoint: int = 1024
    # stop reading from an engine while this much of its answer waits for a slow client
    buffer_high: int = 256 * 1024


class Phase(enum.Enum):
    IDLE = "idle"  # nothing outstanding: new, or back in the pool
    WAITING = "waiting"  # the request is sent; its status line and headers are not back
    BODY = "body"  # the head is back; the body is arriving
    DONE = "done"  # the answer is complete
    CLOSED = "closed"  # by either side; never used again


_IDLE, _WAITING, _BODY, _DONE, _CLOSED = Phase  # (module names: read at every callback)
_ANSWERING = frozenset((_WAITING, _BODY))


class UpstreamConnection(asyncio.Protocol):
    """One connection to one engine, carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self._pool = pool
        self.key = key
        self._loop = pool.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.phase = _IDLE
        self.requests = 0  # sent on this connection so far
        self.idle_since = 0.0
        self.reused_after = 0.0  # seconds it had been idle when the current request was sent
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False  # the engine keeps the connection after this answer
        self.streamed = False  # chunked, or delimited by the connection's end
        self._ends_with_close = False
        self._chunked = False
        self._has_length = False
        self._complete = False
        self._head: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamFailed | None = None
        self._reading_paused = False
        self._got_bytes = False  # anything at all came back for this request

    # --- used by the proxy -------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self._reset()
        self.phase = _WAITING
        self.requests += 1
        self.reused_after = time.monotonic() - self.idle_since if self.idle_since else 0.0
        self._head = self._loop.create_future()
        self._transport.write(data)

    async def response_head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Status and headers (names lower-cased); raises UpstreamFailed."""
        assert self._head is not None
        if not self._head.done():
            await self._wait(self._head)
        self._head.result()
        return self.status, self.headers

    async def body(self):
        """The body as it arrives (chunked framing removed); raises UpstreamFailed."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._reading_paused and self._buffered < self._pool.settings.buffer_high // 2:
                    self._reading_paused = False
                    if self._transport is not None:
                        self._transport.resume_reading()
                yield chunk
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._wait(self._waiter)
            self._waiter = None

    @property
    def complete(self) -> bool:
        """The whole answer is here."""
        return self._complete

    @property
    def reusable(self) -> bool:
        """Both sides are done and the engine keeps the connection: it may carry another
        request (not after a stream; see the module's docstring)."""
        return self.phase is _DONE and self._complete and self.keep_alive and not self.streamed

    @property
    def has_body_ready(self) -> bool:
        """Body bytes (or its end) arrived already: reading them will not wait."""
        return bool(self._chunks) or self._complete

    def abort(self) -> None:
        """Drop the connection now (the engine sees the client leave and stops)."""
        self.phase = _CLOSED
        if self._transport is not None:
            self._transport.abort()

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment] (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        if self.phase not in _ANSWERING:
            # Bytes nobody asked for: an answer longer than it said, or an engine talking
            # out of turn. What they belong to cannot be known; the connection goes.
            self.abort()
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            self.abort()  # a second answer began after this one (on_message_begin said so)
        except httptools.HttpParserError as e:
            self._fail(UpstreamFailed(f"malformed HTTP answer from the engine: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        phase, self.phase = self.phase, _CLOSED
        self._pool.forget(self)
        if phase is _BODY and self._ends_with_close:
            self._complete = True  # an answer with neither length nor chunking ends here
            self._wake()
        elif phase is _WAITING:
            how = (
                f"request {self.requests} on a connection kept alive for {self.reused_after:.2f} s"
                if self.requests > 1
                else "a new connection"
            )
            before = not self._got_bytes
            self._fail(
                UpstreamFailed(
                    f"the engine closed the connection before answering ({exc or 'EOF'}; {how}); "
                    "it may have read the request, so it is not sent again"
                    if before
                    else f"the engine closed the connection in the middle of its head ({how})",
                    before_answer=before,
                )
            )
        elif phase is _BODY:
            self._fail(
                UpstreamFailed(
                    f"the engine closed the connection in the middle of its answer ({exc or 'EOF'})"
                )
            )

    # --- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.phase is not _WAITING:
            raise _SecondAnswer  # more than the one answer asked for: the connection goes

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"transfer-encoding":
            self._chunked = True
        elif name == b"content-length":
            self._has_length = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 1xx: informational, the real head follows
            self.headers = []
            self._chunked = self._has_length = False
            return
        self.status = status
        self.phase = _BODY
        self.keep_alive = self._parser.should_keep_alive()
        chunked = self._chunked
        # llhttp knows which answers have no body whatever their headers (204, 304)
        self._ends_with_close = not chunked and not self._has_length and status not in (204, 304)
        self.streamed = chunked or self._ends_with_close
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > self._pool.settings.buffer_high and not self._reading_paused:
            self._reading_paused = True
            if self._transport is not None:
                self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.phase is not _BODY:
            return  # the end of a 1xx
        self.phase = _DONE
        self._complete = True
        self._wake()

    # --- internals ---------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamFailed) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a caller that gave up may not be waiting
        self._wake()

    async def _wait(self, fut: asyncio.Future[None]) -> None:
        timeout = self._pool.settings.read_timeout
        timer = self._loop.call_later(timeout, self._time_out, fut, timeout)
        try:
            await fut
        finally:
            timer.cancel()

    def _time_out(self, fut: asyncio.Future[None], timeout: float) -> None:
        if not fut.done():
            self._fail(UpstreamFailed(f"the engine sent nothing for {timeout:g} s"))
            self.abort()


class _SecondAnswer(Exception):
    """Raised from a parser callback: the engine began an answer nobody asked for."""


class UpstreamPool:
    def __init__(self, settings: UpstreamSettings | None = None) -> None:
        self.settings = settings or UpstreamSettings()
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self.opened = 0  # connections made, for tests and benchmarks
        self._tls: ssl.SSLContext | None = None

    async def send(
        self, host: str, port: int, data: bytes, *, tls: bool = False
    ) -> UpstreamConnection:
        """Send one request on an idle connection or a new one; raises ConnectFailed if
        nothing could be sent."""
        key = (host, port, tls)
        conn = self._take_idle(key)
        if conn is None:
            conn = await self._connect(key)
        conn.send(data)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Give back a connection whose answer was read completely."""
        if not conn.reusable:
            conn.abort()
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.settings.max_idle_per_endpoint:
            conn.abort()
            return
        conn.phase = Phase.IDLE
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close_idle(self, older_than: float | None = None) -> None:
        """Close idle connections (all, or those idle longer than `older_than` seconds)."""
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = []
            for c in idle:
                if older_than is None or now - c.idle_since > older_than:
                    c.abort()
                else:
                    keep.append(c)
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]

    async def sweep_forever(self) -> None:
        """Close connections idle for longer than the engines keep them."""
        while True:
            await asyncio.sleep(self.settings.idle_timeout / 2)
            self.close_idle(older_than=self.settings.idle_timeout)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _take_idle(self, key: tuple[str, int, bool]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: warm, least likely to be closing
            if conn.phase is not Phase.IDLE:
                continue
            if now - conn.idle_since > self.settings.idle_timeout:
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> UpstreamConnection:
        host, port, tls = key
        try:
            async with asyncio.timeout(self.settings.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: UpstreamConnection(self, key),
                    host,
                    port,
                    ssl=self._tls_context() if tls else None,
                )
        except TimeoutError:
            raise ConnectFailed(
                f"no connection to {authority(host, port)} within {self.settings.connect_timeout:g} s"
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise ConnectFailed(
                f"cannot connect to {authority(host, port)}: {e.strerror or e}"
            ) from None
        self.opened += 1
        return conn


def authority(host: str, port: int) -> str:
    """host:port as a Host header and a URL write it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
