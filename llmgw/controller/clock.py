"""The one clock the controller judges by, passed in so tests can move time themselves.

Judgement, records and the loop's cadence read it: how long a lease or the leader key
stood still, the timestamps written into the bucket, and when a full pass (`resync`) and
a whole-fleet judgement are due, so a test moves time and waits for nothing. Real time on
the event loop is only how often the loop looks (`tick`, and the leader key's renewals) and
how long a write took: a hung write is hung in real time.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.clock import Clock, SystemClock

__all__ = ["Clock", "Instant", "ManualClock", "SystemClock", "instant"]


@dataclass(frozen=True, slots=True)
class Instant:
    """One moment on both of a clock's readings. A reconcile pass reads one and hands it
    down, so everything it judges and stamps is of the same moment."""

    monotonic: float
    wall: float


def instant(clock: Clock) -> Instant:
    return Instant(clock.monotonic(), clock.wall())


class ManualClock:
    """Time that moves only when a test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1.7e9 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
