"""The supervisor against real (fake-engine) processes started through the adapters' argv."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import anyio
import psutil
import pytest
from serving import stream_chat

from llmgw.agent.engines import LaunchSpec
from llmgw.agent.engines.pidfile import (
    ENGINE_MARKER,
    new_record,
    pidfile_path,
    reap_leftover_engines,
    write_pidfile,
)
from llmgw.agent.supervisor import EngineSupervisor, PhaseChange, SupervisorTiming
from llmgw.sim.fake_engine import free_port, write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

FAST = SupervisorTiming(
    readiness_timeout=20,
    poll_interval=0.05,
    backoff_base=0.05,
    backoff_cap=0.4,
    stable_after=600,
    stop_grace=3,
    cancel_grace=3,
    drain_timeout=20,
    drain_poll=0.05,
    probe_timeout=2,
)


class Recorder:
    def __init__(self) -> None:
        self.changes: list[PhaseChange] = []
        self._events: dict[str, anyio.Event] = {}

    async def __call__(self, change: PhaseChange) -> None:
        self.changes.append(change)
        self._events.setdefault(change.phase, anyio.Event()).set()

    async def reached(self, phase: str, timeout: float = 20) -> PhaseChange:
        with anyio.fail_after(timeout):
            await self._events.setdefault(phase, anyio.Event()).wait()
        return next(c for c in reversed(self.changes) if c.phase == phase)

    @property
    def phases(self) -> list[str]:
        return [c.phase for c in self.changes]


def llama(bins, tmp_path: Path, monkeypatch, **env: str) -> LaunchSpec:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return LaunchSpec(
        served_name="qwen3-8b",
        engine="llama-server",
        binary=str(bins["llama-server"]),
        port=free_port(),
        host="127.0.0.1",
        weights_path=str(write_fake_gguf(tmp_path / "m.gguf")),
        gpu_uuids=("GPU-1",),
        context=4096,
        parallel=2,
    )


def supervisor(
    spec: LaunchSpec, tmp_path: Path, rec: Recorder, timing=FAST, clock=None, **kw
) -> EngineSupervisor:
    """Shard r1's supervisor, its log and state under `tmp_path`; `kw` as EngineSupervisor
    takes them (adopt=, launch_prefix=)."""
    return EngineSupervisor(
        spec,
        shard="r1",
        on_phase=rec,
        log_path=tmp_path / "logs" / "r1.log",
        state_dir=tmp_path / "state",
        timing=timing,
        clock=clock,
        **kw,
    )


async def _run_until_restarted(sup: EngineSupervisor, times: int) -> None:
    """Run `sup` until it has restarted its engine `times` times, then stop it."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        with anyio.fail_after(30):
            while sup.restarts < times:
                await anyio.sleep(0.05)
        await sup.stop()


async def left_running(spec: LaunchSpec, tmp_path: Path) -> tuple[EngineSupervisor, PhaseChange]:
    """A supervisor run until its engine is ready, then left running as an agent that is
    being restarted leaves it; with the engine's ready change."""
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        ready = await rec.reached("ready")
        sup.leave_running()  # the agent is being restarted
        tg.cancel_scope.cancel()
    return sup, ready


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def _stream(spec: LaunchSpec, max_tokens: int = 100) -> list[str]:
    return await stream_chat(
        f"http://127.0.0.1:{spec.port}", spec.served_name, max_tokens=max_tokens
    )


async def test_engine_goes_loading_then_ready_and_streams_a_chat_completion(
    bins, tmp_path, monkeypatch
):
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_LOAD_SECONDS="0.5")
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        ready = await rec.reached("ready")
        assert rec.phases == ["starting", "loading", "ready"]
        assert pidfile_path(tmp_path / "state", "r1").exists()
        events = await _stream(spec, max_tokens=3)
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == "tok0 tok1 tok2 "
        await sup.stop()
    assert rec.phases[-1] == "stopped"
    assert group_gone(ready.pid)
    assert not pidfile_path(tmp_path / "state", "r1").exists()
    log = (tmp_path / "logs" / "r1.log").read_text()
    assert "main: model loaded" in log  # the engine's own output reaches the shard's log


async def test_crash_while_loading_reports_the_output_tail_and_retries_with_growing_delays(
    bins, tmp_path, monkeypatch
):
    spec = llama(
        bins, tmp_path, monkeypatch, FAKE_ENGINE_FAIL_LOAD="tensor 'blk.0.attn_q' has wrong shape"
    )
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    await _run_until_restarted(sup, 4)
    failed = [c for c in rec.changes if c.phase == "failed"]
    assert failed[0].reason.startswith("exited with code 1 while loading; restart 1 in")
    assert (
        "llama_model_load: error loading model: tensor 'blk.0.attn_q' has wrong shape"
        in failed[0].tail
    )
    assert failed[0].tail[-1] == "main: exiting due to model loading error"
    assert [c.restarts for c in failed[:4]] == [1, 2, 3, 4]
    # base 0.05 doubling, capped at 0.4
    assert sup.restart_delays[:5] == [0.05, 0.1, 0.2, 0.4, 0.4][: len(sup.restart_delays[:5])]
    assert rec.phases[-1] == "stopped"


async def test_an_engine_that_served_long_enough_restarts_after_the_base_delay(
    bins, tmp_path, monkeypatch
):
    spec = llama(
        bins, tmp_path, monkeypatch, FAKE_ENGINE_CRASH_AFTER_LOAD="0.3", FAKE_ENGINE_EXIT_CODE="134"
    )
    rec = Recorder()
    timing = SupervisorTiming(**{**FAST.__dict__, "stable_after": 0.1})
    sup = supervisor(spec, tmp_path, rec, timing)
    await _run_until_restarted(sup, 3)
    assert sup.restart_delays[:3] == [0.05, 0.05, 0.05]
    failed = next(c for c in rec.changes if c.phase == "failed")
    assert failed.reason.startswith("exited with code 134 while serving")
    assert "CUDA error: an illegal memory access was encountered" in failed.tail


async def test_drain_lets_an_in_flight_stream_finish_before_stopping(bins, tmp_path, monkeypatch):
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_TOKENS="20", FAKE_ENGINE_TOKEN_RATE="20")
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    result: list[list[bytes]] = []

    async def client() -> None:
        result.append(await _stream(spec, max_tokens=20))

    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        ready = await rec.reached("ready")
        tg.start_soon(client)
        with anyio.fail_after(10):  # wait until the engine counts the request
            while True:
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"http://127.0.0.1:{spec.port}/slots") as r:
                        if any(s["is_processing"] for s in await r.json()):
                            break
                await anyio.sleep(0.02)
        await sup.drain()
        assert group_gone(ready.pid)
    events = result[0]
    assert events[-1] == "[DONE]"
    assert len(events) == 1 + 20 + 1 + 1  # role, 20 tokens, finish, DONE: nothing cut off
    assert rec.phases[-2:] == ["draining", "stopped"]


async def test_engine_ignoring_sigterm_is_killed_after_the_grace_period(
    bins, tmp_path, monkeypatch
):
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_IGNORE_SIGTERM="1")
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec, SupervisorTiming(**{**FAST.__dict__, "stop_grace": 0.3}))
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        ready = await rec.reached("ready")
        await sup.stop()
    assert group_gone(ready.pid)
    assert "SIGKILL" in (tmp_path / "logs" / "r1.log").read_text()
    assert rec.phases[-1] == "stopped"


async def test_cancelling_the_supervisor_leaves_no_engine_process_or_worker(
    bins, tmp_path, monkeypatch
):
    record = tmp_path / "record.json"
    spec = llama(
        bins, tmp_path, monkeypatch, FAKE_ENGINE_WORKERS="2", FAKE_ENGINE_RECORD=str(record)
    )
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        ready = await rec.reached("ready")
        workers = json.loads(record.read_text())["workers"]
        assert all(psutil.pid_exists(w) for w in workers)
        tg.cancel_scope.cancel()
    assert group_gone(ready.pid)
    assert not any(psutil.pid_exists(w) and psutil.Process(w).status() != "zombie" for w in workers)
    assert not pidfile_path(tmp_path / "state", "r1").exists()


async def test_workers_left_by_a_crashed_engine_are_killed_before_the_restart(
    bins, tmp_path, monkeypatch
):
    record = tmp_path / "record.json"
    spec = llama(
        bins,
        tmp_path,
        monkeypatch,
        FAKE_ENGINE_WORKERS="1",
        FAKE_ENGINE_RECORD=str(record),
        FAKE_ENGINE_CRASH_AFTER_LOAD="0.2",
    )
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await rec.reached("ready")
        first_pgid = json.loads(record.read_text())["pgid"]
        await rec.reached("failed")
        assert group_gone(first_pgid)  # its worker would hold GPU memory the restart needs
        await sup.stop()


async def test_missing_binary_fails_with_the_reason_and_no_process(tmp_path):
    spec = LaunchSpec(
        served_name="m", engine="llama-server", binary=str(tmp_path / "none"), port=free_port()
    )
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        failed = await rec.reached("failed")
        await sup.stop()
    assert failed.reason.startswith(f"cannot start {tmp_path / 'none'}: No such file or directory")


async def test_engine_not_ready_within_the_timeout_is_stopped_and_reported(
    bins, tmp_path, monkeypatch
):
    # loading for 30 s; the timeout is long enough for a Python process to start listening
    # on a busy machine (0.8 s was not, 1 run in about 20), so the last answer is the 503
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_LOAD_SECONDS="30")
    rec = Recorder()
    sup = supervisor(
        spec, tmp_path, rec, SupervisorTiming(**{**FAST.__dict__, "readiness_timeout": 4.0})
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        failed = await rec.reached("failed")
        await sup.stop()
    assert failed.reason.startswith(
        "not ready after 4 s (last: /health answered 503: Loading model)"
    )


async def wait_healthy(port: int) -> None:
    with anyio.fail_after(20):
        while True:
            try:
                async with aiohttp.ClientSession() as http:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            return
            except aiohttp.ClientError:
                pass
            await anyio.sleep(0.05)


def test_a_restarted_agent_stops_engines_left_by_the_one_before(bins, tmp_path):
    spec_port = free_port()
    model = write_fake_gguf(tmp_path / "m.gguf")
    argv = [str(bins["llama-server"]), "-m", str(model), "--port", str(spec_port)]
    env = {**os.environ, "FAKE_ENGINE_IGNORE_SIGTERM": "1"}
    leftover = subprocess.Popen(
        argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # an unrelated process whose pid a stale pidfile happens to name: must survive
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            portal.call(wait_healthy, spec_port)  # SIGTERM is ignored from here on
        state = tmp_path / "state"
        write_pidfile(state, new_record("r1", leftover.pid, argv, spec_port, ["GPU-1"], ""))
        stale = new_record("r2", stranger.pid, ["vllm"], 8000, [], "")
        stale.create_time -= 3600  # recorded an hour before this process started
        write_pidfile(state, stale)
        messages = reap_leftover_engines(state, grace=0.5)
        # psutil reaped it already (so Popen cannot read its status): it is simply gone
        assert not psutil.pid_exists(leftover.pid)
        assert stranger.poll() is None
        assert messages == [
            f"killed (it ignored SIGTERM) engine for shard r1 (pid {leftover.pid}, "
            f"port {spec_port}, GPUs GPU-1) left by an earlier agent: not adopted"
        ]
        assert list((state / "engines").iterdir()) == []
    finally:
        for p in (leftover, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_workers_of_an_engine_whose_leader_died_are_reaped(bins, tmp_path):
    record = tmp_path / "record.json"
    port = free_port()
    model = write_fake_gguf(tmp_path / "m.gguf")
    argv = [str(bins["llama-server"]), "-m", str(model), "--port", str(port)]
    env = {**os.environ, "FAKE_ENGINE_WORKERS": "1", "FAKE_ENGINE_RECORD": str(record)}
    env[ENGINE_MARKER] = "r1/one-start"  # what proves the orphaned worker is the engine's
    leader = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        with anyio.from_thread.start_blocking_portal() as portal:
            portal.call(wait_healthy, port)
        worker = json.loads(record.read_text())["workers"][0]
        state = tmp_path / "state"
        write_pidfile(
            state, new_record("r1", leader.pid, argv, port, [], "", marker=env[ENGINE_MARKER])
        )
        leader.kill()
        leader.wait()
        assert psutil.pid_exists(worker)  # orphaned, still holding its GPU memory
        messages = reap_leftover_engines(state, grace=2)
        assert messages[0].startswith("stopped engine for shard r1")
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie"
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


# --- named states: give up, leave running, adopt --------------------------------------------


def test_the_restart_policy_backs_off_gives_up_and_starts_over_after_serving():
    from llmgw.agent.supervisor import RestartPolicy

    policy = RestartPolicy(base=1, cap=4, stable_after=60, max_failed_starts=4)
    assert [policy.after_exit(None) for _ in range(3)] == [1, 2, 4]
    assert policy.after_exit(5.0) is None  # the 4th in a row: served 5 s, not 60
    policy = RestartPolicy(base=1, cap=4, stable_after=60, max_failed_starts=4)
    policy.after_exit(None)
    policy.after_exit(None)
    assert policy.after_exit(120.0) == 1  # it served two minutes first: a new problem


async def test_an_engine_that_keeps_failing_to_start_is_given_up_on(bins, tmp_path, monkeypatch):
    """It restarted for ever: supervisord's FATAL after N failed starts in a row, which is
    what the controller's crash-loop rule reads (records.Shard.gave_up)."""
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_FAIL_LOAD="CUDA error: no kernel image")
    rec = Recorder()
    timing = SupervisorTiming(**{**FAST.__dict__, "max_failed_starts": 3})
    sup = supervisor(spec, tmp_path, rec, timing)
    with anyio.fail_after(30):
        await sup.run()  # returns by itself
    last = rec.changes[-1]
    assert last.phase == "failed" and last.gave_up
    assert "gave up after 3 failed starts in a row" in last.reason
    assert any("CUDA error: no kernel image" in line for line in last.tail)
    assert sup.restarts == 2 and sup.state.value == "fatal"
    assert not pidfile_path(tmp_path / "state", "r1").exists()


class FakeClock:
    """Time that moves only when the supervisor waits: minutes of backoff in no time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1.7e9 + self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await anyio.sleep(0)


async def test_backoff_and_giving_up_follow_the_injected_clock(bins, tmp_path, monkeypatch):
    """Delays of 10, 20 and 40 s, then FATAL: taken on the supervisor's clock, so this runs
    in the time the four failed starts take, and the records carry that clock's times."""
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_FAIL_LOAD="CUDA error: no kernel image")
    rec = Recorder()
    clock = FakeClock()
    timing = SupervisorTiming(
        **{**FAST.__dict__, "backoff_base": 10, "backoff_cap": 60, "max_failed_starts": 4}
    )
    sup = supervisor(spec, tmp_path, rec, timing, clock)
    with anyio.fail_after(30):  # far less than the 70 s of backoff it decides
        await sup.run()
    assert sup.restart_delays == [10, 20, 40] and sup.state.value == "fatal"
    assert [s for s in clock.slept if s >= 10] == [10, 20, 40]
    assert rec.changes[-1].gave_up and rec.changes[-1].at >= 1.7e9 + 1070


async def test_the_readiness_timeout_follows_the_injected_clock(bins, tmp_path, monkeypatch):
    spec = llama(bins, tmp_path, monkeypatch, FAKE_ENGINE_LOAD_SECONDS="3600")
    rec = Recorder()
    clock = FakeClock()
    timing = SupervisorTiming(
        **{**FAST.__dict__, "readiness_timeout": 900, "poll_interval": 5, "max_failed_starts": 1}
    )
    sup = supervisor(spec, tmp_path, rec, timing, clock)
    with anyio.fail_after(60):  # a quarter of an hour of probing, in seconds
        await sup.run()
    last = rec.changes[-1]
    assert last.gave_up and "not ready after 900 s" in last.reason
    assert clock.now - 1000.0 >= 900


async def test_an_engine_left_running_is_adopted_by_the_next_supervisor(
    bins, tmp_path, monkeypatch
):
    from llmgw.agent.engines.pidfile import leftover_engines

    spec = llama(bins, tmp_path, monkeypatch)
    first, ready = await left_running(spec, tmp_path)
    assert first.state.value == "left"
    assert psutil.pid_exists(ready.pid) and not group_gone(ready.pid)  # still serving
    (record,), notes = leftover_engines(tmp_path / "state")
    assert record.pid == ready.pid and notes == []
    assert (await _stream(spec, max_tokens=2))[-1] == "[DONE]"

    rec2 = Recorder()
    second = supervisor(spec, tmp_path, rec2, adopt=record)
    async with anyio.create_task_group() as tg:
        tg.start_soon(second.run)
        adopted = await rec2.reached("ready")
        assert rec2.phases == ["ready"]  # no start, no load: the same engine serves on
        assert adopted.pid == ready.pid
        os.killpg(ready.pid, signal.SIGKILL)  # it dies: noticed without being its parent
        restarted = await rec2.reached("starting")
        assert "adopted from an earlier agent: exit status not known" in next(
            c.reason for c in rec2.changes if c.phase == "failed"
        )
        with anyio.fail_after(20):
            while rec2.phases.count("ready") < 2:
                await anyio.sleep(0.05)
        new = rec2.changes[-1]
        assert new.phase == "ready" and new.pid != ready.pid and restarted.phase == "starting"
        await second.stop()
    assert group_gone(new.pid)


async def test_an_engine_run_under_a_launcher_is_recorded_by_its_own_command(
    bins, tmp_path, monkeypatch
):
    """Under systemd the engine runs as `systemd-run --scope ... -- ENGINE`, which execs the
    engine: the pidfile keeps the engine's command, which is what /proc shows and what
    the next agent compares with its assignment's. `env` stands in for systemd-run here."""
    from llmgw.agent.engines.pidfile import leader_alive, leftover_engines

    spec = llama(bins, tmp_path, monkeypatch)
    rec = Recorder()
    sup = supervisor(spec, tmp_path, rec, launch_prefix=["env", "--"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await rec.reached("ready")
        (record,), _ = leftover_engines(tmp_path / "state")
        assert record.argv == sup.command.argv and leader_alive(record)
        await sup.stop()


async def test_an_engine_whose_port_was_taken_while_it_loaded_is_reported_for_a_port_move(
    bins, tmp_path
):
    """vLLM binds its port only after starting up: a program that took it meanwhile makes
    it exit, and the report says so as the launch refusal does (refused port-in-use), for
    the controller to give the replica another port."""
    import socket

    from llmgw.bus.records import PORT_IN_USE

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    port = free_port()
    spec = LaunchSpec(
        served_name="m",
        engine="vllm",
        binary=str(bins["vllm"]),
        port=port,
        host="127.0.0.1",
        weights_path=str(model),
    )
    once = SupervisorTiming(readiness_timeout=20, poll_interval=0.05, max_failed_starts=1)
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        rec = Recorder()
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor(spec, tmp_path, rec, timing=once).run)
            failed = await rec.reached("failed")
            tg.cancel_scope.cancel()
    assert failed.refused == PORT_IN_USE
    assert f"port {port} on 127.0.0.1 is held by another process" in failed.reason
    assert "(OSError: [Errno 98] error while attempting to bind" in failed.reason
