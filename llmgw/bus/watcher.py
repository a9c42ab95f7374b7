"""A watch on the bucket that knows when it has caught up.

One ordered push consumer (the latest value per key, then live changes), as nats-py's
`KeyValue.watch`, but with a different rule for "caught up". nats-py signals it when the
consumer has nothing pending and the client has received nothing yet, which is also true
while the first value is still on its way (a 900 KB value made `llmgw status` print
"0 node(s)" in a few runs out of twenty). Here the consumer's own account decides: right
after it is created, its info says how many messages it has delivered and how many it still
holds (`delivered + pending`, the replay at that moment); the watch is caught up once it
has received that many, or a message with nothing pending after it. A later value arriving
meanwhile only makes the replay end later.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext, api
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE

log = logging.getLogger(__name__)

# how long the server keeps a consumer nobody listens to: a closed watch (or a `llmgw status`
# that exited) leaves nothing behind for long, and a reconnecting Bus re-creates its watches
INACTIVE_THRESHOLD = 5.0
QUEUE_SIZE = 256  # entries waiting for the reader; the consumer's flow control holds the rest


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

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # "$KV.<bucket>."
        self._queue: asyncio.Queue[RawEntry | _Marker] = asyncio.Queue(QUEUE_SIZE)
        self._sub: Any = None
        self._replay: int | None = None  # messages in the replay; None: not known yet
        self._received = 0  # highest consumer sequence received
        self._caught_up = False
        self._stopped = False

    @classmethod
    async def start(cls, js: JetStreamContext, bucket: str, pattern: str) -> KeyWatch:
        watch = cls(f"$KV.{bucket}.")
        watch._sub = await js.subscribe(
            f"$KV.{bucket}.{pattern}",
            stream=f"KV_{bucket}",  # no stream lookup: nodes may not list streams
            cb=watch._on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold=INACTIVE_THRESHOLD,
        )
        try:
            info = await watch._sub.consumer_info()
        except BaseException:
            await watch.stop()
            raise
        if watch._replay is None:
            watch._replay = info.delivered.consumer_seq + (info.num_pending or 0)
        await watch._check_caught_up()
        return watch

    async def _on_msg(self, msg: Any) -> None:
        stream_seq, consumer_seq, pending = delivery(msg.reply)
        deleted = False
        if msg.headers:
            op = msg.headers.get(KV_OP)
            reason = msg.headers.get(KV_MARKER_REASON)
            # a TTL or age expiry marker (nats-server 2.11+) says the key is gone
            deleted = op in (KV_DEL, KV_PURGE) or reason in ("MaxAge", "Purge", "Remove")
        entry = RawEntry(
            key=msg.subject[len(self._prefix) :],
            data=b"" if deleted else msg.data,
            revision=stream_seq,
            deleted=deleted,
        )
        await self._queue.put(entry)
        self._received = max(self._received, consumer_seq)
        if pending == 0:
            self._replay = 0  # nothing after it: caught up, whatever the info said or will say
        await self._check_caught_up()

    async def _check_caught_up(self) -> None:
        if self._caught_up or self._replay is None or self._received < self._replay:
            return
        self._caught_up = True
        await self._queue.put(CAUGHT_UP)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._sub is not None:
                await self._sub.unsubscribe()
        except Exception as e:  # noqa: BLE001 - a closed connection: the server drops it anyway
            log.debug("watch: unsubscribe failed (%s); the consumer expires by itself", e)
        # make room for the end marker: a stopped watch's unread entries do not matter
        while True:
            try:
                self._queue.put_nowait(_STOP)
                break
            except asyncio.QueueFull:
                self._queue.get_nowait()

    def __aiter__(self) -> KeyWatch:
        return self

    async def __anext__(self) -> RawEntry | _Marker:
        item = await self._queue.get()
        if item is _STOP:
            self._queue.put_nowait(_STOP)  # stays stopped for any later reader
            raise StopAsyncIteration
        return item
