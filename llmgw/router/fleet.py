"""What the fleet page shows: the bucket's records read into one JSON document.

Two halves. `FleetWatch` keeps the records the router does not need for routing
(`nodes.*`, `leases.*`, `ops.*`, `fabrics.*`, `load.*`), and keeps them only
while a page is open: its watches start at the first request for the page's state and stop
`idle_after` seconds after the last one, so a router nobody looks at reads and decodes
nothing more than it routes with (heartbeats are the bucket's busiest keys). The catalog,
replicas, shards and placement decisions come from the router's own endpoint table, which
holds them anyway (with health, desired and scale). Both read through the one decoder layer
(llmgw/fleetstate/decode.py). `fleet_state()` is the pure half: records in, the fleet's read
model (llmgw/fleetstate) grouped for the page out, tested without a bus.

Nothing here is on the request path: the document is built when the page asks (every
couple of seconds while it is open), from shallow copies taken on the event loop, in a
worker thread.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from llmgw.bus import keys, records
from llmgw.fleetstate import build
from llmgw.fleetstate.decode import FleetRecords
from llmgw.fleetstate.model import NodeState

log = logging.getLogger(__name__)

# families read only while a page is open (the table has the rest)
WATCHED_WHILE_OPEN: frozenset[str] = frozenset(
    {keys.NODES, keys.LEASES, keys.OPS, keys.FABRICS, keys.LOAD}
)
NO_FABRIC = ""  # the group of nodes on no fabric (each its own island for placement)


def _watched() -> FleetRecords:
    return FleetRecords(families=WATCHED_WHILE_OPEN)


class FleetWatch:
    """The families of WATCHED_WHILE_OPEN, followed while someone looks."""

    def __init__(self, idle_after: float = 30.0) -> None:
        self.idle_after = idle_after
        self.records = _watched()
        self.watching = False  # what tests and /health-minded people may look at
        self.synced = False
        self._asked = anyio.Event()
        self._synced = anyio.Event()
        self._last_asked = float("-inf")

    async def wanted(self, wait: float) -> bool:
        """A page asks: start watching if not yet, and wait up to `wait` seconds for the
        first read of the bucket. True once it has been read."""
        self._last_asked = anyio.current_time()
        self._asked.set()
        if not self.synced:
            with anyio.move_on_after(wait):
                await self._synced.wait()
        return self.synced

    async def run(self, bus_of: Callable[[], Any]) -> None:
        """Owned by the router's task group: idle until a page asks, then follows the
        bucket (`bus_of()`, the router's Bus once connected) until nobody has asked for
        `idle_after` seconds, and so on."""
        while True:
            await self._asked.wait()
            bus = bus_of()
            if bus is None:  # not connected yet (or a router without NATS)
                self._asked = anyio.Event()
                continue
            self.watching = True
            log.info("router: a fleet page is open; following nodes, leases and fabrics")
            try:
                async with anyio.create_task_group() as tg:
                    synced: set[str] = set()
                    for prefix in sorted(WATCHED_WHILE_OPEN):
                        tg.start_soon(self._follow, bus, prefix, synced)
                    while anyio.current_time() - self._last_asked < self.idle_after:
                        await anyio.sleep(self.idle_after / 4)
                    tg.cancel_scope.cancel()
            finally:
                self.watching = False
                self.synced = False
                self._synced = anyio.Event()
                self._asked = anyio.Event()
                self.records = _watched()
            log.info("router: no fleet page asked for %g s; stopped following", self.idle_after)

    async def _follow(self, bus, prefix: str, synced: set[str]) -> None:
        from llmgw.bus.client import RAW, Synced

        # raw bytes: the one decoder layer (llmgw/fleetstate/decode.py) reads them
        async for item in bus.watch(keys.pattern(prefix), RAW):
            if isinstance(item, Synced):
                synced.add(prefix)
                if len(synced) == len(WATCHED_WHILE_OPEN):
                    self.synced = True
                    self._synced.set()
                continue
            self.records.apply(item.key, item.value, item.revision)


# --- this router's load per model ------------------------------------------------------------


class HistogramWindow:
    """Time to first byte per model over the last `window` seconds, from the router's
    histogram (llmgw_router_time_to_first_byte_seconds): its cumulative buckets are sampled
    when the page asks, and the newest sample at least `window` old is subtracted. Until
    there is one (a page open for less than a window), the figures are since the router
    started, and say so (`window_s` None)."""

    def __init__(
        self,
        histogram,
        window: float = 60.0,
        group: Callable[[dict[str, str]], Any] = lambda labels: labels.get("model") or None,
    ) -> None:
        self._histogram = histogram
        self.window = window
        self._group = group  # a sample's labels -> what it is summed under (None: left out)
        self._samples: deque[tuple[float, dict[Any, _Buckets]]] = deque()

    def sample(self, now: float) -> dict[Any, dict[str, float | int | None]]:
        current = _grouped(self._histogram, self._group)
        self._samples.append((now, current))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        old_enough = self._samples[0][0] <= now - self.window
        base = self._samples[0][1] if old_enough else {}
        out = {}
        for model, buckets in current.items():
            summary = buckets.minus(base.get(model)).summary()
            summary["window_s"] = self.window if old_enough else None
            out[model] = summary
        return out


@dataclass
class _Buckets:
    bounds: list[float]  # upper bounds, +Inf last
    counts: list[float]  # cumulative
    total: float = 0.0
    count: float = 0.0

    def minus(self, base: _Buckets | None) -> _Buckets:
        if base is None or base.bounds != self.bounds or base.count > self.count:
            return self  # new, or its series were reset (replicas forgotten): all of it
        return _Buckets(
            self.bounds,
            [a - b for a, b in zip(self.counts, base.counts, strict=True)],
            self.total - base.total,
            self.count - base.count,
        )

    def summary(self) -> dict[str, float | int | None]:
        n = int(self.count)
        return {
            "count": n,
            "mean_s": self.total / n if n else None,
            "p50_s": self.quantile(0.5),
            "p95_s": self.quantile(0.95),
        }

    def quantile(self, q: float) -> float | None:
        """As Prometheus' histogram_quantile: linear within the bucket it falls in."""
        if not self.count:
            return None
        rank = q * self.count
        i = bisect.bisect_left(self.counts, rank)
        i = min(i, len(self.counts) - 1)
        upper = self.bounds[i]
        lower = self.bounds[i - 1] if i > 0 else 0.0
        if math.isinf(upper):
            return lower  # above the largest bound: say the bound
        below = self.counts[i - 1] if i > 0 else 0.0
        in_bucket = self.counts[i] - below
        if in_bucket <= 0:
            return upper
        return lower + (upper - lower) * (rank - below) / in_bucket


def _grouped(histogram, group: Callable[[dict[str, str]], Any]) -> dict[Any, _Buckets]:
    """The histogram's buckets summed by `group` of their labels (by default each model's
    replicas together; requests that reached no model left out)."""
    out: dict[Any, _Buckets] = {}
    by_le: dict[Any, dict[float, float]] = {}
    for family in histogram.collect():
        for s in family.samples:
            model = group(s.labels)
            if model is None:
                continue
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                per = by_le.setdefault(model, {})
                per[le] = per.get(le, 0.0) + s.value
            elif s.name.endswith("_sum"):
                out.setdefault(model, _Buckets([], [])).total += s.value
            elif s.name.endswith("_count"):
                out.setdefault(model, _Buckets([], [])).count += s.value
    for model, per in by_le.items():
        b = out.setdefault(model, _Buckets([], []))
        b.bounds = sorted(per)
        b.counts = [per[le] for le in b.bounds]
    return out


def local_load(
    backends: Iterable,
    ttfb: dict[str, dict],
    waiting: dict[str, int],
    queued: Mapping[tuple[str, str, str], int] | None = None,
    waits: Mapping[tuple[str, str, str], dict] | None = None,
) -> dict[str, dict[str, Any]]:
    """This router's figures per model (catalog id): requests in flight at its engines (and
    what it may have there: its share of those whose capacity is known), the requests it
    holds queued (for a replica, router/hold.py, or for room at its engines, router/flow.py),
    time to first byte over the HistogramWindow, and its queue by class and team: how many wait
    now and how long they waited over the window (`queued`, `waits`: keyed by model, class,
    team). Fleet-wide load, every router's summed, belongs in `fleet_state`'s `load.fleet`."""
    out: dict[str, dict[str, Any]] = {}

    def model(name: str) -> dict[str, Any]:
        return out.setdefault(
            name, {"in_flight": 0, "share": None, "queued": 0, "ttfb": None, "queue": []}
        )

    for b in backends:
        m = model(b.model)
        m["in_flight"] += b.in_flight
        if b.routable and b.share is not None:
            m["share"] = (m["share"] or 0) + b.share
    for name, summary in ttfb.items():
        model(name)["ttfb"] = summary
    for name, count in waiting.items():
        if count:
            model(name)["queued"] += count
    queued, waits = queued or {}, waits or {}
    for name, cls, team in sorted(set(queued) | set(waits), key=_class_order):
        n = queued.get((name, cls, team), 0)
        m = model(name)
        m["queued"] += n
        m["queue"].append(
            {"class": cls, "team": team, "waiting": n, "wait": waits.get((name, cls, team))}
        )
    return out


def _class_order(key: tuple[str, str, str]) -> tuple[str, int, str]:
    name, cls, team = key
    order = records.PRIORITY_CLASSES.index(cls) if cls in records.PRIORITY_CLASSES else 9
    return name, order, team


# --- the document ----------------------------------------------------------------------------


def fleet_state(
    r: FleetRecords, load: dict[str, dict[str, Any]], now: float, router: dict[str, Any]
) -> dict[str, Any]:
    """The page's document: the fleet's read model (llmgw/fleetstate/model.py, what
    `llmgw status --json` encodes) with its nodes grouped by fabric, and this router's and
    every router's load beside each model. Every string in it is from the bucket: the page
    sets it as text, never as markup."""
    view = build.fleet(r, now, labels=False)
    fleet, routers = fleet_load(r.loads, now)
    groups: dict[str, list[NodeState]] = {}
    for n in view.nodes.values():
        if n.inventory:
            groups.setdefault(n.fabric, []).append(n)
    fabrics = [
        {
            "name": name,
            "nodes": groups[name],
            "holds": _holdings(name, [n.id for n in groups[name]], r),
        }
        for name in sorted(groups, key=lambda g: (g == NO_FABRIC, g))
    ]
    models = [
        {
            **msgspec.to_builtins(m),
            "load": load.get(m.id) or {"in_flight": 0, "queued": None, "ttfb": None},
            # every router's, summed from their load.<router> keys (None: none published one)
            "fleet_load": fleet.get(m.id),
        }
        for m in view.models.values()
    ]
    return {
        "now": now,
        "router": router,
        "fabrics": fabrics,
        "models": models,
        "unreadable": view.unreadable,
        "load": {"scope": "this router", "routers": routers},
    }


# a router's load.<router> key is rewritten every second while it serves; older than this,
# by its own clock against this router's, it is a router gone (or far out of step)
LOAD_CURRENT_S = 15.0


def fleet_load(
    loads: dict[str, records.RouterLoad], now: float
) -> tuple[dict[str, dict[str, Any]], int]:
    """Every current router's published load per model, summed (each router counts only
    what it sent, so a sum counts nothing twice), and how many routers were current."""
    out: dict[str, dict[str, Any]] = {}
    current = 0
    for load in loads.values():
        if abs(now - load.at) > LOAD_CURRENT_S:
            continue
        current += 1
        for model, m in list(load.models.items())[: records.MAX_LOAD_MODELS]:
            have = out.setdefault(model, {"in_flight": 0.0, "queued": 0, "ttft_ms": 0.0})
            have["in_flight"] += m.in_flight
            have["queued"] += m.waiting
            have["ttft_ms"] = max(have["ttft_ms"], m.ttft_ms)
    for v in out.values():
        v["in_flight"] = round(v["in_flight"], 1)
    return out, current


def _holdings(fabric: str, nodes: list[str], r: FleetRecords) -> list[dict[str, Any]]:
    """What a fabric holds (the controller's fabrics.<fabric>); for the nodes on no fabric,
    what each node's island holds."""
    holdings = []
    if fabric != NO_FABRIC:
        sources = [r.fabrics[fabric]] if fabric in r.fabrics else []
    else:
        sources = [f for f in r.fabrics.values() if f.island and set(f.nodes) & set(nodes)]
    for f in sources:
        for m in f.models:
            holdings.append(
                {
                    "key": m.key,
                    "copies": [
                        {"store": c.store, "kind": c.kind, "bytes": c.bytes, "nodes": c.nodes}
                        for c in m.copies
                    ],
                }
            )
    return sorted(holdings, key=lambda h: h["key"])


def encode_state(state: dict[str, Any]) -> bytes:
    return msgspec.json.encode(state)
