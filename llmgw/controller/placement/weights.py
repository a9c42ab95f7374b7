"""Where each model's weights are, per node and per fabric: what the weights score reads."""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

from llmgw.bus.records import Weights
from llmgw.catalog import WeightsRef, hf_repo
from llmgw.controller.fabrics import fabric_view
from llmgw.controller.placement.nodes import Need
from llmgw.controller.placement.snapshot import Snapshot


class WeightsNearby:
    """Where each model's weights are, per node and per fabric, built once per plan.

    From the snapshot's fabric view, or `fabric_view` of its inventories when it has none
    (a node on no fabric is its own island). Only `models` matter,
    never `looked`: a node that never looked must rank with one that found nothing, or
    enabling weights discovery on one node would drain every other.
    """

    def __init__(self, snapshot: Snapshot) -> None:
        self.on_node: dict[str, dict[str, str]] = defaultdict(dict)  # node -> key -> store
        self.by_path: dict[str, dict[str, str]] = defaultdict(dict)  # node -> path -> store
        self.in_fabric: dict[str, set[str]] = defaultdict(set)  # fabric -> keys
        self.fabrics_of: dict[str, list[str]] = defaultdict(list)  # node -> fabrics
        self._holders: dict[str, set[str]] | None = None  # key -> nodes: built by `levels`
        for node_id, inv in snapshot.inventories.items():
            for held in inv.weights.models:
                self.on_node[node_id].setdefault(held.key, held.store.identity)
                self.by_path[node_id].setdefault(held.path, held.store.identity)
        view = snapshot.fabrics
        if view is None:
            view = fabric_view(snapshot.inventories.values())
        for name, holdings in view.items():
            for node_id in holdings.nodes:
                self.fabrics_of[node_id].append(name)
            for held in holdings.models:
                self.in_fabric[name].add(held.key)
                for copy in held.copies:  # a share seen by a node that did not scan it
                    for node_id in copy.nodes:
                        self.on_node[node_id].setdefault(held.key, copy.store)

    def _store(self, node: str, need: Need) -> str | None:
        held = self.on_node.get(node)
        store = held.get(need.weights_key) if held else None
        path = need.profile.weights.path
        if store is None and path is not None and node in self.by_path:
            store = self.by_path[node].get(path)
        return store

    def _fabric(self, node: str, need: Need) -> str | None:
        for name in self.fabrics_of.get(node, ()):
            if need.weights_key in self.in_fabric.get(name, ()):
                return name
        return None

    def levels(self, need: Need) -> tuple[frozenset[str], frozenset[str]]:
        """The nodes at level 2 and at level 1 for `need` (`level`), for every node at once:
        what a picker ranks a whole fleet by, a set lookup a node."""
        if self._holders is None:
            self._holders = defaultdict(set)
            self._path_holders: dict[str, set[str]] = defaultdict(set)
            self._fabric_nodes: dict[str, set[str]] = defaultdict(set)
            for node, held in self.on_node.items():
                for key in held:
                    self._holders[key].add(node)
            for node, paths in self.by_path.items():
                for path in paths:
                    self._path_holders[path].add(node)
            for node, names in self.fabrics_of.items():
                for name in names:
                    self._fabric_nodes[name].add(node)
        on = set(self._holders.get(need.weights_key, ()))
        path = need.profile.weights.path
        if path is not None:
            on |= self._path_holders.get(path, set())
        near: set[str] = set()
        for name, keys in self.in_fabric.items():
            if need.weights_key in keys:
                near |= self._fabric_nodes.get(name, set())
        return frozenset(on), frozenset(near - on)

    def level(self, node: str, need: Need) -> int:
        """2: on the node or a share it sees; 1: elsewhere in its fabric; 0: nowhere near."""
        if self._store(node, need) is not None:
            return 2
        return 1 if self._fabric(node, need) is not None else 0

    def describe(self, node: str, need: Need) -> str:
        store = self._store(node, need)
        if store is not None:
            where = "on node" if store.startswith("local:") else "on a share the node sees"
            return f"weights {where} ({store})"
        ref = need.profile.weights
        if ref.path is not None:
            # the engine is given the path as it is: nothing fetches a path
            return f"weights path {ref.path} not reported by this node (the engine reads it there)"
        fetched = f"the engine fetches {ref.source or ref.key}"
        fabric = self._fabric(node, need)
        if fabric is not None:
            return f"weights elsewhere in fabric {fabric}, not on this node ({fetched})"
        return f"no copy of the weights nearby ({fetched})"


def must_hold(ref: WeightsRef) -> tuple[str, str] | None:
    """("key" or "path", its value) when no engine can fetch these weights, so a node must
    hold them to run the replica: a requirement, not a preference. None when an engine
    fetches what the node lacks: a `source`, or a key that is a Hugging Face repo id
    ("org/name"), which an agent that does not hold it gives its engine to fetch (the
    agent's rule: llmgw/catalog.py `hf_repo`). A key of another form (a directory name,
    a GGUF file stem) and a path are never fetched."""
    return _must_hold(ref.key, ref.path, ref.source)


@lru_cache(maxsize=4096)  # asked for every node a profile is tried on: decided once
def _must_hold(key: str | None, path: str | None, source: str | None) -> tuple[str, str] | None:
    if source is not None:
        return None
    if key is not None:
        return None if hf_repo(key) is not None else ("key", key)
    assert path is not None
    return ("path", path)


def holds(weights: Weights, kind: str, value: str) -> bool | None:
    """Whether a node's own inventory holds the weights (`must_hold`'s answer): what its
    agent launches from. None for a path the node never scanned (its agent looked
    elsewhere, or not at all): the engine reads it there, and only a launch can tell."""
    if kind == "key":
        return any(m.key == value for m in weights.models)
    path = value.rstrip("/")
    if any(m.path.rstrip("/") == path for m in weights.models):
        return True
    scanned = [d.path.rstrip("/") for d in weights.dirs if d.status == "ok"]
    if any(path == d or path.startswith(d + "/") for d in scanned):
        return False
    return None
