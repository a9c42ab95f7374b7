"""Budget: one limit (a key's requests per minute, a team's tokens of the day, ...) as one
router spends it, from shares claimed ahead on a counter all routers add to.

The counter of a window (`llmgw.limits.<scope>.<dimension>.<window>`) holds what every
router has claimed in it. A router claims a share (`Nats-Incr: +n`), and the answer is the
new total: what it got is what fits under the limit, and anything past the limit it gives
back at once. It then spends from what it got without asking anyone. So the routers
together never admit more than the limit in a window; what they leave unused is at most the
unspent shares (each router's `granted - spent`), which is why shares are small (0.5% of the
limit by default). All of this is arithmetic on numbers given to it: the Limiter does the
claiming (llmgw/gateway/limiter.py).

In flight (`max_parallel`) is a budget whose window is also a minute, but what a router
holds carries into the next window and is claimed again there: a router that stops
(crashes) holds nothing in the next window. Places no longer held go back to the counter
at each flush, but for one share kept idle while the router holds any (`surplus`): under
steady load a request takes a place without a round trip, and another router can be
refused while at most one share per router is idle. A request that was admitted before a window
changed is never cut, so in flight can pass its limit by what was held across a window
change that the new window could not take back (said in docs/security.md).
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
        if window != self.window:
            self.window = window
            self.granted = 0
            self.total = 0
            if not self.carries:
                self.spent = 0

    def window_subject(self) -> str:
        return f"{self.subject}.{self.window}"

    def reset_in(self, now: float) -> float:
        return (self.window + 1) * self.window_s - now

    def try_spend(self, units: int) -> bool:
        """Spend from what this router holds; False if it holds too little."""
        if self.spent + units <= self.granted:
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
        """How much to claim so that `units` can be spent, a share ahead."""
        return max(0, self.spent + units - self.granted) + self.share

    def claimed(self, asked: int, total: int) -> int:
        """The counter answered `total` to a claim of `asked`: keep what fits under the
        limit; return what to give back (the part past the limit)."""
        self.claims += 1
        over = max(0, total - self.limit)
        back = min(asked, over)
        self.granted += asked - back
        self.total = total - back
        return back

    def spend_now(self, units: int, now: float) -> Spent:
        """`roll` to `now`, then `try_spend`, and whether the share now runs low: the
        request path's one call per limit."""
        window = int(now // self.window_s)
        if window != self.window:
            self.roll(now)
        spent = self.spent + units
        if spent > self.granted:
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

    def fits(self, units: int) -> bool:
        """Could `units` ever be spent in one window?"""
        return units <= self.limit

    def remaining(self) -> int:
        """What is left of the limit in this window, as far as this router knows."""
        return max(0, self.limit - self.total + (self.granted - self.spent))

    def surplus(self) -> int:
        """In flight: places claimed and not held, which other routers may need. While this
        router holds any, it keeps one share of idle places (the next requests take them
        without a claim); holding none, it keeps none."""
        if not self.carries:
            return 0
        surplus = self.granted - self.spent - (self.share if self.spent else 0)
        if surplus <= 0:
            return 0
        self.granted -= surplus
        return surplus


def _share(dimension: Dimension, limit: int, fraction: float) -> int:
    # places in flight too are claimed a share ahead (one claim for a burst, not one per
    # request waiting in turn); what is idle goes back at the next flush (Limiter.flush)
    return max(1, math.ceil(limit * fraction))
