"""What a pass decides, as data: a Change puts or deletes one key with one record and says
why; a Notice says something and writes nothing. The reconciler (controller/reconciler.py)
returns them, the writer (controller/writer.py) applies them, and `said` renders each, from
one table, as its log line and its event. Nothing here does I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from llmgw.bus import keys, records
from llmgw.fleetstate.decode import CONTROLLER_WRITES, slot_of

# --- why: one type per reason a key is written or a thing is said ------------------------


@dataclass(frozen=True, slots=True)
class Derived:
    """Written because it follows from other records (an assignment from its replica, the
    fabric view from the inventories, a replica's launch or endpoint): said by no one."""

    what: str


@dataclass(frozen=True, slots=True)
class NodeJudged:
    record: records.Health
    previous: str | None
    quiet: bool = False  # one of a fleet's worth (at start-up): ready said at debug only


@dataclass(frozen=True, slots=True)
class NodesJudged:
    """A fleet's worth of phase changes, said in one line (a Notice)."""

    counts: dict[str, int]


@dataclass(frozen=True, slots=True)
class Placed:
    replica: records.Replica


@dataclass(frozen=True, slots=True)
class PortMoved:
    replica: records.Replica
    why: str


@dataclass(frozen=True, slots=True)
class ReplicaIs:
    """A replica's phase changed to one worth saying (ready, failed, gave-up)."""

    replica: records.Replica
    previous: str


@dataclass(frozen=True, slots=True)
class Draining:
    replica: records.Replica
    reason: str


@dataclass(frozen=True, slots=True)
class Removed:
    replica: records.Replica
    why: str


@dataclass(frozen=True, slots=True)
class Restored:
    """A record of the leader's own whose newest value does not read (garbled by hand) is
    written back as the view kept it, so that a reader started since reads it too."""

    key: str
    bad_revision: int


@dataclass(frozen=True, slots=True)
class RolloutIs:
    rollout: records.Rollout


@dataclass(frozen=True, slots=True)
class Unplaced:
    record: records.PlacementRecord


@dataclass(frozen=True, slots=True)
class Scaled:
    scale: records.Scale


@dataclass(frozen=True, slots=True)
class Qualifies:
    node: str
    model: str
    qualifies: bool  # False: it no longer does


@dataclass(frozen=True, slots=True)
class NotPlacedNow:
    """A pass that took long judged a chosen node again and found it no longer ready."""

    replica: records.Replica
    took: float
    gone: tuple[str, ...]


Why = (
    Derived
    | NodeJudged
    | NodesJudged
    | Placed
    | PortMoved
    | ReplicaIs
    | Draining
    | Removed
    | Restored
    | RolloutIs
    | Unplaced
    | Scaled
    | Qualifies
    | NotPlacedNow
)


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    record: msgspec.Struct | None  # None: delete the key
    why: Why


@dataclass(frozen=True, slots=True)
class Notice:
    why: Why


# --- where a written key lives in the view ------------------------------------------------


def mirror(tables: object, key: str, record: msgspec.Struct | None) -> None:
    """Store what a change wrote in `tables` (the view, or a pass's copy of its tables),
    where the one decoder layer holds it (fleetstate/decode.py SLOTS)."""
    parsed = keys.parse(key)
    assert parsed is not None and parsed.prefix in CONTROLLER_WRITES, key
    attr, slot = slot_of(parsed)
    table = getattr(tables, attr)
    if record is None:
        table.pop(slot, None)
    else:
        table[slot] = record


def stamped(record: msgspec.Struct, epoch: int) -> msgspec.Struct:
    """The record as the leadership of `epoch` writes it: a record with an `epoch` field
    says who wrote it last."""
    if "epoch" in type(record).__struct_fields__:
        return msgspec.structs.replace(record, epoch=epoch)
    return record


def batched(change: Change) -> bool:
    """Written in atomic batches with its neighbours (a fleet's health at start-up)."""
    return isinstance(change.why, NodeJudged) or (
        isinstance(change.why, Derived) and change.why.what == "health"
    )


# --- the one table: how each is said ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    subject: str
    text: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Said:
    level: int
    text: str
    event: Event | None = None


def _node_judged(w: NodeJudged) -> Said:
    r = w.record
    level = logging.INFO if r.phase == "ready" else logging.WARNING
    text = f"node {r.node}: {w.previous or 'new'} -> {r.phase} ({r.reason})"
    event = Event(
        f"node-{r.phase}",
        r.node,
        f"node {r.node} is {r.phase}: {r.reason}",
        {"previous": w.previous},
    )
    return Said(logging.DEBUG if w.quiet and r.phase == "ready" else level, text, event)


def _nodes_judged(w: NodesJudged) -> Said:
    n = sum(w.counts.values())
    parts = ", ".join(f"{k} {p}" for p, k in w.counts.items())
    return Said(logging.INFO, f"{n} nodes changed phase: {parts}")


def _replica_said(r: records.Replica, kind: str, text: str, event: str, **data: Any) -> Said:
    """A replica's change said at INFO, its event about the model and naming the replica."""
    return Said(logging.INFO, text, Event(kind, r.model, event, {"rid": r.rid, **data}))


def _placed(w: Placed) -> Said:
    r = w.replica
    where = ", ".join(m.node for m in r.members)
    return _replica_said(
        r,
        "placed",
        f"placed {r.model} {r.rid} on {where}: {r.reason}",
        f"{r.model} {r.rid} placed on {where}",
        nodes=[m.node for m in r.members],
        reason=r.reason,
    )


def _port_moved(w: PortMoved) -> Said:
    r = w.replica
    text = f"{r.model} {r.rid}: {w.why}"
    return _replica_said(r, "port-moved", text, text)


def _replica_is(w: ReplicaIs) -> Said:
    r = w.replica
    at = f" at {r.endpoint}" if r.endpoint else ""
    return _replica_said(
        r,
        r.phase,
        f"{r.model} {r.rid} is {r.phase}{at}",
        f"{r.model} {r.rid} is {r.phase}",
        endpoint=r.endpoint,
    )


def _draining(w: Draining) -> Said:
    r = w.replica
    event = f"{r.model} {r.rid}: {w.reason}"
    return _replica_said(r, "draining", f"draining {r.model} {r.rid}: {w.reason}", event)


def _removed(w: Removed) -> Said:
    r = w.replica
    event = f"{r.model} {r.rid} removed: {w.why}"
    return _replica_said(r, "removed", f"removed {r.model} {r.rid}: {w.why}", event)


def _restored(w: Restored) -> Said:
    return Said(
        logging.WARNING,
        f"{w.key} (revision {w.bad_revision}) does not read: wrote its last good value back",
    )


def _rollout_is(w: RolloutIs) -> Said:
    ro = w.rollout
    text = {
        "progressing": f"rolling out: {ro.old} replica(s) to replace",
        "stopped": f"stopped: {ro.reason}",
        # the counts: no old replica left is not every new one ready
        "complete": f"complete: no replica of an older revision left; {ro.ready}/{ro.desired} "
        "of the current one ready",
    }[ro.phase]
    return Said(
        logging.WARNING if ro.phase == "stopped" else logging.INFO,
        f"{ro.model} rollout {text}",
        Event(f"rollout-{ro.phase}", ro.model, f"{ro.model} rollout {text}", {"old": ro.old}),
    )


def _unplaced(w: Unplaced) -> Said:
    rec = w.record
    return Said(
        logging.INFO,
        f"{rec.model}: {rec.placed}/{rec.desired} placed; {rec.explanation}",
        Event(
            "unplaced",
            rec.model,
            f"{rec.model}: {rec.explanation}",
            {"desired": rec.desired, "placed": rec.placed, "refused": rec.refused},
        ),
    )


def _scaled(w: Scaled) -> Said:
    s = w.scale
    return Said(
        logging.INFO,
        f"{s.model} autoscaled: {s.reason}",
        Event("scaled", s.model, f"{s.model}: {s.reason}", {"replicas": s.replicas}),
    )


def _qualifies(w: Qualifies) -> Said:
    if w.qualifies:
        log_text = f"node {w.node} now qualifies for waiting model {w.model}"
        kind, text = "node-qualifies", f"node {w.node} now qualifies for {w.model}"
    else:
        log_text = f"node {w.node} no longer qualifies for waiting model {w.model}"
        kind, text = "node-unqualifies", f"node {w.node} no longer qualifies for {w.model}"
    return Said(logging.INFO, log_text, Event(kind, w.node, text, {"model": w.model}))


def _not_placed_now(w: NotPlacedNow) -> Said:
    r = w.replica
    return Said(
        logging.WARNING,
        f"the pass took {w.took:.1f} s: not placing {r.model} {r.rid} on "
        f"{', '.join(w.gone)}, no longer ready; the next pass places it",
    )


SAID: dict[type, Callable[[Any], Said | None]] = {
    Derived: lambda w: None,
    NodeJudged: _node_judged,
    NodesJudged: _nodes_judged,
    Placed: _placed,
    PortMoved: _port_moved,
    ReplicaIs: _replica_is,
    Draining: _draining,
    Removed: _removed,
    Restored: _restored,
    RolloutIs: _rollout_is,
    Unplaced: _unplaced,
    Scaled: _scaled,
    Qualifies: _qualifies,
    NotPlacedNow: _not_placed_now,
}


def said(why: Why) -> Said | None:
    """How `why` is said: its log line and its event (None: it is not said)."""
    return SAID[type(why)](why)
