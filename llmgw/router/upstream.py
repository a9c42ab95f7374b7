"""Connections from the router to engines: HTTP/1.1 keep-alive pools on asyncio protocols.

One pool per router, one list of idle connections per engine, no limit on how many are
open: every request in flight holds one, and a cap would queue requests inside the router
(a competitor's proxy lost two thirds of its throughput at 256 concurrent requests to a
default pool of 100). Idle connections are closed after `idle_timeout`, shorter than the
engines' own keep-alive (llama-server's and uvicorn's are 5 s), so the router rarely
sends on a connection the engine is closing; one the engine has closed is noticed at once
(its protocol sees the EOF) and never reused.

Failures come in two kinds, because only one can be retried safely:
- `ConnectFailed`: nothing was sent (refused, unreachable, connect timeout); the proxy
  may try another engine.
- `UpstreamFailed`: the request was sent and no complete answer came back; the engine may
  have started generating, so it is never sent again.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from dataclasses import dataclass

import httptools


class ConnectFailed(Exception):
    """Nothing was sent to the engine: trying another one is safe."""


class UpstreamFailed(Exception):
    """The engine got the request (or part of it) and did not answer it completely."""


class ClosedWhileIdle(UpstreamFailed):
    """A kept-alive connection the engine had already closed: not one byte came back, so
    the engine never read the request (Go's net/http retries these for the same reason).
    llama-server closes its connection right after every streamed answer, without saying
    so in its headers; the next request on it meets only the EOF."""


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


class UpstreamConnection(asyncio.Protocol):
    """One connection to one engine, carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self._pool = pool
        self.key = key
        self._loop = pool.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.chunked = False
        self.previous_chunked = False  # the answer before the current request was chunked
        self.idle_since = 0.0
        self.requests = 0  # sent on this connection so far
        self.sent = b""
        self.reused_after = 0.0  # seconds it had been idle when the current request was sent
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self._head: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self._length_known = False
        self._reading_paused = False
        self._got_bytes = False  # anything at all came back for this request
        self.chunked = False  # the answer came chunked (a stream)

    # --- used by the proxy -------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self._transport is not None
        self.previous_chunked = self.chunked
        self._reset()
        self.sent = data  # kept until the engine answers: sent again if it never read it
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
            if self._done:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._wait(self._waiter)
            self._waiter = None

    @property
    def complete(self) -> bool:
        return self._done

    @property
    def has_body_ready(self) -> bool:
        """Body bytes (or its end) arrived already: reading them will not wait."""
        return bool(self._chunks) or self._done

    def abort(self) -> None:
        """Drop the connection now (the engine sees the client leave and stops)."""
        self.closed = True
        if self._transport is not None:
            self._transport.abort()

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment] (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self.sent = b""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamFailed(f"malformed HTTP answer from the engine: {e}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._done:
            return
        if self._head is not None and self._head.done() and not self._length_known:
            # an answer with neither length nor chunking ends when the connection does
            self._done = True
            self._wake()
            return
        if self.requests > 1 and not self._got_bytes:
            self._pool.closes_after(self)
            self._fail(
                ClosedWhileIdle(
                    f"the engine had closed the kept-alive connection (request {self.requests} "
                    f"on it, after {self.reused_after:.2f} s idle)"
                )
            )
            return
        how = f"request {self.requests} on this connection" if self.requests > 1 else "new"
        self._fail(UpstreamFailed(f"the engine closed the connection ({exc or 'EOF'}; {how})"))

    # --- parser callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self._length_known = True
            self.chunked = self.chunked or name == b"transfer-encoding"
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # 1xx: informational, the real head follows
            self.headers = []
            return
        self.keep_alive = self._parser.should_keep_alive()
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
        if self.status < 200:
            return
        self._done = True
        self._wake()

    # --- internals ---------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
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


class UpstreamPool:
    def __init__(self, settings: UpstreamSettings | None = None) -> None:
        self.settings = settings or UpstreamSettings()
        self.loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}
        self.opened = 0  # connections made, for tests and benchmarks
        # engines seen closing their connection after a chunked answer (llama-server):
        # their connections are not kept after one
        self._no_reuse_after_chunked: set[tuple[str, int, bool]] = set()
        self._tls: ssl.SSLContext | None = None

    async def send(
        self, host: str, port: int, data: bytes, *, tls: bool = False, fresh: bool = False
    ) -> UpstreamConnection:
        """Send one request on an idle connection (unless `fresh`) or a new one; raises
        ConnectFailed if nothing could be sent."""
        key = (host, port, tls)
        conn = None if fresh else self._take_idle(key)
        if conn is None:
            conn = await self._connect(key)
        conn.send(data)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Give back a connection whose answer was read completely."""
        if conn.closed or not conn.complete or not conn.keep_alive:
            conn.abort()
            return
        if conn.chunked and conn.key in self._no_reuse_after_chunked:
            conn.abort()
            return
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.settings.max_idle_per_endpoint:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def closes_after(self, conn: UpstreamConnection) -> None:
        """`conn` was closed by its engine while idle: if its last answer was chunked,
        this engine closes after chunked answers, and its connections are not kept after
        one any more."""
        if conn.previous_chunked and conn.key not in self._no_reuse_after_chunked:
            self._no_reuse_after_chunked.add(conn.key)

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
            if conn.closed:
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
                f"no connection to {host}:{port} within {self.settings.connect_timeout:g} s"
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        self.opened += 1
        return conn
