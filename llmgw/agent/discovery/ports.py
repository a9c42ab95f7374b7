"""Ports of the engine range that another program listens on, from /proc/net/tcp{,6}.

A busy GPU node runs other services; one listening on a port placement gives an engine
makes that engine's launch fail ("port 18000 on 0.0.0.0 is in use by another process").
The agent reports those ports and placement never assigns them. Any listener on a port
counts, whatever its address: an engine binding 0.0.0.0:P is refused while anything
listens on P, and an IPv6 [::]:P listener covers IPv4 too. Ports this agent's engines
listen on (their pidfiles name them) are its own, not reported.

Read under the agent's `paths.procfs`, so a recorded tree tests it; the kernel's files
need no privilege (psutil.net_connections would, to name other users' processes).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from llmgw.agent.files import bounded_lines
from llmgw.bus.records import MAX_PORTS_TAKEN, PortsTaken

LISTEN = "0A"  # TCP_LISTEN, as /proc/net/tcp writes the state
MAX_LINES = 1_000_000  # a socket per line; a node with more is not one this reads whole
LINE_BYTES = 512  # a line is 150 bytes (tcp6: 180)


def listening_ports(lines: Iterable[str]) -> set[int]:
    """Local ports of the sockets in LISTEN state, from lines of /proc/net/tcp or tcp6:
    `  0: 00000000:4650 00000000:0000 0A ...` (the header's state column reads `st`)."""
    ports: set[int] = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[3] != LISTEN:
            continue
        _, sep, port = fields[1].rpartition(":")
        try:
            number = int(port, 16)
        except ValueError:
            continue
        if sep and 0 < number <= 0xFFFF:
            ports.add(number)
    return ports


def ports_taken(
    listening: Iterable[int], low: int, high: int, own: Iterable[int] = ()
) -> PortsTaken:
    """The listening ports in low..high that are not the agent's own engines', bounded."""
    mine = set(own)
    taken = sorted(p for p in set(listening) if low <= p <= high and p not in mine)
    return PortsTaken(
        low=low,
        high=high,
        ports=taken[:MAX_PORTS_TAKEN],
        unlisted=max(len(taken) - MAX_PORTS_TAKEN, 0),
    )


def read_ports_taken(procfs: Path, low: int, high: int, own: Iterable[int] = ()) -> PortsTaken:
    """`ports_taken` of net/tcp and net/tcp6 under `procfs`; a file that is not there (no
    IPv6) holds no listener."""
    listening: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            listening |= listening_ports(
                bounded_lines(procfs / "net" / name, MAX_LINES, LINE_BYTES)
            )
        except OSError:
            continue
    return ports_taken(listening, low, high, own)
