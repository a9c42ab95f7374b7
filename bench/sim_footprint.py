"""What one simulated node costs (docs/sim.md, "Many nodes"): memory, CPU at idle, NATS
connections and consumers, for `llmgw sim` at each fleet size.

For each size: an embedded nats-server on a free port, `llmgw sim` of a fleet file with
that many nodes (8 GPUs each, half on ib-a reading a share, half on ib-b holding a model),
5 s heartbeats, nothing placed. Once every node's lease is in the bucket and 10 s have
passed, the simulator's and the server's CPU time (user + system) over the window and
their RSS, and the server's connection and consumer counts.

Baseline, measured in the same run against the same kind of server: the same number of
bare nodes (llmgw.sim.bare.SimNode: the records an agent writes, no agent) heartbeating
on one connection at the same interval. Printed: both, and the simulator/bare ratios.

    .venv/bin/python bench/sim_footprint.py [--nodes 100 1000] [--connections 1 0] [--seconds 30]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import anyio
import psutil

from llmgw.bus import keys
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.server import EmbeddedNats, free_port

HEARTBEAT = 5.0


def fleet(n: int) -> str:
    half = n // 2
    return f"""
[sim]
heartbeat = {HEARTBEAT}

[shares.filer]
models = ["org/big"]

[[nodes]]
name = "a"
count = {half}
gpus = {{ count = 8 }}
ram_gb = 2048
ib = [{{ adapter = "mlx5_0", fabric = "ib-a" }}]
engines = ["vllm"]
mounts = ["filer"]

[[nodes]]
name = "b"
count = {n - half}
gpus = {{ count = 8 }}
ram_gb = 2048
ib = [{{ adapter = "mlx5_0", fabric = "ib-b" }}]
engines = ["vllm", "llama-server"]
models = ["org/small"]
"""


async def _leases(url: str) -> int:
    async with await Bus.connect(NatsSettings(urls=(url,), name="bench"), give_up_after=5) as bus:
        return len(await bus.list(keys.pattern(keys.LEASES), lambda b: b))


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def measure(argv: list[str], n: int, root: Path, seconds: float) -> dict:
    server = EmbeddedNats(data_dir=root / "nats", port=free_port())
    server.start()
    try:
        began = time.monotonic()
        proc = subprocess.Popen(
            [*argv, "--nats", server.url],
            stdout=subprocess.DEVNULL,
            stderr=open(root / "log", "w"),  # noqa: SIM115 - the child's, closed with it
        )
        try:
            while anyio.run(_leases, server.url) < n:
                if proc.poll() is not None or time.monotonic() - began > 900:
                    raise SystemExit(f"{argv}: not all {n} nodes registered; see {root}/log")
                time.sleep(1)
            registered = time.monotonic() - began
            time.sleep(10)
            me, srv = psutil.Process(proc.pid), psutil.Process(server.process.pid)
            c0, s0 = _cpu(me), _cpu(srv)
            time.sleep(seconds)
            c1, s1 = _cpu(me), _cpu(srv)
            monitor = f"http://127.0.0.1:{server.http_port}"
            varz = json.load(urllib.request.urlopen(f"{monitor}/varz"))
            jsz = json.load(urllib.request.urlopen(f"{monitor}/jsz"))
            return {
                "registered_s": registered,
                "rss_mb": me.memory_info().rss / 2**20,
                "cpu": (c1 - c0) / seconds,
                "nats_rss_mb": srv.memory_info().rss / 2**20,
                "nats_cpu": (s1 - s0) / seconds,
                "connections": varz["connections"],
                "consumers": jsz.get("consumers", 0),
            }
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        server.stop()


def bare_main(n: int, url: str) -> None:
    """The baseline: `n` bare nodes heartbeating on one connection."""
    from llmgw.shutdown import cancel_on_signal
    from llmgw.sim.bare import SimNode, inventory

    async def run() -> None:
        async with await Bus.connect(
            NatsSettings(urls=(url,), name="bare"), give_up_after=10
        ) as bus:
            nodes = [SimNode(bus, inventory(f"n{i}"), heartbeat=HEARTBEAT) for i in range(n)]
            for node in nodes:
                await node.register()
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_signal, tg.cancel_scope)
                for i, node in enumerate(nodes):
                    tg.start_soon(_staggered, node, HEARTBEAT * i / n)

    anyio.run(run)


async def _staggered(node, offset: float) -> None:
    await anyio.sleep(offset)
    await node.run()


def main() -> None:
    if sys.argv[1:2] == ["--bare"]:
        return bare_main(int(sys.argv[2]), sys.argv[4])
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    rows = []
    for n in args.nodes:
        root = Path(tempfile.mkdtemp(prefix="llmgw-sim-bench-"))
        try:
            (root / "fleet.toml").write_text(fleet(n))
            (root / "bare").mkdir()
            bare = [sys.executable, __file__, "--bare", str(n)]
            base = measure(bare, n, root / "bare", args.seconds)
            for c in args.connections:
                (root / f"sim{c}").mkdir()
                sim = [
                    sys.executable, "-m", "llmgw.cli", "--log-level", "ERROR", "sim",
                    str(root / "fleet.toml"), "--data-dir", str(root / f"sim{c}" / "disk"),
                    "--connections", str(c),
                ]  # fmt: skip
                rows.append((n, c, measure(sim, n, root / f"sim{c}", args.seconds), base))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"{'nodes':>6} {'conns':>9} {'up s':>5} {'RSS MB':>7} {'x bare':>6} {'CPU':>6} "
        f"{'x bare':>6} {'nats MB':>7} {'nats CPU':>8} {'clients':>7} {'consumers':>9}"
    )
    for n, c, s, b in rows:
        print(
            f"{n:>6} {'per node' if c == 0 else c:>9} {s['registered_s']:>5.1f} "
            f"{s['rss_mb']:>7.0f} {s['rss_mb'] / b['rss_mb']:>6.1f} {s['cpu']:>6.3f} "
            f"{s['cpu'] / max(b['cpu'], 1e-6):>6.1f} {s['nats_rss_mb']:>7.0f} "
            f"{s['nats_cpu']:>8.3f} {s['connections']:>7} {s['consumers']:>9}"
        )
        print(
            f"{'':>6} {'bare':>9} {b['registered_s']:>5.1f} {b['rss_mb']:>7.0f} {'':>6} "
            f"{b['cpu']:>6.3f} {'':>6} {b['nats_rss_mb']:>7.0f} {b['nats_cpu']:>8.3f} "
            f"{b['connections']:>7} {b['consumers']:>9}"
        )


if __name__ == "__main__":
    main()
