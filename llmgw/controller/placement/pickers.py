"""Pickers: the best node (or nodes, in one fabric) for the next replica of one profile."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from llmgw.bus.records import ReplicaMember
from llmgw.controller.placement.explain import Refusal
from llmgw.controller.placement.filters import fit
from llmgw.controller.placement.nodes import SHARE_HEADROOM, Need, NodeState, take
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
    """The best-ranked node that fits, lazily: every node is ranked (cheap: set lookups
    and counts), and only the nodes reached in rank order are judged by the filters. Within
    one plan resources only shrink, so a node refused stays refused, and the node just used
    is ranked again (it may still take another). The node chosen is the one an exhaustive
    judgement would choose: the best-ranked of those that fit (bench/placement.py checks
    it). Every node is judged only when the profile runs out of nodes, which is when an
    explanation needs every refusal."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self._on, self._near = on, near = weights.levels(need)
        want, model = need.profile.gpus_per_node, need.model
        self._shared = need.profile.share_gpus
        if self._shared:
            # _shared_order's bound, inlined for the nodes nothing shares or holds (most of
            # a fleet): this runs for every node for every shared profile placed
            k, order = SHARE_HEADROOM + need.gpu_bytes, self._shared_order
            gpu_model = need.profile.gpu_model
            self.heap: list[tuple] = [
                (
                    1,
                    -2 if node_id in on else -1 if node_id in near else 0,
                    node.smallest_gpu - k,
                    len(node.free),
                    node.models.get(model, 0),
                    node_id,
                )
                if node.free and not (node.allotted or node.held or node.unschedulable or gpu_model)
                else order(node, exact=False)
                for node_id, node in nodes.items()
            ]
            heapq.heapify(self.heap)
            return
        # Rank.order of scores.rank (weights level, packing, spread, id), inlined: this runs
        # for every node of the fleet for every profile placed
        self.heap = [
            (
                -2 if node_id in on else -1 if node_id in near else 0,
                len(node.free) - want,
                node.models.get(model, 0),
                node_id,
            )
            for node_id, node in nodes.items()
        ]
        heapq.heapify(self.heap)

    def _order(self, node: NodeState) -> tuple:
        node_id = node.id
        level = 2 if node_id in self._on else 1 if node_id in self._near else 0
        if self._shared:
            return self._shared_order(node, exact=True)
        packing = self.need.profile.gpus_per_node - len(node.free)
        return (-level, -packing, node.models.get(self.need.model, 0), node_id)

    def _shared_order(self, node: NodeState, *, exact: bool) -> tuple:
        """A shared profile's order: a GPU shared already before a fresh one (whole GPUs stay
        free for exclusive profiles), then the weights level, then the least room left on
        the GPU (best fit), then the node with fewest free GPUs (whole nodes stay free),
        spread, id. Not `exact`, a node nothing shares or holds gets a bound no worse than
        its order (its smallest GPU's room): `pick` puts a node whose order is worse than
        its entry back, so the first node taken is the best."""
        node_id, need = node.id, self.need
        level = 2 if node_id in self._on else 1 if node_id in self._near else 0
        spread = node.models.get(need.model, 0)
        if not node.free and not node.allotted:
            return (2, -level, 0, 0, spread, node_id)  # no GPU to share: refused when reached
        plain = not (node.allotted or node.held or node.unschedulable or need.profile.gpu_model)
        if not exact and plain:
            left = node.smallest_gpu - SHARE_HEADROOM - need.gpu_bytes
            return (1, -level, left, len(node.free), spread, node_id)
        best = node.best_shared_fit(need)
        if best is None:
            return (2, -level, 0, 0, spread, node_id)
        gpu, left = best
        return (
            0 if gpu.uuid in node.allotted else 1,
            -level,
            left,
            len(node.free),
            spread,
            node_id,
        )

    def pick(self) -> Pick | None:
        while self.heap:
            entry = heapq.heappop(self.heap)
            node = self.nodes[entry[-1]]
            if self._shared:
                order = self._order(node)
                if order != entry:  # a bound, or a stale entry: judged at its true order
                    heapq.heappush(self.heap, order)
                    continue
            refusal = fit(node, self.need)
            if refusal is not None:
                self.refused[node.id] = refusal
                continue
            why = why_here(node, self.need, self.weights)
            member = take(node, self.need, rank=0)
            heapq.heappush(self.heap, self._order(node))  # judged again when reached
            return Pick([member], why)
        return None

    def refusals(self) -> dict[str, Refusal]:
        for order in self.heap:  # nodes never reached: judged now, for the explanation
            node = self.nodes[order[-1]]
            refusal = fit(node, self.need)
            if refusal is not None:
                self.refused[node.id] = refusal
        return dict(self.refused)


class MultiNodePicker:
    """N nodes in ONE fabric: NCCL runs over InfiniBand, and fabrics are not connected.

    Each fabric keeps its fitting nodes, their free GPUs summed, and a heap of their ranks,
    all updated as nodes are judged again, so a pick looks at the top of each fabric's heap
    instead of sorting the fabric (entries of a node judged since are skipped as stale)."""

    def __init__(self, nodes: dict[str, NodeState], need: Need, weights: WeightsNearby) -> None:
        self.nodes, self.need, self.weights = nodes, need, weights
        self.refused: dict[str, Refusal] = {}
        self.fitting: dict[str, Rank] = {}
        self._free: dict[str, int] = {}  # node -> its free GPUs when last judged
        self.members: dict[str, set[str]] = defaultdict(set)  # fabric -> fitting nodes
        self.capacity: dict[str, int] = defaultdict(int)  # fabric -> their free GPUs
        self.heaps: dict[str, list[tuple[int, int, int, str]]] = defaultdict(list)
        for node in nodes.values():
            self._judge(node, push=False)
        for heap in self.heaps.values():
            heapq.heapify(heap)

    def _judge(self, node: NodeState, *, push: bool = True) -> None:
        node_id = node.id
        if node_id in self.fitting:
            del self.fitting[node_id]
            for name in node.fabrics:
                self.members[name].discard(node_id)
                self.capacity[name] -= self._free[node_id]
        refusal = fit(node, self.need)
        if refusal is not None:
            self.refused[node_id] = refusal
            return
        r = self.fitting[node_id] = rank(node, self.need, self.weights)
        self._free[node_id] = len(node.free)
        for name in node.fabrics:
            self.members[name].add(node_id)
            self.capacity[name] += len(node.free)
            if push:
                heapq.heappush(self.heaps[name], r.order)
            else:
                self.heaps[name].append(r.order)

    def _top(self, fabric: str, count: int) -> list[Rank]:
        """The `count` best fitting nodes of `fabric`, in rank order."""
        heap, chosen, seen = self.heaps[fabric], [], set()
        while heap and len(chosen) < count:
            order = heapq.heappop(heap)
            r = self.fitting.get(order[-1])
            if r is None or r.order != order or r.node in seen:
                continue  # judged again since (or refused): a stale entry, dropped
            seen.add(r.node)
            chosen.append(r)
        for r in chosen:
            heapq.heappush(heap, r.order)
        return chosen

    def pick(self) -> Pick | None:
        count = self.need.profile.nodes
        best: tuple | None = None
        for name, members in self.members.items():
            if len(members) < count:
                continue
            chosen = self._top(name, count)
            weights_total = sum(r.weights for r in chosen)
            # best weights across the chosen nodes, then most free capacity, then the name
            key = (-weights_total, -self.capacity[name], name)
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
        for node_id in self.fitting:
            name, size = max(
                ((n, len(self.members[n])) for n in sorted(self.nodes[node_id].fabrics)),
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
