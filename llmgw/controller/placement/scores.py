"""Scores: a bigger number is a better node; a node's scores for one need are a `Rank`."""

from __future__ import annotations

from typing import NamedTuple

from llmgw.controller.placement.explain import GB
from llmgw.controller.placement.nodes import Need, NodeState
from llmgw.controller.placement.weights import WeightsNearby


def weights_nearby(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    return weights.level(node.id, need)


def packing(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # Fewest GPUs left free after placing: fill partly used nodes first, so whole nodes stay
    # free for replicas that need all 8 GPUs (and CPU replicas prefer nodes without GPUs).
    return need.profile.gpus_per_node - len(node.free)


def spread(node: NodeState, need: Need, weights: WeightsNearby) -> int:
    # among equally packed nodes, one node going down should take as few replicas as possible
    return -node.models.get(need.model, 0)


class Rank(NamedTuple):
    """How good a node is for one need: the scores, each higher-is-better and compared in
    this order, then the node id so that ties always break the same way."""

    weights: int  # weights_nearby
    packing: int
    spread: int
    node: str

    @property
    def order(self) -> tuple[int, int, int, str]:
        """Sort key, best first."""
        return (-self.weights, -self.packing, -self.spread, self.node)


def rank(node: NodeState, need: Need, weights: WeightsNearby) -> Rank:
    return Rank(
        weights=weights_nearby(node, need, weights),
        packing=packing(node, need, weights),
        spread=spread(node, need, weights),
        node=node.id,
    )


def why_here(node: NodeState, need: Need, weights: WeightsNearby) -> str:
    text = weights.describe(node.id, need)
    total, used = len(node.gpus), len(node.used_gpus)
    if need.profile.gpus_per_node == 0:
        return f"{text}; CPU profile"
    if need.profile.share_gpus:
        return f"{text}; {_shares(node, need)}"
    if used:
        return f"{text}; packs node with {used} of {total} GPUs used"
    return f"{text}; node has all {total} GPUs free"


def _shares(node: NodeState, need: Need) -> str:
    best = node.best_shared_fit(need)
    if best is None:
        return "shares a GPU"
    gpu, _ = best
    size = f"{gpu.memory_total_bytes / GB:.0f} GB"
    name = f"MIG {gpu.mig_profile} of GPU {gpu.index}" if gpu.mig_profile else f"GPU {gpu.index}"
    sharing = node.sharing.get(gpu.uuid, 0)
    if not sharing:
        return f"shares {name} ({size}), which no replica shared yet"
    allotted = node.allotted.get(gpu.uuid, 0) / GB
    many = "replica" if sharing == 1 else "replicas"
    return f"shares {name} ({size}) with {sharing} {many} ({allotted:g} GB allotted)"
