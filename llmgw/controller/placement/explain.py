"""Why replicas are not placed, as data first and text second.

A filter refuses a node with a `Refusal`: a constant reason key plus the numbers it is
about (what the profile needs, what the node has), like Kubernetes'
`InsufficientResource{Requested, Used, Capacity}`. `group` folds the refusals of one
profile into one `RefusedNodes` per reason for the `placement.<model>` record, and
`render` writes the text a person reads from that record:

    0/14 nodes fit: 12 short of host RAM (62-90 GB free, needs 128), 2 lost

A node's free RAM moves a little at every heartbeat; the numbers it moves are kept in
`least`/`most`, and `same_decision` compares records without them, so a model waiting
for RAM is not rewritten (nor logged, nor announced) at every pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from llmgw.bus.records import Failure, Freezing, GpuNamed, PlacementRecord, RefusedNodes
from llmgw.xids import describe_xid

GB = 1_000_000_000  # catalog sizes are 10^9 bytes, like the "80GB" on the card

# Why one node cannot take a replica of one profile. Constant keys: the numbers go in
# the Refusal's fields, never into the key.
Reason = Literal[
    "unreachable",  # node phase: its lease stopped moving
    "lost",
    "no-lease",  # an inventory, but no lease judged yet
    "cordoned",  # the operator's `llmgw node cordon`
    "draining",  # the operator's `llmgw node drain`
    "selector",  # detail: the label the profile's node_selector asks for ("pool=research")
    "excluded",  # detail: the label it excludes ("node=node07" from "node = '!node07'")
    "taint",  # detail: the taint the profile does not tolerate
    "no-engine",  # detail: the engine
    "no-weights",  # detail: "key K" or "path P": weights no engine fetches, not held there
    "no-fabric",  # a multi-node profile on a node on no active IB fabric
    "no-gpus",  # a GPU profile on a node without NVIDIA GPUs
    "no-gpu-driver",
    "gpu-discovery-failed",
    "gpu-memory",  # needs/has: bytes per GPU (has: the node's largest GPU)
    "gpus",  # needs/has: count of free GPUs with enough memory
    "gpus-unschedulable",  # needs/has: free GPUs that are healthy; gpu: one that is not
    "gpus-held",  # needs/has: free GPUs with the memory left; gpu: one other programs hold
    "gpu-model",  # detail: the gpu_model the profile asks for, which no GPU here is
    "gpu-shared",  # needs/has: bytes a shared replica is given / the most room left on a GPU
    "ram",  # needs/has: bytes of host RAM free
    "ports",  # detail: the port range, all in use
    "fabric-size",  # needs/has: fitting nodes in the fabric; detail: the fabric
    "failed-here",  # an agent gave up on this launch here within the cool-down
]

_REASON_ORDER = {r: i for i, r in enumerate(get_args(Reason))}

# Why a model as a whole places nothing (PlacementRecord.blocked).
# The freezing ones are the planner's (records.Freezing), not listed again here.
Blocked = Literal["not-in-catalog", "static-endpoints", "unknown-profile", Freezing]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a node cannot take a replica: `reason`, plus what the profile needs and what
    the node has, in the reason's unit (bytes, GPUs, nodes; see Reason)."""

    reason: Reason
    needs: int | None = None
    has: int | None = None
    detail: str = ""
    gpu: GpuNamed | None = None  # the GPU it is about, named for a person


def group(profile: str, refusals: Mapping[str, Refusal]) -> list[RefusedNodes]:
    """One RefusedNodes per (reason, needs, detail): most nodes first, then in the order of
    Reason (the filters' order), so the order depends on no number that moves by itself."""
    groups: dict[tuple[str, int | None, str], list[int | None]] = {}
    named: dict[tuple[str, int | None, str], GpuNamed] = {}  # the first node's GPU
    for r in refusals.values():
        key = (r.reason, r.needs, r.detail)
        groups.setdefault(key, []).append(r.has)
        if r.gpu is not None:
            named.setdefault(key, r.gpu)
    out = []
    for (reason, needs, detail), has in groups.items():
        known = [h for h in has if h is not None]
        out.append(
            RefusedNodes(
                profile=profile,
                reason=reason,
                nodes=len(has),
                needs=needs,
                least=min(known) if known else None,
                most=max(known) if known else None,
                detail=detail,
                gpu=named.get((reason, needs, detail)),
            )
        )
    out.sort(key=lambda g: (-g.nodes, _REASON_ORDER.get(g.reason, -1), g.detail, g.needs or 0))
    return out


def same_decision(a: PlacementRecord, b: PlacementRecord) -> bool:
    """Whether two records say the same: everything but when, the rendered text, the
    decision lines and the observed numbers (`least`/`most`, and of a GPU named, the
    memory held and by whom), which move by themselves."""
    return _decision(a) == _decision(b)


def _gpu_named(g: GpuNamed | None) -> tuple | None:
    return None if g is None else (g.node, g.gpu, g.why)


def _decision(r: PlacementRecord) -> tuple:
    return (
        r.model,
        r.desired,
        r.placed,
        r.desired_at,
        r.blocked,
        r.blocked_detail,
        r.judged,
        tuple(
            (g.profile, g.reason, g.nodes, g.needs, g.detail, _gpu_named(g.gpu)) for g in r.refused
        ),
        r.waiting,
        tuple((f.node, f.rid, f.launch, f.moved_to) for f in r.failures),
        tuple(r.broken),
        r.rollout,
        r.rollout_detail,
        r.scaled,
    )


# --- text, rendered from the record's data ------------------------------------------------


def render(record: PlacementRecord) -> str:
    """The text a person reads: "" when nothing is missing, waiting or failing, and nothing
    blocks the model."""
    if record.blocked:
        return _render_blocked(record)
    parts = []
    if record.placed < record.desired:
        parts.append(_render_refused(record))
    elif record.waiting and record.refused:
        n = record.waiting
        parts.append(
            f"{n} replacement{'s' if n != 1 else ''} (rollout or drain) "
            f"wait{'s' if n == 1 else ''} for a node: {_render_refused(record)}"
        )
    if record.rollout == "stopped":
        parts.append(f"rollout stopped: {record.rollout_detail}")
    parts.extend(_render_failures(record))
    return "; ".join(p for p in parts if p)


MAX_FAILURES_SAID = 3  # the latest; `failures` holds them all


def _render_failures(r: PlacementRecord) -> list[str]:
    out = []
    for profile in r.broken:
        mine = [f for f in r.failures if f.profile == profile]
        last = mine[-1] if mine else None
        nodes = ", ".join(dict.fromkeys(f.node for f in mine))
        out.append(
            f"profile {profile} failed on {nodes}"
            + (f" ({failure_text(last)})" if last else "")
            + ": the profile, not the nodes, is the problem; nothing more is placed with it "
            f"until it changes (`llmgw catalog apply`, or `llmgw rollout undo {r.model}`)"
        )
    moved = [f for f in r.failures if f.profile not in r.broken]
    for f in moved[-MAX_FAILURES_SAID:]:
        where = f"moved to {f.moved_to}" if f.moved_to else "not placed elsewhere yet"
        out.append(f"failed {f.restarts + 1} times on {f.node} ({failure_text(f)}); {where}")
    return out


def failure_text(f: Failure) -> str:
    """ "exited with code 1 while loading: CUDA error: an illegal memory access" """
    return ": ".join(t for t in (f.reason, f.last_line) if t) or "no reason reported"


def render_refusals(judged: int, refusals: Iterable[tuple[str, Mapping[str, Refusal]]]) -> str:
    """The text of refusals not yet in a record: "0/3 nodes fit: 2 cordoned, 1 lost"."""
    groups = [g for profile, by_node in refusals for g in group(profile, by_node)]
    return _render_refused(
        PlacementRecord(model="", desired=0, placed=0, judged=judged, refused=groups)
    )


def _render_refused(record: PlacementRecord) -> str:
    if not record.refused and record.broken:
        return ""  # nothing was tried: the broken profiles say why
    profiles = list(dict.fromkeys(g.profile for g in record.refused))
    if len(profiles) <= 1:
        return _render_profile(record.judged, record.refused)
    return "; ".join(
        f"profile {p}: "
        + _render_profile(record.judged, [g for g in record.refused if g.profile == p])
        for p in profiles
    )


def _render_blocked(r: PlacementRecord) -> str:
    if r.blocked == "not-in-catalog":
        return f"model '{r.model}' is not in the catalog"
    if r.blocked == "static-endpoints":
        return f"model '{r.model}' is served from static endpoints, not placed"
    if r.blocked == "unknown-profile":
        return (
            f"profile '{r.blocked_detail}' is not in model '{r.model}'; "
            "`llmgw catalog ls` lists its profiles"
        )
    if r.blocked == "invalid-catalog":
        return f"catalog entry is invalid, nothing changed until it is fixed: {r.blocked_detail}"
    if r.blocked == "invalid-desired":
        return (
            f"desired.{r.model} cannot be read ({r.blocked_detail}), so nothing is placed or "
            f"removed: set it with `llmgw place {r.model} --replicas N`, or delete it "
            f"(`nats kv del llmgw desired.{r.model}`) to remove the model"
        )
    if r.blocked == "catalog-deleted":
        n = "1 replica is" if r.desired == 1 else f"{r.desired} replicas are"
        return (
            f"catalog entry deleted while {n} desired, nothing placed or removed: re-apply "
            f"it (`llmgw catalog apply`), then `llmgw place {r.model} --replicas 0` to remove them"
        )
    return f"{r.blocked}: {r.blocked_detail}" if r.blocked_detail else r.blocked


def _render_profile(judged: int, groups: Iterable[RefusedNodes]) -> str:
    groups = list(groups)
    head = f"{judged - sum(g.nodes for g in groups)}/{judged} nodes fit"
    if judged == 0:
        return f"{head}: no node has reported an inventory"
    parts = [render_group(g) for g in groups]
    return f"{head}: " + ", ".join(parts) if parts else head


# reason key -> how its group reads; the numbers come from the group's fields
_GROUP_TEXT: dict[str, Callable[[RefusedNodes], str]] = {
    "lost": lambda g: "lost",
    "unreachable": lambda g: "unreachable",
    "no-lease": lambda g: "with no lease seen",
    "cordoned": lambda g: "cordoned",
    "draining": lambda g: "draining",
    "selector": lambda g: f"lack {g.detail}",
    "excluded": lambda g: f"excluded ({g.detail})",
    "taint": lambda g: f"tainted {g.detail}",
    "no-engine": lambda g: f"no {g.detail}",
    "no-fabric": lambda g: "not on an active IB fabric",
    "no-gpus": lambda g: "without GPUs",
    "no-gpu-driver": lambda g: "without a GPU driver",
    "gpu-discovery-failed": lambda g: "where GPU discovery failed",
    "gpu-memory": lambda g: f"with GPUs too small ({_range(g, _gb)} GB, needs {_gb(g.needs)})",
    "gpus": lambda g: f"short of free GPUs ({_range(g, str)} free, needs {g.needs})",
    "gpus-unschedulable": lambda g: (
        f"short of healthy free GPUs ({_range(g, str)} usable, needs {g.needs}{_named(g.gpu)})"
    ),
    "gpus-held": lambda g: (
        f"short of free GPUs other programs leave room on ({_range(g, str)} usable, needs "
        f"{g.needs}{_named(g.gpu)})"
    ),
    "gpu-model": lambda g: f"without a GPU of model {g.detail}",
    "gpu-shared": lambda g: (
        f"short of GPU memory to share ({_range(g, _gb)} GB left on a GPU, needs "
        f"{_gb(g.needs)}{_named(g.gpu)})"
    ),
    "ram": lambda g: f"short of host RAM ({_range(g, _gb)} GB free, needs {_gb(g.needs)})",
    "ports": lambda g: f"with no free port in {g.detail}",
    "fabric-size": lambda g: (
        f"on {g.detail}, which has {_range(g, str)} fitting node{'s' if g.most != 1 else ''} "
        f"(needs {g.needs})"
    ),
    "failed-here": lambda g: "where this launch failed lately",
    "no-weights": lambda g: _no_weights(g.detail),
}


def _no_weights(detail: str) -> str:
    kind, _, value = detail.partition(" ")
    if kind == "key":
        return (
            f"not holding {value} (a key alone cannot be fetched: place the weights on a "
            "node, or give the profile a `source`)"
        )
    return f"not holding {value} (a path is read where it is, never fetched)"


def render_group(g: RefusedNodes) -> str:
    """ "12 short of host RAM (62-90 GB free, needs 128)" """
    text = _GROUP_TEXT.get(g.reason)
    if text is None:  # a newer writer's key
        return f"{g.nodes} {g.reason}" + (f" ({g.detail})" if g.detail else "")
    return f"{g.nodes} {text(g)}"


# a GPU fault's key -> what it means for a person
_FAULT_TEXT: dict[str, Callable[[GpuNamed], str]] = {
    "ecc-uncorrected": lambda n: (
        f"{n.count} uncorrected ECC error{'s' if n.count != 1 else ''} since the driver "
        "loaded (a GPU reset clears it)"
    ),
    "row-remap-pending": lambda n: "memory rows waiting to be remapped at a GPU reset",
    "row-remap-failed": lambda n: "a memory row could not be remapped (the GPU needs service)",
    "retired-pages-pending": lambda n: "memory pages waiting to be retired at a GPU reset",
    "xid": lambda n: (
        f"{describe_xid(n.count or 0)} reported by NVML; reset the GPU, then restart its agent"
    ),
    "cordoned": lambda n: (
        f"out of service by the operator (llmgw node uncordon {n.node} --gpu {n.gpu})"
    ),
}


def render_gpu(n: GpuNamed) -> str:
    """ "GPU 3 of node05: 60 GB held by pid 4242 (python), not llmgw's" """
    where = f"GPU {n.gpu} of {n.node}"
    if n.mig_profile:
        where = f"MIG {n.mig_profile} of {where}"
    if n.why == "held":
        who = (
            "processes"
            if n.pid is None
            else f"pid {n.pid}" + (f" ({n.process})" if n.process else "")
        )
        more = f" and {n.others} more" if n.others else ""
        return f"{where}: {_gb(n.bytes)} GB held by {who}{more}, not llmgw's"
    if n.why == "shared":
        return f"{where}: " + ", ".join(_shared_parts(n))
    text = _FAULT_TEXT.get(n.why)
    return f"{where}: {text(n) if text else n.why}"


def _shared_parts(n: GpuNamed) -> list[str]:
    """ "141 GB", "60 GB allocated to 3 replicas", "65 GB held by pid 4949 (python3)" """
    parts = [f"{_gb(n.total_bytes)} GB"]
    if n.replicas:
        many = "replica" if n.replicas == 1 else "replicas"
        parts.append(f"{_gb(n.allotted_bytes)} GB allocated to {n.replicas} {many}")
    if n.bytes:
        who = "processes" if n.pid is None else f"pid {n.pid}"
        who += f" ({n.process})" if n.process and n.pid is not None else ""
        who += f" and {n.others} more" if n.others else ""
        parts.append(f"{_gb(n.bytes)} GB held by {who}")
    return parts


def _named(n: GpuNamed | None) -> str:
    return "" if n is None else f"; {render_gpu(n)}"


def _gb(n: int | None) -> str:
    return f"{max(n or 0, 0) / GB:.1f}".removesuffix(".0")


def _range(g: RefusedNodes, show) -> str:
    lo, hi = show(g.least), show(g.most)
    return lo if lo == hi else f"{lo}-{hi}"
