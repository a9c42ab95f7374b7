"""Meter: tokens (prompt, completion, cached) and requests per hour, team, key and model,
from the engines' own `usage`, added to counters in batches.

Counters, not a stream of usage records: `llmgw usage` then reads one number per subject
(hour x team x key x model x kind x router) however many requests there were, and a router
adds a second's worth of requests in one increment per subject. Each router counts on
subjects of its own: what it metered can be changed by no other router. The audit stream keeps the
per-request detail, for as long as its retention says.

Exactness: a batch is sent with a message id (`Nats-Msg-Id`), and a batch whose answer was
lost is sent again with the same id, which the stream drops as a duplicate if it had
stored it (within the stream's duplicate window, 2 minutes): an increment is counted once.
Nothing is dropped while NATS is away; what waits is one number per subject.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.bus import keys

from .outbox import Counter, Deltas

KINDS = ("requests", "prompt", "completion", "cached")


def hour_token(now: float) -> str:
    return time.strftime("%Y%m%d%H", time.gmtime(now))


def usage_subject(
    hour: str, team: str | None, key: str | None, model: str, kind: str, router: str
) -> str:
    """One router's count: each router adds to subjects of its own (its certificate may
    write no others: llmgw/bus/permissions.py), so none can touch another's counts."""
    return ".".join(
        (
            keys.USAGE_ROOT,
            hour,
            team or keys.NO_NAME,
            key or keys.NO_NAME,
            keys.name_token(model),
            kind,
            router,
        )
    )


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One counter of the usage stream, as `llmgw usage` reads it."""

    hour: str  # YYYYMMDDHH, UTC
    team: str | None
    key: str | None
    model: str
    kind: str
    value: int


def parse_usage_subject(subject: str, value: int) -> UsageRow | None:
    """A usage counter as read: one router's (`...<kind>.<router>`), or one all routers
    added to (`...<kind>`, written before counts were per router). A count below 0 is no
    usage (counts only grow; only its own router could have written it)."""
    parts = subject.split(".")
    root = keys.USAGE_ROOT.split(".")
    if parts[: len(root)] != root or len(parts) not in (len(root) + 5, len(root) + 6):
        return None
    hour, team, key, model, kind = parts[len(root) : len(root) + 5]
    if kind not in KINDS:
        return None
    return UsageRow(
        hour,
        None if team == keys.NO_NAME else team,
        None if key == keys.NO_NAME else key,
        keys.token_name(model),
        kind,
        max(0, value),
    )


class Meter:
    def __init__(self, router: str) -> None:
        # (hour, team, key, model) -> [requests, prompt, completion, cached] since the last
        # flush: a request adds to one list; the subjects are made at the flush
        self._counts: dict[tuple[str, str | None, str | None, str], list[int]] = {}
        self._out = Deltas(f"{router}.usage")
        self.router = router  # the last token of its subjects
        self._hour_at, self._hour_token = -1, ""

    def add(
        self,
        team: str | None,
        key: str | None,
        model: str,
        prompt: int,
        completion: int,
        cached: int,
        now: float,
    ) -> None:
        """One request's usage (its last step; `now` by the gateway's clock)."""
        hour = int(now // 3600)
        if hour != self._hour_at:
            self._hour_at, self._hour_token = hour, hour_token(now)
        at = (self._hour_token, team, key, model)
        counts = self._counts.get(at)
        if counts is None:
            self._counts[at] = [1, prompt, completion, cached]
            return
        counts[0] += 1
        counts[1] += prompt
        counts[2] += completion
        counts[3] += cached

    def _collect(self) -> None:
        """What `record` counted, as adds per counter subject."""
        counts, self._counts = self._counts, {}
        for (hour, team, key, model), values in counts.items():
            for kind, n in zip(KINDS, values, strict=True):
                if n:
                    self._out.add(usage_subject(hour, team, key, model, kind, self.router), n)

    def pending(self) -> int:
        self._collect()
        return self._out.units()

    async def flush(self, counter: Counter, timeout: float = 2.0) -> bool:
        """Send what was recorded; True when nothing is left waiting."""
        self._collect()
        return await self._out.send_to(counter, timeout)

    def subjects(self) -> Iterable[str]:
        self._collect()
        return self._out.subjects()
