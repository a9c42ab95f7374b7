"""Filters: each one rule that says whether a node can take one more replica of a profile.

Each returns None when the node fits, else a Refusal (a constant reason key and its
numbers, controller/placement/explain.py); the first refusal is the one reported.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.controller.placement.explain import Refusal
from llmgw.controller.placement.nodes import Need, NodeState


def node_ready(node: NodeState, need: Need) -> Refusal | None:
    if node.phase == "ready":
        return None
    return Refusal("no-lease" if node.phase is None else node.phase)


def engine_installed(node: NodeState, need: Need) -> Refusal | None:
    if need.profile.engine not in node.engines:
        return Refusal("no-engine", detail=need.profile.engine)
    return None


def on_active_fabric(node: NodeState, need: Need) -> Refusal | None:
    # multi-node engines talk NCCL over InfiniBand; the management network is far too slow
    if need.profile.nodes > 1 and not node.fabrics:
        return Refusal("no-fabric")
    return None


_NO_GPUS = {"no_driver": "no-gpu-driver", "error": "gpu-discovery-failed"}


def enough_gpus(node: NodeState, need: Need) -> Refusal | None:
    wanted = need.profile.gpus_per_node
    if wanted == 0:
        return None
    if not node.gpus:
        return Refusal(_NO_GPUS.get(node.inventory.gpus.status, "no-gpus"))
    if need.gpu_bytes > node.largest_gpu:  # no waiting will fix this one
        return Refusal("gpu-memory", needs=need.gpu_bytes, has=node.largest_gpu)
    usable = len(node.free_gpus(need.gpu_bytes))
    if usable < wanted:
        return Refusal("gpus", needs=wanted, has=usable)
    return None


def enough_ram(node: NodeState, need: Need) -> Refusal | None:
    if node.ram_free < need.ram_bytes:
        return Refusal("ram", needs=need.ram_bytes, has=max(node.ram_free, 0))
    return None


def free_port(node: NodeState, need: Need) -> Refusal | None:
    if node.free_port(*need.ports) is None:
        lo, hi = need.ports
        return Refusal("ports", detail=f"{lo}-{hi}")
    return None


Filter = Callable[[NodeState, Need], Refusal | None]
# The first refusal is the one the explanation reports, so the order goes from what says
# most about the node to what placements use up: a lost node is reported lost, not short of
# RAM; what the node is (engine, fabric, GPU model) comes before what waiting may free up
# (free GPUs, RAM, ports), so a person sees first what no amount of waiting will fix.
FILTERS: tuple[Filter, ...] = (
    node_ready,
    engine_installed,
    on_active_fabric,
    enough_gpus,
    enough_ram,
    free_port,
)


def fit(node: NodeState, need: Need) -> Refusal | None:
    """The first filter that refuses the node, or None when it fits."""
    for check in FILTERS:
        refusal = check(node, need)
        if refusal is not None:
            return refusal
    return None
