"""The records a component owns, written until they are: a write the bus could not make is
made again, with backoff, until it lands or a newer value of the key replaces it.

A stream's leader election does not disconnect the clients of the surviving servers: their
writes time out or are refused for a few seconds, and no reconnect follows to say "write
everything again". An agent that restarted a killed engine meanwhile had its shard record
stay `failed`, with the dead engine's pid, for good (the router answered 503 while the new
engine served). Whoever owns a key writes it through `KeptWrites` and runs `run` in its
task group: the last value asked for each key is the one the bucket ends up holding. A
write the server refuses (not the link: a limit, a permission) is said and dropped, on its
first try or a later one, never tried forever nor let end `run`.
"""

from __future__ import annotations

import logging

import anyio
import msgspec

from .backoff import Backoff
from .client import Bus
from .errors import BusUnavailable

log = logging.getLogger(__name__)

_DELETE = None  # what a key waits for when its deletion was not made


class KeptWrites:
    """Writes and deletions of one owner's keys, each kept until made."""

    def __init__(self, bus: Bus, *, base: float = 0.2, cap: float = 5.0) -> None:
        self.bus = bus
        self._backoff = Backoff(base=base, cap=cap)
        # key -> the value it must hold (None: deleted), for the writes not made yet
        self._unwritten: dict[str, msgspec.Struct | bytes | None] = {}
        self._lock = anyio.Lock()  # one write at a time: the last one asked lands last
        self._wake = anyio.Event()

    @property
    def unwritten(self) -> list[str]:
        """The keys whose last value is not written yet."""
        return sorted(self._unwritten)

    async def put(self, key: str, record: msgspec.Struct | bytes) -> bool:
        """Write `key` now; if the bus cannot, keep it to write again. True: written."""
        return await self._write(key, record)

    async def delete(self, key: str) -> bool:
        """Delete `key` now; if the bus cannot, keep it to delete again. True: deleted."""
        return await self._write(key, _DELETE)

    async def _write(self, key: str, record: msgspec.Struct | bytes | None) -> bool:
        async with self._lock:
            self._unwritten.pop(key, None)  # this value replaces one still waiting
            try:
                await self._make(key, record)
            except BusUnavailable as e:
                log.warning("could not write %s (%s); writing it again until it lands", key, e)
                self._unwritten[key] = record
                self._wake.set()
                return False
        return True

    async def _make(self, key: str, record: msgspec.Struct | bytes | None) -> None:
        if record is _DELETE:
            await self.bus.delete(key)
        else:
            await self.bus.put(key, record)

    async def run(self) -> None:
        """Make the writes kept, with backoff, for as long as the owner runs."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._unwritten:
                await anyio.sleep(self._backoff.next_delay())
                async with self._lock:
                    for key, record in list(self._unwritten.items()):
                        try:
                            await self._make(key, record)
                        except BusUnavailable as e:
                            log.debug("%s still not written: %s", key, e)
                            break
                        except Exception as e:  # noqa: BLE001 - a refusal, as `put` says it
                            # not the link: tried again it would be refused again, and this
                            # task must outlive it (the owner's other keys wait on it)
                            log.warning("%s refused, not written again: %s", key, e)
                        else:
                            log.info("wrote %s, which could not be written before", key)
                        del self._unwritten[key]
            self._backoff.reset()
