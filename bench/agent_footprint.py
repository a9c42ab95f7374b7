"""What the agent costs its node: RSS, CPU per minute at a 1 s heartbeat, SIGTERM-to-exit.

Runs the real agent process (`python -m llmgw.agent.service --config <toml>`, heartbeat
1 s, engine probe 60 s, node.gpus = false, the real /proc and /sys) against an embedded
nats-server on a free port. After a warm-up it samples the agent's RSS every second and
its CPU time (user + system, threads and reaped children included) over the window.

Baseline, measured in the same run and at the same time: a bare Python process that
imports only nats, connects to the same server and puts a heartbeat-sized value (the
agent's own lease, measured) every second. Printed: both, and the agent/bare ratios.

SIGTERM-to-exit is the median of several fresh agents: start one, wait until its lease
is in the bucket, SIGTERM it, time until the process has exited (the budget is 1 s).

    .venv/bin/python bench/agent_footprint.py [--seconds 60] [--warmup 10] [--stops 5]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import psutil

from llmgw.agent.config import AgentConfig, Intervals, Nats, Node, Paths, Weights, write_config
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.server import EmbeddedNats, free_port

# The baseline imports nothing of llmgw: the floor for "a Python process holding a NATS
# connection and writing one KV value a second".
BARE_CLIENT = r"""
import asyncio, sys
import nats

async def main(url, key, size):
    async def quiet(e):
        pass
    nc = await nats.connect(url, error_cb=quiet)
    kv = await nc.jetstream().key_value("llmgw")
    payload = b"x" * size
    while True:
        await kv.put(key, payload)
        await asyncio.sleep(1.0)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


@dataclass
class Footprint:
    """What one process cost over the window."""

    rss: list[int] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    uss: int = 0
    threads: int = 0
    clock: str = ""  # how cpu_s was measured: per-thread ns, or kernel ticks

    @property
    def cpu_per_min(self) -> float:
        return self.cpu_s / self.wall_s * 60

    @property
    def rss_median(self) -> float:
        return statistics.median(self.rss)


class Processes:
    """Every process this bench starts, so that all of them end however the bench ends."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.logs / log_name, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def agent_config(url: str, node: str, tmp: Path) -> AgentConfig:
    return AgentConfig(
        nats=Nats(urls=[url]),
        node=Node(id=node, gpus=False),
        intervals=Intervals(heartbeat=1.0, engine_probe=60.0),
        weights=Weights(fetch_dir=str(tmp / "fetch")),
        paths=Paths(state_dir=str(tmp / "state" / node)),
    )


def start_agent(procs: Processes, url: str, node: str, tmp: Path) -> subprocess.Popen[bytes]:
    config = tmp / f"{node}.toml"
    write_config(agent_config(url, node, tmp), config)
    argv = [sys.executable, "-m", "llmgw.agent.service", "--config", str(config)]
    return procs.start([*argv, "--log-level", "WARNING"], f"{node}.log")


async def wait_for_key(bus: Bus, key: str, proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    with anyio.fail_after(timeout):
        while True:
            raw = await bus.get_raw(key)
            if raw is not None:
                return raw[0]
            if proc.poll() is not None:
                raise SystemExit(f"{key}: its process exited with {proc.returncode}; see its log")
            await anyio.sleep(0.01)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> float | None:
    """When the process exited (perf_counter), or None if it outlived `timeout`. A pidfd
    wakes us the moment it exits; Popen.wait(timeout) would poll in up to 50 ms steps."""
    fd = os.pidfd_open(proc.pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        at = time.perf_counter()
    finally:
        os.close(fd)
    if not ready:
        return None
    proc.wait()
    return at


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds on CPU per live thread (/proc/<pid>/task/*/schedstat). At well under 1%
    of a core, the 10 ms ticks of cpu_times would be a quarter of the bare client's minute."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile
    return out


class CpuClock:
    """CPU time a process spends from now on: per-thread nanoseconds while no thread that
    existed at the start has ended, else the kernel's ticks (which keep ended threads);
    reaped children (an engine probe's `--version`) in ticks either way."""

    def __init__(self, p: psutil.Process) -> None:
        self.p = p
        self.threads0 = thread_cpu_ns(p.pid)
        self.ticks0 = self._ticks()

    def _ticks(self) -> tuple[float, float]:
        t = self.p.cpu_times()
        return t.user + t.system, t.children_user + t.children_system

    def elapsed(self) -> tuple[float, str]:
        threads = thread_cpu_ns(self.p.pid)
        (own, children), (own0, children0) = self._ticks(), self.ticks0
        if set(self.threads0) <= set(threads):
            ns = sum(v - self.threads0.get(tid, 0) for tid, v in threads.items())
            return ns / 1e9 + children - children0, "ns"
        return own - own0 + children - children0, "ticks"


def measure(pids: dict[str, int], seconds: float) -> dict[str, Footprint]:
    handles = {name: psutil.Process(pid) for name, pid in pids.items()}
    out = {name: Footprint() for name in pids}
    start = time.perf_counter()
    clocks = {name: CpuClock(p) for name, p in handles.items()}
    deadline = start + seconds
    while (now := time.perf_counter()) < deadline:
        for name, p in handles.items():
            out[name].rss.append(p.memory_info().rss)
        time.sleep(min(1.0, deadline - now))
    end = time.perf_counter()
    for name, p in handles.items():
        out[name].cpu_s, out[name].clock = clocks[name].elapsed()
        out[name].wall_s = end - start
        # after the window: reading smaps costs the reader, not the process read
        out[name].uss = p.memory_full_info().uss
        out[name].threads = p.num_threads()
    return out


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedNats(tmp / "nats", port=free_port())
        server.start()
        procs = Processes(tmp)
        try:
            bus = await Bus.connect(NatsSettings(urls=(server.url,), name="bench"))
            try:
                await footprint_and_stops(args, tmp, server.url, bus, procs)
            finally:
                await bus.close()
        finally:
            procs.stop_all()
            server.stop()


async def footprint_and_stops(
    args: argparse.Namespace, tmp: Path, url: str, bus: Bus, procs: Processes
) -> None:
    agent = start_agent(procs, url, "bench-agent", tmp)
    lease = await wait_for_key(bus, keys.lease("bench-agent"), agent, 30)
    bare = procs.start(
        [sys.executable, "-c", BARE_CLIENT, url, keys.lease("bench-bare"), str(len(lease))],
        "bare.log",
    )
    await wait_for_key(bus, keys.lease("bench-bare"), bare, 30)
    await anyio.sleep(args.warmup)
    seq0 = await _lease_seq(bus, "bench-agent")
    got = await anyio.to_thread.run_sync(
        measure, {"agent": agent.pid, "bare": bare.pid}, args.seconds
    )
    beats = await _lease_seq(bus, "bench-agent") - seq0
    for proc in (agent, bare):
        proc.send_signal(signal.SIGTERM)
        proc.wait(5)

    stops, starts = [], []
    for i in range(args.stops):
        node = f"bench-stop-{i}"
        t0 = time.perf_counter()
        proc = start_agent(procs, url, node, tmp)
        await wait_for_key(bus, keys.lease(node), proc, 30)
        starts.append(time.perf_counter() - t0)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        exited = await anyio.to_thread.run_sync(wait_exit, proc, 10.0)
        if exited is None:
            proc.kill()
            proc.wait()
            raise SystemExit(f"agent {node} did not exit within 10 s of SIGTERM")
        stops.append(exited - sent)

    a, b = got["agent"], got["bare"]
    mib = 1 << 20
    print(f"window: {a.wall_s:.0f} s after {args.warmup:.0f} s warm-up; heartbeat 1 s")
    print(f"agent heartbeats written in the window: {beats}; lease {len(lease)} bytes")
    print(f"{'':14}{'agent':>10}{'bare client':>14}{'ratio':>8}")
    print(
        f"{'RSS MiB':14}{a.rss_median / mib:10.1f}{b.rss_median / mib:14.1f}"
        f"{a.rss_median / b.rss_median:8.2f}   (median of {len(a.rss)} samples; "
        f"agent max {max(a.rss) / mib:.1f})"
    )
    print(f"{'USS MiB':14}{a.uss / mib:10.1f}{b.uss / mib:14.1f}{a.uss / b.uss:8.2f}")
    print(
        f"{'CPU s/min':14}{a.cpu_per_min:10.3f}{b.cpu_per_min:14.3f}"
        f"{a.cpu_per_min / b.cpu_per_min:8.2f}   "
        f"(agent {a.cpu_per_min / 60 * 100:.2f}% of one core; clocks {a.clock}/{b.clock})"
    )
    print(f"{'threads':14}{a.threads:10d}{b.threads:14d}")
    print(
        f"SIGTERM to exit: median {statistics.median(stops) * 1000:.0f} ms, "
        f"max {max(stops) * 1000:.0f} ms over {len(stops)} agents (budget 1000 ms); "
        f"start to first lease: median {statistics.median(starts):.2f} s"
    )


async def _lease_seq(bus: Bus, node: str) -> int:
    raw = await bus.get_raw(keys.lease(node))
    return records.decode(raw[0], records.Lease).seq if raw else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    parser.add_argument("--stops", type=int, default=5, help="agents started and SIGTERMed")
    anyio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
