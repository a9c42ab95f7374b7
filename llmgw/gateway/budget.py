"""Budget: one limit (a key's requests per minute, a team's tokens of the day, ...) as one
router spends it, from shares claimed ahead of need.

A window of a limit (`llmgw.limits.<scope>.<dimension>.<window>`) is what the routers hold
claimed in it, each on a subject of its own (llmgw/bus/claims.py). A router claims a share,
and gets what fits under the limit beside what the others hold; it then spends from what it
got without asking anyone. So the routers together never admit more than the limit in a
window; what they leave unused is at most the unspent shares (each router's `granted -
spent`), which is why shares are small (0.5% of the limit by default). All of this is
arithmetic on numbers given to it: the Limiter does the claiming and writes what it holds
(`stored` lags `granted` until it does; llmgw/gateway/limiter.py).

In flight (`max_parallel`) is a budget whose windows are minutes too, so that a router that
stops (crashes) holds nothing two windows later. A place is held in the window it was taken
in AND the next one: a router claims in both, and as a window ends its places are claimed in
the one after (`carry`, from the limiter's flush, well before that window starts). So in any
window every place some router holds is on that window's counter, and another router cannot
take it across a minute boundary. Places no longer held go back to the counters at each
flush, but for one share kept idle while the router holds any (`surplus`): under steady load
a request takes a place without a round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, StrEnum


class Spent(Enum):
    """What `Budget.spend_now` did."""

    SPENT = "spent"
    SPENT_LOW = "spent, and the share runs low"  # time to top it up ahead of need
    SHORT = "holds too little: a claim is due"


SPENT, SPENT_LOW, SHORT = Spent.SPENT, Spent.SPENT_LOW, Spent.SHORT


class Dimension(StrEnum):
    REQUESTS = "rpm"  # requests per minute
    TOKENS = "tpm"  # tokens per minute
    DAY = "tpd"  # tokens per UTC day
    PARALLEL = "par"  # requests in flight

    @property
    def window_s(self) -> int:
        return 86_400 if self is Dimension.DAY else 60

    @property
    def carries(self) -> bool:
        return self is Dimension.PARALLEL


@dataclass(slots=True)
class Budget:
    """One limit on this router: `subject` is the counter's name without its window."""

    subject: str
    dimension: Dimension
    limit: int
    share: int
    # the dimension's facts, kept here: read on every request (an Enum property is slow)
    window_s: int = 60
    carries: bool = False
    tokens: bool = False
    window: int = -1
    granted: int = 0  # claimed on the counter in this window by this router
    spent: int = 0  # spent (or held, in flight) here in this window
    total: int = 0  # the counter's total at this router's last claim (all routers)
    # in flight only: what this router holds claimed on the next window
    granted_next: int = 0
    # what its subject of this window (and of the next) says it holds: behind `granted`
    # until written (tokens used past a reservation, places handed back)
    stored: int = 0
    stored_next: int = 0
    claims: int = 0  # claims made (round trips), for the benchmarks

    @classmethod
    def new(cls, subject: str, dimension: Dimension, limit: int, share_fraction: float) -> Budget:
        return cls(
            subject,
            dimension,
            limit,
            _share(dimension, limit, share_fraction),
            window_s=dimension.window_s,
            carries=dimension.carries,
            tokens=dimension in (Dimension.TOKENS, Dimension.DAY),
        )

    def relimit(self, limit: int, share_fraction: float) -> None:
        """The operator changed the limit: it applies from the next request."""
        if limit != self.limit:
            self.limit = limit
            self.share = _share(self.dimension, limit, share_fraction)

    def roll(self, now: float) -> None:
        window = int(now // self.window_s)
        if window == self.window:
            return
        # in flight: what was claimed on the next window is this one's now
        ahead = self.carries and window == self.window + 1
        self.window = window
        self.granted = self.granted_next if ahead else 0
        self.stored = self.stored_next if ahead else 0
        self.granted_next = self.stored_next = 0
        self.total = 0
        if not self.carries:
            self.spent = 0

    def window_subject(self, ahead: int = 0) -> str:
        return f"{self.subject}.{self.window + ahead}"

    def reset_in(self, now: float) -> float:
        return (self.window + 1) * self.window_s - now

    def room(self) -> int:
        """What this router may still spend without a claim: in flight, a place must be
        held in this window and the next."""
        if self.carries:
            return min(self.granted, self.granted_next) - self.spent
        return self.granted - self.spent

    def try_spend(self, units: int) -> bool:
        """Spend from what this router holds; False if it holds too little."""
        if units <= self.room():
            self.spent += units
            return True
        return False

    def force(self, units: int) -> int:
        """Spend what was used already (tokens past a reservation): the units this router
        must add to the counter beyond what it holds."""
        self.spent += units
        beyond = self.spent - self.granted
        if beyond > 0:
            self.granted += beyond
            return beyond
        return 0

    def give_back(self, units: int, window: int) -> None:
        """Units spent in `window` were not used after all (a reservation larger than the
        usage, a request no longer in flight): they can be spent again here."""
        if window == self.window or self.carries:
            self.spent = max(0, self.spent - units)

    def to_claim(self, units: int) -> int:
        """How much to claim in this window so that `units` can be spent, a share ahead."""
        return max(0, self.spent + units - self.granted) + self.share

    def next_to_claim(self) -> int:
        """In flight: what to claim on the next window so that it covers what this one
        holds claimed (`granted`), never more: so the next window's counter never holds
        more of this router's than this one's does, and a router carrying its places
        into it always finds them room."""
        return max(0, self.granted - self.granted_next) if self.carries else 0

    def carry_due(self) -> bool:
        """In flight: places held that the next window's counter does not hold yet."""
        return self.carries and self.spent > self.granted_next

    def claimed(self, window: int, got: int, total: int, stored: int) -> None:
        """A claim on `window` got `got` units, the window's total is now `total`, and this
        router's subject there says `stored`. A claim on a window that has passed meanwhile
        grants nothing here (its units only go unused)."""
        self.claims += 1
        if window == self.window:
            self.granted += got
            self.total = total
            self.stored = stored
        elif self.carries and window == self.window + 1:
            self.granted_next += got
            self.stored_next = stored

    def unstored(self) -> list[tuple[int, int]]:
        """What this router's subjects must be told it holds, as (windows ahead, units): the
        next window's first, so that it never says more of this router's than this one."""
        out = []
        if self.carries and self.granted_next != self.stored_next:
            out.append((1, self.granted_next))
        if self.granted != self.stored:
            out.append((0, self.granted))
        return out

    def stored_as(self, ahead: int, units: int) -> None:
        if ahead:
            self.stored_next = units
        else:
            self.stored = units

    def spend_now(self, units: int, now: float) -> Spent:
        """`roll` to `now`, then `try_spend`, and whether the share now runs low: the
        request path's one call per limit."""
        window = int(now // self.window_s)
        if window != self.window:
            self.roll(now)
        spent = self.spent + units
        if spent > self.granted or (self.carries and spent > self.granted_next):
            return SHORT
        self.spent = spent
        # running_low(), inline: this is the request path's one call per limit
        if not self.carries and self.granted - spent < self.share / 2 and self.total < self.limit:
            return SPENT_LOW
        return SPENT

    def running_low(self) -> bool:
        """Less than half a share left here, and the limit not all claimed: time to top up
        ahead of need (in flight excepted: its idle places are kept at each flush)."""
        return (
            not self.carries
            and self.granted - self.spent < self.share / 2
            and self.total < self.limit
        )

    def all_claimed(self, now: float) -> bool:
        """The fleet has claimed this window's limit whole: asking again cannot help (in
        flight excepted: places come back as requests end)."""
        return (
            not self.carries
            and self.total >= self.limit
            and self.window == int(now // self.window_s)
        )

    def fits(self, units: int) -> bool:
        """Could `units` ever be spent in one window?"""
        return units <= self.limit

    def remaining(self) -> int:
        """What is left of the limit in this window, as far as this router knows."""
        return max(0, self.limit - self.total + (self.granted - self.spent))

    def hand_back(self) -> None:
        """In flight: places claimed and not held, which other routers may need, go back (in
        this window and the next; written with the next flush). While this router holds
        any, it keeps one share of idle places (the next requests take them without a
        claim); holding none, it keeps none."""
        if self.carries:
            keep = self.spent + (self.share if self.spent else 0)
            self.granted = min(self.granted, keep)
            self.granted_next = min(self.granted_next, keep)


def _share(dimension: Dimension, limit: int, fraction: float) -> int:
    # places in flight too are claimed a share ahead (one claim for a burst, not one per
    # request waiting in turn); what is idle goes back at the next flush (Limiter.flush)
    return max(1, math.ceil(limit * fraction))
