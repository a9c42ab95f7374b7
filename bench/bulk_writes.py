"""What the controller's start-up costs in two places it does in bulk: many fenced writes,
and decoding the bucket into its view.

writes: N health records fenced by the leader key, one at a time (`Bus.put(..., fence=)`,
the baseline: what every controller write was) and in atomic batches (`Bus.write_all`
after `Bus.allow_batches`), against a real nats-server in a temp dir. Prints writes per
second and the ratio.

decode: N simulated inventories (bench/reconcile.py's fleet) decoded and checked as the
controller's view does (`trust.decode_for_key`), with the cycle collector running (the
baseline) and paused (what the controller's first replay does), and the objects the
collector tracks once they are held. Prints both times and the ratio.

    .venv/bin/python bench/bulk_writes.py [--writes 10000] [--nodes 10000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from llmgw.bus import keys, records, trust
from llmgw.bus.client import BucketSettings, Bus, Fence, NatsSettings, Write
from llmgw.bus.server import EmbeddedNats, free_port

sys.path.insert(0, str(Path(__file__).parent))
from reconcile import fleet_node  # noqa: E402  (the same 8-GPU inventories)


def _health(i: int) -> records.Health:
    return records.Health(node=f"node{i:05d}", phase="ready", since=1.0, reason="bench")


async def fenced_writes(n: int, repeat: int) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-bulk-") as tmp:
        server = EmbeddedNats(data_dir=Path(tmp) / "nats", port=free_port())
        server.start()
        try:
            bus = await Bus.connect(
                NatsSettings(urls=(server.url,), name="bench"), BucketSettings(), give_up_after=10
            )
            allowed = await bus.allow_batches()
            if allowed is not True:
                raise SystemExit(f"atomic batches not allowed: {allowed}")
            held = await bus.put(
                keys.leader(), records.Leader(holder="bench", since=1, renewed_at=1)
            )
            fence = Fence(keys.leader(), held)
            writes = [Write(keys.health(f"node{i:05d}"), _health(i)) for i in range(n)]
            one, batched = [], []
            for _ in range(repeat):  # alternately, so both see the same machine
                start = time.perf_counter()
                for w in writes:
                    await bus.put(w.key, w.value, fence=fence)
                one.append(n / (time.perf_counter() - start))
                start = time.perf_counter()
                await bus.write_all(writes, fence=fence)
                batched.append(n / (time.perf_counter() - start))
            await bus.close()
        finally:
            server.stop()
    a, b = statistics.median(one), statistics.median(batched)
    print(f"fenced writes, {n:,} health records, median of {repeat}:")
    print(f"  one at a time (baseline) : {a:9,.0f} writes/s")
    print(f"  atomic batches of 1,000  : {b:9,.0f} writes/s  ({b / a:.1f}x)")


def decode(n: int, repeat: int) -> None:
    data = [
        (keys.Key(keys.NODES, (f"node{i:05d}",)), records.encode(fleet_node(i))) for i in range(n)
    ]

    def run() -> tuple[float, dict]:
        view = {}
        start = time.perf_counter()
        for key, raw in data:
            view[key.ids[0]] = trust.decode_for_key(key, raw)
        return time.perf_counter() - start, view

    running, paused = [], []
    tracked = 0
    for _ in range(repeat):
        gc.collect()
        took, view = run()
        running.append(took)
        del view
        gc.collect()
        gc.disable()
        try:
            took, view = run()
        finally:
            gc.enable()
        paused.append(took)
        tracked = len(gc.get_objects())  # with the view held
        del view
    a, b = statistics.median(running), statistics.median(paused)
    print(
        f"decoding {n:,} inventories into a view ({len(data[0][1]):,} bytes each), median of {repeat}:"
    )
    print(f"  cycle collector running (baseline) : {a:6.2f} s")
    print(f"  cycle collector paused             : {b:6.2f} s  ({a / b:.1f}x faster)")
    print(f"  objects the collector tracks with the view held: {tracked:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    anyio.run(fenced_writes, args.writes, args.repeat)
    decode(args.nodes, args.repeat)


if __name__ == "__main__":
    main()
