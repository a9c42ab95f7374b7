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
                self._line += data[start:end]
                self._event(bytes(self._line))
                self._line.clear()
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


class GatewayTicket:
    """An admitted request as the router's relay sees it (router/gate.py's Ticket reads
    each chunk through it: router/keygate.py's MeteredTicket is one)."""

    __slots__ = (
        "admission",
        "reader",
        "prompt_estimate",
        "replica",
        "over",
        "_created",
        "_first",
    )

    def __init__(self, admission: Admission, *, stream: bool, prompt_estimate: int = 0) -> None:
        self.admission = admission
        self.reader = UsageReader(stream)
        self.prompt_estimate = prompt_estimate
        self.replica: str | None = None  # set by the router once it picked one
        self.over = False  # a limit refused more tokens: the router ends the stream
        self._created = time.monotonic()  # ttft is a span: measured on the monotonic clock
        self._first: float | None = None

    def chunk(self, data: bytes) -> bytes | None:
        """A piece of the answer as relayed: `data`, or None once a limit refuses the
        stream more tokens (`over`: the router ends it there)."""
        if self._first is None:
            self._first = time.monotonic()
        reader = self.reader
        reader.feed(data)
        if reader.stream and not self.over:
            self.over = not self.admission.progress_now(reader.events)
        return None if self.over else data

    def settle(self, status: int, outcome: str) -> None:
        ttft = None if self._first is None else self._first - self._created
        self.admission.finish(
            status=status,
            usage=self.reader.usage(self.prompt_estimate),
            replica=self.replica,
            ttft=ttft,
        )
