"""Weights no engine can fetch are a requirement, not a preference (issue 30): a key that is
no repo id ("phi-3-mini-4k-instruct-q4") or a path. A replica of such a profile waits,
explained, rather than being placed where its agent must refuse it before launch."""

from __future__ import annotations

import anyio
import msgspec
import pytest
from test_controller import MANUAL, _apply, _model, _placement, _replicas, _seen_beat
from test_placement import model, node, snapshot
from waiting import until

from llmgw.agent.engines import adapter_for
from llmgw.agent.engines.base import LaunchSpec
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, decoder
from llmgw.catalog import encode_model, validate_models
from llmgw.controller.clock import ManualClock
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.controller.placement import plan
from llmgw.controller.placement.weights import must_hold
from llmgw.sim.bare import SimNode, inventory
from llmgw.sim.simulator import Simulator

PHI = "phi-3-mini-4k-instruct-q4"


def _scanned(inv: records.NodeInventory, *dirs: str) -> records.NodeInventory:
    weights = msgspec.structs.replace(
        inv.weights,
        looked=True,
        dirs=[records.WeightsDir(path=d, status="ok") for d in dirs],
    )
    return msgspec.structs.replace(inv, weights=weights)


def test_only_a_source_or_a_repo_id_is_fetched_by_an_engine():
    by = model().profiles[0].weights
    assert must_hold(msgspec.structs.replace(by, key="org/name")) is None
    assert must_hold(msgspec.structs.replace(by, key=PHI)) == ("key", PHI)
    assert must_hold(msgspec.structs.replace(by, key=None, source="hf://org/x")) is None
    assert must_hold(msgspec.structs.replace(by, key=None, path="/srv/x")) == ("path", "/srv/x")


@pytest.mark.parametrize(
    "key", ["org/name", "org/name:Q4_K_M", PHI, "a/b/c", "./org/name", "org/", "~/org/name"]
)
def test_placement_and_the_agent_agree_on_which_keys_an_engine_fetches(key):
    """A key that placement does not require a node to hold is one the agent hands its
    engine to fetch and the engine takes (one rule, llmgw/catalog.py hf_repo): placing it
    on a node without it must not end in a refused launch."""
    fetched = must_hold(msgspec.structs.replace(model().profiles[0].weights, key=key)) is None
    spec = LaunchSpec(
        served_name="m",
        engine="llama-server",
        binary="llama-server",
        port=8000,
        host="127.0.0.1",
        download_source=key,
    )
    refused = [r for r in adapter_for("llama-server").check(spec) if "download source" in r]
    assert fetched == (not refused), (key, refused)
    assert fetched == (key in ("org/name", "org/name:Q4_K_M"))


def test_a_key_alone_held_by_no_ready_node_waits_explained_and_is_placed_nowhere():
    holder, other = node("cpu-01", held=[(PHI, "local:cpu-01")]), node("cpu-02")
    phi = model(weights={"key": PHI})
    result = plan(snapshot([holder, other], [phi], {"m": 1}, health={"cpu-01": "lost"}))
    assert result.create == []
    why = result.placements["m"].explanation
    assert why.startswith("0/2 nodes fit: 1 lost, 1 not holding phi-3-mini-4k-instruct-q4")
    assert "a key alone cannot be fetched" in why
    # held by a ready node: placed there, and only there
    result = plan(snapshot([holder, other], [phi], {"m": 1}))
    assert [[m.node for m in r.members] for r in result.create] == [["cpu-01"]]


def test_a_repo_id_held_by_no_node_is_still_placed_for_the_engine_to_fetch():
    result = plan(snapshot([node("cpu-02")], [model(key="org/m")], {"m": 1}))
    assert len(result.create) == 1


def test_a_path_is_required_where_the_node_scanned_for_it_and_unknown_elsewhere():
    by_path = model(weights={"path": "/srv/models/x"})
    scanned = _scanned(node("n1"), "/srv/models")
    result = plan(snapshot([scanned], [by_path], {"m": 1}))
    assert result.create == []
    assert "1 not holding /srv/models/x (a path is read where it is" in (
        result.placements["m"].explanation
    )
    # a node that scanned elsewhere, or not at all, cannot say: the engine reads it there
    elsewhere = _scanned(node("n2"), "/data")
    assert len(plan(snapshot([elsewhere], [by_path], {"m": 1})).create) == 1


@pytest.mark.anyio
async def test_when_the_only_node_holding_a_key_alone_is_lost_its_replica_waits_explained(
    bus, second_bus
):
    """The sim catalog's phi3-mini: cpu-01, the only node holding its weights, dies. Its
    replica was placed on cpu-02 and refused there before launch, failed for good; now it
    waits, with the reason in its placement record, and comes back when cpu-01 does."""
    clock = ManualClock()
    holder = SimNode(
        bus, inventory("cpu-01", gpus=0, engines=("llama-server",), held=[(PHI, "local:cpu-01")])
    )
    other = SimNode(bus, inventory("cpu-02", gpus=0, engines=("llama-server",)))
    for n in (holder, other):
        await n.register()
    await _apply(bus, _model(engine="llama-server", gpus=0, key=PHI), 1)
    controller = Controller(second_bus, ControllerSettings(**MANUAL), clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.run)
        (placed,) = await until(lambda: _replicas(bus))
        assert [m.node for m in placed.members] == ["cpu-01"]
        for _ in range(7):  # cpu-01 is silent for 70 s: lost; cpu-02 beats
            await other.beat()
            await until(lambda: _seen_beat(controller, other))
            clock.advance(10)

        async def waiting():
            rec = await _placement(bus)
            return rec if rec and rec.placed == 0 and "not holding" in rec.explanation else None

        rec = await until(waiting)
        assert "1 lost, 1 not holding phi-3-mini-4k-instruct-q4" in rec.explanation
        assert "a key alone cannot be fetched" in rec.explanation
        live = [r for r in await _replicas(bus) if r.phase != "draining"]
        assert live == []  # nothing placed on cpu-02
        await holder.beat()  # back: placed on it again
        (again,) = await until(lambda: _live_on(bus, "cpu-01"))
        assert again.rid != placed.rid
        tg.cancel_scope.cancel()


async def _live_on(bus, node: str) -> list[records.Replica]:
    return [
        r
        for r in await _replicas(bus)
        if r.phase != "draining" and [m.node for m in r.members] == [node]
    ]


PHI_FLEET = """
[sim]
heartbeat = 0.2
load_seconds = 0.1

[[nodes]]
name = "cpu-01"
ram_gb = 64
engines = ["llama-server"]
models = ["phi-3-mini-4k-instruct-q4.gguf"]

[[nodes]]
name = "cpu-02"
ram_gb = 64
engines = ["llama-server"]
"""


@pytest.mark.anyio
async def test_with_real_agents_a_key_alone_is_never_placed_where_its_agent_refuses_it(
    tmp_path, nats_settings
):
    """The phi3-mini scenario of issue 30 with real agents on a simulated fleet: cpu-01,
    the only node holding the weights, dies. Before, the replica went to cpu-02, whose
    agent refused it before launch ("download source ... is neither hf://org/name[:QUANT]
    nor an http(s) URL"), and it stayed failed for good. Now it waits, explained, and
    serves again on cpu-01 once cpu-01 is back."""
    path = tmp_path / "fleet.toml"
    path.write_text(PHI_FLEET)
    (phi,) = validate_models(
        {
            "models": [
                {
                    "id": "phi3-mini",
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"key": PHI},
                            "gpus_per_node": 0,
                            "host_ram_gb": 24,
                        }
                    ],
                }
            ]
        }
    )
    settings = ControllerSettings(
        unreachable_after=1, lost_after=2.5, leader_ttl=1, tick=0.05, resync=0.5
    )
    sim = Simulator(
        path, nats_settings, BucketSettings(), tmp_path / "sim", connections=1, poll=0.1
    )
    async with await Bus.connect(nats_settings, give_up_after=5) as bus:
        await bus.put(keys.catalog(phi.id), encode_model(phi))
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(bus, settings).run)
            await tg.start(sim.run)
            await bus.put(keys.desired(phi.id), records.Desired(model=phi.id, replicas=1))
            (first,) = await until(lambda: _ready_on(bus, "cpu-01"), timeout=30)

            def edit(old: str, new: str) -> None:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(path.read_text().replace(old, new, 1))
                tmp.replace(path)

            edit('name = "cpu-01"', 'name = "cpu-01"\nstate = "dead"')

            async def waiting() -> records.PlacementRecord | None:
                got = await bus.get(keys.placement(phi.id), decoder(records.PlacementRecord))
                rec = got.value if got else None
                return rec if rec and rec.placed == 0 and "not holding" in rec.explanation else None

            rec = await until(waiting, timeout=30)
            assert "1 lost, 1 not holding phi-3-mini-4k-instruct-q4" in rec.explanation
            assert "a key alone cannot be fetched" in rec.explanation
            on_02 = [r for r in await _all(bus) if any(m.node == "cpu-02" for m in r.members)]
            assert on_02 == []
            edit('state = "dead"', 'state = "up"')
            (again,) = await until(lambda: _ready_on(bus, "cpu-01"), timeout=30)
            assert again.rid != first.rid
            tg.cancel_scope.cancel()


async def _all(bus: Bus) -> list[records.Replica]:
    found = await bus.list(keys.pattern(keys.REPLICAS, "phi3-mini"), decoder(records.Replica))
    return [e.value for e in found.values()]


async def _ready_on(bus: Bus, node: str) -> list[records.Replica]:
    return [
        r for r in await _all(bus) if r.phase == "ready" and [m.node for m in r.members] == [node]
    ]


@pytest.mark.anyio
async def test_with_real_agents_a_launch_refused_before_launch_moves_then_is_explained(
    tmp_path, nats_settings
):
    """A replica its agent refuses before launch (a weights path no node has) is a failed
    start like any other: moved to the other node, refused there too, and then kept and
    explained as failing everywhere, instead of failed for good on the first node. The
    agent says at once that it gave up (the refusal stays until a new assignment), so the
    controller's fallback for agents that do not say (refused_after) never comes into it."""
    path = tmp_path / "fleet.toml"
    path.write_text(PHI_FLEET)
    (bad,) = validate_models(
        {
            "models": [
                {
                    "id": "m",
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"path": "/nowhere/x.gguf"},
                            "gpus_per_node": 0,
                            "host_ram_gb": 1,
                        }
                    ],
                }
            ]
        }
    )
    settings = ControllerSettings(
        unreachable_after=1,
        lost_after=2.5,
        leader_ttl=1,
        tick=0.05,
        resync=0.5,
        refused_after=3600.0,  # the fallback: far past this test's time
        failure_nodes=2,
    )
    sim = Simulator(
        path, nats_settings, BucketSettings(), tmp_path / "sim", connections=1, poll=0.1
    )
    async with await Bus.connect(nats_settings, give_up_after=5) as bus:
        await bus.put(keys.catalog(bad.id), encode_model(bad))
        async with anyio.create_task_group() as tg:
            await tg.start(Controller(bus, settings).run)
            await tg.start(sim.run)
            await bus.put(keys.desired(bad.id), records.Desired(model=bad.id, replicas=1))

            async def blamed() -> records.PlacementRecord | None:
                got = await bus.get(keys.placement(bad.id), decoder(records.PlacementRecord))
                rec = got.value if got else None
                return rec if rec and rec.broken == ["cpu"] else None

            rec = await until(blamed, timeout=60)
            tried = sorted(f.node for f in rec.failures)
            assert tried == ["cpu-01", "cpu-02"], rec.failures
            assert all(f.reason.startswith("refused before launch") for f in rec.failures)
            assert "the profile, not the nodes, is the problem" in rec.explanation
            tg.cancel_scope.cancel()
