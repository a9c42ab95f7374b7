"""Choosing the engine for a request, and keeping away from the ones that fail.

Two rules, in this order (the rule every production LLM router surveyed uses, in
../shared/NOTES-router.md):
1. Prefix affinity. Requests that share a conversation (same `user`, same session header,
   or the same opening messages) go to the same replica, because that replica already
   holds their prompt in its KV cache: a cached prompt starts in a fraction of the time.
   Replicas are ranked by rendezvous hashing of that key, so every router ranks them the
   same way without talking to the others. The first in that order takes the request
   unless it would then carry more than `affinity_load_factor` times the average
   in-flight load (bounded-load consistent hashing): a hot conversation cannot pile onto
   one replica, and what spills over goes to the next in the same order, so a spilled
   prefix is cached on few replicas rather than all.
2. Least requests in flight, counted exactly by this router (a full scan: with the few
   replicas a model has, it costs less than sampling two, and it never picks the busier
   of two; ties are broken at random so routers do not herd).

Passive health, as Envoy's outlier detection: an engine that fails `eject_after` times in a
row (cannot connect, drops the request, answers 502/503/504) is ejected for a time that
doubles with every ejection in a row, up to `eject_cap`. If every engine of a model is
ejected or failing its health probe, they are all tried anyway (Envoy's panic mode): an
error from an engine says more than a refusal from the router.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.router.table import Backend

log = logging.getLogger(__name__)

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class BalancerSettings:
    affinity_load_factor: float = 1.25  # 0 turns prefix affinity off
    eject_after: int = 3  # consecutive failures
    eject_base: float = 2.0  # seconds; doubled with every ejection in a row
    eject_cap: float = 60.0


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads the bits of key XOR backend into a rank."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def load_cap(total_in_flight: int, n: int, factor: float) -> int:
    """Bounded-load hashing (Mirrokni, Thorup, Zadimoghaddam, SODA'18): no engine takes
    more than `factor` times the average in-flight load, counting the request placed."""
    return max(1, math.ceil(factor * (total_in_flight + 1) / n))


class Balancer:
    def __init__(self, settings: BalancerSettings | None = None) -> None:
        self.settings = settings or BalancerSettings()
        self._random = random.Random()

    def pick(
        self,
        backends: Sequence[Backend],
        affinity: int | None,
        now: float,
        exclude: Backend | None = None,
    ) -> Backend | None:
        """The engine for one request; None when there is none to try."""
        return self.choose(self.candidates(backends, now, exclude), affinity)

    @staticmethod
    def candidates(
        backends: Sequence[Backend], now: float, exclude: Backend | None = None
    ) -> list[Backend]:
        """The engines a request may go to: the available ones, or, when none is, every
        routable one (panic mode)."""
        candidates = [b for b in backends if b is not exclude and b.available(now)]
        if not candidates:
            candidates = [b for b in backends if b is not exclude and b.routable]  # panic
        return candidates

    def choose(self, candidates: Sequence[Backend], affinity: int | None) -> Backend | None:
        """Of `candidates`, the engine for a request with this affinity key."""
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        if affinity is not None and self.settings.affinity_load_factor > 0:
            cap = load_cap(
                sum(b.in_flight for b in candidates),
                len(candidates),
                self.settings.affinity_load_factor,
            )
            for b in sorted(candidates, key=lambda b: _mix(affinity ^ b.id_hash), reverse=True):
                if b.in_flight < cap:
                    return b
        least = min(b.in_flight for b in candidates)
        tied = [b for b in candidates if b.in_flight == least]
        return tied[0] if len(tied) == 1 else self._random.choice(tied)

    def rank(self, backends: Sequence[Backend], affinity: int) -> list[Backend]:
        """Backends in the order affinity tries them (for tests and `llmgw status`)."""
        return sorted(backends, key=lambda b: _mix(affinity ^ b.id_hash), reverse=True)

    # --- passive health ---------------------------------------------------------------------

    def failed(self, b: Backend, now: float, why: str) -> bool:
        """Count a failure; True when it ejected the engine."""
        b.failures += 1
        if b.failures < self.settings.eject_after or now < b.ejected_until:
            return False
        duration = min(self.settings.eject_cap, self.settings.eject_base * 2**b.ejections)
        b.ejections += 1
        b.ejected_until = now + duration
        b.failures = 0
        log.warning(
            "router: %s (%s, %s) ejected for %.0f s after %d failures in a row: %s",
            b.id,
            b.model,
            b.address,
            duration,
            self.settings.eject_after,
            why,
        )
        return True

    def succeeded(self, b: Backend, now: float) -> None:
        b.failures = 0
        if b.ejections and now >= b.ejected_until + self.settings.eject_cap:
            b.ejections = 0  # healthy for a while: the next ejection starts short again
