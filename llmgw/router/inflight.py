"""Requests in flight, counted once: one account, taken when a request is given its place
at an engine (at once, or when the router's queue lets it go) and given back once when its
answer is over, however it ends.

Everything that asks "how busy" reads this account, never a count of its own:
- the balancer reads each engine's count (`Backend.in_flight`, written only here);
- `/metrics` reads `llmgw_router_in_flight{model,replica}` from it at each scrape;
- the load records (`load.<router>`, router/load.py) read each model's mean over the
  interval from it;
- the router's queue (router/flow.py) reads each model's count by class and team (its
  demand, published for the other routers) and is told of every place given back.
A request that reached no engine (refused, held, or its connection never made) holds
nothing here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.priority import Priority
from llmgw.router.table import Backend


@dataclass
class _ModelFlights:
    count: int = 0
    sent: int = 0  # requests sent ever (a change is a request seen: the load records' count)
    integral: float = 0.0  # count x seconds since the interval began
    since: float = 0.0  # when count last changed, or the interval began
    # in flight now by (class, team): what this router asks of the model's engines
    # (its demand, router/share.py)
    by_standing: dict[tuple[Priority, str], int] = field(default_factory=dict)


class Flight:
    """One request's place in the account, on the engine it goes to: counted when taken
    (`InFlight.take`), given back once when its `with` block is left, however that happens,
    or by `give_back` for a place granted to a request that never used it. (A class, not a
    generator-based context manager: this is on every request's path.)"""

    __slots__ = ("_account", "backend", "standing", "tokens", "_out")

    def __init__(self, account: InFlight, backend: Backend, standing: tuple[Priority, str]) -> None:
        self._account = account
        self.backend = backend
        self.standing = standing  # (class, team)
        self.tokens = 0  # its prompt's estimate, charged to its team while it runs
        self._out = False

    @property
    def priority(self) -> Priority:
        return self.standing[0]

    @property
    def team(self) -> str:
        return self.standing[1]

    def __enter__(self) -> Flight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.give_back()

    def give_back(self) -> None:
        if self._out:
            return
        self._out = True
        account = self._account
        account._move(self.backend, -1)
        by_standing = account._models[self.backend.model].by_standing
        key = self.standing
        left = by_standing[key] - 1
        if left:
            by_standing[key] = left
        else:
            del by_standing[key]
        if account.freed is not None:
            account.freed(self)

    def move(self, backend: Backend) -> None:
        """To another engine of the same model: the first could not be reached, and
        nothing of the request was sent to it."""
        self._account._move(self.backend, -1)
        self._account._move(backend, 1)
        self.backend = backend


class InFlight:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._models: dict[str, _ModelFlights] = {}
        # every engine that carried a request, until forget_except() drops it idle: what
        # /metrics shows (0 once it is idle again, as a gauge should)
        self._engines: dict[Backend, None] = {}
        self._interval_start = clock()
        # told each time a place is given back: the router's queue sends the next request
        self.freed: Callable[[Flight], None] | None = None

    def take(
        self, backend: Backend, priority: Priority = Priority.STANDARD, team: str = ""
    ) -> Flight:
        """One request's place on `backend`, counted now (and once as a request sent,
        wherever it moves); `with flight:` gives it back when the request is over."""
        self._move(backend, 1)
        m = self._models[backend.model]
        m.sent += 1
        key = (priority, team)
        m.by_standing[key] = m.by_standing.get(key, 0) + 1
        return Flight(self, backend, key)

    def _move(self, backend: Backend, by: int) -> None:
        backend.in_flight += by
        if by > 0:
            self._engines[backend] = None
        m = self._models.get(backend.model)
        now = self.clock()
        if m is None:
            m = self._models[backend.model] = _ModelFlights(since=now)
        since = m.since if m.since > self._interval_start else self._interval_start
        m.integral += m.count * (now - since)
        m.since = now
        m.count += by

    # --- what the readers ask --------------------------------------------------------------

    def model(self, model: str) -> int:
        m = self._models.get(model)
        return m.count if m is not None else 0

    def by_standing(self, model: str) -> dict[tuple[Priority, str], int]:
        """In flight for `model` now, by (class, team)."""
        m = self._models.get(model)
        return m.by_standing if m is not None else {}

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
