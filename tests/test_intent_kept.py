"""A value of an intent key that does not read never fails open (issue 27): every family an
operator or a controller writes keeps its last good value, the controller acts on it, and
`llmgw status` and the controller's metrics say so. Real nats-server, real controller."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from prometheus_client import generate_latest
from record_helpers import shard
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus
from llmgw.cli.status import gather, render
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.sim.bare import SimNode, inventory

pytestmark = pytest.mark.anyio

FAST = dict(unreachable_after=0.6, lost_after=1.5, leader_ttl=1.0, tick=0.05, resync=0.5)
GARBAGE = b'{"node": "a", "cordoned": "yes"'  # cut short by hand: not JSON


def _model(mid: str = "m", autoscale: dict | None = None) -> catalog.Model:
    profile = {
        "name": "p",
        "engine": "vllm",
        "weights": {"source": "hf://org/m"},
        "gpus_per_node": 1,
    }
    entry: dict = {"id": mid, "profiles": [profile]}
    if autoscale:
        entry["autoscale"] = autoscale
    return catalog.validate_models({"models": [entry]})[0]


async def _start(bus: Bus, tg, *nodes: records.NodeInventory) -> None:
    for inv in nodes:
        sim = SimNode(bus, inv)
        await sim.register()
        tg.start_soon(sim.run)


async def _replicas(bus: Bus) -> list[records.Replica]:
    got = await bus.list("replicas.m.*", lambda b: b)
    out = []
    for e in got.values():
        try:
            out.append(records.decode(e.value, records.Replica))
        except msgspec.DecodeError:
            pass  # the one garbled by the test
    return out


async def _answered(bus: Bus, desired_at: float) -> records.PlacementRecord | None:
    raw = await bus.get_raw(keys.placement("m"))
    rec = None if raw is None else records.decode(raw[0], records.PlacementRecord)
    return rec if rec is not None and rec.desired_at == desired_at else None


async def test_a_garbled_ops_keeps_a_drained_node_out_of_placement_and_status_says_so(
    bus, second_bus
):
    """A garbled ops.<node> was read as absent: the drained and cordoned node took new
    replicas again while `llmgw status` printed "cordoned"."""
    async with anyio.create_task_group() as tg:
        await _start(bus, tg, inventory("a", gpus=2), inventory("b", gpus=2))
        await bus.put(keys.ops("a"), records.NodeOps(node="a", state="draining"))
        await bus.put(keys.catalog("m"), catalog.encode_model(_model()))
        await bus.put(keys.desired("m"), records.Desired(model="m", replicas=1, updated_at=1.0))
        controller = Controller(second_bus, ControllerSettings(**FAST))
        tg.start_soon(controller.run)
        await until(lambda: _answered(bus, 1.0))
        await bus.put(keys.ops("a"), GARBAGE)
        await until(lambda: _true(keys.ops("a") in controller.view.unreadable))
        # more replicas than b alone holds: one may land on a only if its drain is forgotten
        await bus.put(keys.desired("m"), records.Desired(model="m", replicas=3, updated_at=2.0))
        rec = await until(lambda: _answered(bus, 2.0))
        assert rec.placed == 2
        assert {m.node for r in await _replicas(bus) for m in r.members} == {"b"}
        assert controller.view.ops["a"].drain  # the last good value, acted on

        fleet = await gather(bus)
        (u,) = fleet.unreadable
        assert (u.key, u.reading) == ("ops.a", "cordoned")  # a new reader read nothing good
        assert fleet.nodes["a"].ops is not None and fleet.nodes["a"].ops.cordoned
        text = render(fleet, now=fleet.now)
        assert "ops.a (revision " in text and "does not read: " in text
        assert "the node is taken as cordoned" in text
        scraped = generate_latest(controller.metrics.registry).decode()
        assert 'llmgw_controller_unreadable_keys{family="ops",reading="kept"} 1.0' in scraped
        tg.cancel_scope.cancel()


async def test_a_controller_started_after_ops_stopped_reading_places_nothing_there(bus, second_bus):
    async with anyio.create_task_group() as tg:
        await _start(bus, tg, inventory("a", gpus=2), inventory("b", gpus=1))
        await bus.put(keys.ops("a"), GARBAGE)  # never read good by this controller
        await bus.put(keys.catalog("m"), catalog.encode_model(_model()))
        await bus.put(keys.desired("m"), records.Desired(model="m", replicas=2, updated_at=1.0))
        tg.start_soon(Controller(second_bus, ControllerSettings(**FAST)).run)
        rec = await until(lambda: _answered(bus, 1.0))
        assert rec.placed == 1 and "cordoned" in rec.explanation
        assert {m.node for r in await _replicas(bus) for m in r.members} == {"b"}
        tg.cancel_scope.cancel()


async def test_an_ops_past_the_size_limit_is_read_as_one_that_does_not_read(bus, second_bus):
    """Too big for the controller to read (it reads at most its bucket's value limit): a
    cordon, as for any ops that never read, never an absent key (a node open to placement)."""
    second_bus.max_value_bytes = 8000  # as a bucket made by hand with a smaller limit
    async with anyio.create_task_group() as tg:
        await _start(bus, tg, inventory("a", gpus=2), inventory("b", gpus=1))
        big = records.NodeOps(node="a", state="active", reason="x" * 10_000)
        await bus.put(keys.ops("a"), big)
        await bus.put(keys.catalog("m"), catalog.encode_model(_model()))
        await bus.put(keys.desired("m"), records.Desired(model="m", replicas=2, updated_at=1.0))
        controller = Controller(second_bus, ControllerSettings(**FAST))
        tg.start_soon(controller.run)
        rec = await until(lambda: _answered(bus, 1.0))
        assert rec.placed == 1 and "cordoned" in rec.explanation
        assert {m.node for r in await _replicas(bus) for m in r.members} == {"b"}
        problem = controller.view.unreadable[keys.ops("a")]
        assert problem.reading == "cordoned" and "over the limit of 8,000" in problem.why
        tg.cancel_scope.cancel()


async def _true(value) -> bool:
    return bool(value)


# family -> (the key, what the test writes so that the controller has a good value)
OPERATOR_FAMILIES = ["desired", "catalog", "ops"]
CONTROLLER_FAMILIES = ["rollout", "scale", "placement", "health", "fabrics", "replicas", "assign"]


async def _garbled(bus, second_bus, tg, family: str):
    """A fleet of two nodes (b cordoned), model m placed once on a, a controller leading;
    then `family`'s key garbled after the controller read a good value of it. Returns the
    controller, the key, its table in the view, the id there, the good value, the replica."""
    autoscale = {"min_replicas": 1, "max_replicas": 2} if family == "scale" else None
    await _start(bus, tg, inventory("a", gpus=2), inventory("b", gpus=2))
    await bus.put(keys.ops("b"), records.NodeOps(node="b", state="cordoned", reason="fans"))
    await bus.put(keys.catalog("m"), catalog.encode_model(_model(autoscale=autoscale)))
    desired = records.Desired(model="m", replicas=1, updated_at=1.0, auto=family == "scale")
    await bus.put(keys.desired("m"), desired)
    controller = Controller(second_bus, ControllerSettings(**FAST))
    tg.start_soon(controller.run)
    view = controller.view
    (placed,) = await until(lambda: _replicas(bus))
    rid = placed.rid
    key, table, id_ = {
        "desired": (keys.desired("m"), view.desired, "m"),
        "catalog": (keys.catalog("m"), view.catalog, "m"),
        "ops": (keys.ops("b"), view.ops, "b"),
        "rollout": (keys.rollout("m"), view.rollouts, "m"),
        "scale": (keys.scale("m"), view.scales, "m"),
        "placement": (keys.placement("m"), view.placements, "m"),
        "health": (keys.health("a"), view.health, "a"),
        "fabrics": (keys.fabric("node-a"), view.fabrics, "node-a"),
        "replicas": (keys.replica("m", rid), view.replicas, rid),
        "assign": (keys.assign("a", rid), view.assigns, ("a", rid)),
    }[family]
    await until(lambda: _true(table.get(id_)))
    good = table[id_]
    revision = await bus.put(key, b'{"garbled": ')
    return controller, key, table, id_, good, placed, revision


def _acting_as_before(controller: Controller, placed: records.Replica) -> None:
    """The replica stays where it is, serving, and nothing more is placed or drained."""
    view = controller.view
    assert [(r.rid, r.phase) for r in view.replicas.values()] == [(placed.rid, placed.phase)]
    assert {m.node for m in placed.members} == {"a"}
    assert [a.action for a in view.assigns.values()] == ["run"]


@pytest.mark.parametrize("family", OPERATOR_FAMILIES)
async def test_an_operators_key_that_stops_reading_keeps_its_last_good_value_and_is_said(
    bus, second_bus, family
):
    async with anyio.create_task_group() as tg:
        controller, key, table, id_, good, placed, _ = await _garbled(bus, second_bus, tg, family)
        view = controller.view
        await until(lambda: _true(key in view.unreadable))
        await anyio.sleep(0.5)  # passes go on
        assert table[id_] == good, f"{key} read as something else than its last good value"
        assert view.unreadable[key].reading == "kept"
        _acting_as_before(controller, placed)

        fleet = await gather(bus)
        (u,) = [u for u in fleet.unreadable if u.key == key]
        assert u.why and u.revision > 0
        assert f"{key} (revision {u.revision}) does not read: " in render(fleet, now=fleet.now)
        if family != "ops":
            assert key in fleet.models["m"].unreadable
        scraped = generate_latest(controller.metrics.registry).decode()
        assert (
            f'llmgw_controller_unreadable_keys{{family="{family}",reading="kept"}} 1.0' in scraped
        )
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("family", CONTROLLER_FAMILIES)
async def test_a_controllers_record_that_stops_reading_is_kept_and_written_back(
    bus, second_bus, family
):
    """Kept and compared as kept, a garbled record of the controller's own was never written
    again: a reader started since (a restarted router, `llmgw status`) could not read it."""
    async with anyio.create_task_group() as tg:
        controller, key, _, _, good, placed, revision = await _garbled(bus, second_bus, tg, family)

        async def written_back():
            raw = await bus.get_raw(key)
            if raw is None or raw[1] <= revision:
                return None
            return records.decode(raw[0], type(good)) if family != "catalog" else raw

        back = await until(written_back)
        if "epoch" in good.__struct_fields__:
            back = msgspec.structs.replace(back, epoch=good.epoch)
        assert back == good  # the last good value, not one decided again
        await anyio.sleep(0.3)
        _acting_as_before(controller, placed)
        assert not [u for u in (await gather(bus)).unreadable if u.key == key]
        tg.cancel_scope.cancel()


def test_the_cordon_of_an_ops_that_never_read_reads_as_the_wire_format_says():
    """The safe reading is built from the wire format NodeOps always reads."""
    from llmgw.fleetstate.decode import FleetRecords

    r = FleetRecords()
    r.apply("ops.n1", b"[1, 2]", 5)
    assert r.ops["n1"].unschedulable and not r.ops["n1"].drain
    assert r.unreadable["ops.n1"].reading == "cordoned"
    r.apply("ops.n1", msgspec.json.encode(records.NodeOps(node="n1")), 6)
    assert not r.ops["n1"].unschedulable and not r.unreadable


def test_the_router_keeps_an_autoscaled_models_intent_and_a_lost_node_when_they_garble():
    """The router's table reads through the same decoder: a garbled desired.<model> kept the
    model autoscaled (its requests held while it is cold, not refused), and a garbled
    health.<node> does not make a lost node's engine routable again."""
    from llmgw.router.table import EndpointTable

    table = EndpointTable()
    model = _model(autoscale={"max_replicas": 2, "idle_unload_after": 60})
    table.apply(keys.catalog("m"), catalog.encode_model(model), 1)
    auto = records.Desired(model="m", replicas=0, auto=True)
    table.apply(keys.desired("m"), msgspec.json.encode(auto), 2)
    member = records.ReplicaMember(node="a", rank=0, gpus=["GPU-a-00"], port=18000)
    replica = records.Replica(model="m", rid="r1", profile="p", members=[member], phase="ready")
    table.apply(keys.replica("m", "r1"), msgspec.json.encode(replica), 3)
    record = shard("a", "r1", "ready", endpoint="h:1")
    table.apply(keys.shard("a", "r1"), msgspec.json.encode(record), 4)
    lost = records.Health(node="a", phase="lost", since=1.0)
    table.apply(keys.health("a"), msgspec.json.encode(lost), 5)
    assert table.autoscaled("m") and table.route("m").backends == []

    table.apply(keys.desired("m"), b'{"model": "m", "auto": "yes"', 6)
    table.apply(keys.health("a"), b"{}", 7)
    assert table.autoscaled("m")
    assert table.route("m").backends == []  # still on a lost node
    assert set(table.records.unreadable) == {"desired.m", "health.a"}


async def test_a_watch_of_assignments_keeps_the_last_good_one_when_it_garbles(bus):
    """The agent follows assign.<node>.* with Bus.watch: a garbled assignment was given to it
    as a deletion, and it stopped the engine. A deletion is still one."""
    from llmgw.bus.client import Synced, decoder

    run = records.Assignment(model="m", rid="r1", profile="p", action="run", generation=1)
    await bus.put(keys.assign("a", "r1"), run)
    seen: list[records.Assignment | None] = []
    async with anyio.create_task_group() as tg:

        async def follow() -> None:
            async for item in bus.watch(
                keys.pattern(keys.ASSIGN, "a"), decoder(records.Assignment)
            ):
                if not isinstance(item, Synced):
                    seen.append(item.value)

        tg.start_soon(follow)
        await until(lambda: _true(seen))
        await bus.put(keys.assign("a", "r1"), b'{"model": "m", "generation": "two"}')
        second = msgspec.structs.replace(run, generation=2)
        await bus.put(keys.assign("a", "r1"), second)
        await until(lambda: _true(len(seen) >= 2))
        await bus.delete(keys.assign("a", "r1"))
        await until(lambda: _true(len(seen) >= 3))
        tg.cancel_scope.cancel()
    assert seen == [run, second, None]


async def _said_by_status(bus: Bus, key: str) -> str:
    """What `llmgw status` says of a value that does not read (its read model's words)."""
    return next(u.says() for u in (await gather(bus)).unreadable if u.key == key)


async def test_llmgw_node_reads_a_garbled_ops_as_status_does_and_changes_it_from_that_reading(
    bus, nats_server
):
    """`llmgw node taint` read a garbled ops.<node> as absent and wrote an ops record in
    service beside the taint: the cordon the operator had set was gone."""
    from test_cli import _llmgw

    await bus.put(keys.node("a"), inventory("a", gpus=1))
    await bus.put(keys.ops("a"), GARBAGE)
    said = await _said_by_status(bus, "ops.a")
    assert "the node is taken as cordoned" in said
    out = await _llmgw(nats_server.url, "node", "taint", "a", "gpu-flaky")
    assert out.returncode == 0, out.stderr
    assert said in out.stdout
    assert out.stdout.strip().endswith("ops.a: cordoned; taints: gpu-flaky")
    entry = await bus.get(keys.ops("a"), lambda b: records.decode(b, records.NodeOps))
    assert (entry.value.state, entry.value.taints) == ("cordoned", ["gpu-flaky"])
    assert "did not read" in entry.value.reason
    assert not (await gather(bus)).unreadable  # written over: it reads again

    await bus.put(keys.ops("a"), GARBAGE)
    out = await _llmgw(nats_server.url, "node", "uncordon", "a")
    assert out.returncode == 0 and out.stdout.strip().endswith("ops.a: in service")
    assert await bus.get_raw(keys.ops("a")) is None  # asks for nothing: deleted


async def test_llmgw_rollout_says_a_garbled_rollout_or_desired_and_writes_nothing(bus, nats_server):
    """`llmgw rollout status` said "no rollout recorded" of a rollout.<model> that does not
    read; `undo` read a garbled desired.<model> as absent and switched no profile back."""
    from test_cli import _llmgw

    m = _model()
    await bus.put(keys.catalog("m"), catalog.encode_model(m))
    await bus.put(keys.rollout("m"), b'{"model": "m", "phase": ')
    out = await _llmgw(nats_server.url, "rollout", "status", "m")
    assert out.returncode == 1
    assert await _said_by_status(bus, "rollout.m") in out.stderr
    assert "no rollout recorded" not in out.stderr

    profile = records.ProfileRevision(name="p", launch="x", content={"name": "p"})
    revision = records.Revision(profile="p", profiles=[profile])
    earlier = records.Revision(profile="q", profiles=[profile])
    ro = records.Rollout(model="m", phase="complete", current=revision, history=[earlier])
    await bus.put(keys.rollout("m"), ro)
    await bus.put(keys.desired("m"), b'{"model": "m", "replicas": "2"}')
    catalog_before = await bus.get_raw(keys.catalog("m"))
    out = await _llmgw(nats_server.url, "rollout", "undo", "m")
    assert out.returncode == 1
    assert await _said_by_status(bus, "desired.m") in out.stderr
    assert await bus.get_raw(keys.catalog("m")) == catalog_before  # nothing written


async def test_every_reader_reads_a_value_that_does_not_read_by_the_one_rule(nats_settings, caplog):
    """The rule lived in four places (Bus.watch, the key table, the decoder layer, the
    controller's own copy of where a key lives): a typed read of an ops that never read
    took the node as in service where the decoder layer cordons it, and a value over the
    size limit was warned about at every read of it."""
    import logging

    from nats.js.api import KeyValueConfig

    from llmgw.bus.client import MAX_VALUE_BYTES, RAW, BucketSettings, decoder
    from llmgw.fleetstate.decode import FleetRecords

    async with Bus.open(nats_settings, give_up_after=5) as writer:
        # a bucket made by another tool, with no value limit of its own
        kv = await writer.js.create_key_value(KeyValueConfig(bucket="wide"))
        await kv.put("ops.a", GARBAGE)
        await kv.put("nodes.b", b'"' + b"x" * (MAX_VALUE_BYTES + 10) + b'"')
    caplog.set_level(logging.WARNING, logger="llmgw")
    async with Bus.open(nats_settings, BucketSettings(name="wide"), give_up_after=5) as bus:
        for _ in range(3):
            assert await bus.list("nodes.*", decoder(records.NodeInventory)) == {}
        big = [r for r in caplog.records if r.getMessage().startswith("skipping nodes.b ")]
        typed = await bus.get("ops.a", decoder(records.NodeOps))
        watched = await bus.list("ops.*", decoder(records.NodeOps))
        layer = FleetRecords()
        for key, entry in (await bus.list(">", RAW)).items():
            layer.apply(key, entry.value, entry.revision)
    assert len(big) == 1, [r.getMessage() for r in big]  # said once, however often read
    assert typed is not None and watched["ops.a"].value == typed.value == layer.ops["a"]
    assert typed.value.unschedulable
    assert layer.unreadable["nodes.b"].reading == "absent" and "nodes.b" not in layer.nodes
