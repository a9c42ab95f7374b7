"""A thousand LoRA adapters of one base in the simulated fleet, under Zipf(1.0) demand (issue 39).

    .venv/bin/python bench/adapters.py              # both sections (about 4 minutes)
    .venv/bin/python bench/adapters.py room         # some sections

The simulator (llmgw/sim, as `llmgw up --sim` runs it: real agents, simulated vLLM engines)
runs 4 one-GPU nodes mounting a share that holds the base and 1,000 PEFT adapters
(`adapters = [{ name = "ft", count = 1000 }]` in the fleet file); a controller and a router
run in this process, and the adapters are in the catalog as `llmgw adapter add ft-{0001..1000}
--base base` writes them. The base has 4 replicas. Clients send streamed requests at
BENCH_RATE a second (Poisson arrivals) for BENCH_SECONDS, each naming adapter ft-k with
probability proportional to 1/k (Zipf, exponent 1.0); each streams 8 tokens.

- room:  adapter_slots 256 a replica (vLLM's --max-cpu-loras): 1,024 places for 1,000
         adapters, so placement loads every adapter once, into a free slot, before its first
         request (controller/adapters.py).
- tight: adapter_slots 64 a replica: 256 places for 1,000 adapters; the rest are loaded on
         demand, into the slot of the adapter used least lately (the churn budget: a slot
         turns over at most once a minute, an adapter asked for in the last 10 s is kept).

Figures, each beside its goal: the share of requests that found their adapter loaded (the
router's llmgw_router_adapter_requests_total, loaded="yes"; goal at least 95%); the p99
time to first token of the rarest adapters (ranks 501-1,000, about 9% of requests) against
the most asked (ranks 1-10, about 39%) (goal at most 2x); adapter loads per adapter per 10
minutes while the load runs (the engines' own count of load_lora_adapter calls), and those
of the warm-up before it. Everything shares this machine's cores.
"""

from __future__ import annotations

import bisect
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the router and controller the tests run

import os  # noqa: E402

import aiohttp  # noqa: E402
import anyio  # noqa: E402
from controller_helpers import quick_controller  # noqa: E402
from lora_fleet import gpu_base  # noqa: E402
from port_helpers import free_port_run  # noqa: E402
from router_helpers import metric_by, router_settings, running_router  # noqa: E402

from llmgw import catalog  # noqa: E402
from llmgw.bus import keys, records  # noqa: E402
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder  # noqa: E402
from llmgw.bus.server import EmbeddedNats, free_port  # noqa: E402
from llmgw.controller.loop import Controller  # noqa: E402
from llmgw.sim.simulator import Simulator  # noqa: E402

ADAPTERS = 1000
NODES = 4
RATE = float(os.environ.get("BENCH_RATE", "20"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "90"))
TOP, RARE = range(1, 11), range(501, ADAPTERS + 1)  # adapter ranks compared
SECTIONS = {"room": 256, "tight": 64}  # adapter_slots a replica

FLEET = f"""
[sim]
heartbeat = 1
tokens = 8
token_rate = 200
first_token_seconds = 0.05
load_seconds = 0.5

[shares.filer]
models = ["org/base"]
adapters = [{{ name = "ft", count = {ADAPTERS} }}]

[[nodes]]
name = "g"
count = {NODES}
gpus = {{ count = 1 }}
ram_gb = 256
engines = ["vllm"]
mounts = ["filer"]
"""


def name(rank: int) -> str:
    return f"ft-{rank:04d}"


class Zipf:
    """Adapter ranks 1..n with P(k) proportional to 1/k."""

    def __init__(self, n: int, rng: random.Random) -> None:
        weights = [1 / k for k in range(1, n + 1)]
        total = sum(weights)
        self.cumulative, acc = [], 0.0
        for w in weights:
            acc += w / total
            self.cumulative.append(acc)
        self.rng = rng

    def draw(self) -> int:
        return min(bisect.bisect_left(self.cumulative, self.rng.random()), ADAPTERS - 1) + 1


@dataclass
class Results:
    ttft: dict[int, list[float]] = field(default_factory=dict)  # adapter rank -> seconds
    failed: list[str] = field(default_factory=list)


async def one_request(http: aiohttp.ClientSession, url: str, rank: int, out: Results) -> None:
    body = {
        "model": name(rank),
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    started = time.monotonic()
    first = None
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                out.failed.append(f"{resp.status}: {(await resp.read())[:200]!r}")
                return
            async for line in resp.content:
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.monotonic() - started
            if first is not None:
                out.ttft.setdefault(rank, []).append(first)
    except aiohttp.ClientError as e:
        out.failed.append(repr(e))


async def drive(url: str, seconds: float, rng: random.Random) -> Results:
    out, zipf = Results(), Zipf(ADAPTERS, rng)
    # no bound on the client's connections: a request held for its adapter holds one, and
    # aiohttp's default of 100 would make every later request wait in the client
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http, anyio.create_task_group() as tg:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tg.start_soon(one_request, http, url, zipf.draw(), out)
            await anyio.sleep(rng.expovariate(RATE))
    return out


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def loads(sim: Simulator) -> int:
    engines = sim._engines.running if sim._engines is not None else set()
    return sum(e.served.vllm_loras.loads for e in engines if e.served is not None)


async def adapter_requests(url: str) -> dict[str, float]:
    return await metric_by(url, "llmgw_router_adapter_requests_total", "loaded")


async def loaded_count(bus: Bus) -> int:
    shards = await bus.list(keys.pattern(keys.SHARDS), decoder(records.Shard))
    return len({a for e in shards.values() for a in e.value.adapters})


async def section(label: str, slots: int, tmp: Path) -> None:
    nats_server = EmbeddedNats(data_dir=tmp / f"nats-{label}", port=free_port())
    nats_server.start()
    nats = NatsSettings(urls=(nats_server.url,), name="bench")
    fleet = tmp / f"fleet-{label}.toml"
    fleet.write_text(FLEET)
    sim = Simulator(fleet, nats, BucketSettings(), tmp / f"sim-{label}", connections=2)
    filer = tmp / f"sim-{label}" / "shares" / "filer" / "loras"
    try:
        with free_port_run() as ports:
            async with await Bus.connect(nats, give_up_after=5) as bus:
                await bus.put(keys.catalog("base"), catalog.encode_model(gpu_base(slots, rank=8)))
                await bus.put(keys.desired("base"), records.Desired(model="base", replicas=NODES))
                for rank in range(1, ADAPTERS + 1):
                    a = catalog.check_adapter(
                        {
                            "id": name(rank),
                            "served_name": name(rank),
                            "base": "base",
                            "path": str(filer / name(rank)),
                            "rank": 8,
                        }
                    )
                    await bus.put(keys.adapter(a.id), catalog.encode_model(a))
                async with anyio.create_task_group() as tg:
                    await tg.start(Controller(bus, quick_controller(ports)).run)
                    await tg.start(sim.run)

                    def connect() -> Bus:
                        return Bus.connect(nats, give_up_after=5)

                    async with running_router(connect=connect, settings=router_settings()) as r:
                        began = time.monotonic()
                        want = min(ADAPTERS, NODES * slots)
                        while await loaded_count(bus) < want and time.monotonic() - began < 120:
                            await anyio.sleep(1)
                        warm_s, warm_loads = time.monotonic() - began, loads(sim)
                        print(
                            f"[{label}] warm-up: {await loaded_count(bus)} adapters loaded on "
                            f"{NODES} replicas x {slots} slots in {warm_s:.0f} s, "
                            f"{warm_loads} loads"
                        )
                        before = await adapter_requests(r.url)
                        out = await drive(r.url, SECONDS, random.Random(39))
                        after = await adapter_requests(r.url)
                        ran_loads = loads(sim) - warm_loads
                    tg.cancel_scope.cancel()
    finally:
        nats_server.stop()
    report(label, out, before, after, ran_loads)


def report(label: str, out: Results, before: dict, after: dict, ran_loads: int) -> None:
    yes = after.get("yes", 0) - before.get("yes", 0)
    no = after.get("no", 0) - before.get("no", 0)
    total = sum(len(v) for v in out.ttft.values())
    top = [t for k in TOP for t in out.ttft.get(k, [])]
    rare = [t for k in RARE for t in out.ttft.get(k, [])]
    hit = yes / (yes + no) if yes + no else float("nan")
    ratio = p99(rare) / p99(top)
    per = ran_loads / ADAPTERS / (SECONDS / 600)
    print(f"[{label}] {total} requests served, {len(out.failed)} failed, over {SECONDS:.0f} s")
    print(f"[{label}] served where loaded: {hit:.1%} ({yes:.0f} of {yes + no:.0f}); goal >= 95%")
    print(
        f"[{label}] TTFT p99: rarest (ranks 501-1000, {len(rare)} requests) {p99(rare) * 1000:.0f}"
        f" ms, most asked (ranks 1-10, {len(top)}) {p99(top) * 1000:.0f} ms: {ratio:.2f}x; "
        f"goal <= 2x (medians {statistics.median(rare or [0]) * 1000:.0f} and "
        f"{statistics.median(top or [0]) * 1000:.0f} ms)"
    )
    print(f"[{label}] loads while it ran: {ran_loads}, {per:.2f} per adapter per 10 minutes")
    for line in out.failed[:3]:
        print(f"[{label}]   failed: {line}")


async def main(chosen: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-adapters-") as tmp:
        for label in chosen:
            await section(label, SECTIONS[label], Path(tmp))


if __name__ == "__main__":
    wanted = sys.argv[1:] or list(SECTIONS)
    unknown = [w for w in wanted if w not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    anyio.run(main, wanted)
