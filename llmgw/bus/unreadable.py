"""What a reader does with a value that does not read: the one rule, asked by every reader
(a typed `Bus.watch` and `Bus.get`, the one decoder layer's `FleetRecords`, the router's key
table), so none re-derives it and none fails open.

A value that does not decode, or is not believed (llmgw/bus/trust.py), or is over the size
limit, is never read as a request. Intent and decisions (the families an operator or a
controller writes, KEEPS_LAST_GOOD) keep their last good value: a typo in `ops.<node>` read
as absent would put replicas back on a drained node while `llmgw status` still printed
"cordoned". A reader that never read a good value (started since the bad write) takes the
family's safe reading instead: a node is cordoned, a model frozen (controller/view.py); a
controller's own records are absent, and the leader writes back the one it kept (or decides
it again); a client key (`apikeys.<name>`) is refused, and a team's keys are refused
(`teams.<team>`): a key never grants more than its last good value did, and a garbled one
never read grants nothing. Observations (what an agent or a router writes: nodes, leases,
shards, load) are absent when they do not read; their writer rewrites them at its next
heartbeat or change. Each is said once in the reader's log (trust.SkippedValues). Imports
no nats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from . import keys, records
from .trust import Oversized, SkippedValues

log = logging.getLogger(__name__)

# Written by an operator (catalog, desired, ops, apikeys, teams) or by the leading
# controller (its own records: one it kept is written again as it kept it): intent and
# decisions, which keep their last good value. A key or team garbled by hand must never
# grant more than its last good value did: read as absent, a team's limits would vanish,
# and the bucket's only key would open the fleet. Not the leader key: a lease, taken over
# at its revision when it does not read.
OPERATOR_WRITES: frozenset[str] = frozenset(
    {keys.CATALOG, keys.DESIRED, keys.OPS, keys.APIKEYS, keys.TEAMS, keys.ADAPTERS}
)
CONTROLLER_WRITES: frozenset[str] = frozenset(
    {
        keys.ROLLOUT,
        keys.SCALE,
        keys.PLACEMENT,
        keys.HEALTH,
        keys.FABRICS,
        keys.REPLICAS,
        keys.ASSIGN,
    }
)
KEEPS_LAST_GOOD: frozenset[str] = OPERATOR_WRITES | CONTROLLER_WRITES
# the model of a catalog entry or count that does not read is frozen (View.frozen), kept or not;
# an adapter stays loaded where it is, and is loaded nowhere else (controller/adapters.py)
FREEZES_MODEL: frozenset[str] = frozenset({keys.CATALOG, keys.DESIRED, keys.ADAPTERS})
# the gateway's records (the operator's), read by routers: with no good value, nothing granted
REFUSES: frozenset[str] = frozenset({keys.APIKEYS, keys.TEAMS})

# What a reader does with a value that does not read:
# kept: the last good value; cordoned: the node takes nothing new (ops, nothing kept);
# frozen: nothing placed or removed for the model (catalog, desired, nothing kept);
# absent: as if deleted (observations, and the controller's records it will write again);
# refused: a client key refused (401), a team's keys refused (403) (apikeys, teams, nothing kept).
Reading = Literal["kept", "cordoned", "frozen", "absent", "refused"]

# what "does not read" is: a decoder's errors, a catalog's refusal and trust's rejection
# (both ValueErrors)
_DOES_NOT_READ = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


class Unreadable(msgspec.Struct, kw_only=True, frozen=True):
    """A key whose newest value does not read, and what readers do instead."""

    key: str
    family: str
    revision: int
    why: str
    reading: Reading

    def says(self) -> str:
        """ "ops.n1 (revision 7) does not read: ...; its last good value is kept" """
        return f"{self.key} (revision {self.revision}) does not read: {self.why}; {self.instead()}"

    def instead(self) -> str:
        """What is read instead, in words."""
        if self.reading == "absent" and self.family in KEEPS_LAST_GOOD:
            # a reader started since the bad write (`llmgw status`): the controller that
            # read the good one still has it
            return "no good value was read here; a leader that read one keeps it and writes it back"
        if self.reading == "frozen" and self.family == keys.ADAPTERS:
            return (
                "no good value was read here, so the adapter stays loaded where it is and is "
                "loaded nowhere else"
            )
        if self.reading == "refused" and self.family == keys.TEAMS:
            return (
                "no good value was read here: a router that read one keeps it, one that did "
                "not refuses the team's keys (403)"
            )
        return _SAYS[self.reading]


_SAYS: dict[str, str] = {
    "kept": "its last good value is kept until a good one is written",
    "cordoned": "no good value was read, so the node is taken as cordoned (nothing new placed)",
    "frozen": "no good value was read, so the model is frozen (nothing placed or removed)",
    "absent": "read as absent until its writer writes it again",
    "refused": "no good value was read here: a router that read one keeps it, one that did "
    "not refuses the key (401)",
}


def settle(
    key: str,
    parsed: keys.Key | None,
    data: bytes | Oversized,
    revision: int,
    last: Any,
    decode: Callable[[bytes], Any],
    skipped: SkippedValues | None = None,
) -> tuple[Any, Unreadable | None]:
    """The value a reader holds for `key` after `data` was written over `last` (None: none
    held): `decode(data)` when it reads, else the family's reading (module doc), said once
    in the log through `skipped` (None: not said, a command reading once)."""
    if isinstance(data, Oversized):
        why = data.why()
    else:
        try:
            return decode(data), None
        except _DOES_NOT_READ as e:
            why = str(e).replace("\n", " ")
    family = parsed.prefix if parsed is not None else ""
    value = None
    if family in KEEPS_LAST_GOOD and last is not None:
        value, reading = last, "kept"
    elif family == keys.OPS and parsed is not None:
        value, reading = _cordoned(parsed.ids[0], f"{key} does not read: {why}"), "cordoned"
    else:
        reading = (
            "frozen" if family in FREEZES_MODEL else "refused" if family in REFUSES else "absent"
        )
    problem = Unreadable(key=key, family=family, revision=revision, why=why, reading=reading)
    if skipped is not None:
        skipped.skipped(log, key, revision, f"{why}; {problem.instead()}")
    return value, problem


def _cordoned(node: str, reason: str) -> records.NodeOps:
    # built from the wire format, which NodeOps always reads (its fields may change shape)
    raw = msgspec.json.encode({"node": node, "cordoned": True, "reason": reason[:300]})
    return records.decode(raw, records.NodeOps)
