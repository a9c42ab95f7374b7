"""The control plane at fleet size: one nats-server and one controller under N simulated nodes.

For each fleet size (--nodes 1000,5000,10000), a fresh embedded nats-server on a free port
and the real controller (`python -m llmgw.cli controller`, --lost-after 30 s by default) face
N simulated nodes: each writes `nodes.<id>` once and then renews `leases.<id>` every 5 s the
way the agent does (llmgw/agent/service.py `_heartbeats`: a Lease with the next seq, put
with Bus.put; a failed put is retried at the next beat), staggered over one heartbeat. The
nodes live in writer processes of their own (one connection each, up to 2,500 nodes per
process), so the controller and the server are measured alone and the writers' own CPU is
printed beside them. Measured per size:

- CPU share (CPU s/s) of the controller, the nats-server and the writers over a window in
  steady state, and, as the baseline in the same run, of a client that only follows the
  same bucket (Bus.watch(">"), decoding every lease) without reconciling;
- the bucket's size on disk (the server's store dir) and the stream's own byte count;
- `llmgw place` of 100 replicas (the real CLI, a process of its own): from the command's
  start, and from desired.<model> appearing in the bucket, to all 100 assigned;
- --dead nodes stopped at once: from each one's last lease (acknowledged) to the controller
  writing it `unreachable` and `lost`, against the configured thresholds (the lateness);
- at the largest size, with --profile, a py-spy profile of the controller after the
  window (its own 20 s, so the window is not disturbed), top functions printed.

Then a reconnect storm (--storm 5000 nodes, 0 to skip): every simulated node on a
connection of its own (Bus.connect, so the agents' reconnect and backoff code,
llmgw/bus/connection.py and backoff.py), rewriting its inventory on reconnect as the
agent does; the nats-server is stopped and started again on the same port and store.
Printed: time from the server being back to every node reconnected and to every lease
moving again, and the reconnect rate per 100 ms bucket (the clients' own timestamps), its
peak and how many buckets it spreads over: a lockstep would put most of the fleet in one.

    .venv/bin/python bench/scale.py [--nodes 1000,5000,10000] [--storm 5000] [--window 20]
                                    [--lost-after 30] [--dead 20] [--profile]

The whole default run takes 4-6 minutes on a 2-core machine (--profile adds 20 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc

# the same fleet, processes and CPU sampling as the controller's own bench
from reconcile import WATCHER, Processes, catalog_models, fleet_node, measured_window  # noqa: I001

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings, Update, decoder
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.controller.liveness import UNREACHABLE_AFTER_S
from llmgw.sim.bare import SimNode

MODEL = "bench-100"  # the model `llmgw place` asks 100 replicas of
MODEL_ROW = (MODEL, "llama-server", "hf://org/bench-100:Q4_K_M", 1, 1, 0)
NODES_PER_WRITER = 2500  # shared-connection writers: each puts 500 leases/s at most
STORM_NODES_PER_WRITER = 625  # own-connection writers: nats-py clients per process


# --- the writer process: simulated nodes heartbeating as agents do -----------------------


@dataclass
class Fleet:
    """Simulated nodes first..first+count in one process, on one shared connection or
    (own) a connection each."""

    url: str
    first: int
    count: int
    total: int
    heartbeat: float
    own: bool
    sims: dict[str, SimNode] = field(default_factory=dict)
    buses: list[Bus] = field(default_factory=list)
    stopped: dict[str, anyio.Event] = field(default_factory=dict)
    last_put: dict[str, float] = field(default_factory=dict)  # wall time of the last ack
    mark: float | None = None  # wall time the bench said the server went away
    moved_at: dict[str, float] = field(default_factory=dict)  # first lease acked after mark
    reconnected_at: list[float] = field(default_factory=list)
    attempts_at: list[float] = field(default_factory=list)  # reconnect attempts the backoff planned

    async def connect(self, node: str) -> Bus:
        return await Bus.connect(NatsSettings(urls=(self.url,), name=node))

    async def register(self) -> None:
        shared = None if self.own else await self.connect("bench fleet")
        if shared is not None:
            self.buses.append(shared)
        limiter = anyio.CapacityLimiter(32)

        async def one(i: int) -> None:
            async with limiter:
                inv = fleet_node(i)
                bus = shared or await self.connect(inv.node)
                if shared is None:
                    self.buses.append(bus)
                    bus.on_reconnected(lambda: self.on_reconnected(sim))
                    self.record_attempts(bus)
                sim = SimNode(bus, inv, heartbeat=self.heartbeat)
                self.sims[inv.node] = sim
                self.stopped[inv.node] = anyio.Event()
                await sim.register()

        async with anyio.create_task_group() as tg:
            for i in range(self.first, self.first + self.count):
                tg.start_soon(one, i)

    def record_attempts(self, bus: Bus) -> None:
        """Note when each reconnect attempt is due, as the backoff chooses its delay."""
        backoff = bus.backoff
        choose = backoff.next_delay

        def planned() -> float:
            delay = choose()
            self.attempts_at.append(time.time() + delay)
            return delay

        backoff.next_delay = planned  # type: ignore[method-assign]

    async def on_reconnected(self, sim: SimNode) -> None:
        # the agent's _on_reconnected: registration carries everything, so it is rewritten
        self.reconnected_at.append(time.time())
        with contextlib.suppress(Exception):
            await sim.bus.put(keys.node(sim.node), sim.inv)

    async def heartbeats(self, sim: SimNode, offset: float) -> None:
        """The agent's `_heartbeats` loop: a lease, then sleep one heartbeat, forever."""
        await anyio.sleep(offset)
        while sim.alive:
            try:
                await sim.beat()
            except Exception:  # noqa: BLE001 - as the agent: retried at the next beat
                pass
            else:
                now = time.time()
                self.last_put[sim.node] = now
                if self.mark is not None and sim.node not in self.moved_at:
                    self.moved_at[sim.node] = now
                    if len(self.moved_at) == self.count:
                        self.say(
                            "moved",
                            last=max(self.moved_at.values()),
                            reconnected=[t for t in self.reconnected_at if t > self.mark],
                            attempts=self.attempts_at,
                        )
            await anyio.sleep(self.heartbeat)
        self.stopped[sim.node].set()

    async def kill(self, nodes: list[str]) -> None:
        for node in nodes:
            self.sims[node].alive = False
        for node in nodes:
            await self.stopped[node].wait()  # no lease is in flight any more
        self.say("killed", last={node: self.last_put[node] for node in nodes})

    async def commands(self, tg: anyio.abc.TaskGroup) -> None:
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            verb, *rest = line.split()
            if verb == "kill":
                tg.start_soon(self.kill, rest)
            elif verb == "mark":
                self.mark = time.time()
        tg.cancel_scope.cancel()  # the bench closed our stdin: it is done

    @staticmethod
    def say(event: str, **data: object) -> None:
        print(json.dumps({"event": event, **data}), flush=True)

    async def run(self) -> None:
        started = time.perf_counter()
        await self.register()
        self.say("registered", seconds=time.perf_counter() - started)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.commands, tg)
            for sim in self.sims.values():
                i = int(sim.node.removeprefix("node"))
                tg.start_soon(self.heartbeats, sim, self.heartbeat * (i + 1) / self.total)
        for bus in self.buses:
            with contextlib.suppress(Exception):
                await bus.close()


# --- the orchestrator's view of the bucket ----------------------------------------------


@dataclass
class Seen:
    """What the bench saw the controller write, with the wall time it arrived."""

    health: dict[str, str] = field(default_factory=dict)
    health_at: dict[tuple[str, str], float] = field(default_factory=dict)  # (node, phase): when
    assigned: set[str] = field(default_factory=set)  # rids of MODEL assigned to run
    all_assigned_at: float | None = None
    desired_at: float | None = None

    def ready(self) -> int:
        return sum(1 for phase in self.health.values() if phase == "ready")

    async def follow_health(self, bus: Bus) -> None:
        async with contextlib.aclosing(bus.watch("health.*", decoder(records.Health))) as items:
            async for item in items:
                if isinstance(item, Update) and item.value is not None:
                    node, phase = item.key.split(".", 1)[1], item.value.phase
                    if self.health.get(node) != phase:  # the latest move into each phase
                        self.health_at[(node, phase)] = time.time()
                    self.health[node] = phase

    async def follow_placing(self, bus: Bus, replicas: int) -> None:
        async def assigns() -> None:
            watch = bus.watch("assign.*.*", decoder(records.Assignment))
            async with contextlib.aclosing(watch) as items:
                async for item in items:
                    if isinstance(item, Update) and item.value is not None:
                        a = item.value
                        if a.model == MODEL and a.action == "run":
                            self.assigned.add(a.rid)
                            if len(self.assigned) >= replicas and self.all_assigned_at is None:
                                self.all_assigned_at = time.time()

        async def desired() -> None:
            async with contextlib.aclosing(bus.watch(keys.desired(MODEL), bytes)) as items:
                async for item in items:
                    if isinstance(item, Update) and item.value is not None:
                        self.desired_at = self.desired_at or time.time()

        async with anyio.create_task_group() as tg:
            tg.start_soon(assigns)
            tg.start_soon(desired)


async def until(what: str, timeout: float, check, *, every: float = 0.1) -> float:
    """Wait for check() to be true; the wall time it was seen true."""
    with anyio.move_on_after(timeout):
        while not check():
            await anyio.sleep(every)
        return time.time()
    raise SystemExit(f"{what}: not reached within {timeout:g} s (logs in the temp dir)")


class Writers:
    """The writer processes of one fleet, and the lines they say."""

    def __init__(self, procs: Processes, url: str, nodes: int, heartbeat: float, own: bool):
        per = STORM_NODES_PER_WRITER if own else NODES_PER_WRITER
        count = max(2, math.ceil(nodes / per))
        self.ranges: list[range] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        step = math.ceil(nodes / count)
        for k, first in enumerate(range(0, nodes, step)):
            span = range(first, min(nodes, first + step))
            argv = [sys.executable, __file__, "--role", "writer", "--nats", url]
            argv += ["--first", str(span.start), "--count", str(len(span))]
            argv += ["--total", str(nodes), "--heartbeat", str(heartbeat)]
            argv += ["--own"] if own else []
            proc = procs.start(
                argv, f"writer{k}.log", stdout=subprocess.PIPE, stdin=subprocess.PIPE
            )
            self.ranges.append(span)
            self.procs.append(proc)

    async def read(self, proc: subprocess.Popen[bytes], event: str, timeout: float) -> dict:
        assert proc.stdout is not None
        with anyio.fail_after(timeout):
            line = await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
        said = json.loads(line) if line.strip() else {"event": "exited"}
        if said["event"] != event:
            raise SystemExit(f"a writer said {said['event']!r}, not {event!r}: see writer*.log")
        return said

    async def each(self, event: str, timeout: float) -> list[dict]:
        said: list[dict] = [{}] * len(self.procs)

        async def one(k: int) -> None:
            said[k] = await self.read(self.procs[k], event, timeout)

        async with anyio.create_task_group() as tg:
            for k in range(len(self.procs)):
                tg.start_soon(one, k)
        return said

    def tell(self, k: int, line: str) -> None:
        stdin = self.procs[k].stdin
        assert stdin is not None
        stdin.write(line.encode() + b"\n")
        stdin.flush()

    def holder(self, i: int) -> int:
        return next(k for k, span in enumerate(self.ranges) if i in span)

    @property
    def pids(self) -> dict[str, int]:
        return {f"writer{k}": p.pid for k, p in enumerate(self.procs)}


def node_name(i: int) -> str:
    return f"node{i:05d}"


def disk_bytes(path: Path) -> int:
    """Bytes the store takes on disk (allocated blocks, not apparent sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


# --- one fleet size ------------------------------------------------------------------------


@dataclass
class Row:
    nodes: int
    registered_s: float
    first_pass_s: float
    writes_per_s: float
    expected_per_s: float
    cpu: dict[str, float]  # CPU s/s: controller, watch-only, nats-server, writers, writer max
    disk_bytes: int
    stream_bytes: int
    place_from_cli_s: float
    place_from_desired_s: float
    unreachable_late: list[float]  # seconds after last lease + threshold
    lost_late: list[float]
    profile: list[tuple[str, float]] = field(default_factory=list)


async def start_fleet(
    args: argparse.Namespace, tmp: Path, nodes: int, *, own: bool
) -> tuple[EmbeddedNats, Processes, Writers, Bus]:
    server = EmbeddedNats(tmp / "nats", port=free_port())
    server.start()
    procs = Processes(tmp)
    bus = await Bus.connect(NatsSettings(urls=(server.url,), name="bench"))
    for model in catalog_models([MODEL_ROW]):
        await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    writers = Writers(procs, server.url, nodes, args.heartbeat, own)
    return server, procs, writers, bus


def start_controller(args: argparse.Namespace, procs: Processes, url: str):
    argv = [sys.executable, "-m", "llmgw.cli", "controller", "--nats", url]
    argv += ["--unreachable-after", str(args.unreachable_after)]
    argv += ["--lost-after", str(args.lost_after)]
    return procs.start(argv, "controller.log")


async def one_size(args: argparse.Namespace, nodes: int, profile: bool) -> Row:
    with tempfile.TemporaryDirectory(prefix=f"llmgw-bench-scale-{nodes}-") as tmp_name:
        tmp = Path(tmp_name)
        server, procs, writers, bus = await start_fleet(args, tmp, nodes, own=False)
        try:
            return await measure(args, nodes, profile, tmp, server, procs, writers, bus)
        finally:
            for proc in writers.procs:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            await bus.close()
            procs.stop_all()
            server.stop()


async def measure(args, nodes, profile, tmp, server, procs, writers, bus) -> Row:
    said = await writers.each("registered", 600)
    registered = max(s["seconds"] for s in said)
    watcher = procs.start([sys.executable, "-c", WATCHER, server.url], "watcher.log")
    seen = Seen()
    async with anyio.create_task_group() as tg:
        tg.start_soon(seen.follow_health, bus)
        tg.start_soon(seen.follow_placing, bus, args.replicas)
        started = time.time()
        controller = start_controller(args, procs, server.url)
        first = await until("health for every node", 300, lambda: seen.ready() == nodes)
        print(f"  {nodes}: registered in {registered:.1f} s, first pass {first - started:.1f} s")
        await anyio.sleep(args.settle)

        pids = {
            "controller": controller.pid,
            "watch-only": watcher.pid,
            "nats-server": server.process.pid,
            **writers.pids,
        }
        usage, writes = await measured_window(bus, pids, args.window)
        wall = usage["controller"].wall_s
        cpu = {name: u.per_s for name, u in usage.items() if not name.startswith("writer")}
        per_writer = [u.per_s for name, u in usage.items() if name.startswith("writer")]
        cpu["writers"] = sum(per_writer)
        cpu["writer max"] = max(per_writer)
        top = await py_spy(controller.pid, tmp, args.window) if profile else []

        # 100 replicas asked for with the real CLI
        cli = [sys.executable, "-m", "llmgw.cli", "place", MODEL, "--replicas"]
        cli_started = time.time()
        place = procs.start([*cli, str(args.replicas), "--nats", server.url], "place.log")
        assigned = await until("100 replicas assigned", 120, lambda: seen.all_assigned_at)
        assigned = seen.all_assigned_at or assigned
        await anyio.to_thread.run_sync(place.wait)

        # nodes that die at once, spread over the fleet and the writers
        dead = [i * nodes // args.dead for i in range(args.dead)]
        by_writer: dict[int, list[str]] = {}
        for i in dead:
            by_writer.setdefault(writers.holder(i), []).append(node_name(i))
        for k, names in by_writer.items():
            writers.tell(k, "kill " + " ".join(names))
        last: dict[str, float] = {}
        for k in by_writer:
            last.update((await writers.read(writers.procs[k], "killed", 60))["last"])
        await until(
            "dead nodes lost",
            args.lost_after + 60,
            lambda: all(seen.health.get(n) == "lost" for n in last),
            every=0.5,
        )
        if controller.poll() is not None:
            raise SystemExit("the controller exited; see controller.log")
        tg.cancel_scope.cancel()

    info = await bus.js.stream_info(f"KV_{keys.DEFAULT_BUCKET}")
    return Row(
        nodes=nodes,
        registered_s=registered,
        first_pass_s=first - started,
        writes_per_s=writes / wall,
        expected_per_s=nodes / args.heartbeat,
        cpu=cpu,
        disk_bytes=disk_bytes(tmp / "nats" / "jetstream"),
        stream_bytes=info.state.bytes,
        place_from_cli_s=assigned - cli_started,
        place_from_desired_s=assigned - (seen.desired_at or cli_started),
        unreachable_late=[
            seen.health_at[(n, "unreachable")] - t - args.unreachable_after
            for n, t in last.items()
            if (n, "unreachable") in seen.health_at
        ],
        lost_late=[seen.health_at[(n, "lost")] - t - args.lost_after for n, t in last.items()],
        profile=top,
    )


async def py_spy(pid: int, tmp: Path, seconds: float) -> list[tuple[str, float]]:
    """The controller's hottest functions (share of samples that have them on the stack)."""
    out = tmp / "controller.spy"
    argv = ["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "50"]
    argv += ["-f", "raw", "-o", str(out), "--nonblocking"]
    spy = Path(sys.executable).parent / "py-spy"
    argv[0] = str(spy) if spy.exists() else "py-spy"
    try:
        await anyio.run_process(argv, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"  py-spy failed ({e}); no profile (pip install py-spy)")
        return []
    return hottest(out.read_text().splitlines())


def hottest(collapsed: list[str], top: int = 20) -> list[tuple[str, float]]:
    """From py-spy's collapsed stacks: the llmgw, nats and msgspec functions with the largest
    share of the busy samples on their stack (samples waiting in select() are idle)."""
    inclusive: Counter[str] = Counter()
    busy = 0
    for line in collapsed:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not frames or "select" in frames[-1].split(" (")[0]:
            continue
        busy += int(count)
        names = set()
        for frame in frames:
            function, _, where = frame.partition(" (")
            path = where.split(":")[0]
            if "llmgw/cli/" in path:
                continue  # the process entry point: on every stack
            for package in ("llmgw/", "nats/", "msgspec/"):
                if package in path:
                    names.add(f"{function} ({package}{path.split(package, 1)[1]})")
        for name in names:
            inclusive[name] += int(count)
    return [(name, n / busy) for name, n in inclusive.most_common(top)] if busy else []


# --- the reconnect storm ---------------------------------------------------------------------


@dataclass
class Storm:
    nodes: int
    connected_s: float
    down_s: float  # server stopped to serving again
    reconnected_s: float  # server back to the last node reconnected
    moved_s: float  # server back to the last node's lease acknowledged
    per_bucket: list[int]  # reconnects per 100 ms from the server's stop
    attempt_buckets: list[int]  # reconnect attempts the backoff planned, likewise


async def storm(args: argparse.Namespace) -> Storm:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-storm-") as tmp_name:
        tmp = Path(tmp_name)
        server, procs, writers, bus = await start_fleet(args, tmp, args.storm, own=True)
        try:
            said = await writers.each("registered", 900)
            connected = max(s["seconds"] for s in said)
            start_controller(args, procs, server.url)
            print(f"  storm: {args.storm} connections up in {connected:.1f} s")
            # agents' connections older than healthy_after, as in a fleet that ran a while
            await anyio.sleep(max(args.settle, 12))
            await bus.close()
            stopped = time.time()
            await anyio.to_thread.run_sync(server.stop)
            for k in range(len(writers.procs)):
                writers.tell(k, "mark")
            await anyio.to_thread.run_sync(server.start)
            back = time.time()
            moved = await writers.each("moved", 300)
        finally:
            for proc in writers.procs:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            procs.stop_all()
            server.stop()
    reconnects = [t for m in moved for t in m["reconnected"]]
    attempts = [t for m in moved for t in m["attempts"] if t > stopped]
    if not reconnects:
        raise SystemExit("storm: no reconnect seen")
    return Storm(
        nodes=args.storm,
        connected_s=connected,
        down_s=back - stopped,
        reconnected_s=max(reconnects) - back,
        moved_s=max(m["last"] for m in moved) - back,
        per_bucket=per_100ms(reconnects, stopped),
        attempt_buckets=per_100ms(attempts, stopped),
    )


def per_100ms(times: list[float], since: float) -> list[int]:
    """How many of `times` fall in each 100 ms from `since`."""
    buckets = Counter(int((t - since) * 10) for t in times)
    return [buckets.get(b, 0) for b in range(max(buckets, default=-1) + 1)]


# --- the report --------------------------------------------------------------------------


def growth(rows: list[Row], value) -> list[str]:
    """Each size's value per node against the smallest size's: 1.0 is linear."""
    base = value(rows[0]) / rows[0].nodes
    return [f"{value(r) / r.nodes / base:.2f}" if base else "-" for r in rows]


def report(args: argparse.Namespace, rows: list[Row], st: Storm | None) -> None:
    if rows:
        fleet_table(args, rows)
    if st is not None:
        storm_report(st)


def fleet_table(args: argparse.Namespace, rows: list[Row]) -> None:
    print()
    print(
        f"heartbeat {args.heartbeat:g} s; window {args.window:g} s; unreachable after "
        f"{args.unreachable_after:g} s, lost after {args.lost_after:g} s; {args.dead} nodes "
        f"killed; {args.replicas} replicas placed"
    )
    cols = [f"{r.nodes:,} nodes" for r in rows]
    table: list[tuple[str, list[str]]] = [
        (
            "lease writes/s (expected)",
            [f"{r.writes_per_s:.0f} ({r.expected_per_s:.0f})" for r in rows],
        ),
        ("controller CPU s/s", [f"{r.cpu['controller']:.3f}" for r in rows]),
        ("  per node, vs smallest", growth(rows, lambda r: r.cpu["controller"])),
        ("watch-only client CPU s/s", [f"{r.cpu['watch-only']:.3f}" for r in rows]),
        (
            "controller / watch-only",
            [f"{r.cpu['controller'] / r.cpu['watch-only']:.2f}" for r in rows],
        ),
        ("nats-server CPU s/s", [f"{r.cpu['nats-server']:.3f}" for r in rows]),
        ("  per node, vs smallest", growth(rows, lambda r: r.cpu["nats-server"])),
        (
            "writers CPU s/s (busiest)",
            [f"{r.cpu['writers']:.2f} ({r.cpu['writer max']:.2f})" for r in rows],
        ),
        ("store on disk MiB", [f"{r.disk_bytes / 2**20:.1f}" for r in rows]),
        ("  stream bytes MiB", [f"{r.stream_bytes / 2**20:.1f}" for r in rows]),
        ("  per node, vs smallest", growth(rows, lambda r: r.disk_bytes)),
        ("first complete pass s", [f"{r.first_pass_s:.1f}" for r in rows]),
        ("place 100: from CLI s", [f"{r.place_from_cli_s:.2f}" for r in rows]),
        ("place 100: from desired s", [f"{r.place_from_desired_s:.2f}" for r in rows]),
        ("unreachable late s (med/max)", [spread(r.unreachable_late) for r in rows]),
        ("lost late s (med/max)", [spread(r.lost_late) for r in rows]),
    ]
    width = max(len(name) for name, _ in table) + 2
    print("".ljust(width) + "".join(c.rjust(16) for c in cols))
    for name, values in table:
        print(name.ljust(width) + "".join(v.rjust(16) for v in values))
    print(
        "lateness: from a node's last acknowledged lease to the controller's health write, "
        "less the threshold; `per node, vs smallest`: cost per node over the smallest "
        "size's (1.00 = linear)"
    )
    for r in rows:
        if r.profile:
            print(f"\ncontroller profile at {r.nodes:,} nodes (py-spy: share of busy samples):")
            for frame, share in r.profile:
                print(f"  {share:6.1%}  {frame}")


def storm_report(st: Storm) -> None:
    print(
        f"\nreconnect storm, {st.nodes:,} nodes on a connection each (connected in "
        f"{st.connected_s:.0f} s): server down {st.down_s:.2f} s; from back up to every "
        f"node reconnected {st.reconnected_s:.2f} s, to every lease moving {st.moved_s:.2f} s"
    )
    for what, counts in (
        ("connection attempts the backoff planned", st.attempt_buckets),
        ("reconnects (connected again)", st.per_bucket),
    ):
        peak = max(counts, default=0)
        first = next((b for b, c in enumerate(counts) if c), 0)
        print(
            f"{what}, per 100 ms from the server's stop: peak {peak} "
            f"({peak / st.nodes:.1%} of the fleet), {sum(counts)} in all over "
            f"{len(counts) - first} buckets from {first / 10:.1f} s"
        )
        print("  " + " ".join(str(c) for c in counts[first:]))


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return f"{values[len(values) // 2]:.1f} / {values[-1]:.1f}"


async def run(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    sizes = [int(n) for n in args.nodes.split(",") if n]
    rows = []
    for n in sizes:
        rows.append(await one_size(args, n, profile=args.profile and n == max(sizes)))
    st = await storm(args) if args.storm else None
    report(args, rows, st)
    print(f"\nwhole run: {time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="1000,5000,10000", help="fleet sizes, comma-separated")
    parser.add_argument("--storm", type=int, default=5000, help="nodes in the reconnect storm")
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between leases")
    parser.add_argument("--window", type=float, default=20.0, help="CPU window, seconds")
    parser.add_argument("--settle", type=float, default=5.0, help="steady state before it")
    parser.add_argument("--unreachable-after", type=float, default=UNREACHABLE_AFTER_S)
    parser.add_argument("--lost-after", type=float, default=30.0)
    parser.add_argument("--dead", type=int, default=20, help="nodes stopped at once")
    parser.add_argument("--replicas", type=int, default=100, help="replicas `llmgw place` asks")
    parser.add_argument("--profile", action="store_true", help="py-spy the largest controller")
    parser.add_argument(
        "--role", choices=["bench", "writer"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--first", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--own", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "writer":
        fleet = Fleet(args.nats, args.first, args.count, args.total, args.heartbeat, args.own)
        anyio.run(fleet.run)
    else:
        anyio.run(run, args)


if __name__ == "__main__":
    main()
