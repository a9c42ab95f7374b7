"""Who holds a port or a store, named for a person: "llmgw up (pid 1234)".

A refusal that says another llmgw holds what was asked for is one the reader can act on
(stop it, or move this one); "another program" sends them looking. Only this user's
processes can be named (the kernel hides which process holds another user's socket);
anything that cannot be told is None, and the caller says "another program".
"""

from __future__ import annotations

from pathlib import Path

import psutil

# the llmgw commands that run until stopped (and so hold ports and stores)
_LONG_RUNNING = ("up", "router", "controller", "agent", "sim")


def llmgw_command(cmdline: list[str]) -> str | None:
    """ "llmgw up" for the command line of an llmgw process (`llmgw up ...`, `python -m
    llmgw.cli up ...`, `llmgw-agent`); None for any other program."""
    for i, arg in enumerate(cmdline):
        name = Path(arg).name
        module = cmdline[i + 1] if arg == "-m" and i + 1 < len(cmdline) else ""
        if name == "llmgw-agent" or module.startswith("llmgw.agent"):
            return "llmgw-agent"
        if name == "llmgw" or module.startswith("llmgw"):
            sub = next((a for a in cmdline[i + 1 :] if a in _LONG_RUNNING), "")
            return f"llmgw {sub}".strip()
    return None


def describe(pid: int) -> str | None:
    """The process `pid` as a person knows it: "llmgw up (pid 1234)", or "the NATS of llmgw
    up (pid 1234; nats-server pid 1240)" for the server an llmgw started; None when it is
    neither, or gone, or not this user's to look at."""
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        own = llmgw_command(cmdline)
        if own is not None:
            return f"{own} (pid {pid})"
        if cmdline and Path(cmdline[0]).name == "nats-server":
            parent = proc.parent()
            if parent is not None:
                started_by = llmgw_command(parent.cmdline())
                if started_by is not None:
                    return f"the NATS of {started_by} (pid {parent.pid}; nats-server pid {pid})"
    except (psutil.Error, OSError):
        return None
    return None


def port_holder(port: int) -> str | None:
    """`describe` of the process listening on TCP `port`, when it is an llmgw's."""
    try:
        listening = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return None
    for c in listening:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return describe(c.pid)
    return None
