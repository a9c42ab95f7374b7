"""The one writer of the leading controller: it applies a pass's changes to the bucket.

Every write is stamped with the leadership's epoch and fenced with the leader key: the
server stores it only while the key is still at the revision this controller gave it, so a
leader deposed while stalled writes nothing after the takeover. Writes go in the order they
were decided (a replica before its assignments), health in atomic batches where the stream
allows them. What is stored is mirrored into the view at once, and each change is said,
from the one table in controller/changes.py, as its log line and event.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import anyio

from llmgw.bus import keys
from llmgw.bus.client import BATCH_MAX, Bus, Fence, FencedOff, ValueTooLarge, Write
from llmgw.controller.changes import Change, Notice, batched, mirror, said, stamped
from llmgw.controller.leadership import Leadership
from llmgw.controller.link import Link
from llmgw.controller.view import View

log = logging.getLogger(__name__)


class NotLeading(Exception):
    """Leadership was lost during a pass: stop writing."""


class FencedWriter:
    def __init__(self, bus: Bus, view: View, leadership: Leadership, link: Link) -> None:
        self.bus = bus
        self.view = view
        self.leadership = leadership
        self.link = link
        self.fenced_off = 0  # writes the server refused: another controller had taken over
        # One write at a time, renewals included: a write is fenced with the revision the
        # last renewal left, and a cluster's stream leader refuses (without comparing) a
        # conditional write while another on the same key is in flight.
        self.lock = anyio.Lock()
        self.batches_asked = anyio.Event()  # the stream said whether it takes batches

    def fence(self) -> Fence:
        """What this controller's writes are fenced with now; NotLeading when it may not
        write (it does not lead, or its view does not hold its takeover yet)."""
        revision = self.leadership.fence(self.view.leader_rev)
        if revision is None:
            raise NotLeading
        return Fence(keys.leader(), revision)

    async def apply(self, changes: Sequence[Change | Notice]) -> list[Change]:
        """Write every change in order, said as it lands; the changes written. Raises
        NotLeading at the first write refused (nothing after it is written) and BusError
        when the link fails; a record too large to write is said as the bug it is and
        skipped, the others still written."""
        done: list[Change] = []
        i = 0
        while i < len(changes):
            item = changes[i]
            if isinstance(item, Notice):
                await self._say(item)
                i += 1
                continue
            if batched(item):
                j = i
                while j < len(changes) and isinstance(changes[j], Change) and batched(changes[j]):
                    j += 1
                run = [c for c in changes[i:j] if isinstance(c, Change)]
                done += await self._write_batched(run)
                i = j
                continue
            if await self._write_one(item):
                done.append(item)
            i += 1
        return done

    async def _write_one(self, change: Change) -> bool:
        epoch = self.leadership.epoch
        record = None if change.record is None else stamped(change.record, epoch)
        key = change.key
        try:
            if record is None:
                await self._fenced(key, lambda fence: self.bus.delete(key, fence=fence))
            else:
                await self._fenced(key, lambda fence: self.bus.put(key, record, fence=fence))
        except ValueTooLarge:
            # the record is wrong, not the link: the others are still written
            parsed = keys.parse(key)
            family, subject = (parsed.prefix, parsed.ids[0]) if parsed else (key, "")
            log.exception("bug: the %s record of %s is too large to write", family, subject)
            return False
        mirror(self.view, key, record)
        await self._say(change)
        return True

    async def _write_batched(self, run: list[Change]) -> list[Change]:
        """Many fenced writes: in atomic batches, one round trip each, where the stream
        allows them (Bus.allow_batches); else one at a time (~3,000 a second on one server,
        ~1,000 on a 3-server cluster). Each batch or write is timed for the link."""
        epoch = self.leadership.epoch
        writes = [Write(c.key, None if c.record is None else stamped(c.record, epoch)) for c in run]
        await self.batches_asked.wait()  # asked at start, beside the watch's replay
        size = BATCH_MAX if self.bus.batches is True else 1
        for start in range(0, len(writes), size):
            chunk = writes[start : start + size]
            await self._timed(
                self._fenced(
                    chunk[0].key, lambda fence, chunk=chunk: self.bus.write_all(chunk, fence=fence)
                )
            )
        for w in writes:
            mirror(self.view, w.key, w.value)
        for c in run:
            await self._say(c)
        return run

    async def _fenced(self, key: str, write: Callable[[Fence], Awaitable[object]]) -> None:
        """Make one write on the condition, checked by the server with the write itself,
        that the leader key is still at the revision this controller last gave it. A leader
        deposed while it was stalled (a paused process, a partitioned link whose bytes
        arrive late) has every later write refused, and stops leading."""
        async with self.lock:
            fence = self.fence()
            try:
                await write(fence)
            except FencedOff as e:
                self.fenced_off += 1
                self.leadership.step_down(
                    f"the server refused its write to {key}: the leader key moved on from "
                    f"revision {e.fence.revision}"
                    + (f" to {e.now_at}" if e.now_at is not None else "")
                    + f" (epoch {self.leadership.epoch} is over: another controller took over)"
                )
                raise NotLeading from None

    async def _timed(self, write: Awaitable[None]) -> None:
        """A write, its time told to the link: one that hangs makes it suspect."""
        started = anyio.current_time()
        try:
            await write
        finally:
            self.link.wrote(anyio.current_time() - started)

    async def _say(self, item: Change | Notice) -> None:
        s = said(item.why)
        if s is None:
            return
        log.log(s.level, "%s", s.text)
        if s.event is not None:
            await self.bus.publish_event(
                s.event.kind, s.event.subject, s.event.text, **s.event.data
            )
