"""RAM: total and available, from /proc/meminfo.

Read on every heartbeat, not once at registration: a VM given more RAM must become a
candidate without anyone restarting its agent. So this is one small file read.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.bus.records import Memory

_FIELDS = ("MemTotal", "MemAvailable")


def parse_meminfo(text: str) -> Memory:
    """MemTotal and MemAvailable (kB in the file) as bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or name not in _FIELDS:
            continue
        number, _, unit = rest.strip().partition(" ")
        try:
            values[name] = int(number) * (1024 if unit.strip() == "kB" else 1)
        except ValueError:
            raise ValueError(f"/proc/meminfo line {line!r}: {name} is not a number") from None
    for field in _FIELDS:
        if field not in values:
            # MemAvailable appeared in Linux 3.14; anything older cannot run our engines anyway
            raise ValueError(f"/proc/meminfo has no {field} line (Linux 3.14 or newer is needed)")
    return Memory(total_bytes=values["MemTotal"], available_bytes=values["MemAvailable"])


def read_memory(procfs: Path = Path("/proc")) -> Memory:
    return parse_meminfo((procfs / "meminfo").read_text())
