"""One replica on this node (`LocalShard`): what it does next, without a bus; and its states
as it runs the fake engine against a real nats-server, without the agent around it."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import anyio
import msgspec
import pytest
from serving import cpu_model
from waiting import until

from llmgw import catalog
from llmgw.agent.config import AgentConfig, Engines, Paths
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.pidfile import EngineProcess, leftover_engines
from llmgw.agent.shards import (
    LocalShard,
    NodeShards,
    RetryDelay,
    ShardState,
    Step,
    ThisNode,
    adoption,
    keeps_launch,
    next_step,
)
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.bus.records import PORT_IN_USE
from llmgw.sim.fake_engine import free_port, write_fake_gguf

RUN = records.Assignment(model="tiny", rid="r1", profile="cpu", action="run", generation=3)


def generation(a: records.Assignment, n: int, **kw: object) -> records.Assignment:
    return msgspec.structs.replace(a, generation=n, **kw)


# --- what it does next ------------------------------------------------------------------------


def test_a_deleted_assignment_is_forgotten_whether_or_not_an_engine_runs() -> None:
    assert next_step(None, None) is Step.FORGET
    assert next_step(None, RUN) is Step.FORGET


def test_the_generation_already_running_is_left_alone_whatever_it_says() -> None:
    assert next_step(RUN, RUN) is Step.LEAVE
    # a drain already acted on carries the generation it was acted on with
    assert next_step(generation(RUN, 3, action="drain"), RUN) is Step.LEAVE


def test_drain_and_stop_stop_what_runs_or_say_stopped_when_nothing_does() -> None:
    for action in ("drain", "stop"):
        assert next_step(generation(RUN, 4, action=action), RUN) is Step.STOP
        assert next_step(generation(RUN, 4, action=action), None) is Step.STOP


def test_a_new_generation_to_run_is_launched_and_so_is_one_with_no_engine() -> None:
    assert next_step(generation(RUN, 4), RUN) is Step.LAUNCH
    assert next_step(RUN, None) is Step.LAUNCH  # refused before, or its engine failed


SPEC = LaunchSpec(served_name="tiny-chat", engine="llama-server", binary="llama-server", port=8080)


def test_a_running_engine_keeps_its_launch_when_nothing_it_sees_changed() -> None:
    assert keeps_launch(SPEC, SPEC, healthy=True)
    assert keeps_launch(SPEC, SPEC, healthy=False)


def test_only_a_serving_engine_keeps_its_launch_when_only_the_catalog_changed() -> None:
    edited = replace(SPEC, context=8192)
    assert keeps_launch(edited, SPEC, healthy=True)
    assert not keeps_launch(edited, SPEC, healthy=False)  # a failing one gets the fix


def test_a_new_place_or_no_launch_at_all_replaces_the_engine() -> None:
    assert not keeps_launch(replace(SPEC, port=8081), SPEC, healthy=True)
    assert not keeps_launch(replace(SPEC, gpu_uuids=("GPU-1",)), SPEC, healthy=True)
    assert not keeps_launch(None, SPEC, healthy=True)  # its catalog entry is gone


def _left(spec: LaunchSpec, generation: int, **kw: object) -> EngineProcess:
    fields: dict[str, object] = {
        "shard": "n1.r1",
        "pid": 1,
        "pgid": 1,
        "create_time": 0.0,
        "argv": ["llama-server"],
        "port": spec.port,
        "gpus": list(spec.gpu_uuids),
        "generation": generation,
    }
    return EngineProcess(**{**fields, **kw})  # type: ignore[arg-type]


def test_an_engine_left_for_this_generation_and_place_is_adopted_whatever_its_command() -> None:
    spec = replace(SPEC, gpu_uuids=("GPU-1",))
    assert adoption(_left(spec, 3), RUN, spec) == ""
    # the catalog changed while no agent ran (a new generation, another command line, the
    # weights not scanned yet): served on, as a running agent keeps it, until rolled out
    assert adoption(_left(spec, 2, argv=["llama-server", "-c", "4096"]), RUN, spec) == ""


def test_an_engine_left_somewhere_its_assignment_no_longer_puts_it_is_not_adopted() -> None:
    spec = replace(SPEC, gpu_uuids=("GPU-1",))
    moved = adoption(_left(replace(spec, port=8081), 3), RUN, spec)
    assert moved == "its assignment moved it (port 8081 -> 8080)"
    other = adoption(_left(replace(spec, gpu_uuids=("GPU-2",)), 3), RUN, spec)
    assert other == "its assignment moved it (GPUs GPU-2 -> GPU-1)"
    rank = adoption(_left(spec, 3, rank=1, nodes=2, master_addr="10.0.0.1"), RUN, spec)
    assert rank == "its assignment moved it (rank 1 -> 0; nodes 2 -> 1; rank 0 at 10.0.0.1 -> )"


def test_an_engine_started_for_a_later_generation_than_its_assignment_is_not_adopted() -> None:
    # the assignment was deleted and made anew (generations start again at 1)
    assert "made anew" in adoption(_left(SPEC, 7), RUN, SPEC)


def test_the_retry_delay_doubles_to_its_cap_while_nothing_new_arrives() -> None:
    retry = RetryDelay(first=1.0, cap=60.0)
    seen = []
    for _ in range(8):
        seen.append(retry.delay)
        retry.waited()
    assert seen == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    retry.reset()  # something new arrived
    assert retry.delay == 1.0


# --- its states, running the fake engine --------------------------------------------------------


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_fake_gguf(tmp_path / "weights" / "tiny.gguf")


@pytest.fixture
def node(bus: Bus, bins: dict[str, Path], tmp_path: Path) -> ThisNode:
    cfg = AgentConfig(
        engines=Engines(listen_host="127.0.0.1", poll_interval=0.1, stop_grace=3, drain_timeout=10),
        paths=Paths(state_dir=str(tmp_path / "state")),
    )
    inventory = records.NodeInventory(
        node="n1",
        hostname="n1",
        address="127.0.0.1",
        agent_version="test",
        started_at=0.0,
        cpu=records.Cpu(count=2),
        memory=records.Memory(total_bytes=64 << 30, available_bytes=60 << 30),
        gpus=records.Gpus(status="no_library"),
        engines=[
            records.EngineInstall(name="llama-server", path=str(bins["llama-server"]), version="1")
        ],
        fetch_dir=str(tmp_path / "fetch"),
    )
    return ThisNode(bus, cfg, lambda: inventory)


async def _no_overlap(rid: str, spec: LaunchSpec) -> None:
    pass


@asynccontextmanager
async def running(node: ThisNode, first: records.Assignment) -> AsyncIterator[LocalShard]:
    """A LocalShard for r1, given `first`, running until the block ends."""
    shard = LocalShard("r1", node, _no_overlap)
    async with anyio.create_task_group() as tg:
        tg.start_soon(shard.run)
        shard.assign(first)
        yield shard
        tg.cancel_scope.cancel()


async def _stored(bus: Bus) -> records.Shard | None:
    got = await bus.get(keys.shard("n1", "r1"), decoder(records.Shard))
    return got.value if got else None


def _in(shard: LocalShard, state: ShardState):
    async def check() -> bool:
        return shard.state is state

    return check


def _phase(bus: Bus, phase: str):
    async def check() -> records.Shard | None:
        s = await _stored(bus)
        return s if s is not None and s.phase == phase else None

    return check


def _waiting(bus: Bus):
    async def check() -> records.Shard | None:
        s = await _stored(bus)
        return s if s is not None and s.reason.startswith("waiting: ") else None

    return check


async def _put_model(bus: Bus, gguf: Path, **profile: object) -> None:
    await bus.put(keys.catalog("tiny"), catalog.encode_model(cpu_model(str(gguf), **profile)))


@asynccontextmanager
async def serving(
    bus: Bus, node: ThisNode, gguf: Path
) -> AsyncIterator[tuple[LocalShard, records.Assignment, records.Shard]]:
    """r1 given generation 1 of the fake engine's model, and its record once ready."""
    await _put_model(bus, gguf)
    a = generation(RUN, 1, port=free_port())
    async with running(node, a) as shard:
        yield shard, a, await until(_phase(bus, "ready"))


@pytest.mark.anyio
@pytest.mark.slow
async def test_it_runs_its_engine_then_drains_it_stops_and_is_gone_with_its_assignment(
    bus, node, gguf
) -> None:
    async with serving(bus, node, gguf) as (shard, a, ready):
        assert shard.state is ShardState.RUNNING and shard.engine is not None
        assert ready.pid == shard.engine.supervisor.pid

        shard.assign(generation(a, 2, action="drain"))
        await until(_in(shard, ShardState.STOPPING))  # a drain polls twice: a second at least
        await until(_in(shard, ShardState.IDLE))
        stopped = await _stored(bus)  # the supervisor's "stopped on request", then this
        assert stopped is not None and stopped.phase == "stopped"
        assert (stopped.reason, stopped.generation) == ("assignment says drain", 2)
        assert shard.engine is None

        shard.assign(None)
        await until(_in(shard, ShardState.GONE))
        assert await _stored(bus) is None and shard.record is None


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_refusal_that_clears_by_itself_is_an_expected_wait_retried_until_it_launches(
    bus, node, gguf
) -> None:
    """A port (or GPU memory) an engine being stopped still holds is waited for, not a
    failure: it was reported "failed" meanwhile, and a rollout stopped on it."""
    await _put_model(bus, gguf)
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    async with running(node, generation(RUN, 1, port=port)) as shard:
        try:
            await until(_in(shard, ShardState.RETRYING))
            waiting = await until(_waiting(bus))
            assert waiting.phase == "validating", waiting
            assert waiting.reason.startswith(f"waiting: port {port} ")
            assert waiting.refused == PORT_IN_USE  # what the controller moves a port for
            assert not waiting.gave_up and shard.engine is None
            await anyio.sleep(1.5)  # past the first retry: looked at again, and still waits
            again = await _stored(bus)
            assert again is not None and (again.phase, again.since) == ("validating", waiting.since)
        finally:
            holder.close()
        await until(_phase(bus, "ready"))  # the next look, a second later at most
        assert shard.state is ShardState.RUNNING


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_refusal_for_good_waits_idle_until_a_new_assignment(bus, node, gguf) -> None:
    a = generation(RUN, 1, port=free_port())
    async with running(node, a) as shard:  # no catalog entry yet
        refused = await until(_phase(bus, "failed"))
        assert refused.reason == (
            "refused before launch: catalog.tiny is missing or invalid; nothing to launch"
        )
        # said at once: the controller moves or explains it without waiting to see
        assert refused.gave_up
        assert shard.state is ShardState.IDLE
        before = await bus.get(keys.shard("n1", "r1"), decoder(records.Shard))
        await anyio.sleep(1.5)  # past the first retry delay: not retried
        after = await bus.get(keys.shard("n1", "r1"), decoder(records.Shard))
        assert after is not None and before is not None and after.revision == before.revision

        await _put_model(bus, gguf)
        shard.assign(generation(a, 2))
        assert (await until(_phase(bus, "ready"))).generation == 2


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_catalog_edit_keeps_the_serving_engine_and_takes_the_new_generation(
    bus, node, gguf
) -> None:
    async with serving(bus, node, gguf) as (shard, a, first):
        await _put_model(bus, gguf, context=4096)
        shard.assign(generation(a, 2))

        async def taken() -> records.Shard | None:
            s = await _stored(bus)
            return s if s is not None and s.generation == 2 else None

        second = await until(taken)
        assert (second.phase, second.pid) == ("ready", first.pid)
        assert shard.state is ShardState.RUNNING
        assert shard.engine is not None and shard.engine.spec.context is None


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_replica_placed_here_again_after_it_was_gone_runs_again(bus, node, gguf) -> None:
    # through NodeShards and the bucket: the rid's first LocalShard is gone, a new one runs
    await _put_model(bus, gguf)
    shards = NodeShards(bus, node.cfg, node.inventory)
    a = generation(RUN, 1, port=free_port())
    async with anyio.create_task_group() as tg:
        tg.start_soon(shards.run)
        await bus.put(keys.assign("n1", "r1"), a)
        first = await until(_phase(bus, "ready"))
        await bus.delete(keys.assign("n1", "r1"))

        async def forgotten() -> bool:
            return await _stored(bus) is None

        await until(forgotten)
        await bus.put(keys.assign("n1", "r1"), generation(a, 2))
        second = await until(_phase(bus, "ready"))
        assert second.generation == 2 and second.pid != first.pid
        tg.cancel_scope.cancel()


# --- engines an earlier agent left --------------------------------------------------------------


@asynccontextmanager
async def left_serving(
    bus: Bus, node: ThisNode, gguf: Path
) -> AsyncIterator[tuple[records.Assignment, records.Shard, EngineProcess]]:
    """r1 served, then its shard's owner gone the way a restarted agent goes: the engine
    serves on with its pidfile. Yields the assignment, its ready record and that pidfile."""
    async with serving(bus, node, gguf) as (shard, a, ready):
        assert shard.engine is not None
        shard.engine.supervisor.leave_running()
        # (the block's end cancels the shard: the engine is left)
    (left,), _ = leftover_engines(node.state_dir)
    assert left.pid == ready.pid and left.ready  # it had served: the next agent expects it to
    try:
        yield a, ready, left
    finally:
        import psutil

        from llmgw.agent.engines.pidfile import reap_leftover_engines

        reap_leftover_engines(node.state_dir, grace=2)
        if psutil.pid_exists(left.pid):
            os.killpg(left.pid, signal.SIGKILL)


def _own_phase(shard: LocalShard, phase: str):
    """The phase this shard itself reported (the bucket may still hold an earlier owner's)."""

    async def check() -> records.Shard | None:
        r = shard.record
        return r if r is not None and r.phase == phase else None

    return check


def _adopting(node: ThisNode, left: EngineProcess) -> LocalShard:
    claims = {"r1": left}
    return LocalShard("r1", node, _no_overlap, claims.pop)  # type: ignore[arg-type]


async def _run_shard(shard: LocalShard, want: records.Assignment, tg: anyio.abc.TaskGroup) -> None:
    tg.start_soon(shard.run)
    shard.assign(want)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_catalog_edit_made_while_no_agent_ran_keeps_the_engine_it_left(
    bus, node, gguf
) -> None:
    async with left_serving(bus, node, gguf) as (a, ready, left):
        await _put_model(bus, gguf, context=4096)  # what the engine runs is not this now
        shard = _adopting(node, left)
        async with anyio.create_task_group() as tg:
            await _run_shard(shard, generation(a, 2), tg)

            again = await until(_own_phase(shard, "ready"))
            assert again.generation == 2
            assert again.pid == ready.pid and _alive(ready.pid)
            # its pidfile now says the generation it serves, for the agent after this one
            (kept,), _ = leftover_engines(node.state_dir)
            assert (kept.generation, kept.argv) == (2, left.argv)
            tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_engine_kept_for_a_new_generation_is_adopted_by_the_next_agent_too(
    bus, node, gguf
) -> None:
    """A running agent keeps its engine through a catalog edit; its pidfile says so, and the
    agent after it adopts that engine for the new generation."""
    async with left_serving(bus, node, gguf) as (a, ready, left):
        await _put_model(bus, gguf, context=4096)
        first = _adopting(node, left)
        async with anyio.create_task_group() as tg:
            await _run_shard(first, a, tg)
            await until(_own_phase(first, "ready"))
            first.assign(generation(a, 2))  # the running agent keeps it

            async def taken() -> records.Shard | None:
                s = await _stored(bus)
                return s if s is not None and s.generation == 2 else None

            await until(taken)
            assert first.engine is not None
            first.engine.supervisor.leave_running()
            tg.cancel_scope.cancel()
        (record,), _ = leftover_engines(node.state_dir)
        assert (record.pid, record.generation) == (ready.pid, 2)
        second = _adopting(node, record)
        async with anyio.create_task_group() as tg:
            await _run_shard(second, generation(a, 2), tg)
            again = await until(_own_phase(second, "ready"))
            assert again.pid == ready.pid and second.engine is not None
            assert second.engine.supervisor.adopted
            tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_engine_left_where_its_assignment_no_longer_puts_it_is_stopped_and_replaced(
    bus, node, gguf
) -> None:
    async with left_serving(bus, node, gguf) as (a, ready, left):
        moved = generation(a, 2, port=free_port())  # the controller moved it meanwhile
        shard = _adopting(node, left)
        async with anyio.create_task_group() as tg:
            await _run_shard(shard, moved, tg)

            new = await until(_own_phase(shard, "ready"), timeout=20)
            assert new.pid != ready.pid
            assert new.port == moved.port and not _alive(ready.pid)
            tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_engine_left_while_its_replica_drained_is_adopted_and_drained(
    bus, node, gguf
) -> None:
    """An agent restarted in the middle of a node drain or a rollout: the engine it left
    is this replica's to drain, not left running with no owner."""
    async with left_serving(bus, node, gguf) as (a, ready, left):
        shard = _adopting(node, left)
        async with anyio.create_task_group() as tg:
            await _run_shard(shard, generation(a, 2, action="drain"), tg)

            # the supervisor's "stopped on request" comes first, then the shard's own word
            async def drained() -> records.Shard | None:
                r = shard.record
                return r if r is not None and r.reason == "assignment says drain" else None

            stopped = await until(drained, timeout=20)
            assert stopped.phase == "stopped" and shard.engine is None
            assert not _alive(ready.pid)
            assert leftover_engines(node.state_dir) == ([], [])
            tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_engine_left_for_a_removed_replica_is_stopped(bus, node, gguf) -> None:
    async with left_serving(bus, node, gguf) as (_a, ready, left):
        shard = _adopting(node, left)
        async with anyio.create_task_group() as tg:
            tg.start_soon(shard.run)
            shard.assign(None)
            await until(_in(shard, ShardState.GONE), timeout=20)
            assert not _alive(ready.pid)
            tg.cancel_scope.cancel()
