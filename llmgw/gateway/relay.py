"""What the gateway reads of an answer as the router relays it: its `usage` (the engine's
own count, in its route's names: usage.py), and for a stream its events as they come (a
stream is charged as it goes, and one cut short is charged what it generated). Fits the
router's ticket (router/gate.py): `chunk(data)` for each piece relayed, `settle(status,
outcome)` once at the end.

An answer is read as what it is, whatever the request said: a stream when its first bytes
are server-sent events, a whole answer otherwise. Reading is bounded: a stream's line is
kept whole up to MAX_LINE bytes (a longer one, a response's last event with all its text,
is searched for its usage as a whole answer is, usage.Document), a whole answer of any
size is read by usage.Document. An answer whose usage cannot be read is metered by an
estimate (`GatewayTicket.settle`), never as nothing.
"""

from __future__ import annotations

import time

from . import usage as usage_
from .gateway import CHARS_PER_TOKEN, Admission
from .usage import Usage

MAX_LINE = 1 << 20
# how a stream of server-sent events may begin (a field, or a comment)
_SSE_STARTS = (b"data:", b"event:", b":", b"id:", b"retry:")


def _framing(data: bytes) -> bool | None:
    """Whether an answer beginning with `data` is a stream of events (None: too few bytes
    to say)."""
    start = data.lstrip()
    if start.startswith(_SSE_STARTS):
        return True
    if (not start or any(s.startswith(start) for s in _SSE_STARTS)) and len(data) < 64:
        return None
    return False


# the bytes that mark a stream's piece that may carry usage: `usage`, or on llama-server's
# own routes (/infill) its counts
USAGE_KEY = b'"usage"'
NATIVE_KEY = b'"tokens_predicted"'


def _may_carry_usage(data: bytes) -> bool:
    """A piece that may carry a usage in some route's names (usage.py)."""
    return USAGE_KEY in data or NATIVE_KEY in data


class UsageReader:
    """The usage of one answer, from its bytes in the order relayed. `stream`: what the
    request asked for, until the answer's first bytes say what it is."""

    __slots__ = (
        "stream",
        "events",
        "_line",
        "_long",
        "_body",
        "_size",
        "_big",
        "_usage",
        "_framed",
        "_sniffed",
        "usage_only",
    )

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.events = 0  # stream events with output (about one token each)
        self._line = bytearray()
        self._long: usage_.Document | None = None  # a stream line past MAX_LINE
        self._body: list[bytes] = []  # a whole answer's pieces, joined once at the end...
        self._size = 0
        self._big: usage_.Document | None = None  # ...or past MAX_USAGE_JSON, searched
        self._usage: Usage | None = None
        self._framed = False  # the answer's first bytes said what it is
        self._sniffed = b""  # first bytes too few to say it, held until they do
        # the payloads of the usage-only events read and not yet relayed, kept when they
        # are to be stripped (GatewayTicket: by these, without reading them again)
        self.usage_only: list[bytes] | None = None

    def feed(self, data: bytes) -> None:
        if not self._framed:
            data = self._sniffed + data
            framing = _framing(data)
            if framing is None:
                self._sniffed = data
                return
            self._sniffed = b""
            self.stream, self._framed = framing, True
        if not self.stream:
            self._whole(data)
            return
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                if self._long is None and len(self._line) + len(data) - start <= MAX_LINE:
                    self._line += data[start:]
                else:
                    self._too_long(data[start:])
                return
            if self._long is not None:
                self._too_long(data[start:end])
                self._long_ended()
            elif self._line:  # a line begun in an earlier piece
                line = self._line
                line += data[start:end]
                if line.startswith(b"data:"):
                    self._event(bytes(line))
                line.clear()
            elif data.startswith(b"data:", start, end):  # (a blank line is no call)
                self._event(data[start:end])
            start = end + 1

    def _whole(self, data: bytes) -> None:
        self._size += len(data)
        big = self._big
        if big is not None:
            big.feed(data)
            return
        self._body.append(data)
        if self._size > usage_.MAX_USAGE_JSON:  # kept whole no more: its ends only
            big = self._big = usage_.Document()
            big.feed(b"".join(self._body))
            self._body = []

    def _too_long(self, data: bytes) -> None:
        if self._long is None:
            self._long = usage_.Document()
            self._long.feed(bytes(self._line))
            self._line.clear()
        self._long.feed(data)

    def _long_ended(self) -> None:
        """A line too long to keep has ended: its usage if it has one (searched), else an
        event of output."""
        long, self._long = self._long, None
        assert long is not None
        found = long.usage()
        if found is not None:
            self._found(found)
        else:
            self.events += 1

    def _event(self, line: bytes) -> None:
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return
        if _may_carry_usage(payload):
            found, usage_only = usage_.read(payload)
            if found is not None:
                self._found(found)
                if usage_only:
                    if self.usage_only is not None:
                        self.usage_only.append(payload)
                    return
        self.events += 1

    def _found(self, found: Usage) -> None:
        self._usage = found
        # an engine's count so far (llama-server's own events carry it): what the stream
        # is charged as it goes, when its events say less
        if found.completion > self.events:
            self.events = found.completion

    def usage(self, prompt_estimate: int = 0) -> Usage | None:
        """The engine's usage; for a stream that ended without one (cut short), what it
        generated (an event a token) and the prompt's estimate; None if nothing is known."""
        if not self.stream:
            if self._big is not None:
                return self._big.usage()
            body = self._body
            return usage_.of_json(body[0] if len(body) == 1 else b"".join(body))
        if self._usage is not None:
            return self._usage
        if self.events:
            return Usage(prompt_estimate, self.events)
        return None

    def estimate(self, prompt_estimate: int, generates: bool) -> Usage:
        """What an answer whose usage cannot be read is metered: its prompt's estimate, and
        for a route that generates, a token for every CHARS_PER_TOKEN bytes of a whole
        answer (its text and more) or every event of a stream."""
        if not generates:
            return Usage(prompt_estimate, 0)
        if self.stream:
            return Usage(prompt_estimate, self.events)
        return Usage(prompt_estimate, -(-self._size // CHARS_PER_TOKEN))


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
        "generates",
        "usage_key",
        "replica",
        "over",
        "strip",
        "rewrites",
        "_created",
        "_first",
        "_pending",
        "_held",
        "_plain",
    )

    def __init__(
        self,
        admission: Admission,
        *,
        stream: bool,
        prompt_estimate: int = 0,
        strip: bool = False,
        generates: bool = True,
        usage_key: bytes = USAGE_KEY,
    ) -> None:
        UsageReader.__init__(self, stream)
        self.admission = admission
        self._held = admission.held  # None: no limit to charge its tokens to
        self.prompt_estimate = prompt_estimate
        self.generates = generates  # the route generates (its estimate counts output)
        # what marks a piece of its stream that may carry usage: the route's name for it
        self.usage_key = usage_key
        self.replica: str | None = None  # set by `answering`
        self.over = False  # a limit refused more tokens: the router ends the stream
        self.strip = self.rewrites = strip
        if strip:
            self.usage_only = []
        self._created = time.monotonic()  # ttft is a span: measured on the monotonic clock
        self._first: float | None = None
        self._pending = b""  # an event begun and not ended, held while stripping
        self._plain = False  # a stream read so far with nothing begun and not ended

    def answering(self, replica: str) -> tuple[tuple[bytes, bytes], ...]:
        """The replica answering ("" for none); the x-ratelimit-* headers of a limited key."""
        self.replica = replica or None
        held = self._held
        return () if held is None else held.header_pairs()

    def chunk(self, data: bytes, last: bool = False) -> bytes | None:
        """A piece of the answer as relayed (`last`: the answer ends with it): what to relay
        of it, or None once a limit refuses the stream more tokens (`over`: the router ends
        it there)."""
        # the common piece, an engine's write of one token: one event, one line of data
        # holding a JSON object without usage, in a stream with nothing begun and not ended
        # (`_plain`): counted, and relayed as it is
        if (
            self._plain
            and data.startswith(b"data: {")
            and data.endswith(b"\n\n")
            and data.find(b"\n") == len(data) - 2
            and self.usage_key not in data
        ):
            self.events += 1
            held = self._held
            if held is None or held.progress_now(self.events):
                return data
            self.over, self._plain = True, False
            return None
        relayed = self._chunk(data, last)
        self._plain = (
            self._framed
            and self.stream
            and not self.over
            and not self._line
            and not self._pending
            and self._long is None
        )
        return relayed

    def _chunk(self, data: bytes, last: bool) -> bytes | None:
        if self._first is None:
            self._first = time.monotonic()
            head = data[:1]
            if head == b"{" or head == b"[":  # the common whole answer, told at once
                self.stream, self._framed = False, True
            elif data.startswith(b"data:"):  # the common stream
                self.stream, self._framed = True, True
        if self._framed and not self.stream:
            self._whole(data)
            return data
        # the common piece, an engine's write: whole events of output, each line of data a
        # JSON object, nothing to read for usage, to strip, or to hold; its events counted
        # as `feed` would count them, without reading it line by line
        whole = False
        if (
            self._framed
            and data.endswith(b"\n\n")
            and not self._line
            and not self._pending
            and self._long is None
            and self.usage_key not in data  # one search a piece: every piece comes here
        ):
            events = data.count(b"\ndata: {") + data.startswith(b"data: {")
            whole = events == data.count(b"\ndata:") + data.startswith(b"data:")
        if whole:
            self.events += events
        else:
            self.feed(data)
            if not self.stream:
                return data  # its first bytes: a whole answer after all
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
            return self._without_usage(done)
        if end < 0:
            if len(data) > MAX_LINE:
                self._pending = b""
                if self.usage_only:
                    self.usage_only.clear()  # passed on unread
                return data
            self._pending = data
            return b""
        done, self._pending = data[: end + 2], data[end + 2 :]
        return self._without_usage(done)

    def _without_usage(self, data: bytes) -> bytes:
        """SSE events, the usage-only ones left out (those `_event` read as such: each
        data line is read before its event ends); a last piece not ended by a blank line
        is kept as it is."""
        payloads = self.usage_only
        if not payloads:
            return data
        events = data.split(b"\n\n")
        tail = events.pop()  # b"" when `data` ends with a blank line
        kept = []
        for event in events:
            payload = _payload(event) if USAGE_KEY in event else None
            if payload is not None and payload in payloads:
                payloads.remove(payload)
            else:
                kept.append(event + b"\n\n")
        return b"".join(kept) + tail

    def settle(self, status: int, outcome: str, refused: str | None = None) -> None:
        first = self._first
        found = self.usage(self.prompt_estimate)
        # an answer (or one the client left: status 0) whose usage does not read: metered
        # by an estimate, its reservation kept against the limits; an error generated nothing
        estimate = (
            self.estimate(self.prompt_estimate, self.generates)
            if found is None and status < 400
            else None
        )
        self.admission.finish(
            status=status,
            usage=found,
            replica=self.replica,
            ttft=None if first is None else first - self._created,
            estimate=estimate,
            refused=refused,
        )


def _payload(event: bytes) -> bytes | None:
    """An event's first data line's payload, as `_event` reads it."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None
