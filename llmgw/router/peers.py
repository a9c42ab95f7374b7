"""The routers that share the fleet's engines, as their `load.<router>` records say: which
are live, and what each asks of each model (its demand: requests in flight and queued
there, by class and team). The router's split of each engine (router/share.py) is computed
from these, the same on every router.

A router is live while its record keeps moving (it is written every second), judged by
this router's clock; one whose record has not moved for `stale_after` seconds, or whose key
is gone (a router deletes it as it shuts down), no longer counts, and its share moves to
the others. This router's own record counts as it last wrote it, so its share is what the
others compute for it (but for requests of a class above every class the others send,
router/flow.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from llmgw.bus import records
from llmgw.priority import BY_NAME, Priority
from llmgw.router.share import Demand

# a router whose record has not moved for this long is gone (it writes one every second)
STALE_AFTER_S = 3.0
# teams per class read from a record: a garbled or hostile one cannot make the split slow
MAX_TEAMS = 1024


def demand_of(load: records.ModelLoad) -> dict[tuple[Priority, str], int]:
    """A record's demand for one model, as the split reads it (unknown classes ignored)."""
    out: dict[tuple[Priority, str], int] = {}
    for label, teams in load.demand.items():
        cls = BY_NAME.get(label)
        if cls is None:
            continue
        for team, n in list(teams.items())[:MAX_TEAMS]:
            if n > 0:
                out[(cls, team)] = n
    return out


def demand_record(demand: Demand) -> dict[str, dict[str, int]]:
    """`demand` as a record holds it: class -> team -> requests."""
    out: dict[str, dict[str, int]] = {}
    for (cls, team), n in sorted(demand.items()):
        if n > 0:
            out.setdefault(cls.label, {})[team] = int(n)
    return out


class Peers:
    def __init__(
        self,
        me: str,
        stale_after: float = STALE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.me = me
        self.stale_after = stale_after
        self.clock = clock
        self._demands: dict[str, dict[str, dict[tuple[Priority, str], int]]] = {}
        # router -> model -> replica -> requests it had there when it wrote its record
        self._held: dict[str, dict[str, dict[str, int]]] = {}
        self._moved: dict[str, tuple[int, float]] = {}  # router -> (seq, when it moved)

    def saw(self, router: str, load: records.RouterLoad | None) -> set[str] | None:
        """A router's record as read (None: its key is gone); the models whose split it
        changes (None: every model's, the router comes or goes)."""
        if load is None:
            self._demands.pop(router, None)
            self._held.pop(router, None)
            self._moved.pop(router, None)
            return None
        seen = self._moved.get(router)
        if seen is None or seen[0] != load.seq:
            self._moved[router] = (load.seq, self.clock())
        held_before = self._held.get(router, {})
        held = self._held[router] = {m: v.engines for m, v in load.models.items() if v.engines}
        before = self._demands.get(router)
        now = self._demands[router] = {m: demand_of(v) for m, v in load.models.items()}
        if before is None:
            return None
        return {
            m
            for m in before.keys() | now.keys() | held.keys() | held_before.keys()
            if before.get(m) != now.get(m) or held_before.get(m) != held.get(m)
        }

    def live(self) -> list[str]:
        """The routers that count now, this one always among them."""
        now = self.clock()
        alive = {r for r, (_, at) in self._moved.items() if now - at <= self.stale_after}
        return sorted(alive | {self.me})

    def demands(self, model: str) -> dict[str, Demand]:
        """Each live router's demand for `model` (empty for one asking nothing)."""
        return {r: self._demands.get(r, {}).get(model, {}) for r in self.live()}

    def held(self, router: str, model: str, replica: str) -> int:
        """What `router` had in flight at that engine when it wrote its record."""
        return self._held.get(router, {}).get(model, {}).get(replica, 0)
