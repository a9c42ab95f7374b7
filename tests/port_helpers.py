"""Ports for the engines a test starts: a run of ports found free, never a fixed number.

llmgw's default engine range (18000-18999) is where a busy machine's other programs, and
the engines of a second test run beside this one, listen too. A test gives its controller
(and its agents) a run from `free_port_run` instead: below the kernel's ephemeral range,
so an outgoing connection's local port never lands on it; every port of it bindable when
it is handed out; and reserved for the test's life with a lock file that every llmgw test
run on this machine honours, so two runs at once never share one. A program that starts
listening on one later is what placement's port moves are for, as in production.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from llmgw.bus.records import ENGINE_PORTS

WIDTH = 20  # engines of one test: a handful, and room for a few port moves
LOWEST = 20000  # above llmgw's default engine range
LOCKS = Path(tempfile.gettempdir()) / "llmgw-test-ports"


def ephemeral_low(procfs: Path = Path("/proc")) -> int:
    """The first port the kernel hands out to outgoing connections (32768 when unknown)."""
    try:
        with (procfs / "sys/net/ipv4/ip_local_port_range").open() as f:
            return int(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Nothing listens on `port`, on any address, and no socket holds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def free_port_run(width: int = WIDTH) -> Iterator[tuple[int, int]]:
    """(low, high): `width` consecutive ports, all bindable now, reserved against other
    llmgw test runs on this machine until the block exits. Blocks are tried from a random
    one on, so runs rarely even contend for a lock."""
    top = ephemeral_low() - 1
    assert LOWEST > ENGINE_PORTS[1] and top - LOWEST + 1 >= width, "no room below ephemeral ports"
    blocks = (top - LOWEST + 1) // width
    try:
        LOCKS.mkdir()
        LOCKS.chmod(0o1777)  # every user's test runs share it, as they share the ports
    except FileExistsError:
        pass
    start = random.randrange(blocks)
    for i in range(blocks):
        low = LOWEST + ((start + i) % blocks) * width
        fd = os.open(LOCKS / f"{low}.lock", os.O_RDONLY | os.O_CREAT, 0o644)  # flock needs no write
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if all(bindable(p) for p in range(low, low + width)):
                yield low, low + width - 1
                return
        finally:
            os.close(fd)  # releases the lock
    raise AssertionError(f"no run of {width} free ports in {LOWEST}-{top} on this machine")
