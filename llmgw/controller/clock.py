"""The one clock the controller judges by, passed in so tests can move time themselves.

Judgement and records read it: how long a lease or the leader key stood still, and the
timestamps written into the bucket. The loop's rhythm (tick, resync, renewals) and how
long a write took are real time on the event loop: a hung write is hung in real time.
"""

from __future__ import annotations

import time
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
