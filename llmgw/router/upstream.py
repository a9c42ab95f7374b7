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
engine keeping the connection), as httpcore's connection does.

After a stream (a chunked answer) the engine may not keep it: llama-server closes its
connection after every stream although its headers promise keep-alive, while vLLM's
uvicorn keeps it. A request sent on a connection the engine is closing is lost and cannot
be sent again (below), so a connection that carried a stream *settles* first: it may
carry another request only once it stayed open `stream_settle` seconds after the stream's
last chunk. An engine seen closing a connection after a stream (while it settles, idle
later, or with a request on it) is remembered, and no connection that carried a stream
to it is kept again. Against llama-server the router thus opens a connection a stream,
as it must; against an engine that keeps them, streams reuse them as whole answers do.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools

Key = tuple[str, int, bool]  # an engine's endpoint: host, port, TLS
# engines remembered as closing their connections after streams (the oldest forgotten first)
MAX_REMEMBERED = 4096


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
    # how long a connection must stay open after a stream's last chunk before it carries
    # another request (an engine that closes after streams does so at once: llama-server
    # closes it right after that chunk)
    stream_settle: float = 0.25
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

    def __init__(self, pool: UpstreamPool, key: Key) -> None:
        self._pool = pool
        self.key = key
        self._loop = pool.loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.phase = _IDLE
        self.requests = 0  # sent on this connection so far
        self.idle_since = 0.0
        self.reused_after = 0.0  # seconds it had been idle when the current request was sent
        # the answer before the current request was a stream (a close then is the engine's
        # way with streams, not a keep-alive timeout)
        self.after_stream = False
        self._timer: asyncio.TimerHandle | None = None  # the engine's silence, timed
        self._heard = 0.0  # loop time of the last bytes from the engine (or of the send)
        # the transport's reading is paused: the connection's state, which outlives a
        # request; only `_steer_reading` changes it
        self._reading_paused = False
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
        self._got_bytes = False  # anything at all came back for this request
        # relay(): where the body goes from data_received, and what happened there
        self._sink: Callable[[bytes, bool], bool] | None = None
        self._first: Callable[[], None] | None = None
        self._delivered = False  # the whole body was handed on
        self._client_full = False  # the sink's client takes no more for now
        self._sink_error: BaseException | None = None

    # --- used by the proxy -------------------------------------------------------------

    def send(self, data: bytes) -> None:
        self.after_stream = self.streamed
        self._reset()
        if self._reading_paused:  # (nothing held back for a new request: read)
            self._steer_reading()
        self.phase = _WAITING
        self.requests += 1
        self.reused_after = time.monotonic() - self.idle_since if self.idle_since else 0.0
        self._head = self._loop.create_future()
        # one timer a request, not one a wait: it fires after `read_timeout` and looks how
        # long the engine has really been silent (data_received notes when it last spoke)
        timeout = self._pool.settings.read_timeout
        self._heard = self._loop.time()
        self._timer = self._loop.call_later(timeout, self._silence, timeout)
        self._transport.write(data)

    async def response_head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Status and headers (names lower-cased); raises UpstreamFailed."""
        assert self._head is not None
        if not self._head.done():
            await self._head
        self._head.result()
        return self.status, self.headers

    async def body(self):
        """The body as it arrives (chunked framing removed): all that is here at each turn
        in one piece (what one read from the engine brought is one write to the client, not
        one a chunk); raises UpstreamFailed."""
        chunks = self._chunks
        while True:
            if chunks:
                chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._reading_paused:
                    self._steer_reading()
                yield chunk
                continue
            if self._complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
            self._waiter = None

    async def relay(
        self,
        write: Callable[[bytes, bool], bool],
        drain: Callable[[], Awaitable[None]],
        first: Callable[[], None],
    ) -> None:
        """Hand the body on to `write(data, last)` as it arrives, from this protocol's own
        callback: what one read from the engine brought in one call, and no task woken for
        it (the caller waits here for the end). `write` returns False while its client
        takes no more: reading from the engine pauses until `drain()` returns. `first()` is
        called before the first bytes are handed on. Raises UpstreamFailed, or what `write`
        raised. Whatever paused reading (this, or the answer piling up past `buffer_high`
        before the relay began), it resumes once nothing holds it (`_steer_reading`)."""
        self._first = first
        try:
            while not self._delivered:
                if self._sink_error is not None:
                    raise self._sink_error
                if self._client_full:
                    await drain()
                    self._client_full = False
                    self._steer_reading()
                    continue
                if self._chunks or self._complete:
                    self._hand_on(write)
                    continue
                if self._error is not None:
                    raise self._error
                self._sink = write
                self._waiter = self._loop.create_future()
                await self._waiter
        finally:
            self._sink = self._first = self._waiter = None

    def _hand_on(self, write: Callable[[bytes, bool], bool]) -> None:
        """What is here goes to `write`; reading pauses if its client takes no more."""
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._first is not None:
            first, self._first = self._first, None
            first()
        last = self._complete
        more = write(data, last)
        self._delivered = last  # (not when `write` raised: relay() raises it)
        if not more and not last:
            self._client_full = True
            self._steer_reading()
        elif self._reading_paused:
            self._steer_reading()  # paused past the mark before the relay began: room now

    @property
    def complete(self) -> bool:
        """The whole answer is here."""
        return self._complete

    @property
    def reusable(self) -> bool:
        """Both sides are done and the engine keeps the connection: it may carry another
        request (after a stream, once it settled; see the module's docstring)."""
        return (
            self.phase is _DONE and self._complete and self.keep_alive and not self._ends_with_close
        )

    @property
    def has_body_ready(self) -> bool:
        """Body bytes (or its end) arrived already: reading them will not wait."""
        return bool(self._chunks) or self._complete

    def abort(self) -> None:
        """Drop the connection now (the engine sees the client leave and stops)."""
        self.phase = _CLOSED
        self._stop_timer()
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
        self._heard = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            self.abort()  # a second answer began after this one (on_message_begin said so)
        except httptools.HttpParserError as e:
            self._fail(UpstreamFailed(f"malformed HTTP answer from the engine: {e}"))
            self.abort()
            return
        sink = self._sink
        if sink is not None and (self._chunks or self._complete):
            # relay(): handed on here, the relaying task woken only at the end, when the
            # client is full, or on an error
            try:
                self._hand_on(sink)
            except Exception as e:  # noqa: BLE001 - raised in the relaying task, not here
                self._sink_error = e
            if self._delivered or self._client_full or self._sink_error is not None:
                self._sink = None
                self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        phase, self.phase = self.phase, _CLOSED
        self._stop_timer()
        self._parser = None  # (it holds this protocol's callbacks: a cycle; see server.py)
        # closed by the engine (the router's own closes set the phase first)
        if phase is _IDLE:
            self._pool.forget(self)  # in the pool, settling or idle
            if self.streamed:
                self._pool.closes_after_streams(self.key)
        elif phase is _WAITING and self.after_stream and not self._got_bytes:
            self._pool.closes_after_streams(self.key)
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
            self._steer_reading()
        if self._sink is None:
            self._wake()  # (relay() hands the body on after the read, not a chunk at a time)

    def on_message_complete(self) -> None:
        if self.phase is not _BODY:
            return  # the end of a 1xx
        self.phase = _DONE
        self._complete = True
        self._stop_timer()
        if self._sink is None:
            self._wake()

    # --- internals ---------------------------------------------------------------------------

    def _steer_reading(self) -> None:
        """The one rule for reading from the engine: paused while more than `buffer_high` of
        its answer waits here for the relay, or while the client takes no more; read again
        as soon as neither holds, in whichever order they came (called where either
        changes). A pause that only a drain undid outlived answers that passed the mark
        before the relay began: they stalled, and so did the next request on the connection."""
        hold = self._client_full or self._buffered > self._pool.settings.buffer_high
        if hold is self._reading_paused:
            return
        self._reading_paused = hold
        transport = self._transport
        if transport is None:
            return
        if hold:
            transport.pause_reading()
        else:
            self._heard = self._loop.time()  # its silence is timed from now
            transport.resume_reading()

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

    def _silence(self, timeout: float) -> None:
        self._timer = None
        if self.phase not in _ANSWERING:
            return
        silent = self._loop.time() - self._heard
        if silent < timeout or self._reading_paused:
            # it spoke since (or the router holds it back for a slow client): time on
            wait = timeout if self._reading_paused else timeout - silent
            self._timer = self._loop.call_later(wait, self._silence, timeout)
            return
        self._fail(UpstreamFailed(f"the engine sent nothing for {timeout:g} s"))
        self.abort()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _SecondAnswer(Exception):
    """Raised from a parser callback: the engine began an answer nobody asked for."""


class UpstreamPool:
    def __init__(self, settings: UpstreamSettings | None = None) -> None:
        self.settings = settings or UpstreamSettings()
        self.loop = asyncio.get_running_loop()
        self._idle: dict[Key, list[UpstreamConnection]] = {}
        # connections that carried a stream, in the order they came back, until they have
        # stayed open `stream_settle` seconds (then they are idle like any other)
        self._settling: dict[Key, collections.deque[UpstreamConnection]] = {}
        # engines seen closing a connection after a stream: none is kept after one again
        self._close_after_streams: dict[Key, None] = {}
        # engines that close after streams, a connection being opened to each ahead of
        # its next request (see `_open_ahead`), and those tasks
        self._opening: set[Key] = set()
        self._tasks: set[asyncio.Task[None]] = set()
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
        key = conn.key
        place: list[UpstreamConnection] | collections.deque[UpstreamConnection]
        if conn.streamed:
            if key in self._close_after_streams:
                conn.abort()  # the engine closes it anyway (llama-server, at once)
                self._open_ahead(key)
                return
            place = self._settling.get(key) or self._settling.setdefault(key, collections.deque())
        else:
            place = self._idle.get(key) or self._idle.setdefault(key, [])
        if len(place) >= self.settings.max_idle_per_endpoint:
            conn.abort()
            return
        conn.phase = Phase.IDLE
        conn.idle_since = time.monotonic()
        place.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        """An idle (or settling) connection the engine closed."""
        for place in (self._idle.get(conn.key), self._settling.get(conn.key)):
            if place and conn in place:
                place.remove(conn)
                return

    def closes_after_streams(self, key: Key) -> None:
        """The engine at `key` closed a connection after a stream: it keeps none after one,
        whatever its headers say (llama-server). Its connections that carried a stream go
        now, none is kept after a stream from now on, and the next request's connection is
        opened ahead of it."""
        if key not in self._close_after_streams:
            if len(self._close_after_streams) >= MAX_REMEMBERED:
                del self._close_after_streams[next(iter(self._close_after_streams))]
            self._close_after_streams[key] = None
        for c in self._settling.pop(key, ()):
            c.abort()
        idle = self._idle.get(key)
        if idle:
            for c in [c for c in idle if c.streamed]:
                idle.remove(c)
                c.abort()
        self._open_ahead(key)

    def _open_ahead(self, key: Key) -> None:
        """The engine at `key` closes its connection after every stream: open the one its
        next request will take now, while nothing waits for it, rather than on that
        request's time to first token (a connect is a tenth of a millisecond and more
        here). One at a time, and only when no idle connection is there already; it is
        idle like any other (closed after `idle_timeout` if nothing takes it), and no
        request was ever sent on it, so the engine keeps it."""
        if key in self._opening or self._idle.get(key):
            return
        self._opening.add(key)
        task = self.loop.create_task(self._open_idle(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_idle(self, key: Key) -> None:
        try:
            conn = await self._connect(key)
        except ConnectFailed:
            return  # the next request tries for itself, and says why
        finally:
            self._opening.discard(key)
        if conn.phase is Phase.IDLE:  # (not closed by the engine meanwhile)
            conn.idle_since = time.monotonic()
            self._idle.setdefault(key, []).append(conn)

    def close_idle(self, older_than: float | None = None) -> None:
        """Close idle and settling connections (all, or those idle longer than `older_than`
        seconds; all stops opening ahead too)."""
        if older_than is None:
            for task in self._tasks:
                task.cancel()
        now = time.monotonic()
        for places in (self._idle, self._settling):
            for key, place in list(places.items()):
                keep = [
                    c for c in place if older_than is not None and now - c.idle_since <= older_than
                ]
                for c in place:
                    if older_than is None or now - c.idle_since > older_than:
                        c.abort()
                if keep:
                    place.clear()
                    place.extend(keep)
                else:
                    del places[key]

    async def sweep_forever(self) -> None:
        """Close connections idle for longer than the engines keep them."""
        while True:
            await asyncio.sleep(self.settings.idle_timeout / 2)
            self.close_idle(older_than=self.settings.idle_timeout)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _take_idle(self, key: Key) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        settling = self._settling.get(key)
        now = time.monotonic()
        if settling:
            # those that stayed open long enough after their stream join the idle ones
            settled = now - self.settings.stream_settle
            while settling and settling[0].idle_since <= settled:
                if idle is None:
                    idle = self._idle[key] = []
                idle.append(settling.popleft())
        if not idle:
            return None
        while idle:
            conn = idle.pop()  # the most recently used: warm, least likely to be closing
            if conn.phase is not Phase.IDLE:
                continue
            if now - conn.idle_since > self.settings.idle_timeout:
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self, key: Key) -> UpstreamConnection:
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
