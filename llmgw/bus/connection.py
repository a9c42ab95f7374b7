"""One NATS connection that stays up, and leaves a server that is there but useless.

`Connection.open` keeps trying until the first connection succeeds; then nats-py reconnects
forever, with the delay and the server chosen here: a jittered exponential backoff (nats-py
has no jitter or cap) that resets only after a connection has stayed up for `healthy_after`
seconds, passing over servers found cut off lately. A frozen server or a stalled link is
left after 2 unanswered PINGs (nats-py's keepalive, every `ping_interval`); a server that
answers PINGs but whose JetStream stays silent (cut off from the rest of its cluster) is
left by `jetstream_silent`. `round_trip` PINGs the server without breaking the connection
when the PONG comes late.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from nats.aio.client import Client

from . import classify
from .backoff import Backoff
from .classify import Problem
from .errors import BusUnavailable, NatsUnreachable, Unanswered
from .settings import NatsSettings

log = logging.getLogger(__name__)

# A server cut off from the rest of its cluster answers PINGs but no JetStream request.
# An election (of the bucket's stream, or of the cluster's metadata leader after its server
# died) silences every server alike for a few seconds: 2-10 s measured. Only a silence that
# outlasts that makes a client move.
CUT_OFF_AFTER = 10.0  # seconds of JetStream silence through a server before leaving it
_JS_ASK_EVERY = 1.0  # seconds between questions to the server's JetStream meanwhile
_JS_MOVE_EVERY = 5.0  # seconds: at most one move to another server this often
_AVOID_FOR = 60.0  # seconds a server found cut off is passed over when reconnecting
_PROBE_PATIENCE = 600  # seconds a round_trip PING may wait for its PONG (a reconnect ends it)


class Connection:
    """A nats-py client, connected, with llmgw's reconnect policy around it."""

    def __init__(self, settings: NatsSettings) -> None:
        self.settings = settings
        self.nc = Client()
        self.backoff = Backoff(base=settings.backoff_base, cap=settings.backoff_cap)
        self.connected_since: float | None = None
        self.reconnects = 0
        self.refusal: BaseException | None = None  # the last TLS or authorization refusal
        self.denied: classify.Denial | None = None  # the last subject permissions refused
        # servers (host:port) whose JetStream was found cut off, and when: reconnect elsewhere
        self.avoid: dict[str, float] = {}
        self._lost = ""  # the server (host:port) the connection last dropped from: tried last
        # run after every reconnect, once the PING in flight is dropped (the Bus's listeners
        # and watches)
        self.after_reconnect: Callable[[], Awaitable[None]] | None = None
        self._closed = False
        self._health_task: asyncio.Task[None] | None = None
        self._moved_at = -math.inf
        self._moving: asyncio.Task[None] | None = None  # asking a silent JetStream
        self._probe: asyncio.Task[None] | None = None  # the PING in flight for round_trip
        # first connect: servers that refused the TCP connection in this attempt, and when
        # all have (nothing listens anywhere)
        self._refused = 0
        self._nobody_listens = asyncio.Event()

    @classmethod
    async def open(
        cls, settings: NatsSettings, deadline: float | None, *, wait_for_server: bool = True
    ) -> Connection:
        """Connect, retrying with backoff until it works or `deadline` (monotonic) passes
        (NatsUnreachable). Settings that can never work raise BusError at once, and so does
        no server listening when not `wait_for_server` (a command a person runs: `llmgw
        status` with no NATS took 6 s and two warnings to say what the first attempt knew)."""
        settings.check_urls()
        tls = settings.ssl_context()
        conn = cls(settings)
        # One attempt = one pass over the servers. nats-py's own first-connect loop retries
        # at a fixed interval forever, so each pass is bounded here and the delay between
        # passes is our jittered backoff.
        window = settings.connect_timeout * len(settings.urls) + 0.5
        while True:
            conn.nc = nc = Client()
            conn._refused = 0
            try:
                await conn._first_connect(
                    nc.connect(
                        servers=list(settings.urls),
                        name=settings.name,
                        tls=tls,
                        tls_hostname=settings.tls_hostname,
                        inbox_prefix=settings.inbox_prefix or "_INBOX",
                        connect_timeout=settings.connect_timeout,
                        reconnect_time_wait=window,
                        max_reconnect_attempts=-1,
                        # nats-py's default (a PING every 120 s, 2 unanswered) leaves a client
                        # of a frozen server timing out for minutes: measured in
                        # tests/test_cluster_faults.py, a paused server is left in 7-15 s
                        ping_interval=settings.ping_interval,
                        max_outstanding_pings=settings.max_outstanding_pings,
                        reconnect_to_server_handler=conn._next_server,
                        error_cb=conn._on_error,
                        disconnected_cb=conn._on_disconnected,
                        reconnected_cb=conn._on_reconnected,
                    ),
                    window,
                    wait_for_server,
                )
                break
            except Exception as e:  # noqa: BLE001 - every failure is retried; it was logged
                cause = conn.refusal or nc.last_error or e
                try:
                    await asyncio.wait_for(nc.close(), 1.0)
                except Exception:  # noqa: BLE001
                    pass
                delay = conn.backoff.next_delay()
                if (deadline is not None and time.monotonic() + delay > deadline) or (
                    not wait_for_server and classify.nobody_listening(cause)
                ):
                    # said once, by the caller: not also logged as "retrying"
                    why = (
                        "no server listens there (connection refused)"
                        if classify.nobody_listening(cause)
                        else tls_dropped(cause, settings) or classify.describe(cause)
                    )
                    raise NatsUnreachable(
                        f"cannot connect to NATS at {', '.join(settings.urls)}: {why}"
                    ) from e
                log_problem(cause, settings, first_connect=True)
                await asyncio.sleep(delay)
        conn.connected_since = time.monotonic()
        conn._health_task = asyncio.create_task(conn._reset_backoff_when_healthy())
        return conn

    async def _first_connect(
        self, connecting: Coroutine[Any, Any, None], window: float, wait_for_server: bool
    ) -> None:
        """One pass of nats-py's connect over the servers, at most `window` seconds; without
        `wait_for_server`, ended as soon as every server refused the TCP connection (nats-py
        would try them again after its wait, until the window ends)."""
        attempt = asyncio.ensure_future(asyncio.wait_for(connecting, window))
        if wait_for_server:
            await attempt
            return
        refused = asyncio.ensure_future(self._nobody_listens.wait())
        try:
            await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            refused.cancel()
            if not attempt.done():
                attempt.cancel()
                await asyncio.wait({attempt})
        if attempt.cancelled():
            self._nobody_listens.clear()
            raise self.nc.last_error or ConnectionRefusedError("no NATS server listening")
        attempt.result()

    # --- nats-py's callbacks ----------------------------------------------------------------

    async def _on_error(self, e: Exception) -> None:
        if self.connected_since is None and classify.nobody_listening(e):
            self._refused += 1
            if self._refused >= len(self.settings.urls):
                self._nobody_listens.set()
        if classify.refusal(e):
            self.refusal = e  # a later "connection lost" must not hide why
        elif (denied := classify.denial(e)) is not None:
            self.denied = denied  # a JetStream request refused so answers nothing
        log_problem(e, self.settings)

    async def _on_disconnected(self) -> None:
        if self.connected_since is not None and not self._closed:
            log.warning("disconnected from NATS; reconnecting")
        url = self.nc.connected_url
        self._lost = url.netloc if url else ""
        self.connected_since = None

    async def _on_reconnected(self) -> None:
        self.connected_since = time.monotonic()
        self.reconnects += 1
        log.info("reconnected to NATS at %s", server_url(self.nc))
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()  # its PING went to the old connection: no PONG will come
        self._probe = None
        if self.after_reconnect is not None:
            await self.after_reconnect()

    def _next_server(self, servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
        delay = self.backoff.next_delay()
        now = time.monotonic()
        # the servers not found cut off lately; all of them if every one was
        fresh = [s for s in servers if now - self.avoid.get(s.uri.netloc, -math.inf) > _AVOID_FOR]
        # the server the connection dropped from last: it has most likely died
        pool = sorted(fresh or servers, key=lambda s: s.uri.netloc == self._lost)
        server = pool[self.backoff.attempt % len(pool)] if pool else None
        log.debug("next reconnect attempt in %.2fs", delay)
        return server, delay

    async def _reset_backoff_when_healthy(self) -> None:
        # Only a connection that stayed up resets the delay: a server that accepts and then
        # refuses (auth) must still see the delay grow.
        healthy_after = self.settings.healthy_after
        while True:
            await asyncio.sleep(min(1.0, healthy_after / 2))
            since = self.connected_since
            if since is not None and time.monotonic() - since >= healthy_after:
                if self.backoff.attempt:
                    log.debug("connection healthy for %.0fs; backoff reset", healthy_after)
                self.backoff.reset()

    # --- is the server useful -------------------------------------------------------------

    async def round_trip(self, timeout: float = 2.0) -> float:
        """Seconds for a PING/PONG with the server; BusUnavailable if none within `timeout`."""
        started = time.monotonic()
        # nats-py's flush(timeout) cancels its PONG future on timeout but leaves it queued;
        # the late PONG then raises InvalidStateError in the read loop, which stops reading
        # for good (a connection that delivers nothing until the pinger gives up on it).
        # So one PING at a time, waited for with our own timeout and never cancelled: a late
        # PONG resolves it; a reconnect (which empties nats-py's queue) drops it.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(
                self.nc.flush(timeout=_PROBE_PATIENCE)
            )
            self._probe.add_done_callback(_retrieved)
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), timeout)
        except TimeoutError:
            raise BusUnavailable(
                "round trip to the server (PING)", Unanswered.TIMEOUT, f"{timeout:g} s"
            ) from None
        except Exception as e:
            failure = classify.failure(e, "round trip to the server (PING)")
            if failure is None:
                raise
            raise failure from e
        return time.monotonic() - started

    def jetstream_silent(self) -> None:
        """A JetStream request got no answer through this connection: find out whether the
        server is cut off from its cluster (`_leave_if_cut_off`), unless already asking."""
        if (
            len(getattr(self.nc, "servers", [])) < 2
            or not self.nc.is_connected
            or time.monotonic() - self._moved_at < _JS_MOVE_EVERY
            or (self._moving is not None and not self._moving.done())
            or self._closed
        ):
            return
        self._moving = asyncio.get_running_loop().create_task(self._leave_if_cut_off())

    async def _leave_if_cut_off(self) -> None:
        """Ask the server every second for its JetStream account info, which the cluster's
        metadata leader answers. An answer ends it: the silence was an election, the same on
        every server, and moving could land the client on one that is really cut off. Still
        no answer after `CUT_OFF_AFTER` seconds: this server is cut off from its cluster;
        move to another, passing over this one for a while. (Other requests are no sign: a
        cut-off server still answers some of them itself, a missing key say.)"""
        url = self.nc.connected_url
        here = url.netloc if url else ""
        started, reconnects = time.monotonic(), self.reconnects
        while True:
            asked = time.monotonic()
            if await self._jetstream_answers():
                log.debug("JetStream answers through %s: it was an election", here)
                return
            if self.reconnects != reconnects:
                return  # nats-py left it meanwhile (a stale connection)
            if self._closed or not self.nc.is_connected:
                return
            if time.monotonic() - started >= CUT_OFF_AFTER:
                break
            await asyncio.sleep(max(0.0, _JS_ASK_EVERY - (time.monotonic() - asked)))
        self._moved_at = time.monotonic()
        if here:
            self.avoid[here] = self._moved_at
        log.warning(
            "JetStream has not answered through %s for %.0f s although the server does (cut "
            "off from the rest of its cluster?): moving to another server",
            here or "the current server",
            self._moved_at - started,
        )
        await self.nc.force_reconnect()

    async def _jetstream_answers(self) -> bool:
        try:
            msg = await self.nc.request("$JS.API.INFO", b"", timeout=_JS_ASK_EVERY)
            return "error" not in msgspec.json.decode(msg.data, type=dict)
        except Exception:  # noqa: BLE001 - no usable answer is the answer
            return False

    async def close(self) -> None:
        """Stop the background tasks and close; bounded so shutdown never hangs."""
        self._closed = True
        for task in (self._health_task, self._probe, self._moving):
            if task is not None:
                task.cancel()
        try:
            await asyncio.wait_for(self.nc.close(), 1.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("NATS close did not finish cleanly", exc_info=True)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Done callback for a task whose failure its waiters may have stopped waiting for."""
    if not task.cancelled():
        task.exception()


def server_info(nc: Client) -> dict[str, Any]:
    # the INFO the server sent: `cluster` is its cluster's name (absent on a lone server),
    # `jetstream` whether it runs JetStream; nats-py keeps it only privately
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}


def server_url(nc: Client) -> str:
    url = nc.connected_url
    return f"{url.scheme}://{url.netloc}" if url else "?"


def tls_dropped(e: BaseException, settings: NatsSettings) -> str | None:
    """What a TLS connection dropped while being set up most likely means, or None. TLS 1.3
    checks the client certificate after the handshake: a refusal often reaches us as a
    broken pipe or a reset rather than as the server's alert (and then as the first
    connect's last error, with nothing logged before it)."""
    if not (settings.tls_ca or settings.tls_cert) or classify.problem(e) is not Problem.DROPPED:
        return None
    cert = f"certificate {settings.tls_cert}" if settings.tls_cert else "no client certificate"
    who = f" claimed identity {settings.identity}" if settings.identity else ""
    return (
        f"NATS closed the TLS connection while setting it up ({classify.describe(e)}): the "
        f"server may require a client certificate or refuse this one ({cert},{who})"
    )


def log_problem(e: BaseException, settings: NatsSettings, first_connect: bool = False) -> None:
    """Say what went wrong with the connection, as its kind (llmgw.bus.classify) asks."""
    text = classify.describe(e)
    who = f" claimed identity {settings.identity}" if settings.identity else ""
    cert = f"certificate {settings.tls_cert}" if settings.tls_cert else "no client certificate"
    kind = classify.problem(e)
    if kind is Problem.AUTHORIZATION:
        log.error(
            "NATS refused the connection (authorization violation): %s,%s; check that the "
            "server maps this certificate's CN to a user",
            cert,
            who,
        )
    elif kind is Problem.TLS:
        log.error("TLS handshake with NATS failed: %s (%s,%s)", text, cert, who)
    elif kind is Problem.DENIED:
        log.error("NATS refused a subject: %s (%s,%s)", text, cert, who)
    elif first_connect and (dropped := tls_dropped(e, settings)):
        log.error("%s; retrying", dropped)
    elif first_connect:
        log.warning("cannot connect to NATS at %s: %s; retrying", ", ".join(settings.urls), text)
    else:
        log.debug("NATS: %s", text)
