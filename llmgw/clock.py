"""A clock passed in, so tests can move time themselves (the controller judges leases by
it, the agent's supervisors their engines' restarts)."""

from __future__ import annotations

import time
from typing import Protocol

import anyio


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never jumps: how long something stood still."""
        ...

    def wall(self) -> float:
        """Unix seconds: timestamps written into records."""
        ...


class Timer(Clock, Protocol):
    """A clock that can also be waited on: what a supervisor's backoff, readiness deadline
    and drain wait by, so a test moves through minutes of them at once."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)
