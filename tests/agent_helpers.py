"""Running llmgw-agent as a real process in tests, pointed at recorded /proc and /sys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

from llmgw.agent.config import (
    AgentConfig,
    Engines,
    Intervals,
    Nats,
    Node,
    Paths,
    Weights,
    write_config,
)
from llmgw.sim.fake_engine import install_fake_engines

MEMINFO = """MemTotal:       {total_kb} kB
MemFree:         1000000 kB
MemAvailable:   {avail_kb} kB
Buffers:          100000 kB
Cached:          2000000 kB
"""


def write_meminfo(procfs: Path, total_gib: float, available_gib: float) -> None:
    procfs.mkdir(parents=True, exist_ok=True)
    tmp = procfs / "meminfo.tmp"
    tmp.write_text(
        MEMINFO.format(
            total_kb=int(total_gib * 1024 * 1024), avail_kb=int(available_gib * 1024 * 1024)
        )
    )
    tmp.replace(procfs / "meminfo")


def host_dirs(tmp: Path) -> dict[str, Path]:
    """A recorded host: /proc with meminfo and cpuinfo, an empty /sys, an empty PATH dir."""
    procfs, sysfs, bindir = tmp / "proc", tmp / "sys", tmp / "bin"
    write_meminfo(procfs, 64, 60)
    (procfs / "cpuinfo").write_text(
        "processor\t: 0\nmodel name\t: Test CPU\n\nprocessor\t: 1\nmodel name\t: Test CPU\n"
    )
    (procfs / "self").mkdir(exist_ok=True)
    (procfs / "self" / "mountinfo").write_text(
        "22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n"
    )
    sysfs.mkdir(exist_ok=True)
    bindir.mkdir(exist_ok=True)
    return {
        "procfs": procfs,
        "sysfs": sysfs,
        "bin": bindir,
        "state": tmp / "state",
        "fetch": tmp / "fetch",
    }


def agent_config(url: str, dirs: dict[str, Path], **node: object) -> AgentConfig:
    return AgentConfig(
        nats=Nats(urls=[url]),
        node=Node(**{"gpus": False, **node}),
        intervals=Intervals(heartbeat=0.2, engine_probe=0.3),
        weights=Weights(fetch_dir=str(dirs["fetch"]), scan_interval=0.5),
        paths=Paths(
            procfs=str(dirs["procfs"]),
            sysfs=str(dirs["sysfs"]),
            state_dir=str(dirs["state"]),
            llama_search_dirs=[],
        ),
    )


def start_agent(
    cfg: AgentConfig,
    config_path: Path,
    path_dirs: list[Path],
    log_path: Path,
    env_extra: dict[str, str] | None = None,
    simulate: list[str] | None = None,
) -> subprocess.Popen:
    """llmgw-agent as a process; with `simulate` (options of llmgw.sim.agent, such as
    ["--recorded-nvml", "count=2"]) the same agent on simulated hardware."""
    write_config(cfg, config_path)
    env = {**os.environ, **(env_extra or {})}
    env["PATH"] = os.pathsep.join(str(p) for p in path_dirs)
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llmgw.sim.agent" if simulate else "llmgw.agent.service",
                *(simulate or []),
                "--config",
                str(config_path),
                "--log-level",
                "DEBUG",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()


@dataclass
class FakeEngineAgent:
    """An agent process with the fake engines on its PATH, and what it was started with."""

    proc: subprocess.Popen
    cfg: AgentConfig
    dirs: dict[str, Path]
    path: list[Path]  # its PATH
    log: Path


def start_fake_engine_agent(
    url: str,
    root: Path,
    engines: Engines,
    *,
    simulate: list[str] | None = None,
    vllm_cpu: bool = False,
    **node: object,
) -> FakeEngineAgent:
    """An agent under `root` (its dirs, agent.toml, agent.log) with the fake engine as
    llama-server and vllm on its PATH (`vllm_cpu`: a CPU build of vLLM), `engines` its
    engine settings, `node` its [node]."""
    dirs = host_dirs(root)
    install_fake_engines(dirs["bin"], vllm_cpu=vllm_cpu)
    cfg = msgspec.structs.replace(agent_config(url, dirs, **node), engines=engines)
    path = [dirs["bin"], Path("/usr/bin"), Path("/bin")]
    log = root / "agent.log"
    proc = start_agent(cfg, root / "agent.toml", path, log, simulate=simulate)
    return FakeEngineAgent(proc, cfg, dirs, path, log)


NODES = {"node1": "127.0.0.2", "node2": "127.0.0.3", "node3": "127.0.0.4"}


def start_agents(url: str, root: Path, nodes: dict[str, str] = NODES) -> list[subprocess.Popen]:
    """One agent process per node (id -> its loopback address), each with the fake engine
    as llama-server on its PATH and quick engine supervision: the fleet of the end-to-end
    operations and autoscaling tests."""
    procs = []
    for node, address in nodes.items():
        engines = Engines(
            listen_host=address,
            poll_interval=0.1,
            backoff_base=0.2,
            backoff_cap=2,
            stop_grace=3,
            drain_timeout=30,
        )
        agent = start_fake_engine_agent(url, root / node, engines, id=node, address=address)
        procs.append(agent.proc)
    return procs


def stop_agents(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        stop(p)


def stop(proc: subprocess.Popen, timeout: float = 5.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"agent did not stop within {timeout}s of SIGTERM") from None
    return proc.returncode
