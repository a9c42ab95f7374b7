"""Which process is which: its name, from /proc/<pid>/comm, and whether it is one of this
agent's engines (its GPU memory is the agent's own) or foreign (another team's job, a
notebook, an engine no pidfile names any more).

NVML lists the pids holding GPU memory and nothing else. A process is an engine's only on
the proof the agent acts on when it stops engines (llmgw.agent.engines.pidfile): the
engine's first process is proven by its pid, start time and command line read back from
/proc against its pidfile, and while it lives every process of its group or session is its
(the kernel gives no process that number while the group lives, and the engine's session
is its own); a process that outlived it is the engine's only when its environment carries
the engine's marker (`pidfile.ENGINE_MARKER`, a nonce per start that every process of the
engine inherits) and it started after the engine did. A group number alone proves nothing:
after a reboot or an engine crash it may be any daemon's, and its GPU memory is foreign.

The parsers take the text of the files; `HostProcesses` reads them under the agent's
`paths.procfs`, each read bounded (stat lines are under 1 KiB, comm 16 bytes, a command
line no longer than a pidfile holds, an environment as `pidfile.marker_of` reads it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.engines.pidfile import (
    MAX_PIDFILE,
    SAME_START,
    EngineProcess,
    marker_of,
    same_command,
)
from llmgw.agent.files import bounded_lines, open_regular, read_bounded

NAME_CHARS = 64  # the kernel keeps 15 (TASK_COMM_LEN); a recorded tree may hold anything
_READ_BYTES = 4096
_STAT_LINES = 100_000  # /proc/stat: a line per CPU, then btime
# a command line longer than the pidfile that records it cannot be the one recorded
_MAX_CMDLINE = MAX_PIDFILE


@dataclass(frozen=True, slots=True)
class ProcStat:
    """What /proc/<pid>/stat says about who a process belongs to."""

    pgrp: int
    session: int
    start_ticks: int  # clock ticks after boot (field 22)
    state: str = "?"  # R, S, D, Z (a zombie has ended), ...


def parse_stat(text: str) -> ProcStat | None:
    """`4242 (python3) S 1 4242 4242 ...`; the name in parentheses may itself hold spaces and
    parentheses, so the fields are counted after the last ')'. None when it does not parse."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        # after the name: state, ppid, pgrp, session, ... starttime is the 20th
        return ProcStat(
            pgrp=int(fields[2]),
            session=int(fields[3]),
            start_ticks=int(fields[19]),
            state=fields[0],
        )
    except ValueError:
        return None


def parse_boot_time(lines: Iterable[str]) -> float | None:
    """`btime 1718000000` of /proc/stat: when the machine booted, unix seconds."""
    for line in lines:
        if line.startswith("btime "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def parse_comm(text: str) -> str:
    """The name in /proc/<pid>/comm, printable and bounded."""
    name = text.strip()[:NAME_CHARS]
    return "".join(c if c.isprintable() else "?" for c in name)


def parse_cmdline(data: bytes) -> list[str]:
    """/proc/<pid>/cmdline as psutil reads it (what `pidfile.leader_alive` compares): NUL
    separated, or space separated when the process rewrote its title (setproctitle)."""
    if not data:
        return []
    sep = b"\0" if data.endswith(b"\0") else b" "
    if data.endswith(sep):
        data = data[:-1]
    parts = data.split(sep)
    if sep == b"\0" and len(parts) == 1 and b" " in data:
        parts = data.split(b" ")
    return [os.fsdecode(p) for p in parts]


class HostProcesses:
    """Answers `discovery.gpus.ProcessLookup` from the files under `procfs` and this agent's
    engines (their pidfile records), proving each as the module's docstring says. One is
    made per probe: what it proved of each engine's first process holds for that probe."""

    def __init__(
        self, procfs: Path, engines: Sequence[EngineProcess], clock_ticks: int | None = None
    ) -> None:
        self.procfs = procfs
        self.engines = list(engines)
        self.by_marker = {e.marker: e for e in self.engines if e.marker}
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self.boot_time = self._boot_time() if self.engines else None
        self._leader_proven: dict[str, bool] = {}  # by shard

    def _read(self, *parts: str) -> str | None:
        try:
            with open_regular(self.procfs.joinpath(*parts)) as f:
                return f.read(_READ_BYTES).decode(errors="replace")
        except OSError:
            return None  # ended meanwhile, or not visible from here

    def _boot_time(self) -> float | None:
        try:
            return parse_boot_time(bounded_lines(self.procfs / "stat", _STAT_LINES, _READ_BYTES))
        except OSError:
            return None

    def _stat(self, pid: int) -> tuple[ProcStat, float] | None:
        """The process's stat and when it started (unix seconds); None when either cannot
        be read: then nothing proves what it is."""
        text = self._read(str(pid), "stat")
        stat = None if text is None else parse_stat(text)
        if stat is None or self.boot_time is None:
            return None
        return stat, self.boot_time + stat.start_ticks / self.clock_ticks

    def _cmdline(self, pid: int) -> list[str] | None:
        try:
            return parse_cmdline(read_bounded(self.procfs / str(pid) / "cmdline", _MAX_CMDLINE))
        except (OSError, ValueError):
            return None  # gone, not visible from here, or longer than any recorded

    def leader_proven(self, engine: EngineProcess) -> bool:
        """The engine's first process still runs and leads its group: the same pid, start
        time and command line as its pidfile records (`pidfile.leader_alive`, read here)."""
        proven = self._leader_proven.get(engine.shard)
        if proven is None:
            proven = self._prove_leader(engine)
            self._leader_proven[engine.shard] = proven
        return proven

    def _prove_leader(self, engine: EngineProcess) -> bool:
        if engine.pgid != engine.pid:
            return False  # every engine runs in a session of its own: group id = its pid
        found = self._stat(engine.pid)
        if found is None:
            return False
        stat, started = found
        if stat.state == "Z" or stat.pgrp != engine.pgid:
            return False
        if abs(started - engine.create_time) > SAME_START:
            return False  # the pid was given to another process since
        cmdline = self._cmdline(engine.pid)
        return cmdline is not None and same_command(cmdline, engine.argv)

    def name(self, pid: int) -> str:
        text = self._read(str(pid), "comm")
        return "" if text is None else parse_comm(text)

    def own(self, pid: int) -> bool:
        return self.engine(pid) is not None

    def engine(self, pid: int) -> int | None:
        """The pid of the first process of the engine `pid` is proven part of, or None."""
        if not self.engines:
            return None
        found = self._stat(pid)
        if found is None:
            return None  # not readable from here: nothing proves it is an engine's
        stat, started = found
        for e in self.engines:
            # workers start after their leader: an older process only reuses the number
            if started + SAME_START < e.create_time:
                continue
            if e.pgid in (stat.pgrp, stat.session) and self.leader_proven(e):
                return e.pid
        if self.by_marker:
            # the leader is gone (or never proven): only the marker says whose it is
            marked = self.by_marker.get(marker_of(pid, self.procfs) or "")
            if marked is not None and started + SAME_START >= marked.create_time:
                return marked.pid
        return None
