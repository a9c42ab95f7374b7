"""Who waits when the fleet is full, through 3 routers, each figure beside its goal (issue 40).

    .venv/bin/python bench/priority.py               # every section (about 5 minutes)
    .venv/bin/python bench/priority.py vllm slots    # some sections

Three `llmgw router --nats` processes on one nats-server serve one model, placed (its
replica and shard records written as the controller and agent would) on one fake engine
(llmgw/sim/fake_engine.py) that behaves as the real one does under load; clients in this
process spread their requests over the three routers, round robin, as a load balancer does.
Every request has a first token after 200 ms and then 1 to 31 tokens (16 on average) at 40
a second; the profile's `parallel` is the engine's.

- vllm:  the vLLM-like engine, continuous batching up to --max-num-seqs 32 (what it runs
         at once; beyond, requests wait in its queue). Critical requests alone (team web,
         a critical key), then with sheddable ones (team batch) at twice the engine's
         capacity for BENCH_LOADED_S, then the sheddable stop and what waits drains. Goals:
         the critical class's TTFT p99 at most 1.5x its unloaded p99 (llm-d: 3.4x); every
         sheddable request not refused completes; engine slots idle while requests wait at
         most 1% of the time. The same load through routers without their queue
         (`--no-queue`) is shown beside, as llm-d shows its unprotected figure.
- slots: the llama-server-like engine, 4 slots (-np 4) with requests beyond them deferred;
         the same phases. Goal: the critical TTFT p99 at most its unloaded p99 plus one
         slot's time (a request's whole time on a slot: the longest a critical request
         waits for one to free).
- fair:  10 teams of equal weight on the vLLM-like engine (--max-num-seqs 32), each
         sending from its own clients one request after another, one team with 10 times
         the clients of the others. Goal: Jain's fairness index over the tokens each team
         was served (the engines' own usage) at least 0.95.

The share of the engine each router may use is split between them by what they publish in
`load.<router>` (docs/router.md): the figure "over capacity" is the most the engine held
beyond its capacity at any sample (the routers' disagreement while shares move, bounded by
the share that moved).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmgw import catalog  # noqa: E402
from llmgw.bus import keys, records  # noqa: E402
from llmgw.bus.client import BucketSettings, Bus, NatsSettings  # noqa: E402
from llmgw.bus.counters import ensure_streams  # noqa: E402
from llmgw.bus.server import EmbeddedNats, free_port  # noqa: E402
from llmgw.gateway import credentials  # noqa: E402
from llmgw.sim.fake_engine import write_fake_gguf  # noqa: E402

PY = sys.executable
ROUTERS = int(os.environ.get("BENCH_ROUTERS", "3"))
FIRST_TOKEN_S = 0.2
TOKENS = 16  # on average
TOKEN_RATE = 40.0  # a request holds its slot 0.2 + 16/40 = 0.6 s on average
SERVICE_S = FIRST_TOKEN_S + TOKENS / TOKEN_RATE
LOADED_S = float(os.environ.get("BENCH_LOADED_S", "30"))
UNLOADED_S = float(os.environ.get("BENCH_UNLOADED_S", "30"))
SERVED = "bench"
PROMPT = "tell me about the fleet " * 8  # about 50 tokens


# --- the fleet ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}


def _wait_http(url: str, proc: subprocess.Popen, path: str = "/health") -> None:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection(parts.hostname, parts.port, timeout=1)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{proc.args} not ready at {url}")


@contextlib.contextmanager
def _process(argv: list[str], url: str, env: dict[str, str], log: Path):
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(url, proc)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Engine:
    kind: str  # "vllm" | "llama-server"
    capacity: int
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self, tmp: Path) -> list[str]:
        base = [PY, "-m", "llmgw.sim.fake_engine"]
        if self.kind == "vllm":
            model = tmp / "model"
            model.mkdir(exist_ok=True)
            (model / "config.json").write_text("{}")
            return [*base, "vllm", "serve", str(model), "--served-model-name", SERVED] + [
                "--port",
                str(self.port),
                "--max-num-seqs",
                str(self.capacity),
            ]
        gguf = write_fake_gguf(tmp / "model.gguf")
        return [*base, "llama-server", "-m", str(gguf), "-a", SERVED, "--metrics"] + [
            "--port",
            str(self.port),
            "-np",
            str(self.capacity),
        ]

    def model(self) -> catalog.Model:
        return catalog.validate_models(
            {
                "models": [
                    {
                        "id": "m",
                        "served_name": SERVED,
                        "profiles": [
                            {
                                "name": "p",
                                "engine": self.kind,
                                "weights": {"path": "/models/m"},
                                "gpus_per_node": 0 if self.kind == "llama-server" else 1,
                                "parallel": self.capacity,
                            }
                        ],
                    }
                ]
            }
        )[0]


async def _fill(url: str, engine: Engine, teams: dict[str, dict]) -> dict[str, str]:
    """The bucket: the model placed on the engine, the teams and a key for each; the keys'
    secrets by team."""
    bus = await Bus.connect(
        NatsSettings(urls=(url,), name="bench"), BucketSettings(), give_up_after=10
    )
    try:
        await ensure_streams(bus)
        model = engine.model()
        await bus.put(keys.catalog("m"), catalog.encode_model(model))
        endpoint = f"127.0.0.1:{engine.port}"
        await bus.put(
            keys.replica("m", "r1"),
            records.Replica(
                model="m",
                rid="r1",
                profile="p",
                members=[records.ReplicaMember(node="n1", rank=0, port=engine.port)],
                phase="ready",
                endpoint=endpoint,
            ),
        )
        await bus.put(
            keys.shard("n1", "r1"),
            records.Shard(
                node="n1",
                rid="r1",
                model="m",
                generation=1,
                phase="ready",
                since=time.time(),
                endpoint=endpoint,
                served_name=SERVED,
            ),
        )
        secrets = {}
        for team, fields in teams.items():
            await bus.put(keys.team(team), records.Team(team=team, **fields))
            secret = credentials.new_secret(team)
            key = records.ApiKey(name=team, team=team, secrets=[credentials.hash_secret(secret)])
            await bus.put(keys.apikey(team), key)
            secrets[team] = secret
        return secrets
    finally:
        await bus.close()


@contextlib.contextmanager
def fleet(tmp: Path, engine: Engine, teams: dict[str, dict], *router_args: str):
    """nats-server, the engine, the bucket, and ROUTERS routers: (router URLs, secrets)."""
    server = EmbeddedNats(data_dir=tmp / "nats", port=free_port())
    server.start()
    try:
        env = {**_env(), "FAKE_ENGINE_FIRST_TOKEN_SECONDS": str(FIRST_TOKEN_S)}
        env |= {"FAKE_ENGINE_TOKENS": str(2 * TOKENS), "FAKE_ENGINE_TOKEN_RATE": str(TOKEN_RATE)}
        with contextlib.ExitStack() as stack:
            stack.enter_context(_process(engine.argv(tmp), engine.url, env, tmp / "engine.log"))
            secrets = anyio.run(_fill, server.url, engine, teams)
            urls = []
            for n in range(ROUTERS):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                argv = [PY, "-m", "llmgw.cli", "--log-level", "WARNING", "router"]
                argv += ["--nats", server.url, "--listen", f"127.0.0.1:{port}"]
                argv += ["--router-id", f"r{n}", *router_args]
                stack.enter_context(_process(argv, url, _env(), tmp / f"router-{n}.log"))
                urls.append(url)
            yield urls, secrets
    finally:
        server.stop()


# --- clients -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    team: str
    start: float
    status: int = 0
    ttft: float | None = None
    tokens: int = 0  # prompt and completion, the engine's usage
    refused: str | None = None
    error: str | None = None


class Clients:
    def __init__(self, urls: list[str], secrets: dict[str, str]) -> None:
        self.urls = urls
        self.secrets = secrets
        self.outcomes: list[Outcome] = []
        self._next = 0
        self.http: aiohttp.ClientSession | None = None
        self.rng = random.Random(7)

    def _url(self) -> str:
        self._next += 1
        return self.urls[self._next % len(self.urls)]

    async def one(self, team: str, stream: bool) -> Outcome:
        assert self.http is not None
        out = Outcome(team, time.monotonic())
        self.outcomes.append(out)
        body = {
            "model": SERVED,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": stream,
            # answers of different lengths, as a fleet's are (16 on average): with one
            # length, places would free in waves instead of one at a time
            "max_tokens": self.rng.randint(1, 2 * TOKENS - 1),
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"authorization": f"Bearer {self.secrets[team]}"}
        try:
            async with self.http.post(
                f"{self._url()}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.refused = resp.headers.get("x-llmgw-refused")
                    await resp.read()
                    return out
                if not stream:
                    usage = (await resp.json())["usage"]
                    out.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
                    return out
                async for line in resp.content:
                    if (
                        out.ttft is None
                        and line.startswith(b"data: {")
                        and b'"content": "tok' in line
                    ):
                        out.ttft = time.monotonic() - out.start
                    if line.startswith(b"data: {") and b'"usage"' in line:
                        usage = json.loads(line[6:])["usage"]
                        if usage:
                            out.tokens = usage["prompt_tokens"] + usage["completion_tokens"]
        except aiohttp.ClientError as e:
            out.error = repr(e)
        return out

    async def open_loop(self, team: str, rate: float, seconds: float, stream: bool) -> None:
        """Poisson arrivals at `rate` a second for `seconds`, each its own task."""
        rng = random.Random(hash(team))
        end = time.monotonic() + seconds
        async with anyio.create_task_group() as tg:
            while time.monotonic() < end:
                tg.start_soon(self.one, team, stream)
                await anyio.sleep(rng.expovariate(rate))

    async def closed_loop(self, team: str, clients: int, stop: anyio.Event) -> None:
        async def client() -> None:
            while not stop.is_set():
                await self.one(team, False)

        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(client)


async def _gauges(
    http: aiohttp.ClientSession, url: str, *groups: tuple[str, ...]
) -> tuple[float, ...]:
    """The sum of each group's gauges, from one read of `url`'s /metrics."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    totals = [0.0] * len(groups)
    for line in text.splitlines():
        for i, names in enumerate(groups):
            if line.startswith(names):
                totals[i] += float(line.rsplit(" ", 1)[-1])
    return tuple(totals)


async def _gauge(http: aiohttp.ClientSession, url: str, *names: str) -> float:
    return (await _gauges(http, url, names))[0]


# how often the sampler reads the engine and the routers (an idle slot is seen only in a
# sample: a shorter interval counts the short gaps between a request's end and the next's
# start more exactly)
SAMPLE_S = float(os.environ.get("BENCH_SAMPLE_S", "0.1"))


class Sampler:
    """Every SAMPLE_S: what the engine runs and makes wait (its /metrics), and what waits at
    the routers (their llmgw_router_queued)."""

    def __init__(self, engine: Engine, urls: list[str]) -> None:
        self.engine = engine
        self.urls = urls
        self.idle_while_waiting = 0.0  # idle slots x samples, in samples where some wait
        self.samples = 0
        self.over = 0  # the most the engine held past its capacity
        self.overcommitted = 0  # samples in which requests waited in the engine's own queue
        self.critical_wait = (0.0, 0)  # the routers' p99 of critical waits, and how many

    async def run(self, http: aiohttp.ClientSession, stop: anyio.Event) -> None:
        running = ("vllm:num_requests_running", "llamacpp:requests_processing")
        waiting = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")
        while not stop.is_set():
            # all at once: what the engine runs and what waits at the routers, at one moment
            (r, w), *queues = await asyncio.gather(
                _gauges(http, self.engine.url, running, waiting),
                *(_gauge(http, url, "llmgw_router_queued{") for url in self.urls),
            )
            queued = sum(queues)
            self.samples += 1
            self.over = max(self.over, int(r + w) - self.engine.capacity)
            self.overcommitted += w > 0
            if queued > 0:
                self.idle_while_waiting += max(0.0, self.engine.capacity - r)
            await anyio.sleep(SAMPLE_S)

    @property
    def idle_fraction(self) -> float:
        return self.idle_while_waiting / max(1, self.samples * self.engine.capacity)


async def _queue_wait_p99(urls: list[str], cls: str) -> tuple[float, int]:
    """The routers' own histogram of waits in their queue for `cls`, summed: its p99 (the
    bucket's upper bound) and how many requests."""
    buckets: dict[float, float] = {}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("llmgw_router_queue_wait_seconds_bucket{") and (
                    f'class="{cls}"' in line
                ):
                    le = line.split('le="')[1].split('"')[0]
                    bound = float("inf") if le == "+Inf" else float(le)
                    buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[-1])
    total = buckets.get(float("inf"), 0.0)
    for bound in sorted(buckets):
        if buckets[bound] >= 0.99 * total:
            return bound, int(total)
    return float("nan"), int(total)


def _p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def _ttfts(outcomes: list[Outcome], team: str, since: float = 0.0) -> list[float]:
    return [o.ttft for o in outcomes if o.team == team and o.ttft is not None and o.start >= since]


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# --- sections ----------------------------------------------------------------------------------

PROTECT_TEAMS = {"web": {"priority": "critical"}, "batch": {"priority": "sheddable"}}


async def _phases(
    urls: list[str], secrets: dict[str, str], engine: Engine, critical_rate: float, loaded_s: float
) -> tuple[Clients, Sampler, float]:
    """Critical alone, then with sheddable at twice the engine's capacity, then the drain."""
    clients = Clients(urls, secrets)
    sampler = Sampler(engine, urls)
    capacity_rate = engine.capacity / SERVICE_S
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        clients.http = http
        for _ in urls:  # each router has read the bucket and routes (round robin)
            while (await clients.one("web", False)).status != 200:
                await anyio.sleep(0.2)
        clients.outcomes.clear()
        await clients.open_loop("web", critical_rate, UNLOADED_S, True)
        loaded_from = time.monotonic()
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler.run, http, stop)
            async with anyio.create_task_group() as load:
                load.start_soon(clients.open_loop, "batch", 2 * capacity_rate, loaded_s, False)
                load.start_soon(clients.open_loop, "web", critical_rate, loaded_s, True)
            stop.set()  # (the open loops end with their last requests answered: drained)
    sampler.critical_wait = await _queue_wait_p99(urls, "critical")
    return clients, sampler, loaded_from


def _report_protection(
    name: str, engine: Engine, clients: Clients, sampler: Sampler, loaded_from: float, goal
) -> None:
    out = clients.outcomes
    unloaded = _p99([o.ttft for o in out if o.team == "web" and o.start < loaded_from and o.ttft])
    loaded = _p99(_ttfts(out, "web", loaded_from))
    n_un = sum(1 for o in out if o.team == "web" and o.start < loaded_from)
    n_lo = sum(1 for o in out if o.team == "web" and o.start >= loaded_from)
    batch = [o for o in out if o.team == "batch"]
    refused = [o for o in batch if o.status in (429, 503)]
    completed = [o for o in batch if o.status == 200]
    lost = [o for o in batch if o not in refused and o not in completed]
    critical_refused = sum(1 for o in out if o.team == "web" and o.status != 200)
    limit, goal_text = goal(unloaded)
    print(f"\n{name} (capacity {engine.capacity}, {ROUTERS} routers)")
    print(f"  critical TTFT p99 unloaded {unloaded * 1000:.0f} ms ({n_un} requests)")
    waited, n = sampler.critical_wait
    print(f"  critical requests' wait in the routers' queues: p99 at most {waited:g} s ({n})")
    print(
        f"  critical TTFT p99 with sheddable at 2x capacity {loaded * 1000:.0f} ms "
        f"({n_lo} requests, {critical_refused} refused) = {loaded / unloaded:.2f}x unloaded; "
        f"goal {goal_text}: {_verdict(loaded <= limit)}"
    )
    print(
        f"  sheddable: {len(batch)} sent, {len(completed)} completed, {len(refused)} refused "
        f"({', '.join(sorted({str(o.refused) for o in refused})) or '-'}), {len(lost)} lost; "
        f"goal every one not refused completes: {_verdict(not lost)}"
    )
    if lost:
        print(f"    e.g. {lost[0]}")
    print(
        f"  engine slots idle while requests waited: {sampler.idle_fraction * 100:.2f}% of the "
        f"slot-time ({sampler.samples} samples); goal at most 1%: "
        f"{_verdict(sampler.idle_fraction <= 0.01)}"
    )
    print(
        f"  the most the engine held past its capacity: {sampler.over} (requests waited in "
        f"its own queue in {sampler.overcommitted * 100 / max(1, sampler.samples):.0f}% of "
        "the samples)"
    )


async def _unprotected(
    urls: list[str], secrets: dict[str, str], engine: Engine, rate: float, seconds: float
) -> float:
    clients = Clients(urls, secrets)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        clients.http = http
        capacity_rate = engine.capacity / SERVICE_S
        with anyio.move_on_after(seconds + 10):  # the engine's queue is not waited out
            async with anyio.create_task_group() as load:
                load.start_soon(clients.open_loop, "batch", 2 * capacity_rate, seconds, False)
                load.start_soon(clients.open_loop, "web", rate, seconds, True)
    return _p99(_ttfts(clients.outcomes, "web"))


def _protection(tmp: Path, engine: Engine, critical_rate: float, goal) -> None:
    name = {"vllm": "vLLM-like", "llama-server": "llama-server-like"}[engine.kind]
    with fleet(tmp / "on", engine, PROTECT_TEAMS) as (urls, secrets):
        clients, sampler, loaded_from = anyio.run(
            _phases, urls, secrets, engine, critical_rate, LOADED_S
        )
    _report_protection(name, engine, clients, sampler, loaded_from, goal)
    bare = Engine(engine.kind, engine.capacity)
    seconds = min(LOADED_S, 10.0)
    with fleet(tmp / "off", bare, PROTECT_TEAMS, "--no-queue") as (urls, secrets):
        p99 = anyio.run(_unprotected, urls, secrets, bare, critical_rate, seconds)
    print(
        f"  without the routers' queue (--no-queue), {seconds:g} s of the same load: critical "
        f"TTFT p99 {p99 * 1000:.0f} ms"
    )


def section_vllm(tmp: Path) -> None:
    engine = Engine("vllm", 32)
    _protection(tmp, engine, 4.0, lambda u: (1.5 * u, f"at most 1.5x ({1.5 * u * 1000:.0f} ms)"))


def section_slots(tmp: Path) -> None:
    engine = Engine("llama-server", 4)
    _protection(
        tmp,
        engine,
        1.0,
        lambda u: (
            u + SERVICE_S,
            f"at most unloaded + one slot's time {SERVICE_S:.2f} s ({(u + SERVICE_S) * 1000:.0f} ms)",
        ),
    )


def section_fair(tmp: Path) -> None:
    engine = Engine("vllm", 32)
    teams = {f"t{n}": {} for n in range(10)}
    seconds = float(os.environ.get("BENCH_FAIR_S", "30"))

    async def run(urls: list[str], secrets: dict[str, str]) -> Clients:
        clients = Clients(urls, secrets)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            clients.http = http
            for team in teams:
                while (await clients.one(team, False)).status != 200:
                    await anyio.sleep(0.2)
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                for team in teams:
                    tg.start_soon(clients.closed_loop, team, 100 if team == "t0" else 10, stop)
                await anyio.sleep(5)  # the queues fill, the counters start even
                clients.outcomes.clear()
                await anyio.sleep(seconds)
                stop.set()
                measured = list(clients.outcomes)
        clients.outcomes = measured
        return clients

    def served(clients: Clients) -> tuple[float, int, float, list[int]]:
        by_team = {t: sum(o.tokens for o in clients.outcomes if o.team == t) for t in teams}
        xs = list(by_team.values())
        jain = sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0
        light = statistics.mean(by_team[t] for t in teams if t != "t0")
        return jain, by_team["t0"], light, xs

    print(f"\nfairness: 10 teams of weight 1 on the vLLM-like engine (capacity {engine.capacity})")
    with fleet(tmp / "fair", engine, teams) as (urls, secrets):
        jain, heavy, light, xs = served(anyio.run(run, urls, secrets))
    print(
        f"  tokens served in {seconds:g} s: the team with 10x the clients {heavy}, the others "
        f"{light:.0f} on average (min {min(xs)}, max {max(xs)})"
    )
    print(f"  Jain's index {jain:.3f}; goal at least 0.95: {_verdict(jain >= 0.95)}")
    bare = Engine(engine.kind, engine.capacity)
    with fleet(tmp / "fair-off", bare, teams, "--no-queue") as (urls, secrets):
        jain, heavy, light, _ = served(anyio.run(run, urls, secrets))
    print(
        f"  without the routers' queue (--no-queue): the team with 10x the clients {heavy}, "
        f"the others {light:.0f} on average; Jain's index {jain:.3f}"
    )


SECTIONS = {"vllm": section_vllm, "slots": section_slots, "fair": section_fair}


def main() -> None:
    chosen = sys.argv[1:] or list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; sections: {', '.join(SECTIONS)}")
    print(
        f"bench/priority.py: {ROUTERS} routers, first token after {FIRST_TOKEN_S * 1000:.0f} ms "
        f"then {TOKENS} tokens at {TOKEN_RATE:g}/s ({SERVICE_S:.2f} s on a slot); "
        f"load {LOADED_S:g} s, unloaded {UNLOADED_S:g} s; load average {os.getloadavg()[0]:.1f}"
    )
    keep = os.environ.get("BENCH_TMP")  # a directory to keep the logs in
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            section = Path(tmp) / name
            section.mkdir()
            SECTIONS[name](section)


if __name__ == "__main__":
    main()
