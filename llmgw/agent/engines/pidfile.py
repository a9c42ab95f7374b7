"""One file per running engine, so the next agent finds the engines its predecessor left.

An agent that is restarted (an upgrade, a config change) leaves its engines serving, and
one that dies (SIGKILL, the OOM killer, a crash) cannot stop them: either way the next
agent reads these files, adopts each engine that still matches its assignment, and stops
the rest before it starts anything on their GPUs and ports, so that nothing runs twice.

The agent runs as root, so it acts only on a process it can prove is an engine it started;
what it cannot prove it leaves alone and reports. The engine's first process is proven by
its pid, start time and command line read back from /proc against the pidfile (a pid
reused by an unrelated process is never signalled nor adopted). While it lives, every
process of its group is its (a session leader's group holds only its descendants). Once
it is gone, its group number proves nothing (after a reboot or a double-forking daemon it
is anyone's): a process is the engine's only when its environment carries the engine's
marker (`ENGINE_MARKER`, a nonce per start that every process of the engine inherits, vLLM's
workers included) and it started after the engine did.

Every pidfile is read as a state file: bounded, no link followed, nothing that is not a
regular file (a FIFO would hang the agent before it registers, a link to /dev/zero grow it).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import psutil

from llmgw.agent.files import read_bounded

# a pidfile is a few hundred bytes; one past this is not one of ours
MAX_PIDFILE = 64 * 1024
# /proc/<pid>/environ: the kernel caps argv and environment together at a quarter of the
# stack limit (2 MiB by default); an environment larger than this proves nothing
_MAX_ENVIRON = 4 * 1024 * 1024
# the environment variable that marks every process of an engine: "<shard>/<nonce>"
ENGINE_MARKER = "LLMGW_ENGINE"
SAME_START = 0.05  # seconds: psutil's start times are in clock ticks


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
    # ENGINE_MARKER's value in the environment of every process of this engine; "" in a
    # pidfile of an agent before markers (its workers are then proven by a live leader only)
    marker: str = ""
    cpu_cores: list[int] = []  # the cores a CPU engine is pinned to (an adopting agent keeps them)

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
    # written new, never through whatever was left at that name (a link would be followed)
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(record))
    tmp.replace(path)  # never a half-written file for the next agent to misread
    return path


def remove_pidfile(state_dir: Path, shard: str) -> None:
    pidfile_path(state_dir, shard).unlink(missing_ok=True)


def new_marker(shard: str) -> str:
    """A value of ENGINE_MARKER for one start of `shard`'s engine: new at every start, so
    that nothing but that engine's processes carries it."""
    return f"{shard}/{secrets.token_hex(12)}"


def read_pidfile(path: Path) -> EngineProcess:
    """One pidfile: OSError when it is no regular file or cannot be read (NotRegularFile
    for a FIFO, a device or a link), ValueError when it is too large or does not decode."""
    data = read_bounded(path, MAX_PIDFILE, follow=False)
    try:
        return msgspec.json.decode(data, type=EngineProcess)
    except msgspec.DecodeError as e:
        raise ValueError(str(e)) from None


def read_pidfiles(state_dir: Path) -> list[EngineProcess]:
    """The engines the pidfiles under `state_dir` name, those that read (an unreadable
    one is the reaper's to remove): what tells this agent's processes from others'."""
    found = []
    for path in sorted((state_dir / "engines").glob("*.json")):
        try:
            found.append(read_pidfile(path))
        except (OSError, ValueError):
            continue
    return found


def process_create_time(pid: int) -> float:
    return psutil.Process(pid).create_time()


def marker_of(pid: int, procfs: Path = Path("/proc")) -> str | None:
    """ENGINE_MARKER's value in process `pid`'s environment (as it was started): None when
    it has none, or when it cannot be read (gone, not ours to read, too large)."""
    try:
        environ = read_bounded(procfs / str(pid) / "environ", _MAX_ENVIRON)
    except (OSError, ValueError):
        return None
    prefix = f"{ENGINE_MARKER}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def carries_marker(pid: int, marker: str, procfs: Path = Path("/proc")) -> bool:
    """Whether process `pid`'s environment (as it was started) holds ENGINE_MARKER=`marker`:
    False when it does not, or when it cannot be read (gone, not ours to read, too large)."""
    return bool(marker) and marker_of(pid, procfs) == marker


@dataclass(frozen=True)
class EngineFound:
    """The live processes of an engine an earlier agent left: those proven to be it, and a
    line for each process of its recorded group that nothing proves is it (left alone)."""

    proven: list[psutil.Process] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} ({proc.name()})"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {proc.pid}"


def find_engine(record: EngineProcess) -> EngineFound:
    """The processes of `record`'s engine that still run, each proven to be it (the
    module's docstring says how), and those of its recorded group that are not proven.
    Blocking (psutil, /proc): run it in a worker thread."""
    try:
        leader_started = psutil.Process(record.pid).create_time()
    except psutil.NoSuchProcess:
        leader_started = None
    if leader_started is not None and abs(leader_started - record.create_time) > SAME_START:
        # pid reused; the kernel reuses no pid while its group lives, so ours is gone
        return EngineFound()
    # its group is its own while its first process, proven, leads it (the agent starts
    # every engine in a session of its own: group id = session id = the leader's pid)
    leader_proven = (
        leader_started is not None
        and record.pgid == record.pid
        and _group_of(record.pid) == record.pgid
        and leader_alive(record)
    )
    found = EngineFound()
    for proc in psutil.process_iter(["pid", "create_time", "status"]):
        if _group_of(proc.pid) != record.pgid:
            continue
        # workers start after their leader; anything older is not from this engine. A
        # zombie has ended already: nothing to stop, nothing to prove
        started = proc.info["create_time"]
        if started is not None and started + SAME_START < record.create_time:
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if started is not None and (leader_proven or carries_marker(proc.pid, record.marker)):
            found.proven.append(proc)
        else:
            found.unproven.append(_describe(proc))
    return found


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _left_alone(record: EngineProcess, unproven: list[str]) -> str:
    why = (
        "its environment lacks the engine's marker"
        if record.marker
        else "its pidfile predates markers and the engine's first process is gone"
    )
    return (
        f"left alone {len(unproven)} process(es) in process group {record.pgid} of the engine "
        f"for shard {record.shard} (pid {record.pid}): nothing proves they are that engine "
        f"({why}): {', '.join(unproven)}"
    )


@dataclass(frozen=True)
class Refusal:
    """What the agent would not act on, for the log and an event: a pidfile it did not read
    (`pidfile`), or processes of an engine's recorded group not proven to be it
    (`processes`: left running)."""

    what: Literal["pidfile", "processes"]
    line: str

    def __str__(self) -> str:
        return self.line


def leader_alive(record: EngineProcess) -> bool:
    """The engine's own first process still runs: same pid, same start time, the same
    command line (what /proc says, not what the file says)."""
    try:
        proc = psutil.Process(record.pid)
        if abs(proc.create_time() - record.create_time) > SAME_START:
            return False
        return same_command(proc.cmdline(), record.argv) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def same_command(cmdline: list[str], argv: list[str]) -> bool:
    """Whether /proc's command line is `argv` run: itself, or its executable (by name) and
    arguments after another program's name (a script run by the interpreter its #! line
    names, as vLLM's `vllm` is, or a wrapper that execs the real binary, as a conda shim
    does). An argv of a name alone proves nothing beyond itself. The process's start time,
    checked beside this, is what says it is the one this agent started."""
    if not argv:
        return False
    if cmdline == argv:
        return True
    args = argv[1:]
    if not args or len(cmdline) <= len(args) or cmdline[-len(args) :] != args:
        return False
    return os.path.basename(cmdline[-len(args) - 1]) == os.path.basename(argv[0])


def leftover_engines(state_dir: Path) -> tuple[list[EngineProcess], list[Refusal]]:
    """The engines an earlier agent left with a pidfile: those with a process proven to be
    theirs, and what was refused: a file not read (removed: a FIFO, a link, too large,
    garbled), processes of a recorded group that nothing proves are the engine (left
    running). A file of an engine that is gone is removed. Blocking (psutil): run it in a
    worker thread."""
    directory = state_dir / "engines"
    if not directory.is_dir():
        return [], []
    found, notes = [], []
    for path in sorted(directory.glob("*.json")):
        try:
            record = read_pidfile(path)
        except (OSError, ValueError) as e:
            why = (e.strerror if isinstance(e, OSError) else None) or str(e)
            notes.append(Refusal("pidfile", f"removed engine pidfile {path} unread: {why}"))
            path.unlink(missing_ok=True)  # a link or a FIFO goes, never what it names
            continue
        members = find_engine(record) if path.stem == record.shard else EngineFound()
        if members.unproven:
            notes.append(Refusal("processes", _left_alone(record, members.unproven)))
        if not members.proven:
            path.unlink(missing_ok=True)  # gone (or a file that lies about whose it is)
            continue
        found.append(record)
    return found, notes


@dataclass(frozen=True)
class Stopped:
    """What `stop_engine` did: the line for the log, and the processes of the engine's
    recorded group it left running as nothing proves they are the engine."""

    line: str
    left_alone: Refusal | None = None


def stop_engine(state_dir: Path, record: EngineProcess, why: str, grace: float = 10.0) -> Stopped:
    """SIGTERM the processes proven to be an engine an earlier agent left, SIGKILL after
    `grace`. Blocking: run it in a worker thread."""
    found = find_engine(record)
    members = found.proven
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
    if not members:
        verb = "found nothing left of"
    left = Refusal("processes", _left_alone(record, found.unproven)) if found.unproven else None
    return Stopped(f"{verb} {what}: {why}", left)


def reap_leftover_engines(state_dir: Path, grace: float = 10.0) -> list[str]:
    """Stop every engine an earlier agent left running; one line per engine and per refusal,
    for the log. Blocking (psutil, sleeps): run it in a worker thread."""
    found, notes = leftover_engines(state_dir)
    lines = [n.line for n in notes]
    for record in found:
        stopped = stop_engine(state_dir, record, "not adopted", grace)
        lines.append(stopped.line)
        if stopped.left_alone is not None:
            lines.append(stopped.left_alone.line)
    return lines


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
    marker: str = "",
    cpu_cores: list[int] | None = None,
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
        marker=marker,
        cpu_cores=cpu_cores or [],
    )
