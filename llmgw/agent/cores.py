"""This node's CPU cores, given to CPU engines each a set of their own: one account.

vLLM on a CPU pins its worker's threads, by default to core 0: two engines on one node
would share a core. A profile's `cpu_cores` asks for that many cores of the engine's own;
the account hands out the lowest free ones of the agent's CPU affinity and takes them back
when the replica leaves the node. A replica holds its cores while its assignment is here
(restarts and relaunches get the same set), and an engine an earlier agent left keeps the
cores it runs on (its pidfile names them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence


class CoreAccount:
    """Which of `cores` each holder (a replica's rid) has; nothing else decides it."""

    def __init__(self, cores: Iterable[int]) -> None:
        self.cores = tuple(sorted(set(cores)))
        self._held: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of_this_process(cls) -> CoreAccount:
        """The cores this agent may run on (its affinity, as cgroups and taskset set it)."""
        return cls(os.sched_getaffinity(0))

    def held(self, holder: str) -> tuple[int, ...]:
        return self._held.get(holder, ())

    def free(self) -> tuple[int, ...]:
        taken = {c for cores in self._held.values() for c in cores}
        return tuple(c for c in self.cores if c not in taken)

    def take(self, holder: str, count: int) -> tuple[int, ...] | None:
        """`count` cores for `holder`: the ones it holds when it holds that many, else the
        lowest free ones (what it held is given back first); None when too few are free."""
        mine = self._held.get(holder, ())
        if len(mine) == count:
            return mine
        self._held.pop(holder, None)
        free = self.free()
        if len(free) < count:
            if mine:
                self._held[holder] = mine
            return None
        self._held[holder] = free[:count]
        return self._held[holder]

    def keep(self, holder: str, cores: Sequence[int]) -> None:
        """`holder` runs on `cores` already (an engine an earlier agent left): they are its."""
        if cores:
            self._held[holder] = tuple(sorted(cores))

    def give_back(self, holder: str) -> None:
        self._held.pop(holder, None)

    def shortage(self, count: int) -> str:
        """Why `count` cores cannot be had now, for a refusal."""
        others = ", ".join(
            f"{holder} {core_list(cores)}" for holder, cores in sorted(self._held.items())
        )
        return (
            f"needs {count} CPU cores of its own (cpu_cores); {len(self.free())} of this node's "
            f"{len(self.cores)} are free ({others or 'none pinned'}); tried again as engines stop"
        )


def core_list(cores: Sequence[int]) -> str:
    """ "0-3,6" for (0, 1, 2, 3, 6): the form taskset and VLLM_CPU_OMP_THREADS_BIND take."""
    runs: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(runs)
