"""A watch on the bucket that knows when it has caught up.

One ordered push consumer (the latest value per key, then live changes), as nats-py's
`KeyValue.watch`, but with a different rule for "caught up". nats-py signals it when the
consumer has nothing pending and the client has received nothing yet, which is also true
while the first value is still on its way (a 900 KB value made `llmgw status` print
"0 node(s)" in a few runs out of twenty). Nor is a delivery's own "nothing pending" enough:
while a key is rewritten, the server counts its old message gone before its new one
stored, and says 0 in between (a key rewritten every 5 ms was missing from 1.3% of
lists); and a consumer placed on a server that has just restarted reads that server's
copy of the stream, which may be seconds behind (every key 8 s old, within 0.2 s of the
restart). So the stream's leader decides, in two steps. Right after the consumer is made, it is asked
for the last sequence stored on the watched keys (`last_sequence`): once that is received,
the consumer's copy is as current as the leader was then. A delivery that says nothing is
pending before then only makes it ask again (a message deleted since is not waited for).
Then the leader is asked which keys it holds (`stored_subjects`): a key rewritten while the
consumer was on its way has had its message deleted before the consumer reached it, and
may have been rewritten past that sequence meanwhile; each one not received is read from
the leader (`last_message`), and the watch is caught up. What the replay delivers is held
until then, the latest entry per key, and handed over in the order stored: a reader never
sees a value older than the bucket held when the watch started, nor a key left out.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE

log = logging.getLogger(__name__)

# how long the server keeps a consumer nobody listens to: a closed watch (or a `llmgw status`
# that exited) leaves nothing behind for long, and a reconnecting Bus re-creates its watches
INACTIVE_THRESHOLD = 5.0
QUEUE_SIZE = 256  # entries waiting for the reader; the consumer's flow control holds the rest
# seconds a watch waits for the consumer it makes and for the leader's answers: one asked
# during an election is asked again soon after it, not after nats-py's 5 s
START_TIMEOUT = 1.0
# seconds between the idle heartbeats of a watch's consumer; two missed and nats-py makes it
# again where the last one stopped. Its default, 5 s, left a watch whose server died silent
# for 10-20 s (a router routing from a table that long out of date); at 2 s it is 4-6 s, for
# one small message every 2 s per idle watch (10,000 agents: 5,000 a second to the servers)
WATCH_HEARTBEAT = 2.0
_NO_MESSAGE = 10037  # JetStream: "no message found"


@dataclass(frozen=True, slots=True)
class RawEntry:
    key: str
    data: bytes  # empty for a deletion
    revision: int
    deleted: bool


def delivery(reply: str) -> tuple[int, int, int]:
    """(stream sequence, consumer sequence, messages pending) of a JetStream delivery, from
    its reply subject: `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer
    seq>.<time>.<pending>`, or with a domain and account hash after `ACK` (12 tokens and
    more, nats-server 2.9+). nats-py's `msg.metadata` builds two dataclasses and a datetime
    for the same three numbers, 4.5 µs a message: a quarter of a second in the replay of a
    10,000-node bucket. ValueError when `reply` is no such subject."""
    tokens = reply.split(".")
    if tokens[:2] != ["$JS", "ACK"]:
        raise ValueError(f"not a JetStream delivery: {reply[:200]!r}")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[6]), int(tokens[8])
    if len(tokens) >= 11:
        return int(tokens[7]), int(tokens[8]), int(tokens[10])
    raise ValueError(f"not a JetStream delivery: {reply[:200]!r}")


async def _request(nc: Client, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    """A JetStream API request; its answer, or the APIError it carries (nats-py raises what
    it raises when nothing answers: an election)."""
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=START_TIMEOUT)
    answer = json.loads(msg.data)
    if answer.get("error"):
        raise nats.js.errors.APIError.from_error(answer["error"])
    return answer


async def last_message(nc: Client, stream: str, subjects: str) -> dict[str, Any] | None:
    """The last message `stream` stores on `subjects` (a wildcard allowed; None: none), as
    JetStream's API gives it (`seq`, `subject`, base64 `data` and `hdrs`), from the stream's
    leader: a non-direct get, which no other copy of the stream answers."""
    try:
        answer = await _request(nc, f"$JS.API.STREAM.MSG.GET.{stream}", {"last_by_subj": subjects})
    except nats.js.errors.APIError as e:
        if e.err_code == _NO_MESSAGE:
            return None
        raise
    return answer["message"]


async def last_sequence(nc: Client, stream: str, subjects: str) -> int:
    """The sequence of the last message `stream` stores on `subjects` (0: none), as its
    leader says."""
    message = await last_message(nc, stream, subjects)
    return 0 if message is None else int(message["seq"])


async def stored_subjects(nc: Client, stream: str, subjects: str) -> set[str]:
    """Every subject matching `subjects` that `stream` stores a message on (a deleted key's
    marker included), as its leader says, a page of up to 100,000 at a time."""
    found: set[str] = set()
    while True:
        answer = await _request(
            nc,
            f"$JS.API.STREAM.INFO.{stream}",
            {"subjects_filter": subjects, "offset": len(found)},
        )
        page = (answer.get("state") or {}).get("subjects") or {}
        found.update(page)
        if not page or len(found) >= answer.get("total", 0):
            return found


def _entry(prefix: str, message: dict[str, Any]) -> RawEntry:
    """A message as `last_message` gives it, as the watch's entry of its key."""
    headers = base64.b64decode(message.get("hdrs") or b"")
    fields = dict(
        (name.strip(), value.strip())
        for name, _, value in (
            line.partition(":") for line in headers.decode(errors="replace").splitlines()[1:]
        )
    )
    deleted = _deleted(fields.get(KV_OP), fields.get(KV_MARKER_REASON))
    return RawEntry(
        key=message["subject"][len(prefix) :],
        data=b"" if deleted else base64.b64decode(message.get("data") or b""),
        revision=int(message["seq"]),
        deleted=deleted,
    )


def _deleted(op: str | None, reason: str | None) -> bool:
    # a TTL or age expiry marker (nats-server 2.11+) says the key is gone
    return op in (KV_DEL, KV_PURGE) or reason in ("MaxAge", "Purge", "Remove")


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


CAUGHT_UP = _Marker("CAUGHT_UP")
_STOP = _Marker("STOP")


class KeyWatch:
    """Iterate for RawEntry items and exactly one CAUGHT_UP, after the replay; stop() ends
    the iteration."""

    def __init__(self, nc: Client, bucket: str, pattern: str) -> None:
        self._nc = nc
        self._stream = f"KV_{bucket}"
        self._prefix = f"$KV.{bucket}."
        self._subjects = f"$KV.{bucket}.{pattern}"
        # items for the reader: an entry, a marker, or the replay (entries, then CAUGHT_UP)
        self._queue: asyncio.Queue[RawEntry | _Marker | tuple[RawEntry | _Marker, ...]] = (
            asyncio.Queue(QUEUE_SIZE)
        )
        self._ready: list[RawEntry | _Marker] = []  # the replay being handed out, reversed
        self._sub: Any = None
        self._replay: dict[str, RawEntry] | None = {}  # latest per key; None once caught up
        # the sequence to receive before the replay is handed over: the leader's last one,
        # then the latest of the keys read from it; None: not known yet
        self._target: int | None = None
        self._received = 0  # highest stream sequence received
        self._keys_read = False  # the keys the leader holds were asked, the missing read
        self._asking: asyncio.Task[None] | None = None  # the target asked again
        self._reading: asyncio.Task[None] | None = None  # the keys asked
        self._stopped = False

    @classmethod
    async def start(
        cls,
        js: JetStreamContext,
        nc: Client,
        bucket: str,
        pattern: str,
        heartbeat: float = WATCH_HEARTBEAT,
    ) -> KeyWatch:
        watch = cls(nc, bucket, pattern)
        watch._sub = await js.subscribe(
            watch._subjects,
            stream=watch._stream,  # no stream lookup: nodes may not list streams
            cb=watch._on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold=INACTIVE_THRESHOLD,
            idle_heartbeat=heartbeat,
        )
        try:
            # asked once the consumer exists: whatever is stored later, it delivers too
            watch._target = await last_sequence(watch._nc, watch._stream, watch._subjects)
        except BaseException:
            await watch.stop()
            raise
        watch._advance()
        return watch

    async def _on_msg(self, msg: Any) -> None:
        stream_seq, _, pending = delivery(msg.reply)
        deleted = False
        if msg.headers:
            deleted = _deleted(msg.headers.get(KV_OP), msg.headers.get(KV_MARKER_REASON))
        entry = RawEntry(
            key=msg.subject[len(self._prefix) :],
            data=b"" if deleted else msg.data,
            revision=stream_seq,
            deleted=deleted,
        )
        self._received = max(self._received, stream_seq)
        if self._replay is None:
            await self._queue.put(entry)
            return
        self._keep(entry)
        self._advance()
        if self._replay is not None and pending == 0:
            # the server has nothing more here, yet the leader stores a later message: a
            # key being rewritten, a copy behind the leader, or a message deleted since
            if self._asking is None or self._asking.done():
                self._asking = asyncio.get_running_loop().create_task(self._target_again())

    def _keep(self, entry: RawEntry) -> None:
        assert self._replay is not None
        held = self._replay.get(entry.key)
        if held is None or held.revision < entry.revision:
            self._replay[entry.key] = entry

    def _advance(self) -> None:
        """Once the target is received: ask the keys, then hand the replay over."""
        if self._replay is None or self._target is None or self._received < self._target:
            return
        if not self._keys_read:
            if self._reading is None:
                self._reading = asyncio.get_running_loop().create_task(self._read_keys())
            return
        replay, self._replay = self._replay, None
        entries: Iterable[RawEntry] = sorted(replay.values(), key=lambda e: e.revision)
        # one item: the queue is empty until now (the replay was held here)
        self._queue.put_nowait((*entries, CAUGHT_UP))

    async def _target_again(self) -> None:
        try:
            target = await last_sequence(self._nc, self._stream, self._subjects)
        except Exception as e:  # noqa: BLE001 - the next delivery asks again
            log.debug("watch %s: last sequence not known (%s)", self._subjects, e)
            return
        # the leader holds nothing past what was received: whatever the target was (its
        # message deleted since), there is nothing more to wait for
        if not self._stopped and target <= self._received:
            self._target = target
            self._advance()

    async def _read_keys(self) -> None:
        """Read from the leader each key it holds that the replay did not deliver; the
        target becomes the latest of them, so that what is handed over is all the stream
        stored up to a point, in its order. Asked again until answered (an election)."""
        delay = 0.05
        while True:
            try:
                subjects = await stored_subjects(self._nc, self._stream, self._subjects)
                assert self._replay is not None
                for subject in subjects:
                    if subject[len(self._prefix) :] in self._replay:
                        continue
                    message = await last_message(self._nc, self._stream, subject)
                    if message is not None:
                        entry = _entry(self._prefix, message)
                        self._keep(entry)
                        self._target = max(self._target or 0, entry.revision)
                break
            except Exception as e:  # noqa: BLE001 - asked again
                log.debug("watch %s: keys not known (%s); asking again", self._subjects, e)
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        self._keys_read = True
        self._advance()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for task in (self._asking, self._reading):
            if task is not None:
                task.cancel()
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
        except Exception as e:  # noqa: BLE001 - a closed connection: the server drops it anyway
            log.debug("watch: unsubscribe failed (%s); the consumer expires by itself", e)
        # make room for the end marker: a stopped watch's unread entries do not matter
        self._ready.clear()
        while True:
            try:
                self._queue.put_nowait(_STOP)
                break
            except asyncio.QueueFull:
                self._queue.get_nowait()

    def __aiter__(self) -> KeyWatch:
        return self

    async def __anext__(self) -> RawEntry | _Marker:
        if not self._ready:
            item = await self._queue.get()
            if item is _STOP:
                self._queue.put_nowait(_STOP)  # stays stopped for any later reader
                raise StopAsyncIteration
            self._ready = list(reversed(item)) if isinstance(item, tuple) else [item]
        return self._ready.pop()
