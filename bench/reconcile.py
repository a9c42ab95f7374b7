"""The controller's cost at fleet size: CPU per second with 2,000 nodes heartbeating.

An embedded nats-server on a free port; a writer process runs 2,000 SimNodes (8 GPUs each,
four InfiniBand fabrics plus nodes on none, weights on some local disks and one filer
per fabric) that heartbeat every 5 s, staggered: ~400 lease writes/s, from a process of
their own so the controller's CPU is measured alone. The catalog holds four models with
37 replicas wanted, placed by the controller on its first passes and then reported ready
by shards (steady state), plus --waiting models no node can take (they keep waiting, as
a fleet usually has some). The controller is the real one: `python -m llmgw.cli controller`.

Baseline, measured in the same run and window: a process that only follows the same
bucket (Bus.watch(">") and decodes every lease) without reconciling, so the ratio is what
reconciling costs on top of keeping up with the bucket. Also printed: the controller's
time from process start to its first complete pass (health written for every node), and
to every placeable replica placed.

    .venv/bin/python bench/reconcile.py [--nodes 2000] [--heartbeat 5] [--seconds 60]
                                        [--waiting 1]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import psutil

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings, Update, decoder
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.sim.bare import SimNode, inventory

FABRICS = ["ib-a", "ib-b", "ib-c", "ib-d"]
# (id, engine, weights source, GPUs per node, nodes, replicas)
PLACEABLE = [
    ("llama-8b", "llama-server", "hf://org/llama-8b:Q4_K_M", 1, 1, 20),
    ("qwen-32b", "vllm", "hf://org/qwen-32b", 2, 1, 10),
    ("llama-70b", "vllm", "hf://org/llama-70b", 8, 1, 5),
    ("deepseek", "vllm", "hf://org/deepseek", 8, 2, 2),
]


def waiting_models(count: int) -> list[tuple[str, str, str, int, int, int]]:
    """Models no node can take (16 GPUs per node): they wait, with their explanation."""
    return [(f"too-big-{i}", "vllm", f"hf://org/too-big-{i}", 16, 1, 1) for i in range(count)]


# The baseline: follow the whole bucket as the controller does, decode leases, nothing more.
WATCHER = r"""
import sys
import anyio
from llmgw.bus import records
from llmgw.bus.client import Bus, NatsSettings, Update

async def main(url):
    bus = await Bus.connect(NatsSettings(urls=(url,), name="bench watcher"))
    leases = {}
    async for item in bus.watch(">", lambda data: data):
        if isinstance(item, Update) and item.value is not None and item.key.startswith("leases."):
            leases[item.key] = records.decode(item.value, records.Lease)

anyio.run(main, sys.argv[1])
"""


# --- the writer process: the fleet's agents ---------------------------------------------


def fleet_node(i: int) -> records.NodeInventory:
    name = f"node{i:05d}"
    fabric = FABRICS[i % len(FABRICS)] if i % 10 else None
    inv = inventory(name, fabric=fabric, address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    held = []
    if i % 20 == 0:  # a local copy here and there
        key = f"org/{PLACEABLE[i // 20 % 4][0]}"
        held.append((key, records.Store(kind="local", identity=f"local:{name}")))
    if fabric and i % 3 == 0:  # one filer per fabric, seen from a third of its nodes
        store = records.Store(kind="shared", identity=f"nfs:filer-{fabric}:/models")
        held.append((f"org/{PLACEABLE[FABRICS.index(fabric)][0]}", store))
    models = [
        records.HeldModel(key=k, format="safetensors", path=f"/m/{k}", bytes=1, files=1, store=s)
        for k, s in held
    ]
    return msgspec.structs.replace(inv, weights=records.Weights(looked=i % 2 == 0, models=models))


async def write_fleet(url: str, nodes: int, heartbeat: float) -> None:
    bus = await Bus.connect(NatsSettings(urls=(url,), name="bench fleet"))
    sims = [SimNode(bus, fleet_node(i), heartbeat=heartbeat) for i in range(nodes)]
    limiter = anyio.CapacityLimiter(64)

    async def register(sim: SimNode) -> None:
        async with limiter:
            await sim.register()

    async with anyio.create_task_group() as tg:
        for sim in sims:
            tg.start_soon(register, sim)
    print("registered", flush=True)

    async def staggered(sim: SimNode, offset: float) -> None:
        await anyio.sleep(offset)  # spread the fleet's beats evenly over one heartbeat
        await sim.run()

    async with anyio.create_task_group() as tg:
        for i, sim in enumerate(sims):
            tg.start_soon(staggered, sim, heartbeat * (i + 1) / nodes)


# --- the orchestrator -------------------------------------------------------------------


def catalog_models(models) -> list[catalog.Model]:
    raw = [
        {
            "id": mid,
            "profiles": [
                {
                    "name": "p",
                    "engine": engine,
                    "weights": {"source": source},
                    "gpus_per_node": gpus,
                    "gpu_memory_gb": 40,
                    "host_ram_gb": 32,
                    "nodes": n,
                }
            ],
        }
        for mid, engine, source, gpus, n, _ in models
    ]
    return catalog.validate_models({"models": raw})


class Processes:
    """Every process this bench starts, so that all of them end however the bench ends."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log_name: str, **kw) -> subprocess.Popen[bytes]:
        with open(self.logs / log_name, "ab") as log:
            kw.setdefault("stdout", log)
            proc = subprocess.Popen(argv, stderr=log, **kw)
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


@dataclass
class Usage:
    cpu_s: float
    wall_s: float

    @property
    def per_s(self) -> float:
        return self.cpu_s / self.wall_s


def cpu_over(pids: dict[str, int], seconds: float) -> dict[str, Usage]:
    handles = {name: psutil.Process(pid) for name, pid in pids.items()}

    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    start = time.perf_counter()
    before = {name: cpu(p) for name, p in handles.items()}
    time.sleep(seconds)
    wall = time.perf_counter() - start
    return {name: Usage(cpu(p) - before[name], wall) for name, p in handles.items()}


async def measured_window(
    bus: Bus, pids: dict[str, int], seconds: float
) -> tuple[dict[str, Usage], int]:
    """CPU of each process over `seconds`, and how many bucket writes came meanwhile."""
    stream = f"KV_{keys.DEFAULT_BUCKET}"
    seq0 = (await bus.js.stream_info(stream)).state.last_seq
    usage = await anyio.to_thread.run_sync(cpu_over, pids, seconds)
    return usage, (await bus.js.stream_info(stream)).state.last_seq - seq0


async def until(what: str, timeout: float, check) -> None:
    with anyio.move_on_after(timeout):
        while not await check():
            await anyio.sleep(0.2)
        return
    raise SystemExit(f"{what}: not reached within {timeout:g} s; see controller.log")


async def wait_for_health(bus: Bus, nodes: int, controller: subprocess.Popen[bytes]) -> None:
    """Until health.<node> says ready for every node: the first complete pass."""
    ready: set[str] = set()
    with anyio.fail_after(120):
        async with contextlib.aclosing(bus.watch("health.*", decoder(records.Health))) as items:
            async for item in items:
                if isinstance(item, Update):
                    node = item.key.split(".", 1)[1]
                    if item.value is not None and item.value.phase == "ready":
                        ready.add(node)
                    else:
                        ready.discard(node)
                if len(ready) == nodes:
                    return
                if controller.poll() is not None:
                    raise SystemExit("the controller exited; see controller.log")


async def placed_everything(bus: Bus, waiting: int) -> bool:
    got = await bus.list("placement.*", decoder(records.PlacementRecord))
    by_model = {e.value.model: e.value for e in got.values()}
    placed = all(m in by_model and by_model[m].placed == want for m, *_, want in PLACEABLE)
    return placed and all(m in by_model for m, *_ in waiting_models(waiting))


async def report_shards_ready(bus: Bus) -> int:
    """What the agents of the placed nodes would say once their engines serve."""
    nodes = await bus.list("nodes.*", decoder(records.NodeInventory))
    assigns = await bus.list("assign.*.*", decoder(records.Assignment))
    for entry in assigns.values():
        a = entry.value
        node = entry.key.split(".")[1]
        address = nodes[keys.node(node)].value.address
        shard = records.Shard(
            node=node,
            rid=a.rid,
            model=a.model,
            generation=a.generation,
            phase="ready",
            since=time.time(),
            endpoint=f"{address}:{a.port}",
        )
        await bus.put(keys.shard(node, a.rid), shard)
    return len(assigns)


async def replicas_ready(bus: Bus) -> bool:
    got = await bus.list("replicas.*.*", decoder(records.Replica))
    return bool(got) and all(e.value.phase == "ready" for e in got.values())


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-reconcile-") as tmp_name:
        tmp = Path(tmp_name)
        server = EmbeddedNats(tmp / "nats", port=free_port())
        server.start()
        procs = Processes(tmp)
        try:
            bus = await Bus.connect(NatsSettings(urls=(server.url,), name="bench"))
            try:
                await steady_state(args, server, bus, procs)
            finally:
                await bus.close()
        finally:
            procs.stop_all()
            server.stop()


async def steady_state(
    args: argparse.Namespace, server: EmbeddedNats, bus: Bus, procs: Processes
) -> None:
    url = server.url
    models = PLACEABLE + waiting_models(args.waiting)
    for model in catalog_models(models):
        await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    for mid, *_, want in models:
        await bus.put(keys.desired(mid), records.Desired(model=mid, replicas=want))

    here = [sys.executable, __file__, "--nats", url, "--nodes", str(args.nodes)]
    writer = procs.start(
        [*here, "--heartbeat", str(args.heartbeat), "--role", "writer"],
        "writer.log",
        stdout=subprocess.PIPE,
    )
    assert writer.stdout is not None
    line = await anyio.to_thread.run_sync(writer.stdout.readline)
    if line.strip() != b"registered":
        raise SystemExit(f"the fleet writer did not start ({line!r}); see writer.log")
    watcher = procs.start([sys.executable, "-c", WATCHER, url], "watcher.log")

    started = time.perf_counter()
    controller = procs.start(
        [sys.executable, "-m", "llmgw.cli", "controller", "--nats", url], "controller.log"
    )
    await wait_for_health(bus, args.nodes, controller)
    first_pass = time.perf_counter() - started
    await until("placement", 120, lambda: placed_everything(bus, args.waiting))
    placed = time.perf_counter() - started
    shards = await report_shards_ready(bus)
    await until("replicas ready", 60, lambda: replicas_ready(bus))
    await anyio.sleep(args.settle)

    pids = {
        "controller": controller.pid,
        "watcher": watcher.pid,
        "writer": writer.pid,
        "nats-server": server.process.pid,  # type: ignore[union-attr]
    }
    usage, writes = await measured_window(bus, pids, args.seconds)
    health = await bus.list("health.*", decoder(records.Health))
    not_ready = sum(1 for e in health.values() if e.value.phase != "ready")
    if controller.poll() is not None or watcher.poll() is not None:
        raise SystemExit("the controller or the watcher exited during the window; see their logs")

    c, w = usage["controller"], usage["watcher"]
    rate = writes / c.wall_s
    wanted = sum(want for *_, want in PLACEABLE)
    print(
        f"fleet: {args.nodes} nodes heartbeating every {args.heartbeat:g} s; "
        f"{len(PLACEABLE)} models, {wanted} replicas placed and ready ({shards} shards), "
        f"{args.waiting} more model(s) waiting (fit nowhere)"
    )
    print(
        f"window: {c.wall_s:.0f} s, {rate:.0f} bucket writes/s; "
        f"nodes not ready at the end: {not_ready}"
    )
    print(f"controller:        {c.per_s:.3f} CPU s/s  ({c.per_s / rate * 1e6:.0f} us per write)")
    print(f"watch-only client: {w.per_s:.3f} CPU s/s  ({w.per_s / rate * 1e6:.0f} us per write)")
    print(
        f"ratio controller/watch-only: {c.per_s / w.per_s:.2f}  "
        f"(reconciling adds {(c.per_s - w.per_s):.3f} CPU s/s)"
    )
    print(
        f"also in the window: fleet writer {usage['writer'].per_s:.3f}, "
        f"nats-server {usage['nats-server'].per_s:.3f} CPU s/s"
    )
    print(
        f"controller start to first complete pass (health for {args.nodes} nodes): "
        f"{first_pass:.2f} s; to every placeable replica placed: {placed:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between beats")
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window")
    parser.add_argument("--waiting", type=int, default=1, help="models that fit nowhere")
    parser.add_argument("--settle", type=float, default=5.0, help="steady state before it")
    parser.add_argument(
        "--role", choices=["bench", "writer"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "writer":
        anyio.run(write_fleet, args.nats, args.nodes, args.heartbeat)
    else:
        anyio.run(run, args)


if __name__ == "__main__":
    main()
