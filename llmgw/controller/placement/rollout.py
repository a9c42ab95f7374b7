"""Rolling replacement: replicas that must be replaced, one batch at a time, never below the
ready count a model may not go under.

A replica must be replaced when the catalog no longer asks for it as it runs: its profile is
not the one wanted (a switch, a removed or renamed profile), or the profile's launch content
changed (`catalog.launch_hash`: what reaches the engine), or its node is draining. Like a
Kubernetes Deployment: at most `surge` replicas beyond the desired count at once, and at least
`desired - max_unavailable` ready ones at all times; an old replica drains only once the
ready count allows it, not-ready ones first.

A rollout of a new revision stops at the first new replica that fails (validation, loading,
a restart before it was ready): the failing replicas are removed, the old ones keep serving,
and `rollout.<model>` says why until the revision changes (a fixed catalog, `llmgw rollout
undo`). Drains alone are not a rollout: a replacement that fails there is restarted by its
agent, and moved when its agent gives up, like any replica.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from llmgw.bus.records import (
    PORT_IN_USE,
    Desired,
    ProfileRevision,
    Replica,
    Revision,
    Rollout,
    Shard,
)
from llmgw.catalog import Model, Profile

MAX_HISTORY = 5  # revisions kept for `llmgw rollout undo`
MAX_TAIL = 10  # engine output lines a stopped rollout keeps

Why = Literal["revision", "drain", "adapters"]


@dataclass(frozen=True, slots=True)
class Outdated:
    replica: Replica
    kind: Why
    reason: str


@dataclass(frozen=True, slots=True)
class Roll:
    """One pass of a rolling replacement."""

    new: list[Replica]  # current replicas kept
    old: list[Replica]  # old replicas kept for now
    removed: list[tuple[Replica, str]] = field(default_factory=list)
    start: int = 0  # new replicas to place now


def outdated(
    replica: Replica,
    model: Model,
    allowed: set[str],
    launches: Mapping[str, str],
    draining: set[str],
    started_without: Sequence[str] = (),
) -> Outdated | None:
    """Why `replica` must be replaced, or None when it is what the catalog asks for. A
    replica without a launch hash (placed before llmgw recorded one) is taken as current.
    `started_without`: adapters its node holds that its llama-server was started without
    (controller/adapters.started_without)."""
    if replica.profile not in allowed:
        if model.profile(replica.profile) is None:
            why = f"profile '{replica.profile}' is no longer in the catalog: replaced"
        else:
            why = f"replaced by profile {'/'.join(sorted(allowed))}"
        return Outdated(replica, "revision", why)
    launch = launches.get(replica.profile, "")
    if replica.launch and replica.launch != launch:
        return Outdated(
            replica,
            "revision",
            f"profile {replica.profile} changed (launch {replica.launch} -> {launch}): replaced",
        )
    on = next((m.node for m in replica.members if m.node in draining), None)
    if on is not None:
        return Outdated(replica, "drain", f"node {on} is draining: moved")
    if started_without:
        return Outdated(
            replica,
            "adapters",
            f"its node holds adapter(s) {', '.join(started_without)} its llama-server was "
            "started without: replaced to serve them",
        )
    return None


def failing(replica: Replica, shards: Mapping[tuple[str, str], Shard]) -> Shard | None:
    """A member shard that failed, or was restarted before it was ready: a new revision that
    does not run. Refused a port another program holds is no failure of the revision: the
    controller moves the replica to another port (ports.py)."""
    for m in replica.members:
        s = shards.get((m.node, replica.rid))
        if s is None or s.refused == PORT_IN_USE:
            continue
        if s.phase == "failed" or (s.restarts > 0 and s.phase != "ready"):
            return s
    return None


def roll(
    old: list[Outdated],
    new: list[Replica],
    want: int,
    surge: int,
    max_unavailable: int,
    *,
    stopped: bool,
) -> Roll:
    """Which new replicas to start and which old ones to drain now. Kubernetes' arithmetic:
    total <= want + surge; an old replica drains while total - (want - max_unavailable) -
    new replicas not ready yet allows it, not-ready ones first, and a ready one only while
    the ready count stays at or above want - max_unavailable. Stopped: nothing starts and
    nothing drains but what a lowered count leaves over."""
    removed: list[tuple[Replica, str]] = []
    lowered = "desired is 0: draining" if want == 0 else f"desired lowered to {want}"
    new = sorted(new, key=lambda r: (r.created_at, r.rid))
    if len(new) > want:
        removed += [(r, lowered) for r in reversed(new[want:])]
        new = new[:want]
    # not ready first (draining one costs no ready replica), then the newest
    order = sorted(
        old, key=lambda o: (o.replica.phase == "ready", -o.replica.created_at, o.replica.rid)
    )
    over = max(0, len(order) + len(new) - (want + surge))
    removed += [(o.replica, lowered) for o in order[:over]]
    order = order[over:]
    total = len(order) + len(new)
    if stopped:
        return Roll(new, [o.replica for o in order], removed, 0)
    start = max(0, min(want - len(new), want + surge - total))
    min_ready = max(0, want - max_unavailable)
    unready_new = sum(r.phase != "ready" for r in new) + start
    removable = max(0, total + start - min_ready - unready_new)
    ready = sum(r.phase == "ready" for r in new) + sum(o.replica.phase == "ready" for o in order)
    kept: list[Replica] = []
    for o in order:
        is_ready = o.replica.phase == "ready"
        if removable > 0 and (not is_ready or ready - 1 >= min_ready):
            removable -= 1
            ready -= is_ready
            removed.append((o.replica, o.reason))
        else:
            kept.append(o.replica)
    return Roll(new, kept, removed, start)


def revision(
    model: Model,
    desired: Desired | None,
    profiles: list[Profile],
    launches: Mapping[str, str],
    now: float,
) -> Revision:
    """What the catalog and desired.<model> ask the model to run now."""
    return Revision(
        profile=desired.profile if desired is not None and desired.profile else None,
        served_name=model.served_name,
        profiles=[
            ProfileRevision(name=p.name, launch=launches[p.name], content=msgspec.to_builtins(p))
            for p in profiles
        ],
        since=now,
    )


@dataclass(frozen=True, slots=True)
class Failing:
    replica: Replica
    shard: Shard


def stop_text(model: str, f: Failing) -> str:
    why = ": ".join(t for t in (f.shard.reason, f.shard.telling_line()) if t)
    return (
        f"new replica {f.replica.rid} of profile {f.replica.profile} failed on {f.shard.node}"
        f" ({why or 'no reason reported'}); the old replicas keep serving: fix the profile"
        f" (`llmgw catalog apply`) or go back (`llmgw rollout undo {model}`)"
    )


def record(
    model: Model,
    stored: Rollout | None,
    target: Revision,
    *,
    want: int,
    updated: list[Replica],
    old: int,
    failed: Failing | None,
    now: float,
) -> Rollout:
    """The model's rollout.<model>: a new revision pushes the one before to the history (when
    it ever ran everywhere); a stopped one stays stopped until its revision changes."""
    if stored is not None and stored.current.same(target):
        current, history = stored.current, list(stored.history)
    else:
        current, history = target, list(stored.history) if stored is not None else []
        if stored is not None and stored.current.completed_at:
            history = (history + [stored.current])[-MAX_HISTORY:]
    out = Rollout(
        model=model.id,
        phase="progressing",
        current=current,
        history=history,
        desired=want,
        updated=len(updated),
        ready=sum(r.phase == "ready" for r in updated),
        old=old,
        surge=model.surge,
        max_unavailable=model.max_unavailable,
        decided_at=now,
    )
    if old == 0:
        out.phase = "complete"
        if not current.completed_at and updated:  # ran somewhere, and everywhere
            out.current = msgspec.structs.replace(current, completed_at=now)
    elif stopped(stored, target):
        out.phase = "stopped"
        out.reason, out.failed_rid, out.failed_node = (
            stored.reason,
            stored.failed_rid,
            stored.failed_node,
        )
        out.output_tail = list(stored.output_tail)
    elif failed is not None:
        out.phase = "stopped"
        out.reason = stop_text(model.id, failed)
        out.failed_rid, out.failed_node = failed.replica.rid, failed.shard.node
        out.output_tail = list(failed.shard.output_tail[-MAX_TAIL:])
    return out


def stopped(stored: Rollout | None, target: Revision) -> bool:
    """A rollout stopped before stays stopped until its revision changes."""
    return stored is not None and stored.phase == "stopped" and stored.current.same(target)


def news(stored: Rollout | None, new: Rollout) -> bool:
    """Whether `new` is worth a log line and an event: a rollout began, moved to another
    revision, stopped, or ended. "complete" with no rollout before it (a model's first
    placement, however little of it is placed) is none: it said "rollout complete" while 0
    of 1 replica was placed."""
    if new.phase == "complete":
        return stored is not None and stored.phase != "complete"
    return stored is None or stored.phase != new.phase or not stored.current.same(new.current)


def same_rollout(a: Rollout, b: Rollout) -> bool:
    """Whether two records say the same, whenever decided and by whom."""
    return msgspec.structs.replace(a, decided_at=0.0, epoch=0) == (
        msgspec.structs.replace(b, decided_at=0.0, epoch=0)
    )
