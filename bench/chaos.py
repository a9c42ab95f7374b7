"""The fleet under seeded random faults, until it stops itself: does it keep its promise?

    .venv/bin/python bench/chaos.py                          # 30 minutes, seed 1
    .venv/bin/python bench/chaos.py --minutes 3 --seed 7 --report /tmp/chaos.json
    .venv/bin/python bench/chaos.py --scenario my-chaos.toml  # keys of Scenario, [weights]

It starts, on this host, a 3-server JetStream cluster (tests/local_cluster.py;
`sync_interval: always`, the bucket and the gateway's streams with 3 copies), 2 controllers,
2 routers and 4 agents (each on a loopback address of its own, its NATS links through
proxies this process holds so that they can be cut) running the fake engine as
llama-server: a model of 4 replicas that the load streams from, and a canary of 1 or 2
replicas that each cluster server's death changes, to time the control plane's next write.
Every router gets 3 streaming clients. Then, until the time is up, faults are drawn (seeded):
SIGKILL of an agent, an engine, a controller, a router or one nats-server (never two servers
at once); a router told to stop (SIGTERM); SIGSTOP of any of them for a few seconds; an
agent's links cut. What is killed or stopped is started again after a few seconds (an
engine, by its agent). Each fault is held, undone, and the next one drawn once the fleet is
whole again: every process up, every desired replica ready in the bucket and routed by both
routers, every node ready; now and then a second fault of another kind comes while the
first one holds.

It reports every request and explains each failure by the fault that explains it: a request
an engine had read (fake engine's FAKE_ENGINE_REQUEST_LOG) while that engine was killed or
stopped, a request to a router killed, stopped or restarting; anything else is unexplained.
It reports the time to a whole fleet after each kind of fault, the control plane's next
write after each server's death, then duplicate replicas, engine processes no shard names
(leaked) and keys that do not read, and checks the goals of docs/reliability.md ("The chaos
run"): exit 1 when one fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import aiohttp
import anyio
import msgspec
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from agent_helpers import agent_config, host_dirs, start_agent  # noqa: E402
from links import ProxyLink  # noqa: E402
from local_cluster import LocalCluster  # noqa: E402
from serving import cpu_model, serve  # noqa: E402

from llmgw.agent.config import Engines, Intervals, Nats  # noqa: E402
from llmgw.bus import keys, records  # noqa: E402
from llmgw.bus.client import RAW, BucketSettings, Bus, BusError, NatsSettings  # noqa: E402
from llmgw.bus.counters import ensure_streams  # noqa: E402
from llmgw.bus.server import SYNC_INTERVAL, free_port  # noqa: E402
from llmgw.fleetstate.decode import FleetRecords  # noqa: E402
from llmgw.sim.fake_engine import install_fake_engines, write_fake_gguf  # noqa: E402

LLMGW = [sys.executable, "-m", "llmgw.cli"]
SERVED = {"tiny": "tiny-chat", "canary": "canary-chat"}
KINDS = (
    "kill agent",
    "kill engine",
    "kill controller",
    "kill router",
    "stop router",
    "kill server",
    "pause agent",
    "pause engine",
    "pause controller",
    "pause router",
    "pause server",
    "cut agent link",
)
# faults whose fleet is measured from the fault itself, not from its undoing: nothing undoes
# an engine's death but its agent, and a cluster is built to lose one server
FROM_THE_FAULT = ("kill engine", "kill server")
# the goals (docs/reliability.md, "The chaos run")
WRITES_AGAIN_S = 10.0  # the control plane's next write after a cluster server's death
WHOLE_AGAIN_S = 10.0  # the fleet whole again after a fault's end, besides an engine's start


@dataclass
class Scenario:
    seed: int = 1
    minutes: float = 30.0
    agents: int = 4
    replicas: int = 4  # of the model the load streams from
    clients: int = 3  # streaming clients per router
    tokens: int = 20  # a stream's tokens, at token_rate a second
    token_rate: float = 40.0
    engine_load_s: float = 1.0  # an engine's own start
    gap_s: tuple[float, float] = (2.0, 8.0)  # between the fleet whole again and the next fault
    down_s: tuple[float, float] = (1.0, 5.0)  # a killed process is started again after this
    pause_s: tuple[float, float] = (2.0, 8.0)  # SIGSTOP to SIGCONT
    cut_s: tuple[float, float] = (3.0, 12.0)  # an agent's links cut
    overlap: float = 0.2  # chance of a second fault of another kind while one holds
    settle_s: float = 120.0  # a fleet not whole again by then: that fault is reported so
    weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 1.0))

    @classmethod
    def read(cls, path: Path) -> Scenario:
        data = tomllib.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SystemExit(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        bad = set(data.get("weights", {})) - set(KINDS)
        if bad:
            raise SystemExit(f"{path}: unknown fault kinds {sorted(bad)}; known: {KINDS}")
        for k in ("gap_s", "down_s", "pause_s", "cut_s"):
            if k in data:
                data[k] = tuple(data[k])
        if "weights" in data:
            data["weights"] = {**dict.fromkeys(KINDS, 0.0), **data["weights"]}
        return cls(**data)


@dataclass
class Request:
    id: str
    router: int
    start: float
    end: float = 0.0
    status: int = 0
    error: str = ""
    replica: str | None = None
    done: bool = False  # the stream's [DONE] came

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error


@dataclass
class Fault:
    kind: str
    target: str
    start: float
    undo: float | None = None  # restarted, continued, healed (an engine: by its agent)
    ready: float | None = None  # the fleet whole again
    pid: int | None = None
    router: int | None = None
    control_plane_s: float | None = None  # a server's death: to the canary's next placement
    change_in_effect_s: float | None = None  # ...and to its new count served by both routers
    leader_s: float | None = None  # a controller's death: until one leads again
    engine_start_s: float | None = None  # an engine killed: its replacement's own start
    overlapped: bool = False
    # the last end among the faults of its round: two that overlap leave the fleet whole
    # only once both have ended, and the one that ended first is not charged the other's
    measured_from: float | None = None
    waited_for: str = ""  # what the fleet lacked longest before it was whole again

    @property
    def ended(self) -> float:
        """When the fault ended: its undo; a server's death and an engine's: the fault
        itself (nothing undoes them but the cluster and the agent)."""
        return self.start if self.kind in FROM_THE_FAULT else (self.undo or self.start)

    @property
    def whole_after_s(self) -> float | None:
        """From the end of the fault (of the last of its round) to the fleet whole again,
        less an engine's own start."""
        if self.ready is None:
            return None
        took = self.ready - (self.measured_from or self.ended)
        return took - min(took, self.engine_start_s or 0.0)


class Fleet:
    """Every process of the run, started and started again by name."""

    def __init__(self, run: Path, scenario: Scenario) -> None:
        self.run, self.s = run, scenario
        self.cluster = LocalCluster(run / "cluster", sync_interval=SYNC_INTERVAL)
        self.controllers: dict[str, subprocess.Popen] = {}
        self.routers: dict[int, subprocess.Popen] = {}
        self.router_ports = [free_port() for _ in range(2)]
        self.agents: dict[str, subprocess.Popen] = {}
        self.agent_cfgs: dict[str, tuple] = {}
        self.links: dict[str, list[ProxyLink]] = {}
        self.paused: dict[int, str] = {}  # pids under SIGSTOP: what each is
        self.down: set[str] = set()  # names of processes killed and not started again
        self.requests_log = run / "requests.log"
        self.bus: Bus | None = None

    @property
    def nats(self) -> NatsSettings:
        return NatsSettings(urls=self.cluster.urls, connect_timeout=1, name="chaos monitor")

    def _nats_args(self) -> list[str]:
        return [a for u in self.cluster.urls for a in ("--nats", u)]

    def _log(self, name: str):
        return open(self.run / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it

    async def start(self) -> None:
        (self.run / "logs").mkdir(parents=True)
        self.cluster.start_all()
        self.bus = await Bus.connect(self.nats, BucketSettings(replicas=3), give_up_after=60)
        await ensure_streams(self.bus)
        for name in ("c1", "c2"):
            self.start_controller(name)
        for i in range(self.s.agents):
            await self._make_agent(f"n{i + 1}", f"127.0.42.{i + 2}")
        env = {
            "FAKE_ENGINE_TOKENS": str(self.s.tokens),
            "FAKE_ENGINE_TOKEN_RATE": str(self.s.token_rate),
            "FAKE_ENGINE_LOAD_SECONDS": str(self.s.engine_load_s),
            "FAKE_ENGINE_REQUEST_LOG": str(self.requests_log),
        }
        gguf = str(write_fake_gguf(self.run / "weights" / "tiny.gguf"))
        for model, replicas in (("tiny", self.s.replicas), ("canary", 1)):
            await serve(
                self.bus,
                cpu_model(gguf, model_id=model, served_name=SERVED[model], env=env, host_ram_gb=1),
                replicas,
            )
        for i in range(2):
            self.start_router(i)

    def start_controller(self, name: str) -> None:
        with self._log(f"controller-{name}") as log:
            self.controllers[name] = subprocess.Popen(
                [*LLMGW, "controller", *self._nats_args(), "--bucket-replicas", "3", "--id", name],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.down.discard(f"controller {name}")

    def start_router(self, i: int) -> None:
        with self._log(f"router-{i}") as log:
            self.routers[i] = subprocess.Popen(
                [
                    *LLMGW,
                    "router",
                    *self._nats_args(),
                    "--listen",
                    f"127.0.0.1:{self.router_ports[i]}",
                    "--router-id",
                    f"r{i}",
                    "--shutdown-grace",
                    "30",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.down.discard(f"router {i}")

    async def _make_agent(self, node: str, address: str) -> None:
        links = [ProxyLink(s.port) for s in self.cluster.servers]
        for link in links:
            await link.start()
        self.links[node] = links
        dirs = host_dirs(self.run / "nodes" / node)
        install_fake_engines(dirs["bin"])
        cfg = msgspec.structs.replace(
            agent_config(links[0].url, dirs, id=node, address=address),
            nats=Nats(urls=[link.url for link in links]),
            intervals=Intervals(),
            engines=Engines(listen_host=address, stop_grace=3, drain_timeout=30),
        )
        self.agent_cfgs[node] = (cfg, dirs)
        self.start_agent(node)

    def start_agent(self, node: str) -> None:
        cfg, dirs = self.agent_cfgs[node]
        root = self.run / "nodes" / node
        self.agents[node] = start_agent(
            cfg,
            root / "agent.toml",
            [dirs["bin"], Path("/usr/bin"), Path("/bin")],
            self.run / "logs" / f"agent-{node}.log",
        )
        self.down.discard(f"agent {node}")

    # --- what the bucket says ----------------------------------------------------------------

    async def records(self) -> FleetRecords:
        """The bucket, decoded as the controller reads it (a BusError while it elects)."""
        assert self.bus is not None
        view = FleetRecords(gateway=True)
        for key, entry in (await self.bus.list(">", RAW)).items():
            view.apply(key, entry.value, entry.revision)
        return view

    async def engines(self) -> dict[int, str]:
        """The pid of every engine a shard names, and what it runs."""
        view = await self.records()
        return {
            s.pid: f"{s.model} {s.rid} on {s.node}"
            for s in view.shards.values()
            if s.pid and s.phase == "ready"
        }

    async def lacks(self) -> tuple[str | None, str | None]:
        """What the fleet lacks to be whole (None: nothing), with the canary and without
        it. Whole: every agent and router up, no engine stopped, no agent's links cut (a
        controller or one server of three down is what the fleet is built to lose), every
        desired replica ready in the bucket and routed by both routers, every node ready (a
        replica on a node judged unreachable still serves, llmgw/fleetstate/serving.py, and
        no request fails for it; but nothing is placed there until it is ready again)."""
        blocking = sorted(d for d in self.down if d.split()[0] in ("agent", "router", "links"))
        paused = sorted(pid for pid, what in self.paused.items() if what != "server")
        gone = [name for name, p in self._processes().items() if p.poll() is not None]
        gone = [name for name in gone if name not in self.down]
        if blocking or paused or gone:
            why = f"down: {blocking}, stopped: {paused}, exited: {gone}"
            return why, why
        try:
            view = await self.records()
        except BusError as e:
            return f"bucket: {e}", f"bucket: {e}"
        dead = [
            s.pid
            for s in view.shards.values()
            if s.phase == "ready" and s.pid and not psutil.pid_exists(s.pid)
        ]
        if dead:
            return f"engines gone: {dead}", f"engines gone: {dead}"
        unwell = [n for n, h in view.health.items() if h.phase != "ready"]
        if unwell or len(view.health) < self.s.agents:
            why = f"nodes not ready: {unwell or 'not all judged'}"
            return why, why
        routed = [await _routed(port) for port in self.router_ports]
        lacking: dict[str, str] = {}
        for model, desired in view.desired.items():
            ready = sum(
                1 for r in view.replicas.values() if r.model == model and r.phase == "ready"
            )
            if ready != desired.replicas:
                lacking[model] = f"{model}: {ready} of {desired.replicas} ready"
                continue
            for i, got in enumerate(routed):
                if isinstance(got, str):
                    lacking[model] = f"router {i}: {got}"
                elif got.get(model) != desired.replicas:
                    lacking[model] = f"router {i} routes {got.get(model)} of {model}'s {ready}"
        core = [why for model, why in lacking.items() if model != "canary"]
        return next(iter(lacking.values()), None), (core[0] if core else None)

    def _processes(self) -> dict[str, subprocess.Popen]:
        return {
            **{f"controller {n}": p for n, p in self.controllers.items()},
            **{f"router {n}": p for n, p in self.routers.items()},
            **{f"agent {n}": p for n, p in self.agents.items()},
        }

    async def stop(self) -> None:
        for pid in list(self.paused):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.paused.clear()
        for p in self._processes().values():
            if p.poll() is None:
                p.terminate()
        for p in self._processes().values():
            try:
                await anyio.to_thread.run_sync(p.wait, 35)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.bus is not None:
            await self.bus.close()
        for links in self.links.values():
            for link in links:
                await link.cut()
        self.cluster.stop()

    def engine_processes(self) -> dict[int, str]:
        """Fake engines of this run still running (their command line names its weights)."""
        weights = str(self.run / "weights")
        found = {}
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "llmgw.sim.fake_engine" in cmd and weights in cmd:
                found[p.info["pid"]] = cmd
        return found


async def _routed(port: int) -> dict[str, int] | str:
    """What a router's /metrics says it routes: model -> endpoints; or why it said nothing."""
    out: dict[str, int] = {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http,
            http.get(f"http://127.0.0.1:{port}/metrics") as r,
        ):
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"/metrics unanswered ({type(e).__name__})"
    for line in text.splitlines():
        if line.startswith("llmgw_router_endpoints{"):
            model = line.split('model="', 1)[1].split('"', 1)[0]
            out[model] = int(float(line.rsplit(" ", 1)[1]))
    return out


class Load:
    """Streaming clients through both routers, every request kept."""

    def __init__(self, fleet: Fleet, clock) -> None:
        self.fleet, self.clock = fleet, clock
        self.requests: list[Request] = []
        self.stopping = False

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=90, sock_connect=5)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            anyio.create_task_group() as tg,
        ):
            for i in range(2):
                for _ in range(self.fleet.s.clients):
                    tg.start_soon(self._client, http, i)

    async def _client(self, http: aiohttp.ClientSession, i: int) -> None:
        while not self.stopping:
            r = Request(id=uuid.uuid4().hex, router=i, start=self.clock())
            self.requests.append(r)
            body = {
                "model": SERVED["tiny"],
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "user": r.id,
            }
            url = f"http://127.0.0.1:{self.fleet.router_ports[i]}/v1/chat/completions"
            try:
                async with http.post(url, json=body) as resp:
                    r.status = resp.status
                    r.replica = resp.headers.get("x-llmgw-replica")
                    async for line in resp.content:
                        if line.strip() == b"data: [DONE]":
                            r.done = True
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                r.error = type(e).__name__
            r.end = self.clock()
            if not r.ok:
                await anyio.sleep(0.5)  # a router down: not thousands of refusals a second


class Chaos:
    def __init__(self, scenario: Scenario, run: Path) -> None:
        self.s = scenario
        self.rng = random.Random(scenario.seed)
        self.fleet = Fleet(run, scenario)
        self.t0 = time.monotonic()
        self.load = Load(self.fleet, self.clock)
        self.faults: list[Fault] = []
        self.canary = 1
        self.samples: list[tuple[float, str | None, str | None]] = []
        # kinds of fault not injected yet, in an order of the seed's: each comes once first
        self.not_yet = [k for k in KINDS if scenario.weights.get(k, 0) > 0]
        self.rng.shuffle(self.not_yet)

    def clock(self) -> float:
        return time.monotonic() - self.t0

    def log(self, text: str) -> None:
        print(f"[{self.clock():7.1f}] {text}", flush=True)

    async def run(self) -> dict:
        await self.fleet.start()
        self.log(f"fleet started in {self.fleet.run}")
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._sample)
            if (await self._whole_since(0.0, core=False))[0] is None:
                raise SystemExit(f"the fleet never became whole: {self.samples[-1]}")
            self.t0 = time.monotonic()
            self.samples.clear()
            self.log("fleet whole: load and faults begin")
            tg.start_soon(self.load.run)
            await anyio.sleep(3)
            while self.clock() < self.s.minutes * 60:
                await self._one_round()
                await anyio.sleep(self.rng.uniform(*self.s.gap_s))
            self.load.stopping = True
            await anyio.sleep(5)  # the last streams end
            report = await self._report()
            tg.cancel_scope.cancel()
        await self.fleet.stop()
        report["left_running"] = sorted(self.fleet.engine_processes())
        for pid in report["left_running"]:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        return report

    # --- faults ------------------------------------------------------------------------

    async def _one_round(self) -> None:
        fault = await self._inject(self._draw())
        if fault is None:
            return
        faults = [fault]
        if self.rng.random() < self.s.overlap:
            # another kind of process (never two servers at once: _inject says so)
            kinds = [k for k in KINDS if k.split()[1] != fault.kind.split()[1]]
            second = await self._inject(self._draw(kinds))
            if second is not None:
                fault.overlapped = second.overlapped = True
                faults.append(second)
        async with anyio.create_task_group() as tg:
            for f in faults:
                tg.start_soon(self._undo, f)
                if f.kind == "kill server":
                    tg.start_soon(self._canary_moves, f)
        last_end = max(f.ended for f in faults)
        # a round with a server's death is measured as the fleet it leaves, the canary's new
        # count (this run's own probe of the control plane) apart, as a change in effect: a
        # link cut beside it was charged the canary's placement and start (12.5 s)
        probed = any(f.kind == "kill server" for f in faults)
        for f in faults:
            f.measured_from = last_end
            f.ready, f.waited_for = await self._whole_since(last_end, core=probed)
            if f.kind == "kill server":
                in_effect, _ = await self._whole_since(f.start, core=False)
                if in_effect is not None:
                    f.change_in_effect_s = in_effect - f.start
            await self._after(f)
            self.log(
                f"{f.kind} {f.target}: whole again after "
                + (f"{f.whole_after_s:.1f} s" if f.whole_after_s is not None else "NEVER")
                + (f" (it lacked: {f.waited_for})" if f.waited_for else "")
            )
        await self._whole_since(self.clock(), core=False)  # all of it, before the next

    def _draw(self, among: list[str] | tuple[str, ...] = KINDS) -> str:
        """A kind not injected yet, in the seeded order, while there is one; then one drawn
        by the weights. A short run (CI's 3 minutes) so meets every kind once."""
        kinds = [k for k in among if self.s.weights.get(k, 0) > 0]
        first = [k for k in self.not_yet if k in kinds]
        if first:
            return first[0]
        return self.rng.choices(kinds, weights=[self.s.weights[k] for k in kinds])[0]

    async def _inject(self, kind: str) -> Fault | None:
        f = self.fleet
        verb, what = kind.split()[:2]
        now = self.clock()
        if verb == "cut":  # an agent's links
            node = self.rng.choice(sorted(f.agents))
            fault = Fault(kind, f"agent {node}", now)
            for link in f.links[node]:
                await link.cut()
            f.down.add(f"links of {node}")
        elif what == "server":
            if any(s.paused or not s.running for s in f.cluster.servers):
                return None  # never two servers at once
            i = self.rng.randrange(len(f.cluster.servers))
            server = f.cluster.servers[i]
            fault = Fault(kind, f"server {server.name}", now, pid=server.pid)
            if verb == "kill":
                f.cluster.kill(i)
                f.down.add(fault.target)
            else:
                f.cluster.pause(i)
                f.paused[server.pid or 0] = "server"
        elif what == "engine":
            try:
                engines = await f.engines()
            except BusError:
                return None
            live = [p for p in engines if p not in f.paused and psutil.pid_exists(p)]
            if not live:
                return None
            pid = self.rng.choice(sorted(live))
            fault = Fault(kind, f"engine {pid} ({engines[pid]})", now, pid=pid)
            if verb == "kill":
                os.kill(pid, signal.SIGKILL)
                fault.undo = now  # its agent starts another
            else:
                os.kill(pid, signal.SIGSTOP)
                f.paused[pid] = "engine"
        else:
            group = {"agent": f.agents, "controller": f.controllers, "router": f.routers}[what]
            name = self.rng.choice(sorted(group))
            proc = group[name]
            if proc.poll() is not None or proc.pid in f.paused:
                return None
            fault = Fault(kind, f"{what} {name}", now, pid=proc.pid)
            if what == "router":
                fault.router = int(name)
            if verb == "pause":
                os.kill(proc.pid, signal.SIGSTOP)
                f.paused[proc.pid] = what
            else:
                proc.send_signal(signal.SIGTERM if verb == "stop" else signal.SIGKILL)
                f.down.add(fault.target)
        self.faults.append(fault)
        if kind in self.not_yet:
            self.not_yet.remove(kind)
        self.log(f"{kind} {fault.target}")
        return fault

    async def _undo(self, fault: Fault) -> None:
        f = self.fleet
        verb, what = fault.kind.split()[:2]
        if fault.kind == "kill engine":
            return
        if verb == "pause":
            await anyio.sleep(self.rng.uniform(*self.s.pause_s))
            if fault.pid is not None:
                os.kill(fault.pid, signal.SIGCONT)
                f.paused.pop(fault.pid, None)
                if what == "server":
                    for s in f.cluster.servers:
                        s.paused = False
        elif verb == "cut":
            await anyio.sleep(self.rng.uniform(*self.s.cut_s))
            node = fault.target.split()[-1]
            for link in f.links[node]:
                await link.heal()
            f.down.discard(f"links of {node}")
        else:
            await anyio.sleep(self.rng.uniform(*self.s.down_s))
            name = fault.target.split()[-1]
            if what == "server":  # waits for its port: not on the loop the load runs on
                await anyio.to_thread.run_sync(f.cluster.start, f.cluster.index(name))
            elif what == "agent":
                await anyio.to_thread.run_sync(f.agents[name].wait)
                f.start_agent(name)
            elif what == "controller":
                await anyio.to_thread.run_sync(f.controllers[name].wait)
                f.start_controller(name)
            elif what == "router":
                await anyio.to_thread.run_sync(f.routers[int(name)].wait)  # a stop drains
                f.start_router(int(name))
            f.down.discard(fault.target)
        fault.undo = self.clock()

    async def _after(self, fault: Fault) -> None:
        """What a fault of its kind measures once the fleet is whole again."""
        if fault.kind == "kill engine":
            model, rid = fault.target.split("(", 1)[1].split()[:2]
            fault.engine_start_s = await self._engine_start(fault, model, rid)
        elif fault.kind == "kill controller":
            fault.leader_s = await self._leader_after(fault)

    async def _engine_start(self, fault: Fault, model: str, rid: str | None) -> float | None:
        """An engine started since the fault for `model` (`rid`): its own start, from its
        process's birth to its shard's ready (both wall clocks); None: none started."""
        killed_at = time.time() - (self.clock() - fault.start)
        try:
            view = await self.fleet.records()
        except BusError:
            return None
        starts = []
        for s in view.shards.values():
            if s.model != model or rid not in (None, s.rid) or not s.pid or s.phase != "ready":
                continue
            try:
                born = psutil.Process(s.pid).create_time()
            except psutil.NoSuchProcess:
                continue
            if born >= killed_at - 1:  # the replacement, not an engine from before
                starts.append(max(0.0, s.since - born))
        return max(starts) if starts else None

    async def _leader_after(self, fault: Fault) -> float | None:
        """Seconds from a controller's death until a controller leads: 0 when another led
        throughout; else when the leader key was taken over (its `since`, wall clock)."""
        killed = fault.target.split()[-1]
        died_at = time.time() - (self.clock() - fault.start)
        deadline = self.clock() + 60
        while self.clock() < deadline:
            with contextlib.suppress(BusError):
                leader = (await self.fleet.records()).leader
                if leader is not None and leader.since > died_at:
                    return leader.since - died_at
                if leader is not None and leader.holder != killed:
                    return 0.0
            await anyio.sleep(0.25)
        return None

    async def _canary_moves(self, fault: Fault) -> None:
        """A cluster server just died: ask for another count of the canary; the seconds
        until the controller writes its placement (a replica placed or drained) are the
        fault's `control_plane_s`."""
        fault.control_plane_s = await self._placed_after(fault.start)

    async def _placed_after(self, killed_at: float) -> float | None:
        assert self.fleet.bus is not None
        bus = self.fleet.bus
        self.canary = 2 if self.canary == 1 else 1
        want = records.Desired(model="canary", replicas=self.canary, updated_at=time.time())
        while self.clock() - killed_at < 60:
            try:
                await bus.put(keys.desired("canary"), want)
                break
            except BusError:
                await anyio.sleep(0.1)
        while self.clock() - killed_at < 60:
            try:
                view = await self.fleet.records()
                live = [
                    r
                    for r in view.replicas.values()
                    if r.model == "canary" and r.phase not in ("draining", "stopped")
                ]
                if len(live) == self.canary:
                    return self.clock() - killed_at
            except BusError:
                pass
            await anyio.sleep(0.1)
        return None

    async def _sample(self) -> None:
        """What the fleet lacks, looked at every 0.25 s for the whole run: (time, with the
        canary, without it)."""
        while True:
            lacks = await self.fleet.lacks()
            self.samples.append((self.clock(), *lacks))
            await anyio.sleep(0.25)

    async def _whole_since(self, since: float, *, core: bool) -> tuple[float | None, str]:
        """The first time at or after `since` the fleet was whole (`core`: the canary aside),
        and what it lacked longest meanwhile; (None, ...) when not within settle_s."""
        lacked: Counter[str] = Counter()
        seen = 0
        while True:
            for t, everything, without in self.samples[seen:]:
                seen += 1
                if t < since:
                    continue
                why = without if core else everything
                if why is None:
                    return t, lacked.most_common(1)[0][0] if lacked else ""
                lacked[why.split(":")[0]] += 1
            if self.clock() > since + self.s.settle_s:
                worst = lacked.most_common(1)[0][0] if lacked else ""
                self.log(f"not whole within {self.s.settle_s:.0f} s: {worst}")
                return None, worst
            await anyio.sleep(0.1)

    # --- the report ----------------------------------------------------------------------

    def _read_by(self) -> dict[str, list[int]]:
        """Request id -> the engine pids that read it."""
        read: dict[str, list[int]] = defaultdict(list)
        with contextlib.suppress(FileNotFoundError):
            for line in self.fleet.requests_log.read_text().splitlines():
                rid, _, pid = line.partition(" ")
                if rid and pid.isdigit():
                    read[rid].append(int(pid))
        return read

    def explain(self, r: Request, read_by: dict[str, list[int]]) -> Fault | None:
        """The fault that explains a failed request, or None."""
        for f in self.faults:
            end = f.ready or f.undo or f.start
            if f.kind in ("kill engine", "pause engine") and f.pid in read_by.get(r.id, ()):
                if f.start <= r.end and r.start <= end:
                    return f
            if f.router == r.router and f.start <= r.end and r.start <= end + 1.0:
                if f.kind == "stop router" and r.start < f.start:
                    continue  # a router told to stop finishes what it holds
                return f
        return None

    async def _report(self) -> dict:
        read_by = self._read_by()
        failed = [r for r in self.load.requests if not r.ok and r.end]
        explained: Counter[str] = Counter()
        unexplained = []
        for r in failed:
            f = self.explain(r, read_by)
            if f is None:
                unexplained.append(asdict(r))
            else:
                explained[f.kind] += 1
        twice = sorted(rid for rid, pids in read_by.items() if len(pids) > 1)
        checks = await self._final_checks()
        by_kind: dict[str, dict] = {}
        for kind in KINDS:
            mine = [f for f in self.faults if f.kind == kind]
            times = [f.whole_after_s for f in mine if f.whole_after_s is not None]
            by_kind[kind] = {
                "faults": len(mine),
                "whole_again_s": _spread(times),
                "never_whole": sum(1 for f in mine if f.ready is None),
            }
        writes = [f.control_plane_s for f in self.faults if f.kind == "kill server"]
        in_effect = [
            f.change_in_effect_s
            for f in self.faults
            if f.change_in_effect_s is not None and not math.isnan(f.change_in_effect_s)
        ]
        leaders = [f.leader_s for f in self.faults if f.leader_s is not None]
        engine_starts = [f.engine_start_s for f in self.faults if f.engine_start_s is not None]
        slow = [
            {
                "kind": f.kind,
                "target": f.target,
                "whole_after_s": f.whole_after_s,
                "waited_for": f.waited_for,
            }
            for f in self.faults
            if f.whole_after_s is None or f.whole_after_s > WHOLE_AGAIN_S
        ]
        goals = {
            "no failure unexplained": not unexplained,
            "no request sent to two engines": not twice,
            "the control plane writes within 10 s of a server's death": all(
                w is not None and w <= WRITES_AGAIN_S for w in writes
            ),
            "whole within 10 s of each fault (besides an engine's start)": not slow,
            "no duplicate replica": checks["duplicate_replicas"] == 0,
            "no leaked engine": checks["leaked_engines"] == 0,
            "no unreadable key": checks["unreadable_keys"] == 0,
        }
        return {
            "scenario": {**asdict(self.s)},
            "seconds": round(self.clock(), 1),
            "requests": len(self.load.requests),
            "ok": sum(1 for r in self.load.requests if r.ok),
            "failed": len(failed),
            "explained": dict(explained),
            "unexplained": unexplained,
            "sent_twice": twice,
            "faults": [asdict(f) | {"whole_after_s": f.whole_after_s} for f in self.faults],
            "by_kind": by_kind,
            "control_plane_writes_after_server_death_s": _spread([w for w in writes if w]),
            "control_plane_never_wrote": sum(1 for w in writes if w is None),
            "change_in_effect_after_server_death_s": _spread(in_effect),
            "leader_again_after_controller_death_s": _spread(leaders),
            "engine_start_s": _spread(engine_starts),
            "slow": slow,
            **checks,
            "goals": goals,
            "passed": all(goals.values()),
        }

    async def _final_checks(self) -> dict:
        """Once the load has stopped and the fleet is whole: duplicate replicas, engines no
        shard names, keys that do not read."""
        await self._whole_since(self.clock(), core=False)
        view = await self.fleet.records()
        duplicates = 0
        for model, desired in view.desired.items():
            placed = [r for r in view.replicas.values() if r.model == model]
            duplicates += max(0, len(placed) - desired.replicas)
        named = {s.pid for s in view.shards.values() if s.pid}
        running = self.fleet.engine_processes()
        per_rid = Counter(s.rid for s in view.shards.values())
        duplicates += sum(n - 1 for n in per_rid.values() if n > 1)
        return {
            "duplicate_replicas": duplicates,
            "leaked_engines": len(set(running) - named),
            "leaked": sorted(set(running) - named),
            "unreadable_keys": len(view.unreadable),
            "unreadable": sorted(view.unreadable),
        }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "n": len(values),
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def summary(report: dict) -> str:
    """The report as a person reads it."""
    lines = [
        f"chaos run, seed {report['scenario']['seed']}, {report['seconds'] / 60:.1f} minutes: "
        f"{report['requests']} requests, {report['ok']} whole, {report['failed']} failed "
        f"({sum(report['explained'].values())} explained by a fault, "
        f"{len(report['unexplained'])} not)",
        "  failures explained: "
        + (", ".join(f"{k} {n}" for k, n in sorted(report["explained"].items())) or "none"),
        f"  sent to two engines: {len(report['sent_twice'])}",
        "  faults, and seconds from each fault's end (two overlapping: the later one's) to a"
        " whole fleet (min/median/max):",
    ]
    for kind, row in report["by_kind"].items():
        if row["faults"]:
            t = row["whole_again_s"]
            span = f"{t['min']}/{t['median']}/{t['max']}" if t else "-"
            never = f", {row['never_whole']} never" if row["never_whole"] else ""
            lines.append(f"    {kind:<18} {row['faults']:>3}  {span}{never}")
    for name, key in (
        (
            "control plane's next write after a server's death",
            "control_plane_writes_after_server_death_s",
        ),
        (
            "...and the new count served by both routers",
            "change_in_effect_after_server_death_s",
        ),
        ("a controller leads again after one's death", "leader_again_after_controller_death_s"),
        ("a replacement engine's own start", "engine_start_s"),
    ):
        t = report[key]
        if t:
            lines.append(f"  {name}: {t['min']}/{t['median']}/{t['max']} s ({t['n']})")
    lines.append(
        f"  duplicate replicas {report['duplicate_replicas']}, leaked engines "
        f"{report['leaked_engines']}, unreadable keys {report['unreadable_keys']}, engines left "
        f"running after the stop {len(report['left_running'])}"
    )
    for f in report["slow"]:
        lines.append(
            f"  slow: {f['kind']} {f['target']}: {f['whole_after_s']} s ({f['waited_for']})"
        )
    for goal, ok in report["goals"].items():
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {goal}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", type=Path, help="a TOML file of Scenario's keys")
    parser.add_argument("--minutes", type=float, help="how long faults are drawn")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--report", type=Path, help="write the whole report here (JSON)")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    args = parser.parse_args()
    scenario = Scenario.read(args.scenario) if args.scenario else Scenario()
    if args.minutes is not None:
        scenario.minutes = args.minutes
    if args.seed is not None:
        scenario.seed = args.seed
    run = Path(tempfile.mkdtemp(prefix="llmgw-chaos-"))
    try:
        report = asyncio.run(_run(scenario, run))
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(run, ignore_errors=True)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    print(summary(report))
    return 0 if report["passed"] else 1


async def _run(scenario: Scenario, run: Path) -> dict:
    chaos = Chaos(scenario, run)
    try:
        return await chaos.run()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await chaos.fleet.stop()
            for pid in chaos.fleet.engine_processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()
        raise


if __name__ == "__main__":
    sys.exit(main())
