"""This controller's leadership through the `leader` key: pure, time passed in.

The leader renews the key; the others judge it by when they saw its revision change, on
their own clock (clocks differ between hosts), and take it over by compare-and-set on that
revision once it has stood still for `leader_ttl`. A value that does not decode is treated
as absent, as every reader treats one, so one garbage value cannot stop the control plane.
A controller recognises its own lease by the random `instance` of its process, not by its
id: a restart under the same `--id` must wait for the old process's lease like anyone's.

While it leads, the key's revision is the fence of every write it makes: a takeover moves
the revision, and the deposed leader's writes are refused from then on. Each leadership
has an epoch, one more than the revision it took over (a deletion's included), so a later
leadership's is always larger.

`Leadership` is the state machine (following, claiming, leading, resigned) and its one
question, `fence`: may this controller write now, and with which fence. The loop does the
I/O (controller/loop.py) and reports each answer back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from llmgw.bus.records import Leader

log = logging.getLogger(__name__)

CREATE = 0  # the revision `claim` returns when the key is absent: create it


@dataclass
class LeaderKey:
    """The `leader` key as this controller sees it, and since when (its own clock)."""

    revision: int = 0  # 0: absent
    value: Leader | None = None  # None with a revision: a value that does not decode
    seen_at: float = 0.0  # when this revision was first seen

    def saw(self, revision: int, value: Leader | None, now: float) -> None:
        if revision != self.revision:
            self.seen_at = now
        self.revision, self.value = revision, value

    def claim(self, instance: str, now: float, ttl: float) -> int | None:
        """The revision to take the key over at (CREATE: create it), or None: not yet."""
        if self.revision == 0:
            return CREATE
        if self.value is None:
            return self.revision  # does not decode: treated as absent
        if self.value.instance == instance:
            return self.revision  # ours: a renewal failed, and nobody took it meanwhile
        if now - self.seen_at >= ttl:
            return self.revision  # stood still for ttl: its holder stopped renewing
        return None


class LeadershipState(Enum):
    FOLLOWING = "following"  # another controller leads, or none does and it is not time yet
    CLAIMING = "claiming"  # its takeover is on its way to the server
    LEADING = "leading"  # it holds the key: its writes are fenced with the key's revision
    RESIGNED = "resigned"  # it stopped, and deleted the key: it never leads again


@dataclass(frozen=True, slots=True)
class Takeover:
    """A claim to make: at which revision, and from whom (for the log and the event)."""

    at: int  # CREATE: the key is absent (ask for its deletion's revision first)
    previous: str | None


class Leadership:
    def __init__(self, holder: str, instance: str, ttl: float) -> None:
        self.holder, self.instance, self.ttl = holder, instance, ttl
        self.key = LeaderKey()
        self.state = LeadershipState.FOLLOWING
        self.epoch = 0  # of its latest leadership (records.Leader.epoch); kept after it ends
        self.since = 0.0  # wall time its latest leadership began
        self._revision = 0  # the key's revision as this controller last wrote it: the fence
        self._taken_at = 0  # the key's revision its takeover wrote
        self._claim: tuple[int, float] | None = None  # (epoch, since) of a claim in flight

    @property
    def leading(self) -> bool:
        return self.state is LeadershipState.LEADING

    def fence(self, view_revision: int) -> int | None:
        """May this controller write now, and with which fence: the key's revision as it
        last wrote it, which the server compares with every write. None while it does not
        lead, and while its view (at `view_revision` of the key) does not hold its own
        takeover yet: the watch delivers in the order the bucket stored, so once it does,
        the view holds every write the previous leader made before it."""
        if self.state is not LeadershipState.LEADING or view_revision < self._taken_at:
            return None
        return self._revision

    def saw(self, revision: int, value: Leader | None, now: float) -> None:
        """The key as this controller's view now holds it (0: absent)."""
        self.key.saw(revision, value, now)

    # --- taking the lead ------------------------------------------------------------------

    def takeover(self, now: float) -> Takeover | None:
        """The claim to make now, if this controller may take the key; None: not now."""
        if self.state is not LeadershipState.FOLLOWING:
            return None
        at = self.key.claim(self.instance, now, self.ttl)
        if at is None:
            return None
        if self.key.value is not None:
            previous: str | None = self.key.value.holder
        else:
            previous = "a value that does not decode" if at != CREATE else None
        return Takeover(at, previous)

    def claiming(self, at: int, wall: float) -> Leader:
        """A claim at revision `at` (an absent key's deletion's included) goes out now: the
        record to write, with the epoch it starts."""
        self.state = LeadershipState.CLAIMING
        self._claim = (at + 1, wall)
        return self._record(*self._claim, renewed_at=wall)

    def claimed(self, revision: int | None) -> bool:
        """The claim's answer: the key's revision it wrote, or None (another controller was
        quicker). True when this controller now leads."""
        claim, self._claim = self._claim, None
        if self.state is not LeadershipState.CLAIMING or claim is None:
            return False
        if revision is None:
            self.state = LeadershipState.FOLLOWING
            return False
        self.epoch, self.since = claim
        self._revision = self._taken_at = revision
        self.state = LeadershipState.LEADING
        return True

    # --- holding it -----------------------------------------------------------------------

    def renewal(self, wall: float) -> tuple[int, Leader] | None:
        """While leading: the revision to compare-and-set the key at, and the record."""
        if self.state is not LeadershipState.LEADING:
            return None
        return self._revision, self._record(self.epoch, self.since, renewed_at=wall)

    def renewed(self, revision: int) -> None:
        if self.state is LeadershipState.LEADING:
            self._revision = revision

    def renewal_refused(self, now_at: int | None, value: Leader | None) -> None:
        """The key moved from the revision this controller renews at; it is now at `now_at`
        with `value` (None: absent, or does not decode). A renewal whose answer was lost may
        still have been stored: if the key is still ours, adopt its revision."""
        if now_at is not None and value is not None and value.instance == self.instance:
            self.renewed(now_at)
        else:
            self.step_down("another controller took the leader key")

    def step_down(self, why: str) -> None:
        """It must not write on what may be a stale view; it takes the key back at the next
        step if nobody else took it meanwhile (with a new epoch)."""
        if self.state is LeadershipState.LEADING:
            log.warning("controller %s stops leading: %s", self.holder, why)
        if self.state is not LeadershipState.RESIGNED:
            self.state = LeadershipState.FOLLOWING

    def resign(self) -> int | None:
        """Stop for good: the revision to delete the key at, so that others take over at
        once; None when it does not hold the key."""
        revision = self._revision if self.leading and self._revision else None
        self.state = LeadershipState.RESIGNED
        return revision

    def _record(self, epoch: int, since: float, renewed_at: float) -> Leader:
        return Leader(
            holder=self.holder,
            since=since,
            renewed_at=renewed_at,
            instance=self.instance,
            epoch=epoch,
        )
