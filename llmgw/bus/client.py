"""Connecting to NATS and using the bucket: the one place llmgw talks to nats-py.

`Bus.connect()` keeps trying until the first connection succeeds and then reconnects
forever, with a jittered exponential delay chosen by us (nats-py has no jitter or cap):
the backoff resets only after a connection has stayed up for `healthy_after` seconds.
Values are msgspec records (llmgw.bus.records). A value that does not decode, is too big,
or names another owner than its key (llmgw.bus.trust) is logged with its key and skipped,
never fatal: anyone allowed to write a key can put anything in it.

    async with Bus.open(settings, give_up_after=5) as bus:
        await bus.put(keys.lease("node05"), lease)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from llmgw.errors import LlmgwError

from . import keys, records, requests, trust
from .backoff import Backoff
from .watcher import CAUGHT_UP, KeyWatch, RawEntry

log = logging.getLogger(__name__)

T = TypeVar("T")
Decoder = Callable[[bytes], T]

DEFAULT_HEALTHY_AFTER = 10.0
# Values are state, not data: a whole node inventory is a few KB. The cap keeps one value
# (with its headers) under nats-server's default max_payload of 1 MiB, and bounds what a
# reader accepts from a writer it does not control.
MAX_VALUE_BYTES = 1_000_000
_MAX_PEM_BYTES = 1 << 20  # a certificate chain or key file; anything bigger is not one
_SCHEMES = ("nats", "tls", "ws", "wss")
# JetStream's answers to a conditional write (nats-server): 10071 compared and found the
# subject at another revision ("wrong last sequence: N"); 10164 did not compare, because
# another conditional write on the subject is in flight on a cluster (decides nothing)
_WRONG_LAST_SEQUENCE = 10071
_WRONG_LAST_SEQUENCE_BUSY = 10164
_EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
# nats-server >= 2.11: the expected revision is that of this subject, not the written one's
_EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_REPLICAS_NEED_A_CLUSTER = 10074  # "replicas > 1 not supported in non-clustered mode"
_FENCE_BUSY_ATTEMPTS = 40  # about 3 s of 10164s before a write gives up until the next pass


# no answer to a JetStream request: silence (timeout), nobody there (no responders), or the
# server's JetStream saying it cannot (no stream response, 503 unavailable)
_NO_ANSWER = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
# A server cut off from the rest of its cluster answers PINGs but no JetStream request.
# An election (of the bucket's stream, or of the cluster's metadata leader after its server
# died) silences every server alike for a few seconds: 2-10 s measured. Only a silence that
# outlasts that makes a client move.
_CUT_OFF_AFTER = 10.0  # seconds of JetStream silence through a server before leaving it
_JS_ASK_EVERY = 1.0  # seconds between questions to the server's JetStream meanwhile
_JS_MOVE_EVERY = 5.0  # seconds: at most one move to another server this often
_AVOID_FOR = 60.0  # seconds a server found cut off is passed over when reconnecting
_PROBE_PATIENCE = 600  # seconds a round_trip PING may wait for its PONG (a reconnect ends it)


class BusError(LlmgwError):
    """A NATS problem stated for the operator (what failed and what to do)."""


class NatsUnreachable(BusError):
    """No server answered (or all refused) for as long as the caller would wait: the one
    BusError where "is NATS running? is --nats right?" is the useful hint."""


@dataclass(frozen=True)
class NatsSettings:
    urls: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    ping_interval: float = 3.0  # seconds between keepalive PINGs
    max_outstanding_pings: int = 2  # unanswered PINGs before the server is left
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    name: str = "llmgw"
    # what this client claims to be, for refusal messages ("node05 (from hostname)")
    identity: str = ""
    inbox_prefix: str | None = None
    connect_timeout: float = 2.0
    healthy_after: float = DEFAULT_HEALTHY_AFTER
    backoff_base: float = 0.5
    backoff_cap: float = 30.0

    def check_urls(self) -> None:
        """Raise BusError naming the first URL that is not a NATS URL, and the fix."""
        if not self.urls:
            raise BusError("no NATS URL given: set --nats (or nats.urls) to nats://HOST:4222")
        schemes = {check_url(u) for u in self.urls}
        if schemes & {"ws", "wss"} and schemes - {"ws", "wss"}:
            raise BusError(
                f"NATS URLs {', '.join(self.urls)} mix websocket (ws://, wss://) and plain "
                "(nats://, tls://) servers, which one connection cannot: list one kind"
            )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context for the configured files; BusError naming the file and what is
        wrong with it (missing, unreadable, not PEM, encrypted, key not the certificate's)."""
        if not (self.tls_ca or self.tls_cert or self.tls_key):
            return None
        if self.tls_cert and not self.tls_key:
            raise BusError(f"TLS certificate {self.tls_cert} given without its key: set tls_key")
        if self.tls_key and not self.tls_cert:
            raise BusError(f"TLS key {self.tls_key} given without its certificate: set tls_cert")
        if self.tls_ca:
            _check_pem(self.tls_ca, "TLS CA file", "tls_ca", b"CERTIFICATE")
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        except ssl.SSLError as e:
            raise BusError(
                f"TLS CA file {self.tls_ca} holds no usable CA certificate ({e.reason or e}): "
                "give the PEM file of the CA that signed the server's certificate"
            ) from None
        if self.tls_cert and self.tls_key:
            _check_pem(self.tls_cert, "TLS certificate", "tls_cert", b"CERTIFICATE")
            key = _check_pem(self.tls_key, "TLS key", "tls_key", b"PRIVATE KEY")
            if b"ENCRYPTED" in key:
                raise BusError(
                    f"TLS key {self.tls_key} is encrypted, and llmgw cannot ask for its "
                    "passphrase: store it unencrypted (`openssl pkey -in KEY -out KEY.plain`), "
                    "readable only by the user llmgw runs as"
                )
            try:
                # a callback that refuses: OpenSSL must never prompt on a terminal
                ctx.load_cert_chain(self.tls_cert, self.tls_key, password=_no_passphrase)
            except (ssl.SSLError, ValueError) as e:
                raise BusError(
                    f"cannot use TLS certificate {self.tls_cert} with key {self.tls_key} "
                    f"({getattr(e, 'reason', None) or e}): the key must be that certificate's "
                    "private key (compare `openssl x509 -noout -pubkey -in CERT` with "
                    "`openssl pkey -pubout -in KEY`)"
                ) from None
        return ctx


def check_url(url: str) -> str:
    """The scheme of a NATS URL (nats, tls, ws, wss; `host:port` alone reads as nats, as
    nats-py reads it); BusError naming the URL and the fix for anything else."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "nats", url.strip()
    fix = "write nats://HOST:4222 (tls:// insists on TLS; ws://, wss:// reach a websocket port)"
    if scheme.lower() not in _SCHEMES:
        raise BusError(f"{url!r} is not a NATS URL (scheme {scheme}://): {fix}")
    try:
        parsed = urllib.parse.urlsplit(f"{scheme}://{rest}")
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as e:
        raise BusError(f"{url!r} is not a NATS URL ({e}): {fix}") from None
    if not parsed.hostname or parsed.path not in ("", "/") or parsed.query:
        raise BusError(f"{url!r} is not a NATS URL (expected only a host and a port): {fix}")
    return scheme.lower()


def _no_passphrase() -> bytes:
    raise ValueError("the key is encrypted")


def _check_pem(path: str, what: str, setting: str, kind: bytes) -> bytes:
    """The file's bytes, if it is a readable PEM file holding `kind`; BusError otherwise."""
    fix = f"set {setting} (--{setting.replace('_', '-')}) to the right PEM file"
    try:
        size = os.stat(path).st_size
        if os.path.isdir(path):
            raise IsADirectoryError
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM_BYTES + 1)
    except FileNotFoundError:
        raise BusError(f"{what} {path} does not exist: {fix}") from None
    except IsADirectoryError:
        raise BusError(f"{what} {path} is a directory, not a file: {fix}") from None
    except PermissionError:
        raise BusError(
            f"{what} {path} cannot be read by this user (uid {os.getuid()}): make it readable "
            "by the user llmgw runs as"
        ) from None
    except OSError as e:
        raise BusError(f"{what} {path} cannot be read ({e.strerror or e}): {fix}") from None
    if size > _MAX_PEM_BYTES or len(data) > _MAX_PEM_BYTES:
        raise BusError(f"{what} {path} is {size:,} bytes, too big for a PEM file: {fix}")
    if b"-----BEGIN " not in data:
        raise BusError(
            f"{what} {path} is not PEM (no '-----BEGIN' line; DER or another format?): {fix}; "
            "convert DER with `openssl x509 -inform der -in FILE -out FILE.pem` "
            "(`openssl pkey -inform der ...` for a key)"
        )
    if kind + b"-----" not in data:
        raise BusError(
            f"{what} {path} is PEM but holds no {kind.decode()} (another file given here?): {fix}"
        )
    return data


@dataclass(frozen=True)
class BucketSettings:
    name: str = keys.DEFAULT_BUCKET
    # None: not specified by the operator; a missing bucket is created with the defaults
    # and an existing one is accepted as it is. Given: checked against the bucket.
    replicas: int | None = None
    history: int | None = None


@dataclass(frozen=True)
class Entry(Generic[T]):
    key: str
    value: T
    revision: int


@dataclass(frozen=True)
class Update(Generic[T]):
    """One change seen by a watch: `value` None means deleted (or no longer decodable)."""

    key: str
    value: T | None
    revision: int


@dataclass(frozen=True)
class Synced:
    """The watch has delivered the current state (after start and after every reconnect)."""


@dataclass(frozen=True)
class Fence:
    """A condition the server checks together with a write, atomically: `key` is still at
    `revision`. The leading controller fences each of its writes with the `leader` key, so
    a controller deposed meanwhile writes nothing (docs/architecture.md, "Fenced writes")."""

    key: str
    revision: int


class FencedOff(Exception):
    """The server refused a fenced write: the fence key has moved on from the revision the
    writer held. Not an operator's problem: the writer lost what the fence stood for."""

    def __init__(self, key: str, fence: Fence, now_at: int | None) -> None:
        self.key, self.fence, self.now_at = key, fence, now_at
        at = f"revision {now_at}" if now_at is not None else "another revision"
        super().__init__(
            f"write to {key} refused: {fence.key} is at {at}, not {fence.revision} as fenced"
        )


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Done callback for a task whose failure its waiters may have stopped waiting for."""
    if not task.cancelled():
        task.exception()


def decoder(type_: type[T]) -> Decoder[T]:
    return lambda data: records.decode(data, type_)


@dataclass
class _ConnState:
    backoff: Backoff
    connected_since: float | None = None
    reconnects: int = 0
    refusal: BaseException | None = None  # the last TLS or authorization refusal seen
    denied: str = ""  # the last subject permissions refused this client, as the server said
    watch_restarts: list[asyncio.Event] = field(default_factory=list)
    # servers (host:port) whose JetStream was found cut off, and when: reconnect elsewhere
    avoid: dict[str, float] = field(default_factory=dict)

    def servers_to_try(self, servers: list[Any]) -> list[Any]:
        """The servers not found cut off lately; all of them if every one was."""
        now = time.monotonic()
        return [s for s in servers if now - self.avoid.get(s.uri.netloc, -math.inf) > _AVOID_FOR]


class Bus:
    """A connection plus the llmgw bucket."""

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        settings: NatsSettings,
        bucket: BucketSettings,
        state: _ConnState,
        max_value_bytes: int = MAX_VALUE_BYTES,
    ) -> None:
        self.nc = nc
        self.kv = kv
        self.js = nc.jetstream()
        self.settings = settings
        self.bucket = bucket
        self.max_value_bytes = max_value_bytes
        self._state = state
        self._reconnect_listeners: list[Callable[[], Awaitable[None]]] = []
        self._health_task: asyncio.Task[None] | None = None
        self._watchers: set[KeyWatch] = set()
        self._closed = False
        self._moved_at = -math.inf
        self._moving: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None  # the PING in flight for round_trip

    # --- connecting -----------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        settings: NatsSettings,
        bucket: BucketSettings | None = None,
        *,
        give_up_after: float | None = None,
    ) -> AsyncIterator[Bus]:
        """`connect`, then `close` when the block ends: `async with Bus.open(...) as bus:`."""
        bus = await cls.connect(settings, bucket, give_up_after=give_up_after)
        async with bus:
            yield bus

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @classmethod
    async def connect(
        cls,
        settings: NatsSettings,
        bucket: BucketSettings | None = None,
        *,
        give_up_after: float | None = None,
    ) -> Bus:
        """Connect (retrying with backoff until it works, or for `give_up_after` seconds) and
        open the bucket, creating it if missing. Settings that can never work (a URL that is
        not NATS's, a TLS file that is missing or not PEM) raise BusError at once."""
        bucket = bucket or BucketSettings()
        settings.check_urls()
        tls = settings.ssl_context()
        state = _ConnState(Backoff(base=settings.backoff_base, cap=settings.backoff_cap))
        holder: dict[str, Bus] = {}

        async def error_cb(e: Exception) -> None:
            if _is_refusal(e):
                state.refusal = e  # a later "connection lost" must not hide why
            elif "permissions violation" in _describe(e).lower():
                state.denied = _describe(e)  # a JetStream request refused so answers nothing
            _log_nats_error(e, settings)

        async def disconnected_cb() -> None:
            closing = "bus" in holder and holder["bus"]._closed
            if state.connected_since is not None and not closing:
                log.warning("disconnected from NATS; reconnecting")
            state.connected_since = None

        async def reconnected_cb() -> None:
            state.connected_since = time.monotonic()
            state.reconnects += 1
            log.info("reconnected to NATS at %s", _server_url(holder["bus"].nc) if holder else "?")
            if "bus" in holder:
                await holder["bus"]._on_reconnected()

        def reconnect_to_server(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
            delay = state.backoff.next_delay()
            pool = state.servers_to_try(servers) or servers
            server = pool[state.backoff.attempt % len(pool)] if pool else None
            log.debug("next reconnect attempt in %.2fs", delay)
            return server, delay

        deadline = None if give_up_after is None else time.monotonic() + give_up_after
        # One attempt = one pass over the servers. nats-py's own first-connect loop retries at
        # a fixed interval forever, so each pass is bounded here and the delay between passes
        # is our jittered backoff.
        window = settings.connect_timeout * len(settings.urls) + 0.5
        while True:
            nc = Client()
            try:
                await asyncio.wait_for(
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
                        reconnect_to_server_handler=reconnect_to_server,
                        error_cb=error_cb,
                        disconnected_cb=disconnected_cb,
                        reconnected_cb=reconnected_cb,
                    ),
                    window,
                )
                break
            except Exception as e:  # noqa: BLE001 - every failure is retried; it was logged
                cause = state.refusal or nc.last_error or e
                try:
                    await asyncio.wait_for(nc.close(), 1.0)
                except Exception:  # noqa: BLE001
                    pass
                _log_nats_error(cause, settings, first_connect=True)
                delay = state.backoff.next_delay()
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise NatsUnreachable(
                        f"cannot connect to NATS at {', '.join(settings.urls)}: {_describe(cause)}"
                    ) from e
                await asyncio.sleep(delay)
        state.connected_since = time.monotonic()
        try:
            kv, max_value = await _open_bucket(nc, bucket, settings, state, deadline)
        except BaseException:
            await nc.close()
            raise
        bus = cls(nc, kv, settings, bucket, state, max_value)
        holder["bus"] = bus
        bus._health_task = asyncio.create_task(bus._reset_backoff_when_healthy())
        return bus

    async def _reset_backoff_when_healthy(self) -> None:
        # Only a connection that stayed up resets the delay: a server that accepts and then
        # refuses (auth) must still see the delay grow.
        while True:
            await asyncio.sleep(min(1.0, self.settings.healthy_after / 2))
            since = self._state.connected_since
            if since is not None and time.monotonic() - since >= self.settings.healthy_after:
                if self._state.backoff.attempt:
                    log.debug(
                        "connection healthy for %.0fs; backoff reset", self.settings.healthy_after
                    )
                self._state.backoff.reset()

    def on_reconnected(self, cb: Callable[[], Awaitable[None]]) -> None:
        """Run `cb` after every reconnect (re-read assignments, re-report shards...)."""
        self._reconnect_listeners.append(cb)

    async def _on_reconnected(self) -> None:
        if self._probe is not None and not self._probe.done():
            self._probe.cancel()  # its PING went to the old connection: no PONG will come
        self._probe = None
        # Listeners first: they may need to know the view is stale before the watches
        # replay the bucket.
        for cb in list(self._reconnect_listeners):
            try:
                await cb()
            except Exception:  # noqa: BLE001
                log.exception("reconnect handler failed")
        # A watch resumes by itself only after its idle-heartbeat check (13-16 s): restart ours now.
        for w in list(self._watchers):
            await w.stop()

    @property
    def backoff(self) -> Backoff:
        return self._state.backoff

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def reconnects(self) -> int:
        return self._state.reconnects

    async def round_trip(self, timeout: float = 2.0) -> float:
        """Seconds for a PING/PONG with the server; raises if none within `timeout`. What a
        component checks before concluding that others went silent, not itself."""
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
            raise nats.errors.FlushTimeoutError from None
        return time.monotonic() - started

    async def close(self) -> None:
        """Stop watches, then close the connection; bounded so shutdown never hangs."""
        self._closed = True
        if self._health_task:
            self._health_task.cancel()
        for task in (self._probe, self._moving):
            if task is not None:
                task.cancel()
        for w in list(self._watchers):
            try:
                await asyncio.wait_for(w.stop(), 0.5)
            except Exception:  # noqa: BLE001
                pass
        self._watchers.clear()
        try:
            await asyncio.wait_for(self.nc.close(), 1.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("NATS close did not finish cleanly", exc_info=True)

    # --- the bucket ---------------------------------------------------------------------

    def _sized(self, key: str, data: bytes) -> bytes:
        if len(data) > self.max_value_bytes:
            raise BusError(
                f"not writing {key}: its value is {len(data):,} bytes, over the bucket's limit "
                f"of {self.max_value_bytes:,}; values are state, not data: keep them small "
                "(a node inventory is a few KB)"
            )
        return data

    async def put(
        self, key: str, record: msgspec.Struct | bytes, *, fence: Fence | None = None
    ) -> int:
        """Write; with `fence`, only while the fence key is at its revision (FencedOff if not)."""
        data = self._sized(key, record if isinstance(record, bytes) else records.encode(record))
        if fence is None:
            return await self._js(self.kv.put(key, data))
        return await self._fenced(key, data, fence, {})

    async def create(self, key: str, record: msgspec.Struct) -> int | None:
        """Write only if the key does not exist; None if it does."""
        try:
            return await self._js(self.kv.create(key, self._sized(key, records.encode(record))))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update(self, key: str, record: msgspec.Struct, last: int) -> int | None:
        """Compare-and-set on the revision; None if someone else wrote in between."""
        try:
            data = self._sized(key, records.encode(record))
            return await self._js(self.kv.update(key, data, last=last))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def delete(
        self, key: str, last: int | None = None, *, fence: Fence | None = None
    ) -> bool:
        """Delete; with `last`, only if the key is still at that revision (False if not); with
        `fence`, only while the fence key is at its revision (FencedOff if not)."""
        if fence is not None:
            await self._fenced(key, b"", fence, {KV_OP: KV_DEL})
            return True
        try:
            await self._js(self.kv.delete(key, last=last))
        except nats.js.errors.APIError as e:
            # nats-py's delete does not map a stale `last` to KeyWrongLastSequenceError
            if e.err_code in (_WRONG_LAST_SEQUENCE, _WRONG_LAST_SEQUENCE_BUSY):
                return False
            raise
        return True

    async def _fenced(self, key: str, data: bytes, fence: Fence, headers: dict[str, str]) -> int:
        """Publish `data` to `key` on the condition that `fence.key` is at `fence.revision`.
        The stream checks the condition and stores the write as one step, on one server or
        on a cluster's stream leader."""
        headers = {
            **headers,
            _EXPECTED_LAST_SUBJECT_SEQUENCE: str(fence.revision),
            _EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT: self._subject(fence.key),
        }
        backoff = Backoff(base=0.005, cap=0.1)
        for _ in range(_FENCE_BUSY_ATTEMPTS):
            try:
                ack = await self._js(self.js.publish(self._subject(key), data, headers=headers))
                return ack.seq
            except nats.js.errors.APIError as e:
                if e.err_code == _WRONG_LAST_SEQUENCE:
                    raise FencedOff(key, fence, _revision_in(e.description)) from None
                if e.err_code != _WRONG_LAST_SEQUENCE_BUSY:
                    raise
            # A cluster's stream leader lets one conditional write on a subject be in flight
            # at a time and refuses the others without comparing: that decides nothing.
            await asyncio.sleep(backoff.next_delay())
        raise BusError(
            f"write to {key} not made: {fence.key} stayed busy with other conditional writes "
            f"for {_FENCE_BUSY_ATTEMPTS} attempts; it is tried again on the next pass"
        )

    async def _js(self, request: Awaitable[T]) -> T:
        """A JetStream request, watching for a server that answers PINGs but whose JetStream
        no longer answers (cut off from the other servers of its cluster): nats-py stays on
        it, since the connection is fine, and every read and write would fail until the
        partition heals. A request without an answer starts `_leave_if_cut_off`."""
        try:
            result = await request
        except _NO_ANSWER:
            self._js_no_answer()
            raise
        return result

    def _js_no_answer(self) -> None:
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
        no answer after `_CUT_OFF_AFTER` seconds: this server is cut off from its cluster;
        move to another, passing over this one for a while. (Other requests are no sign: a
        cut-off server still answers some of them itself, a missing key say.)"""
        url = self.nc.connected_url
        here = url.netloc if url else ""
        started, reconnects = time.monotonic(), self._state.reconnects
        while True:
            asked = time.monotonic()
            if await self._jetstream_answers():
                log.debug("JetStream answers through %s: it was an election", here)
                return
            if self._state.reconnects != reconnects:
                return  # nats-py left it meanwhile (a stale connection)
            if self._closed or not self.nc.is_connected:
                return
            if time.monotonic() - started >= _CUT_OFF_AFTER:
                break
            await asyncio.sleep(max(0.0, _JS_ASK_EVERY - (time.monotonic() - asked)))
        self._moved_at = time.monotonic()
        if here:
            self._state.avoid[here] = self._moved_at
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

    def _subject(self, key: str) -> str:
        return f"$KV.{self.bucket.name}.{key}"

    async def deleted_at(self, key: str) -> int | None:
        """The revision of the key's deletion (what a compare-and-set recreating it names);
        0 if it never existed; None if it holds a value."""
        try:
            e = await self._js(self.kv.get(key))
        except nats.js.errors.KeyNotFoundError as e:
            return (e.entry.revision or 0) if e.entry is not None else 0
        return None if e.value is not None else (e.revision or 0)

    async def get_raw(self, key: str) -> tuple[bytes, int] | None:
        """The value's bytes and revision; None when absent (or over the size limit: logged)."""
        try:
            e = await self._js(self.kv.get(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        if e.value is None or e.operation in (KV_DEL, KV_PURGE):
            return None  # a just-expired key can come back with value None
        revision = e.revision or 0
        if _too_big(key, e.value, revision, self.max_value_bytes):
            return None
        return e.value, revision

    async def get(self, key: str, decode: Decoder[T]) -> Entry[T] | None:
        """The key's value, decoded and checked against the key (llmgw.bus.trust); None when
        absent or not believable (logged)."""
        raw = await self.get_raw(key)
        if raw is None:
            return None
        value = _decode_or_log(key, raw[0], raw[1], decode)
        return None if value is None else Entry(key, value, raw[1])

    async def list(self, pattern: str, decode: Decoder[T]) -> dict[str, Entry[T]]:
        """Current values of every key matching `pattern` (the ones that do not decode or must
        not be believed are logged and skipped). Its consumer is gone seconds after."""
        out: dict[str, Entry[T]] = {}
        async for item in self.watch(pattern, decode, until_synced=True):
            if isinstance(item, Update):
                if item.value is None:
                    out.pop(item.key, None)
                else:
                    out[item.key] = Entry(item.key, item.value, item.revision)
        return out

    async def watch(
        self, pattern: str, decode: Decoder[T], *, until_synced: bool = False
    ) -> AsyncIterator[Update[T] | Synced]:
        """Latest value per key, then `Synced`, then live updates; re-created after every
        reconnect, reporting keys that vanished meanwhile as deletions. A view of the latest
        state, not a log: intermediate values may be skipped. `Synced` comes only once every
        value stored when the watch (re)started has been yielded (llmgw.bus.watcher)."""
        known: dict[str, int] = {}
        backoff = Backoff(base=0.2, cap=5.0)
        while not self._closed:
            try:
                watch = await KeyWatch.start(self.js, self.bucket.name, pattern)
            except Exception as e:  # noqa: BLE001 - disconnected: retry
                log.debug("watch %s: cannot start (%s); retrying", pattern, _describe(e))
                await asyncio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            self._watchers.add(watch)
            seen: set[str] | None = set()
            try:
                async for item in watch:
                    if item is CAUGHT_UP:
                        for gone in [k for k in known if k not in (seen or ())]:
                            del known[gone]
                            yield Update(gone, None, 0)
                        seen = None
                        yield Synced()
                        if until_synced:
                            return
                        continue
                    assert isinstance(item, RawEntry)
                    if seen is not None:
                        seen.add(item.key)
                    value = None
                    if not item.deleted and not _too_big(
                        item.key, item.data, item.revision, self.max_value_bytes
                    ):
                        value = _decode_or_log(item.key, item.data, item.revision, decode)
                    if value is None:
                        if known.pop(item.key, None) is not None:
                            yield Update(item.key, None, item.revision)
                        continue
                    known[item.key] = item.revision
                    yield Update(item.key, value, item.revision)
            finally:
                self._watchers.discard(watch)
                try:
                    await asyncio.wait_for(watch.stop(), 0.5)
                except Exception:  # noqa: BLE001
                    pass

    # --- core NATS ------------------------------------------------------------------------

    async def publish_event(self, kind: str, subject_id: str, message: str, **data: object) -> None:
        """Publish on llmgw.events.<kind>.<id>; best effort (events are a log, not state)."""
        event = records.Event(
            kind=kind, subject=subject_id, message=message, time=time.time(), data=data
        )
        try:
            await self.nc.publish(keys.event_subject(kind, subject_id), records.encode(event))
        except Exception as e:  # noqa: BLE001
            log.debug("event %s not published: %s", kind, _describe(e))

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        """Every message on `subject` (events). Requests that make a component act go
        through `serve`, which tells them from what the server delivers on others' behalf."""
        return await self.nc.subscribe(subject, cb=cb)

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Any:
        """Answer requests on `subject` with `await handler(payload)`. Acts only on requests a
        client published there: what the server delivers there on another's behalf (a
        JetStream consumer aimed at the subject, a forged reply; llmgw.bus.requests) is
        dropped and logged as a spoof attempt, once per source."""
        reported: set[str] = set()

        async def on_msg(msg: Any) -> None:
            why = requests.forged(subject, msg.subject, msg.reply, msg.headers)
            if why is not None:
                source = str(requests.consumer_of(msg.reply) or why)
                first = source not in reported and len(reported) < 1000
                reported.add(source)
                log.log(
                    logging.WARNING if first else logging.DEBUG,
                    "ignoring a message on %s: %s; only a request published there by the "
                    "controller or the operator is acted on (spoof attempt?)",
                    subject,
                    why,
                )
                return
            try:
                answer = await handler(msg.data)
            except Exception:  # noqa: BLE001 - one failed request must not end the subscription
                log.exception("request on %s failed", subject)
                return
            await msg.respond(answer)

        return await self.nc.subscribe(subject, cb=on_msg)

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 5.0) -> bytes:
        msg = await self.nc.request(subject, payload, timeout=timeout)
        return msg.data


async def _open_bucket(
    nc: Client,
    bucket: BucketSettings,
    settings: NatsSettings,
    state: _ConnState,
    deadline: float | None,
) -> tuple[KeyValue, int]:
    """`ensure_bucket`, waiting for JetStream like for any outage (until `deadline`), and
    saying what it waits for. A JetStream request that permissions refused also answers
    nothing: that is said at once instead of waited on."""
    backoff = Backoff(base=settings.backoff_base, cap=min(settings.backoff_cap, 5.0))
    said_at: float | None = None
    while True:
        state.denied = ""
        try:
            return await ensure_bucket(nc, bucket, timeout=settings.connect_timeout)
        except JetStreamNotReady as e:
            denied = state.denied.lower()  # nats-py lowercases what the server said
            if "$js.api.stream.create" in denied:
                raise BusError(
                    f"bucket {bucket.name} does not exist and this identity may not create it "
                    f"({state.denied}): start a controller (or `llmgw up`) first, or check the "
                    "NATS permissions (docs/security.md)"
                ) from None
            if "$js." in denied:
                raise BusError(
                    f"NATS refused this identity a JetStream request ({state.denied}): "
                    "check the NATS permissions (docs/security.md)"
                ) from None
            delay = backoff.next_delay()
            if deadline is not None and time.monotonic() + delay > deadline:
                raise JetStreamNotReady(
                    e.url,
                    e.detail,
                    "a NATS cluster serves JetStream once a majority of its servers is up and "
                    "has elected a leader: check each server's /healthz",
                ) from None
            now = time.monotonic()
            if said_at is None or now - said_at >= 30:
                log.warning("JetStream not ready on %s: waiting (%s)", e.url, e.detail)
                said_at = now
            else:
                log.debug("JetStream not ready on %s: %s", e.url, e.detail)
            await asyncio.sleep(delay)


class JetStreamNotReady(BusError):
    """JetStream gave no answer, or said it is not available yet: a cluster still electing
    its leader or short of a majority of its servers. A wait, like any outage."""

    def __init__(self, url: str, detail: str, hint: str = "") -> None:
        self.url, self.detail = url, detail
        super().__init__(f"JetStream not ready on {url} ({detail})" + (f"; {hint}" if hint else ""))


async def ensure_bucket(
    nc: Client, settings: BucketSettings, *, timeout: float = 5.0
) -> tuple[KeyValue, int]:
    """Open the bucket, creating it if missing; never silently recreate one that differs.
    Returns it with the largest value llmgw writes to or accepts from it. JetStream not
    answering within `timeout` (or answering 503) raises JetStreamNotReady: the caller waits.
    """
    # short answers while starting; the bucket itself is used with the default timeout
    js = nc.jetstream(timeout=timeout)
    try:
        max_value = await _open_or_create(nc, js, settings)
        return await nc.jetstream().key_value(settings.name), max_value
    except (
        nats.errors.TimeoutError,
        nats.errors.NoRespondersError,
        nats.js.errors.ServiceUnavailableError,
    ) as e:
        if not _server_info(nc).get("jetstream"):  # the INFO of a server with it says so
            raise BusError(
                f"NATS at {_server_url(nc)} has no JetStream, which llmgw's bucket needs: "
                "enable it in the server's config (`jetstream { store_dir: ... }`, nats/dev.conf)"
            ) from None
        if isinstance(e, nats.errors.TimeoutError):
            what = "no answer"
        elif isinstance(e, nats.js.errors.APIError) and e.description:
            what = e.description  # "JetStream system temporarily unavailable"
        else:
            what = "nothing answers JetStream requests yet"
        raise JetStreamNotReady(
            _server_url(nc), f"{what} while opening bucket {settings.name}"
        ) from None


async def _open_or_create(nc: Client, js: Any, settings: BucketSettings) -> int:
    cluster = _server_info(nc).get("cluster")
    try:
        await js.key_value(settings.name)
    except nats.js.errors.BucketNotFoundError:
        replicas = settings.replicas or 1
        if cluster and replicas == 1:
            _warn_r1(settings.name, cluster, "creating it with replicas=1")
        try:
            await js.create_key_value(
                KeyValueConfig(
                    bucket=settings.name,
                    history=settings.history or 1,
                    replicas=replicas,
                    max_value_size=MAX_VALUE_BYTES,
                    description="llmgw: inventory, weights, desired state, assignments (docs/bucket.md)",
                )
            )
            log.info(
                "created bucket %s (replicas=%d, history=%d)",
                settings.name,
                replicas,
                settings.history or 1,
            )
            return MAX_VALUE_BYTES
        except nats.js.errors.APIError as e:
            if e.err_code == _REPLICAS_NEED_A_CLUSTER:
                raise BusError(
                    f"bucket {settings.name} cannot be created with replicas={replicas}: NATS "
                    f"at {_server_url(nc)} is a single server, not a cluster; leave "
                    "--bucket-replicas unset (or 1), or give the cluster's URLs"
                ) from None
            if not isinstance(e, nats.js.errors.BadRequestError):
                raise
            await js.key_value(settings.name)  # another component created it first
    except nats.js.errors.BadBucketError as e:
        raise BusError(
            f"stream KV_{settings.name} exists but is not a KV bucket: pick another --bucket"
        ) from e
    info = await js.stream_info(f"KV_{settings.name}")
    problems = []
    if settings.replicas is not None and info.config.num_replicas != settings.replicas:
        problems.append(f"replicas={info.config.num_replicas} (configured {settings.replicas})")
    if settings.history is not None and info.config.max_msgs_per_subject != settings.history:
        problems.append(
            f"history={info.config.max_msgs_per_subject} (configured {settings.history})"
        )
    if problems:
        raise BusError(
            f"bucket {settings.name} exists with {', '.join(problems)}; llmgw does not recreate it "
            f"(that would lose its contents): change the setting to match, or edit the bucket with "
            f"`nats kv edit {settings.name}`"
        )
    if cluster and (info.config.num_replicas or 1) == 1 and settings.replicas is None:
        _warn_r1(settings.name, cluster, "it has replicas=1")
    # a bucket made by another tool may allow bigger values; llmgw still keeps to its own cap
    bucket_max = info.config.max_msg_size or -1
    return MAX_VALUE_BYTES if bucket_max <= 0 else min(bucket_max, MAX_VALUE_BYTES)


def _warn_r1(bucket: str, cluster: str, what: str) -> None:
    log.warning(
        "bucket %s on NATS cluster %s: %s, so it lives on ONE server of the cluster, and losing "
        "that server stops the whole control plane; give every component --bucket-replicas 3 "
        "(LLMGW_BUCKET_REPLICAS; nats.bucket_replicas in the agent config), and raise an "
        "existing bucket with `nats stream edit KV_%s --replicas 3`",
        bucket,
        cluster,
        what,
        bucket,
    )


def _server_info(nc: Client) -> dict[str, Any]:
    # the INFO the server sent: `cluster` is its cluster's name (absent on a lone server),
    # `jetstream` whether it runs JetStream; nats-py keeps it only privately
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}


def _revision_in(description: str | None) -> int | None:
    """N in JetStream's "wrong last sequence: N"."""
    _, _, tail = (description or "").rpartition(":")
    return int(tail) if tail.strip().isdigit() else None


def _too_big(key: str, data: bytes, revision: int, limit: int) -> bool:
    if len(data) <= limit:
        return False
    log.warning(
        "skipping %s (revision %d): its value is %s bytes, over the limit of %s; remove it "
        "with `nats kv del <bucket> %s` and fix its writer",
        key,
        revision,
        f"{len(data):,}",
        f"{limit:,}",
        key,
    )
    return True


def _decode_or_log(key: str, data: bytes, revision: int, decode: Decoder[T]) -> T | None:
    """Decode and check against the key (llmgw.bus.trust); log and return None if either
    fails."""
    try:
        value = decode(data)
        trust.check(key, value)
    except trust.RecordRejected as e:
        # names the key, and says "spoof attempt" when the value claims another owner
        log.warning("skipping %s (revision %d): %s", key, revision, e)
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        preview = data[:80].decode("utf-8", "replace")
        log.warning(
            "skipping %s (revision %d): value does not decode: %s (value starts %r); "
            "fix it or remove it with `nats kv del <bucket> %s`",
            key,
            revision,
            e,
            preview,
            key,
        )
        return None
    return value


def _server_url(nc: Client) -> str:
    url = nc.connected_url
    return f"{url.scheme}://{url.netloc}" if url else "?"


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text


def _is_refusal(e: BaseException) -> bool:
    text = _describe(e).lower()
    return isinstance(e, ssl.SSLError) or "authorization" in text


def _dropped(e: BaseException) -> bool:
    text = _describe(e).lower()
    return isinstance(e, ConnectionError) or any(
        t in text for t in ("broken pipe", "connection reset", "unexpected eof", "connection lost")
    )


def _log_nats_error(e: BaseException, settings: NatsSettings, first_connect: bool = False) -> None:
    text = _describe(e)
    who = f" claimed identity {settings.identity}" if settings.identity else ""
    cert = f"certificate {settings.tls_cert}" if settings.tls_cert else "no client certificate"
    if "Authorization Violation" in text or "authorization" in text.lower():
        log.error(
            "NATS refused the connection (authorization violation): %s,%s; check that the "
            "server maps this certificate's CN to a user",
            cert,
            who,
        )
    elif isinstance(e, ssl.SSLError):
        log.error("TLS handshake with NATS failed: %s (%s,%s)", text, cert, who)
    elif "permissions violation" in text.lower():
        log.error("NATS refused a subject: %s (%s,%s)", text, cert, who)
    elif first_connect and (settings.tls_ca or settings.tls_cert) and _dropped(e):
        # TLS 1.3 checks the client certificate after the handshake: a refusal often reaches
        # us as a broken pipe or a reset rather than as the server's alert
        log.error(
            "NATS closed the TLS connection while setting it up (%s): the server may require a "
            "client certificate or refuse this one (%s,%s); retrying",
            text,
            cert,
            who,
        )
    elif first_connect:
        log.warning("cannot connect to NATS at %s: %s; retrying", ", ".join(settings.urls), text)
    else:
        log.debug("NATS: %s", text)
