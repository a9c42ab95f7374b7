"""The load this router sees per model, and its `load.<router>` key that the leader sums.

Per model: requests in flight (sent to an engine, answer not finished; the mean over the
last interval, so a burst of short requests between two writes is not missed), requests
held for a replica (a cold model, router/hold.py) or waiting in the router's queue for room
at its engines (router/flow.py), a count of requests started (a change is a request seen:
what `idle_unload_after` waits for), the slowest time to first token of the interval, and
its demand now by class and team (in flight and queued), by which the routers split the
model's engines between them (router/share.py). Every router counts only what it sent itself, so the sum over routers counts
each request once.

The key is this router's alone (one writer per key). It is written every `interval`, and
at once when a request starts waiting for a model with no replica (that is how a router
asks for a replica: the leader wakes on it) or when its demand moves (a class or team starts
or stops asking, or asks a quarter more or less): the other routers' split follows it. A router that stops writing stops counting
after the leader's `load_stale_after`; one that shuts down deletes its key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from llmgw.bus import keys, records
from llmgw.priority import Priority
from llmgw.router.inflight import InFlight
from llmgw.router.peers import demand_record

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 1.0
# urgent writes (a request waits, demand moved) at most this often
MIN_GAP_S = 0.01


@dataclass
class _Model:
    waiting: int = 0
    requests: int = 0  # held or refused for want of a replica (sent ones: the account's)
    ttft: float = 0.0  # the slowest of the interval, seconds
    asked: bool = False  # a request found no replica since the last write


class Queued(Protocol):
    """The router's queue (router/flow.py), as the load record reads it."""

    def queued(self, model: str) -> int: ...

    def demand(self, model: str) -> dict[tuple[Priority, str], int]: ...

    def models(self) -> list[str]: ...


@dataclass
class LoadCounter:
    """Requests held, asked for and their first tokens, counted by the proxy; requests in
    flight are read from the one in-flight account (router/inflight.py), those waiting for
    room at their engines and each model's demand from the router's queue."""

    in_flight: InFlight = field(default_factory=InFlight)
    models: dict[str, _Model] = field(default_factory=dict)
    urgent: asyncio.Event = field(default_factory=asyncio.Event)
    # a place was handed back that another router waits for: written without the gap
    handover: asyncio.Event = field(default_factory=asyncio.Event)
    queue: Queued | None = None
    # model -> (class, team) -> the demand its records say (`_steady`)
    _shown: dict[str, dict[tuple[Priority, str], int]] = field(default_factory=dict)

    def _model(self, model: str) -> _Model:
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = _Model()
        return m

    def first_token(self, model: str, seconds: float) -> None:
        m = self._model(model)
        m.ttft = max(m.ttft, seconds)

    def held(self, model: str) -> None:
        """A request waits for a replica of `model`: say so now, not at the next write."""
        m = self._model(model)
        m.waiting += 1
        m.requests += 1
        self.urgent.set()

    def released(self, model: str) -> None:
        self._model(model).waiting -= 1

    def asked(self, model: str) -> None:
        """A request found no replica and did not wait: the next write asks for one."""
        m = self._model(model)
        m.asked = True
        m.requests += 1
        self.urgent.set()

    def waiting(self) -> dict[str, int]:
        """Requests held now per model, waiting for a replica (the fleet page's "queued")."""
        return {model: m.waiting for model, m in self.models.items() if m.waiting}

    def _steady(
        self, model: str, demand: dict[tuple[Priority, str], int]
    ) -> dict[tuple[Priority, str], int]:
        """`demand` as the record says it: each figure as last written while it stays within
        an eighth of it (the routers' split moves with real changes, not with every request
        that ends and the next that starts in its place)."""
        shown = self._shown.setdefault(model, {})
        for key in list(shown):
            if key not in demand:
                del shown[key]
        for key, n in demand.items():
            before = shown.get(key)
            if before is None or abs(n - before) > before // 8:
                shown[key] = n
        return dict(shown)

    def snapshot(self) -> dict[str, records.ModelLoad]:
        """Each model's load over the interval since the last snapshot, which starts anew."""
        means = self.in_flight.take_means()
        out: dict[str, records.ModelLoad] = {}
        queue = self.queue
        queued = set(queue.models()) if queue is not None else set()
        engines: dict[str, dict[str, int]] = {}
        for (model, replica), n in self.in_flight.by_replica().items():
            if n:
                engines.setdefault(model, {})[replica] = n
        for model in sorted(set(means) | set(self.models) | queued):
            m = self._model(model)
            out[model] = records.ModelLoad(
                in_flight=round(means.get(model, 0.0), 3),
                waiting=max(m.waiting, 1 if m.asked else 0)
                + (queue.queued(model) if queue is not None else 0),
                requests=m.requests + self.in_flight.sent(model),
                ttft_ms=round(m.ttft * 1000, 1),
                demand=demand_record(
                    self._steady(
                        model,
                        queue.demand(model)
                        if queue is not None
                        else self.in_flight.by_standing(model),
                    )
                ),
                engines=engines.get(model, {}),
            )
            m.ttft, m.asked = 0.0, False
        return out


class LoadPublisher:
    """Writes `load.<router_id>` every interval, and at once (at most every `min_gap`)
    when a request waits for a replica or the router's demand moves; `written` is told
    each record as it is written (the router's split counts its own record as written)."""

    def __init__(
        self,
        counter: LoadCounter,
        router_id: str,
        interval: float = LOAD_INTERVAL_S,
        *,
        min_gap: float = MIN_GAP_S,
        written: Callable[[records.RouterLoad], None] = lambda record: None,
    ) -> None:
        self.counter = counter
        self.router_id = keys.check_token(router_id, "router id")
        self.interval = interval
        self.min_gap = min_gap
        self.written = written
        self.seq = 0

    def record(self) -> records.RouterLoad:
        self.seq += 1
        return records.RouterLoad(
            router=self.router_id, seq=self.seq, at=time.time(), models=self.counter.snapshot()
        )

    async def run(self, bus) -> None:
        key = keys.load(self.router_id)
        try:
            while True:
                self.counter.urgent.clear()  # before the snapshot: a later wait is not missed
                self.counter.handover.clear()
                record = self.record()
                self.written(record)
                last = time.monotonic()
                try:
                    await bus.put(key, record)
                except Exception as e:  # noqa: BLE001 - NATS away: the next write says it again
                    log.debug("router: cannot write %s: %s", key, e)
                with anyio.move_on_after(self.interval):
                    await self.counter.urgent.wait()
                # what moved within the gap goes in one record; a place handed back goes now
                with anyio.move_on_after(max(0.0, last + self.min_gap - time.monotonic())):
                    await self.counter.handover.wait()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await bus.delete(key)  # gone at once, not after the leader's stale time
                except Exception:  # noqa: BLE001
                    pass
