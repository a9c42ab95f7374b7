"""What each engine says it can take now, asked in the background (every second).

The profile's parallel slots are where the router starts (`Backend.capacity`); where the
engine says more, its word wins (`Backend.reported`):
- llama-server's `GET /slots` lists its slots: that many requests run at once, and it
  defers the rest (exact, whatever the profile or its `-np` says);
- otherwise its Prometheus text: vLLM's `vllm:num_requests_running` and
  `vllm:num_requests_waiting` (llama-server's `llamacpp:requests_processing` and
  `llamacpp:requests_deferred` read alike). An engine that makes requests wait while it runs
  N can take N now (vLLM runs fewer than --max-num-seqs when its KV cache is full); one that
  runs all it was given and makes none wait is tried with one more at each report, up to
  its profile's slots.
An engine that says nothing keeps its profile's slots, or no bound when it has none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import anyio

from llmgw.router.probe import get
from llmgw.router.table import Backend, EndpointTable
from llmgw.router.upstream import ConnectFailed, UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 1.0
MAX_REPORT = 1 << 20  # bytes of an engine's answer read (a /metrics text is tens of KB)
MAX_SLOTS = 65_536  # what a /slots list may claim
# (running, waiting) gauges of each engine's Prometheus text
GAUGES = (
    (b"vllm:num_requests_running", b"vllm:num_requests_waiting"),
    (b"llamacpp:requests_processing", b"llamacpp:requests_deferred"),
)


def slots_listed(body: bytes) -> int | None:
    """How many slots a llama-server `/slots` answer lists (None: not such an answer)."""
    try:
        slots = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(slots, list) or not slots or len(slots) > MAX_SLOTS:
        return None
    return len(slots) if all(isinstance(s, dict) for s in slots) else None


def gauge(text: bytes, name: bytes) -> float | None:
    """The sum of a gauge's samples in Prometheus text (every label set); None if absent."""
    total: float | None = None
    start = 0
    while True:
        at = text.find(name, start)
        if at < 0:
            return total
        start = at + len(name)
        if at and text[at - 1 : at] != b"\n":
            continue  # inside another name, or a comment
        after = text[start : start + 1]
        if after not in (b" ", b"{"):
            continue
        end = text.find(b"\n", start)
        line = text[start : end if end >= 0 else len(text)]
        try:
            value = float(line.rsplit(b" ", 1)[-1])
        except ValueError:
            continue
        total = value if total is None else total + value


def running_waiting(text: bytes) -> tuple[int, int] | None:
    for running, waiting in GAUGES:
        busy = gauge(text, running)
        if busy is not None:
            return int(busy), int(gauge(text, waiting) or 0)
    return None


def refine(b: Backend, running: int, waiting: int) -> None:
    """What an engine's running and waiting counts say it can take now."""
    if waiting > 0:
        b.reported = max(1, running)
    elif b.reported is not None and running >= b.reported:
        b.reported += 1  # it ran all it had and made none wait: try one more
        if b.capacity is not None and b.reported >= b.capacity:
            b.reported = None  # back to its profile's


class EngineReports:
    def __init__(
        self,
        table: EndpointTable,
        pool: UpstreamPool,
        changed: Callable[[], None],
        *,
        interval: float = REPORT_INTERVAL_S,
        timeout: float = 2.0,
    ) -> None:
        self.table = table
        self.pool = pool
        self.changed = changed  # an engine's capacity changed: shares are split again
        self.interval = interval
        self.timeout = timeout
        self._no_slots: set[str] = set()  # engines that answer no /slots list (not llama-server)

    async def run(self) -> None:
        while True:
            try:
                await self.report_all()
            except Exception:  # noqa: BLE001 - a bug here must not stop the router serving
                log.exception("router: engine reports failed")
            await anyio.sleep(self.interval)

    async def report_all(self) -> None:
        known = self.table.backends()
        self._no_slots &= {b.id for b in known}  # replica ids are new at every placement
        backends = [b for b in known if b.routable and b.probe_ok]
        before = [b.slots for b in backends]
        async with anyio.create_task_group() as tg:
            for b in backends:
                tg.start_soon(self.report, b)
        if [b.slots for b in backends] != before:
            self.changed()

    async def report(self, b: Backend) -> None:
        try:
            if b.id not in self._no_slots:
                status, body = await get(self.pool, b, b"/slots", self.timeout, MAX_REPORT)
                listed = slots_listed(body) if status == 200 else None
                if listed is not None:
                    b.reported = listed
                    return
                self._no_slots.add(b.id)
            status, body = await get(self.pool, b, b"/metrics", self.timeout, MAX_REPORT)
        except (TimeoutError, ConnectFailed, UpstreamFailed):
            return  # the health probe and the requests say what is wrong with it
        counts = running_waiting(body) if status == 200 else None
        if counts is not None:
            refine(b, *counts)
