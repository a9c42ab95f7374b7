"""Waiting for what a test expects to happen, bounded: a hang is a failure, never a pass."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def until(cond: Callable[[], Awaitable[T]], timeout: float = 20.0) -> T:
    """Poll the async `cond` until it returns something truthy, and return that."""
    with anyio.fail_after(timeout):
        while True:
            got = await cond()
            if got:
                return got
            await anyio.sleep(0.05)
