"""Who waits when the fleet is full: the router's own queue, per model, in front of engines
that can take no more.

Each engine can take so many requests at once (`Backend.slots`: its profile's parallel
slots, or what the engine itself says, router/report.py), and this router may have its
share of them there (`Backend.share`, router/share.py: the engine split between the routers
that send to it). A request for a model with an engine that has room goes at once, as
before: nothing is held while an engine of its model has room (work-conserving). Otherwise
it waits here, not in the engine's own queue, and leaves when a place frees: by class
first, then by fair share between teams, then in arrival order (router/queue.py). Each
class waits at most its bound (`--queue-wait`); past it the request is refused, sheddable
with 429, the others with 503, each with `retry-after` and `x-llmgw-refused` naming why.
An engine whose capacity is not known takes every request at once, as before.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from llmgw.bus import records
from llmgw.priority import ASK_HEADER, Priority, Standing
from llmgw.router.balancer import Balancer
from llmgw.router.hold import MAX_WAIT_HEADER, client_wait
from llmgw.router.inflight import Flight, InFlight
from llmgw.router.peers import Peers, demand_of
from llmgw.router.queue import ModelQueue, Waiter
from llmgw.router.refusal import Refusal
from llmgw.router.share import handing_over, split
from llmgw.router.table import Backend, EndpointTable, Route

REFUSED_HEADER = b"x-llmgw-refused"
# what each class waits at most, by default (critical, standard, sheddable): seconds
MAX_WAIT_S = (60.0, 30.0, 10.0)
# releases remembered per model to estimate how fast its queue drains (Retry-After)
_PACE = 64
# Retry-After within these bounds, seconds
_RETRY_MIN, _RETRY_MAX = 1, 60


@dataclass(frozen=True)
class FlowSettings:
    enabled: bool = True  # off: every request goes straight to an engine, as before
    max_wait: tuple[float, float, float] = MAX_WAIT_S  # by class
    max_queued: int = 4096  # per model at this router; then a lower class gives way


class Waits:
    """What the queue tells /metrics and the page: each request's wait, and each refusal.
    The router's RouterMetrics implements it; this one counts nothing."""

    def waited(self, model: str, priority: Priority, team: str, seconds: float) -> None: ...

    def refused(self, model: str, priority: Priority, team: str, reason: str) -> None: ...


class FlowControl:
    def __init__(
        self,
        table: EndpointTable,
        balancer: Balancer,
        flights: InFlight,
        settings: FlowSettings | None = None,
        *,
        served_tokens: Callable[[str, str], int] = lambda team, served: 0,
        team_weight: Callable[[str], int] = lambda team: 1,
        waits: Waits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.balancer = balancer
        self.flights = flights
        self.settings = settings or FlowSettings()
        self.served_tokens = served_tokens
        self.team_weight = team_weight
        self.waits = waits or Waits()
        # the other routers sending to the same engines (None: this router alone, as one
        # run from a catalog file)
        self.peers: Peers | None = None
        self.clock = clock
        self.queues: dict[str, ModelQueue] = {}  # model id -> its queue here
        self.stopping = False
        # demand moved enough since this router last published it: publish now (router/load.py)
        self.moved: Callable[[], None] = lambda: None
        self._published: dict[str, dict[tuple[Priority, str], int]] = {}
        self._published_held: dict[tuple[str, str], int] = {}  # (model, replica) -> held
        # a place handed back that another router waits for: its record is written now
        self.handed_back: Callable[[], None] = lambda: None
        # model -> (the lowest class the other routers send, how many of this router's
        # requests of classes above it may go past its shares): see `_free`
        self._outranking: dict[str, tuple[Priority, int]] = {}
        self._releasing: set[str] = set()  # models whose release is scheduled
        self._pace: dict[str, deque[float]] = {}
        flights.freed = self._freed

    # --- a request ----------------------------------------------------------------------

    def queue(self, route: Route) -> ModelQueue:
        q = self.queues.get(route.model)
        if q is None:
            q = self.queues[route.model] = ModelQueue(route.served_name, self.served_tokens)
        return q

    def take(
        self,
        route: Route,
        standing: Standing,
        priority: Priority,
        affinity: int | None,
        tokens: int,
    ) -> Flight | Waiter | None:
        """A place at an engine of `route` now (a Flight), or a Waiter to `wait` with when
        its engines are full (or others wait before it); None when it has no engine at all
        (the caller holds it for a cold model)."""
        candidates = self.balancer.candidates(route.backends, self.clock())
        if not candidates:
            return None
        q = self.queues.get(route.model) or self.queue(route)
        if not q.depth:
            free = [b for b in candidates if b.share is None or b.in_flight < b.share]
            if not free:
                free = self._free(route.model, candidates, priority)
            if free:
                backend = free[0] if len(free) == 1 else self.balancer.choose(free, affinity)
                assert backend is not None
                team = standing.team
                flight = self.flights.take(backend, priority, team)
                flight.tokens = tokens
                q.started(team, tokens)
                self.waits.waited(route.model, priority, team, 0.0)
                return flight
        return Waiter(standing, priority, affinity, tokens, self.clock())

    async def wait(
        self, route: Route, waiter: Waiter, max_wait_header: bytes | None
    ) -> Flight | Refusal:
        """Hold `waiter` in its model's queue until a place is its (a Flight), or refuse it:
        past its class's bound, or the client's own (`x-llmgw-max-wait`), when the queue is
        full and it is the one to give way, or when the router shuts down."""
        q = self.queue(route)
        bound = self.settings.max_wait[waiter.priority]
        asked = client_wait(max_wait_header)
        if asked is not None:
            bound = min(bound, asked)
        if self.stopping:
            return self._refusal(route, q, waiter, "router_shutting_down")
        if bound <= 0:
            return self._refusal(route, q, waiter, "queue_timeout", bound)
        if q.depth >= self.settings.max_queued:
            victim = q.newest_below(waiter.priority)
            if victim is None:
                return self._refusal(route, q, waiter, "queue_full")
            q.drop(victim)
            victim.future.set_result(self._refusal(route, q, victim, "queue_full", gave_way=True))
        q.push(waiter)
        self._demand_changed(route.model)
        if self._outranks(route.model, waiter.priority):
            self._reshare(route)  # counted now, not once its record is written
        self.release(route.model)  # it may go at once (a place freed, or it outranks)
        try:
            async with asyncio.timeout(bound):
                got = await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()  # let go as its time ran out: it goes
            q.drop(waiter)
            self._demand_changed(route.model)
            return self._refusal(route, q, waiter, "queue_timeout", bound)
        except asyncio.CancelledError:  # its client left
            if waiter.future.done() and not waiter.future.cancelled():
                given = waiter.future.result()
                if isinstance(given, Flight):
                    given.give_back()
            else:
                q.drop(waiter)
                self._demand_changed(route.model)
            raise
        return got

    # --- letting requests go ------------------------------------------------------------

    def _freed(self, flight: Flight) -> None:
        model = flight.backend.model
        q = self.queues.get(model)
        if q is None:
            return
        q.ended(flight.team, flight.tokens)
        b = flight.backend
        if self._published_held.get((model, b.id), 0) > max(b.in_flight, b.share or 0):
            self.handed_back()  # its record says it holds past its share: say it holds less
        if q.depth and model not in self._releasing:
            # after the request that freed the place has settled (its tokens are in its
            # team's tally then): the task giving back settles before it next awaits
            self._releasing.add(model)
            asyncio.get_running_loop().call_soon(self._release_soon, model)

    def _release_soon(self, model: str) -> None:
        self._releasing.discard(model)
        self.release(model)

    def release(self, model: str) -> None:
        """Let waiting requests go while an engine of `model` has room for them."""
        q = self.queues.get(model)
        if q is None or not q.depth:
            return
        route = self.table.route(q.served)
        if route is None:
            return
        candidates = self.balancer.candidates(route.backends, self.clock())
        went = False
        while q.depth:
            w = q.peek()
            assert w is not None
            free = self._free(model, candidates, w.priority)
            if not free:
                break
            if w.future.done():  # its client left; its task has not run since
                q.drop(w)
                continue
            backend = self.balancer.choose(free, w.affinity)
            assert backend is not None
            q.pop(w)
            flight = self.flights.take(backend, w.priority, w.standing.team)
            flight.tokens = w.tokens
            q.started(w.standing.team, w.tokens)
            now = self.clock()
            self.waits.waited(model, w.priority, w.standing.team, now - w.since)
            self._pace.setdefault(model, deque(maxlen=_PACE)).append(now)
            w.future.set_result(flight)
            went = True
        if went:
            self._demand_changed(model)

    # --- this router's share of each engine ----------------------------------------------

    def reshare(self, models: Iterable[str] | None = None) -> None:
        """Set this router's share of the engines of `models` (model ids; None: of every
        model), then let go what the shares now make room for."""
        if models is None:
            names = self.table.known_names()
        else:
            catalog = self.table.models
            names = [catalog[m].served_name for m in models if m in catalog]
        for name in names:
            route = self.table.route(name)
            if route is not None:
                self._reshare(route)
                self.release(route.model)

    def _outranks(self, model: str, priority: Priority) -> bool:
        peers = self.peers
        if peers is None:
            return False
        theirs = [cls for r, d in peers.demands(model).items() if r != peers.me for cls, _ in d]
        return bool(theirs) and priority < max(theirs)

    def _free(self, model: str, candidates: list[Backend], priority: Priority) -> list[Backend]:
        """The engines a request of class `priority` may go to now: those with room in this
        router's share; or, for a class above every class the other routers send there,
        any of them while this router's requests of such classes are fewer than their split
        gives it: the engine's own queue holds it, first in line, and the others, reading
        this router's record, leave it the next place to free (class order across routers
        costs the engine at most those requests past its capacity)."""
        free = [b for b in candidates if b.room]
        if free:
            return free
        outranking = self._outranking.get(model)
        if outranking is None or priority >= outranking[0]:
            return free
        lowest, allowed = outranking
        held = sum(n for (cls, _), n in self.flights.by_standing(model).items() if cls < lowest)
        return candidates if held < allowed else free

    def _reshare(self, route: Route) -> None:
        """This router's share of each engine of `route`, split with the live routers by
        their demand as their records say and its own as it is now (each engine's part of a
        model's demand in proportion to its slots)."""
        self._outranking.pop(route.model, None)
        for b in route.backends:
            b.share = b.slots if self.settings.enabled else None
        sized = [b for b in route.backends if b.share is not None]
        peers = self.peers
        if not sized or peers is None:
            return
        demands = peers.demands(route.model)
        if len(demands) < 2:
            return  # alone: all of it
        total = sum(b.slots or 0 for b in sized)
        # the lowest class the other routers send: this router's requests of a class above
        # it need not wait for room (`_free`), and count here as they are now, not as its
        # record last said (the others learn of them from its next one)
        theirs = [cls for r, d in demands.items() if r != peers.me for cls, _ in d]
        lowest = max(theirs) if theirs else None
        if lowest is not None:
            mine = {k: n for k, n in demands[peers.me].items() if k[0] >= lowest}
            above = {k: n for k, n in self.demand(route.model).items() if k[0] < lowest}
            demands[peers.me] = {**mine, **above}
            if above:
                high = {
                    r: {k: n for k, n in d.items() if k[0] < lowest} for r, d in demands.items()
                }
                allowed = split(total, high, self.team_weight, rest=False)[peers.me]
                self._outranking[route.model] = (lowest, allowed)
        for b in sized:
            part = (b.slots or 0) / total
            scaled = {r: {k: n * part for k, n in d.items()} for r, d in demands.items()}
            shares = split(b.slots or 0, scaled, self.team_weight, b.id_hash)
            # a share that grew is used as the others hand back what they hold past theirs
            # (requests sent are never called back): the engine is not sent more than it
            # takes, and a request of a class above theirs finds nothing of theirs queued
            # before it there; a share that did not grow is used whole meanwhile
            held = {r: peers.held(r, route.model, b.id) for r in shares}
            waits = handing_over(shares, held, b.id_hash)
            b.share = max(0, shares[peers.me] - waits[peers.me])
            if b.in_flight > b.share:
                held = self._published_held.get((route.model, b.id), 0)
                if held < b.in_flight:
                    self.moved()  # it holds past its share: the others learn how much

    def stop(self) -> None:
        """The router shuts down: every waiting request is answered now (503, retry
        elsewhere); none reached an engine."""
        self.stopping = True
        for q in self.queues.values():
            route = self.table.route(q.served)
            for w in list(q.waiters()):
                q.drop(w)
                if not w.future.done() and route is not None:
                    w.future.set_result(self._refusal(route, q, w, "router_shutting_down"))

    # --- what the other routers are told --------------------------------------------------

    def demand(self, model: str) -> dict[tuple[Priority, str], int]:
        """Requests in flight and queued for `model` here, by (class, team)."""
        out = dict(self.flights.by_standing(model))
        q = self.queues.get(model)
        if q is not None:
            for key, n in q.queued.items():
                out[key] = out.get(key, 0) + n
        return out

    def models(self) -> list[str]:
        """The models that had a request here."""
        return list(self.queues)

    def queued_by_standing(self) -> dict[tuple[str, str, str], int]:
        """(model, class, team) -> requests waiting now (the fleet page's)."""
        return {
            (model, cls.label, team): n
            for model, q in self.queues.items()
            for (cls, team), n in q.queued.items()
        }

    def queued(self, model: str) -> int:
        q = self.queues.get(model)
        return q.depth if q is not None else 0

    def written(self, record: records.RouterLoad) -> None:
        """This router's own load record, as written (router/load.py): its share counts its
        demand as the others read it."""
        changed = self.peers.saw(self.peers.me, record) if self.peers is not None else None
        self._published = {m: demand_of(v) for m, v in record.models.items()}
        self._published_held = {
            (m, replica): n for m, v in record.models.items() for replica, n in v.engines.items()
        }
        self.reshare(changed)

    def _demand_changed(self, model: str) -> None:
        """Publish now when a class or team starts or stops asking here, or asks a quarter
        more or less than published: what the others split the engines by."""
        now = self.demand(model)
        before = self._published.get(model, {})
        for key in now.keys() | before.keys():
            n, n0 = now.get(key, 0), before.get(key, 0)
            if (n > 0) != (n0 > 0) or abs(n - n0) >= max(1, n0 // 4):
                self.moved()
                return

    # --- refusals -----------------------------------------------------------------------

    def _refusal(
        self,
        route: Route,
        q: ModelQueue,
        w: Waiter,
        reason: str,
        bound: float = 0.0,
        *,
        gave_way: bool = False,
    ) -> Refusal:
        cls = w.priority.label
        ahead = q.ahead_of(w.priority)
        after = self._retry_after(route.model, ahead)
        engines = len(route.backends)
        if reason == "queue_timeout":
            why = (
                f"waited {bound:g} s, its bound (the class's, or the client's "
                f"{MAX_WAIT_HEADER.decode()}), for room at the model's {engines} engine(s)"
                if bound > 0
                else f"does not wait (the client's {MAX_WAIT_HEADER.decode()}) and the "
                f"model's {engines} engine(s) are full"
            )
        elif reason == "queue_full":
            why = (
                "gave way to a request of a higher class in the router's full queue"
                if gave_way
                else f"found the router's queue for the model full ({self.settings.max_queued} "
                "waiting) with nothing of a lower class to give way"
            )
        else:
            why = "was waiting for room when the router began shutting down (send it again)"
        self.waits.refused(route.model, w.priority, w.standing.team, reason)
        status = 429 if w.priority is Priority.SHEDDABLE else 503
        return Refusal(
            status,
            f"model {route.served_name!r}: this {cls} request {why}; {ahead} request(s) of "
            f"its class or above wait at this router; retry after {after} s",
            code=reason,
            kind=reason,
            model=route.model,
            headers=(
                (b"retry-after", b"%d" % after),
                (REFUSED_HEADER, reason.encode()),
                (ASK_HEADER, cls.encode()),
            ),
        )

    def _retry_after(self, model: str, ahead: int) -> int:
        """When those waiting ahead would have left, at the pace requests left lately."""
        pace = self._pace.get(model)
        if not pace or len(pace) < 2:
            return _RETRY_MIN if not ahead else min(_RETRY_MAX, max(_RETRY_MIN, ahead))
        span = max(self.clock() - pace[0], 1e-3)
        rate = (len(pace) - 1) / span
        return min(_RETRY_MAX, max(_RETRY_MIN, math.ceil(ahead / rate)))
