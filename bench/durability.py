"""What the store keeps when every server of the cluster dies at once, and what fsyncing
every write costs: a 3-server JetStream cluster of real nats-server processes on this host
(tests/local_cluster.py), the bucket and the gateway's streams with 3 replicas, as
`llmgw up`'s cluster example makes them, with the servers' default `sync_interval` (2
minutes) and with `always`.

    .venv/bin/python bench/durability.py                 # both sections, both settings
    .venv/bin/python bench/durability.py throughput      # or: kill
    BENCH_SYNC=default,always BENCH_ROUNDS=3 BENCH_SECONDS=5 ...

Sections:
- throughput: acknowledged writes a second, BENCH_IN_FLIGHT in flight (16; it must divide
  16), for each kind of write the fleet makes: a bucket put (a lease, a shard), a limits
  holder's write (a claim), a usage counter add, an audit message; BENCH_SECONDS each, the
  settings in alternate rounds (BENCH_ROUNDS), median and range.
- kill: writers of all four kinds under load, then every server SIGKILLed at the same
  moment and started again on its store (BENCH_ROUNDS times per setting). Every write
  acknowledged before the kill is looked for afterwards: a bucket key whose stored version
  is older than the last acknowledged, a limits holder below what it was acknowledged at
  (what the limits can over-admit afterwards: the sum of those shortfalls, in units of the
  limit), a usage counter below the sum of its acknowledged adds, an audit message missing.

A SIGKILL loses what a server had not yet handed to the operating system; what the kernel
holds reaches the disk unless the machine itself loses power. A power loss of every server
at once loses what was not fsynced: up to `sync_interval` of acknowledged writes with the
default (nats-server's own docs; Jepsen's analysis of NATS 2.12.1), nothing acknowledged
with `always`, which fsyncs each write before it is acknowledged. This machine cannot cut
its own power; docs/reliability.md states both.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from durability_load import Writes, drive, kinds, lost_after_restart  # noqa: E402
from local_cluster import LocalCluster  # noqa: E402

from llmgw.bus.client import BucketSettings, Bus, NatsSettings  # noqa: E402
from llmgw.bus.counters import StreamPlan, ensure_streams  # noqa: E402

SETTINGS = os.environ.get("BENCH_SYNC", "default,always").split(",")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "5"))
IN_FLIGHT = int(os.environ.get("BENCH_IN_FLIGHT", "16"))


def _sync(setting: str) -> str | None:
    return None if setting == "default" else setting


async def _cluster_bus(tmp: Path, setting: str) -> tuple[LocalCluster, Bus]:
    cluster = LocalCluster(tmp, sync_interval=_sync(setting)).start_all()
    bus = await Bus.connect(
        NatsSettings(urls=cluster.urls, connect_timeout=2),
        BucketSettings(replicas=3),
        give_up_after=60,
    )
    await ensure_streams(bus, StreamPlan(replicas=3))
    return cluster, bus


async def throughput(setting: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-durability-") as tmp:
        cluster, bus = await _cluster_bus(Path(tmp), setting)
        try:
            out = {}
            for name, write in kinds(bus, Writes()).items():
                out[name] = await drive(write, SECONDS, Writes(), IN_FLIGHT) / SECONDS
            return out
        finally:
            await bus.close()
            cluster.stop()


async def kill_round(setting: str, load_s: float) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-durability-") as tmp:
        cluster, bus = await _cluster_bus(Path(tmp), setting)
        acked = Writes()
        try:
            async with anyio.create_task_group() as tg:
                for write in kinds(bus, acked).values():
                    tg.start_soon(drive, write, load_s + 30, acked, IN_FLIGHT)
                await anyio.sleep(load_s)
                cluster.kill_all()  # every server at the same moment, under load
                await anyio.sleep(0.5)
                tg.cancel_scope.cancel()
            await bus.close()
            for i in range(len(cluster.servers)):
                cluster.start(i)
            cluster.wait_healthy(120)
            again = await Bus.connect(
                NatsSettings(urls=cluster.urls, connect_timeout=2), give_up_after=60
            )
            try:
                return await lost_after_restart(again, acked)
            finally:
                await again.close()
        finally:
            cluster.stop()


async def main(sections: list[str]) -> None:
    results: dict[str, object] = {}
    if "throughput" in sections:
        # the settings in alternate rounds, so that both see the same machine
        runs: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
        for _ in range(ROUNDS):
            for setting in SETTINGS:
                runs[setting].append(await throughput(setting))
        for setting, got in runs.items():
            results[f"throughput {setting}"] = got
            print(
                f"throughput, sync_interval {setting}, {IN_FLIGHT} in flight, median of "
                f"{ROUNDS} (range): "
                + ", ".join(
                    f"{k} {statistics.median(r[k] for r in got):,.0f}/s "
                    f"({min(r[k] for r in got):,.0f}-{max(r[k] for r in got):,.0f})"
                    for k in got[0]
                ),
                flush=True,
            )
    if "kill" in sections:
        for setting in SETTINGS:
            rounds = [await kill_round(setting, SECONDS) for _ in range(ROUNDS)]
            results[f"kill {setting}"] = rounds
            lost = {k: [r[k] for r in rounds] for k in rounds[0]}
            print(
                f"every server SIGKILLed under load, sync_interval {setting}, {ROUNDS} rounds: "
                + "; ".join(f"{k} {v}" for k, v in lost.items()),
                flush=True,
            )
    out = os.environ.get("BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:] or ["throughput", "kill"])
