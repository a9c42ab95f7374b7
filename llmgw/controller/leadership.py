"""When a controller may take the `leader` key: pure, time passed in.

The leader renews the key; the others judge it by when they saw its revision change, on
their own clock (clocks differ between hosts), and take it over by compare-and-set on that
revision once it has stood still for `leader_ttl`. A value that does not decode is treated
as absent, as every reader treats one, so one garbage value cannot stop the control plane.
A controller recognises its own lease by the random `instance` of its process, not by its
id: a restart under the same `--id` must wait for the old process's lease like anyone's.
While it leads, the key's revision is also the fence of every write it makes (loop.py): a
takeover moves the revision, and the deposed leader's writes are refused from then on.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.bus.records import Leader

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
