"""The per-fabric weights view placement and `llmgw status` read: a pure function of inventories."""

from __future__ import annotations

from pathlib import Path

import msgspec

from llmgw.agent.discovery.weights.mounts import MountTable
from llmgw.agent.discovery.weights.scan import scan_weights
from llmgw.bus.records import (
    FabricHoldings,
    HeldModel,
    IbAdapter,
    IbPort,
    NodeInventory,
    Store,
    Weights,
    decode,
    encode,
)
from llmgw.controller.fabrics import (
    fabric_has_model,
    fabric_view,
    holders_for,
    node_fabrics,
    node_has_model,
    nodes_seeing,
    render_fabrics,
)
from llmgw.sim.bare import inventory

FILER = Store(kind="shared", identity="nfs:filer01:/export/models", fs_type="nfs")
GB = 1_000_000_000


def adapter(fabric: str | None, *, active: bool = True, name: str = "mlx5_0") -> IbAdapter:
    state = "ACTIVE" if active else "DOWN"
    return IbAdapter(
        name=name, fabric=fabric, ports=[IbPort(port=1, state=state, phys_state="LinkUp")]
    )


def held(key: str, store: Store, nbytes: int = 140 * GB) -> HeldModel:
    return HeldModel(
        key=key, format="safetensors", path=f"/m/{key}", bytes=nbytes, files=30, store=store
    )


def local(node: str) -> Store:
    return Store(kind="local", identity=f"local:{node}", fs_type="xfs")


def node(
    name: str,
    fabrics: list[str | None],
    models: list[HeldModel] = (),  # type: ignore[assignment]
    *,
    looked: bool = True,
) -> NodeInventory:
    """A node with one IB adapter per entry of `fabrics` (None: not configured)."""
    return inventory(
        name, gpus=0, fabrics=fabrics, models=models, looked=looked, address="10.0.0.1"
    )


def test_one_filer_seen_by_twenty_nodes_counts_once() -> None:
    fleet = [node(f"gpu{i:02d}", ["ib-a"], [held("llama-70b", FILER)]) for i in range(20)]
    view = fabric_view(fleet)
    assert list(view) == ["ib-a"]
    [model] = view["ib-a"].models
    assert model.key == "llama-70b"
    [copy] = model.copies
    assert (copy.store, copy.kind, copy.bytes) == (FILER.identity, "shared", 140 * GB)
    assert copy.nodes == [f"gpu{i:02d}" for i in range(20)]


def test_local_copies_count_per_node() -> None:
    view = fabric_view(
        [
            node("gpu01", ["ib-a"], [held("m", local("gpu01")), held("m", FILER)]),
            node("gpu02", ["ib-a"], [held("m", local("gpu02"))]),
            node("gpu03", ["ib-a"], [held("m", FILER)]),
        ]
    )
    copies = holders_for(view, "ib-a", "m")
    assert [(c.store, c.nodes) for c in copies] == [
        ("local:gpu01", ["gpu01"]),
        ("local:gpu02", ["gpu02"]),
        (FILER.identity, ["gpu01", "gpu03"]),
    ]
    assert nodes_seeing(view, "ib-a", "m") == {"gpu01", "gpu02", "gpu03"}


def test_weights_in_one_fabric_are_not_weights_in_another() -> None:
    view = fabric_view(
        [
            node("a1", ["ib-a"], [held("llama-70b", local("a1"))]),
            node("b1", ["ib-b"]),
            node("b2", ["ib-b"]),
        ]
    )
    assert fabric_has_model(view, "ib-a", "llama-70b")
    assert not fabric_has_model(view, "ib-b", "llama-70b")
    assert view["ib-b"].models == [] and view["ib-b"].nodes == ["b1", "b2"]


def test_a_shared_filer_seen_from_two_fabrics_lists_each_fabrics_own_nodes() -> None:
    view = fabric_view(
        [node("a1", ["ib-a"], [held("m", FILER)]), node("b1", ["ib-b"], [held("m", FILER)])]
    )
    assert [c.nodes for c in holders_for(view, "ib-a", "m")] == [["a1"]]
    assert [c.nodes for c in holders_for(view, "ib-b", "m")] == [["b1"]]


def test_node_without_fabric_is_its_own_island() -> None:
    cpu = node("cpu01", [], [held("small", local("cpu01"), GB)])
    unconfigured = node("gpu09", [None])  # an adapter whose fabric was never configured
    down = node("gpu10", ["ib-a"])
    down.ib[0].ports[0].state = "DOWN"
    view = fabric_view([cpu, unconfigured, down])
    assert sorted(view) == ["node-cpu01", "node-gpu09", "node-gpu10"]
    assert all(h.island for h in view.values())
    assert fabric_has_model(view, "node-cpu01", "small")
    assert not fabric_has_model(view, "node-gpu09", "small")
    assert node_fabrics(cpu) == ["node-cpu01"]


def test_node_on_two_fabrics_counts_in_both() -> None:
    view = fabric_view([node("gpu01", ["ib-a", "ib-b"], [held("m", local("gpu01"))])])
    assert sorted(view) == ["ib-a", "ib-b"]
    assert fabric_has_model(view, "ib-a", "m") and fabric_has_model(view, "ib-b", "m")
    assert not any(h.island for h in view.values())


def test_node_never_asked_ranks_with_node_that_found_nothing(tmp_path: Path) -> None:
    # both weights records come from real scans: one never configured, one configured with
    # an empty directory (and a half-finished download, which is not weights either)
    (tmp_path / "models" / "llama-70b").mkdir(parents=True)
    mounts = MountTable.empty()
    never = scan_weights([], tmp_path / "fetch", mounts, "gpu01", False, {}, 60.0)
    found_nothing = scan_weights(
        [tmp_path / "models"], tmp_path / "fetch", mounts, "gpu01", True, {}, 60.0
    )
    assert never.looked is False and found_nothing.looked is True

    def inventory(weights: Weights) -> NodeInventory:
        inv = node("gpu01", ["ib-a"])
        inv.weights = weights
        return inv

    a, b = inventory(never), inventory(found_nothing)
    peers = [node("gpu02", ["ib-a"], [held("other", local("gpu02"))])]
    # everything placement consumes about weights is identical
    assert fabric_view([a, *peers]) == fabric_view([b, *peers])
    for key in ("llama-70b", "other"):
        assert node_has_model(a, key) == node_has_model(b, key) is False
        assert nodes_seeing(fabric_view([a, *peers]), "ib-a", key) == nodes_seeing(
            fabric_view([b, *peers]), "ib-a", key
        )


def test_view_is_the_same_whatever_order_inventories_arrive_in() -> None:
    fleet = [
        node("gpu03", ["ib-a"], [held("m", FILER)]),
        node("gpu01", ["ib-a"], [held("z", local("gpu01")), held("m", FILER)]),
        node("gpu02", ["ib-b"]),
    ]
    assert fabric_view(fleet) == fabric_view(reversed(fleet))


def test_holdings_round_trip_through_the_bucket_encoding() -> None:
    view = fabric_view([node("gpu01", ["ib-a"], [held("m", FILER)])])
    assert decode(encode(view["ib-a"]), FabricHoldings) == view["ib-a"]
    assert msgspec.json.decode(encode(view["ib-a"]))["fabric"] == "ib-a"


def test_render_shows_each_fabric_and_its_copies() -> None:
    fleet = [node(f"gpu{i:02d}", ["ib-a"], [held("llama-70b", FILER)]) for i in range(20)]
    fleet[0].weights.models.append(held("llama-70b", local("gpu00"), 141 * GB))
    fleet.append(node("b1", ["ib-b"]))
    fleet.append(node("cpu01", []))
    lines = render_fabrics(fabric_view(fleet))
    assert lines == [
        "ib-a (20 nodes)",
        "  llama-70b: 2 copies",
        "    local  gpu00  141.0 GB",
        "    shared nfs:filer01:/export/models  140.0 GB  seen by 20 nodes",
        "ib-b (1 node): holds no models",
        "node-cpu01 (island, no fabric): holds no models",
    ]
