"""Operating a fleet end to end: three agent processes (three hosts on one machine, one
loopback address each) run the fake engine, a controller places, a router serves from the
bucket, and a client streams through it without pause while the fleet is changed under it:
a rollout of a changed profile, a rollout to a profile that fails to load (stopped, then
resumed by fixing it), a node drained. Nothing the client sent may fail, and the model may
never have fewer replicas ready than desired."""

from __future__ import annotations

import aiohttp
import anyio
import msgspec
import psutil
import pytest
from agent_helpers import (
    NODES,
    agent_config,
    host_dirs,
    start_agent,
    start_agents,
    stop,
    stop_agents,
)
from router_helpers import SERVED, RetryingClient, router_settings, running_router
from serving import cpu_model, serve, want
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.cli.status import gather, render
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# 20 tokens at 100 a second: a stream lasts 0.2 s, so several are in flight at every step
STREAM = {"FAKE_ENGINE_TOKENS": "20", "FAKE_ENGINE_TOKEN_RATE": "100"}


@pytest.fixture
def fleet(tmp_path, nats_server):
    procs = start_agents(nats_server.url, tmp_path)
    yield tmp_path
    stop_agents(procs)


def _model(tmp_path, **env: str) -> catalog.Model:
    gguf = str(write_fake_gguf(tmp_path / "weights" / "tiny.gguf"))
    return cpu_model(gguf, served_name=SERVED, env={**STREAM, **env}, host_ram_gb=1)


async def _replicas(bus: Bus) -> list[records.Replica]:
    got = await bus.list(keys.pattern(keys.REPLICAS, "tiny"), decoder(records.Replica))
    return sorted((e.value for e in got.values()), key=lambda r: r.rid)


async def _rollout(bus: Bus) -> records.Rollout | None:
    got = await bus.get(keys.rollout("tiny"), decoder(records.Rollout))
    return got.value if got else None


class Watch:
    """The fewest ready replicas, and the fewest the router would route to, seen while on."""

    def __init__(self, bus: Bus, router) -> None:
        self.bus, self.router = bus, router
        self.fewest_ready = self.fewest_routed = 1_000
        self.samples = 0

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            ready = sum(r.phase == "ready" for r in await _replicas(self.bus))
            route = self.router.table.route(SERVED)
            routed = len(route.backends) if route else 0
            self.fewest_ready = min(self.fewest_ready, ready)
            self.fewest_routed = min(self.fewest_routed, routed)
            self.samples += 1
            await anyio.sleep(0.05)


class Serving:
    """Three replicas ready behind a router, a client streaming through it and a watch."""

    def __init__(self, bus: Bus, router, client: RetryingClient, watch: Watch) -> None:
        self.bus, self.router, self.client, self.watch = bus, router, client, watch


async def _three_ready(bus: Bus, router) -> None:
    async def ready():
        reps = await _replicas(bus)
        route = router.table.route(SERVED)
        return (
            len(reps) == 3
            and all(r.phase == "ready" for r in reps)
            and route is not None
            and len(route.backends) == 3
        )

    await until(ready, timeout=60)


async def _under_load(bus, nats_settings, model, step) -> tuple[RetryingClient, Watch]:
    """Serve `model` x3, then run `step(serving)` under streamed load; the client's and the
    watch's findings once it returns."""

    async def every_node_ready():
        got = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
        return sum(e.value.phase == "ready" for e in got.values()) == len(NODES)

    await until(every_node_ready, timeout=30)  # then the three replicas spread over them
    await serve(bus, model, 3)
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    async with running_router(connect=connect, settings=router_settings()) as router:
        await _three_ready(bus, router)
        client = RetryingClient([router.url])
        watch = Watch(bus, router)
        stop = anyio.Event()
        async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
            tg.start_soon(client.run, http, 4, stop)
            tg.start_soon(watch.run, stop)
            await until(lambda: _true(client.completed >= 20), timeout=30)
            try:
                await step(Serving(bus, router, client, watch))
                done = client.completed
                await until(lambda: _true(client.completed >= done + 20), timeout=30)
            finally:
                stop.set()
    assert client.lost == [], client.lost[:5]
    # never fewer ready, nor routed to, than desired
    assert watch.samples > 0 and watch.fewest_ready >= 3 and watch.fewest_routed >= 3, vars(watch)
    return client, watch


async def _true(value: bool) -> bool:
    return value


async def _history_ends_with(bus: Bus, model: catalog.Model) -> None:
    """What `llmgw rollout undo` would go back to: `model`'s launch."""
    ro = await _rollout(bus)
    assert [p.launch for p in ro.history[-1].profiles] == [
        catalog.launch_hash(model, model.profiles[0])
    ]


async def _rolled_out_to(bus: Bus, launch: str) -> bool:
    reps = await _replicas(bus)
    ro = await _rollout(bus)
    return (
        ro is not None
        and ro.phase == "complete"
        and len(reps) == 3
        and all(r.phase == "ready" and r.launch == launch for r in reps)
    )


async def test_a_rollout_under_streamed_load_loses_no_request_and_keeps_three_ready(
    bus, nats_settings, fleet, controller
):
    before = _model(fleet)
    after = _model(fleet, FAKE_ENGINE_TOKENS="21")  # a changed env: a new launch
    new_launch = catalog.launch_hash(after, after.profiles[0])
    assert new_launch != catalog.launch_hash(before, before.profiles[0])

    async def roll(s: Serving) -> None:
        first = {r.rid for r in await _replicas(bus)}
        await bus.put(keys.catalog("tiny"), catalog.encode_model(after))
        await until(lambda: _rolled_out_to(bus, new_launch), timeout=120)
        assert not first & {r.rid for r in await _replicas(bus)}  # every one replaced

    await _under_load(bus, nats_settings, before, roll)
    await _history_ends_with(bus, before)


async def test_a_rollout_to_a_profile_that_fails_to_load_stops_and_fixing_it_resumes(
    bus, nats_settings, fleet, controller
):
    before = _model(fleet)
    broken = _model(fleet, FAKE_ENGINE_FAIL_LOAD="bad weights (simulated)")
    fixed = _model(fleet, FAKE_ENGINE_TOKENS="22")

    async def fail_then_fix(s: Serving) -> None:
        old = {r.rid for r in await _replicas(bus)}
        await bus.put(keys.catalog("tiny"), catalog.encode_model(broken))

        async def stopped():
            ro = await _rollout(bus)
            return ro if ro and ro.phase == "stopped" else None

        ro = await until(stopped, timeout=60)
        assert "exited with code 1 while loading" in ro.reason, ro.reason
        assert "bad weights (simulated)" in ro.reason and "llmgw rollout undo tiny" in ro.reason
        assert any("bad weights (simulated)" in line for line in ro.output_tail)
        # the old ones keep serving, and placement says why nothing moves on
        await anyio.sleep(2.0)
        reps = await _replicas(bus)
        assert {r.rid for r in reps if r.phase == "ready"} == old
        p = await bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))
        assert p.value.explanation.startswith("rollout stopped: new replica ")
        text = render(await gather(bus), now=0.0)
        assert "rollout stopped: new replica " in text
        # the engine's own last lines, as plain `llmgw status` shows them under the reason
        tail = [line.strip() for line in text.splitlines() if line.strip().startswith("| ")]
        assert any("bad weights (simulated)" in line for line in tail), text
        assert any("bad weights (simulated)" in line for line in p.value.rollout_tail)

        await bus.put(keys.catalog("tiny"), catalog.encode_model(fixed))
        launch = catalog.launch_hash(fixed, fixed.profiles[0])
        await until(lambda: _rolled_out_to(bus, launch), timeout=120)

    await _under_load(bus, nats_settings, before, fail_then_fix)
    # the broken revision never ran everywhere: going back goes to the first one
    await _history_ends_with(bus, before)


async def test_a_node_drained_under_load_loses_no_request_and_gets_nothing_new(
    bus, nats_settings, fleet, controller
):
    async def drain(s: Serving) -> None:
        on_node1 = [r for r in await _replicas(bus) if r.members[0].node == "node1"]
        assert on_node1, "spread over the three nodes: one replica is on node1"
        shards = await bus.list("shards.node1.*", decoder(records.Shard))
        engines = [psutil.Process(e.value.pid) for e in shards.values() if e.value.pid]
        assert engines, "node1's engine runs before the drain"
        await bus.put(keys.ops("node1"), records.NodeOps(node="node1", state="draining"))

        async def moved():
            reps = await _replicas(bus)
            return (
                len(reps) == 3
                and all(r.phase == "ready" and r.members[0].node != "node1" for r in reps)
                and len(s.router.table.route(SERVED).backends) == 3
            )

        await until(moved, timeout=60)
        # its engines were drained and stopped, not left running
        gone, _ = await anyio.to_thread.run_sync(lambda: psutil.wait_procs(engines, timeout=10))
        assert len(gone) == len(engines)
        # cordoned, it takes nothing new either
        await want(bus, "tiny", 5, at=2.0)

        async def five():
            reps = await _replicas(bus)
            return len(reps) == 5 and all(r.phase == "ready" for r in reps)

        await until(five, timeout=60)
        assert all(r.members[0].node != "node1" for r in await _replicas(bus))

    await _under_load(bus, nats_settings, _model(fleet), drain)


async def test_an_engine_that_keeps_failing_on_one_node_is_moved_and_the_node_named(
    bus, fleet, controller
):
    """The fake engine fails to load on node1 only (a broken GPU there): its agent gives up
    after max_failed_starts, the controller places the replica on another node, and the
    placement record and plain `llmgw status` name node1 and the engine's last line."""

    async def every_node_ready():
        got = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
        return sum(e.value.phase == "ready" for e in got.values()) == len(NODES)

    await until(every_node_ready, timeout=30)
    broken_here = {
        "FAKE_ENGINE_FAIL_LOAD": "CUDA error: uncorrectable ECC error encountered",
        "FAKE_ENGINE_FAIL_ON_HOST": NODES["node1"],
    }
    await serve(bus, _model(fleet, **broken_here), 3)

    async def moved():
        reps = await _replicas(bus)
        ready = [r for r in reps if r.phase == "ready"]
        if len(ready) == 3 and all(r.members[0].node != "node1" for r in ready):
            got = await bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))
            return got.value if got and got.value.failures else None
        return None

    record = await until(moved, timeout=90)
    (failure,) = record.failures
    assert failure.node == "node1" and failure.moved_to in ("node2", "node3")
    said = (
        "failed 5 times on node1 (exited with code 1 while loading; gave up after 5 failed "
        "starts in a row: llama_model_load: error loading model: CUDA error: uncorrectable "
        f"ECC error encountered); moved to {failure.moved_to}"
    )
    assert said in record.explanation, record.explanation
    text = render(await gather(bus), now=0.0)
    assert said in text


@pytest.fixture
def labelled_fleet(tmp_path, nats_server):
    """Three agent processes whose agent files set labels and a taint, as an operator's
    onboarding would: node1 pool=research, node2 pool=prod, node3 pool=research but tainted
    gpu-flaky."""
    config = {
        "node1": ({"pool": "research"}, []),
        "node2": ({"pool": "prod"}, []),
        "node3": ({"pool": "research"}, ["gpu-flaky"]),
    }
    procs = []
    for node, address in NODES.items():
        root = tmp_path / node
        dirs = host_dirs(root)
        install_fake_engines(dirs["bin"])
        cfg = agent_config(nats_server.url, dirs, id=node, address=address)
        labels, taints = config[node]
        cfg = msgspec.structs.replace(
            cfg,
            # 4 GiB as far as placement knows: one 3 GB replica a node
            node=msgspec.structs.replace(cfg.node, labels=labels, taints=taints, ram_total_gb=4),
            engines=Engines(listen_host=address, poll_interval=0.1, stop_grace=3),
        )
        procs.append(
            start_agent(
                cfg, root / "agent.toml", [dirs["bin"], "/usr/bin", "/bin"], root / "agent.log"
            )
        )
    yield tmp_path
    for p in procs:
        stop(p)


async def test_selectors_and_taints_from_agent_files_place_and_explain_with_counts(
    bus, labelled_fleet, controller
):
    async def every_node_labelled():
        got = await bus.list(keys.pattern(keys.NODES), decoder(records.NodeInventory))
        return len(got) == len(NODES) and all(e.value.labels for e in got.values())

    await until(every_node_labelled, timeout=30)
    research = _model(labelled_fleet)
    research = msgspec.structs.replace(
        research,
        profiles=[
            msgspec.structs.replace(
                research.profiles[0], node_selector={"pool": "research"}, host_ram_gb=3.0
            )
        ],
    )
    await serve(bus, research, 2)

    async def decided():
        got = await bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))
        return got.value if got and got.value.placed == 1 else None

    record = await until(decided, timeout=30)
    (placed,) = await _replicas(bus)
    # node2 lacks the label, node3 has it but its taint is not tolerated
    assert placed.members[0].node == "node1"
    # and node1 has no RAM left for a second: each node refused is counted by its reason
    assert record.explanation.startswith("0/3 nodes fit: "), record.explanation
    for said in ("1 lack pool=research", "1 tainted gpu-flaky", "1 short of host RAM"):
        assert said in record.explanation, record.explanation

    # tolerating the taint, the second replica goes to node3
    tolerant = msgspec.structs.replace(
        research,
        profiles=[msgspec.structs.replace(research.profiles[0], tolerations=["gpu-flaky"])],
    )
    await bus.put(keys.catalog("tiny"), catalog.encode_model(tolerant))

    async def on_both():
        nodes = {r.members[0].node for r in await _replicas(bus) if r.phase != "draining"}
        return nodes == {"node1", "node3"}

    await until(on_both, timeout=30)
