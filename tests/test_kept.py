"""KeptWrites (llmgw/bus/kept.py) against a real nats-server: a write the bus could not make
is made again until it lands; one the server refuses when tried again is said and dropped,
and the writes kept after it still land."""

from __future__ import annotations

import dataclasses
import logging

import anyio
import pytest
from nats.js.api import StreamConfig
from waiting import until

from llmgw.bus.client import RAW, Bus
from llmgw.bus.errors import BusUnavailable
from llmgw.bus.kept import KeptWrites

pytestmark = pytest.mark.anyio


async def _remove_bucket(bus: Bus) -> StreamConfig:
    """Delete the bucket's stream (every write is then unanswered); its config, to make it
    again."""
    stream = f"KV_{bus.bucket.name}"
    config = (await bus.js.stream_info(stream)).config
    await bus.js.delete_stream(stream)
    return config


async def _holds(bus: Bus, key: str) -> bytes | None:
    try:
        entry = await bus.get(key, RAW)
    except BusUnavailable:  # the bucket being made again
        return None
    return entry.value if entry is not None else None


async def test_a_kept_write_refused_when_tried_again_is_said_and_the_next_ones_still_land(
    bus: Bus, caplog
) -> None:
    kept = KeptWrites(bus, base=0.05, cap=0.2)
    big, small = b'{"pad": "' + b"x" * 2000 + b'"}', b'{"pad": "y"}'
    async with anyio.create_task_group() as tg:
        tg.start_soon(kept.run)
        config = await _remove_bucket(bus)
        assert not await kept.put("notes.big", big)  # unanswered: kept
        # made again with a message limit the kept value is over: its next try is refused
        await bus.js.add_stream(dataclasses.replace(config, max_msg_size=1000))
        with caplog.at_level(logging.WARNING, logger="llmgw.bus.kept"):
            await until(lambda: _not_kept(kept))
        assert "notes.big" in caplog.text and "refused" in caplog.text

        # kept writes go on: another one unanswered lands once the bucket answers again
        config = await _remove_bucket(bus)
        assert not await kept.put("notes.small", small)
        await bus.js.add_stream(config)
        assert await until(lambda: _holds(bus, "notes.small"), timeout=10) == small
        assert kept.unwritten == []
        tg.cancel_scope.cancel()


async def _not_kept(kept: KeptWrites) -> bool:
    return not kept.unwritten
