"""An engine's capacity split between the routers that send to it. Pure: no I/O, no clock.

Every router publishes its demand per model in its `load.<router>` record (requests in
flight and queued there, by class and team); every router reads every other's, and each
computes the same split from the same records, so the shares add up to the engine's
capacity without a word between them. The split follows the queue's own order fleet-wide:

1. by class: critical demand first, then standard, then sheddable, each from what the
   classes before it left;
2. within a class, between teams by weighted max-min (water-filling): no team gets more
   than it asks, and a team that asks more than its weighted part of what is left gets that
   part; a team's slots go to the routers in proportion to what each holds of its demand;
3. what nobody asks for is shared by every live router equally, so a router's first request
   does not wait for its record to be read.

Shares are whole requests (largest remainder, compared in quarters and then by a hash of
the router and the engine, so what is left over falls on different routers for different
engines and stays put while demand moves a little) and sum to the capacity exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from llmgw.priority import CLASSES, Priority
from llmgw.router.table import stable_hash

# a router's demand for a model: (class, team) -> requests in flight and queued there
Demand = Mapping[tuple[Priority, str], float]


def water_fill(asks: Mapping[str, float], weights: Mapping[str, float], room: float) -> dict:
    """Weighted max-min: each team's part of `room`, none above what it asks. Every sum is
    taken in the teams' sorted order: routers are other processes, whose sets iterate in
    another order, and a float summed otherwise may round a share the other way."""
    given = {t: 0.0 for t in sorted(asks)}
    open_ = [t for t in given if asks[t] > 0]
    while open_ and room > 1e-9:
        level = room / sum(weights[t] for t in open_)
        done = [t for t in open_ if asks[t] - given[t] <= level * weights[t] + 1e-12]
        if not done:  # every team asks more than its part: each gets its part
            for t in open_:
                given[t] += level * weights[t]
            return given
        for t in done:
            room -= asks[t] - given[t]
            given[t] = asks[t]
        open_ = [t for t in open_ if t not in done]
    return given


def split(
    capacity: int,
    demands: Mapping[str, Demand],
    weight: Callable[[str], float],
    salt: int = 0,
    *,
    rest: bool = True,
) -> dict[str, int]:
    """Each router's share of `capacity` (every router in `demands`, an empty Demand for a
    live router that asks for nothing); `rest` False: what nobody asks for is shared by
    no one."""
    routers = sorted(demands)
    if not routers:
        return {}
    exact = dict.fromkeys(routers, 0.0)
    room = float(capacity)
    for cls in CLASSES:
        asks: dict[str, float] = {}
        held: dict[str, list[tuple[str, float]]] = {}
        for r in routers:
            for (c, team), n in demands[r].items():
                if c is cls and n > 0:
                    asks[team] = asks.get(team, 0.0) + n
                    held.setdefault(team, []).append((r, n))
        if not asks:
            continue
        given = water_fill(asks, {t: max(weight(t), 1e-9) for t in asks}, room)
        for team, g in given.items():
            for r, n in held[team]:
                exact[r] += g * n / asks[team]
            room -= g
        if room <= 1e-9:
            break
    if room > 1e-9 and rest:
        for r in routers:
            exact[r] += room / len(routers)
    return _whole(exact, capacity - (0 if rest else math.floor(room + 1e-9)), salt)


def _whole(exact: Mapping[str, float], capacity: int, salt: int) -> dict[str, int]:
    """Largest remainder: whole shares that sum to `capacity`. Remainders are compared in
    quarters, and within a quarter by a hash of router and engine: a last bit of float
    rounding never orders them differently on two routers, and a share left over does not
    hop between routers whose demand moves a little (each hop would send a request the
    engine must queue until the router it left has one end)."""
    out = {r: math.floor(v + 1e-6) for r, v in exact.items()}
    left = capacity - sum(out.values())
    order = sorted(
        exact,
        key=lambda r: (
            -math.floor((exact[r] - out[r]) * 4 + 1e-6),
            stable_hash(b"%d:%s" % (salt, r.encode())),
        ),
    )
    for r in order[: max(0, left)]:
        out[r] += 1
    return out


def handing_over(
    shares: Mapping[str, int], held: Mapping[str, int], salt: int = 0
) -> dict[str, int]:
    """What each router must leave unused of its share of one engine while places change
    routers: `shares` the split, `held` what each router's record says it has there. The
    places some hold past their shares (sent before the split moved; never called back)
    are counted against the routers whose shares grew, and no other: those whose shares
    did not move keep using them whole, or a place would idle each time one of their
    requests ends. The routers that grew least wait first (ties by a hash of router and
    engine), so the first places to free go to those short of the most. Each router
    computes the same from the same records, and what all may use plus what is held past
    the shares is the engine's capacity."""
    excess = sum(max(0, held.get(r, 0) - n) for r, n in shares.items())
    waits = dict.fromkeys(shares, 0)
    if not excess:
        return waits
    short = sorted(
        (n - held.get(r, 0), stable_hash(b"%d:%s" % (salt, r.encode())), r)
        for r, n in shares.items()
        if n > held.get(r, 0)
    )
    for deficit, _, r in short:
        waits[r] = min(deficit, excess)
        excess -= waits[r]
        if not excess:
            break
    return waits
