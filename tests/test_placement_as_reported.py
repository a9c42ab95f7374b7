"""Placement on plain data, with GPUs and ports as the agents see them: memory other
programs hold, GPUs NVML reports faulty, ports other programs listen on, and a launch
refused because its port was taken after placement."""

from __future__ import annotations

import msgspec
import pytest
from record_helpers import shard
from test_placement import _with, model, node, replica, snapshot

from llmgw.bus.records import (
    PORT_IN_USE,
    GpuErrors,
    GpuNamed,
    GpuProcess,
    NodeInventory,
    NodeOps,
    PortsTaken,
)
from llmgw.controller.placement import (
    fit,
    plan,
    same_decision,
)
from llmgw.controller.placement.nodes import Need, fleet_nodes

GB = 1_000_000_000


def with_gpu(inv: NodeInventory, index: int, **fields) -> NodeInventory:
    """`inv` with GPU `index` reporting `fields` (processes, errors, memory_used_bytes)."""
    devices = list(inv.gpus.devices)
    devices[index] = msgspec.structs.replace(devices[index], **fields)
    return msgspec.structs.replace(inv, gpus=msgspec.structs.replace(inv.gpus, devices=devices))


def python_holding(gb: float, pid: int = 4242, name: str = "python") -> list[GpuProcess]:
    return [GpuProcess(pid=pid, name=name, used_bytes=int(gb * GB), own=False)]


def busy_but(node_id: str, free: list[int], gpus: int = 8):
    """A replica of another model on every GPU of the node but `free`."""
    used = [i for i in range(gpus) if i not in free]
    return replica("r-busy", [(node_id, used)], mid="other", port=18500)


# --- memory other programs hold -----------------------------------------------------------


def test_a_gpu_whose_memory_another_program_holds_is_not_free_and_the_explanation_names_it():
    n = with_gpu(node("node05"), 3, processes=python_holding(60))
    result = plan(
        snapshot([n], [model(gpus=1, gpu_gb=40)], {"m": 1}, replicas=[busy_but("node05", [3])])
    )

    assert result.create == []
    record = result.placements["m"]
    assert record.explanation == (
        "0/1 nodes fit: 1 short of free GPUs other programs leave room on (0 usable, needs 1; "
        "GPU 3 of node05: 60 GB held by pid 4242 (python), not llmgw's)"
    )
    (refused,) = record.refused
    assert (refused.reason, refused.nodes, refused.needs, refused.least) == ("gpus-held", 1, 1, 0)
    assert refused.gpu == GpuNamed(
        node="node05", gpu=3, why="held", bytes=60 * GB, pid=4242, process="python"
    )


def test_the_explanation_counts_every_node_so_refused_and_names_the_first():
    nodes = [
        with_gpu(node("n1", gpus=1), 0, processes=python_holding(80, pid=10)),
        with_gpu(
            node("n2", gpus=1),
            0,
            processes=python_holding(50, pid=20) + python_holding(5, pid=21, name="jupyter"),
        ),
    ]
    result = plan(snapshot(nodes, [model(gpus=1)], {"m": 1}))

    assert result.placements["m"].explanation == (
        "0/2 nodes fit: 2 short of free GPUs other programs leave room on (0 usable, needs 1; "
        "GPU 0 of n1: 80 GB held by pid 10 (python), not llmgw's)"
    )


def test_room_beside_another_program_is_used_when_the_profile_says_its_size_and_last():
    n = with_gpu(node("n1", gpus=2), 0, processes=python_holding(60))  # 25.5 GB left on GPU 0
    fits = model(gpus=1, gpu_gb=20)

    result = plan(snapshot([n], [fits], {"m": 2}))

    # the GPU nobody else holds first
    assert [r.members[0].gpus for r in result.create] == [["GPU-n1-01"], ["GPU-n1-00"]]
    too_big = plan(snapshot([n], [model(gpus=1, gpu_gb=30)], {"m": 2}))
    assert [r.members[0].gpus for r in too_big.create] == [["GPU-n1-01"]]


def test_a_profile_that_says_no_size_never_shares_a_gpu_with_another_program():
    n = with_gpu(node("n1", gpus=2), 1, processes=python_holding(0.5, name="nvtop"))

    result = plan(snapshot([n], [model(gpus=1, gpu_gb=0)], {"m": 2}))

    assert [r.members[0].gpus for r in result.create] == [["GPU-n1-00"]]
    assert result.placements["m"].refused[0].reason == "gpus-held"


def test_memory_of_llmgws_own_engines_is_not_held_by_others():
    # GPU 0: an engine of this agent whose replica went away (not in the snapshot); GPU 1: a
    # job of another team. Only the second is held.
    own = [GpuProcess(pid=7001, name="vllm", used_bytes=80 * GB, own=True)]
    n = with_gpu(node("n1", gpus=2), 0, processes=own)
    n = with_gpu(n, 1, processes=python_holding(80))

    result = plan(snapshot([n], [model()], {"m": 2}))

    assert [r.members[0].gpus for r in result.create] == [["GPU-n1-00"]]
    assert result.placements["m"].refused[0].gpu.gpu == 1


def test_memory_held_moving_is_not_a_new_decision():
    def held(gb: float):
        n = with_gpu(node("n1", gpus=1), 0, processes=python_holding(gb))
        return plan(snapshot([n], [model(gpus=1)], {"m": 1})).placements["m"]

    assert same_decision(held(60), held(61))
    assert held(60).refused[0].gpu.bytes != held(61).refused[0].gpu.bytes


# --- GPUs NVML reports faulty -------------------------------------------------------------


def test_a_gpu_with_ecc_errors_is_unschedulable_while_its_nodes_other_gpus_take_replicas():
    n = with_gpu(node("n1"), 2, errors=GpuErrors(ecc_uncorrected_volatile=2))

    result = plan(snapshot([n], [model(gpus=1)], {"m": 8}))

    gpus = sorted(g for r in result.create for g in r.members[0].gpus)
    assert len(result.create) == 7 and "GPU-n1-02" not in gpus
    record = result.placements["m"]
    assert record.explanation == (
        "0/1 nodes fit: 1 short of healthy free GPUs (0 usable, needs 1; GPU 2 of n1: 2 "
        "uncorrected ECC errors since the driver loaded (a GPU reset clears it))"
    )
    assert record.refused[0].gpu == GpuNamed(node="n1", gpu=2, why="ecc-uncorrected", count=2)


@pytest.mark.parametrize(
    ("errors", "why", "text"),
    [
        (GpuErrors(remapped_rows_pending=True), "row-remap-pending", "memory rows waiting"),
        (GpuErrors(remapping_failed=True), "row-remap-failed", "could not be remapped"),
        (GpuErrors(retired_pages_pending=True), "retired-pages-pending", "pages waiting"),
        (
            GpuErrors(xid=79, xid_at=1.0),
            "xid",
            "Xid 79 (fallen off the bus) reported by NVML; reset the GPU, then restart its agent",
        ),
    ],
)
def test_a_fault_waiting_for_a_reset_makes_a_gpu_unschedulable(errors, why, text):
    n = with_gpu(node("n1", gpus=1), 0, errors=errors)

    record = plan(snapshot([n], [model(gpus=1)], {"m": 1})).placements["m"]

    assert record.refused[0].gpu.why == why and text in record.explanation


def test_healthy_counters_and_unknown_ones_leave_a_gpu_schedulable():
    n = with_gpu(node("n1", gpus=3), 0, errors=GpuErrors(ecc_uncorrected_volatile=1))
    n = with_gpu(n, 1, errors=GpuErrors(ecc_uncorrected_volatile=0, remapped_rows_pending=False))
    # GPU 2: GpuErrors() as from an agent that does not read them, or a GPU without ECC

    (placed,) = plan(snapshot([n], [model(gpus=2)], {"m": 1})).create

    assert placed.members[0].gpus == ["GPU-n1-01", "GPU-n1-02"]


def test_an_operators_cordon_of_one_gpu_is_refused_and_explained_the_way_a_fault_is():
    # `llmgw node cordon n1 --gpu 1` writes ops.n1.gpus_out; the node's other GPU still serves
    snap = _with(
        snapshot([node("n1", gpus=2)], [model(gpus=1)], {"m": 2}),
        ops={"n1": NodeOps(node="n1", gpus_out=["GPU-n1-01"])},
    )
    nodes = fleet_nodes(snap)

    refusal = fit(nodes["n1"], Need.of("m", model(gpus=2).profiles[0], snap.port_range))
    assert refusal.reason == "gpus-unschedulable" and refusal.has == 1
    assert refusal.gpu == GpuNamed(node="n1", gpu=1, why="cordoned")
    result = plan(snap)
    assert [m.gpus for r in result.create for m in r.members] == [["GPU-n1-00"]]
    assert "GPU 1 of n1: out of service by the operator" in result.placements["m"].explanation


# --- ports other programs listen on -------------------------------------------------------


def test_a_port_another_program_listens_on_is_never_assigned():
    n = msgspec.structs.replace(
        node("n1"), ports=PortsTaken(low=18000, high=18999, ports=[18000, 18002])
    )

    result = plan(snapshot([n], [model()], {"m": 2}))

    assert [r.members[0].port for r in result.create] == [18001, 18003]


def test_every_port_of_the_range_taken_refuses_the_node_naming_the_range():
    taken = PortsTaken(low=18000, high=18002, ports=[18000, 18001, 18002])
    n = msgspec.structs.replace(node("n1"), ports=taken)

    result = plan(snapshot([n], [model()], {"m": 1}, port_range=(18000, 18002)))

    assert result.placements["m"].explanation == "0/1 nodes fit: 1 with no free port in 18000-18002"


def _refused_plan(member_port: int, refused_port: int, refused: str = PORT_IN_USE, **replica_kw):
    """The plan for 2 replicas of m on n1 wanted, r1 there on `member_port`, its shard's
    launch refused at `refused_port` for `refused`."""
    r1 = msgspec.structs.replace(
        replica("r1", [("n1", [0])], phase="failed", port=member_port), **replica_kw
    )
    record = shard("n1", "r1", "failed", port=refused_port, refused=refused)
    return plan(
        snapshot([node("n1")], [model()], {"m": 2}, replicas=[r1], shards={("n1", "r1"): record})
    )


def test_a_replica_refused_its_port_moves_to_the_next_free_one_and_new_ones_skip_both():
    result = _refused_plan(18000, 18000)

    (move,) = result.port_moves
    assert move.replica.rid == "r1" and move.replica.members[0].port == 18001
    assert move.replica.members[0].gpus == ["GPU-n1-00"]
    assert "port 18000 on n1 was taken by another program, moved to 18001" in move.replica.reason
    assert [r.members[0].port for r in result.create] == [18002]


def test_a_port_refusal_already_answered_moves_nothing_twice():
    # the move to 18001 is written; the agent has not acted on it yet
    assert _refused_plan(18001, 18000).port_moves == []


def test_a_refusal_for_anything_else_moves_nothing():
    assert _refused_plan(18000, 18000, "").port_moves == []


def test_a_second_move_goes_above_the_port_it_leaves_not_back_to_the_first():
    # 18000 was refused first; the agent has not listed it yet, and 18001 is refused now
    moved_once = (
        "node has all 8 GPUs free (port moved: port 18000 on n1 was taken by another "
        "program, moved to 18001)"
    )

    (move,) = _refused_plan(18001, 18001, reason=moved_once).port_moves

    assert move.replica.members[0].port == 18002
    assert move.replica.reason == (
        "node has all 8 GPUs free (port moved: port 18001 on n1 was taken by another program, "
        "moved to 18002)"
    )


# --- what an inventory says, remembered between passes ---------------------------------------


def test_the_fleet_remembered_between_passes_follows_every_change_of_an_inventory():
    """The controller keeps what each inventory says from one pass to the next: a new
    inventory (a fault, foreign memory, a port taken, an engine gone) is seen at the next
    pass exactly as a fleet built afresh sees it, and a node removed is forgotten."""
    from llmgw.controller.placement import InventoryMemo

    memo = InventoryMemo()
    first = snapshot([node("n1", gpus=2), node("n2", gpus=2)], [model(gpus=1)], {"m": 1})

    def same_as_fresh(snap) -> dict:
        kept, fresh = fleet_nodes(snap, memo), fleet_nodes(snap)
        assert kept.keys() == fresh.keys()
        for n in fresh:
            a, b = kept[n], fresh[n]
            assert (a.gpus, a.free, a.unschedulable, a.held, a.used_ports, a.engines) == (
                b.gpus,
                b.free,
                b.unschedulable,
                b.held,
                b.used_ports,
                b.engines,
            )
        return kept

    assert same_as_fresh(first)["n1"].unschedulable == {}
    changed = with_gpu(first.inventories["n1"], 1, errors=GpuErrors(ecc_uncorrected_volatile=2))
    changed = with_gpu(changed, 0, processes=python_holding(10))
    changed = msgspec.structs.replace(
        changed, ports=PortsTaken(low=18000, high=18999, ports=[18005]), engines=[]
    )
    later = _with(first, inventories={"n1": changed, "n2": first.inventories["n2"]})
    n1 = same_as_fresh(later)["n1"]
    assert n1.unschedulable["GPU-n1-01"].why == "ecc-uncorrected"
    assert n1.held["GPU-n1-00"] > 0 and 18005 in n1.used_ports and not n1.engines
    # a replica on the node still takes its GPU off the remembered list
    held = _with(later, replicas=[replica("r1", [("n2", [0])])])
    assert [g.uuid for g in same_as_fresh(held)["n2"].free] == ["GPU-n2-01"]
    gone = _with(later, inventories={"n2": first.inventories["n2"]})
    assert list(same_as_fresh(gone)) == ["n2"]
    assert list(memo._by_node) == ["n2"]


def test_what_the_whole_fleet_says_is_kept_only_while_every_inventory_is_the_same() -> None:
    # the fabric view and where weights are follow from all the inventories together: the
    # controller keeps them between passes, and any new inventory value builds them again
    from llmgw.controller.fabrics import fabric_view
    from llmgw.controller.placement import InventoryMemo

    memo = InventoryMemo()
    first = snapshot([node("n1", gpus=2), node("n2", gpus=2)], [model(gpus=1)], {"m": 1})
    built: list[dict] = []

    def fabrics(snap) -> dict:
        def build() -> dict:
            built.append(fabric_view(snap.inventories.values()))
            return built[-1]

        return memo.of_fleet("fabrics", snap.inventories, build)

    assert fabrics(first) is fabrics(first) and len(built) == 1
    same_values = _with(first, inventories=dict(first.inventories))  # another dict, same values
    assert fabrics(same_values) is built[0] and len(built) == 1
    n1 = msgspec.structs.replace(
        first.inventories["n1"], labels={"pool": "b"}
    )  # an equal-ish new value
    assert fabrics(_with(first, inventories={**first.inventories, "n1": n1})) is not built[0]
    assert len(built) == 2
    assert fabrics(_with(first, inventories={"n2": first.inventories["n2"]}))["node-n2"].nodes == [
        "n2"
    ]
    assert len(built) == 3
