"""The router's side of the key table: its watch of `apikeys.*` and `teams.*` fed into a
Gateway, and what it does when NATS goes away. Takes the router's Bus as it is given (this
package imports no nats): anything with `watch(pattern, decode)` and `connected`."""

from __future__ import annotations

import logging
from typing import Any

import anyio

from llmgw.bus import keys
from llmgw.bus.trust import RAW

from .gateway import Gateway

log = logging.getLogger(__name__)

CHECK_EVERY = 0.2  # how often the connection is looked at; a cut-off counts from then


async def follow(bus: Any, gateway: Gateway) -> None:
    """Feed the gateway's table until cancelled: both watches, and the connection's state
    (cut off: the table's copy may miss a revocation from then on). The watches are started
    afresh as soon as the connection is back, so a revocation made meanwhile is heard
    within a second of it (a watch left to restart itself can wait out a request timeout)."""
    said = False
    while True:
        synced: set[str] = set()
        async with anyio.create_task_group() as tg:

            async def watch(prefix: str, synced: set[str] = synced) -> None:
                # the bytes as stored: the table reads them (a value that does not read
                # keeps the last good one, or grants nothing: llmgw/gateway/table.py)
                async for item in bus.watch(keys.pattern(prefix), RAW):
                    if hasattr(item, "key"):
                        gateway.table.apply_raw(item.key, item.value, item.revision)
                        continue
                    synced.add(prefix)  # Synced: the watch has replayed the bucket
                    if len(synced) == 2:
                        gateway.table.caught_up()
                        gateway.limiter.reconnected()
                        nonlocal said
                        if not said:
                            said = True
                            log.warning(
                                "%s",
                                "API keys required: the bucket holds keys"
                                if gateway.enabled
                                else "no API keys in the bucket: serving every client "
                                "(`llmgw key create NAME` to require keys)",
                            )

            tg.start_soon(watch, keys.APIKEYS)
            tg.start_soon(watch, keys.TEAMS)
            await _until_reconnected(bus, gateway)
            tg.cancel_scope.cancel()


async def _until_reconnected(bus: Any, gateway: Gateway) -> None:
    """Return when the connection is back after being lost, saying the loss on the way."""
    lost = False
    while True:
        await anyio.sleep(CHECK_EVERY)
        if bus.connected:
            if lost:
                return
            continue
        if not lost:
            lost = True
            gateway.table.cut_off()
            gateway.limiter.cut_off()
            log.warning(
                "cut off from NATS: serving the keys known for at most %.0f s",
                gateway.table.serve_known_for,
            )
