"""Many models on one GPU: shared profiles placed by GPU memory (share_gpus), beside
exclusive ones that keep their GPUs whole, and MIG devices asked for by name
(controller/placement/nodes.py, "Sharing")."""

from __future__ import annotations

import msgspec
import pytest
from record_helpers import shard
from test_placement import node, replica, snapshot
from test_placement_as_reported import python_holding, with_gpu

from llmgw.bus.records import Gpu, NodeInventory, Replica, ReplicaMember
from llmgw.catalog import Model, validate_models
from llmgw.controller.placement import plan
from llmgw.controller.placement.nodes import SHARE_HEADROOM

GB = 1_000_000_000
H200 = 141 * GB


def shared(mid: str = "s", gb: float = 20, gpu_model: str | None = None) -> Model:
    profile = {
        "name": "p",
        "engine": "llama-server",
        "weights": {"key": f"org/{mid}"},
        "gpus_per_node": 1,
        "gpu_memory_gb": gb,
        "share_gpus": True,
    }
    if gpu_model:
        profile["gpu_model"] = gpu_model
    return validate_models({"models": [{"id": mid, "profiles": [profile]}]})[0]


def exclusive(mid: str = "x", gpus: int = 1) -> Model:
    profile = {"name": "p", "engine": "vllm", "weights": {"key": "org/x"}, "gpus_per_node": gpus}
    return validate_models({"models": [{"id": mid, "profiles": [profile]}]})[0]


def sharing(rid: str, node_id: str, gpu: int, gb: float, mid: str = "other") -> Replica:
    """A running shared replica of `gb` on one GPU."""
    member = ReplicaMember(
        node=node_id, rank=0, gpus=[f"GPU-{node_id}-{gpu:02d}"], port=18100, gpu_bytes=int(gb * GB)
    )
    return Replica(model=mid, rid=rid, profile="p", members=[member], phase="ready")


def gpus_of(result) -> list[tuple[str, str, int]]:
    return [(m.node, m.gpus[0], m.gpu_bytes) for r in result.create for m in r.members]


def test_shared_replicas_pack_onto_one_gpu_by_memory_and_leave_the_others_whole():
    result = plan(snapshot([node("h1", gpus=2, gpu_gb=141)], [shared(gb=20)], {"s": 6}))

    # 6 x 20 GB = 120 GB fit on one 141 GB GPU (less the headroom): GPU 1 stays whole
    assert gpus_of(result) == [("h1", "GPU-h1-00", 20 * GB)] * 6
    assert result.create[0].reason.endswith("shares GPU 0 (141 GB), which no replica shared yet")
    assert result.create[1].reason.endswith("shares GPU 0 (141 GB) with 1 replica (20 GB allotted)")
    # 7 x 20 = 140 GB is GPU 0 less the headroom: the 8th goes to GPU 1
    more = plan(snapshot([node("h1", gpus=2, gpu_gb=141)], [shared(gb=20)], {"s": 8}))
    assert [g for _, g, _ in gpus_of(more)] == ["GPU-h1-00"] * 7 + ["GPU-h1-01"]


def test_a_shared_gpu_is_best_fit_among_gpus_already_shared_before_a_whole_one():
    running = [sharing("r0", "h1", 0, 100), sharing("r1", "h1", 1, 60), sharing("r2", "h2", 0, 30)]
    nodes = [node("h1", gpus=4, gpu_gb=141), node("h2", gpus=4, gpu_gb=141)]
    result = plan(snapshot(nodes, [shared(gb=20)], {"s": 1}, replicas=running))
    # GPU 0 of h1 has 40 GB left, the least that still takes 20
    assert gpus_of(result) == [("h1", "GPU-h1-00", 20 * GB)]


def test_exclusive_never_lands_on_a_shared_gpu_nor_shared_on_an_exclusive_one():
    nodes = [node("h1", gpus=2, gpu_gb=141)]
    # GPU 0 shared (20 GB of 141), GPU 1 an exclusive replica's
    running = [sharing("r0", "h1", 0, 20), replica("rx", [("h1", [1])], mid="other", port=18200)]
    result = plan(snapshot(nodes, [exclusive(), shared(gb=20)], {"x": 1, "s": 1}, replicas=running))

    assert gpus_of(result) == [("h1", "GPU-h1-00", 20 * GB)]  # the shared one, beside r0
    assert result.placements["x"].explanation == (
        "0/1 nodes fit: 1 short of free GPUs (0 free, needs 1)"
    )
    # an exclusive replica's GPU is not shared, however much of it the engine leaves unused
    only_exclusive = [replica("rx", [("h1", [0, 1])], mid="other", port=18200)]
    result = plan(snapshot(nodes, [shared(gb=1)], {"s": 1}, replicas=only_exclusive))
    assert result.create == []
    assert result.placements["s"].explanation == (
        "0/1 nodes fit: 1 short of free GPUs (0 free, needs 1)"
    )


def test_a_full_shared_gpu_is_explained_with_what_fills_it():
    inv = with_gpu(node("h200-01", gpus=1, gpu_gb=141), 0, processes=python_holding(65, pid=4949))
    running = [sharing(f"r{i}", "h200-01", 0, 20) for i in range(3)]
    result = plan(snapshot([inv], [shared(gb=20)], {"s": 1}, replicas=running))

    assert result.create == []
    assert result.placements["s"].explanation == (
        "0/1 nodes fit: 1 short of GPU memory to share (15 GB left on a GPU, needs 20; "
        "GPU 0 of h200-01: 141 GB, 60 GB allocated to 3 replicas, 65 GB held by pid 4949 "
        "(python))"
    )


def test_a_gpu_whose_free_memory_shrinks_under_a_shared_replica_takes_no_more():
    running = [sharing("r0", "h1", 0, 40, mid="s")]

    def with_other_program(gb: float) -> NodeInventory:
        return with_gpu(node("h1", gpus=1, gpu_gb=141), 0, processes=python_holding(gb))

    grown_from = plan(
        snapshot([with_other_program(10)], [shared(gb=40)], {"s": 2}, replicas=running)
    )
    assert gpus_of(grown_from) == [("h1", "GPU-h1-00", 40 * GB)]  # 141-40-10-1 covers 40
    # the other program grew to 70 GB: the replica there stays (nothing is moved for it),
    # and no other one joins it
    grown = plan(snapshot([with_other_program(70)], [shared(gb=40)], {"s": 2}, replicas=running))
    assert grown.create == [] and grown.remove == []
    assert "30 GB left on a GPU, needs 40" in grown.placements["s"].explanation
    assert "40 GB allocated to 1 replica, 70 GB held by pid 4242 (python)" in (
        grown.placements["s"].explanation
    )


def test_the_headroom_is_kept_on_a_shared_gpu():
    # exactly the card less the headroom fits; a byte more does not
    card = 141 * GB - SHARE_HEADROOM
    fits = plan(snapshot([node("h1", gpus=1, gpu_gb=141)], [shared(gb=card / GB)], {"s": 1}))
    assert len(fits.create) == 1
    over = plan(snapshot([node("h1", gpus=1, gpu_gb=141)], [shared(gb=card / GB + 0.01)], {"s": 1}))
    assert over.create == []


# --- MIG devices: GPUs of their own, asked for by profile ---------------------------------


def mig_node(node_id: str, profiles: list[str]) -> NodeInventory:
    """An H200 node whose card 0 is in MIG mode with these MIG devices, and card 1 whole."""
    sizes = {"1g.18gb": 17.4, "2g.35gb": 34.9, "3g.71gb": 70.3}
    migs = [
        Gpu(
            index=0,
            name=f"NVIDIA H200 MIG {p}",
            uuid=f"MIG-{node_id}-{slot}",
            memory_total_bytes=int(sizes[p] * GB),
            pci_bus_id="00000000:18:00.0",
            compute_capability="9.0",
            mig_profile=p,
            parent_uuid=f"GPU-{node_id}-00",
        )
        for slot, p in enumerate(profiles)
    ]
    inv = node(node_id, gpus=2, gpu_gb=141)
    whole = msgspec.structs.replace(inv.gpus.devices[1], name="NVIDIA H200")
    gpus = msgspec.structs.replace(inv.gpus, devices=[*migs, whole])
    return msgspec.structs.replace(inv, gpus=gpus)


def test_a_profile_asking_for_a_mig_profile_is_given_such_mig_devices_by_uuid():
    inv = mig_node("h1", ["3g.71gb", "1g.18gb", "1g.18gb"])
    small = shared("small", gb=8, gpu_model="1g.18gb")
    result = plan(snapshot([inv], [small], {"small": 4}))

    # two 8 GB replicas per 1g.18gb device (17.4 - 1 headroom), never on the 3g or the card
    assert sorted(g for _, g, _ in gpus_of(result)) == ["MIG-h1-1"] * 2 + ["MIG-h1-2"] * 2
    whole = exclusive()
    whole.profiles[0].gpu_model = "3g.71gb"
    result = plan(snapshot([inv], [whole], {"x": 1}))
    assert [r.members[0].gpus for r in result.create] == [["MIG-h1-0"]]


def test_a_node_without_the_gpu_model_asked_is_refused_saying_so():
    result = plan(snapshot([node("h1", gpus=2)], [shared(gb=8, gpu_model="1g.18gb")], {"s": 1}))
    assert result.placements["s"].explanation == "0/1 nodes fit: 1 without a GPU of model 1g.18gb"


def test_the_lazy_picker_takes_the_node_an_exhaustive_judgement_would():
    import random

    from llmgw.controller.placement.filters import fit
    from llmgw.controller.placement.nodes import Need, fleet_nodes, take
    from llmgw.controller.placement.pickers import SingleNodePicker
    from llmgw.controller.placement.weights import WeightsNearby

    rng = random.Random(3)
    invs, running = [], []
    for i in range(40):
        inv = node(f"n{i:02d}", gpus=4, gpu_gb=rng.choice([48, 85.5, 141]))
        if rng.random() < 0.3:
            inv = with_gpu(inv, rng.randrange(4), processes=python_holding(rng.choice([5, 30])))
        if rng.random() < 0.3:  # a GPU too small for the profile: the bound is below the node
            inv = with_gpu(inv, 3, memory_total_bytes=10 * GB)
        invs.append(inv)
        if rng.random() < 0.4:
            running.append(sharing(f"r{i}", inv.node, rng.randrange(4), rng.choice([10, 20, 40])))
    snap = snapshot(invs, [shared(gb=12)], {"s": 60}, replicas=running)
    need = Need.of("s", snap.catalog["s"].profiles[0], snap.port_range)
    lazy_nodes, full_nodes = fleet_nodes(snap), fleet_nodes(snap)
    weights = WeightsNearby(snap)
    lazy = SingleNodePicker(lazy_nodes, need, weights)
    judge = SingleNodePicker(full_nodes, need, weights)  # its exact order, for every node
    for _ in range(60):
        fitting = [n for n in full_nodes.values() if fit(n, need) is None]
        expected = min(fitting, key=lambda n: judge._shared_order(n, exact=True), default=None)
        got = lazy.pick()
        assert (got and got.members[0].node) == (expected and expected.id)
        if expected is None:
            break
        take(expected, need, rank=0)
        # and the same GPU on it
        assert lazy_nodes[expected.id].allotted == expected.allotted


def test_best_fit_looks_past_a_gpu_too_small_for_the_replica():
    # node a's smallest GPU (10 GB) cannot take 12 GB: its best fit is a 141 GB GPU (128 GB
    # left), worse than b's 48 GB GPU (35 GB left)
    a = with_gpu(node("a", gpus=4, gpu_gb=141), 0, memory_total_bytes=10 * GB)
    b = node("b", gpus=4, gpu_gb=48)
    result = plan(snapshot([a, b], [shared(gb=12)], {"s": 1}))
    assert gpus_of(result) == [("b", "GPU-b-00", 12 * GB)]


def test_a_full_mig_device_is_named_as_one():
    inv = mig_node("h1", ["1g.18gb"])
    running = [
        Replica(
            model="other",
            rid="r0",
            profile="p",
            members=[ReplicaMember(node="h1", rank=0, gpus=["MIG-h1-0"], gpu_bytes=10 * GB)],
        )
    ]
    result = plan(snapshot([inv], [shared(gb=8, gpu_model="1g.18gb")], {"s": 1}, replicas=running))
    assert "MIG 1g.18gb of GPU 0 of h1: 17.4 GB, 10 GB allocated to 1 replica" in (
        result.placements["s"].explanation
    )


def test_an_engine_that_outgrew_its_allotment_counts_with_what_it_holds():

    running = [sharing("r0", "h1", 0, 100)]
    nodes = [node("h1", gpus=1, gpu_gb=141)]
    fits = plan(snapshot(nodes, [shared(gb=30)], {"s": 1}, replicas=running))
    assert len(fits.create) == 1  # 141 - 100 - 1 covers 30
    grown = shard("h1", "r0", "ready", model="other", since=0, pid=7001, gpu_used_bytes=115 * GB, gpu_allotted_bytes=100 * GB, gpu_outgrown=True)  # fmt: skip
    result = plan(
        snapshot(nodes, [shared(gb=30)], {"s": 1}, replicas=running, shards={("h1", "r0"): grown})
    )
    assert result.create == []
    assert "115 GB allocated to 1 replica" in result.placements["s"].explanation


def test_a_node_record_listing_a_mig_device_beside_its_parent_is_refused_whole_and_gets_nothing():
    """A record that listed card 0 whole beside its own MIG device had placement put two
    exclusive replicas on that one card: the record contradicts itself, so none of it is
    believed, and the node is read as absent (as any node record that does not read)."""
    from llmgw.bus import keys, records
    from llmgw.fleetstate.decode import FleetRecords

    inv = mig_node("h1", ["3g.71gb"])  # MIG-h1-0 of card 0, and card 1 whole
    parent = msgspec.structs.replace(inv.gpus.devices[1], index=0, uuid="GPU-h1-00")
    said = msgspec.structs.replace(
        inv, gpus=msgspec.structs.replace(inv.gpus, devices=[parent, *inv.gpus.devices])
    )
    read = FleetRecords()
    read.apply(keys.node("h1"), records.encode(said), 7)
    read.apply(keys.node("h2"), records.encode(node("h2", gpus=1, gpu_gb=141)), 8)

    assert "h1" not in read.nodes
    why = read.unreadable[keys.node("h1")].why
    assert "is MIG device 'MIG-h1-0' of GPU 'GPU-h1-00', which is listed too" in why
    result = plan(snapshot(list(read.nodes.values()), [exclusive()], {"x": 3}))
    assert [(m.node, m.gpus) for r in result.create for m in r.members] == [("h2", ["GPU-h2-00"])]
    # as the agent said it, the card was given twice
    before = plan(snapshot([said], [exclusive()], {"x": 3}))
    assert sorted(m.gpus[0] for r in before.create for m in r.members) == [
        "GPU-h1-00",
        "GPU-h1-01",
        "MIG-h1-0",
    ]


def test_a_node_record_listing_one_gpu_twice_is_refused():
    from llmgw.bus import trust

    inv = node("h1", gpus=2)
    twice = [inv.gpus.devices[0], inv.gpus.devices[0]]
    bad = msgspec.structs.replace(inv, gpus=msgspec.structs.replace(inv.gpus, devices=twice))
    with pytest.raises(
        trust.RecordRejected, match=r"devices\[1\]\.uuid 'GPU-h1-00' is listed twice"
    ):
        trust.check("nodes.h1", bad)
