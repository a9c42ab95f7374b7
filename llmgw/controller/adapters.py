"""Which LoRA adapters each replica of a base serves: pure, no I/O, time passed in.

The answer goes into each replica's assignments (`Assignment.adapters`), which the agents
follow: vLLM loads and unloads adapters while it runs, llama-server is started with them.
The assignments are also what this remembers between passes: an adapter stays where it
is unless a rule here moves it, so a pass run again on the same view changes nothing.

llama-server takes its adapters only at start, so every replica of a llama-server base is
given every GGUF adapter of the base that its node holds; a new adapter reaches it when
the replica is replaced (the launch changed: a rollout, controller/placement/rollout.py).

vLLM loads an adapter in milliseconds, so its replicas serve what the demand asks:
- an adapter gets one replica for every `target_in_flight` requests it has in flight
  (the base's autoscale target, else 2), at least one while it was asked for lately, and
  one more while a router holds requests for it (loaded nowhere yet, or every replica
  holding it busier than its share: router/adapters.py);
- an adapter nobody asked for is loaded where a slot is free, so that its first request
  finds it (a slot is a place in the replica's `adapter_slots`);
- for an adapter with requests in flight or held, a replica with no free slot makes room
  by unloading the adapter used least lately that has no request in flight, has been
  loaded for `resident_s` at least (unless nobody asked for it since it was loaded ahead),
  and was not asked for in the last `busy_s` (the churn budget: a slot an adapter was
  asked for in turns over at most once a `resident_s`, and an adapter in use is never
  unloaded for another); a spare copy goes first, and another adapter's last copy only
  for an adapter loaded nowhere;
- one adapter gets at most one new replica every `settle_s` (a load takes effect in
  about a second; the next pass sees whether it was enough), and gives back a copy its
  demand no longer needs only after `resident_s`;
- an adapter an engine refused (another base, a rank over the room, incomplete files)
  stays where it failed, so the failure is said once, and is loaded nowhere else.
Only replicas whose nodes hold the adapter's files complete (every member's, for a
multi-node one) take it, and only those launched with LoRA room (current, not outdated).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.bus.records import (
    REPLICA_COUNTED,
    AdapterAssigned,
    Assignment,
    LoraRoom,
    NodeInventory,
    Replica,
    Shard,
)
from llmgw.catalog import Adapter, Model, launch_hash, lora_room

TARGET_IN_FLIGHT = 2.0  # per replica, for a base without an autoscale policy


@dataclass(frozen=True, slots=True)
class AdapterPolicy:
    resident_s: float = 60.0  # an adapter loaded stays at least this long
    settle_s: float = 5.0  # between two new replicas of one adapter
    busy_s: float = 10.0  # asked for within this long: not unloaded for another
    idle_s: float = 300.0  # asked for within this long: kept on one replica at least


@dataclass(frozen=True, slots=True)
class Demand:
    """One adapter's requests, summed over the routers (autoscale.ModelLoad), and when it
    was last asked for (the leader's wall clock)."""

    in_flight: float = 0.0
    waiting: int = 0
    last_active: float = float("-inf")


class DemandTracker:
    """When each adapter was last asked for, from the routers' summed loads at each pass. A
    new leader starts every adapter as asked for at its first pass: it never unloads one
    for being idle before it has watched it for its own `idle_s`."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._started: float | None = None

    def demand(
        self, loads: Mapping[str, object], adapters: Iterable[str], now: float
    ) -> dict[str, Demand]:
        """`loads`: model id -> autoscale.ModelLoad (in_flight, waiting, active)."""
        if self._started is None:
            self._started = now
        out: dict[str, Demand] = {}
        for aid in adapters:
            load = loads.get(aid)
            in_flight = float(getattr(load, "in_flight", 0.0))
            waiting = int(getattr(load, "waiting", 0))
            if getattr(load, "active", False) or in_flight > 0 or waiting > 0:
                self._last[aid] = now
            last = self._last.get(aid, self._started)
            out[aid] = Demand(in_flight, waiting, last)
        for gone in set(self._last) - set(out):
            del self._last[gone]
        return out


@dataclass(frozen=True, slots=True)
class Seat:
    """A replica of a base as adapter placement sees it."""

    rid: str
    slots: int  # adapters it keeps loaded at most (vLLM); 0: as many as its node holds
    holds: frozenset[str]  # adapter paths its nodes hold complete
    have: tuple[AdapterAssigned, ...]  # what its assignments give it now
    failed: frozenset[str] = frozenset()  # adapter ids its engine refused
    current: bool = True  # launched with the room the catalog asks now (not outdated)
    load: float = 0.0  # its engine's requests, from its node's lease: a tie-break


@dataclass
class _Table:
    """The pass's working copy: what each seat is given, and where each adapter is."""

    seats: dict[str, Seat]
    given: dict[str, dict[str, AdapterAssigned]] = field(default_factory=dict)
    where: dict[str, list[str]] = field(default_factory=dict)

    def add(self, rid: str, entry: AdapterAssigned) -> None:
        self.given[rid][entry.id] = entry
        self.where.setdefault(entry.id, []).append(rid)

    def drop(self, rid: str, aid: str) -> None:
        del self.given[rid][aid]
        self.where[aid].remove(rid)

    def free(self, rid: str) -> int:
        return self.seats[rid].slots - len(self.given[rid])


def entry(adapter: Adapter, since: float) -> AdapterAssigned:
    return AdapterAssigned(
        id=adapter.id, name=adapter.served_name, path=adapter.path, rank=adapter.rank, since=since
    )


def _kept(adapter: Adapter | None, have: AdapterAssigned) -> bool:
    """Whether an assigned adapter is still the catalog's as assigned (the same files and
    name): a changed one is unloaded and loaded anew."""
    return adapter is not None and (adapter.served_name, adapter.path, adapter.rank) == (
        have.name,
        have.path,
        have.rank,
    )


def started_with(
    seats: Sequence[Seat], adapters: Sequence[Adapter], now: float
) -> dict[str, list[AdapterAssigned]]:
    """llama-server: every adapter (by id) whose file the seat's nodes hold."""
    out: dict[str, list[AdapterAssigned]] = {}
    for seat in seats:
        had = {a.id: a for a in seat.have}
        out[seat.rid] = [
            entry(a, had[a.id].since if a.id in had and _kept(a, had[a.id]) else now)
            for a in sorted(adapters, key=lambda a: a.id)
            if a.path.rstrip("/") in seat.holds
        ]
    return out


def loaded_for_demand(
    seats: Sequence[Seat],
    adapters: Sequence[Adapter],
    demand: Mapping[str, Demand],
    now: float,
    *,
    policy: AdapterPolicy = AdapterPolicy(),
    target: float = TARGET_IN_FLIGHT,
    frozen: Iterable[str] = (),
) -> dict[str, list[AdapterAssigned]]:
    """vLLM: each seat's adapters (the module's rules). `frozen`: adapter ids whose catalog
    value does not read: kept where they are, loaded nowhere else."""
    by_id = {a.id: a for a in adapters}
    keep = set(frozen)
    table = _Table({s.rid: s for s in seats}, {s.rid: {} for s in seats})
    for seat in seats:
        for have in seat.have:
            if have.id in keep or _kept(by_id.get(have.id), have):
                table.add(seat.rid, have)
    refused = {aid for s in seats for aid in s.failed}
    asked = sorted(
        (a for a in adapters if a.id not in refused),
        key=lambda a: _urgency(demand.get(a.id, Demand()), a.id),
    )
    for adapter in asked:
        d = demand.get(adapter.id, Demand())
        want = _wanted(d, len(table.where.get(adapter.id, [])), target, now, policy)
        _grow(table, adapter, d, want, demand, now, policy)
        _trim(table, adapter, d, want, now, policy)
    return {rid: sorted(given.values(), key=lambda e: e.id) for rid, given in table.given.items()}


def _urgency(d: Demand, aid: str) -> tuple:
    # waiting first, then the most in flight, then the latest asked for
    return (-d.waiting, -d.in_flight, -d.last_active, aid)


def _wanted(d: Demand, have: int, target: float, now: float, policy: AdapterPolicy) -> int:
    want = math.ceil(d.in_flight / target - 1e-9) if d.in_flight > 0 else 0
    if d.waiting > 0:
        want = max(want, have + 1)  # held at a router: loaded nowhere, or too busy where it is
    if now - d.last_active < policy.idle_s:
        want = max(want, 1)
    return want


def _in_use(d: Demand, now: float, policy: AdapterPolicy) -> bool:
    return d.in_flight > 0 or d.waiting > 0 or now - d.last_active < policy.busy_s


def _grow(
    table: _Table,
    adapter: Adapter,
    d: Demand,
    want: int,
    demand: Mapping[str, Demand],
    now: float,
    policy: AdapterPolicy,
) -> None:
    where = table.where.setdefault(adapter.id, [])
    candidates = [
        s
        for s in table.seats.values()
        if s.current and adapter.path.rstrip("/") in s.holds and s.rid not in where
    ]
    # an adapter nobody asks for now takes only a free slot (it is loaded ahead of its next
    # request); one with requests in flight or held may make room
    may_evict = d.in_flight > 0 or d.waiting > 0
    wanted = max(want, 1)
    while len(where) < wanted and candidates:
        newest = max((table.given[r][adapter.id].since for r in where), default=float("-inf"))
        if where and now - newest < policy.settle_s:
            return
        seat, victim = _seat_for(table, candidates, demand, now, policy, may_evict, not where)
        if seat is None:
            return
        if victim is not None:
            table.drop(seat.rid, victim)
        table.add(seat.rid, entry(adapter, now))
        candidates.remove(seat)


def _seat_for(
    table: _Table,
    candidates: list[Seat],
    demand: Mapping[str, Demand],
    now: float,
    policy: AdapterPolicy,
    may_evict: bool,
    loaded_nowhere: bool,
) -> tuple[Seat | None, str | None]:
    """The seat for one more copy, and what it unloads to make room (None: a free slot).
    Only an adapter loaded nowhere unloads another's last copy: one more copy of a loaded
    adapter takes a free slot or a spare copy, or a popular adapter's extra copies would
    push the rarely asked out of the fleet, each then missed and loaded again."""
    free = [s for s in candidates if table.free(s.rid) > 0]
    if free:
        return min(free, key=lambda s: (-table.free(s.rid), s.load, s.rid)), None
    if not may_evict:
        return None, None
    best: tuple[tuple, Seat, str] | None = None
    for seat in candidates:
        for aid, have in table.given[seat.rid].items():
            d = demand.get(aid, Demand())
            if _in_use(d, now, policy) or _resident(have, d, now, policy):
                continue
            last = len(table.where.get(aid, [])) <= 1
            if last and not loaded_nowhere:
                continue
            # a spare copy first, then the adapter asked for least lately
            rank = (last, d.last_active, seat.load, seat.rid, aid)
            if best is None or rank < best[0]:
                best = (rank, seat, aid)
    return (best[1], best[2]) if best is not None else (None, None)


def _resident(have: AdapterAssigned, d: Demand, now: float, policy: AdapterPolicy) -> bool:
    """Within its churn budget: loaded less than `resident_s` ago and asked for since. One
    loaded ahead of any request (into a free slot) and not asked for since gives its slot
    at once: taking it back moves nothing anyone used, and it comes back only when asked."""
    return now - have.since < policy.resident_s and d.last_active >= have.since


def _trim(
    table: _Table, adapter: Adapter, d: Demand, want: int, now: float, policy: AdapterPolicy
) -> None:
    """One copy more than the demand needs is given back per pass, the newest first, once
    it has been loaded `resident_s` and nothing waits for the adapter."""
    where = table.where.get(adapter.id, [])
    if len(where) <= max(want, 1) or d.waiting > 0:
        return
    newest = max(where, key=lambda r: (table.given[r][adapter.id].since, r))
    if now - table.given[newest][adapter.id].since >= policy.resident_s:
        table.drop(newest, adapter.id)


# --- seats from the bucket's records ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Given:
    """What one replica's assignments say of LoRA: its room (vLLM), and its adapters (given
    to its rank 0, which serves the API)."""

    room: LoraRoom | None
    adapters: list[AdapterAssigned]


def plan(
    *,
    catalog: Mapping[str, Model],
    adapters: Mapping[str, Sequence[Adapter]],
    nodes: Mapping[str, NodeInventory],
    shards: Mapping[tuple[str, str], Shard],
    replicas: Mapping[str, Replica],
    assigns: Mapping[tuple[str, str], Assignment],
    demand: Mapping[str, Demand],
    now: float,
    policy: AdapterPolicy = AdapterPolicy(),
    frozen: Iterable[str] = (),
) -> dict[str, Given]:
    """Every replica's LoRA, by rid. `adapters`: by base id; `frozen`: adapter ids whose
    value does not read (kept where they are). A replica going away keeps what it has."""
    out: dict[str, Given] = {}
    by_base: dict[tuple[str, str], list[Seat]] = {}
    for rid, r in replicas.items():
        model = catalog.get(r.model)
        profile = model.profile(r.profile) if model is not None else None
        rank0 = next((m for m in r.members if m.rank == 0), r.members[0])
        had = assigns.get((rank0.node, rid))
        have = tuple(had.adapters) if had is not None else ()
        if model is None or profile is None or r.phase not in REPLICA_COUNTED:
            out[rid] = Given(had.lora if had else None, list(have))
            continue
        mine = adapters.get(model.id, ())
        room = lora_room(profile, mine)
        fmt = "gguf" if profile.engine == "llama-server" else "peft"
        shard = shards.get((rank0.node, rid))
        seat = Seat(
            rid=rid,
            slots=room.slots if room else 0,
            holds=_held(nodes, [m.node for m in r.members], fmt),
            have=have,
            failed=frozenset(f.adapter for f in shard.adapter_failures) if shard else frozenset(),
            current=r.launch in ("", launch_hash(model, profile, mine)),
        )
        out[rid] = Given(room, list(have))
        by_base.setdefault((model.id, profile.engine), []).append(seat)
    for (base, engine), seats in by_base.items():
        mine = adapters.get(base, ())
        if engine == "llama-server":
            given = started_with(seats, [a for a in mine if a.format == "gguf"], now)
        else:
            policy_target = getattr(catalog[base].autoscale, "target_in_flight", TARGET_IN_FLIGHT)
            given = loaded_for_demand(
                [s for s in seats if s.slots],
                [a for a in mine if a.format == "peft"],
                demand,
                now,
                policy=policy,
                target=policy_target,
                frozen=frozen,
            )
        for rid, entries in given.items():
            out[rid] = Given(out[rid].room, entries)
    return out


def started_without(
    replica: Replica,
    engine: str,
    adapters: Sequence[Adapter],
    nodes: Mapping[str, NodeInventory],
    shards: Mapping[tuple[str, str], Shard],
) -> list[str]:
    """llama-server: the base's GGUF adapters (ids) that every member node holds and that
    the replica's running engine was started without: its rank 0's shard, ready, neither
    serves them nor said why it would not. llama-server takes adapters only at start, so
    such a replica is replaced to serve them (`steps.split_outdated`): files that reached
    its node after the engine started, or a node placed on before it reported what it
    holds, would otherwise leave the adapter unserved there for as long as the engine ran
    (its launch hash is the catalog's, and did not change)."""
    if engine != "llama-server" or not adapters or not replica.members:
        return []
    rank0 = min(replica.members, key=lambda m: m.rank)
    shard = shards.get((rank0.node, replica.rid))
    if shard is None or shard.phase != "ready":
        return []
    held = _held(nodes, [m.node for m in replica.members], "gguf")
    known = set(shard.adapters) | {f.adapter for f in shard.adapter_failures}
    return sorted(
        a.id
        for a in adapters
        if a.format == "gguf" and a.path.rstrip("/") in held and a.id not in known
    )


def _held(nodes: Mapping[str, NodeInventory], members: list[str], fmt: str) -> frozenset[str]:
    """Adapter paths every one of `members` holds complete, in format `fmt`."""
    common: set[str] | None = None
    for node in members:
        inv = nodes.get(node)
        paths = (
            {h.path.rstrip("/") for h in inv.weights.adapters if h.format == fmt}
            if inv is not None
            else set()
        )
        common = paths if common is None else common & paths
    return frozenset(common or ())
