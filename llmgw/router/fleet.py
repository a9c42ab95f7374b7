"""What the fleet page shows: the bucket's records read into one JSON document.

Two halves. `FleetWatch` keeps the records the router does not need for routing
(`nodes.*`, `leases.*`, `health.*`, `ops.*`, `fabrics.*`, `desired.*`), and keeps them only
while a page is open: its watches start at the first request for the page's state and stop
`idle_after` seconds after the last one, so a router nobody looks at reads and decodes
nothing more than it routes with (heartbeats are the bucket's busiest keys). The catalog,
replicas, shards and placement decisions come from the router's own endpoint table, which
holds them anyway. `fleet_state()` is the pure half: records in, the page's document out,
tested without a bus.

Nothing here is on the request path: the document is built when the page asks (every
couple of seconds while it is open), from shallow copies taken on the event loop, in a
worker thread.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from llmgw import catalog
from llmgw.bus import keys, records

log = logging.getLogger(__name__)

# families read only while a page is open (the table has the rest)
WATCHED_WHILE_OPEN: dict[str, type[msgspec.Struct]] = {
    keys.NODES: records.NodeInventory,
    keys.LEASES: records.Lease,
    keys.HEALTH: records.Health,
    keys.OPS: records.NodeOps,
    keys.FABRICS: records.FabricHoldings,
    keys.DESIRED: records.Desired,
    keys.LOAD: records.RouterLoad,
}
NO_FABRIC = ""  # the group of nodes on no fabric (each its own island for placement)


@dataclass
class FleetRecords:
    """Every record the page reads, by the id its key names (a reader trusts the key)."""

    nodes: dict[str, records.NodeInventory] = field(default_factory=dict)
    leases: dict[str, records.Lease] = field(default_factory=dict)
    health: dict[str, records.Health] = field(default_factory=dict)
    ops: dict[str, records.NodeOps] = field(default_factory=dict)
    fabrics: dict[str, records.FabricHoldings] = field(default_factory=dict)
    desired: dict[str, records.Desired] = field(default_factory=dict)
    models: dict[str, catalog.Model] = field(default_factory=dict)
    replicas: dict[tuple[str, str], records.Replica] = field(default_factory=dict)
    shards: dict[tuple[str, str], records.Shard] = field(default_factory=dict)
    placements: dict[str, records.PlacementRecord] = field(default_factory=dict)
    loads: dict[str, records.RouterLoad] = field(default_factory=dict)  # by router id


class FleetWatch:
    """The families of WATCHED_WHILE_OPEN, followed while someone looks."""

    def __init__(self, idle_after: float = 30.0) -> None:
        self.idle_after = idle_after
        self.records = FleetRecords()
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
                    for prefix, type_ in WATCHED_WHILE_OPEN.items():
                        tg.start_soon(self._follow, bus, prefix, type_, synced)
                    while anyio.current_time() - self._last_asked < self.idle_after:
                        await anyio.sleep(self.idle_after / 4)
                    tg.cancel_scope.cancel()
            finally:
                self.watching = False
                self.synced = False
                self._synced = anyio.Event()
                self._asked = anyio.Event()
                self.records = FleetRecords()
            log.info("router: no fleet page asked for %g s; stopped following", self.idle_after)

    async def _follow(self, bus, prefix: str, type_: type, synced: set[str]) -> None:
        from llmgw.bus.client import Synced, decoder

        table = _table_of(self.records, prefix)
        async for item in bus.watch(keys.pattern(prefix), decoder(type_)):
            if isinstance(item, Synced):
                synced.add(prefix)
                if len(synced) == len(WATCHED_WHILE_OPEN):
                    self.synced = True
                    self._synced.set()
                continue
            parsed = keys.parse(item.key)
            if parsed is None:
                continue  # not a key llmgw writes (an id that is not a token): not shown
            if item.value is None:
                table.pop(parsed.ids[0], None)
            else:
                table[parsed.ids[0]] = item.value


def _table_of(r: FleetRecords, prefix: str) -> dict:
    return {
        keys.NODES: r.nodes,
        keys.LEASES: r.leases,
        keys.HEALTH: r.health,
        keys.OPS: r.ops,
        keys.FABRICS: r.fabrics,
        keys.DESIRED: r.desired,
        keys.LOAD: r.loads,
    }[prefix]


# --- this router's load per model ------------------------------------------------------------


class TtfbWindow:
    """Time to first byte per model over the last `window` seconds, from the router's
    histogram (llmgw_router_time_to_first_byte_seconds): its cumulative buckets are sampled
    when the page asks, and the newest sample at least `window` old is subtracted. Until
    there is one (a page open for less than a window), the figures are since the router
    started, and say so (`window_s` None)."""

    def __init__(self, histogram, window: float = 60.0) -> None:
        self._histogram = histogram
        self.window = window
        self._samples: deque[tuple[float, dict[str, _Buckets]]] = deque()

    def sample(self, now: float) -> dict[str, dict[str, float | int | None]]:
        current = _per_model(self._histogram)
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


def _per_model(histogram) -> dict[str, _Buckets]:
    """The histogram's buckets summed over each model's replicas."""
    out: dict[str, _Buckets] = {}
    by_le: dict[str, dict[float, float]] = {}
    for family in histogram.collect():
        for s in family.samples:
            model = s.labels.get("model", "")
            if not model:
                continue  # requests that reached no model
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
    backends: Iterable, ttfb: dict[str, dict], waiting: dict[str, int]
) -> dict[str, dict[str, Any]]:
    """This router's figures per model (catalog id): requests in flight at its engines, the
    requests it holds queued waiting for a replica (router/hold.py), and time to first byte
    over the TtfbWindow. Fleet-wide load, every router's summed, belongs in `fleet_state`'s
    `load.fleet`."""
    out: dict[str, dict[str, Any]] = {}

    def model(name: str) -> dict[str, Any]:
        return out.setdefault(name, {"in_flight": 0, "queued": 0, "ttfb": None})

    for b in backends:
        model(b.model)["in_flight"] += b.in_flight
    for name, summary in ttfb.items():
        model(name)["ttfb"] = summary
    for name, count in waiting.items():
        if count:
            model(name)["queued"] = count
    return out


# --- the document ----------------------------------------------------------------------------


def fleet_state(
    r: FleetRecords, load: dict[str, dict[str, Any]], now: float, router: dict[str, Any]
) -> dict[str, Any]:
    """The page's document. Every string in it is from the bucket: the page sets it as
    text, never as markup."""
    held = _gpus_held(r)
    ix = _Index.of(r)
    fleet, routers = fleet_load(r.loads, now)
    groups: dict[str, list[str]] = {}
    for node in sorted(r.nodes):
        groups.setdefault(ix.fabric_of(node, r), []).append(node)
    fabrics = []
    for name in sorted(groups, key=lambda g: (g == NO_FABRIC, g)):
        fabrics.append(
            {
                "name": name,
                "nodes": [_node(n, r, held, ix) for n in groups[name]],
                "holds": _holdings(name, groups[name], r),
            }
        )
    names = sorted(set(r.desired) | set(r.placements) | {m for m, _ in r.replicas} | set(r.models))
    return {
        "now": now,
        "router": router,
        "fabrics": fabrics,
        "models": [_model(m, r, load.get(m), ix, fleet.get(m)) for m in names],
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


@dataclass
class _Index:
    """The records by what the document looks them up by, built once per document (a fleet
    of 200 nodes and 300 replicas is looked through once, not once per node and model)."""

    fabric: dict[str, str]  # node -> the controller's (non-island) fabric that lists it
    shards_by_node: dict[str, list[tuple[str, records.Shard]]]  # (rid, its shard) in rid order
    shards_by_rid: dict[str, list[records.Shard]]  # in node order
    replicas_by_model: dict[str, list[records.Replica]]  # in rid order
    replica: dict[str, records.Replica]  # by rid

    @classmethod
    def of(cls, r: FleetRecords) -> _Index:
        fabric: dict[str, str] = {}
        for name, f in sorted(r.fabrics.items(), reverse=True):  # the first name wins
            if not f.island:
                fabric.update(dict.fromkeys(f.nodes, name))
        by_node: dict[str, list[tuple[str, records.Shard]]] = {}
        by_rid: dict[str, list[records.Shard]] = {}
        for (node, rid), shard in sorted(r.shards.items()):
            by_node.setdefault(node, []).append((rid, shard))
            by_rid.setdefault(rid, []).append(shard)
        by_model: dict[str, list[records.Replica]] = {}
        for (model, _), rep in sorted(r.replicas.items()):
            by_model.setdefault(model, []).append(rep)
        replica = {rid: rep for (_, rid), rep in r.replicas.items()}
        return cls(fabric, by_node, by_rid, by_model, replica)

    def fabric_of(self, node: str, r: FleetRecords) -> str:
        """The fabric group a node is shown in: the controller's fabrics.<fabric> that lists
        it (not an island), else the first active fabric its inventory names, else none."""
        return self.fabric.get(node) or min(r.nodes[node].fabrics(), default=NO_FABRIC)


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


def _gpus_held(r: FleetRecords) -> dict[tuple[str, str], tuple[records.Replica, int]]:
    """(node, GPU uuid) -> the replica holding it and the bytes its profile asked per GPU
    (0: none said; llmgw gives engines whole GPUs)."""
    out = {}
    for rep in r.replicas.values():
        if rep.phase not in records.REPLICA_HOLDS_GPUS_AND_PORTS:
            continue
        model = r.models.get(rep.model)
        profile = (
            next((p for p in model.profiles if p.name == rep.profile), None) if model else None
        )
        asked = int(profile.gpu_memory_gb * 1e9) if profile else 0
        for m in rep.members:
            for uuid in m.gpus:
                out[(m.node, uuid)] = (rep, asked)
    return out


def _node(
    node: str,
    r: FleetRecords,
    held: dict[tuple[str, str], tuple[records.Replica, int]],
    ix: _Index,
) -> dict[str, Any]:
    inv = r.nodes[node]
    replica_of = ix.replica
    lease = r.leases.get(node)
    health = r.health.get(node)
    ops = r.ops.get(node)
    memory = lease.memory if lease else inv.memory
    out_of_service = set(ops.gpus_out) if ops else set()
    gpus = []
    for g in inv.gpus.devices:
        holder = held.get((node, g.uuid))
        gpus.append(
            {
                "index": g.index,
                "name": g.name,
                "total_bytes": g.memory_total_bytes,
                "used_bytes": g.memory_used_bytes,
                "own_bytes": sum(p.used_bytes or 0 for p in g.processes if p.own),
                "foreign_bytes": g.foreign_bytes(),
                "processes": [
                    {"pid": p.pid, "name": p.name, "used_bytes": p.used_bytes, "own": p.own}
                    for p in g.processes
                ],
                "allocated": None
                if holder is None
                else {
                    "model": holder[0].model,
                    "replica": holder[0].rid,
                    "bytes": holder[1] or g.memory_total_bytes,
                    "whole": not holder[1],
                },
                "out_of_service": g.uuid in out_of_service,
            }
        )
    free = sum(1 for g in gpus if g["allocated"] is None and not g["out_of_service"])
    return {
        "id": node,
        "hostname": inv.hostname,
        "address": inv.address,
        "phase": health.phase if health else "unjudged",
        "phase_since": health.since if health else None,
        "phase_reason": health.reason if health else "",
        "heartbeat_at": lease.time if lease else None,
        "ram_total_bytes": memory.total_bytes,
        "ram_available_bytes": memory.available_bytes,
        "gpu_status": inv.gpus.status,
        "gpus": gpus,
        "gpus_free": free,
        "engines": [{"name": e.name, "version": e.version} for e in inv.engines],
        # the rid its key names (a reader trusts the key), the model its replica names
        "running": [
            f"{rep.model if (rep := replica_of.get(rid)) else s.model} {rid} {s.phase}"
            for rid, s in ix.shards_by_node.get(node, [])
        ],
        "ops": None
        if ops is None
        else {"cordoned": ops.cordoned, "drain": ops.drain, "reason": ops.reason},
    }


def _model(
    model: str,
    r: FleetRecords,
    load: dict[str, Any] | None,
    ix: _Index,
    fleet: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cat = r.models.get(model)
    desired = r.desired.get(model)
    p = r.placements.get(model)
    replicas = []
    for rep in ix.replicas_by_model.get(model, []):
        replicas.append(
            {
                "rid": rep.rid,
                "profile": rep.profile,
                "phase": rep.phase,
                "endpoint": rep.endpoint,
                "nodes": [mem.node for mem in rep.members],
                "shards": [s.phase for s in ix.shards_by_rid.get(rep.rid, [])],
            }
        )
    placement = None
    if p is not None:
        unplaced = max(p.desired - p.placed, p.waiting, 0)
        placement = {
            "desired": p.desired,
            "placed": p.placed,
            "unplaced": unplaced,
            "waiting": p.waiting,
            "judged": p.judged,
            "blocked": p.blocked,
            "explanation": p.explanation,
            "refused": [
                {"profile": x.profile, "reason": x.reason, "nodes": x.nodes, "detail": x.detail}
                for x in p.refused
            ],
            "decided_at": p.decided_at,
        }
    return {
        "id": model,
        "served_name": cat.served_name if cat else "",
        "desired": desired.replicas if desired else (p.desired if p else 0),
        "replicas": replicas,
        "placement": placement,
        "load": load or {"in_flight": 0, "queued": None, "ttfb": None},
        # every router's, summed from their load.<router> keys (None: none published one)
        "fleet_load": fleet,
    }


def encode_state(state: dict[str, Any]) -> bytes:
    return msgspec.json.encode(state)
