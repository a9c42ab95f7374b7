"""The autoscaler's decisions, time passed in (llmgw/controller/autoscale.py), and the
catalog's autoscale policy rules."""

from __future__ import annotations

import msgspec
import pytest
from record_helpers import shard

from llmgw import catalog
from llmgw.bus import records
from llmgw.controller.autoscale import (
    Autoscaler,
    EngineSaturation,
    FleetShort,
    Limit,
    LoadSum,
    ModelLoad,
    Scaler,
    engine_saturation,
)

POLICY = catalog.Autoscale(
    min_replicas=1,
    max_replicas=8,
    target_in_flight=2,
    scale_up_after=30,
    scale_down_after=60,
    idle_unload_after=0,
)


def _run(scaler: Scaler, load: ModelLoad, start: float, end: float, policy=POLICY, step=1.0):
    """Step once a second from `start` to `end`; the decisions that changed the count."""
    changes = []
    t = start
    while t <= end:
        d = scaler.step(policy, load, t)
        if d.reason:
            changes.append((t, d))
        t += step
    return changes


def _load(in_flight: float, waiting: int = 0) -> ModelLoad:
    return ModelLoad(in_flight=in_flight, waiting=waiting, routers=1, active=in_flight > 0)


def test_a_burst_of_twice_the_target_scales_up_at_once_with_its_figures() -> None:
    s = Scaler(3, started=0.0)
    changes = _run(s, _load(14), 100, 100)
    assert [(t, d.replicas) for t, d in changes] == [(100, 7)]
    assert changes[0][1].reason == "3 -> 7: 14 in flight over 3 replicas, target 2 (panic)"


def test_a_load_above_target_scales_up_only_once_it_held_for_the_up_window() -> None:
    s = Scaler(3, started=0.0)
    _run(s, _load(6), 0, 40)  # what 3 replicas are for
    changes = _run(s, _load(10), 41, 100)  # 5 wanted: not twice 3, so no panic
    assert [(t, d.replicas) for t, d in changes] == [(71, 5)]
    assert changes[0][1].reason == "3 -> 5: 10 in flight over 3 replicas, target 2, for 30 s"


def test_the_load_ending_scales_down_after_the_down_window_and_not_before() -> None:
    s = Scaler(5, started=0.0)
    _run(s, _load(10), 0, 60)
    changes = _run(s, _load(2), 61, 200)
    assert [(t, d.replicas) for t, d in changes] == [(121, 1)]
    assert changes[0][1].reason.startswith("5 -> 1: 2 in flight over 5 replicas, target 2")


def test_a_steady_load_changes_the_count_at_most_once_per_window() -> None:
    s = Scaler(1, started=0.0)
    # steady, noisy load around 7 in flight: 4 replicas, never flapping
    loads = [6.5, 7.5, 7.0, 6.8, 7.2]
    changes = []
    for i in range(600):
        d = s.step(POLICY, _load(loads[i % len(loads)]), float(i))
        if d.reason:
            changes.append(i)
    assert len(changes) <= 2, changes  # one up (panic from 1), at most one settling change
    assert all(b - a >= POLICY.scale_up_after for a, b in zip(changes, changes[1:], strict=False))


def test_max_replicas_bounds_the_count_and_says_so() -> None:
    s = Scaler(2, started=0.0)
    d = s.step(POLICY, _load(100), 10)
    assert d.replicas == 8 and d.limit == Limit(max_replicas=8)
    assert d.limited == "max_replicas 8"


def test_an_idle_model_goes_to_zero_and_a_waiting_request_brings_it_back_at_once() -> None:
    policy = catalog.Autoscale(max_replicas=4, idle_unload_after=120, scale_down_after=60)
    s = Scaler(2, started=0.0)
    changes = _run(s, ModelLoad(), 0, 130, policy)
    # down to the floor after the down window, then to zero once idle that long
    assert [(t, d.replicas) for t, d in changes] == [(60, 1), (120, 0)]
    assert changes[1][1].reason == "1 -> 0: no request for 120 s (idle_unload_after 120)"
    d = s.step(policy, ModelLoad(waiting=1, routers=1, active=True), 131)
    assert d.replicas == 1
    assert d.reason == "0 -> 1: cold start, 0 in flight and 1 waiting over 0 replicas, target 2"


def test_a_fleet_that_places_fewer_than_asked_stops_the_count_growing() -> None:
    s = Scaler(4, started=0.0)
    short = FleetShort(3, 4, (("p", "gpus"),), "0/3 nodes fit")
    d = s.step(POLICY, _load(100), 10, fleet_short=short)
    assert d.replicas == 4 and d.limit == Limit(fleet=short)
    assert d.limited == "the fleet, which places 3 of 4: 0/3 nodes fit"


def _router(name: str, seq: int, **models: ModelLoad) -> records.RouterLoad:
    return records.RouterLoad(
        router=name,
        seq=seq,
        at=0.0,
        models={
            m: records.ModelLoad(in_flight=v.in_flight, waiting=v.waiting)
            for m, v in models.items()
        },
    )


def _engines(waiting: int = 0, kv: float = 0.0, in_flight: float = 4) -> ModelLoad:
    return ModelLoad(
        in_flight=in_flight,
        routers=1,
        active=True,
        engines=EngineSaturation(engines=2, waiting=waiting, kv_cache=kv),
    )


def test_engines_that_queue_or_fill_their_kv_cache_ask_for_one_more_after_the_window() -> None:
    # 4 in flight over 2 replicas is on target: only the engines' own word asks for more
    queued = Scaler(2, started=0.0)
    changes = _run(queued, _engines(waiting=12), 0, 40)
    assert [(t, d.replicas) for t, d in changes] == [(30, 3)]
    assert changes[0][1].reason == (
        "2 -> 3: 4 in flight over 2 replicas, target 2, 12 queued in the engines "
        "(over 5 a replica), for 30 s"
    )
    full = Scaler(2, started=0.0)
    changes = _run(full, _engines(kv=0.93), 0, 40)
    assert [(t, d.replicas) for t, d in changes] == [(30, 3)]
    assert "an engine's KV cache 93% full (over 80%)" in changes[0][1].reason


def test_engines_below_their_thresholds_or_with_the_signal_off_ask_for_nothing() -> None:
    calm = Scaler(2, started=0.0)
    assert _run(calm, _engines(waiting=10, kv=0.8), 0, 40) == []  # 5 a replica, not over
    off = msgspec.structs.replace(POLICY, engine_queue_per_replica=0, kv_cache_full=0)
    ignored = Scaler(2, started=0.0)
    assert _run(ignored, _engines(waiting=50, kv=1.0), 0, 40, policy=off) == []


def _lease(node: str, *loads: records.EngineLoad) -> records.Lease:
    return records.Lease(
        node=node,
        seq=1,
        time=0.0,
        started_at=0.0,
        memory=records.Memory(total_bytes=1, available_bytes=1),
        engines=list(loads),
    )


def _replica(rid: str, model: str, node: str, phase: str = "ready") -> records.Replica:
    return records.Replica(
        model=model,
        rid=rid,
        profile="p",
        phase=phase,  # type: ignore[arg-type]
        members=[records.ReplicaMember(node=node, rank=0, gpus=[], port=18000)],
    )


def test_a_node_speaks_only_for_its_own_ready_replicas_of_their_own_model() -> None:
    replicas = {
        "r1": _replica("r1", "m", "n1"),
        "r2": _replica("r2", "m", "n2"),
        "r3": _replica("r3", "m", "n1", phase="placed"),
    }
    leases = {
        "n1": _lease(
            "n1",
            records.EngineLoad(rid="r1", model="m", waiting=3, kv_cache=0.5),
            records.EngineLoad(rid="r2", model="m", waiting=900, kv_cache=1.0),  # n2's
            records.EngineLoad(rid="r1", model="other", waiting=900),  # another model
            records.EngineLoad(rid="r3", model="m", waiting=900),  # not ready
        ),
        "n2": _lease("n2", records.EngineLoad(rid="r2", model="m", waiting=4, kv_cache=0.7)),
        "n3": _lease("n3", records.EngineLoad(rid="r1", model="m", waiting=900)),  # silent
    }
    health = {
        n: records.Health(node=n, phase="ready" if n != "n3" else "unreachable", since=0.0)
        for n in leases
    }
    # r3 has no engine reported yet: it does not serve (fleetstate/serving.py)
    shards = {
        (n, rid): shard(n, rid, "ready", endpoint=f"{n}:18000")
        for n, rid in (("n1", "r1"), ("n2", "r2"))
    }
    assert engine_saturation(leases, health, replicas, shards) == {
        "m": EngineSaturation(engines=2, waiting=7, kv_cache=0.7)
    }


def test_two_routers_are_summed_and_one_rewriting_its_key_is_not_counted_twice() -> None:
    sums = LoadSum(stale_after=5)
    loads = {"r1": _router("r1", 1, tiny=_load(3)), "r2": _router("r2", 1, tiny=_load(4))}
    for name, load in loads.items():
        sums.saw(name, load, 0.0)
    assert sums.sum(loads, 1.0)["tiny"].in_flight == 7
    loads["r1"] = _router("r1", 2, tiny=_load(3))  # its next write: the same requests
    sums.saw("r1", loads["r1"], 1.0)
    assert sums.sum(loads, 2.0)["tiny"].in_flight == 7
    assert sums.sum(loads, 2.0)["tiny"].routers == 2


def test_a_router_whose_key_stopped_moving_counts_no_more() -> None:
    sums = LoadSum(stale_after=5)
    loads = {"r1": _router("r1", 1, tiny=_load(3)), "r2": _router("r2", 1, tiny=_load(4))}
    sums.saw("r1", loads["r1"], 0.0)
    sums.saw("r2", loads["r2"], 0.0)
    for t in range(1, 10):
        loads["r2"] = _router("r2", 1 + t, tiny=_load(4))
        sums.saw("r2", loads["r2"], float(t))
    assert sums.sum(loads, 9.0)["tiny"].in_flight == 4
    assert sums.current(loads, 9.0) == ["r2"]


def _model(**autoscale) -> catalog.Model:
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": "tiny",
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"path": "/w/tiny.gguf"},
                            "gpus_per_node": 0,
                        }
                    ],
                    "autoscale": autoscale,
                }
            ]
        }
    )[0]


def test_a_controller_taking_over_starts_from_the_count_the_last_leader_wrote() -> None:
    model = _model(max_replicas=6, scale_up_after=30)
    desired = {"tiny": records.Desired(model="tiny", replicas=1, auto=True)}
    written = {"tiny": records.Scale(model="tiny", replicas=5, reason="1 -> 5: ...")}
    loads = {"r1": _router("r1", 1, tiny=_load(9))}  # asks for 5: what was decided
    a = Autoscaler()
    a.loads.saw("r1", loads["r1"], 0.0)
    out = a.decide(
        catalog={"tiny": model},
        desired=desired,
        scales=written,
        loads=loads,
        placed={"tiny": 2},  # the scale-up was under way: 2 of 5 placed
        placements={},
        now=0.0,
        wall=0.0,
    )
    assert out == {}  # nothing to change: the count stays 5, nothing more is asked
    assert a.scalers["tiny"].replicas == 5


def test_the_catalog_refuses_an_autoscale_policy_that_cannot_work() -> None:
    with pytest.raises(catalog.CatalogError) as e:
        _model(min_replicas=0, max_replicas=2, target_in_flight=0, scale_up_aftr=3)
    text = str(e.value)
    assert "autoscale.min_replicas: 0 is not a floor" in text
    assert "scale to zero is idle_unload_after" in text
    assert "autoscale.target_in_flight: expected a number > 0" in text
    assert "autoscale.scale_up_aftr: unknown field (did you mean 'scale_up_after'?)" in text
    with pytest.raises(catalog.CatalogError, match="max_replicas: expected an integer >= 1"):
        _model()
    with pytest.raises(catalog.CatalogError, match="min_replicas 3 is above max_replicas 2"):
        _model(min_replicas=3, max_replicas=2)
    with pytest.raises(catalog.CatalogError) as e:
        _model(max_replicas=2, hold_max=10**6, hold_timeout=-1, kv_cache_full=1.5)
    text = str(e.value)
    assert "autoscale.hold_max: expected an integer <= 100000" in text
    assert "autoscale.hold_timeout: expected a number >= 0" in text
    assert "autoscale.kv_cache_full: expected a fraction 0..1 (0: off)" in text


def test_an_autoscale_policy_survives_the_bucket_round_trip() -> None:
    model = _model(max_replicas=4, idle_unload_after=300, ttft_target_ms=500)
    back = catalog.decode_model(catalog.encode_model(model), "tiny")
    assert back.autoscale == model.autoscale
    assert back.autoscale.idle_unload_after == 300 and back.autoscale.min_replicas == 1


def test_a_fleet_limit_whose_text_moves_by_itself_is_not_written_again() -> None:
    """The fleet's explanation embeds what the nodes have (free RAM moves at every
    heartbeat): the limit is compared as data, so only a new decision is a new write."""
    model = _model(max_replicas=6, scale_up_after=30)
    desired = {"tiny": records.Desired(model="tiny", replicas=1, auto=True)}
    loads = {"r1": _router("r1", 1, tiny=_load(100))}
    a = Autoscaler()
    a.loads.saw("r1", loads["r1"], 0.0)

    def short(free_gb: float, reason: str = "ram") -> records.PlacementRecord:
        return records.PlacementRecord(
            model="tiny",
            desired=2,
            placed=1,
            refused=[records.RefusedNodes(profile="p", reason=reason, nodes=1, least=int(free_gb))],
            explanation=f"0/1 nodes fit: 1 short of RAM ({free_gb} GB free)",
        )

    scales: dict[str, records.Scale] = {
        "tiny": records.Scale(model="tiny", replicas=2, reason="1 -> 2: ...")
    }

    def decide(rec: records.PlacementRecord, now: float) -> dict[str, records.Scale]:
        out = a.decide(
            catalog={"tiny": model},
            desired=desired,
            scales=scales,
            loads=loads,
            placed={"tiny": 1},
            placements={"tiny": rec},
            now=now,
            wall=now,
        )
        scales.update(out)
        return out

    first = decide(short(7.1), 1.0)
    assert first["tiny"].limited.startswith("the fleet, which places 1 of 2")
    assert decide(short(6.9), 2.0) == {}  # the same decision, other numbers
    assert decide(short(6.9, reason="gpus"), 3.0) != {}  # another reason: said
