"""Outbox: what a router must store on NATS exactly once (usage counts, tokens owed to a limit,
places handed back, audit records), sent in the background until it is stored.

What waits is sealed into messages, each with an id of its own (`Nats-Msg-Id`); a send that
fails, or whose answer is lost, is made again with the same messages and the same ids, so
the stream drops what it had stored already (its duplicate window, 2 minutes) and nothing
is counted twice. What arrives meanwhile waits for the next seal: messages once sealed never
change, which is what makes sending them again safe.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

from llmgw.errors import LlmgwError

T = TypeVar("T")

Sealed = list[tuple[str, T]]  # (message id, what the message holds)


class Outbox(Generic[T]):
    def __init__(
        self, prefix: str, seal: Callable[[], list[T]], size: Callable[[T], int] = lambda m: 1
    ) -> None:
        # ids unique to this process: a restarted router must not look like a duplicate of
        # its previous life
        self._prefix = f"{prefix}.{os.getpid()}.{os.urandom(4).hex()}"
        self._ids = itertools.count()
        self._seal = seal  # what waits, taken as messages (and no longer waiting there)
        self._size = size
        self.sending: Sealed[T] = []
        self.sending_size = 0  # what the sealed messages hold, by `size` (read per request)

    async def flush(self, send: Callable[[Sealed[T]], Awaitable[None]]) -> None:
        """Send the sealed messages, or seal what waits; raises what `send` raised (they are
        sent again, as they are, at the next flush)."""
        if not self.sending:
            self.sending = [(f"{self._prefix}.{next(self._ids)}", m) for m in self._seal()]
            self.sending_size = sum(self._size(m) for _, m in self.sending)
        if self.sending:
            await send(self.sending)
            self.sending, self.sending_size = [], 0


class Counter(Protocol):
    """A counter stream, as the gateway adds to it (llmgw/bus/counters.py)."""

    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        """Add `delta` to `subject`'s total; the new total. Raises on failure."""
        ...


class Deltas(Outbox[tuple[str, int]]):
    """Adds to counter subjects: the units owed to each, summed while they wait, one message
    a subject when sealed."""

    def __init__(self, prefix: str) -> None:
        self.waiting: dict[str, int] = {}
        super().__init__(prefix, self._take)

    def add(self, subject: str, units: int) -> None:
        self.waiting[subject] = self.waiting.get(subject, 0) + units

    def _take(self) -> list[tuple[str, int]]:
        waiting, self.waiting = self.waiting, {}
        return [(subject, units) for subject, units in waiting.items() if units]

    def count(self) -> int:
        """Adds not yet known stored (waiting, or sent and unanswered)."""
        return len(self.waiting) + len(self.sending)

    def units(self) -> int:
        return sum(self.waiting.values()) + sum(units for _, (_, units) in self.sending)

    def subjects(self) -> list[str]:
        return [*self.waiting, *(subject for _, (subject, _) in self.sending)]

    async def send_to(self, counter: Counter, timeout: float) -> bool:
        """Flush to `counter`; True when it took every add (nothing is lost either way)."""

        async def send(sealed: Sealed[tuple[str, int]]) -> None:
            results = await asyncio.gather(
                *(
                    asyncio.wait_for(counter.add(subject, units, msg_id), timeout)
                    for msg_id, (subject, units) in sealed
                ),
                return_exceptions=True,
            )
            for r in results:
                if isinstance(r, BaseException):
                    raise r

        try:
            await self.flush(send)
        except (LlmgwError, TimeoutError, OSError):
            return False
        return not self.waiting
