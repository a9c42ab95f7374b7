"""Stopping on SIGINT/SIGTERM: cancel the task group, whose `finally` blocks clean up."""

from __future__ import annotations

import logging
import signal

import anyio

log = logging.getLogger(__name__)


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Start in a task group with its cancel scope: Ctrl-C or `systemctl stop` cancels it."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for sig in signals:
            log.info("%s: stopping", signal.Signals(sig).name)
            scope.cancel()
            return
