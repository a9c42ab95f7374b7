"""The bus as llmgw's components use it: one connection plus the llmgw bucket.

`Bus.connect()` connects (llmgw.bus.connection: backoff, failover), opens the bucket
(llmgw.bus.bucket) and then reads, writes, fences and watches its keys. Values are msgspec
records (llmgw.bus.records). A value that does not decode, is too big, or names another
owner than its key (llmgw.bus.trust) is never fatal (anyone allowed to write a key can put
anything in it): it is said once in the log and read as the one rule of
llmgw.bus.unreadable says (the last good value kept, or absent). Every failure of a call is a BusError
(llmgw.bus.errors), read from what nats-py raised by llmgw.bus.classify.

    async with Bus.open(settings, give_up_after=5) as bus:
        await bus.put(keys.lease("node05"), lease)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from . import classify, keys, records, requests, trust, unreadable
from .backoff import Backoff
from .bucket import MAX_VALUE_BYTES, ensure_bucket, open_bucket
from .connection import Connection
from .errors import (
    Absent,
    BusError,
    BusRefused,
    BusUnavailable,
    ConditionBusy,
    FencedOff,
    JetStreamNotReady,
    NatsUnreachable,
    ValueTooLarge,
    WrongRevision,
)
from .settings import DEFAULT_NATS_URL, BucketSettings, NatsSettings, check_url
from .trust import RAW
from .watcher import CAUGHT_UP, START_TIMEOUT, WATCH_HEARTBEAT, KeyWatch, RawEntry

# what callers import from here: the Bus and everything its signatures name
__all__ = [
    "DEFAULT_NATS_URL",
    "RAW",
    "MAX_VALUE_BYTES",
    "ValueTooLarge",
    "BucketSettings",
    "Bus",
    "BusError",
    "BusRefused",
    "BusUnavailable",
    "Decoder",
    "Entry",
    "Fence",
    "FencedOff",
    "JetStreamNotReady",
    "NatsSettings",
    "NatsUnreachable",
    "Synced",
    "Update",
    "check_url",
    "decoder",
    "ensure_bucket",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Decoder = Callable[[bytes], T]

_EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
# nats-server >= 2.11: the expected revision is that of this subject, not the written one's
_EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_FENCE_BUSY_ATTEMPTS = 40  # about 3 s of 10164s before a write gives up until the next pass
# atomic batch publishes (nats-server >= 2.12, on a stream that allows them): the headers
_BATCH_ID = "Nats-Batch-Id"
_BATCH_SEQUENCE = "Nats-Batch-Sequence"
_BATCH_COMMIT = "Nats-Batch-Commit"
# nats-server's default limit on one atomic batch (`max_batch_size`); a server configured
# lower says its own in error 10199, and the batches shrink to it
BATCH_MAX = 1000
_REQUEST_TIMEOUT = 5.0  # as nats-py's JetStream requests (the bucket's reads and writes)


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
class Write:
    """One write of a batch (`Bus.write_all`): `value` None deletes the key."""

    key: str
    value: msgspec.Struct | bytes | None


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


def decoder(type_: type[T]) -> Decoder[T]:
    return lambda data: records.decode(data, type_)


class Bus:
    """A connection plus the llmgw bucket."""

    def __init__(
        self,
        connection: Connection,
        kv: KeyValue,
        bucket: BucketSettings,
        max_value_bytes: int = MAX_VALUE_BYTES,
    ) -> None:
        self.connection = connection
        self.kv = kv
        self.js = connection.nc.jetstream()
        self.settings = connection.settings
        self.bucket = bucket
        self.max_value_bytes = max_value_bytes
        self.skipped = trust.SkippedValues()  # values its reads left out, said once each
        self._reconnect_listeners: list[Callable[[], Awaitable[None]]] = []
        self._watchers: set[KeyWatch] = set()
        self._closed = False
        # atomic batches: unknown until `allow_batches`, then True, or why not
        self.batches: bool | str = "not asked for (Bus.allow_batches)"
        self._batch_max = BATCH_MAX
        connection.after_reconnect = self._on_reconnected

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
        wait_for_server: bool = True,
    ) -> Bus:
        """Connect (retrying with backoff until it works, or for `give_up_after` seconds) and
        open the bucket, creating it if missing. Settings that can never work (a URL that is
        not NATS's, a TLS file that is missing or not PEM) raise BusError at once, and so
        does no server listening, unless `wait_for_server` (one may be starting)."""
        bucket = bucket or BucketSettings()
        deadline = None if give_up_after is None else time.monotonic() + give_up_after
        connection = await Connection.open(settings, deadline, wait_for_server=wait_for_server)
        try:
            kv, max_value = await open_bucket(connection, bucket, deadline)
        except BaseException:
            await connection.close()
            raise
        return cls(connection, kv, bucket, max_value)

    def on_reconnected(self, cb: Callable[[], Awaitable[None]]) -> None:
        """Run `cb` after every reconnect (re-read assignments, re-report shards...)."""
        self._reconnect_listeners.append(cb)

    def forget_reconnected(self, cb: Callable[[], Awaitable[None]]) -> None:
        """No longer run `cb`: its owner stopped while the bus goes on (many simulated
        agents share one connection, llmgw.sim)."""
        with contextlib.suppress(ValueError):
            self._reconnect_listeners.remove(cb)

    async def _on_reconnected(self) -> None:
        # Listeners first: they may need to know the view is stale before the watches
        # replay the bucket.
        for cb in list(self._reconnect_listeners):
            try:
                await cb()
            except Exception:  # noqa: BLE001
                log.exception("reconnect handler failed")
        # A watch resumes by itself only after its idle-heartbeat check (13-16 s): restart ours now.
        await self.restart_watches()

    async def restart_watches(self) -> None:
        """Make every watch of this Bus read the bucket again from a new consumer (each
        says `Synced` again once it has): after a reconnect, and when its owner finds a
        watch has stopped delivering (its consumer was on a server that died, say)."""
        for w in list(self._watchers):
            await w.stop()

    @property
    def nc(self) -> Client:
        return self.connection.nc

    @property
    def backoff(self) -> Backoff:
        return self.connection.backoff

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    @property
    def reconnects(self) -> int:
        return self.connection.reconnects

    async def round_trip(self, timeout: float = 2.0) -> float:
        """Seconds for a PING/PONG with the server; BusUnavailable if none within `timeout`.
        What a component checks before concluding that others went silent, not itself."""
        return await self.connection.round_trip(timeout)

    async def close(self) -> None:
        """Stop watches, then close the connection; bounded so shutdown never hangs."""
        self._closed = True
        for w in list(self._watchers):
            try:
                await asyncio.wait_for(w.stop(), 0.5)
            except Exception:  # noqa: BLE001
                pass
        self._watchers.clear()
        await self.connection.close()

    # --- requests -------------------------------------------------------------------------

    async def _js(self, request: Awaitable[T], doing: str) -> T:
        """A JetStream request, watching for a server that answers PINGs but whose JetStream
        no longer answers (cut off from the other servers of its cluster): nats-py stays on
        it, since the connection is fine, and every read and write would fail until the
        partition heals. A request without an answer asks the connection to check."""
        try:
            return await classify.answer(request, doing)
        except BusUnavailable as e:
            if e.jetstream_silent:
                self.connection.jetstream_silent()
            raise

    # --- the bucket ---------------------------------------------------------------------

    def _sized(self, key: str, data: bytes) -> bytes:
        if len(data) > self.max_value_bytes:
            raise ValueTooLarge(
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
            return await self._js(self.kv.put(key, data), f"put {key}")
        return await self._fenced(key, data, fence, {})

    async def create(self, key: str, record: msgspec.Struct) -> int | None:
        """Write only if the key does not exist; None if it does."""
        data = self._sized(key, records.encode(record))
        try:
            return await self._js(self.kv.create(key, data), f"create {key}")
        except WrongRevision:
            return None

    async def update(self, key: str, record: msgspec.Struct, last: int) -> int | None:
        """Compare-and-set on the revision; None if someone else wrote in between."""
        data = self._sized(key, records.encode(record))
        try:
            return await self._js(self.kv.update(key, data, last=last), f"update {key}")
        except WrongRevision:
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
            await self._js(self.kv.delete(key, last=last), f"delete {key}")
        except (WrongRevision, ConditionBusy):
            return False
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
        doing = f"write {key} fenced by {fence.key}"
        for _ in range(_FENCE_BUSY_ATTEMPTS):
            try:
                publish = self.js.publish(self._subject(key), data, headers=headers)
                return (await self._js(publish, doing)).seq
            except WrongRevision as e:
                raise FencedOff(key, fence, e.now_at) from None
            except ConditionBusy:
                # A cluster's stream leader lets one conditional write on a subject be in
                # flight at a time and refuses the others without comparing: that decides
                # nothing.
                await asyncio.sleep(backoff.next_delay())
        raise BusError(
            f"write to {key} not made: {fence.key} stayed busy with other conditional writes "
            f"for {_FENCE_BUSY_ATTEMPTS} attempts; it is tried again on the next pass"
        )

    # --- many fenced writes at once ------------------------------------------------------

    async def allow_batches(self) -> bool | str:
        """Let the bucket's stream take atomic batch publishes (nats-server >= 2.12), which
        `write_all` uses: its first write carries the fence and the server stores all of
        them or none, so many fenced writes cost one round trip, not one each. The stream's
        own configuration is sent back with `allow_atomic` set, nothing else changed. True,
        or why not (an older server, an identity without $JS.API.STREAM.UPDATE), which the
        caller says: `write_all` then writes one at a time."""
        stream = f"KV_{self.bucket.name}"
        try:
            info = await self._js(
                self._api(f"$JS.API.STREAM.INFO.{stream}", b""), f"reading stream {stream}"
            )
            config = info.get("config") or {}
            if config.get("allow_atomic"):
                self.batches = True
                return True
            version = self.connection.nc.connected_server_version
            if (version.major, version.minor) < (2, 12):
                self.batches = f"nats-server {version} has no atomic batches (2.12 has)"
                return self.batches
            config["allow_atomic"] = True
            await self._js(
                self._api(f"$JS.API.STREAM.UPDATE.{stream}", json.dumps(config).encode()),
                f"allowing atomic batches on stream {stream}",
            )
        except BusError as e:
            self.batches = (
                f'{e}; set "allow_atomic": true in stream {stream}\'s configuration '
                f"(nats-server >= 2.12), or let the controller's identity publish to "
                f"$JS.API.STREAM.UPDATE.{stream}"
            )
            return self.batches
        self.batches = True
        log.info("stream %s now allows atomic batches (many fenced writes at once)", stream)
        return True

    async def _api(self, subject: str, payload: bytes, headers: dict[str, str] | None = None):
        """A request whose answer is JetStream's JSON (an API call, a publish's ack): the
        answer, or the APIError it carries."""
        msg = await self.connection.nc.request(
            subject, payload, timeout=_REQUEST_TIMEOUT, headers=headers
        )
        answer = json.loads(msg.data)
        if isinstance(answer, dict) and answer.get("error"):
            raise nats.js.errors.APIError.from_error(answer["error"])
        return answer

    async def write_all(self, writes: Sequence[Write], *, fence: Fence) -> None:
        """Make every write in `writes` while `fence.key` is at its revision (FencedOff if
        not): in atomic batches of up to BATCH_MAX, each stored whole or not at all, when
        the stream allows them (`allow_batches`), else one at a time. A batch whose answer
        is lost has an unknown outcome as a whole, like any one write."""
        start = 0
        while start < len(writes):
            if self.batches is not True:
                for w in writes[start:]:
                    if w.value is None:
                        await self.delete(w.key, fence=fence)
                    else:
                        await self.put(w.key, w.value, fence=fence)
                return
            chunk = writes[start : start + self._batch_max]
            try:
                await self._batch(chunk, fence)
            except BusRefused as e:
                if e.err_code == classify.ATOMIC_DISABLED:
                    # edited away since: nothing of this batch was stored
                    self.batches = f"stream KV_{self.bucket.name}: {e.description}"
                    log.warning("atomic batches refused (%s): writing one at a time", e)
                    continue
                if e.err_code == classify.ATOMIC_TOO_LARGE and len(chunk) > 1:
                    said = classify.revision_in(e.description)  # "...too large: N"
                    self._batch_max = said if said and said < len(chunk) else len(chunk) // 2
                    continue
                raise
            start += len(chunk)

    async def _batch(self, writes: Sequence[Write], fence: Fence) -> None:
        """One atomic batch, the fence on its first write; ConditionBusy retried."""
        doing = f"write {len(writes)} keys ({writes[0].key}...) fenced by {fence.key}"
        messages = []
        for w in writes:
            if w.value is None:
                messages.append((self._subject(w.key), b"", {KV_OP: KV_DEL}))
            else:
                data = w.value if isinstance(w.value, bytes) else records.encode(w.value)
                messages.append((self._subject(w.key), self._sized(w.key, data), {}))
        backoff = Backoff(base=0.005, cap=0.1)
        nc = self.connection.nc
        for _ in range(_FENCE_BUSY_ATTEMPTS):
            batch_id = uuid.uuid4().hex
            last = len(messages)
            for n, (subject, data, headers) in enumerate(messages, 1):
                headers = {**headers, _BATCH_ID: batch_id, _BATCH_SEQUENCE: str(n)}
                if n == 1:
                    headers[_EXPECTED_LAST_SUBJECT_SEQUENCE] = str(fence.revision)
                    headers[_EXPECTED_LAST_SUBJECT_SEQUENCE_SUBJECT] = self._subject(fence.key)
                if n < last:
                    await self._js(nc.publish(subject, data, headers=headers), doing)
                    continue
                headers[_BATCH_COMMIT] = "1"
                try:
                    await self._js(self._api(subject, data, headers), doing)
                    return
                except WrongRevision as e:
                    raise FencedOff(writes[0].key, fence, e.now_at) from None
                except ConditionBusy:
                    await asyncio.sleep(backoff.next_delay())
        raise BusError(
            f"{doing}: not made, {fence.key} stayed busy with other conditional writes for "
            f"{_FENCE_BUSY_ATTEMPTS} attempts; it is tried again on the next pass"
        )

    def _subject(self, key: str) -> str:
        return f"$KV.{self.bucket.name}.{key}"

    async def _last(self, key: str) -> tuple[bytes | None, int]:
        """The key's value (None: deleted, purged, expired, or never written) and the
        revision of its last entry (0: it never had one)."""
        try:
            e = await self._js(self.kv.get(key), f"get {key}")
        except Absent as gone:
            return None, gone.revision
        if e.value is None or e.operation in (KV_DEL, KV_PURGE):
            return None, e.revision or 0  # a just-expired key can come back with value None
        return e.value, e.revision or 0

    async def deleted_at(self, key: str) -> int | None:
        """The revision of the key's deletion (what a compare-and-set recreating it names);
        0 if it never existed; None if it holds a value."""
        value, revision = await self._last(key)
        return None if value is not None else revision

    async def get_raw(self, key: str) -> tuple[bytes, int] | None:
        """The value's bytes and revision; None when absent (or over the size limit: logged)."""
        value, revision = await self._last(key)
        if value is None or _too_big(key, value, revision, self.max_value_bytes):
            return None
        return value, revision

    async def get(self, key: str, decode: Decoder[T]) -> Entry[T] | None:
        """The key's value, decoded and checked against the key (llmgw.bus.trust); None when
        absent or not believable (logged)."""
        raw = await self.get_raw(key)
        if raw is None:
            return None
        value = self._read(key, raw[0], raw[1], decode, None)
        return None if value is None else Entry(key, value, raw[1])

    def _read(self, key: str, data: bytes, revision: int, decode: Decoder[T], last: Any) -> Any:
        """`data` decoded and checked against its key (llmgw.bus.trust), or what the one
        rule (llmgw.bus.unreadable) reads instead, said once in the log: `last` kept,
        a cordon, or None."""
        if len(data) > self.max_value_bytes:
            data = trust.Oversized(len(data), self.max_value_bytes)
        parsed = keys.parse(key) or keys.parse_gateway(key)
        value, _ = unreadable.settle(
            key, parsed, data, revision, last, _checked(key, decode), self.skipped
        )
        return value

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
        self,
        pattern: str,
        decode: Decoder[T],
        *,
        until_synced: bool = False,
        heartbeat: float = WATCH_HEARTBEAT,
    ) -> AsyncIterator[Update[T] | Synced]:
        """Latest value per key, then `Synced`, then live updates; re-created after every
        reconnect (and `restart_watches`), reporting keys that vanished meanwhile as
        deletions. A view of the latest state, not a log: intermediate values may be
        skipped. `Synced` comes only once every value stored when the watch (re)started has
        been yielded (llmgw.bus.watcher). A consumer that goes silent for two `heartbeat`s
        (its server died) is made again where the last one stopped."""
        known: dict[str, int] = {}
        # an election is a few seconds: the next try soon after it, not 5 s later
        backoff = Backoff(base=0.05, cap=1.0)
        while not self._closed:
            try:
                watch = await KeyWatch.start(
                    self.nc.jetstream(timeout=START_TIMEOUT),
                    self.nc,
                    self.bucket.name,
                    pattern,
                    heartbeat,
                )
            except Exception as e:  # noqa: BLE001 - disconnected: retry
                log.debug("watch %s: cannot start (%s); retrying", pattern, classify.describe(e))
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
                    if item.deleted:
                        pass
                    elif decode is RAW:
                        value = item.data
                        if len(value) > self.max_value_bytes:
                            # the reader's one decoder reads it as a value that does not
                            # read (and logs it)
                            value = trust.Oversized(len(value), self.max_value_bytes)
                    else:
                        held = _HELD if item.key in known else None
                        value = self._read(item.key, item.data, item.revision, decode, held)
                        if value is _HELD:
                            continue  # the reader keeps the last good value it was given
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
            log.debug("event %s not published: %s", kind, classify.describe(e))

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> Any:
        """Every message on `subject` (events). Requests that make a component act go
        through `serve`, which tells them from what the server delivers on others' behalf."""
        return await classify.answer(self.nc.subscribe(subject, cb=cb), f"subscribe to {subject}")

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

        return await classify.answer(self.nc.subscribe(subject, cb=on_msg), f"serve {subject}")

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 5.0) -> bytes:
        msg = await classify.answer(
            self.nc.request(subject, payload, timeout=timeout), f"request on {subject}"
        )
        return msg.data


# a reader's value the watch does not hold itself (only revisions): kept, not yielded again
_HELD = object()


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


def _checked(key: str, decode: Decoder[T]) -> Decoder[T]:
    def read(data: bytes) -> T:
        value = decode(data)
        trust.check(key, value)
        return value

    return read
