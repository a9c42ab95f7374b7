"""The supervisor and the shard are driven by their state alone: each changes it through one
function that checks the move against one table (a move outside it is a bug and raises).
The tables are tested here without processes; what each state does is tested against real
engines in test_supervisor.py and test_local_shard.py."""

from __future__ import annotations

import itertools

import anyio
import psutil
import pytest
from test_supervisor import Recorder, left_running, llama, supervisor

from llmgw.agent.shards import SHARD_MOVES, ShardState, ShardStateError, check_shard_move
from llmgw.agent.supervisor import (
    MOVES,
    PHASE_OF,
    EngineState,
    StateError,
    check_move,
)

S = EngineState
DONE = {S.EXITED, S.FATAL, S.LEFT}


def test_every_engine_state_has_a_row_and_a_done_state_leads_nowhere():
    assert set(MOVES) == set(EngineState) == set(PHASE_OF)
    assert all(MOVES[s] == frozenset() for s in DONE)
    # every state but IDLE is reached, and every state that is not done leads somewhere
    assert set().union(*MOVES.values()) == set(EngineState) - {S.IDLE}
    assert all(MOVES[s] for s in set(EngineState) - DONE)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(EngineState, repeat=2)))
def test_check_move_allows_exactly_the_table(old, new):
    if new in MOVES[old]:
        assert check_move(old, new) is new
    else:
        with pytest.raises(StateError, match=f"{old.value} -> {new.value}"):
            check_move(old, new)


def test_what_the_supervisor_never_does():
    # nothing starts once a drain or a stop was asked for, or once it is done
    for old in (S.DRAINING, S.STOPPING, *DONE):
        assert S.STARTING not in MOVES[old] and S.RUNNING not in MOVES[old]
    # it is ready only after starting; it gives up only on an engine that ran
    assert {s for s in EngineState if S.RUNNING in MOVES[s]} == {S.STARTING}
    assert {s for s in EngineState if S.FATAL in MOVES[s]} == {S.STARTING, S.RUNNING}
    # an engine left running is one that lives: never from a backoff or before run()
    assert S.LEFT not in MOVES[S.BACKOFF] and S.LEFT not in MOVES[S.IDLE]
    # a stop is final: a drain becomes a stop, never the other way
    assert S.DRAINING not in MOVES[S.STOPPING] and S.STOPPING in MOVES[S.DRAINING]


def test_each_state_reports_the_phase_the_shard_record_says():
    assert PHASE_OF[S.STARTING] == "starting" and PHASE_OF[S.RUNNING] == "ready"
    assert PHASE_OF[S.BACKOFF] == PHASE_OF[S.FATAL] == "failed"
    assert PHASE_OF[S.DRAINING] == "draining" and PHASE_OF[S.EXITED] == "stopped"
    # stopping keeps the phase before it (draining, or what the router last saw)
    assert PHASE_OF[S.STOPPING] is None and PHASE_OF[S.LEFT] is None


@pytest.mark.anyio
async def test_a_stop_before_run_returns_at_once_and_run_then_only_says_stopped(
    bins, tmp_path, monkeypatch
):
    rec = Recorder()
    sup = supervisor(llama(bins, tmp_path, monkeypatch), tmp_path, rec)
    with anyio.fail_after(5):
        await sup.stop()
    assert sup.state is S.STOPPING and not sup.done
    with anyio.fail_after(5):
        await sup.run()
    assert sup.state is S.EXITED and sup.done and rec.phases == ["stopped"]
    assert sup.pid is None  # nothing was launched
    with pytest.raises(StateError):
        await sup.run()  # a supervisor runs once


SS = ShardState


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ShardState, repeat=2)))
def test_check_shard_move_allows_exactly_the_table_and_staying_put(old, new):
    if new is old or new in SHARD_MOVES[old]:
        assert check_shard_move(old, new) is new
    else:
        with pytest.raises(ShardStateError, match=f"{old.value} -> {new.value}"):
            check_shard_move(old, new)


def test_what_a_shard_never_does():
    assert set(SHARD_MOVES) == set(ShardState) and SHARD_MOVES[SS.GONE] == frozenset()
    # an engine is replaced only after the old one stopped
    assert SS.LAUNCHING not in SHARD_MOVES[SS.RUNNING]
    # a replica goes only once its engine is stopped
    assert SS.GONE not in SHARD_MOVES[SS.RUNNING]
    # a stopping engine is never taken for a running one
    assert SS.RUNNING not in SHARD_MOVES[SS.STOPPING]


@pytest.mark.anyio
async def test_an_engine_adopted_to_be_drained_stays_draining_until_it_stopped(
    bins, tmp_path, monkeypatch
):
    """An agent restarted while its replica drained adopts the engine to drain it: the record
    goes draining, then stopped; the adopted engine answering ready never flips it back to
    ready (a router would send it requests again)."""
    from llmgw.agent.engines.pidfile import read_pidfiles

    spec = llama(bins, tmp_path, monkeypatch)
    _, ready = await left_running(spec, tmp_path)
    (record,) = read_pidfiles(tmp_path / "state")
    rec = Recorder()
    second = supervisor(spec, tmp_path, rec, adopt=record)
    async with anyio.create_task_group() as tg:
        # the engine is this test's child (not the agent's, as after a real restart):
        # reaped here once it exits, or its zombie would read as a group still alive
        tg.start_soon(anyio.to_thread.run_sync, psutil.Process(ready.pid).wait)
        tg.start_soon(second.drain)  # as a LocalShard does: before run() has adopted it
        await anyio.sleep(0)
        assert second.state is S.DRAINING
        tg.start_soon(second.run)
    assert rec.phases == ["draining", "stopped"]
    assert second.state is S.EXITED and second.pid == ready.pid
    assert read_pidfiles(tmp_path / "state") == []
