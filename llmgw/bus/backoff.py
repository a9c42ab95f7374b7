"""Jittered exponential backoff that resets only after a connection proved healthy.

The seed's lesson: a backoff reset on every failed attempt hammered the control plane
forever at the base interval. Here `reset()` is called only by whoever has watched a
connection stay up for `healthy_after` seconds, never by a failed attempt. Jitter keeps a
fleet that lost its servers together from reconnecting in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base: float = 0.5
    cap: float = 30.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        """Delay before the next attempt: uniform in [d/2, d] with d = min(cap, base*factor^n)."""
        ceiling = min(self.cap, self.base * (self.factor**self.attempt))
        self.attempt += 1
        return self.rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0
