"""One server per store: an exclusive lock on `store.lock` in the store's directory.

Two nats-servers on one JetStream store corrupt it (a second `llmgw up` rewrote the first
one's config and shared its store; the next start sat at 81% CPU on "indexCacheBuf corrupt
record state"). The lock is taken before anything in the directory is written, and held
for the server's life: the server process inherits it, so a server left running by a
killed llmgw still holds it, and a crashed holder releases it with its last descriptor
(flock). The file says who holds it, for the refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from llmgw import holders
from llmgw.errors import LlmgwError

LOCK_NAME = "store.lock"
_HOLDER_BYTES = 4096  # what the file says of its holder: two pids
_TRIES = 10  # a peek holds the lock for an instant: taking it is tried again meanwhile


@dataclass(frozen=True)
class Holder:
    """Who holds a store: the process that took the lock, and the server it started."""

    pid: int | None
    server_pid: int | None

    def says(self) -> str:
        """ "llmgw up (pid 1234)", or the server it left running."""
        alive = self.pid is not None and psutil.pid_exists(self.pid)
        if alive:
            assert self.pid is not None
            return holders.describe(self.pid) or f"pid {self.pid}"
        if self.server_pid is not None and psutil.pid_exists(self.server_pid):
            gone = f" by pid {self.pid}, which is gone" if self.pid else ""
            return f"a nats-server (pid {self.server_pid}) left running{gone}"
        return "another process" if self.pid is None else f"pid {self.pid}"

    def stop_it(self) -> str:
        if self.pid is not None and psutil.pid_exists(self.pid):
            return f"stop it (Ctrl-C where it runs, or `kill {self.pid}`)"
        if self.server_pid is not None and psutil.pid_exists(self.server_pid):
            return f"stop it (`kill {self.server_pid}`)"
        return "stop it"


class StoreInUse(LlmgwError):
    """Another process runs a server on this store."""

    def __init__(self, store: Path, holder: Holder) -> None:
        self.store, self.holder = store, holder
        super().__init__(
            f"store {store} is in use by {holder.says()}, and two servers on one store "
            f"corrupt it: {holder.stop_it()}, or give this one a store of its own "
            "(--data-dir DIR)"
        )


class StoreLock:
    """The lock of one store, held from `take` until `release`; `fd` is passed on to the
    server so that it holds the lock too."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self.fd = fd

    @classmethod
    def take(cls, directory: Path) -> StoreLock:
        """Create the directory and take its lock; StoreInUse naming the holder if another
        process holds it."""
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        for attempt in range(_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == _TRIES - 1:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise StoreInUse(directory, holder) from None
                time.sleep(0.02)
        lock = cls(directory, fd)
        lock._write(Holder(os.getpid(), None))
        return lock

    def started(self, server_pid: int) -> None:
        """Say which server runs on the store (a holder that is gone leaves it running)."""
        self._write(Holder(os.getpid(), server_pid))

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the last descriptor (the server's, if alive)
            self.fd = -1

    def _write(self, holder: Holder) -> None:
        data = json.dumps({"pid": holder.pid, "server_pid": holder.server_pid}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data + b"\n", 0)


def holder_of(directory: Path) -> Holder | None:
    """Who holds the store in `directory`, if anyone; creates and writes nothing (a command
    asks before it checks its ports, so a refused start leaves no trace)."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> Holder:
    try:
        said = json.loads(os.pread(fd, _HOLDER_BYTES, 0) or b"{}")
    except (OSError, ValueError):
        said = {}
    if not isinstance(said, dict):
        said = {}
    return Holder(_pid(said.get("pid")), _pid(said.get("server_pid")))


def _pid(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
