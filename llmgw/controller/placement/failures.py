"""Replicas an agent gave up on: placed elsewhere, and the node avoided for that launch.

An agent gives up on an engine that keeps failing to start (Shard.gave_up). Nothing restarts
it where it is, so the replica is removed and its successor placed on another node; the
failure is remembered in `placement.<model>.failures` for the cool-down, during which the
`not_failed_here` filter keeps that launch off that node. The same launch given up on by
`FailurePolicy.nodes` distinct nodes within the cool-down says the profile, not the nodes,
is the problem: it is not placed again until it changes, and its last failed replica stays
where it is (not counted) to show why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from llmgw.bus.records import REPLICA_TERMINAL, Failure, PlacementRecord, Replica, Shard

MAX_KEPT = 20  # failures a placement record remembers, the newest


@dataclass(frozen=True, slots=True)
class Crashes:
    """What the failures step decided for one model."""

    failures: list[Failure]  # remembered within the cool-down, and new ones
    broken: set[str]  # launch hashes failing on enough distinct nodes
    move: list[tuple[Replica, Failure]] = field(default_factory=list)  # removed, placed again
    stay: list[tuple[Replica, Failure]] = field(default_factory=list)  # of a broken launch

    def avoid(self, launch: str) -> frozenset[str]:
        """Nodes a new replica of `launch` is not placed on."""
        return frozenset(f.node for f in self.failures if f.launch == launch)


def gave_up_shard(replica: Replica, shards: Mapping[tuple[str, str], Shard]) -> Shard | None:
    """The member shard whose agent gave up on it, or None."""
    for m in replica.members:
        s = shards.get((m.node, replica.rid))
        if s is not None and s.phase == "failed" and s.gave_up:
            return s
    return None


def remembered(stored: PlacementRecord | None, now: float, cooldown: float) -> list[Failure]:
    """The stored failures still within the cool-down."""
    if stored is None:
        return []
    return [f for f in stored.failures if f.at + cooldown > now]


def failure_of(replica: Replica, shard: Shard | None, launch: str, now: float) -> Failure:
    return Failure(
        node=shard.node if shard else replica.members[0].node,
        rid=replica.rid,
        profile=replica.profile,
        launch=launch,
        at=now,
        restarts=shard.restarts if shard else 0,
        reason=shard.reason if shard else "",
        last_line=shard.telling_line() if shard else "",
    )


def crashes(
    given_up: Iterable[tuple[Replica, str]],
    shards: Mapping[tuple[str, str], Shard],
    stored: PlacementRecord | None,
    *,
    now: float,
    cooldown: float,
    nodes: int,
    eligible: Mapping[str, int] | None = None,
) -> Crashes:
    """`given_up`: replicas in a terminal phase with their launch hash. Each is moved, unless
    its launch has now failed on `nodes` distinct nodes, or on every node that could run it
    at all when fewer do (`eligible`, per launch: a fleet of two cannot give a third node
    to fail on): then it stays."""
    failures = remembered(stored, now, cooldown)
    known = {f.rid: f for f in failures}
    pending: list[tuple[Replica, Failure]] = []
    for replica, launch in given_up:
        assert replica.phase in REPLICA_TERMINAL
        f = known.get(replica.rid)
        if f is None:
            f = failure_of(replica, gave_up_shard(replica, shards), launch, now)
            failures.append(f)
            known[f.rid] = f
        pending.append((replica, f))
    failures = failures[-MAX_KEPT:]
    by_launch: dict[str, set[str]] = {}
    for f in failures:
        by_launch.setdefault(f.launch, set()).add(f.node)
    eligible = eligible or {}

    def enough(launch: str) -> int:
        return max(1, min(nodes, eligible.get(launch, nodes)))

    broken = {launch for launch, where in by_launch.items() if len(where) >= enough(launch)}
    out = Crashes(failures, broken)
    for replica, f in pending:
        (out.stay if f.launch in broken else out.move).append((replica, f))
    return out


def moved(c: Crashes, rid: str, to: str) -> None:
    """Say where the successor of the replica `rid` went."""
    for i, f in enumerate(c.failures):
        if f.rid == rid and not f.moved_to:
            c.failures[i] = msgspec.structs.replace(f, moved_to=to)
