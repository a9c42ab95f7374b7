"""Who qualifies now: the loop reports when a node starts or stops qualifying for a model
still waiting, the answer to "why was this placed an hour after it was asked for"."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.controller.placement.filters import fit
from llmgw.controller.placement.nodes import Need, NodeState, fleet_nodes
from llmgw.controller.placement.snapshot import Snapshot


def qualifying_nodes(snapshot: Snapshot, model: str, profile: str | None = None) -> set[str]:
    """Nodes that pass every filter for the model's profile (the desired one, else any of
    them) right now. The loop compares this between passes to log and publish when a
    node starts or stops qualifying for a waiting model."""
    return _qualifying(snapshot, model, profile, fleet_nodes(snapshot))


def qualifying_nodes_by_model(
    snapshot: Snapshot, models: Iterable[str], nodes: Mapping[str, NodeState] | None = None
) -> dict[str, set[str]]:
    """`qualifying_nodes` of several models with the fleet built once per call, not once per
    model: building it is O(nodes), ~45 ms at 2,000 nodes (bench/reconcile.py --waiting).
    `nodes`: that fleet, when the caller built it already (a pass builds it once for this
    and the plan; judging here only reads it)."""
    models = list(models)
    fleet = (nodes if nodes is not None else fleet_nodes(snapshot)) if models else {}
    return {m: _qualifying(snapshot, m, None, fleet) for m in models}


def _qualifying(
    snapshot: Snapshot, model: str, profile: str | None, nodes: Mapping[str, NodeState]
) -> set[str]:
    entry = snapshot.catalog.get(model)
    if entry is None or not entry.profiles:
        return set()
    desired = snapshot.desired.get(model)
    name = profile or (desired.profile if desired is not None else None)
    profiles = [entry.profile(name)] if name else entry.profiles
    out: set[str] = set()
    for p in profiles:
        if p is None:
            continue
        need = Need.of(model, p, snapshot.port_range)
        out.update(n.id for n in nodes.values() if fit(n, need) is None)  # fit only reads
    return out
