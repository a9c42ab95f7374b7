"""The one decoder of the bucket: every key's value typed and checked, kept by the id its
key names. What a reader does with a value that does not read (keeps the last good one,
cordons the node, freezes the model, refuses the key, reads it as absent) is the one rule of
llmgw/bus/unreadable.py, which `settle` asks.

Every reader says what it kept: `unreadable` (by key) feeds the log, `llmgw status`, the
fleet page and the controller's metrics. No reader applies the rule itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from llmgw import catalog
from llmgw.bus import keys, records, trust, unreadable
from llmgw.bus.unreadable import (
    CONTROLLER_WRITES,
    FREEZES_MODEL,
    KEEPS_LAST_GOOD,
    REFUSES,
    Reading,
    Unreadable,
)

log = logging.getLogger(__name__)

# what readers import from here beside the records: the rule's words (llmgw/bus/unreadable.py)
__all__ = [
    "CONTROLLER_WRITES",
    "FREEZES_MODEL",
    "KEEPS_LAST_GOOD",
    "REFUSES",
    "FleetRecords",
    "Reading",
    "Unreadable",
    "decode_value",
    "read_once",
    "settle",
    "slot_of",
]


def decode_value(key: keys.Key, data: bytes) -> Any:
    """The record `data` holds at `key`, checked against its key (trust.py); catalog entries
    are decoded and validated by the catalog. Raises one of catalog.UNREADABLE."""
    if key.prefix == keys.CATALOG:
        return catalog.decode_model(data, key.ids[0])
    if key.prefix == keys.ADAPTERS:
        return catalog.decode_adapter(data, key.ids[0])
    return trust.decode_for_key(key, data)


def settle(
    parsed: keys.Key,
    key: str,
    data: bytes | trust.Oversized,
    revision: int,
    last: Any,
    skipped: trust.SkippedValues | None = None,
) -> tuple[Any, Unreadable | None]:
    """The value a reader holds for `key` after `data` was written over `last` (None: none
    held): the new one when it reads, else the family's reading (llmgw/bus/unreadable.py),
    said once through `skipped`."""
    return unreadable.settle(
        key, parsed, data, revision, last, lambda d: decode_value(parsed, d), skipped
    )


def read_once(key: str, raw: tuple[bytes, int] | None) -> tuple[Any, Unreadable | None]:
    """What a reader that has held nothing before (a command: `llmgw node`, `llmgw rollout`)
    reads at `key` from `raw` (Bus.get_raw's bytes and revision; None: absent): the value,
    or the family's reading and why (`settle`), as `llmgw status` reads it."""
    parsed = keys.parse(key)
    if raw is None or parsed is None:
        return None, None
    return settle(parsed, key, raw[0], raw[1], None)


# family -> the FleetRecords table that holds it, and which of its key's ids it is held by
# (None: all of them); also where a controller stores what it wrote (controller/changes.py)
SLOTS: dict[str, tuple[str, int | None]] = {
    keys.CATALOG: ("catalog", 0),
    keys.DESIRED: ("desired", 0),
    keys.NODES: ("nodes", 0),
    keys.LEASES: ("leases", 0),
    keys.HEALTH: ("health", 0),
    keys.FABRICS: ("fabrics", 0),
    keys.REPLICAS: ("replicas", -1),
    keys.ASSIGN: ("assigns", None),
    keys.SHARDS: ("shards", None),
    keys.PLACEMENT: ("placements", 0),
    keys.OPS: ("ops", 0),
    keys.ROLLOUT: ("rollouts", 0),
    keys.SCALE: ("scales", 0),
    keys.LOAD: ("loads", 0),
    keys.APIKEYS: ("apikeys", 0),
    keys.TEAMS: ("teams", 0),
    keys.ADAPTERS: ("adapters", 0),
}


def slot_of(parsed: keys.Key) -> tuple[str, Any]:
    """(the attribute of the table that holds `parsed`'s family, the id it is held by)."""
    attr, by = SLOTS[parsed.prefix]
    return attr, parsed.ids if by is None else parsed.ids[by]


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
    adapters: dict[str, catalog.Adapter] = field(default_factory=dict)  # LoRA adapters, by id
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
        # family -> its table, and which id keys it (SLOTS). The tables are changed in
        # place, never replaced.
        self._tables: dict[str, tuple[dict, int | None]] = {
            family: (getattr(self, attr), by) for family, (attr, by) in SLOTS.items()
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
        value, problem = settle(parsed, key, data, revision, table.get(k), self.skipped)
        if problem is not None:
            self.unreadable[key] = problem
        if value is None:
            table.pop(k, None)
        else:
            table[k] = value
        return prefix

    def _apply_leader(self, parsed: keys.Key, key: str, data: bytes | None, revision: int) -> str:
        value, problem = (
            (None, None)
            if data is None
            else settle(parsed, key, data, revision, None, self.skipped)
        )
        if problem is not None:
            self.unreadable[key] = problem
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
