"""What each fabric holds: per fabric, per model, the copies and who sees them. Pure.

Per fabric because fabrics are not connected to one another: weights in ib-a are not
weights in ib-b (the only path between them is the management network), so the question
placement asks is "can this fabric serve it". One shared filer seen by twenty nodes is
one copy; a node on no fabric is its own island; a node on two fabrics counts in both.

Only what was found counts: a node that never looked and one that looked and found
nothing give the same view, or enabling the feature on one node would drain every other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.bus.records import FabricHoldings, FabricModel, HeldModel, ModelCopy, NodeInventory

ISLAND_PREFIX = "node-"


def island_name(node: str) -> str:
    return f"{ISLAND_PREFIX}{node}"


def node_fabrics(inventory: NodeInventory) -> list[str]:
    """The fabrics a node is on (adapters with a configured fabric and an active port), or
    its own island "node-<id>" when none."""
    return sorted(inventory.fabrics()) or [island_name(inventory.node)]


def node_has_model(inventory: NodeInventory, key: str) -> bool:
    """The node itself can read complete weights for `key` (on its disk or a share)."""
    return any(m.key == key for m in inventory.weights.models)


def fabric_view(inventories: Iterable[NodeInventory]) -> dict[str, FabricHoldings]:
    """fabric name -> FabricHoldings, every list sorted so an unchanged fleet gives an equal
    view. Pass the inventories of the nodes that count (the caller leaves out lost ones)."""
    members: dict[str, set[str]] = {}
    islands: set[str] = set()
    # fabric -> model key -> store identity -> (kind, bytes, nodes)
    copies: dict[str, dict[str, dict[str, tuple[str, int, set[str]]]]] = {}
    for inv in inventories:
        on = inv.fabrics()
        fabrics = sorted(on) or [island_name(inv.node)]  # node_fabrics, asked once
        if not on:
            islands.add(fabrics[0])
        for fabric in fabrics:
            members.setdefault(fabric, set()).add(inv.node)
            held = copies.setdefault(fabric, {})
            for m in inv.weights.models:
                _add_copy(held.setdefault(m.key, {}), m, inv.node)
    return {
        fabric: FabricHoldings(
            fabric=fabric,
            nodes=sorted(members[fabric]),
            models=[
                FabricModel(key=key, copies=_copies(by_store))
                for key, by_store in sorted(copies[fabric].items())
            ],
            island=fabric in islands,
        )
        for fabric in sorted(members)
    }


def _add_copy(by_store: dict[str, tuple[str, int, set[str]]], m: HeldModel, node: str) -> None:
    # a store identity is one copy however many nodes (or weights dirs on one node) see it
    kind, nbytes, nodes = by_store.get(m.store.identity, (m.store.kind, 0, set()))
    nodes.add(node)
    by_store[m.store.identity] = (kind, max(nbytes, m.bytes), nodes)


def _copies(by_store: Mapping[str, tuple[str, int, set[str]]]) -> list[ModelCopy]:
    return [
        ModelCopy(store=identity, kind=kind, bytes=nbytes, nodes=sorted(nodes))  # type: ignore[arg-type]
        for identity, (kind, nbytes, nodes) in sorted(by_store.items())
    ]


def holders_for(view: Mapping[str, FabricHoldings], fabric: str, key: str) -> list[ModelCopy]:
    """The copies of `key` in `fabric`; empty when the fabric does not hold it."""
    holdings = view.get(fabric)
    if holdings is None:
        return []
    return next((m.copies for m in holdings.models if m.key == key), [])


def fabric_has_model(view: Mapping[str, FabricHoldings], fabric: str, key: str) -> bool:
    return bool(holders_for(view, fabric, key))


def nodes_seeing(view: Mapping[str, FabricHoldings], fabric: str, key: str) -> set[str]:
    """Nodes of `fabric` that can load `key` without copying anything."""
    return {n for c in holders_for(view, fabric, key) for n in c.nodes}


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{nbytes} B"


def render_fabrics(view: Mapping[str, FabricHoldings]) -> list[str]:
    """Lines for `llmgw status`: each fabric, its nodes, and per model the copies."""
    lines: list[str] = []
    for fabric, holdings in sorted(view.items()):
        count = len(holdings.nodes)
        what = "island, no fabric" if holdings.island else f"{count} node{'s' * (count != 1)}"
        lines.append(f"{fabric} ({what})" + ("" if holdings.models else ": holds no models"))
        for model in holdings.models:
            n = len(model.copies)
            lines.append(f"  {model.key}: {n} cop{'ies' if n != 1 else 'y'}")
            for c in model.copies:
                if c.kind == "shared":
                    seen = f"seen by {len(c.nodes)} node{'s' * (len(c.nodes) != 1)}"
                    if len(c.nodes) <= 4:
                        seen += f" ({', '.join(c.nodes)})"
                    lines.append(f"    shared {c.store}  {_size(c.bytes)}  {seen}")
                else:
                    lines.append(f"    local  {', '.join(c.nodes)}  {_size(c.bytes)}")
    return lines
