"""The fleet page's document, its router-side cost, and the metrics' pure parts."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import anyio
import msgspec
import pytest
from import_helpers import loaded
from prometheus_client import CollectorRegistry, Histogram
from record_helpers import shard
from router_helpers import router_settings
from waiting import until

from llmgw.agent.config import ConfigError, parse_config
from llmgw.bus import records
from llmgw.bus.client import Bus
from llmgw.cli.status import gpu_line, gpu_lines, render
from llmgw.controller.metrics import main_reason, unplaced_count
from llmgw.fleetstate.decode import FleetRecords
from llmgw.router.fleet import NO_FABRIC, HistogramWindow, encode_state
from llmgw.router.fleet import fleet_state as _fleet_state
from llmgw.router.proxy import ProxySettings
from llmgw.router.service import Router
from llmgw.sim.bare import SimNode, inventory

GB = 10**9


def fleet_state(r: FleetRecords, load: dict, now: float, router: dict) -> dict:
    """The page's document as the page reads it: encoded, then parsed."""
    return msgspec.json.decode(encode_state(_fleet_state(r, load, now, router)))


def _replica(model: str, rid: str, node: str, gpus: list[str], phase="ready") -> records.Replica:
    return records.Replica(
        model=model,
        rid=rid,
        profile="p",
        members=[records.ReplicaMember(node=node, rank=0, gpus=gpus, port=18000)],
        phase=phase,
        endpoint="10.0.0.1:18000" if phase == "ready" else None,
    )


def test_nodes_are_grouped_by_fabric_with_free_gpus_and_what_llmgw_allocated():
    a = inventory("a", gpus=4, fabric="ib-a")
    b = inventory("b", gpus=2)
    r = FleetRecords(
        # the value names another node: the key's id is the one shown
        nodes={"a": a, "b": msgspec.structs.replace(b, node="evil")},
        ops={"a": records.NodeOps(node="a", gpus_out=["GPU-a-03"])},
        replicas={
            "r1": _replica("m", "r1", "a", ["GPU-a-00", "GPU-a-01"]),
            # a stopped replica's engines are gone: its GPUs are free
            "r0": _replica("m", "r0", "a", ["GPU-a-02"], phase="stopped"),
        },
    )
    state = fleet_state(r, {}, now=100.0, router={})
    assert [(f["name"], [n["id"] for n in f["nodes"]]) for f in state["fabrics"]] == [
        ("ib-a", ["a"]),
        (NO_FABRIC, ["b"]),
    ]
    node_a = state["fabrics"][0]["nodes"][0]
    assert node_a["gpus_free"] == 1  # 0 and 1 held by r1, 3 out of service
    assert node_a["gpus"][0]["allocated"] == {
        "model": "m",
        "replica": "r1",
        "bytes": 80 * GB,
        "whole": True,
        "shared": False,
        "used_bytes": None,
        "outgrown": False,
    }
    assert node_a["gpus"][2]["allocated"] is None
    assert node_a["gpus"][3]["out_of_service"] is True
    assert state["fabrics"][1]["nodes"][0]["phase"] == "unjudged"  # no health record yet


def test_a_model_waiting_says_how_many_replicas_and_why():
    rec = records.PlacementRecord(
        model="big",
        desired=2,
        placed=0,
        waiting=2,
        judged=6,
        refused=[
            records.RefusedNodes(profile="p", reason="gpus", nodes=4, needs=16),
            records.RefusedNodes(profile="p", reason="lost", nodes=2),
        ],
        explanation="0/6 nodes fit: 4 short of free GPUs, 2 lost",
    )
    state = fleet_state(FleetRecords(placements={"big": rec}), {}, now=0.0, router={})
    (model,) = state["models"]
    assert model["placement"]["unplaced"] == 2
    assert model["placement"]["explanation"] == rec.explanation
    assert [x["nodes"] for x in model["placement"]["refused"]] == [4, 2]
    assert unplaced_count(rec) == 2 and main_reason(rec) == "gpus"


def _ready_shard(node: str, rid: str) -> records.Shard:
    return shard(node, rid, "ready", endpoint="10.0.0.1:18000")


def _health(node: str, phase: str, since: float) -> records.Health:
    return records.Health(node=node, phase=phase, since=since, reason="lease seq 4 still")


def test_a_replica_on_a_node_that_stopped_beating_says_so_beside_its_phase():
    """For 45 s after a node stopped its heartbeats `llmgw status` said its replica was
    ready with nothing beside it: the node's phase is shown beside the replica's. On an
    unreachable node it still serves (the routers ask its engine directly and judge it by
    their own health checks); on a lost one it does not."""
    r = FleetRecords(
        nodes={n: inventory(n, gpus=1) for n in "abc"},
        health={
            "a": _health("a", "unreachable", 80.0),
            "b": _health("b", "ready", 10.0),
            "c": _health("c", "lost", 40.0),
        },
        desired={"m": records.Desired(model="m", replicas=3)},
        replicas={
            "r1": _replica("m", "r1", "a", ["GPU-a-00"]),
            "r2": _replica("m", "r2", "b", ["GPU-b-00"]),
            "r3": _replica("m", "r3", "c", ["GPU-c-00"]),
        },
        shards={
            ("a", "r1"): _ready_shard("a", "r1"),
            ("b", "r2"): _ready_shard("b", "r2"),
            ("c", "r3"): _ready_shard("c", "r3"),
        },
    )
    state = fleet_state(r, {}, now=100.0, router={})
    (m,) = state["models"]
    assert (m["desired"], m["ready"], sorted(m["serving"])) == (3, 2, ["a", "b"])
    r1 = next(x for x in m["replicas"] if x["rid"] == "r1")
    assert r1["state"] == "ready, node a unreachable for 20 s" and r1["serving"]
    assert r1["members"][0]["node_phase"] == "unreachable"
    r3 = next(x for x in m["replicas"] if x["rid"] == "r3")
    assert r3["state"] == "ready, node c lost for 60 s" and not r3["serving"]
    assert "r3 ready, node c lost for 60 s" in m["why_not"]
    text = render(build_fleet(r, 100.0), now=100.0)
    assert "  m: 2/3 ready, 1 ready but not serving  (fixed)" in text
    assert "    r1  ready, node a unreachable for 20 s  on a" in text
    assert text.index("\nmodels\n") < text.index("\nnodes\n")


def build_fleet(r: FleetRecords, now: float):
    from llmgw.fleetstate.build import fleet

    return fleet(r, now, bucket="llmgw")


def test_the_page_says_why_a_replica_failed_and_what_the_agent_cannot_serve():
    inv = msgspec.structs.replace(
        inventory("a", gpus=1), metrics_error="port 9464 taken: set metrics.listen"
    )
    record = shard(
        "a",
        "r1",
        "failed",
        reason="exited with code 1 while loading",
        output_tail=["llama_model_load: error loading model"],
        restarts=3,
    )
    r = FleetRecords(
        nodes={"a": inv},
        desired={"m": records.Desired(model="m", replicas=1)},
        replicas={"r1": _replica("m", "r1", "a", ["GPU-a-00"], phase="failed")},
        shards={("a", "r1"): record},
    )
    state = fleet_state(r, {}, now=100.0, router={})
    (m,) = state["models"]
    (rep,) = m["replicas"]
    assert rep["failure"] == "a: exited with code 1 while loading (restarts 3)"
    assert rep["shards"][0]["output_tail"] == ["llama_model_load: error loading model"]
    assert "exited with code 1 while loading" in m["why_not"]
    node = state["fabrics"][0]["nodes"][0]
    assert node["metrics_error"] == "port 9464 taken: set metrics.listen"
    text = render(build_fleet(r, 100.0), now=100.0)
    assert "  metrics port 9464 taken: set metrics.listen" in text


def test_gpu_memory_parts_add_up_to_what_is_in_use_on_recorded_nvml_answers():
    """The simulated fleet's every GPU read "in use 0.6 GB (llmgw 0.0 GB, others 0.0 GB)":
    memory no listed process holds is shown as unaccounted."""
    from llmgw.agent.discovery.gpus import discover_gpus
    from llmgw.sim.nvml import from_spec

    gpus = discover_gpus(from_spec("count=2,node=a,held=1:5"))
    inv = msgspec.structs.replace(inventory("a", gpus=0), gpus=gpus)
    state = fleet_state(FleetRecords(nodes={"a": inv}), {}, now=1.0, router={})
    shown = state["fabrics"][0]["nodes"][0]["gpus"]
    for g in shown:
        assert g["own_bytes"] + g["foreign_bytes"] + g["unaccounted_bytes"] == g["used_bytes"]
    assert shown[0]["unaccounted_bytes"] == shown[0]["used_bytes"] > 0  # nothing listed
    assert shown[1]["foreign_bytes"] == 5 * GB
    view = build_fleet(FleetRecords(nodes={"a": inv}), 1.0)
    assert gpu_line(view.nodes["a"].gpus[0]) == (
        "GPU 0: in use 0.6 of 85.5 GB (llmgw 0.0, others 0.0, unaccounted 0.6)"
    )
    idle = msgspec.structs.replace(inv, gpus=discover_gpus(from_spec("count=4,node=a")))
    assert gpu_lines(build_fleet(FleetRecords(nodes={"a": idle}), 1.0).nodes["a"].gpus) == [
        "GPU 0-3: in use 0.6 of 85.5 GB (llmgw 0.0, others 0.0, unaccounted 0.6) each"
    ]


def test_every_current_routers_load_is_summed_per_model_and_a_stale_one_left_out():
    def router(name: str, at: float, **models: records.ModelLoad) -> records.RouterLoad:
        return records.RouterLoad(router=name, seq=1, at=at, models=dict(models))

    r = FleetRecords(
        desired={"m": records.Desired(model="m", replicas=1)},
        loads={
            "r1": router("r1", 99.0, m=records.ModelLoad(in_flight=2.5, waiting=1, ttft_ms=80)),
            "r2": router("r2", 100.0, m=records.ModelLoad(in_flight=1.0, waiting=3, ttft_ms=300)),
            # its key stopped moving a minute ago: a router gone, not counted
            "old": router("old", 40.0, m=records.ModelLoad(in_flight=50, waiting=50)),
        },
    )
    state = fleet_state(r, {}, now=100.0, router={})
    (m,) = state["models"]
    assert m["fleet_load"] == {"in_flight": 3.5, "queued": 4, "ttft_ms": 300}
    assert state["load"]["routers"] == 2


def test_the_unplaced_reason_is_the_block_else_the_one_refusing_most_nodes():
    blocked = records.PlacementRecord(model="m", desired=1, placed=0, blocked="unknown-profile")
    assert main_reason(blocked) == "unknown-profile"
    empty = records.PlacementRecord(model="m", desired=1, placed=0)
    assert main_reason(empty) == "none"
    # a rollout's replacement waiting while the old replica still counts as placed
    rollout = records.PlacementRecord(model="m", desired=1, placed=1, waiting=1)
    assert unplaced_count(rollout) == 1


def test_time_to_first_byte_counts_only_the_last_window():
    registry = CollectorRegistry()
    h = Histogram("ttfb", "t", ["model", "replica"], buckets=(0.1, 0.5, 1, 5), registry=registry)
    window = HistogramWindow(h, window=60)
    for _ in range(9):
        h.labels("m", "r1").observe(4.0)  # slow, long ago
    first = window.sample(0.0)["m"]
    assert first["count"] == 9 and first["window_s"] is None  # since the router started
    for _ in range(10):
        h.labels("m", "r2").observe(0.2)  # both replicas of one model count
    assert window.sample(30.0)["m"]["count"] == 19
    later = window.sample(61.0)["m"]  # the sample at 0 is a minute old: the base
    assert later["count"] == 10 and later["window_s"] == 60
    assert 0.1 < later["p50_s"] <= 0.5 and later["p95_s"] <= 0.5
    assert later["mean_s"] == pytest.approx(0.2)
    quiet = window.sample(200.0)["m"]  # nothing new within a minute
    assert quiet["count"] == 0 and quiet["p50_s"] is None


def test_a_bad_metrics_address_names_the_key():
    with pytest.raises(ConfigError, match="metrics.listen.*HOST:PORT"):
        parse_config('[metrics]\nlisten = "9464"\n')


async def _get(url: str) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status, await r.read(), dict(r.headers)


@pytest.mark.anyio
async def test_the_router_follows_nodes_only_while_a_page_asks(nats_settings, bus):
    sim = SimNode(bus, inventory("n1", gpus=2), heartbeat=0.2)
    await sim.register()
    router = Router(router_settings())
    async with anyio.create_task_group() as tg:
        tg.start_soon(sim.run)
        await tg.start(router.serve_bucket, lambda: Bus.connect(nats_settings, give_up_after=5))
        router.page.watch.idle_after = 0.5
        await until(lambda: _true(router.table.synced))
        status, page, headers = await _get(router.url + "/")
        assert status == 200 and b"/fleet/fleet.js" in page
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert router.page.watch.watching is False  # the page alone reads nothing

        status, body, _ = await _get(router.url + "/fleet/state")
        state = msgspec.json.decode(body)
        assert status == 200 and state["router"]["fleet_read"] is True
        assert [n["id"] for f in state["fabrics"] for n in f["nodes"]] == ["n1"]
        assert router.page.watch.watching is True

        # nobody asks any more: the watches stop, and what they held is dropped
        await until(lambda: _true(not router.page.watch.watching))
        assert router.page.watch.records.nodes == {}
        status, body, _ = await _get(router.url + "/fleet/state")  # and start again
        assert [n["id"] for f in msgspec.json.decode(body)["fabrics"] for n in f["nodes"]] == ["n1"]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_router_only_run_shows_its_static_models_at_once(tmp_path):
    from llmgw import catalog

    # never reached: the page asks no engine
    model = catalog.Model(id="tiny", served_name="tiny-chat", endpoints=["http://127.0.0.1:9"])
    router = Router(router_settings())
    async with anyio.create_task_group() as tg:
        await tg.start(router.serve_static, [model])
        status, body, _ = await _get(router.url + "/fleet/state")
        state = msgspec.json.decode(body)
        assert status == 200 and [m["id"] for m in state["models"]] == ["tiny"]
        # read in full: no bucket to wait for (a bucket router says false until it has read)
        assert state["router"]["fleet_read"] is True
        assert state["fabrics"] == [] and router.page.watch.watching is False
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_router_without_the_page_answers_404_there():
    router = Router(replace(router_settings(), proxy=ProxySettings(page=False)))
    async with anyio.create_task_group() as tg:
        await tg.start(router.serve_static, [])
        for path in ("/", "/fleet/state", "/fleet/fleet.js"):
            status, _, _ = await _get(router.url + path)
            assert status == 404, path
        tg.cancel_scope.cancel()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.anyio
async def test_a_metrics_address_taken_stops_the_component_naming_it():
    import socket

    from llmgw.errors import stated
    from llmgw.metrics_http import MetricsListenError, serve_metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BaseException) as raised:
            async with anyio.create_task_group() as tg:
                await tg.start(serve_metrics, CollectorRegistry(), ("127.0.0.1", port))
    problem = stated(raised.value)  # what the CLI prints, one line, no traceback
    assert isinstance(problem, MetricsListenError)
    assert f"127.0.0.1:{port}" in str(problem) and "address already in use" in str(problem)


def test_no_chromium_skips_except_where_it_is_required(tmp_path, monkeypatch):
    from chromium import REQUIRE, find_chromium

    monkeypatch.setenv("PATH", str(tmp_path))  # no browser on it
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception):
        find_chromium()
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match=REQUIRE):
        find_chromium()


def test_the_read_model_imports_no_nats_and_no_component():
    """The controller, the router and the CLI all import it: it must import none of them,
    nor NATS (only llmgw/bus's client does)."""
    components = ("llmgw.controller", "llmgw.router", "llmgw.agent", "llmgw.cli")
    got = loaded(
        "llmgw.fleetstate.build, llmgw.fleetstate.decode",
        packages=("nats", "anyio"),
        modules=("llmgw.bus.client",),
        prefixes=components,
    )
    assert got == []
