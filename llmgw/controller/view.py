"""The controller's view of the bucket: the latest value of every key, kept by one watch.

Rebuilt from scratch at every start (the controller remembers nothing across restarts).
Values that do not decode are logged, left out, and remembered as invalid: a catalog entry
or a desired count garbled by hand freezes its model (`frozen`) instead of reading as a
model that was removed or a count of 0 (either would drain its replicas).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmgw import catalog
from llmgw.bus import keys, records, trust

log = logging.getLogger(__name__)


@dataclass
class View:
    catalog: dict[str, catalog.Model] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)  # key -> why it does not decode
    desired: dict[str, records.Desired] = field(default_factory=dict)
    nodes: dict[str, records.NodeInventory] = field(default_factory=dict)
    leases: dict[str, records.Lease] = field(default_factory=dict)
    health: dict[str, records.Health] = field(default_factory=dict)
    fabrics: dict[str, records.FabricHoldings] = field(default_factory=dict)
    replicas: dict[str, records.Replica] = field(default_factory=dict)  # rid -> replica
    assigns: dict[tuple[str, str], records.Assignment] = field(default_factory=dict)  # (node, rid)
    shards: dict[tuple[str, str], records.Shard] = field(default_factory=dict)
    placements: dict[str, records.PlacementRecord] = field(default_factory=dict)
    ops: dict[str, records.NodeOps] = field(default_factory=dict)  # node -> operator's intent
    rollouts: dict[str, records.Rollout] = field(default_factory=dict)
    scales: dict[str, records.Scale] = field(default_factory=dict)  # the autoscaler's counts
    loads: dict[str, records.RouterLoad] = field(default_factory=dict)  # router -> its load
    leader: records.Leader | None = None
    leader_rev: int = 0
    skipped: trust.SkippedValues = field(default_factory=trust.SkippedValues)

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
        }

    def apply(self, key: str, data: bytes | None, revision: int) -> str | None:
        """Apply one change; returns the key family it touched (None: not ours)."""
        parsed = keys.parse(key)
        if parsed is None:
            log.debug("ignoring key %s: not an llmgw key", key)
            return None
        prefix, ids = parsed.prefix, parsed.ids
        self.invalid.pop(key, None)
        try:
            value = None if data is None else self._decode(parsed, data)
        except catalog.UNREADABLE as e:
            self.invalid[key] = str(e)
            self.skipped.skipped(log, key, revision, str(e))
            value = None
            if prefix in (keys.REPLICAS, keys.DESIRED):
                # keep the last valid value: a replica's engines are still running, and a
                # garbled count is not a request for none (the model is frozen instead)
                return prefix
        if prefix == keys.LEADER:
            # a value that does not decode still has a revision: the one to take it over at
            self.leader, self.leader_rev = value, (revision if data is not None else 0)
            return prefix
        self._store(prefix, ids, value)
        return prefix

    @staticmethod
    def _decode(key: keys.Key, data: bytes):
        if key.prefix == keys.CATALOG:
            return catalog.decode_model(data, key.ids[0])
        # the owner comes from the key, never the value; ranges and ids are checked there
        return trust.decode_for_key(key, data)

    def _store(self, prefix: str, ids: tuple[str, ...], value) -> None:
        table, k = self._slot(prefix, ids)
        if value is None:
            table.pop(k, None)
        else:
            table[k] = value

    def _slot(self, prefix: str, ids: tuple[str, ...]):
        table, by_ids = self._tables[prefix]
        return table, ids if by_ids is None else ids[by_ids]

    def invalid_catalog(self) -> dict[str, str]:
        return {
            k.split(".", 1)[1]: why
            for k, why in self.invalid.items()
            if k.startswith(keys.CATALOG + ".")
        }

    def frozen(self) -> dict[str, Freeze]:
        """Models whose replicas stay exactly as they are (nothing placed, nothing removed)
        because their catalog entry cannot be trusted to say what is wanted."""
        out = {
            model: Freeze("invalid-catalog", why) for model, why in self.invalid_catalog().items()
        }
        # a count that does not decode or is out of range (a typo, "1" quoted, 10^9) is
        # never read as 0: that would drain the model
        for key, why in self.invalid.items():
            if key.startswith(keys.DESIRED + "."):
                out.setdefault(key.split(".", 1)[1], Freeze("invalid-desired", why))
        models_placed = {r.model for r in self.replicas.values()}
        for model, desired in self.desired.items():
            # one `nats kv del` must not drain a model someone still asks replicas of
            if (
                desired.replicas > 0
                and model not in self.catalog
                and model not in out
                and model in models_placed
            ):
                out[model] = Freeze("catalog-deleted", "")
        return out


@dataclass(frozen=True, slots=True)
class Freeze:
    """Why a model is frozen: `blocked` is its PlacementRecord.blocked key
    ("invalid-catalog", "invalid-desired", "catalog-deleted"), `detail` what is wrong."""

    blocked: str
    detail: str
