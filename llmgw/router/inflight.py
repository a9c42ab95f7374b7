"""Requests in flight, counted once: one account, taken when a request is sent to an
engine and given back once when its answer is over, however it ends.

Everything that asks "how busy" reads this account, never a count of its own:
- the balancer reads each engine's count (`Backend.in_flight`, written only here);
- `/metrics` reads `llmgw_router_in_flight{model,replica}` from it at each scrape;
- the load records (`load.<router>`, router/load.py) read each model's mean over the
  interval from it.
A request that reached no engine (refused, held, or its connection never made) holds
nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.router.table import Backend


@dataclass
class _ModelFlights:
    count: int = 0
    sent: int = 0  # requests sent ever (a change is a request seen: the load records' count)
    integral: float = 0.0  # count x seconds since the interval began
    since: float = 0.0  # when count last changed, or the interval began


class Flight:
    """One request's place in the account, the engine it is on: taken when the `with`
    block is entered, given back when it is left, however that happens. (A class, not a
    generator-based context manager: this is on every request's path.)"""

    __slots__ = ("_account", "backend", "model")

    def __init__(self, account: InFlight, backend: Backend, model: str | None = None) -> None:
        self._account = account
        self.backend = backend
        # the model the request names: its engine's, or a LoRA adapter's served on it
        self.model = model or backend.model

    def __enter__(self) -> Flight:
        account = self._account
        account._move(self.backend, 1, self.model)
        account._models[self.model].sent += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._account._move(self.backend, -1, self.model)

    def move(self, backend: Backend) -> None:
        """To another engine of the same model: the first could not be reached, and
        nothing of the request was sent to it."""
        self._account._move(self.backend, -1, self.model)
        self._account._move(backend, 1, self.model)
        self.backend = backend


class InFlight:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._models: dict[str, _ModelFlights] = {}
        # every engine that carried a request, until forget_except() drops it idle: what
        # /metrics shows (0 once it is idle again, as a gauge should)
        self._engines: dict[Backend, None] = {}
        self._interval_start = clock()

    def taken(self, backend: Backend, model: str | None = None) -> Flight:
        """`with account.taken(backend) as flight:` holds one request on `backend` while
        the block runs (counted once as a request sent, wherever it moves), for `model`
        (a LoRA adapter's id; None: the engine's own model)."""
        return Flight(self, backend, model)

    def _move(self, backend: Backend, by: int, model: str) -> None:
        backend.in_flight += by
        if by > 0:
            self._engines[backend] = None
        m = self._models.get(model)
        now = self.clock()
        if m is None:
            m = self._models[model] = _ModelFlights(since=now)
        since = m.since if m.since > self._interval_start else self._interval_start
        m.integral += m.count * (now - since)
        m.since = now
        m.count += by

    # --- what the readers ask --------------------------------------------------------------

    def model(self, model: str) -> int:
        m = self._models.get(model)
        return m.count if m is not None else 0

    def sent(self, model: str) -> int:
        m = self._models.get(model)
        return m.sent if m is not None else 0

    def models(self) -> list[str]:
        return list(self._models)

    def by_replica(self) -> dict[tuple[str, str], int]:
        """(model, replica) -> requests in flight now, for every engine that carried one."""
        out: dict[tuple[str, str], int] = {}
        for b in self._engines:
            key = (b.model, b.id)
            out[key] = out.get(key, 0) + b.in_flight
        return out

    def busy(self, model: str, replica: str) -> bool:
        return any(b.in_flight for b in self._engines if b.model == model and b.id == replica)

    def take_means(self) -> dict[str, float]:
        """Each model's mean in flight over the interval since the last call, which starts
        a new one (so a burst of short requests between two load writes is not missed)."""
        now = self.clock()
        span = max(now - self._interval_start, 1e-6)
        out: dict[str, float] = {}
        for model, m in list(self._models.items()):
            m.integral += m.count * (now - max(m.since, self._interval_start))
            out[model] = max(m.integral / span, 0.0)
            m.integral, m.since = 0.0, now
        self._interval_start = now
        return out

    def forget_except(self, alive: set[tuple[str, str]]) -> None:
        """Drop idle engines that are gone from the table (replica ids are new at every
        placement: a router that runs for months must not keep them all)."""
        for b in [b for b in self._engines if (b.model, b.id) not in alive and not b.in_flight]:
            del self._engines[b]
