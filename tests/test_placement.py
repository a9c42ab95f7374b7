"""Placement on plain data: inventories, health and replicas as the bucket would hold them."""

from __future__ import annotations

from collections.abc import Iterable

import anyio
import msgspec
import pytest
from import_helpers import loaded
from record_helpers import shard
from waiting import until

from llmgw.bus import keys
from llmgw.bus.client import Bus, decoder
from llmgw.bus.records import (
    Desired,
    Event,
    Failure,
    Lease,
    Memory,
    NodeInventory,
    NodeOps,
    PlacementRecord,
    RefusedNodes,
    Replica,
    ReplicaMember,
    Shard,
    decode,
)
from llmgw.catalog import Model, encode_model, launch_hash, validate_models
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.controller.placement import (
    Snapshot,
    plan,
    qualifying_nodes,
    remove_surplus,
    replace_lost,
    same_decision,
)
from llmgw.controller.placement.rollout import Outdated, roll
from llmgw.sim.bare import SimNode, inventory

GB = 1_000_000_000
GIB = 1 << 30
KEY = "org/model"


def node(
    name: str,
    *,
    gpus: int = 8,
    gpu_gb: float = 85.5,
    ram_gb: float = 1000,
    engines: Iterable[str] = ("vllm", "llama-server"),
    fabric: str | None = None,
    held: Iterable[tuple[str, str]] = (),  # (model key, store identity)
    looked: bool = True,
) -> NodeInventory:
    """An 8x H100 node by default, as its agent would report it."""
    return inventory(
        name,
        gpus=gpus,
        gpu_gb=gpu_gb,
        ram_gb=ram_gb,
        engines=engines,
        fabric=fabric,
        held=held,
        looked=looked,
        started_at=0.0,
    )


def model(
    mid: str = "m",
    *,
    engine: str = "vllm",
    gpus: int = 1,
    gpu_gb: float = 0,
    ram_gb: float = 0,
    nodes: int = 1,
    key: str = KEY,
    weights: dict | None = None,
) -> Model:
    profile = {
        "name": "p",
        "engine": engine,
        "weights": weights or {"key": key},
        "gpus_per_node": gpus,
        "gpu_memory_gb": gpu_gb,
        "host_ram_gb": ram_gb,
        "nodes": nodes,
    }
    return validate_models({"models": [{"id": mid, "profiles": [profile]}]})[0]


def two_profiles(key: str = KEY) -> Model:
    """Model m with profile p (1 GPU) and profile q (2 GPUs), the same weights."""
    profiles = [
        {"name": name, "engine": "vllm", "weights": {"key": key}, "gpus_per_node": gpus}
        for name, gpus in (("p", 1), ("q", 2))
    ]
    return validate_models({"models": [{"id": "m", "profiles": profiles}]})[0]


def replica(
    rid: str,
    members: list[tuple[str, list[int]]],
    *,
    mid: str = "m",
    phase: str = "ready",
    created_at: float = 0.0,
    port: int = 18000,
) -> Replica:
    return Replica(
        model=mid,
        rid=rid,
        profile="p",
        members=[
            ReplicaMember(node=n, rank=i, gpus=[f"GPU-{n}-{g:02d}" for g in gpu_ids], port=port)
            for i, (n, gpu_ids) in enumerate(members)
        ],
        phase=phase,
        created_at=created_at,
    )


def snapshot(
    nodes: list[NodeInventory],
    models: list[Model],
    desired: dict[str, int],
    *,
    replicas: Iterable[Replica] = (),
    health: dict[str, str] | None = None,
    **extra,
) -> Snapshot:
    phases = {n.node: "ready" for n in nodes}
    phases.update(health or {})
    return Snapshot(
        catalog={m.id: m for m in models},
        desired={mid: Desired(model=mid, replicas=n) for mid, n in desired.items()},
        inventories={n.node: n for n in nodes},
        health=phases,
        replicas=list(replicas),
        now=1000.0,
        **extra,
    )


def placed_on(result) -> list[list[str]]:
    return [[m.node for m in r.members] for r in result.create]


# --- weights: a preference, never a filter ---------------------------------------------


def test_weights_on_node_beat_weights_in_fabric_beat_none():
    nodes = [
        node("a-none", fabric="ib-b"),
        node("b-fabric", fabric="ib-a"),
        node("c-holder", fabric="ib-a", held=[(KEY, "local:c-holder")]),
    ]
    result = plan(snapshot(nodes, [model()], {"m": 1}))
    assert placed_on(result) == [["c-holder"]]
    assert result.create[0].reason.startswith("weights on node (local:c-holder)")

    # the holder is full: the node in the holder's fabric beats the node in another fabric
    full = replica("r-full", [("c-holder", list(range(8)))], mid="other")
    result = plan(snapshot(nodes, [model()], {"m": 1}, replicas=[full]))
    assert placed_on(result) == [["b-fabric"]]
    assert result.create[0].reason.startswith("weights elsewhere in fabric ib-a")


def test_weights_on_a_share_the_node_sees_count_as_on_the_node():
    nodes = [node("a", fabric="ib-a"), node("b", fabric="ib-a", held=[(KEY, "nfs:filer:/m")])]
    result = plan(snapshot(nodes, [model()], {"m": 1}))
    assert placed_on(result) == [["b"]]
    assert result.create[0].reason.startswith("weights on a share the node sees (nfs:filer:/m)")


def test_no_holder_anywhere_still_places():
    nodes = [node("n1", fabric="ib-a"), node("n2")]
    result = plan(snapshot(nodes, [model(key="nobody/has-this")], {"m": 2}))
    assert placed_on(result) == [["n1"], ["n1"]]
    assert result.placements["m"].placed == 2
    assert result.placements["m"].explanation == ""
    assert result.create[0].reason.startswith(
        "no copy of the weights nearby (the engine fetches nobody/has-this)"
    )


def test_node_never_asked_ranks_with_node_that_found_nothing():
    # whichever of the two never looked, the choice is the same: the tie-break by id
    for never_looked in ("n1", "n2"):
        nodes = [node(n, looked=(n != never_looked)) for n in ("n2", "n1")]
        result = plan(snapshot(nodes, [model()], {"m": 1}))
        assert placed_on(result) == [["n1"]], never_looked


# --- GPUs, RAM, ports --------------------------------------------------------------------


def test_gpu_accounting_across_replicas_in_snapshot_and_in_the_same_plan():
    nodes = [node("n1"), node("n2", gpus=2)]
    other = replica("r-other", [("n1", [0, 1, 2, 3])], mid="other")
    result = plan(snapshot(nodes, [model(gpus=4)], {"m": 2}, replicas=[other]))
    assert placed_on(result) == [["n1"]]
    (member,) = result.create[0].members
    assert member.gpus == ["GPU-n1-04", "GPU-n1-05", "GPU-n1-06", "GPU-n1-07"]
    record = result.placements["m"]
    assert (record.desired, record.placed) == (2, 1)
    assert record.explanation == "0/2 nodes fit: 2 short of free GPUs (0-2 free, needs 4)"
    assert record.refused == [
        RefusedNodes(profile="p", reason="gpus", nodes=2, needs=4, least=0, most=2)
    ]


def test_gpu_memory_too_small_refuses_node():
    nodes = [node("small", gpu_gb=24), node("big", gpus=2, gpu_gb=85.5)]
    result = plan(snapshot(nodes, [model(gpus=4, gpu_gb=80)], {"m": 1}))
    assert result.create == []
    assert result.placements["m"].explanation == (
        "0/2 nodes fit: 1 with GPUs too small (24 GB, needs 80), "
        "1 short of free GPUs (2 free, needs 4)"
    )
    assert [(g.reason, g.nodes) for g in result.placements["m"].refused] == [
        ("gpu-memory", 1),
        ("gpus", 1),
    ]


# a failed one's engine is down until its agent restarts it there: its RAM shows in
# MemAvailable, and placing on it would leave the restarted engine without it
@pytest.mark.parametrize("phase", ["placed", "starting", "failed"])
def test_ram_of_replicas_whose_engine_is_not_running_yet_or_again_is_reserved(phase):
    nodes = [node("n1", ram_gb=100)]
    big = model(gpus=1, ram_gb=64)
    waiting = replica("r-old", [("n1", [0])], phase=phase)
    result = plan(snapshot(nodes, [big], {"m": 2}, replicas=[waiting]))
    assert result.create == []
    assert result.placements["m"].explanation == (
        "0/1 nodes fit: 1 short of host RAM (36 GB free, needs 64)"
    )


def test_ram_of_a_running_replica_is_not_subtracted_twice():
    # once running, its RAM is already out of MemAvailable
    nodes = [node("n1", ram_gb=100)]
    running = replica("r-old", [("n1", [0])], phase="ready")
    result = plan(snapshot(nodes, [model(gpus=1, ram_gb=64)], {"m": 2}, replicas=[running]))
    assert placed_on(result) == [["n1"]]


def test_lease_ram_is_fresher_than_inventory():
    nodes = [node("n1", ram_gb=10)]
    lease = Lease(
        node="n1",
        seq=5,
        time=0.0,
        started_at=0.0,
        memory=Memory(total_bytes=1, available_bytes=200 * GB),
    )
    result = plan(snapshot(nodes, [model(ram_gb=64)], {"m": 1}, leases={"n1": lease}))
    assert placed_on(result) == [["n1"]]


def test_ports_are_not_shared_on_a_node_and_run_out():
    nodes = [node("n1")]
    existing = replica("r-old", [("n1", [0])], port=18000)
    result = plan(snapshot(nodes, [model()], {"m": 3}, replicas=[existing]))
    assert [r.members[0].port for r in result.create] == [18001, 18002]

    result = plan(
        snapshot(nodes, [model()], {"m": 2}, replicas=[existing], port_range=(18000, 18000))
    )
    assert result.placements["m"].explanation == (
        "0/1 nodes fit: 1 with no free port in 18000-18000"
    )


def test_cpu_profile_prefers_node_without_gpus():
    nodes = [node("a-gpu"), node("b-cpu", gpus=0)]
    result = plan(snapshot(nodes, [model(engine="llama-server", gpus=0)], {"m": 1}))
    assert placed_on(result) == [["b-cpu"]]


# --- scores: packing and ties ------------------------------------------------------------


def test_packing_fills_partly_used_node_before_empty_one():
    nodes = [node("a-empty"), node("b-half")]
    half = replica("r-half", [("b-half", [0, 1, 2, 3])], mid="other")
    result = plan(snapshot(nodes, [model(gpus=2)], {"m": 1}, replicas=[half]))
    assert placed_on(result) == [["b-half"]]
    assert result.create[0].reason.endswith("packs node with 4 of 8 GPUs used")


def test_ties_break_by_node_id_and_plan_is_deterministic():
    names = ["n3", "n1", "n2"]
    first = plan(snapshot([node(n) for n in names], [model(gpus=8)], {"m": 2}))
    again = plan(snapshot([node(n) for n in reversed(names)], [model(gpus=8)], {"m": 2}))
    assert placed_on(first) == [["n1"], ["n2"]]
    assert first == again


def test_new_rids_never_reuse_one_in_use():
    nodes = [node("n1")]
    # the rids this very snapshot would give its first three new replicas...
    first = plan(snapshot(nodes, [model()], {"m": 3}))
    would_be = [r.rid for r in first.create]
    # ...are in use already: the next three must be others
    existing = [replica(rid, [("n1", [i])], port=18000 + i) for i, rid in enumerate(would_be)]
    result = plan(snapshot(nodes, [model()], {"m": 6}, replicas=existing))
    rids = [r.rid for r in result.create]
    assert len(set(rids)) == 3
    assert not set(rids) & set(would_be)


# --- stability, lost nodes, surplus -------------------------------------------------------


def test_placed_replica_does_not_move_when_better_node_appears():
    nodes = [node("n1"), node("n2", held=[(KEY, "local:n2")])]
    running = replica("r1", [("n1", [0])])
    result = plan(snapshot(nodes, [model()], {"m": 1}, replicas=[running]))
    assert (result.create, result.remove) == ([], [])
    assert result.placements["m"].decisions == ["keep r1 on n1 (ready)"]


def test_lost_node_replica_is_replaced_elsewhere():
    nodes = [node("n1"), node("n2")]
    running = replica("r1", [("n1", [0])])
    result = plan(snapshot(nodes, [model()], {"m": 1}, replicas=[running], health={"n1": "lost"}))
    assert [(r.rid, r.reason) for r in result.remove] == [("r1", "node n1 is lost; replaced")]
    assert placed_on(result) == [["n2"]]
    assert result.placements["m"].placed == 1


def test_unreachable_node_replica_is_kept_but_gets_nothing_new():
    nodes = [node("n1"), node("n2")]
    running = replica("r1", [("n1", [0])])
    snap = snapshot(nodes, [model()], {"m": 2}, replicas=[running], health={"n1": "unreachable"})
    result = plan(snap)
    assert result.remove == []
    assert placed_on(result) == [["n2"]]


def test_multi_node_replica_with_one_lost_member_is_replaced_whole():
    nodes = [node(n, fabric="ib-a") for n in ("n1", "n2", "n3")]
    running = replica("r1", [("n1", list(range(8))), ("n2", list(range(8)))])
    snap = snapshot(
        nodes, [model(gpus=8, nodes=2)], {"m": 1}, replicas=[running], health={"n2": "lost"}
    )
    result = plan(snap)
    assert [r.rid for r in result.remove] == ["r1"]
    # n1 still holds r1's GPUs until it has drained, so no room for a new pair yet
    assert result.create == []


def test_surplus_replicas_are_removed_newest_first():
    nodes = [node("n1")]
    running = [
        replica(f"r{i}", [("n1", [i])], created_at=float(i), port=18000 + i) for i in range(4)
    ]
    result = plan(snapshot(nodes, [model()], {"m": 2}, replicas=running))
    assert [(r.rid, r.reason) for r in result.remove] == [
        ("r3", "desired lowered to 2"),
        ("r2", "desired lowered to 2"),
    ]
    assert result.placements["m"].placed == 2


def test_desired_zero_drains_everything():
    nodes = [node("n1")]
    running = [
        replica(f"r{i}", [("n1", [i])], created_at=float(i), port=18000 + i) for i in range(2)
    ]
    result = plan(snapshot(nodes, [model()], {"m": 0}, replicas=running))
    assert [(r.rid, r.reason) for r in result.remove] == [
        ("r1", "desired is 0: draining"),
        ("r0", "desired is 0: draining"),
    ]
    assert result.create == []


def test_draining_replicas_hold_gpus_but_do_not_count():
    nodes = [node("n1", gpus=2)]
    draining = replica("r-old", [("n1", [0, 1])], phase="draining")
    result = plan(snapshot(nodes, [model(gpus=2)], {"m": 1}, replicas=[draining]))
    assert result.remove == [] and result.create == []
    assert result.placements["m"].explanation == (
        "0/1 nodes fit: 1 short of free GPUs (0 free, needs 2)"
    )


def test_model_removed_from_catalog_has_its_replicas_removed():
    nodes = [node("n1")]
    running = replica("r1", [("n1", [0])], mid="gone")
    result = plan(snapshot(nodes, [], {"gone": 1}, replicas=[running]))
    assert [(r.rid, r.reason) for r in result.remove] == [
        ("r1", "model 'gone' is not in the catalog")
    ]
    assert result.placements["gone"].explanation == "model 'gone' is not in the catalog"


# --- explanations ---------------------------------------------------------------------------


def test_explanation_counts_nodes_per_reason_exactly():
    nodes = [
        node("l1"),
        node("l2"),
        node("l3"),
        node("v1", engines=["llama-server"]),
        node("v2", engines=[]),
        node("busy"),
    ]
    busy = replica("r-busy", [("busy", [0, 1, 2, 3, 4, 5])], mid="other")
    health = {"l1": "lost", "l2": "lost", "l3": "lost"}
    result = plan(snapshot(nodes, [model(gpus=4)], {"m": 1}, replicas=[busy], health=health))
    record = result.placements["m"]
    assert record.explanation == (
        "0/6 nodes fit: 3 lost, 2 no vllm, 1 short of free GPUs (2 free, needs 4)"
    )
    assert record.judged == 6
    assert [(g.reason, g.nodes, g.detail) for g in record.refused] == [
        ("lost", 3, ""),
        ("no-engine", 2, "vllm"),
        ("gpus", 1, ""),
    ]
    assert record.decisions[-1] == "1 replica not placed: " + record.explanation


def _short_of_ram(free_gb: list[float], *, lost: int = 0) -> PlacementRecord:
    nodes = [node(f"n{i:02d}", ram_gb=gb) for i, gb in enumerate(free_gb)]
    nodes += [node(f"x{i}") for i in range(lost)]
    health = {f"x{i}": "lost" for i in range(lost)}
    return plan(snapshot(nodes, [model(ram_gb=128)], {"m": 1}, health=health)).placements["m"]


def test_nodes_refused_for_one_reason_are_one_clause_with_the_range():
    free = [62, 90, 64.5, 66, 70.25, 71, 75, 79.5, 80, 84, 88, 89.75]
    record = _short_of_ram(free, lost=2)
    assert record.explanation == (
        "0/14 nodes fit: 12 short of host RAM (62-90 GB free, needs 128), 2 lost"
    )
    ram = record.refused[0]
    assert (ram.reason, ram.nodes, ram.needs, ram.least, ram.most) == (
        "ram",
        12,
        128 * GB,
        62 * GB,
        90 * GB,
    )


def test_free_ram_moving_is_not_a_new_decision_but_a_lost_node_is():
    before = _short_of_ram([62, 70, 90])
    wobbled = _short_of_ram([61.9, 70.3, 90.1])
    assert wobbled.explanation != before.explanation  # the text shows what was seen...
    assert same_decision(before, wobbled)  # ...the decision did not change
    assert not same_decision(before, _short_of_ram([62, 70, 90], lost=1))
    assert not same_decision(before, _short_of_ram([62, 70]))
    assert not same_decision(before, _short_of_ram([62, 70, 128]))  # one fits now


def test_weights_by_path_are_never_said_to_be_fetched():
    by_path = model(weights={"path": "/srv/models/x"})
    result = plan(snapshot([node("n1")], [by_path], {"m": 1}))
    why = result.create[0].reason
    assert why.startswith("weights path /srv/models/x not reported by this node")
    assert "fetch" not in why
    by_source = model(weights={"source": "hf://org/y"})
    why = plan(snapshot([node("n1")], [by_source], {"m": 1})).create[0].reason
    assert why.startswith("no copy of the weights nearby (the engine fetches hf://org/y)")


def test_each_step_decides_one_thing():
    a = replica("ra", [("n1", [0])], created_at=1.0)
    b = replica("rb", [("n2", [0])], created_at=2.0)
    c = replica("rc", [("n1", [1])], created_at=3.0)
    snap = snapshot([node("n1"), node("n2")], [model()], {"m": 1}, health={"n2": "lost"})

    lost = replace_lost(snap, [a, b, c])
    assert [r.rid for r in lost.kept] == ["ra", "rc"]
    assert [(r.rid, why) for r, why in lost.removed] == [("rb", "node n2 is lost; replaced")]

    surplus = remove_surplus(lost.kept, 1)
    assert [r.rid for r in surplus.kept] == ["ra"]
    assert [(r.rid, why) for r, why in surplus.removed] == [("rc", "desired lowered to 1")]

    # an old profile's replica stays until its replacement is ready
    old = [Outdated(a, "revision", "replaced by profile q")]
    starting = replica("rn", [("n1", [2])], phase="starting")
    assert roll(old, [starting], 1, 1, 0, stopped=False).old == [a]
    ready = replica("rn", [("n1", [2])], phase="ready")
    assert roll(old, [ready], 1, 1, 0, stopped=False).removed == [(a, "replaced by profile q")]


def test_node_without_lease_is_not_a_candidate():
    nodes = [node("n1")]
    snap = snapshot(nodes, [model()], {"m": 1})
    snap = Snapshot(**{**snap.__dict__, "health": {}})
    assert plan(snap).placements["m"].explanation == "0/1 nodes fit: 1 with no lease seen"


def test_fallback_profile_is_used_when_the_first_fits_nowhere():
    two = validate_models(
        {
            "models": [
                {
                    "id": "m",
                    "profiles": [
                        {
                            "name": "gpu",
                            "engine": "vllm",
                            "weights": {"key": KEY},
                            "gpus_per_node": 1,
                        },
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"key": KEY},
                            "gpus_per_node": 0,
                        },
                    ],
                }
            ]
        }
    )
    result = plan(snapshot([node("n1", gpus=0)], two, {"m": 1}))
    assert [r.profile for r in result.create] == ["cpu"]

    result = plan(snapshot([node("n1", gpus=0, engines=[])], two, {"m": 1}))
    assert result.placements["m"].explanation == (
        "profile gpu: 0/1 nodes fit: 1 no vllm; profile cpu: 0/1 nodes fit: 1 no llama-server"
    )
    assert [(g.profile, g.reason, g.detail) for g in result.placements["m"].refused] == [
        ("gpu", "no-engine", "vllm"),
        ("cpu", "no-engine", "llama-server"),
    ]


# --- multi-node ---------------------------------------------------------------------------


def test_multi_node_replica_stays_within_one_fabric():
    nodes = [
        node("a1", fabric="ib-a"),
        node("b1", fabric="ib-b"),
        node("b2", fabric="ib-b"),
        node("x1"),
    ]
    result = plan(snapshot(nodes, [model(gpus=4, nodes=2)], {"m": 1}))
    (created,) = result.create
    assert [(m.node, m.rank, len(m.gpus), m.port) for m in created.members] == [
        ("b1", 0, 4, 18000),
        ("b2", 1, 4, 18000),
    ]
    assert created.reason.startswith("2 nodes in fabric ib-b; rank 0:")


def test_multi_node_prefers_fabric_holding_the_weights():
    nodes = [
        node("a1", fabric="ib-a"),
        node("a2", fabric="ib-a"),
        node("b1", fabric="ib-b"),
        node("b2", fabric="ib-b", held=[(KEY, "local:b2")]),
    ]
    result = plan(snapshot(nodes, [model(gpus=8, nodes=2)], {"m": 1}))
    # rank 0 is the best node: the one holding the weights
    assert placed_on(result) == [["b2", "b1"]]


def test_multi_node_explains_fabrics_too_small():
    nodes = [node("a1", fabric="ib-a"), node("b1", fabric="ib-b"), node("x1")]
    result = plan(snapshot(nodes, [model(gpus=8, nodes=2)], {"m": 1}))
    assert result.create == []
    assert result.placements["m"].explanation == (
        "0/3 nodes fit: 1 not on an active IB fabric, 1 on ib-a, which has 1 fitting node "
        "(needs 2), 1 on ib-b, which has 1 fitting node (needs 2)"
    )


# --- qualifying nodes ---------------------------------------------------------------------


def test_qualifying_nodes_follow_engines_and_ram():
    nodes = [node("n1", engines=[]), node("n2", ram_gb=10), node("n3")]
    snap = snapshot(nodes, [model(ram_gb=64)], {"m": 1})
    assert qualifying_nodes(snap, "m") == {"n3"}
    nodes[0] = node("n1")  # vllm got installed on n1
    assert qualifying_nodes(snapshot(nodes, [model(ram_gb=64)], {"m": 1}), "m") == {"n1", "n3"}


def test_fabric_view_share_seen_by_a_node_that_did_not_scan_it_counts_on_that_node():
    from llmgw.bus.records import FabricHoldings, FabricModel, ModelCopy

    nodes = [node("a", fabric="ib-a"), node("b", fabric="ib-a"), node("c", fabric="ib-a")]
    copy = ModelCopy(store="nfs:filer:/m", kind="shared", bytes=1, nodes=["c"])
    view = {
        "ib-a": FabricHoldings(
            fabric="ib-a", nodes=["a", "b", "c"], models=[FabricModel(key=KEY, copies=[copy])]
        )
    }
    result = plan(snapshot(nodes, [model()], {"m": 1}, fabrics=view))
    assert placed_on(result) == [["c"]]


def test_profile_switch_keeps_old_replica_until_new_profile_is_ready():
    two = [two_profiles()]
    nodes = [node("n1")]
    old = replica("r-old", [("n1", [0])])
    switch = Desired(model="m", replicas=1, profile="q")
    snap = snapshot(nodes, two, {}, replicas=[old])
    snap = Snapshot(**{**snap.__dict__, "desired": {"m": switch}})
    result = plan(snap)
    assert [r.profile for r in result.create] == ["q"]
    assert result.remove == []

    new = Replica(**{**msgspec.structs.asdict(result.create[0]), "phase": "ready"})
    snap = Snapshot(**{**snap.__dict__, "replicas": [old, new]})
    result = plan(snap)
    assert result.create == []
    assert [(r.rid, r.reason) for r in result.remove] == [("r-old", "replaced by profile q")]


# --- through the real controller loop -------------------------------------------------------


@pytest.mark.anyio
async def test_waiting_models_record_and_events_stay_still_while_free_ram_wobbles(
    bus, nats_settings
):
    events: list[Event] = []

    async def on_event(msg) -> None:
        events.append(decode(msg.data, Event))

    await bus.subscribe("llmgw.events.>", on_event)
    sims = [
        SimNode(bus, inventory(f"vm{i}", gpus=0, ram_gib=60 + 10 * i, engines=("llama-server",)))
        for i in range(3)
    ]
    big = model(engine="llama-server", gpus=0, ram_gb=128)
    await bus.put(keys.catalog("m"), encode_model(big))
    await bus.put(keys.desired("m"), Desired(model="m", replicas=1, updated_at=1.0))
    settings = ControllerSettings(
        unreachable_after=10, lost_after=30, leader_ttl=1, tick=0.05, resync=0.2
    )
    controller_bus = await Bus.connect(nats_settings, give_up_after=5)
    controller = Controller(controller_bus, settings)
    try:
        async with anyio.create_task_group() as tg:
            for sim in sims:
                await sim.register()
                tg.start_soon(sim.run)
            tg.start_soon(controller.run)

            async def explained():
                e = await bus.get(keys.placement("m"), decoder(PlacementRecord))
                return e if e and "short of host RAM" in e.value.explanation else None

            first = await until(explained)
            assert first.value.explanation.startswith("0/3 nodes fit: 3 short of host RAM (")
            unplaced = sum(1 for e in events if e.kind == "unplaced")

            for wobble in (0.3, -0.2, 0.7, 0.1):  # GiB, as MemAvailable moves on a busy host
                for i, sim in enumerate(sims):
                    free = int((60 + 10 * i + wobble) * GIB)
                    sim.inv = msgspec.structs.replace(
                        sim.inv,
                        memory=Memory(total_bytes=sim.inv.memory.total_bytes, available_bytes=free),
                    )
                    await sim.beat()  # the lease carries it, as an agent's heartbeat does

                async def seen(node=sims[-1].node, free=free):
                    lease = controller.view.leases.get(node)
                    return lease is not None and lease.memory.available_bytes == free

                await until(seen)
                # two passes started after the controller saw it: the first one has ended
                passes = controller.passes
                await until(lambda passes=passes: _true(controller.passes >= passes + 2))

            now = await bus.get(keys.placement("m"), decoder(PlacementRecord))
            assert now.revision == first.revision, now.value.explanation
            # (its log line and its event are said together, from one table: changes.py)
            assert sum(1 for e in events if e.kind == "unplaced") == unplaced
            tg.cancel_scope.cancel()
    finally:
        await controller_bus.close()


async def _true(value: bool) -> bool:
    return value


def test_placement_imports_nothing_that_does_io():
    io = ("llmgw.bus.client", "llmgw.controller.loop", "llmgw.controller.view")
    assert (
        loaded("llmgw.controller.placement", packages=("nats", "anyio", "asyncio"), modules=io)
        == []
    )


# --- records bounded by construction ----------------------------------------------------------


def test_a_model_of_thousands_of_replicas_over_many_profiles_makes_a_small_record():
    """8,000 replicas once made a 1.11 MB placement record, over the bucket's value limit:
    every pass then failed writing it. Lines per replica stop at a bound (each replica's own
    key says the rest), and so does the text; with the catalog's 64 profiles, refusals
    are a line per profile and reason."""
    from llmgw.bus.bucket import MAX_VALUE_BYTES
    from llmgw.bus.records import encode
    from llmgw.catalog import MAX_PROFILES
    from llmgw.controller.placement.record import MAX_DECISION_LINES

    nodes = [
        node(f"node-{i:04d}-rack-{i % 40:02d}-example-cluster", gpus=4, fabric=f"ib-{i % 7}")
        for i in range(300)
    ]
    profiles = [
        {
            "name": f"profile-{p:02d}",
            "engine": "vllm",
            "weights": {"key": KEY},
            "gpus_per_node": 1 + p % 8,
            "gpu_memory_gb": 40 + p,
            "nodes": 1 + p % 3,
        }
        for p in range(MAX_PROFILES)
    ]
    (big,) = validate_models({"models": [{"id": "m", "profiles": profiles}]})
    result = plan(snapshot(nodes, [big], {"m": 10_000}))
    rec = result.placements["m"]
    assert rec.placed < rec.desired == 10_000 and len(result.create) > MAX_DECISION_LINES
    assert len(rec.decisions) <= MAX_DECISION_LINES + 1
    assert "more (each replica's own key" in rec.decisions[MAX_DECISION_LINES - 1]
    assert len(encode(rec)) < MAX_VALUE_BYTES / 10


# --- the operator's intent: cordon, drain, GPUs out of service, taints ------------------------


def _ops(**by_node: dict) -> dict[str, NodeOps]:
    return {n: NodeOps(node=n, **fields) for n, fields in by_node.items()}


def _with(snap: Snapshot, **fields) -> Snapshot:
    return Snapshot(**{**snap.__dict__, **fields})


def test_cordoned_and_draining_nodes_take_nothing_new_and_are_counted_by_name():
    nodes = [node("n1"), node("n2"), node("n3"), node("n4")]
    ops = _ops(n1={"state": "cordoned"}, n2={"state": "cordoned"}, n3={"state": "draining"})
    result = plan(_with(snapshot(nodes, [model()], {"m": 1}), ops=ops))
    assert placed_on(result) == [["n4"]]
    ops["n4"] = NodeOps(node="n4", state="cordoned")
    result = plan(_with(snapshot(nodes, [model()], {"m": 1}), ops=ops))
    assert result.create == []
    assert result.placements["m"].explanation == "0/4 nodes fit: 3 cordoned, 1 draining"


def test_a_cordoned_node_keeps_its_replicas():
    running = replica("r1", [("n1", [0])])
    snap = _with(
        snapshot([node("n1"), node("n2")], [model()], {"m": 1}, replicas=[running]),
        ops=_ops(n1={"state": "cordoned"}),
    )
    result = plan(snap)
    assert result.create == [] and result.remove == []


def test_a_gpu_out_of_service_is_given_to_no_new_replica():
    nodes = [node("n1", gpus=2)]
    ops = _ops(n1={"gpus_out": ["GPU-n1-00"]})
    result = plan(_with(snapshot(nodes, [model()], {"m": 2}), ops=ops))
    assert [m.gpus for r in result.create for m in r.members] == [["GPU-n1-01"]]
    # the explanation names the GPU and how it comes back
    assert result.placements["m"].explanation == (
        "0/1 nodes fit: 1 short of healthy free GPUs (0 usable, needs 1; GPU 0 of n1: out of "
        "service by the operator (llmgw node uncordon n1 --gpu 0))"
    )


# --- labels, selectors, taints ------------------------------------------------------------------


def _selecting(selector: dict | None = None, tolerations: list | None = None) -> Model:
    profile = {"name": "p", "engine": "vllm", "weights": {"key": KEY}, "gpus_per_node": 1}
    if selector is not None:
        profile["node_selector"] = selector
    if tolerations is not None:
        profile["tolerations"] = tolerations
    return validate_models({"models": [{"id": "m", "profiles": [profile]}]})[0]


def _labelled(name: str, labels: dict | None = None, taints: list | None = None) -> NodeInventory:
    return msgspec.structs.replace(node(name), labels=labels or {}, taints=taints or [])


def test_a_selector_places_only_on_nodes_with_the_labels_and_counts_the_rest():
    nodes = [
        _labelled("n1", {"pool": "research"}),
        _labelled("n2", {"pool": "prod"}),
        _labelled("n3"),
        _labelled("n4"),
    ]
    result = plan(snapshot(nodes, [_selecting({"pool": "research"})], {"m": 1}))
    assert placed_on(result) == [["n1"]]
    result = plan(snapshot(nodes[1:], [_selecting({"pool": "research"})], {"m": 1}))
    assert result.placements["m"].explanation == "0/3 nodes fit: 3 lack pool=research"


def test_a_selector_on_discovered_labels_and_an_exclusion():
    nodes = [node("n1"), node("n2")]  # NVIDIA H100 80GB HBM3, 8 of them, vllm and llama-server
    h100 = _selecting({"gpu.model": "H100-80GB-HBM3", "gpu.count": "8", "engine": "vllm"})
    assert len(plan(snapshot(nodes, [h100], {"m": 1})).create) == 1
    a100 = _selecting({"gpu.model": "A100-SXM4-80GB"})
    expl = plan(snapshot(nodes, [a100], {"m": 1})).placements["m"].explanation
    assert expl == "0/2 nodes fit: 2 lack gpu.model=A100-SXM4-80GB"
    never_n1 = _selecting({"node": "!n1"})
    result = plan(snapshot(nodes, [never_n1], {"m": 3}))
    assert {n for on in placed_on(result) for n in on} == {"n2"}
    result = plan(snapshot(nodes[:1], [never_n1], {"m": 1}))
    assert result.placements["m"].explanation == "0/1 nodes fit: 1 excluded (node=n1)"


def test_a_taint_keeps_away_what_does_not_tolerate_it_from_the_agent_or_the_operator():
    nodes = [_labelled("n1", taints=["gpu-flaky"]), _labelled("n2")]
    ops = _ops(n2={"taints": ["gpu-flaky"]})
    result = plan(_with(snapshot(nodes, [_selecting()], {"m": 1}), ops=ops))
    assert result.placements["m"].explanation == "0/2 nodes fit: 2 tainted gpu-flaky"
    tolerant = _selecting(tolerations=["gpu-flaky"])
    assert len(plan(_with(snapshot(nodes, [tolerant], {"m": 1}), ops=ops)).create) == 1


def test_labels_the_agent_config_sets_win_over_discovered_ones():
    from llmgw.labels import node_labels

    inv = _labelled("n1", {"gpu.count": "4", "rack": "r12"})
    labels = node_labels(inv)
    assert labels["gpu.count"] == {"4"} and labels["rack"] == {"r12"}
    assert labels["gpu.model"] == {"H100-80GB-HBM3"} and labels["engine"] == {
        "vllm",
        "llama-server",
    }


# --- rollouts ---------------------------------------------------------------------------------


def _rolling(*, surge: int = 1, max_unavailable: int = 0, **changes) -> Model:
    profile = {"name": "p", "engine": "vllm", "weights": {"key": KEY}, "gpus_per_node": 1}
    profile.update(changes)
    return validate_models(
        {
            "models": [
                {
                    "id": "m",
                    "profiles": [profile],
                    "surge": surge,
                    "max_unavailable": max_unavailable,
                }
            ]
        }
    )[0]


def _running(m: Model, *rids: str, phase: str = "ready", nodes_: tuple = ("n1", "n2", "n3")):
    launch = launch_hash(m, m.profiles[0])
    return [
        msgspec.structs.replace(
            replica(rid, [(nodes_[i % len(nodes_)], [i])], phase=phase, created_at=float(i)),
            launch=launch,
        )
        for i, rid in enumerate(rids)
    ]


def _fleet() -> list[NodeInventory]:
    return [node("n1"), node("n2"), node("n3")]


def test_a_changed_launch_is_replaced_one_at_a_time_a_new_one_ready_before_an_old_drains():
    before = _rolling()
    after = _rolling(env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    old = _running(before, "r1", "r2", "r3")
    result = plan(snapshot(_fleet(), [after], {"m": 3}, replicas=old))
    assert len(result.create) == 1 and result.remove == []
    assert result.create[0].launch == launch_hash(after, after.profiles[0])
    assert result.rollouts["m"].phase == "progressing" and result.rollouts["m"].old == 3

    starting = result.create[0]  # not ready yet: nothing drains, nothing more starts
    result = plan(snapshot(_fleet(), [after], {"m": 3}, replicas=[*old, starting]))
    assert result.create == [] and result.remove == []

    ready = msgspec.structs.replace(starting, phase="ready")
    result = plan(snapshot(_fleet(), [after], {"m": 3}, replicas=[*old, ready]))
    assert result.create == []
    [gone] = result.remove
    assert gone.reason.startswith("profile p changed (launch ")
    assert result.placements["m"].placed == 3  # four running, one of them draining


def test_surge_and_max_unavailable_set_how_many_go_at_once():
    before, after = _rolling(), _rolling(surge=2, max_unavailable=1, context=4096)
    old = _running(before, "r1", "r2", "r3")
    result = plan(snapshot(_fleet(), [after], {"m": 3}, replicas=old))
    # 3 + 2 running at most, 3 - 1 ready at least: two start, one old drains at once
    assert len(result.create) == 2 and len(result.remove) == 1


def _next_pass(snap: Snapshot, result) -> Snapshot:
    """The fleet one pass later: what was created exists (placed, not ready yet), and what
    was removed drains."""
    going = {x.rid for x in result.remove}
    replicas = [
        msgspec.structs.replace(r, phase="draining") if r.rid in going else r for r in snap.replicas
    ] + list(result.create)
    return _with(snap, replicas=replicas)


def _ready(r: Replica) -> bool:
    return r.phase == "ready"


@pytest.mark.parametrize(("surge", "max_unavailable"), [(1, 0), (2, 1), (0, 1)])
def test_a_rollout_never_has_fewer_ready_than_desired_less_max_unavailable_over_passes(
    surge, max_unavailable
):
    before = _rolling()
    after = _rolling(surge=surge, max_unavailable=max_unavailable, context=4096)
    snap = snapshot(_fleet(), [after], {"m": 3}, replicas=_running(before, "r1", "r2", "r3"))
    for _ in range(4):  # the new replicas never become ready: nothing more may drain
        result = plan(snap)
        snap = _next_pass(snap, result)
        live = [r for r in snap.replicas if r.phase != "draining"]
        assert sum(map(_ready, live)) >= 3 - max_unavailable, [
            (r.rid, r.phase) for r in snap.replicas
        ]
        assert len([r for r in snap.replicas if r.phase != "draining"]) <= 3 + surge
    # how many went while nothing new was ready: max_unavailable of them, and no more
    assert sum(r.phase == "draining" for r in snap.replicas) == max_unavailable


def test_what_only_decides_where_a_replica_goes_restarts_nothing():
    before = _rolling()
    for changed in ({"host_ram_gb": 10}, {"node_selector": {"pool": "a"}}, {"tolerations": ["x"]}):
        after = _rolling(**changed)
        assert launch_hash(after, after.profiles[0]) == launch_hash(before, before.profiles[0])
        result = plan(
            snapshot(_fleet(), [after], {"m": 3}, replicas=_running(before, "a", "b", "c"))
        )
        assert result.create == [] and result.remove == [], changed


def test_every_profile_field_either_reaches_the_engine_or_decides_placement():
    from llmgw.catalog import LAUNCH_FIELDS, PLACEMENT_FIELDS, Profile

    assert sorted(LAUNCH_FIELDS + PLACEMENT_FIELDS) == sorted(Profile.__struct_fields__)


def _failed_shard(r: Replica, reason: str, *, gave_up: bool = False, line: str = "") -> Shard:
    m = r.members[0]
    return shard(
        m.node,
        r.rid,
        "failed",
        model=r.model,
        since=0,
        reason=reason,
        output_tail=["loading model", line] if line else [],
        restarts=4,
        gave_up=gave_up,
    )


def test_a_new_replica_that_fails_stops_the_rollout_and_the_old_keep_serving():
    before, after = _rolling(), _rolling(env={"X": "bad"})
    old = _running(before, "r1", "r2", "r3")
    first = plan(snapshot(_fleet(), [after], {"m": 3}, replicas=old))
    new = msgspec.structs.replace(first.create[0], phase="failed")
    shards = {
        (new.members[0].node, new.rid): _failed_shard(
            new, "exited with code 1 while loading", line="RuntimeError: bad"
        )
    }
    snap = _with(snapshot(_fleet(), [after], {"m": 3}, replicas=[*old, new]), shards=shards)
    result = plan(snap)
    assert result.create == []
    assert [r.rid for r in result.remove] == [new.rid]  # only the new one goes
    ro = result.rollouts["m"]
    assert ro.phase == "stopped" and ro.failed_rid == new.rid
    assert "exited with code 1 while loading: RuntimeError: bad" in ro.reason
    assert ro.output_tail[-1] == "RuntimeError: bad"
    expl = result.placements["m"].explanation
    assert expl.startswith("rollout stopped: new replica ") and "llmgw rollout undo m" in expl

    # stopped it stays, once the failed one is gone, until the revision changes
    snap = _with(snapshot(_fleet(), [after], {"m": 3}, replicas=old), rollouts={"m": ro})
    again = plan(snap)
    assert again.create == [] and again.remove == [] and again.rollouts["m"].phase == "stopped"
    fixed = _rolling(env={"X": "good"})
    snap = _with(snapshot(_fleet(), [fixed], {"m": 3}, replicas=old), rollouts={"m": ro})
    resumed = plan(snap)
    assert len(resumed.create) == 1 and resumed.rollouts["m"].phase == "progressing"


def test_history_keeps_revisions_that_ran_everywhere_for_undo():
    a, b, c = _rolling(), _rolling(env={"X": "b"}), _rolling(env={"X": "c"})
    done = plan(snapshot(_fleet(), [a], {"m": 1}, replicas=_running(a, "r1"))).rollouts["m"]
    assert done.phase == "complete" and done.current.completed_at == 1000.0
    to_b = plan(
        _with(snapshot(_fleet(), [b], {"m": 1}, replicas=_running(a, "r1")), rollouts={"m": done})
    ).rollouts["m"]
    assert [r.profiles[0].launch for r in to_b.history] == [launch_hash(a, a.profiles[0])]
    assert to_b.history[0].profiles[0].content["weights"] == {"key": KEY}
    # b never ran everywhere: going on to c leaves history as it was
    to_c = plan(
        _with(snapshot(_fleet(), [c], {"m": 1}, replicas=_running(a, "r1")), rollouts={"m": to_b})
    ).rollouts["m"]
    assert [r.profiles[0].launch for r in to_c.history] == [launch_hash(a, a.profiles[0])]


# --- drains -------------------------------------------------------------------------------------


def test_a_drained_nodes_replica_moves_its_replacement_ready_first():
    m = _rolling()
    [old] = _running(m, "r1", nodes_=("n1",))
    ops = _ops(n1={"state": "draining"})
    result = plan(_with(snapshot(_fleet(), [m], {"m": 1}, replicas=[old]), ops=ops))
    assert result.remove == [] and placed_on(result)[0] != ["n1"]
    new = msgspec.structs.replace(result.create[0], phase="ready")
    result = plan(_with(snapshot(_fleet(), [m], {"m": 1}, replicas=[old, new]), ops=ops))
    assert [(r.rid, r.reason) for r in result.remove] == [("r1", "node n1 is draining: moved")]
    assert result.rollouts["m"].phase == "complete"  # a drain is no new revision


def test_a_drain_without_a_place_to_go_waits_and_says_why_unless_forced():
    m = _rolling()
    [old] = _running(m, "r1", nodes_=("n1",))
    nodes = [node("n1"), node("n2")]
    ops = _ops(n1={"state": "draining"}, n2={"state": "cordoned"})
    result = plan(_with(snapshot(nodes, [m], {"m": 1}, replicas=[old]), ops=ops))
    assert result.create == [] and result.remove == []
    expl = result.placements["m"].explanation
    assert (
        expl
        == "1 replacement (rollout or drain) waits for a node: 0/2 nodes fit: 1 cordoned, 1 draining"
    )
    ops["n1"] = NodeOps(node="n1", state="draining-by-force")
    result = plan(_with(snapshot(nodes, [m], {"m": 1}, replicas=[old]), ops=ops))
    [gone] = result.remove
    assert gone.reason.startswith("drained by force: nowhere else to place it (0/2 nodes fit: ")


# --- replicas an agent gave up on ---------------------------------------------------------------


def test_a_replica_given_up_on_moves_and_its_node_is_avoided_for_that_launch():
    m = _rolling()
    [crashed] = _running(m, "r1", phase="gave-up", nodes_=("n1",))
    shards = {
        ("n1", "r1"): _failed_shard(
            crashed, "exited with code 1 while loading", gave_up=True, line="CUDA error: ECC"
        )
    }
    snap = _with(
        snapshot([node("n1"), node("n2")], [m], {"m": 1}, replicas=[crashed]), shards=shards
    )
    result = plan(snap)
    assert placed_on(result) == [["n2"]]
    [gone] = result.remove
    said = "failed 5 times on n1 (exited with code 1 while loading: CUDA error: ECC); moved to n2"
    assert gone.reason == said
    rec = result.placements["m"]
    assert rec.explanation == said and [f.node for f in rec.failures] == ["n1"]

    # later, with n2 full: n1 is still avoided for this launch, and says so
    full = replica("r-full", [("n2", list(range(8)))], mid="other")
    later = _with(
        snapshot([node("n1"), node("n2")], [m], {"m": 1}, replicas=[full]), placements={"m": rec}
    )
    expl = plan(later).placements["m"].explanation
    assert expl.startswith(
        "0/2 nodes fit: 1 short of free GPUs (0 free, needs 1), 1 where this launch failed lately"
    )
    # a changed profile is tried there again
    changed = _rolling(env={"FIX": "1"})
    later = _with(
        snapshot([node("n1"), node("n2")], [changed], {"m": 1}, replicas=[full]),
        placements={"m": rec},
    )
    assert placed_on(plan(later)) == [["n1"]]
    # and after the cool-down, so is the same one
    cooled = _with(later, catalog={"m": m}, now=1000.0 + 1801)
    assert placed_on(plan(cooled)) == [["n1"]]


def test_a_launch_given_up_on_by_three_nodes_stops_moving_and_blames_the_profile():
    m = _rolling()
    launch = launch_hash(m, m.profiles[0])
    earlier = [
        Failure(
            node=n,
            rid=f"r{n}",
            profile="p",
            launch=launch,
            at=900.0,
            restarts=4,
            reason="exited with code 1",
            moved_to="x",
        )
        for n in ("n1", "n2")
    ]
    stored = PlacementRecord(model="m", desired=1, placed=1, failures=earlier)
    [crashed] = _running(m, "r3", phase="gave-up", nodes_=("n3",))
    shards = {("n3", "r3"): _failed_shard(crashed, "exited with code 1", gave_up=True, line="boom")}
    nodes = [node("n1"), node("n2"), node("n3"), node("n4")]
    snap = _with(
        snapshot(nodes, [m], {"m": 1}, replicas=[crashed]), shards=shards, placements={"m": stored}
    )
    result = plan(snap)
    assert result.create == [] and result.remove == []  # it stays where it failed, to show why
    rec = result.placements["m"]
    assert rec.broken == ["p"] and rec.placed == 0
    assert (
        "profile p failed on n1, n2, n3 (exited with code 1: boom): the profile, not the nodes, is the problem"
        in rec.explanation
    )

    # scaled to 0 (or its desired removed), what stayed to show why goes like any surplus
    for desired in ({"m": 0}, {}):
        scaled = _with(
            snapshot(nodes, [m], desired, replicas=[crashed]),
            shards=shards,
            placements={"m": stored},
        )
        [gone] = plan(scaled).remove
        assert gone.rid == "r3" and gone.reason.startswith("scaled down to 0: it had given up")


def test_on_a_fleet_of_two_a_launch_failing_on_both_blames_the_profile():
    # three nodes is the default bar, but only two could ever run it: both failed
    m = _rolling()
    launch = launch_hash(m, m.profiles[0])
    earlier = [Failure(node="n1", rid="rn1", profile="p", launch=launch, at=900.0, moved_to="n2")]
    stored = PlacementRecord(model="m", desired=1, placed=1, failures=earlier)
    [crashed] = _running(m, "r2", phase="gave-up", nodes_=("n2",))
    shards = {("n2", "r2"): _failed_shard(crashed, "exited with code 1", gave_up=True, line="boom")}
    # n3 has no vLLM: it could never run this profile, and is not counted
    nodes = [node("n1"), node("n2"), node("n3", engines=("llama-server",))]
    snap = _with(
        snapshot(nodes, [m], {"m": 1}, replicas=[crashed]), shards=shards, placements={"m": stored}
    )
    rec = plan(snap).placements["m"]
    assert rec.broken == ["p"]
    assert "profile p failed on n1, n2 (exited with code 1: boom): the profile" in rec.explanation


def test_the_records_lines_say_the_phase_the_shards_say_now():
    from llmgw.controller.inputs import placement_snapshot
    from llmgw.controller.view import View

    m = _rolling()
    [r] = _running(m, "r1", nodes_=("n1",))  # stored ready, from the pass before
    view = View(
        catalog={"m": m},
        desired={"m": Desired(model="m", replicas=1)},
        nodes={"n1": node("n1")},
        replicas={"r1": r},
        shards={("n1", "r1"): _failed_shard(r, "exited with code 1 while serving")},
    )
    snap = placement_snapshot(view, {"n1": "ready"}, {}, port_range=(18000, 18999), now=1000.0)
    lines = plan(snap).placements["m"].decisions
    assert lines == ["keep r1 on n1 (failed on n1: exited with code 1 while serving)"]


# --- the lazy picker chooses what judging every node would ----------------------------------


class _JudgeEveryNode:
    """The reference: every node judged by every filter up front, then the best-ranked of
    those that fit (placement before it judged lazily)."""

    def __init__(self, nodes, need, weights) -> None:
        import heapq

        from llmgw.controller.placement.filters import fit
        from llmgw.controller.placement.scores import rank

        self.nodes, self.need, self.weights = nodes, need, weights
        self._fit, self._rank, self._heapq = fit, rank, heapq
        self.refused = {}
        self.heap = [o for o in map(self._judge, nodes.values()) if o is not None]
        heapq.heapify(self.heap)

    def _judge(self, n):
        refusal = self._fit(n, self.need)
        if refusal is not None:
            self.refused[n.id] = refusal
            return None
        return self._rank(n, self.need, self.weights).order

    def pick(self):
        from llmgw.controller.placement.nodes import take
        from llmgw.controller.placement.pickers import Pick
        from llmgw.controller.placement.scores import why_here

        if not self.heap:
            return None
        n = self.nodes[self._heapq.heappop(self.heap)[-1]]
        why = why_here(n, self.need, self.weights)
        member = take(n, self.need, rank=0)
        order = self._judge(n)
        if order is not None:
            self._heapq.heappush(self.heap, order)
        return Pick([member], why)

    def refusals(self):
        return dict(self.refused)


def _random_fleet(seed: int) -> Snapshot:
    import random

    rng = random.Random(seed)
    fabrics = ["ib-a", "ib-b", None]
    nodes = [
        node(
            f"n{i:02d}",
            gpus=rng.choice([0, 2, 4, 8]),
            ram_gb=rng.choice([8, 64, 1000]),
            engines=rng.choice([("vllm",), ("llama-server",), ("vllm", "llama-server")]),
            fabric=rng.choice(fabrics),
            held=[(KEY, f"local:n{i:02d}")] if rng.random() < 0.2 else [],
        )
        for i in range(rng.randint(3, 30))
    ]
    running = [
        replica(f"x{i}", [(n.node, [0])], mid="m0")
        for i, n in enumerate(nodes)
        if n.gpus.devices and rng.random() < 0.3
    ]
    models = [
        model(f"m{j}", gpus=rng.choice([0, 1, 2, 4]), ram_gb=rng.choice([0, 16, 128]))
        for j in range(4)
    ]
    desired = {m.id: rng.randint(0, 12) for m in models}
    health = {n.node: "lost" for n in nodes if rng.random() < 0.1}
    return snapshot(nodes, models, desired, replicas=running, health=health)


@pytest.mark.parametrize("seed", range(40))
def test_the_lazy_picker_places_and_explains_as_judging_every_node_would(seed, monkeypatch):
    from llmgw.controller.placement import pickers, steps

    snap = _random_fleet(seed)
    lazy = plan(snap)

    def reference(nodes, need, weights):
        if need.profile.nodes > 1:
            return pickers.MultiNodePicker(nodes, need, weights)
        return _JudgeEveryNode(nodes, need, weights)

    monkeypatch.setattr(steps, "picker", reference)
    full = plan(snap)
    assert [(r.model, placed) for r, placed in zip(lazy.create, placed_on(lazy), strict=True)] == [
        (r.model, placed) for r, placed in zip(full.create, placed_on(full), strict=True)
    ]
    assert {m: p.explanation for m, p in lazy.placements.items()} == {
        m: p.explanation for m, p in full.placements.items()
    }
