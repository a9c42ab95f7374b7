"""The load this router sees per model, and its `load.<router>` key that the leader sums.

Per model: requests in flight (sent to an engine, answer not finished; the mean over the
last interval, so a burst of short requests between two writes is not missed), requests
held for a replica (a cold model, router/hold.py), a count of requests started (a change is
a request seen: what `idle_unload_after` waits for), and the slowest time to first token of
the interval. Every router counts only what it sent itself, so the sum over routers counts
each request once.

The key is this router's alone (one writer per key). It is written every `interval`, and
at once when a request starts waiting for a model with no replica: that is how a router
asks for a replica (the leader wakes on it). A router that stops writing stops counting
after the leader's `load_stale_after`; one that shuts down deletes its key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import anyio

from llmgw.bus import keys, records
from llmgw.router.inflight import InFlight

log = logging.getLogger(__name__)

LOAD_INTERVAL_S = 1.0


@dataclass
class _Model:
    waiting: int = 0
    requests: int = 0  # held or refused for want of a replica (sent ones: the account's)
    ttft: float = 0.0  # the slowest of the interval, seconds
    asked: bool = False  # a request found no replica since the last write


@dataclass
class LoadCounter:
    """Requests held, asked for and their first tokens, counted by the proxy; requests in
    flight are read from the one in-flight account (router/inflight.py)."""

    in_flight: InFlight = field(default_factory=InFlight)
    models: dict[str, _Model] = field(default_factory=dict)
    urgent: asyncio.Event = field(default_factory=asyncio.Event)

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

    def crowded(self, model: str) -> None:
        """A LoRA adapter's engines are all busier than their share: the next write asks
        for it on one more replica (as waiting), without counting another request."""
        self._model(model).asked = True

    def waiting(self) -> dict[str, int]:
        """Requests held now per model, waiting for a replica (the fleet page's "queued")."""
        return {model: m.waiting for model, m in self.models.items() if m.waiting}

    def snapshot(self) -> dict[str, records.ModelLoad]:
        """Each model's load over the interval since the last snapshot, which starts anew."""
        means = self.in_flight.take_means()
        out: dict[str, records.ModelLoad] = {}
        for model in sorted(set(means) | set(self.models)):
            m = self._model(model)
            out[model] = records.ModelLoad(
                in_flight=round(means.get(model, 0.0), 3),
                waiting=max(m.waiting, 1 if m.asked else 0),
                requests=m.requests + self.in_flight.sent(model),
                ttft_ms=round(m.ttft * 1000, 1),
            )
            m.ttft, m.asked = 0.0, False
        return out


class LoadPublisher:
    """Writes `load.<router_id>` every interval, and at once when a request waits."""

    def __init__(
        self, counter: LoadCounter, router_id: str, interval: float = LOAD_INTERVAL_S
    ) -> None:
        self.counter = counter
        self.router_id = keys.check_token(router_id, "router id")
        self.interval = interval
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
                try:
                    await bus.put(key, self.record())
                except Exception as e:  # noqa: BLE001 - NATS away: the next write says it again
                    log.debug("router: cannot write %s: %s", key, e)
                with anyio.move_on_after(self.interval):
                    await self.counter.urgent.wait()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await bus.delete(key)  # gone at once, not after the leader's stale time
                except Exception:  # noqa: BLE001
                    pass
