"""One file per running engine, so an agent that died without stopping its engines
can find them and stop them before it starts anything on those GPUs and ports.

Engines are stopped with the agent (see docs/engines.md). The pidfile covers the
cases where that could not happen: the agent was SIGKILLed, OOM-killed or crashed.
A later agent must never start a second engine on the same GPUs or port, so it
reaps what the files name first. Identity is the process start time as well as
the pid, so a pid reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import psutil


class EngineProcess(msgspec.Struct, kw_only=True):
    shard: str  # "<rid>" or any name unique on this node
    pid: int
    pgid: int
    create_time: float  # psutil's, for identity: pids are reused
    argv: list[str]
    port: int
    gpus: list[str] = []
    log_path: str = ""
    started_at: float = 0.0


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


def reap_leftover_engines(state_dir: Path, grace: float = 10.0) -> list[str]:
    """Stop every engine an earlier agent left running; one line per engine, for the log.

    Blocking (psutil, sleeps): run it in a worker thread before launching anything.
    """
    directory = state_dir / "engines"
    if not directory.is_dir():
        return []
    messages = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = msgspec.json.decode(path.read_bytes(), type=EngineProcess)
        except (OSError, msgspec.DecodeError) as e:
            messages.append(f"ignored unreadable engine pidfile {path}: {e}")
            path.unlink(missing_ok=True)
            continue
        members = _members(record)
        if not members:
            path.unlink(missing_ok=True)
            continue
        what = (
            f"leftover engine for shard {record.shard} (pid {record.pid}, port {record.port}, "
            f"GPUs {','.join(record.gpus) or 'none'}) from an earlier agent"
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
        verb = "killed (ignored SIGTERM)" if alive else "stopped"
        messages.append(f"{verb} {what}")
        path.unlink(missing_ok=True)
    return messages


def new_record(
    shard: str, pid: int, argv: list[str], port: int, gpus: list[str], log_path: str
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
    )
