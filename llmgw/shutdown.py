"""Stopping on SIGINT/SIGTERM: cancel the task group, whose `finally` blocks clean up; or,
for what serves clients, drain first and then cancel."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import anyio

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Start in a task group with its cancel scope: Ctrl-C or `systemctl stop` cancels it."""
    with anyio.open_signal_receiver(*_SIGNALS) as signals:
        async for sig in signals:
            log.info("%s: stopping", signal.Signals(sig).name)
            scope.cancel()
            return


async def drain_then_cancel_on_signal(
    scope: anyio.CancelScope, drain: Callable[[], Awaitable[object]]
) -> None:
    """Start in a task group with its cancel scope: the first SIGINT or SIGTERM runs
    `drain()` (a router letting its streams finish), then cancels the scope; a second
    signal while it drains cuts the drain short."""
    with anyio.open_signal_receiver(*_SIGNALS) as signals:
        it = signals.__aiter__()
        first = await it.__anext__()
        log.info(
            "%s: draining before stopping (%s again stops at once)",
            signal.Signals(first).name,
            "Ctrl-C" if first == signal.SIGINT else "the same signal",
        )
        async with anyio.create_task_group() as tg:

            async def on_second_signal() -> None:
                again = await it.__anext__()
                log.warning("%s again: stopping now", signal.Signals(again).name)
                tg.cancel_scope.cancel()

            tg.start_soon(on_second_signal)
            await drain()
            tg.cancel_scope.cancel()
    scope.cancel()
