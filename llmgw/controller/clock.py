"""The one clock the controller judges by, passed in so tests can move time themselves.

Judgement and records read it: how long a lease or the leader key stood still, and the
timestamps written into the bucket. The loop's rhythm (tick, resync, renewals) and how
long a write took are real time on the event loop: a hung write is hung in real time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps: how long something stood still."""
        ...

    def wall(self) -> float:
        """Unix seconds: timestamps written into records."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


@dataclass(frozen=True, slots=True)
class Instant:
    """One moment on both of a clock's readings. A reconcile pass reads one and hands it
    down, so everything it judges and stamps is of the same moment."""

    monotonic: float
    wall: float


def instant(clock: Clock) -> Instant:
    return Instant(clock.monotonic(), clock.wall())
