"""One file per running engine, so the next agent finds the engines its predecessor left.

An agent that is restarted (an upgrade, a config change) leaves its engines serving, and
one that dies (SIGKILL, the OOM killer, a crash) cannot stop them: either way the next
agent reads these files, adopts each engine that still matches its assignment, and stops
the rest before it starts anything on their GPUs and ports, so that nothing runs twice.
Identity is the process start time as well as the pid (a pid reused by an unrelated
process is never signalled nor adopted), and the command line read back from /proc.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import psutil

# a pidfile is a few hundred bytes; one past this is not one of ours
_MAX_PIDFILE = 64 * 1024


class EngineProcess(msgspec.Struct, kw_only=True):
    shard: str  # "<node>.<rid>": unique on this node
    pid: int
    pgid: int
    create_time: float  # psutil's, for identity: pids are reused
    argv: list[str]  # the engine's own command line (no launcher such as systemd-run)
    port: int
    gpus: list[str] = []
    log_path: str = ""
    started_at: float = 0.0
    # of the assignment it serves: the one it was started for, or a later one its agent
    # kept it for (only the catalog changed, not where it runs)
    generation: int = 0
    # where the controller put it, beside port and GPUs: a multi-node replica's rank, its
    # node count and rank 0's address (what an adopting agent compares with its assignment)
    rank: int = 0
    nodes: int = 1
    master_addr: str = ""
    ready: bool = False  # it has answered ready: an adopting agent expects it to go on

    @property
    def rid(self) -> str:
        return self.shard.rsplit(".", 1)[-1]

    @property
    def place(self) -> tuple[tuple[str, ...], int, int, int, str]:
        """GPUs, port, rank, node count and rank 0's address: what the controller decided
        for it, as opposed to what the catalog says (`shards.place_of` for a launch)."""
        return (tuple(self.gpus), self.port, self.rank, self.nodes, self.master_addr)


def pidfile_path(state_dir: Path, shard: str) -> Path:
    return state_dir / "engines" / f"{shard}.json"


def write_pidfile(state_dir: Path, record: EngineProcess) -> Path:
    path = pidfile_path(state_dir, record.shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.encode(record))
    tmp.replace(path)  # never a half-written file for the next agent to misread
    return path


def remove_pidfile(state_dir: Path, shard: str) -> None:
    pidfile_path(state_dir, shard).unlink(missing_ok=True)


def read_pidfiles(state_dir: Path) -> list[EngineProcess]:
    """The engines the pidfiles under `state_dir` name, those that decode (an unreadable
    one is the reaper's to remove): what tells this agent's processes from others'."""
    found = []
    for path in sorted((state_dir / "engines").glob("*.json")):
        try:
            found.append(msgspec.json.decode(path.read_bytes(), type=EngineProcess))
        except (OSError, msgspec.DecodeError):
            continue
    return found


def process_create_time(pid: int) -> float:
    return psutil.Process(pid).create_time()


def _members(record: EngineProcess) -> list[psutil.Process]:
    """The live processes of the engine's group, or [] when the group is not ours any more."""
    try:
        leader_started = psutil.Process(record.pid).create_time()
    except psutil.NoSuchProcess:
        leader_started = None
    if leader_started is not None and abs(leader_started - record.create_time) > 0.05:
        # pid reused; the kernel reuses no pid while its group lives, so ours is gone
        return []
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(proc.pid) != record.pgid:
                continue
        except (ProcessLookupError, PermissionError):
            continue
        # workers start after their leader; anything older is not from this engine
        if proc.info["create_time"] + 0.05 >= record.create_time:
            found.append(proc)
    return found


def leader_alive(record: EngineProcess) -> bool:
    """The engine's own first process still runs: same pid, same start time, the same
    command line (what /proc says, not what the file says)."""
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) > 0.05:
            return False
        return same_command(proc.cmdline(), record.argv) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def same_command(cmdline: list[str], argv: list[str]) -> bool:
    """Whether /proc's command line is `argv` run: itself, or its arguments after another
    program's name (a script run by the interpreter its #! line names, as vLLM's `vllm`
    is, or a wrapper that execs the real binary, as a conda shim does). The process's
    start time, checked beside this, is what says it is the one this agent started."""
    if not argv:
        return False
    if cmdline == argv:
        return True
    args = argv[1:]
    return len(cmdline) > len(args) and (not args or cmdline[-len(args) :] == args)


def leftover_engines(state_dir: Path) -> tuple[list[EngineProcess], list[str]]:
    """The engines an earlier agent left with a pidfile: those whose group still lives,
    and one line per file that was dropped (unreadable, or its engine gone). Blocking
    (psutil): run it in a worker thread."""
    directory = state_dir / "engines"
    if not directory.is_dir():
        return [], []
    found, notes = [], []
    for path in sorted(directory.glob("*.json")):
        try:
            data = path.read_bytes()
            if len(data) > _MAX_PIDFILE:
                raise ValueError(f"{len(data)} bytes")
            record = msgspec.json.decode(data, type=EngineProcess)
        except (OSError, ValueError, msgspec.DecodeError) as e:
            notes.append(f"ignored unreadable engine pidfile {path}: {e}")
            path.unlink(missing_ok=True)
            continue
        if path.stem != record.shard or not _members(record):
            path.unlink(missing_ok=True)  # gone (or a file that lies about whose it is)
            continue
        found.append(record)
    return found, notes


def stop_engine(state_dir: Path, record: EngineProcess, why: str, grace: float = 10.0) -> str:
    """SIGTERM the group of an engine an earlier agent left, SIGKILL after `grace`; the
    line for the log. Blocking: run it in a worker thread."""
    members = _members(record)
    what = (
        f"engine for shard {record.shard} (pid {record.pid}, port {record.port}, "
        f"GPUs {','.join(record.gpus) or 'none'}) left by an earlier agent"
    )
    for proc in members:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(members, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    remove_pidfile(state_dir, record.shard)
    verb = "killed (it ignored SIGTERM)" if alive else "stopped"
    return f"{verb} {what}: {why}"


def reap_leftover_engines(state_dir: Path, grace: float = 10.0) -> list[str]:
    """Stop every engine an earlier agent left running; one line per engine, for the log.
    Blocking (psutil, sleeps): run it in a worker thread."""
    found, notes = leftover_engines(state_dir)
    return notes + [stop_engine(state_dir, r, "not adopted", grace) for r in found]


def new_record(
    shard: str,
    pid: int,
    argv: list[str],
    port: int,
    gpus: list[str],
    log_path: str,
    *,
    generation: int = 0,
    rank: int = 0,
    nodes: int = 1,
    master_addr: str = "",
) -> EngineProcess:
    try:
        created = process_create_time(pid)
    except psutil.NoSuchProcess:
        created = time.time()
    return EngineProcess(
        shard=shard,
        pid=pid,
        pgid=pid,  # engines run in their own session: group id = leader's pid
        create_time=created,
        argv=argv,
        port=port,
        gpus=gpus,
        log_path=log_path,
        started_at=time.time(),
        generation=generation,
        rank=rank,
        nodes=nodes,
        master_addr=master_addr,
    )
