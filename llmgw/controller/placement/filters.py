"""Filters: each one rule that says whether a node can take one more replica of a profile.

Each returns None when the node fits, else a Refusal (a constant reason key and its
numbers, controller/placement/explain.py); the first refusal is the one reported.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw import labels
from llmgw.bus.records import GpuNamed
from llmgw.controller.placement.explain import Refusal
from llmgw.controller.placement.nodes import (
    SHARE_HEADROOM,
    Need,
    NodeState,
    gpu_is,
    held_by_others,
    shared_named,
)
from llmgw.controller.placement.weights import holds, must_hold


def node_ready(node: NodeState, need: Need) -> Refusal | None:
    if node.phase == "ready":
        return None
    return Refusal("no-lease" if node.phase is None else node.phase)


def schedulable(node: NodeState, need: Need) -> Refusal | None:
    # the operator's `llmgw node cordon` or `drain`: nothing new lands there
    if node.cordon:
        return Refusal(node.cordon)
    return None


def matches_selector(node: NodeState, need: Need) -> Refusal | None:
    if not need.profile.node_selector:
        return None
    missed = labels.unmatched(need.profile.node_selector, node.labels)
    if missed is None:
        return None
    key, value, negated = missed
    return Refusal("excluded" if negated else "selector", detail=f"{key}={value}")


def tolerates_taints(node: NodeState, need: Need) -> Refusal | None:
    if not node.taints:
        return None
    taint = labels.untolerated(node.taints, need.profile.tolerations)
    return None if taint is None else Refusal("taint", detail=taint)


def engine_installed(node: NodeState, need: Need) -> Refusal | None:
    if need.profile.engine not in node.engines:
        return Refusal("no-engine", detail=need.profile.engine)
    return None


def weights_held(node: NodeState, need: Need) -> Refusal | None:
    # weights no engine can fetch (a key that is no repo id, a path) are a requirement: a
    # replica placed where they are not is refused by its agent before launch
    required = must_hold(need.profile.weights)
    if required is None or holds(node.inventory.weights, *required) is not False:
        return None
    kind, value = required
    return Refusal("no-weights", detail=f"{kind} {value}")


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
    model = need.profile.gpu_model
    if model is not None and not any(gpu_is(g, model) for g in node.gpus):
        return Refusal("gpu-model", detail=model)
    if need.profile.share_gpus:
        return None  # by memory, not by count: shared_gpu_memory
    usable = len(node.free_gpus(need.gpu_bytes, model))
    if usable < wanted:
        return Refusal("gpus", needs=wanted, has=usable)
    return None


def gpus_schedulable(node: NodeState, need: Need) -> Refusal | None:
    # one bad GPU takes itself out, not its node: the node's other GPUs still take replicas
    wanted = need.profile.gpus_per_node
    if wanted == 0 or not node.unschedulable or need.profile.share_gpus:
        return None
    model = need.profile.gpu_model
    usable = len(node.schedulable_gpus(need.gpu_bytes, model))
    if usable >= wanted:
        return None
    # enough_gpus passed, so one of the free GPUs is what is missing
    bad = next(g for g in node.free_gpus(need.gpu_bytes, model) if g.uuid in node.unschedulable)
    why = node.unschedulable[bad.uuid]
    named = GpuNamed(node=node.id, gpu=bad.index, why=why.why, count=why.count)
    return Refusal("gpus-unschedulable", needs=wanted, has=usable, gpu=named)


def gpus_not_held(node: NodeState, need: Need) -> Refusal | None:
    # memory another program holds is not free, whoever llmgw gave the GPU to: the engine
    # placed there would fail at start (GPUStack #2852, #6044)
    wanted = need.profile.gpus_per_node
    if wanted == 0 or not node.held or need.profile.share_gpus:
        return None
    model = need.profile.gpu_model
    usable = len(node.usable_gpus(need.gpu_bytes, model))
    if usable >= wanted:
        return None
    taken = next(
        g
        for g in node.schedulable_gpus(need.gpu_bytes, model)
        if not node.has_room(g, need.gpu_bytes)
    )
    return Refusal("gpus-held", needs=wanted, has=usable, gpu=held_by_others(node.id, taken))


def shared_gpu_memory(node: NodeState, need: Need) -> Refusal | None:
    # a shared replica goes to a GPU, free or shared already, whose memory less llmgw's
    # allotments, other programs' memory and the headroom covers its own (nodes.py)
    if not need.profile.share_gpus:
        return None
    if node.best_shared_fit(need) is not None:
        return None
    candidates = node.shareable_gpus(need.profile.gpu_model)
    if not candidates:  # every GPU is an exclusive replica's, or unschedulable
        return Refusal("gpus", needs=1, has=0)
    fullest = max(candidates, key=lambda g: (node.room(g), -g.index))
    return Refusal(
        "gpu-shared",
        needs=need.gpu_bytes,
        has=max(node.room(fullest), 0),
        gpu=shared_named(node, fullest),
    )


def enough_ram(node: NodeState, need: Need) -> Refusal | None:
    if node.ram_free < need.ram_bytes:
        return Refusal("ram", needs=need.ram_bytes, has=max(node.ram_free, 0))
    return None


def free_port(node: NodeState, need: Need) -> Refusal | None:
    if node.free_port(*need.ports) is None:
        lo, hi = need.ports
        return Refusal("ports", detail=f"{lo}-{hi}")
    return None


def not_failed_here(node: NodeState, need: Need) -> Refusal | None:
    # an agent gave up on this launch here lately (placement.<model>.failures); last, so that
    # its count is of nodes that would otherwise fit
    if node.id in need.avoid:
        return Refusal("failed-here")
    return None


Filter = Callable[[NodeState, Need], Refusal | None]
# The first refusal is the one the explanation reports, so the order goes from what says
# most about the node to what placements use up: a lost node is reported lost, not short of
# RAM; what the node is (engine, fabric, GPU model) comes before what waiting may free up
# (free GPUs, RAM, ports), so a person sees first what no amount of waiting will fix.
# Among GPUs: free of llmgw's replicas, then healthy, then not held by other programs.
# The operator's intent and the profile's rules about where it may run come right after the
# node's phase: they stay true until someone changes them. A launch that failed on the node
# comes last, so that its count is of nodes that would otherwise fit.

# What a node is, as opposed to what it has free now: these stay true within a plan and
# across plans until the node or the operator changes
_WHAT_IT_IS: tuple[Filter, ...] = (
    node_ready,
    schedulable,
    matches_selector,
    tolerates_taints,
    engine_installed,
    weights_held,
    on_active_fabric,
)

FILTERS: tuple[Filter, ...] = (
    *_WHAT_IT_IS,
    enough_gpus,
    gpus_schedulable,
    gpus_not_held,
    shared_gpu_memory,
    enough_ram,
    free_port,
    not_failed_here,
)


def fit(node: NodeState, need: Need) -> Refusal | None:
    """The first filter that refuses the node, or None when it fits."""
    for check in FILTERS:
        refusal = check(node, need)
        if refusal is not None:
            return refusal
    return None


def could_run(node: NodeState, need: Need) -> bool:
    """Whether the node could run the profile at all, were nothing running on it: what it
    is passes, and it has enough GPUs of the size asked, used or not."""
    if any(check(node, need) is not None for check in _WHAT_IT_IS):
        return False
    wanted = need.profile.gpus_per_node
    if wanted == 0:
        return True
    least = need.gpu_bytes + (SHARE_HEADROOM if need.profile.share_gpus else 0)
    model = need.profile.gpu_model
    fitting = (g for g in node.gpus if g.memory_total_bytes >= least and gpu_is(g, model))
    return sum(1 for _ in fitting) >= wanted
