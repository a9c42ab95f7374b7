"""Pickers: the best node (or nodes, in one fabric) for the next replica of one profile."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from llmgw.bus.records import ReplicaMember
from llmgw.controller.placement.explain import Refusal
from llmgw.controller.placement.filters import fit
from llmgw.controller.placement.nodes import Need, NodeState, take
from llmgw.controller.placement.scores import Rank, rank, why_here
from llmgw.controller.placement.weights import WeightsNearby


@dataclass(frozen=True, slots=True)
class Pick:
    members: list[ReplicaMember]
    why: str


class Picker(Protocol):
    def pick(self) -> Pick | None:
        """Take the best place for one more replica, or None when there is none left."""

    def refusals(self) -> dict[str, Refusal]:
        """Why each node that cannot take one more replica cannot."""


class SingleNodePicker:
    """All nodes are judged once; afterwards only the node just used changes (within one
    plan resources only shrink), so it alone is judged again."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self.heap: list[tuple[int, int, int, str]] = []  # Rank.order: the node id last
        for node in nodes.values():
            order = self._judge(node)
            if order is not None:
                self.heap.append(order)
        heapq.heapify(self.heap)

    def _judge(self, node: NodeState) -> tuple[int, int, int, str] | None:
        refusal = fit(node, self.need)
        if refusal is not None:
            self.refused[node.id] = refusal
            return None
        return rank(node, self.need, self.weights).order

    def pick(self) -> Pick | None:
        if not self.heap:
            return None
        node = self.nodes[heapq.heappop(self.heap)[-1]]
        why = why_here(node, self.need, self.weights)
        member = take(node, self.need, rank=0)
        order = self._judge(node)
        if order is not None:
            heapq.heappush(self.heap, order)
        return Pick([member], why)

    def refusals(self) -> dict[str, Refusal]:
        return dict(self.refused)


class MultiNodePicker:
    """N nodes in ONE fabric: NCCL runs over InfiniBand, and fabrics are not connected."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self.fitting: dict[str, Rank] = {}
        for node in nodes.values():
            self._judge(node)

    def _judge(self, node: NodeState) -> None:
        refusal = fit(node, self.need)
        if refusal is None:
            self.fitting[node.id] = rank(node, self.need, self.weights)
        else:
            self.fitting.pop(node.id, None)
            self.refused[node.id] = refusal

    def _by_fabric(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = defaultdict(list)
        for node_id in self.fitting:
            for name in self.nodes[node_id].fabrics:
                groups[name].append(node_id)
        return groups

    def pick(self) -> Pick | None:
        count = self.need.profile.nodes
        best: tuple | None = None
        for name, members in self._by_fabric().items():
            if len(members) < count:
                continue
            chosen = heapq.nsmallest(
                count, (self.fitting[n] for n in members), key=lambda r: r.order
            )
            weights_total = sum(r.weights for r in chosen)
            capacity = sum(len(self.nodes[n].free) for n in members)
            # best weights across the chosen nodes, then most free capacity, then the name
            key = (-weights_total, -capacity, name)
            if best is None or key < best[0]:
                best = (key, name, [r.node for r in chosen])
        if best is None:
            return None
        _, fabric, chosen_ids = best
        why = why_here(self.nodes[chosen_ids[0]], self.need, self.weights)
        members = [
            take(self.nodes[node_id], self.need, rank) for rank, node_id in enumerate(chosen_ids)
        ]
        for node_id in chosen_ids:
            self._judge(self.nodes[node_id])
        return Pick(members, f"{count} nodes in fabric {fabric}; rank 0: {why}")

    def refusals(self) -> dict[str, Refusal]:
        """Per node, counting nodes that fit alone but whose fabric is too small."""
        out = dict(self.refused)
        groups = self._by_fabric()
        for node_id in self.fitting:
            name, size = max(
                ((n, len(groups[n])) for n in sorted(self.nodes[node_id].fabrics)),
                key=lambda item: item[1],
            )
            out[node_id] = Refusal(
                "fabric-size", needs=self.need.profile.nodes, has=size, detail=name
            )
        return out


def picker(nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> Picker:
    if need.profile.nodes > 1:
        return MultiNodePicker(nodes, need, weights)
    return SingleNodePicker(nodes, need, weights)
