"""How an engine's command line becomes a running engine: the supervisor's one seam to the OS.

The supervisor decides when to start, probe, drain, signal and restart; a launcher only
starts the command, and the `EngineRun` it returns says when the engine exited and takes
its signals. On a node that is an OS process group (`ProcessLauncher`); a simulated node
(llmgw.sim) serves its engines inside the simulator's own process instead, and everything
the supervisor does around them stays the same.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import anyio


class EngineRun(Protocol):
    """One started engine. `pid`: its process group's id, what NVML's processes of the engine
    are counted under (`GpuProcess.engine`); `adoptable`: an OS process group that may
    outlive this agent, so a pidfile is written for a later one to adopt (a simulated
    engine's pid is only what its GPU memory is listed under: no pidfile)."""

    pid: int | None
    adoptable: bool

    async def exited(self) -> int | None:
        """Returns once the engine's first process exited: its exit status, None unknown."""
        ...

    def signal(self, sig: int) -> bool:
        """Send `sig` to what is left of the engine (0: only ask whether any of it lives);
        False once all of it is gone."""
        ...


class EngineLauncher(Protocol):
    async def start(self, argv: Sequence[str], env: Mapping[str, str], output: int) -> EngineRun:
        """Start `argv` with `env` added to this process's, its stdout and stderr going to
        the file descriptor `output` (the caller closes its copy). OSError: it did not start."""
        ...


class ProcessGroup:
    """An engine as an OS process group: its leader started here (`popen`) or adopted from
    an earlier agent (the pid only: its exit status is then unknown)."""

    adoptable = True

    def __init__(
        self, pid: int, popen: subprocess.Popen[bytes] | None = None, *, pidfd: int | None = None
    ) -> None:
        self.pid: int | None = pid
        self.popen = popen
        self.alive = True  # False once a signal found the group gone: never signalled again
        self._pidfd = pidfd  # opened before its identity was checked (`adopt`)

    @classmethod
    def adopt(cls, pid: int, still_ours: Callable[[], bool]) -> ProcessGroup | None:
        """The group of an engine an earlier agent started, or None when `still_ours()`
        (pid, start time and command line read back) says the pid is not that engine.
        The pidfd is opened first and the identity checked after: a pid that died and was
        reused between the two is caught by the check, never watched by mistake."""
        try:
            fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError:
            fd = None  # no pidfd here: polled (`_exited`)
        if not still_ours():
            if fd is not None:
                os.close(fd)
            return None
        return cls(pid, pidfd=fd)

    async def exited(self) -> int | None:
        assert self.pid is not None
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)
        else:
            await _exited(self.pid)
        return self.popen.wait() if self.popen is not None else None

    def signal(self, sig: int) -> bool:
        if self.popen is not None:
            self.popen.poll()  # a child of ours: collect it, or it lingers a zombie
        if not self.alive or self.pid is None:
            return False
        try:
            os.killpg(self.pid, sig)  # its id could be reused by an unrelated group once gone
            return True
        except ProcessLookupError:
            self.alive = False
            return False


class ProcessLauncher:
    """Engines as processes, each in a session of its own (one signal reaches every worker)."""

    async def start(self, argv: Sequence[str], env: Mapping[str, str], output: int) -> ProcessGroup:
        # A plain Popen, not asyncio's subprocess: asyncio kills a child whose transport is
        # closed or collected, and an engine must be able to outlive this agent. Its exit
        # is learnt from a pidfd, as an adopted engine's is.
        popen = functools.partial(
            subprocess.Popen,
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        proc = await anyio.to_thread.run_sync(popen)
        return ProcessGroup(proc.pid, proc)


async def _exited(pid: int) -> None:
    """Returns when process `pid` (not a child of this one) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (an old kernel): ask every half second
        while _alive(pid):
            await anyio.sleep(0.5)
        return
    try:
        await anyio.wait_readable(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
