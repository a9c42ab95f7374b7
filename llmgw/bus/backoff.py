"""Jittered exponential backoff that resets only after a connection proved healthy.

The seed's lesson: a backoff reset on every failed attempt hammered the control plane
forever at the base interval. Here `reset()` is called only by whoever has watched a
connection stay up for `healthy_after` seconds, never by a failed attempt. Jitter keeps a
fleet that lost its servers together from reconnecting in lockstep: full jitter (anywhere
in [0, d]) because bench/scale.py measured the half-jittered [d/2, d] with d = 0.5 s putting
a quarter of 5,000 nodes' first reconnect attempts into the same 100 ms after a server
restart; [0, d] with d = 1 s spreads them over the whole second (the mean first delay,
0.5 s, is about what it was).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base: float = 1.0
    cap: float = 30.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        """Delay before the next attempt: uniform in [0, d] with d = min(cap, base*factor^n)."""
        ceiling = min(self.cap, self.base * (self.factor**self.attempt))
        self.attempt += 1
        return self.rng.uniform(0, ceiling)

    def reset(self) -> None:
        self.attempt = 0
