"""Where LoRA adapters are loaded (controller/adapters.py): pure, time passed in. The rules
a platform team relies on: an adapter on as many replicas as its demand needs and not on
all, room made only by adapters nobody uses, the churn budget, refused adapters kept where
they failed, llama-server given every adapter its node holds."""

from __future__ import annotations

from llmgw.bus.records import AdapterAssigned
from llmgw.catalog import Adapter
from llmgw.controller.adapters import (
    AdapterPolicy,
    Demand,
    DemandTracker,
    Seat,
    loaded_for_demand,
    started_with,
)
from llmgw.controller.autoscale import ModelLoad

NOW = 10_000.0
POLICY = AdapterPolicy(resident_s=60.0, settle_s=5.0, busy_s=10.0, idle_s=300.0)


def adapter(aid: str, path: str | None = None) -> Adapter:
    return Adapter(id=aid, served_name=f"acme/{aid}", base="tiny", path=path or f"/w/{aid}", rank=8)


def seat(rid: str, slots: int = 4, have=(), holds=None, failed=(), load=0.0) -> Seat:
    return Seat(
        rid=rid,
        slots=slots,
        holds=frozenset(holds if holds is not None else (f"/w/{a}" for a in "abcdefgh")),
        have=tuple(have),
        failed=frozenset(failed),
        load=load,
    )


def given(aid: str, since: float) -> AdapterAssigned:
    a = adapter(aid)
    return AdapterAssigned(id=a.id, name=a.served_name, path=a.path, rank=a.rank, since=since)


def where(result: dict[str, list[AdapterAssigned]], aid: str) -> list[str]:
    return sorted(rid for rid, entries in result.items() if any(e.id == aid for e in entries))


def place(seats, adapters, demand, now=NOW, **kw):
    return loaded_for_demand(seats, adapters, demand, now, policy=POLICY, **kw)


def test_idle_adapters_are_loaded_into_free_slots_once_each():
    result = place([seat("r1", 2), seat("r2", 2)], [adapter("a"), adapter("b"), adapter("c")], {})
    assert [where(result, a) for a in "abc"] == [["r1"], ["r2"], ["r1"]]


def test_demand_asks_for_one_replica_per_target_in_flight_not_all():
    seats = [seat(f"r{i}", 4) for i in range(4)]
    have = {"r0": [given("a", NOW - 100)]}
    seats = [seat(s.rid, 4, have.get(s.rid, ())) for s in seats]
    demand = {"a": Demand(in_flight=3.5, last_active=NOW)}
    result = place(seats, [adapter("a")], demand, target=2.0)
    # 3.5 in flight over a target of 2: two replicas, one new this pass (the settle time)
    assert len(where(result, "a")) == 2
    seats = [seat(rid, 4, entries) for rid, entries in result.items()]
    again = place(seats, [adapter("a")], demand, now=NOW + 6, target=2.0)
    assert len(where(again, "a")) == 2  # not a third: 2 copies take 4 in flight


def test_one_new_copy_per_settle_time():
    seats = [seat(f"r{i}", 4) for i in range(4)]
    demand = {"a": Demand(in_flight=8, last_active=NOW)}
    first = place(seats, [adapter("a")], demand)
    assert len(where(first, "a")) == 1
    seats = [seat(rid, 4, e) for rid, e in first.items()]
    soon = place(seats, [adapter("a")], demand, now=NOW + 1)
    assert len(where(soon, "a")) == 1
    later = place(seats, [adapter("a")], demand, now=NOW + 5)
    assert len(where(later, "a")) == 2


def test_held_requests_ask_for_one_more_replica():
    seats = [seat("r1", 4, [given("a", NOW - 100)]), seat("r2", 4)]
    demand = {"a": Demand(in_flight=0.5, waiting=1, last_active=NOW)}
    assert where(place(seats, [adapter("a")], demand), "a") == ["r1", "r2"]


def test_room_is_made_by_the_adapter_used_least_lately_and_never_one_in_use():
    old = NOW - 1000
    seats = [seat("r1", 2, [given("b", old), given("c", old)])]
    demand = {
        "a": Demand(waiting=1, last_active=NOW),
        "b": Demand(in_flight=1, last_active=NOW),  # in use: stays
        "c": Demand(last_active=NOW - 500),
    }
    result = place(seats, [adapter(x) for x in "abc"], demand)
    assert sorted(e.id for e in result["r1"]) == ["a", "b"]


def test_an_adapter_loaded_lately_and_asked_for_since_is_not_unloaded_for_another():
    seats = [seat("r1", 1, [given("b", NOW - 30)])]  # loaded 30 s ago: within resident_s
    demand = {"a": Demand(waiting=1, last_active=NOW), "b": Demand(last_active=NOW - 20)}
    result = place(seats, [adapter("a"), adapter("b")], demand)
    assert [e.id for e in result["r1"]] == ["b"]


def test_an_adapter_loaded_ahead_and_never_asked_for_gives_its_slot_at_once():
    """The slots filled ahead of demand (a thousand adapters, fewer slots) do not make the
    first requests for the others wait out the churn budget."""
    seats = [seat("r1", 1, [given("b", NOW - 30)])]  # loaded ahead 30 s ago
    demand = {"a": Demand(waiting=1, last_active=NOW), "b": Demand(last_active=NOW - 500)}
    result = place(seats, [adapter("a"), adapter("b")], demand)
    assert [e.id for e in result["r1"]] == ["a"]


def test_a_busy_adapter_s_extra_copy_never_unloads_another_s_last_copy():
    """A popular adapter spreading must not push the rarely asked out of the fleet; an
    adapter loaded nowhere may."""
    old = NOW - 1000
    seats = [seat("r1", 1, [given("a", old)]), seat("r2", 1, [given("b", old)])]
    busy = {"a": Demand(in_flight=6, waiting=1, last_active=NOW), "b": Demand(last_active=old)}
    result = place(seats, [adapter("a"), adapter("b")], busy)
    assert where(result, "a") == ["r1"] and where(result, "b") == ["r2"]
    seats = [seat("r1", 1, [given("b", old)])]
    held = {"a": Demand(waiting=1, last_active=NOW), "b": Demand(last_active=old)}
    assert where(place(seats, [adapter("a"), adapter("b")], held), "a") == ["r1"]


def test_an_adapter_nobody_asks_for_takes_only_a_free_slot():
    seats = [seat("r1", 1, [given("b", NOW - 1000)])]
    demand = {"b": Demand(last_active=NOW - 1000)}  # b idle, a never asked for
    result = place(seats, [adapter("a"), adapter("b")], demand)
    assert [e.id for e in result["r1"]] == ["b"]


def test_idle_adapters_never_evict_each_other_over_passes():
    """Twenty passes with more adapters than slots and no demand: nothing moves."""
    adapters = [adapter(x) for x in "abcdef"]
    seats = [seat("r1", 2), seat("r2", 2)]
    result = place(seats, adapters, {})
    for i in range(20):
        seats = [seat(rid, 2, e) for rid, e in result.items()]
        again = place(seats, adapters, {}, now=NOW + 100 * i)
        assert again == result
    assert sum(len(e) for e in result.values()) == 4


def test_a_copy_the_demand_no_longer_needs_goes_after_resident_time():
    seats = [seat("r1", 4, [given("a", NOW - 1000)]), seat("r2", 4, [given("a", NOW - 30)])]
    quiet = {"a": Demand(last_active=NOW)}
    assert where(place(seats, [adapter("a")], quiet), "a") == ["r1", "r2"]  # r2: 30 s only
    later = place(seats, [adapter("a")], quiet, now=NOW + 40)
    assert where(later, "a") == ["r1"]  # the newest went, the adapter stays on one


def test_refused_adapter_stays_where_it_failed_and_goes_nowhere_else():
    seats = [seat("r1", 4, [given("a", NOW - 100)], failed=["a"]), seat("r2", 4)]
    demand = {"a": Demand(waiting=3, last_active=NOW)}
    assert where(place(seats, [adapter("a")], demand), "a") == ["r1"]


def test_only_replicas_whose_nodes_hold_the_files_take_it():
    seats = [seat("r1", 4, holds=[]), seat("r2", 4, holds=["/w/a"])]
    assert where(place(seats, [adapter("a")], {}), "a") == ["r2"]


def test_an_adapter_removed_from_the_catalog_is_unloaded():
    seats = [seat("r1", 4, [given("a", NOW - 10), given("b", NOW - 10)])]
    result = place(seats, [adapter("b")], {})
    assert [e.id for e in result["r1"]] == ["b"]


def test_an_adapter_whose_value_does_not_read_stays_where_it_is():
    seats = [seat("r1", 4, [given("a", NOW - 10)]), seat("r2", 4)]
    demand = {"a": Demand(waiting=2, last_active=NOW)}
    result = place(seats, [], demand, frozen=["a"])
    assert where(result, "a") == ["r1"]


def test_changed_files_are_loaded_anew():
    seats = [seat("r1", 4, [given("a", NOW - 1000)], holds=["/w/a", "/w2/a"])]
    moved = adapter("a", "/w2/a")
    result = place(seats, [moved], {})
    assert [(e.path, e.since) for e in result["r1"]] == [("/w2/a", NOW)]


def test_llama_server_is_given_every_adapter_its_node_holds_in_id_order():
    seats = [
        seat("r1", 0, [given("b", NOW - 50)], holds=["/w/a", "/w/b"]),
        seat("r2", 0, holds=["/w/b"]),
    ]
    result = started_with(seats, [adapter("b"), adapter("a"), adapter("c")], NOW)
    assert [(e.id, e.since) for e in result["r1"]] == [("a", NOW), ("b", NOW - 50)]
    assert [e.id for e in result["r2"]] == ["b"]


def test_demand_tracker_remembers_when_each_adapter_was_last_asked_for():
    tracker = DemandTracker()
    first = tracker.demand({}, ["a", "b"], 100.0)
    assert first["a"].last_active == 100.0  # a new leader: as asked for when it started
    tracker.demand({"a": ModelLoad(in_flight=1.0, active=True)}, ["a", "b"], 200.0)
    later = tracker.demand({}, ["a", "b"], 300.0)
    assert (later["a"].last_active, later["b"].last_active) == (200.0, 100.0)


def test_a_llama_server_started_without_an_adapter_its_node_holds_is_replaced_once():
    """llama-server takes adapters only at start: an engine that started before its node held
    an adapter's file is named for replacement; one that serves it, or said why it would
    not (another base's adapter), is not, so a refusal never replaces it again and again."""
    from test_placement import node, replica

    from llmgw.bus.records import AdapterFailure, HeldAdapter, Shard, Store
    from llmgw.controller.adapters import started_without

    a = Adapter(id="a", served_name="acme/a", base="m", path="/w/a.gguf", rank=4)
    peft = Adapter(id="p", served_name="acme/p", base="m", path="/w/p", rank=4)
    n1 = node("n1")
    store = Store(kind="local", identity="local:n1")
    n1.weights.adapters = [
        HeldAdapter(key="a", format="gguf", path="/w/a.gguf", bytes=1, files=1, store=store)
    ]
    r = replica("r1", [("n1", [0])])

    def shard(phase: str = "ready", **kw) -> Shard:
        return Shard(node="n1", rid="r1", model="m", generation=1, phase=phase, since=0, **kw)

    nodes = {"n1": n1}
    assert started_without(r, "llama-server", [a, peft], nodes, {("n1", "r1"): shard()}) == ["a"]
    served = {("n1", "r1"): shard(adapters=["a"])}
    assert started_without(r, "llama-server", [a], nodes, served) == []
    refused = {("n1", "r1"): shard(adapter_failures=[AdapterFailure(adapter="a", reason="x")])}
    assert started_without(r, "llama-server", [a], nodes, refused) == []
    # vLLM loads adapters while it runs; a starting engine is judged once it is ready
    assert started_without(r, "vllm", [a], nodes, {("n1", "r1"): shard()}) == []
    starting = {("n1", "r1"): shard("starting")}
    assert started_without(r, "llama-server", [a], nodes, starting) == []
