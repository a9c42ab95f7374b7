"""The controller's Prometheus metrics (`GET /metrics` with `--metrics-listen`).

What the fleet looks like (nodes and replicas by phase, replicas waiting and why) is read
from the controller's view of the bucket when scraped, so it costs nothing between scrapes
and is the same on every controller (graph `max` over them, or the leader's:
`llmgw_controller_leading == 1`). Passes are counted and timed by the leader that runs them.
Labels are phases, reason keys (docs/placement.md) and catalog model ids: bounded by the
catalog, never by what a client sends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.bus import records
from llmgw.fleetstate import build
from llmgw.fleetstate.decode import FleetRecords

if TYPE_CHECKING:
    from llmgw.controller.view import View

disable_created_metrics()  # `_created` series double the output and nobody graphs them

# a pass at fleet size plans in tens of ms (bench/reconcile.py); seconds mean trouble
_PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# a node the controller has not judged yet (no health.<node>): just registered, or no
# leader has run since
UNJUDGED = "unjudged"


class ControllerMetrics:
    def __init__(self, view: View, leading) -> None:
        """`leading()` says whether this controller leads now."""
        self.registry = CollectorRegistry()
        self.passes = PromCounter(
            "llmgw_controller_placement_passes",
            "Placement passes run (by the leader)",
            registry=self.registry,
        )
        self.pass_seconds = Histogram(
            "llmgw_controller_placement_pass_seconds",
            "How long a placement pass took: plan and every write it made",
            buckets=_PASS_BUCKETS,
            registry=self.registry,
        )
        self.failures = PromCounter(
            "llmgw_controller_step_failures",
            "A reconcile pass or leadership step that failed: `link` (a write or read of the "
            "bucket failed: judging stops until it answers) or `bug` (logged with its traceback)",
            ["step", "cause"],
            registry=self.registry,
        )
        for step in ("reconcile", "leadership"):
            for cause in ("link", "bug"):
                self.failures.labels(step=step, cause=cause)  # 0 before any: graphable
        self.registry.register(FleetCollector(view, leading))

    def passed(self, seconds: float) -> None:
        self.passes.inc()
        self.pass_seconds.observe(seconds)

    def failed(self, step: str, cause: str) -> None:
        self.failures.labels(step=step, cause=cause).inc()


class FleetCollector(Collector):
    """Gauges computed from the view at scrape time."""

    def __init__(self, view: View, leading) -> None:
        self._view = view
        self._leading = leading

    def collect(self) -> Iterator[GaugeMetricFamily]:
        view = self._view
        yield GaugeMetricFamily(
            "llmgw_controller_leading",
            "1 on the controller that leads (runs the passes), 0 on the others",
            value=1 if self._leading() else 0,
        )
        nodes = GaugeMetricFamily(
            "llmgw_controller_nodes",
            f"Nodes with an inventory, by phase (ready, unreachable, lost; {UNJUDGED}: not "
            "judged yet)",
            labels=["phase"],
        )
        phases = Counter(view.health[n].phase if n in view.health else UNJUDGED for n in view.nodes)
        for phase in (*records.NodePhase.__args__, UNJUDGED):  # type: ignore[attr-defined]
            nodes.add_metric([phase], phases[phase])
        yield nodes
        replicas = GaugeMetricFamily(
            "llmgw_controller_replicas", "Replicas placed, by phase", labels=["phase"]
        )
        by_phase = Counter(r.phase for r in view.replicas.values())
        for phase in records.REPLICA_PHASES:
            replicas.add_metric([phase], by_phase[phase])
        yield replicas
        yield from _unplaced(view.placements.values())
        yield _unreadable(view.unreadable.values())
        yield from shared_gpus(view)


def _unreadable(values) -> GaugeMetricFamily:
    """Keys whose newest value does not read, by family and what is read instead (kept: the
    last good value; llmgw/fleetstate/decode.py)."""
    gauge = GaugeMetricFamily(
        "llmgw_controller_unreadable_keys",
        "Keys whose newest value does not read, by family and what the controller reads "
        "instead (kept: its last good value; cordoned, frozen, absent: none was read)",
        labels=["family", "reading"],
    )
    for (family, reading), n in sorted(Counter((u.family, u.reading) for u in values).items()):
        gauge.add_metric([family, reading], n)
    return gauge


def unplaced_count(rec: records.PlacementRecord) -> int:
    """Replicas without a node: those short of desired, or the replacements (a rollout, a
    drain) the plan found no node for, which `waiting` counts, the short ones among them."""
    return max(rec.desired - rec.placed, rec.waiting, 0)


def main_reason(rec: records.PlacementRecord) -> str:
    """The one reason a model's unplaced replicas are counted under: what blocks the model,
    else the reason that refused the most nodes (ties: the first listed), else "none" (no
    node was judged: an empty fleet)."""
    if rec.blocked:
        return rec.blocked
    per_reason: Counter[str] = Counter()
    for r in rec.refused:
        per_reason[r.reason] += r.nodes
    if not per_reason:
        return "none"
    return per_reason.most_common(1)[0][0]


def _unplaced(placements) -> Iterator[GaugeMetricFamily]:
    unplaced = GaugeMetricFamily(
        "llmgw_controller_unplaced_replicas",
        "Replicas without a node, by model and the reason that refused most nodes (a "
        "blocked model: why it is blocked)",
        labels=["model", "reason"],
    )
    refused = GaugeMetricFamily(
        "llmgw_controller_refused_nodes",
        "For models with unplaced replicas, nodes refused per reason (summed over profiles)",
        labels=["model", "reason"],
    )
    for rec in sorted(placements, key=lambda r: r.model):
        count = unplaced_count(rec)
        if not count:
            continue
        unplaced.add_metric([rec.model, main_reason(rec)], count)
        per_reason: Counter[str] = Counter()
        for r in rec.refused:
            per_reason[r.reason] += r.nodes
        for reason, n in sorted(per_reason.items()):
            refused.add_metric([rec.model, reason], n)
    yield unplaced
    yield refused


# the parts of a shared GPU's memory, as `llmgw status` and the page show them
SHARED_GPU_PARTS = ("total", "allotted", "others", "left")


def shared_gpus(r: FleetRecords) -> Iterator[GaugeMetricFamily]:
    """Per GPU that shared replicas are on (share_gpus; a MIG device is one), its memory
    in parts and the replicas on it, from the fleet's read model (llmgw/fleetstate: the
    same figures as `llmgw status`); and the shared engines over their allotment. Only
    shared GPUs are series: bounded by the shared replicas, not by the fleet's GPUs."""
    memory = GaugeMetricFamily(
        "llmgw_controller_shared_gpu_bytes",
        "Memory of a GPU shared replicas are on, by part: total, allotted (their "
        "allotments, or what an engine that outgrew its holds), others (programs not "
        "llmgw's), left (what one more could be given: total - allotted - others - headroom)",
        labels=["node", "gpu", "mig_profile", "part"],
    )
    sharing = GaugeMetricFamily(
        "llmgw_controller_shared_gpu_replicas",
        "Shared replicas on a GPU (share_gpus)",
        labels=["node", "gpu", "mig_profile"],
    )
    outgrown = GaugeMetricFamily(
        "llmgw_controller_engines_outgrown",
        "Shared engines holding more of their GPU than their allotment plus the margin "
        "(their shard records say so; they are not stopped), by node and model",
        labels=["node", "model"],
    )
    held = build.gpus_held(r)
    over: Counter[tuple[str, str]] = Counter()
    for (node, uuid), allocations in sorted(held.items()):
        inv = r.nodes.get(node)
        if inv is None or not any(a.shared for a in allocations):
            continue
        device = next((g for g in inv.gpus.devices if g.uuid == uuid), None)
        if device is None:
            continue
        ops = r.ops.get(node)
        g = build.gpu_state(device, allocations, bool(ops and uuid in ops.gpus_out))
        labels = [node, uuid, g.mig_profile]
        left = g.left_bytes if g.left_bytes is not None else 0
        for part, value in zip(
            SHARED_GPU_PARTS, (g.total_bytes, g.allotted_bytes, g.foreign_bytes, left), strict=True
        ):
            memory.add_metric([*labels, part], value)
        sharing.add_metric(labels, len(g.shared))
        for a in g.shared:
            over[(node, a.model)] += a.outgrown
    for (node, model), n in sorted(over.items()):
        outgrown.add_metric([node, model], n)
    yield memory
    yield sharing
    yield outgrown
