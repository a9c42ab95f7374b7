"""The agent acts only on a process it can prove is an engine it started (issue 30).

An earlier agent's pidfile names an engine by pid, process group, start time, command line
and a marker every process of the engine inherits in its environment. A recorded group
number alone proves nothing: after a reboot or a double-forking daemon it is anyone's.
Real processes throughout: the fake engine, `sleep`, and a real agent on a real NATS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import anyio
import msgspec
import psutil
import pytest
from agent_helpers import agent_config, host_dirs, start_agent, stop
from test_supervisor import left_running, llama
from waiting import until

from llmgw.agent.engines.pidfile import (
    ENGINE_MARKER,
    EngineProcess,
    leftover_engines,
    new_record,
    pidfile_path,
    read_pidfiles,
    reap_leftover_engines,
    write_pidfile,
)
from llmgw.bus import records
from llmgw.bus.client import decoder
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _orphan_group(env: dict[str, str] | None = None) -> tuple[int, int]:
    """What a double-forking daemon leaves: a `sleep` in a process group whose leader (a
    shell, in a session of its own) has exited. (group id, the sleep's pid)"""
    shell = subprocess.Popen(
        ["sh", "-c", "sleep 120 >/dev/null 2>&1 & echo $!"],
        stdout=subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    out, _ = shell.communicate(timeout=10)
    return shell.pid, int(out)


def _forged(how: str, tmp_path: Path) -> tuple[EngineProcess, int]:
    """A pidfile an earlier agent could have left, whose group now holds an unrelated
    `sleep`, and that sleep's pid. `how`: the recorded leader is gone and its group number
    is a daemon's now (with or without a marker); or the pidfile names the sleep's own pid
    and start time, with an engine's command line."""
    argv = ["/opt/llama/llama-server", "-m", str(tmp_path / "m.gguf"), "--port", "18001"]
    if how == "own pid and start time":
        # a grandchild, as the others are: nobody here waits for it
        pgid, sleeper = _orphan_group()
        record = new_record("r1", sleeper, argv, 18001, [], "", marker="r1/forged")
        record.pgid = pgid
        return record, sleeper
    pgid, sleeper = _orphan_group()
    record = new_record("r1", pgid, argv, 18001, [], "", marker="r1/abc" if "marker" in how else "")
    record.create_time = psutil.Process(sleeper).create_time() - 5  # the engine started first
    return record, sleeper


CASES = ["leader gone, marker recorded", "leader gone, no marker", "own pid and start time"]


@pytest.mark.parametrize("how", CASES)
def test_an_unrelated_process_in_a_recorded_group_is_left_alone_and_reported(tmp_path, how):
    state = tmp_path / "state"
    record, sleeper = _forged(how, tmp_path)
    try:
        write_pidfile(state, record)
        found, notes = leftover_engines(state)
        assert found == []
        assert [n.what for n in notes] == ["processes"]
        assert f"pid {sleeper} (sleep)" in notes[0].line
        assert not pidfile_path(state, "r1").exists()  # nothing of that engine is left
        write_pidfile(state, record)
        reap_leftover_engines(state, grace=0.5)
        assert _alive(sleeper)
    finally:
        _kill(sleeper)


async def test_workers_that_outlive_their_leader_are_found_by_their_marker_and_stopped(
    bins, tmp_path, monkeypatch
):
    """An engine started by the supervisor and left running (an agent restart); its leader
    then dies and its worker lives on, holding its GPU memory: the next agent finds the
    worker by the marker it inherited, and stops it."""
    record_file = tmp_path / "record.json"
    spec = llama(
        bins, tmp_path, monkeypatch, FAKE_ENGINE_WORKERS="1", FAKE_ENGINE_RECORD=str(record_file)
    )
    _, ready = await left_running(spec, tmp_path)
    worker = msgspec.json.decode(record_file.read_bytes())["workers"][0]
    try:
        (record,) = read_pidfiles(tmp_path / "state")
        assert record.marker.startswith("r1/")
        os.kill(ready.pid, signal.SIGKILL)  # the leader only
        with anyio.fail_after(10):
            while _alive(ready.pid):
                await anyio.sleep(0.05)
        assert _alive(worker)  # orphaned, still holding its GPU memory
        lines = reap_leftover_engines(tmp_path / "state", grace=2)
        assert lines[0].startswith("stopped engine for shard r1")
        with anyio.fail_after(10):
            while _alive(worker):
                await anyio.sleep(0.05)
    finally:
        _kill(worker)
        _kill(ready.pid)


def test_an_engine_started_elsewhere_with_the_marker_of_another_start_is_not_proven(bins, tmp_path):
    """The marker is new at every start: a process carrying another start's marker is not
    this start's engine."""
    model = write_fake_gguf(tmp_path / "m.gguf")
    argv = [str(bins["llama-server"]), "-m", str(model), "--port", "1"]
    env = {**os.environ, ENGINE_MARKER: "r1/an-earlier-start"}
    pgid, sleeper = _orphan_group(env)
    record = new_record("r1", pgid, argv, 1, [], "", marker="r1/this-start")
    record.create_time = psutil.Process(sleeper).create_time() - 5
    try:
        write_pidfile(tmp_path / "state", record)
        found, notes = leftover_engines(tmp_path / "state")
        assert found == [] and [n.what for n in notes] == ["processes"]
        record.marker = "r1/an-earlier-start"
        write_pidfile(tmp_path / "state", record)
        (found,), notes = leftover_engines(tmp_path / "state")
        assert found.shard == "r1" and notes == []
    finally:
        _kill(sleeper)


def _hostile_pidfiles(state: Path) -> None:
    """A FIFO and a link to /dev/zero among the pidfiles, and a link to a valid pidfile
    kept elsewhere: none of them is a file this agent wrote."""
    engines = state / "engines"
    engines.mkdir(parents=True, exist_ok=True)
    os.mkfifo(engines / "node1.fifo.json")
    os.symlink("/dev/zero", engines / "node1.zero.json")
    elsewhere = write_pidfile(state / "elsewhere", new_record("node1.r9", 1, ["x"], 1, [], ""))
    os.symlink(elsewhere, engines / "node1.r9.json")


def test_a_fifo_or_a_link_among_the_pidfiles_is_refused_at_once(tmp_path):
    state = tmp_path / "state"
    _hostile_pidfiles(state)
    assert read_pidfiles(state) == []  # what the inventory reads before registering
    assert len(list((state / "engines").iterdir())) == 3
    found, notes = leftover_engines(state)
    assert found == []
    assert sorted((n.what, n.line.rsplit(" unread: ", 1)[-1]) for n in notes) == [
        ("pidfile", "is a FIFO, not a regular file"),
        ("pidfile", "is a symbolic link, not a regular file"),
        ("pidfile", "is a symbolic link, not a regular file"),
    ]
    assert list((state / "engines").iterdir()) == []  # the links go, never what they name
    assert (state / "elsewhere" / "engines" / "node1.r9.json").exists()


async def test_a_restarted_agent_registers_past_hostile_pidfiles_and_spares_a_stranger(
    bus, nats_server, tmp_path
):
    """A real agent started over a state dir holding a FIFO, a /dev/zero link and a pidfile
    whose recorded group is now an unrelated `sleep`: it registers, leaves the sleep
    running, and says what it refused in events."""
    dirs = host_dirs(tmp_path)
    install_fake_engines(dirs["bin"])
    cfg = agent_config(nats_server.url, dirs, id="node1")
    _hostile_pidfiles(dirs["state"])
    record, sleeper = _forged("leader gone, marker recorded", tmp_path)
    record.shard = "node1.r1"
    write_pidfile(dirs["state"], record)
    events: list[records.Event] = []

    async def on_event(msg):
        events.append(records.decode(msg.data, records.Event))

    await bus.subscribe("llmgw.events.*.node1", on_event)
    log = tmp_path / "agent.log"
    proc = start_agent(cfg, tmp_path / "agent.toml", [dirs["bin"], "/usr/bin", "/bin"], log)
    try:

        async def registered():
            return await bus.get("nodes.node1", decoder(records.NodeInventory))

        await until(registered, timeout=30)

        async def all_said():
            kinds = sorted(e.kind for e in events if e.kind.startswith("agent-"))
            return kinds if len(kinds) >= 4 else None

        kinds = await until(all_said, timeout=20)
        assert kinds == ["agent-left-alone"] + ["agent-pidfile-refused"] * 3
        (left,) = [e for e in events if e.kind == "agent-left-alone"]
        assert f"pid {sleeper} (sleep)" in left.message
        assert proc.poll() is None and _alive(sleeper)
    finally:
        assert stop(proc) == 0
        _kill(sleeper)


def test_a_pidfile_is_never_written_through_a_link_left_at_its_name(tmp_path):
    state = tmp_path / "state"
    (state / "engines").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep\n")
    record = new_record("r1", os.getpid(), ["x"], 1, [], "")
    os.symlink(victim, pidfile_path(state, "r1").with_suffix(".tmp"))
    os.symlink(victim, pidfile_path(state, "r1"))
    write_pidfile(state, record)
    assert victim.read_bytes() == b"keep\n"
    assert read_pidfiles(state) == [record]


def test_a_command_line_is_the_engines_by_its_executable_and_arguments():
    from llmgw.agent.engines.pidfile import same_command

    argv = ["/usr/local/bin/vllm", "serve", "/models/x", "--port", "18000"]
    assert same_command(argv, argv)
    assert same_command(["/usr/bin/python3", *argv], argv)  # its #! interpreter
    shim = ["/opt/conda/bin/llama-server", "-m", "x.gguf", "--port", "1"]
    assert same_command(["/opt/conda/pkgs/llama/bin/llama-server", *shim[1:]], shim)
    # the same arguments to another program, or a name alone, prove nothing
    assert not same_command(["/usr/bin/sleep", *argv[1:]], argv)
    assert not same_command(["sleep", "120"], ["vllm"])
    assert not same_command([], argv)


def test_a_live_engine_does_not_vouch_for_a_group_that_is_not_its_own(tmp_path):
    """A pidfile that names a live first process (pid, start time and command line all
    match) beside the group number of another: that group's processes are not proven."""
    leader = subprocess.Popen(["sleep", "120"], start_new_session=True)
    pgid, sleeper = _orphan_group()
    try:
        record = new_record("r1", leader.pid, ["sleep", "120"], 1, [], "")
        record.pgid = pgid
        write_pidfile(tmp_path / "state", record)
        reap_leftover_engines(tmp_path / "state", grace=0.5)
        assert _alive(sleeper)
    finally:
        _kill(sleeper)
        leader.kill()
        leader.wait()


# --- GPU memory: whose it is (discovery.processes.HostProcesses, on the real /proc) ------------


def _group_of_two(marker: str) -> tuple[int, int, int]:
    """A process group whose leader (a shell, in a session of its own, with ENGINE_MARKER
    set) has exited, leaving two `sleep`s: one inherited the marker, the other was started
    without it. (group id, the marked sleep's pid, the unmarked one's)"""
    shell = subprocess.Popen(
        [
            "sh",
            "-c",
            f"sleep 120 >/dev/null 2>&1 & a=$!; env -u {ENGINE_MARKER} sleep 120 >/dev/null 2>&1 & "
            'echo "$a $!"',
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, ENGINE_MARKER: marker},
    )
    out, _ = shell.communicate(timeout=10)
    marked, unmarked = (int(p) for p in out.split())
    for _ in range(200):  # `env` has exec'd `sleep` (until then, its environment is the shell's)
        if psutil.Process(unmarked).cmdline()[:1] == ["sleep"]:
            break
        time.sleep(0.05)
    return shell.pid, marked, unmarked


def test_gpu_memory_of_a_recycled_group_is_foreign_unless_the_marker_proves_it(tmp_path):
    """The engine's first process is gone: of two processes in its recorded group, the one
    whose environment carries the engine's marker is its, the other (a daemon that got the
    group number) is foreign, whatever its group and start time say."""
    from llmgw.agent.discovery.processes import HostProcesses

    pgid, marked, unmarked = _group_of_two("n1.r1/this-start")
    try:
        argv = ["/opt/vllm/bin/vllm", "serve", str(tmp_path / "m"), "--port", "18001"]
        record = new_record("n1.r1", pgid, argv, 18001, ["0"], "", marker="n1.r1/this-start")
        record.create_time = psutil.Process(marked).create_time() - 5  # the engine came first
        lookup = HostProcesses(Path("/proc"), [record])

        assert lookup.engine(marked) == pgid
        assert lookup.engine(unmarked) is None and not lookup.own(unmarked)
        assert lookup.engine(os.getpid()) is None  # neither in the group nor marked

        # another start's marker proves nothing about this one
        other = HostProcesses(Path("/proc"), [msgspec.structs.replace(record, marker="n1.r1/x")])
        assert not other.own(marked) and not other.own(unmarked)
        # a pidfile without a marker (an agent before markers): only a live leader proves
        bare = HostProcesses(Path("/proc"), [msgspec.structs.replace(record, marker="")])
        assert not bare.own(marked) and not bare.own(unmarked)
    finally:
        _kill(marked)
        _kill(unmarked)


def test_gpu_memory_of_a_live_engines_group_is_its_own_when_its_first_process_is_proven():
    """While the engine's first process runs as recorded (pid, start time, command line),
    every process of its group is its, marked or not; the same pid and start time with
    another command line prove nothing."""
    from llmgw.agent.discovery.processes import HostProcesses

    argv = ["sh", "-c", f"env -u {ENGINE_MARKER} sleep 120 >/dev/null 2>&1 & wait"]
    leader = subprocess.Popen(
        argv, start_new_session=True, env={**os.environ, ENGINE_MARKER: "n1.r1/m"}
    )
    try:
        for _ in range(200):  # the shell starts its worker
            if psutil.Process(leader.pid).children():
                break
            time.sleep(0.05)
        (worker,) = psutil.Process(leader.pid).children()
        record = new_record("n1.r1", leader.pid, argv, 18001, ["0"], "", marker="n1.r1/m")
        lookup = HostProcesses(Path("/proc"), [record])
        assert (lookup.engine(leader.pid), lookup.engine(worker.pid)) == (leader.pid, leader.pid)

        # its pid and start time, another command line, no marker to vouch for the leader
        forged = msgspec.structs.replace(
            record, argv=["/opt/vllm/bin/vllm", "serve", "x"], marker=""
        )
        lookup = HostProcesses(Path("/proc"), [forged])
        assert lookup.engine(worker.pid) is None and lookup.engine(leader.pid) is None
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
