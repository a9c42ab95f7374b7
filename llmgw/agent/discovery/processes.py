"""Which process is which: its name and process group, from /proc/<pid>/{comm,stat}, and
whether it belongs to one of this agent's engines.

NVML lists the pids holding GPU memory and nothing else. An engine runs in a session of
its own (the supervisor starts it with start_new_session), so the engine and every worker
it forks (vLLM's hold the GPU memory) share its process group, and its pidfile names that
group and when its leader started. A process is the agent's own when it is in such a
group and did not start before its leader: a pid the kernel gave to an unrelated process
since (its group gone) is never mistaken for an engine, as in pidfile.py. Everything else
is foreign: another team's job, a notebook, an engine no pidfile names any more.

The parsers take the text of the files; `HostProcesses` reads them under the agent's
`paths.procfs`, each read bounded (stat lines are under 1 KiB, comm 16 bytes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.engines.pidfile import EngineProcess
from llmgw.agent.files import bounded_lines, open_regular

NAME_CHARS = 64  # the kernel keeps 15 (TASK_COMM_LEN); a recorded tree may hold anything
_READ_BYTES = 4096
_STAT_LINES = 100_000  # /proc/stat: a line per CPU, then btime


@dataclass(frozen=True, slots=True)
class ProcStat:
    """What /proc/<pid>/stat says about who a process belongs to."""

    pgrp: int
    session: int
    start_ticks: int  # clock ticks after boot (field 22)


def parse_stat(text: str) -> ProcStat | None:
    """`4242 (python3) S 1 4242 4242 ...`; the name in parentheses may itself hold spaces and
    parentheses, so the fields are counted after the last ')'. None when it does not parse."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 20:
        return None
    try:
        # after the name: state, ppid, pgrp, session, ... starttime is the 20th
        return ProcStat(pgrp=int(fields[2]), session=int(fields[3]), start_ticks=int(fields[19]))
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


@dataclass(frozen=True, slots=True)
class EngineGroup:
    pgid: int
    leader_started: float  # unix seconds, psutil's create_time of the leader


def engine_groups(engines: Iterable[EngineProcess]) -> list[EngineGroup]:
    return [EngineGroup(e.pgid, e.create_time) for e in engines]


def in_engine_group(stat: ProcStat, started: float | None, groups: Sequence[EngineGroup]) -> bool:
    """Whether a process (its stat, and when it started if known) is one of the engines'."""
    return engine_group(stat, started, groups) is not None


def engine_group(
    stat: ProcStat, started: float | None, groups: Sequence[EngineGroup]
) -> int | None:
    """The process group of the engine a process (its stat, and when it started if known)
    belongs to, or None."""
    for g in groups:
        if g.pgid not in (stat.pgrp, stat.session):
            continue
        # workers start after their leader: an older process only reuses the number
        if started is None or started + 0.05 >= g.leader_started:
            return g.pgid
    return None


class HostProcesses:
    """Answers `discovery.gpus.ProcessLookup` from the files under `procfs` and this agent's
    engines (their pidfile records)."""

    def __init__(
        self, procfs: Path, engines: Sequence[EngineProcess], clock_ticks: int | None = None
    ) -> None:
        self.procfs = procfs
        self.groups = engine_groups(engines)
        self.leaders = {e.pid for e in engines}
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self.boot_time = self._boot_time() if self.groups else None

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

    def name(self, pid: int) -> str:
        text = self._read(str(pid), "comm")
        return "" if text is None else parse_comm(text)

    def own(self, pid: int) -> bool:
        return self.engine(pid) is not None

    def engine(self, pid: int) -> int | None:
        """The process group of the engine `pid` is part of (its leader's pid), or None."""
        if not self.groups:
            return None
        text = self._read(str(pid), "stat")
        stat = None if text is None else parse_stat(text)
        if stat is None:
            # listed by NVML, so alive: an engine's leader
            return pid if pid in self.leaders else None
        started = (
            None if self.boot_time is None else self.boot_time + stat.start_ticks / self.clock_ticks
        )
        return engine_group(stat, started, self.groups)
