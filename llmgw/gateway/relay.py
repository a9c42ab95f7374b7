"""What the gateway reads of an answer as the router relays it: its `usage` (the engine's
own count), and for a stream its events as they come (a stream is charged as it goes, and
one cut short is charged what it generated). Fits the router's ticket (router/gate.py):
`chunk(data)` for each piece relayed, `settle(status, outcome)` once at the end.

Reading is bounded: a stream's line is kept at most MAX_LINE bytes (a longer one is not
read for usage, only counted), a whole answer at most usage.MAX_USAGE_JSON bytes.
"""

from __future__ import annotations

import time

from . import usage as usage_
from .gateway import Admission
from .usage import Usage

MAX_LINE = 1 << 20


class UsageReader:
    """The usage of one answer, from its bytes in the order relayed."""

    __slots__ = ("stream", "events", "_line", "_body", "_size", "_usage", "_too_long")

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.events = 0  # stream events with output (about one token each)
        self._line = bytearray()
        self._body: list[bytes] = []  # a whole answer's pieces, joined once at the end
        self._size = 0
        self._usage: Usage | None = None
        self._too_long = False

    def feed(self, data: bytes) -> None:
        if not self.stream:
            self._size += len(data)
            if self._size <= usage_.MAX_USAGE_JSON:
                self._body.append(data)
            else:
                self._too_long = True
            return
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                if len(self._line) + len(data) - start <= MAX_LINE:
                    self._line += data[start:]
                else:
                    self._too_long = True
                return
            if self._too_long:
                self._too_long = False
                self._line.clear()
                self.events += 1  # an event too long to read: output all the same
            else:
                line = self._line
                line += data[start:end]
                if line.startswith(b"data:"):  # (a blank line between events is no call)
                    self._event(bytes(line))
                line.clear()
            start = end + 1

    def _event(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return
        if b'"usage"' in payload:
            found, usage_only = usage_.read(payload)
            if found is not None:
                self._usage = found
                if usage_only:
                    return
        self.events += 1

    def usage(self, prompt_estimate: int = 0) -> Usage | None:
        """The engine's usage; for a stream that ended without one (cut short), what it
        generated (an event a token) and the prompt's estimate; None if nothing is known."""
        if not self.stream:
            return None if self._too_long else usage_.of_json(b"".join(self._body))
        if self._usage is not None:
            return self._usage
        if self.events:
            return Usage(prompt_estimate, self.events)
        return None


class GatewayTicket(UsageReader):
    """An admitted request as the router's relay sees it (router/gate.py's Ticket: the
    gateway's gate, router/keygate.py, hands one to every keyed request), reading the
    answer's usage as it passes (one object a request: it is the UsageReader), and giving
    the x-ratelimit-* headers of a limited key. `strip`: the gateway asked the engine for a
    stream's usage chunk that its client did not ask for, and that chunk is taken back out
    of what is relayed (the answer is then `rewrites`: its length is not the engine's)."""

    __slots__ = (
        "admission",
        "prompt_estimate",
        "replica",
        "over",
        "strip",
        "rewrites",
        "_created",
        "_first",
        "_pending",
        "_held",
    )

    def __init__(
        self,
        admission: Admission,
        *,
        stream: bool,
        prompt_estimate: int = 0,
        strip: bool = False,
    ) -> None:
        UsageReader.__init__(self, stream)
        self.admission = admission
        self._held = admission.held  # None: no limit to charge its tokens to
        self.prompt_estimate = prompt_estimate
        self.replica: str | None = None  # set by `answering`
        self.over = False  # a limit refused more tokens: the router ends the stream
        self.strip = self.rewrites = strip
        self._created = time.monotonic()  # ttft is a span: measured on the monotonic clock
        self._first: float | None = None
        self._pending = b""  # an event begun and not ended, held while stripping

    def answering(self, replica: str) -> tuple[tuple[bytes, bytes], ...]:
        """The replica answering ("" for none); the x-ratelimit-* headers of a limited key."""
        self.replica = replica or None
        held = self._held
        return () if held is None else held.header_pairs()

    def chunk(self, data: bytes, last: bool = False) -> bytes | None:
        """A piece of the answer as relayed (`last`: the answer ends with it): what to relay
        of it, or None once a limit refuses the stream more tokens (`over`: the router ends
        it there)."""
        if self._first is None:
            self._first = time.monotonic()
        if not self.stream:
            self.feed(data)
            return data
        # the common piece, an engine's write: whole events of output, each line of data a
        # JSON object, nothing to read for usage, to strip, or to hold; its events counted
        # as `feed` would count them, without reading it line by line
        whole = False
        if (
            data.endswith(b"\n\n")
            and not self._line
            and not self._pending
            and not self._too_long
            and b'"usage"' not in data
        ):
            events = data.count(b"\ndata: {") + data.startswith(b"data: {")
            whole = events == data.count(b"\ndata:") + data.startswith(b"data:")
        if whole:
            self.events += events
        else:
            self.feed(data)
        if self._held is not None and not self.over:
            self.over = not self._held.progress_now(self.events)
        if self.over:
            return None
        if whole or not self.strip:
            return data
        return self._strip(data, last)

    def _strip(self, data: bytes, last: bool) -> bytes:
        """`data` without the usage-only event; an event cut across chunks is held until it
        ends (at most MAX_LINE bytes: past that it is passed on, unread), and what is held
        when the answer ends goes with its last bytes."""
        data = self._pending + data if self._pending else data
        end = data.rfind(b"\n\n")
        if last and end + 2 < len(data):
            # the answer ends inside an event: what is complete is read, the rest passed on
            done, self._pending = data, b""
            return _without_usage(done) if b'"usage"' in done else done
        if end < 0:
            if len(data) > MAX_LINE:
                self._pending = b""
                return data
            self._pending = data
            return b""
        done, self._pending = data[: end + 2], data[end + 2 :]
        return _without_usage(done) if b'"usage"' in done else done

    def settle(self, status: int, outcome: str, refused: str | None = None) -> None:
        first = self._first
        self.admission.finish(
            status=status,
            usage=self.usage(self.prompt_estimate),
            replica=self.replica,
            ttft=None if first is None else first - self._created,
            refused=refused,
        )


def _without_usage(data: bytes) -> bytes:
    """SSE events, the usage-only ones left out (a last piece not ended by a blank line is
    kept as it is)."""
    events = data.split(b"\n\n")
    tail = events.pop()  # b"" when `data` ends with a blank line
    kept = b"".join(e + b"\n\n" for e in events if not _usage_only(e))
    return kept + tail


def _usage_only(event: bytes) -> bool:
    if b'"usage"' not in event:
        return False
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return usage_.is_usage_only_chunk(line[5:].strip())
    return False
