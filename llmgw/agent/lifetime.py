"""How engines outlive their agent: an agent restart (every upgrade and config change is
one) must not restart every model on the node, and a 70B model takes minutes to load.

Two decisions, each a pure function of what it is given (and a thin shell that reads it):
- `own_scope`: under systemd, an engine runs in a scope of its own (`systemd-run --scope`
  in llmgw-engines.slice), since stopping or restarting the agent's unit kills whatever is
  left in the unit's cgroup once the agent has exited (KillMode=mixed);
- `leave_engines`: on SIGTERM or SIGINT, whether the exiting agent leaves its engines
  serving (for the next agent to adopt) or stops them. `systemctl restart` and `systemctl
  stop` both send SIGTERM; what tells them apart is the job systemd is running for the
  unit at that moment, a `restart` or a `stop` (`systemctl list-jobs`). A person's Ctrl-C
  (SIGINT) stops them. `engines.on_agent_exit` in the agent's config overrides this.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from typing import Literal

from llmgw.agent.files import read_text_bounded

log = logging.getLogger(__name__)

_MAX_CGROUP = 64 * 1024  # /proc/self/cgroup: a line per hierarchy, a few hundred bytes

OwnScope = Literal["auto", "always", "never"]
OnAgentExit = Literal["keep-on-restart", "keep", "stop"]


def own_scope(setting: OwnScope, environ: Mapping[str, str], systemd_run: str | None) -> bool:
    """Whether engines are started in a systemd scope of their own: always, never, or
    (auto) when this agent runs under systemd (which sets INVOCATION_ID for its services)
    and systemd-run is installed."""
    if setting == "never":
        return False
    if setting == "always":
        return True
    return bool(environ.get("INVOCATION_ID")) and systemd_run is not None


def unit_of(cgroup: str) -> str | None:
    """The service unit from /proc/self/cgroup ("0::/system.slice/llmgw-agent.service")."""
    for line in cgroup.splitlines():
        path = line.rsplit(":", 1)[-1]
        for part in reversed(path.split("/")):
            if part.endswith(".service"):
                return part
    return None


def restart_job_for(unit: str, list_jobs: str) -> bool:
    """Whether `systemctl list-jobs --no-legend --plain` lists a restart job for `unit`
    (lines "JOB UNIT TYPE STATE"; a restart runs as one job of type restart, its stop
    half included)."""
    for line in list_jobs.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == unit and fields[2] in ("restart", "try-restart"):
            return True
    return False


def leave_engines(
    policy: OnAgentExit, sig: int, unit: str | None, list_jobs: str | None
) -> tuple[bool, str]:
    """Whether an agent exiting on `sig` leaves its engines running, and why (for the log)."""
    if policy == "keep":
        return True, "engines.on_agent_exit = keep"
    if policy == "stop":
        return False, "engines.on_agent_exit = stop"
    if sig == signal.SIGINT:
        return False, "interrupted (Ctrl-C): the engines stop with the agent"
    if unit is None:
        return False, "not a systemd service: SIGTERM stops the engines with the agent"
    if list_jobs is None:
        return False, f"cannot ask systemd whether {unit} is being restarted: engines stop"
    if restart_job_for(unit, list_jobs):
        return True, f"systemd is restarting {unit}: the next agent adopts the engines"
    return False, f"systemd is stopping {unit}: the engines stop with it"


def leave_engines_now(policy: OnAgentExit, sig: int) -> tuple[bool, str]:
    """`leave_engines` with what this host says (blocking: a short subprocess)."""
    unit = list_jobs = None
    if policy == "keep-on-restart" and sig != signal.SIGINT and os.environ.get("INVOCATION_ID"):
        try:
            unit = unit_of(read_text_bounded("/proc/self/cgroup", _MAX_CGROUP))
        except (OSError, ValueError):
            unit = None
        if unit is not None:
            try:
                out = subprocess.run(
                    ["systemctl", "list-jobs", "--no-legend", "--plain"],
                    capture_output=True,
                    text=True,
                    timeout=2,
                )
                list_jobs = out.stdout if out.returncode == 0 else None
            except (OSError, subprocess.TimeoutExpired):
                list_jobs = None
    return leave_engines(policy, sig, unit, list_jobs)
