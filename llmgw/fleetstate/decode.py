"""The one decoder of the bucket: every key's value typed, kept by the id its key names,
and what a reader does with a value that does not read.

A value that does not decode, or is not believed (llmgw/bus/trust.py), is never read as a
request. Intent and decisions (the families an operator or a controller writes,
KEEPS_LAST_GOOD) keep their last good value: a typo in `ops.<node>` read as absent would
put replicas back on a drained node while `llmgw status` still printed "cordoned". A reader
that never read a good value (started since the bad write) takes the family's safe
reading instead: a node is cordoned, a model frozen (controller/view.py); a controller's
own records are absent, and the leader writes back the one it kept (or decides it again); a
client key (`apikeys.<name>`) is refused, and a team's keys are refused (`teams.<team>`): a
key never grants more than its last good value did, and a garbled one never read grants
nothing. Observations (what an agent
or a router writes: nodes, leases, shards, load) are absent when they do not read; their
writer rewrites them at its next heartbeat or change.

Every reader says what it kept: `unreadable` (by key) feeds the log, `llmgw status`, the
fleet page and the controller's metrics. No reader applies this rule itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from llmgw import catalog
from llmgw.bus import keys, records, trust

log = logging.getLogger(__name__)

# Written by an operator (catalog, desired, ops) or by the leading controller; defined
# beside the bus's other reading rules, which Bus.watch applies too
KEEPS_LAST_GOOD = trust.KEEPS_LAST_GOOD
# the leading controller's own records: one it kept is written again as it kept it
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
# the model of a catalog entry or count that does not read is frozen (View.frozen), kept or not
FREEZES_MODEL: frozenset[str] = frozenset({keys.CATALOG, keys.DESIRED})
# the gateway's records (the operator's), read by routers: with no good value, nothing granted
REFUSES: frozenset[str] = frozenset({keys.APIKEYS, keys.TEAMS})

# What a reader does with a value that does not read:
# kept: the last good value; cordoned: the node takes nothing new (ops, nothing kept);
# frozen: nothing placed or removed for the model (catalog, desired, nothing kept);
# absent: as if deleted (observations, and the controller's records it will write again);
# refused: a client key refused (401), a team's keys refused (403) (apikeys, teams, nothing kept).
Reading = Literal["kept", "cordoned", "frozen", "absent", "refused"]


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


def decode_value(key: keys.Key, data: bytes) -> Any:
    """The record `data` holds at `key`, checked against its key (trust.py); catalog entries
    are decoded and validated by the catalog. Raises one of catalog.UNREADABLE."""
    if key.prefix == keys.CATALOG:
        return catalog.decode_model(data, key.ids[0])
    return trust.decode_for_key(key, data)


def settle(
    parsed: keys.Key, key: str, data: bytes, revision: int, last: Any
) -> tuple[Any, Unreadable | None]:
    """The value a reader holds for `key` after `data` was written over `last` (None: none
    held): the new one when it reads, else the family's reading (module doc)."""
    if isinstance(data, trust.Oversized):  # a raw watch's value over the size limit
        why = data.why()
    else:
        try:
            return decode_value(parsed, data), None
        except catalog.UNREADABLE as e:
            why = str(e).replace("\n", " ")
    family = parsed.prefix
    if family in KEEPS_LAST_GOOD and last is not None:
        return last, Unreadable(key=key, family=family, revision=revision, why=why, reading="kept")
    if family == keys.OPS:
        node = parsed.ids[0]
        cordoned = _cordoned(node, f"{key} does not read: {why}")
        return cordoned, Unreadable(
            key=key, family=family, revision=revision, why=why, reading="cordoned"
        )
    reading: Reading = (
        "frozen" if family in FREEZES_MODEL else "refused" if family in REFUSES else "absent"
    )
    return None, Unreadable(key=key, family=family, revision=revision, why=why, reading=reading)


def read_once(key: str, raw: tuple[bytes, int] | None) -> tuple[Any, Unreadable | None]:
    """What a reader that has held nothing before (a command: `llmgw node`, `llmgw rollout`)
    reads at `key` from `raw` (Bus.get_raw's bytes and revision; None: absent): the value,
    or the family's reading and why (`settle`), as `llmgw status` reads it."""
    parsed = keys.parse(key)
    if raw is None or parsed is None:
        return None, None
    return settle(parsed, key, raw[0], raw[1], None)


def _cordoned(node: str, reason: str) -> records.NodeOps:
    # built from the wire format, which NodeOps always reads (its fields may change shape)
    raw = msgspec.json.encode({"node": node, "cordoned": True, "reason": reason[:300]})
    return records.decode(raw, records.NodeOps)


@dataclass
class FleetRecords:
    """The bucket's records by the ids their keys name, decoded one way. `families` limits
    what is kept (a router keeps what it routes with); None keeps every family."""

    catalog: dict[str, catalog.Model] = field(default_factory=dict)
    desired: dict[str, records.Desired] = field(default_factory=dict)
    nodes: dict[str, records.NodeInventory] = field(default_factory=dict)
    leases: dict[str, records.Lease] = field(default_factory=dict)
    health: dict[str, records.Health] = field(default_factory=dict)
    fabrics: dict[str, records.FabricHoldings] = field(default_factory=dict)
    replicas: dict[str, records.Replica] = field(default_factory=dict)  # rid -> replica
    assigns: dict[tuple[str, str], records.Assignment] = field(default_factory=dict)  # (node, rid)
    shards: dict[tuple[str, str], records.Shard] = field(default_factory=dict)  # (node, rid)
    placements: dict[str, records.PlacementRecord] = field(default_factory=dict)
    ops: dict[str, records.NodeOps] = field(default_factory=dict)  # node -> operator's intent
    rollouts: dict[str, records.Rollout] = field(default_factory=dict)
    scales: dict[str, records.Scale] = field(default_factory=dict)  # the autoscaler's counts
    loads: dict[str, records.RouterLoad] = field(default_factory=dict)  # router -> its load
    apikeys: dict[str, records.ApiKey] = field(default_factory=dict)  # the operator's client keys
    teams: dict[str, records.Team] = field(default_factory=dict)
    leader: records.Leader | None = None
    leader_rev: int = 0
    # keys whose newest value does not read, and what is read instead
    unreadable: dict[str, Unreadable] = field(default_factory=dict)
    skipped: trust.SkippedValues = field(default_factory=trust.SkippedValues)
    families: frozenset[str] | None = None
    # hold the gateway's families too (`llmgw status`, which says what does not read in
    # them); the fleet's readers (the controller's view) see them as keys not theirs
    gateway: bool = False

    def __post_init__(self) -> None:
        # family -> its table, and which id keys it (None: all of them). The tables are
        # changed in place, never replaced.
        self._tables: dict[str, tuple[dict, int | None]] = {
            keys.CATALOG: (self.catalog, 0),
            keys.DESIRED: (self.desired, 0),
            keys.NODES: (self.nodes, 0),
            keys.LEASES: (self.leases, 0),
            keys.HEALTH: (self.health, 0),
            keys.FABRICS: (self.fabrics, 0),
            keys.REPLICAS: (self.replicas, -1),
            keys.ASSIGN: (self.assigns, None),
            keys.SHARDS: (self.shards, None),
            keys.PLACEMENT: (self.placements, 0),
            keys.OPS: (self.ops, 0),
            keys.ROLLOUT: (self.rollouts, 0),
            keys.SCALE: (self.scales, 0),
            keys.LOAD: (self.loads, 0),
            keys.APIKEYS: (self.apikeys, 0),
            keys.TEAMS: (self.teams, 0),
        }

    def apply(self, key: str, data: bytes | None, revision: int) -> str | None:
        """Apply one change (`data` None: deleted); returns the key family it touched (None:
        not an llmgw key, or a family not kept here)."""
        parsed = keys.parse(key) or (keys.parse_gateway(key) if self.gateway else None)
        if parsed is None:
            log.debug("ignoring key %s: not an llmgw key (or not read here)", key)
            return None
        prefix = parsed.prefix
        if self.families is not None and prefix not in self.families:
            return None
        if prefix not in self._tables and prefix != keys.LEADER:
            return None  # a family the fleet's records do not hold
        if self.unreadable:
            self.unreadable.pop(key, None)
        if prefix == keys.LEADER:
            return self._apply_leader(parsed, key, data, revision)
        table, k = self._slot(prefix, parsed.ids)
        if data is None:
            table.pop(k, None)
            return prefix
        value, problem = settle(parsed, key, data, revision, table.get(k))
        if problem is not None:
            self.unreadable[key] = problem
            self.skipped.skipped(log, key, revision, f"{problem.why}; {problem.instead()}")
        if value is None:
            table.pop(k, None)
        else:
            table[k] = value
        return prefix

    def _apply_leader(self, parsed: keys.Key, key: str, data: bytes | None, revision: int) -> str:
        value, problem = (None, None) if data is None else settle(parsed, key, data, revision, None)
        if problem is not None:
            self.unreadable[key] = problem
            self.skipped.skipped(log, key, revision, problem.why)
        # a value that does not decode still has a revision: the one to take it over at
        self.leader, self.leader_rev = value, (revision if data is not None else 0)
        return keys.LEADER

    def _slot(self, prefix: str, ids: tuple[str, ...]):
        table, by_ids = self._tables[prefix]
        return table, ids if by_ids is None else ids[by_ids]

    def value_of(self, key: str) -> Any:
        """The value held for `key` (the last good one of a key that does not read)."""
        parsed = keys.parse(key) or keys.parse_gateway(key)
        if parsed is None or parsed.prefix not in self._tables:
            return None
        table, k = self._slot(parsed.prefix, parsed.ids)
        return table.get(k)

    def unreadable_of(self, family: str) -> dict[str, Unreadable]:
        """Unreadable keys of one family, by their first id."""
        return {u.key.split(".", 2)[1]: u for u in self.unreadable.values() if u.family == family}
