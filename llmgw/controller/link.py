"""The controller's judgement of its own link to the bucket: may it judge nodes now?

A controller that hears nothing cannot tell silent nodes from its own silence. It may be
disconnected, reconnected with its view not yet re-read, or cut off without a reconnect
(JetStream without quorum, a stalled link: writes fail or hang and nothing is delivered,
so every lease looks still). Until the link has shown that it works again it judges no
node, and then every node gets a fresh grace period, as after a restart.

Pure: the loop reports what happened, with how long a write or a round trip took, and
asks `may_judge`. Transitions that end a time cut off return True: the caller then
restarts every node's grace period.
"""

from __future__ import annotations

import logging
from enum import Enum

log = logging.getLogger(__name__)

STUCK_S = 3.0  # one write or round trip this slow: the server was not answering meanwhile


class LinkState(Enum):
    STARTING = "starting"  # the watch has not replayed the bucket yet
    RESYNCING = "resyncing"  # disconnected, or reconnected and the bucket not re-read yet
    SUSPECT = "suspect"  # a write failed or hung: until a round trip comes back promptly
    TRUSTED = "trusted"


class Link:
    def __init__(self, stuck_after: float = STUCK_S) -> None:
        self.stuck_after = stuck_after
        self.state = LinkState.STARTING

    @property
    def may_judge(self) -> bool:
        """Whether what this controller has not heard says anything about the nodes."""
        return self.state is LinkState.TRUSTED

    def disconnected(self) -> None:
        """The connection dropped or came back: the view is stale until the watch has
        replayed the bucket (its leases would all look still)."""
        self.resyncing("the bucket is being re-read after a reconnect")

    def resyncing(self, why: str) -> None:
        """The view is stale until the watch has replayed the bucket: after a reconnect,
        and when the watch stopped showing this controller's own writes (controller/echo.py)."""
        if self.state is not LinkState.STARTING:
            self._to(LinkState.RESYNCING, why)

    def synced(self) -> bool:
        """The watch has replayed the bucket. True when that ends a time cut off."""
        if self.state is LinkState.STARTING:
            self._to(LinkState.TRUSTED, "the bucket has been read")
            return False
        if self.state is LinkState.RESYNCING:
            self._to(LinkState.TRUSTED, "the bucket has been re-read; nodes get a fresh grace")
            return True
        return False  # a watch restarted by itself: that says nothing new about the link

    def write_failed(self, why: str) -> None:
        if self.state is LinkState.TRUSTED:
            self._to(LinkState.SUSPECT, f"a write failed ({why}); judging no node meanwhile")

    def wrote(self, took: float) -> None:
        """A write to the bucket took `took` seconds."""
        if took > self.stuck_after and self.state is LinkState.TRUSTED:
            self._to(LinkState.SUSPECT, f"a write hung for {took:.0f} s; judging no node meanwhile")

    def round_trip(self, took: float | None) -> bool:
        """A round trip to the server took `took` seconds (None: no answer within
        `stuck_after`). True when that ends a suspicion."""
        prompt = took is not None and took < self.stuck_after
        if self.state is LinkState.SUSPECT and prompt:
            self._to(LinkState.TRUSTED, "the bucket answers again; nodes get a fresh grace")
            return True
        if self.state is LinkState.TRUSTED and not prompt:
            self._to(
                LinkState.SUSPECT,
                f"the bucket did not answer for {self.stuck_after:g} s; judging no node meanwhile",
            )
        return False

    def _to(self, state: LinkState, why: str) -> None:
        if state is not self.state:
            log.log(logging.INFO if state is LinkState.TRUSTED else logging.WARNING, "%s", why)
        self.state = state
