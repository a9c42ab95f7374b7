"""Waiting for what a test expects to happen, bounded: a hang is a failure, never a pass."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
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


def until_logged(
    proc: subprocess.Popen | None, log: Path, text: str, timeout: float = 20.0
) -> None:
    """Until `text` is in the log file `log` of the process `proc` (None: any process):
    AssertionError with the log when the process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        alive = proc is None or proc.poll() is None
        assert alive and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
