"""The order requests leave a router's queue for one model: by class, then by fair share
between teams, then first come first served within a team (so within a key too).

Fair share is a virtual token counter per team (VTC: Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024): the tokens a team was served (the engines' own usage, as
the gateway tallies it) and the prompts of its requests now running, over its weight; the
team with the lowest counter goes next. A team that starts waiting again is lifted to the
lowest counter among the teams already waiting, so a team idle for an hour does not bank an
hour of tokens. Chosen over weighted fair queuing (WFQ) because an LLM request's cost is not
known when it leaves the queue (its output length is only known at its end): WFQ needs each
request's size up front to stamp its finish time, VTC charges what was actually served and
needs no size, and its paper bounds the difference between two backlogged teams' service by
a constant (a few requests' tokens), whatever their lengths.

Pure bookkeeping on asyncio futures: no clock of its own (times are passed in), no I/O.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator

from llmgw.priority import CLASSES, Priority, Standing

# a team's deque is compacted when more than half of it are requests gone (timed out, left)
_COMPACT_AT = 64


class Waiter:
    """One request waiting for room: its future gets its place (a Flight) or a Refusal."""

    __slots__ = ("standing", "priority", "affinity", "tokens", "since", "future", "gone")

    def __init__(
        self,
        standing: Standing,
        priority: Priority,
        affinity: int | None,
        tokens: int,
        since: float,
    ) -> None:
        self.standing = standing
        self.priority = priority  # its class here (its own, or lower if it asked)
        self.affinity = affinity
        self.tokens = tokens  # its prompt's estimate: charged to its team as it leaves
        self.since = since
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.gone = False  # left the queue without being let go (timed out, refused, left)


class ModelQueue:
    """The requests waiting for room at one model's engines, at this router."""

    def __init__(self, served: str, served_tokens: Callable[[str, str], int]) -> None:
        self.served = served
        self._served_tokens = served_tokens  # (team, served name) -> tokens served so far
        # per class: team -> its waiting requests in arrival order (some may be gone)
        self._bands: tuple[dict[str, deque[Waiter]], ...] = tuple({} for _ in CLASSES)
        self.queued: dict[tuple[Priority, str], int] = {}  # (class, team) -> live waiters
        self.depth = 0
        self._running: dict[str, int] = {}  # team -> prompt tokens let go, not yet served
        self._lift: dict[str, float] = {}  # team -> its VTC lift
        self._weights: dict[str, int] = {}  # team -> its weight as last seen

    # --- the counters -------------------------------------------------------------------

    def counter(self, team: str) -> float:
        """The team's virtual token counter: tokens served and running, over its weight."""
        served = self._served_tokens(team, self.served) + self._running.get(team, 0)
        return served / self._weights.get(team, 1) + self._lift.get(team, 0.0)

    def started(self, team: str, tokens: int) -> None:
        """A request of `team` left the queue (or never waited) with `tokens` of prompt."""
        self._running[team] = self._running.get(team, 0) + tokens

    def ended(self, team: str, tokens: int) -> None:
        """It is over: its tokens are in the tally now (`served_tokens`)."""
        left = self._running.get(team, 0) - tokens
        if left > 0:
            self._running[team] = left
        else:
            self._running.pop(team, None)

    # --- waiting and leaving ------------------------------------------------------------

    def push(self, w: Waiter) -> None:
        team = w.standing.team
        self._weights[team] = max(1, w.standing.weight)
        band = self._bands[w.priority]
        key = (w.priority, team)
        if not self.queued.get(key):
            self._lift_to_waiting(team)
        fifo = band.get(team)
        if fifo is None:
            fifo = band[team] = deque()
        fifo.append(w)
        self.queued[key] = self.queued.get(key, 0) + 1
        self.depth += 1

    def _lift_to_waiting(self, team: str) -> None:
        """A team that starts waiting again starts at the lowest counter among the teams
        waiting (VTC's lift), never below it."""
        waiting = {t for (_, t), n in self.queued.items() if n and t != team}
        if not waiting:
            return
        floor = min(self.counter(t) for t in waiting)
        mine = self.counter(team)
        if mine < floor:
            self._lift[team] = self._lift.get(team, 0.0) + floor - mine

    def peek(self) -> Waiter | None:
        """The request that leaves next: the first class with anyone waiting, its team with
        the lowest counter (by name on a tie), that team's oldest."""
        for cls in CLASSES:
            band = self._bands[cls]
            teams = [t for t in band if self.queued.get((cls, t))]
            if not teams:
                continue
            team = teams[0] if len(teams) == 1 else min(teams, key=lambda t: (self.counter(t), t))
            fifo = band[team]
            while fifo[0].gone:
                fifo.popleft()
            return fifo[0]
        return None

    def pop(self, w: Waiter) -> None:
        """`w`, just peeked, leaves the queue (it is let go)."""
        fifo = self._bands[w.priority][w.standing.team]
        assert fifo[0] is w
        fifo.popleft()
        self._forget(w)

    def drop(self, w: Waiter) -> None:
        """`w` leaves without being let go (it timed out, was refused, or its client left)."""
        if w.gone:
            return
        w.gone = True
        self._forget(w)
        fifo = self._bands[w.priority].get(w.standing.team)
        if fifo is not None and len(fifo) >= _COMPACT_AT:
            live = self.queued.get((w.priority, w.standing.team), 0)
            if live * 2 < len(fifo):
                fifo_live = deque(x for x in fifo if not x.gone)
                self._bands[w.priority][w.standing.team] = fifo_live

    def _forget(self, w: Waiter) -> None:
        key = (w.priority, w.standing.team)
        left = self.queued[key] - 1
        self.depth -= 1
        if left:
            self.queued[key] = left
            return
        del self.queued[key]
        # none of the team's left in its class is live: its gone ones go with it
        self._bands[w.priority].pop(w.standing.team, None)

    def newest_below(self, priority: Priority) -> Waiter | None:
        """The request to give way to one of class `priority` when the queue is full: the
        newest of the lowest class below it, from the team furthest ahead of its share."""
        for cls in reversed(CLASSES):
            if cls <= priority:
                return None
            band = self._bands[cls]
            teams = [t for t in band if self.queued.get((cls, t))]
            if teams:
                team = max(teams, key=lambda t: (self.counter(t), t))
                for w in reversed(band[team]):
                    if not w.gone:
                        return w
        return None

    def ahead_of(self, priority: Priority) -> int:
        """Requests waiting in `priority`'s class or above it."""
        return sum(n for (cls, _), n in self.queued.items() if cls <= priority)

    def waiters(self) -> Iterator[Waiter]:
        for band in self._bands:
            for fifo in band.values():
                yield from (w for w in fifo if not w.gone)
