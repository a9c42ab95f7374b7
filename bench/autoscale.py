"""Autoscaling measured end to end, each figure beside its baseline from the same run.

    .venv/bin/python bench/autoscale.py             # everything (about 4 minutes)
    .venv/bin/python bench/autoscale.py step cold   # some sections

A real nats-server, three agent processes on recorded hosts (one loopback address each)
running the fake engine as llama-server (tests/autoscale_fleet.py, shared with
tests/test_autoscale_e2e.py), a leading controller and a router (both in this process, as in
the tests), and streaming clients. Every stream is 10 tokens at 10 a second (a second per
request); an engine "loads" for LOAD_S before it answers /health. Windows are short so that
one run fits in minutes: target 5 in flight per replica, scale up after 3 s, down after 10 s
(the defaults are 10 s and 300 s).

Sections:
- step:  1 stream, then 50 at once: the time until the first and the last new replica answer
         a request, against one engine's own start (process to first token, started directly
         here); requests failed during the step; the most replicas counted against the 10 the
         load asks for (overshoot); then 20 s (two down windows) at 50: changes of count;
- day:   a day-shaped load over 120 s (2 streams at night, a sine-squared rise to 50 at midday
         and back): replica-seconds held against a fixed fleet of 10 (peak-sized) over the same
         trace, requests failed, changes of count;
- cold:  a model scaled to zero (idle 3 s) gets one streamed request: its time to first token,
         against the engine's own time from process start to first token, started directly;
         three rounds, alternating; the difference is llmgw's overhead.

The controller, the router, the clients and every engine share this machine's cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the fleet the end-to-end tests run

import aiohttp  # noqa: E402
import anyio  # noqa: E402
from agent_helpers import NODES, start_agents, stop_agents  # noqa: E402
from autoscale_fleet import (  # noqa: E402
    Phases,
    Streams,
    autoscaled_model,
    controller_settings,
    replicas_of,
    serve_auto,
)
from port_helpers import free_port_run  # noqa: E402
from router_helpers import router_settings, running_router  # noqa: E402

from llmgw.bus import keys, records  # noqa: E402
from llmgw.bus.client import Bus, NatsSettings, decoder  # noqa: E402
from llmgw.bus.server import EmbeddedNats, free_port  # noqa: E402
from llmgw.controller.loop import Controller  # noqa: E402
from llmgw.sim.fake_engine import install_fake_engines  # noqa: E402

LOAD_S = 1.0  # the fake engine's load time (FAKE_ENGINE_LOAD_SECONDS)
COLD_LOAD_S = 2.0
STREAM = {"FAKE_ENGINE_TOKENS": "10", "FAKE_ENGINE_TOKEN_RATE": "10"}
POLICY = {
    "min_replicas": 1,
    "max_replicas": 16,
    "target_in_flight": 5,
    "scale_up_after": 3,
    "scale_down_after": 10,
}
PEAK = 50
PEAK_REPLICAS = math.ceil(PEAK / POLICY["target_in_flight"])
DAY_S = 120.0


async def wait_for(cond, timeout: float, what: str):
    """Poll `cond` (async) until truthy; SystemExit naming `what` past the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await cond()
        if got:
            return got
        await anyio.sleep(0.05)
    raise SystemExit(f"bench: {what} not within {timeout:g} s")


async def _scale(bus: Bus, model: str) -> records.Scale | None:
    got = await bus.get(keys.scale(model), decoder(records.Scale))
    return got.value if got else None


def _backends(router, served: str) -> int:
    route = router.table.route(served)
    return len(route.backends) if route is not None else 0


async def _remove(bus: Bus, model: str) -> None:
    """`llmgw place MODEL --replicas 0`, and wait until every replica is gone."""
    await bus.put(keys.desired(model), records.Desired(model=model, replicas=0, updated_at=2.0))

    async def gone():
        return not await replicas_of(bus, model)

    await wait_for(gone, 60, f"{model}'s replicas removed")


class Counts:
    """scale.<model> at every change of count: (when, count, the leader's reason)."""

    def __init__(self, bus: Bus, model: str) -> None:
        self.bus, self.model = bus, model
        self.changes: list[tuple[float, int, str]] = []

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            s = await _scale(self.bus, self.model)
            if s is not None and (not self.changes or self.changes[-1][1] != s.replicas):
                self.changes.append((time.monotonic(), s.replicas, s.reason))
            await anyio.sleep(0.05)  # a sampling period

    def between(self, start: float, end: float) -> list[tuple[float, int, str]]:
        return [c for c in self.changes if start < c[0] <= end]

    def show(self, t0: float) -> None:
        for t, _, reason in self.changes:
            print(f"  {t - t0:6.1f} s  {reason}")


# --- baselines: the engine started directly ----------------------------------------------


async def engine_alone(bindir: Path, gguf: Path, load_s: float) -> float:
    """Seconds from starting the fake engine (as the agent would: llama-server on PATH) to
    the first token of a streamed request, with nothing of llmgw in between."""
    port = free_port()
    env = {**STREAM, "FAKE_ENGINE_LOAD_SECONDS": str(load_s), "PATH": "/usr/bin:/bin"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(bindir / "llama-server"), "--host", "127.0.0.1", "--port", str(port), "-m", str(gguf)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit("bench: the fake engine exited")
                await anyio.sleep(0.02)
            return await first_token(http, f"http://127.0.0.1:{port}", "tiny", t0)
    finally:
        proc.terminate()
        proc.wait()


async def first_token(http: aiohttp.ClientSession, url: str, served: str, t0: float) -> float:
    body = {"model": served, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise SystemExit(f"bench: {r.status} {await r.text()}")
        async for chunk in r.content.iter_any():
            if b"data: " in chunk:
                took = time.monotonic() - t0
                await r.read()
                return took
    raise SystemExit("bench: a stream without data")


# --- sections ------------------------------------------------------------------------------


async def serve(bus: Bus, work: Path, name: str, load_s: float, **policy) -> None:
    """Catalog `name` (served as `name`, its engine loading for `load_s`) with POLICY and
    `policy` over it, `llmgw place NAME --auto`."""
    env = {**STREAM, "FAKE_ENGINE_LOAD_SECONDS": str(load_s)}
    model = autoscaled_model(
        work / "weights", id=name, served_name=name, env=env, **{**POLICY, **policy}
    )
    await serve_auto(bus, model)


@contextlib.asynccontextmanager
async def loaded(bus: Bus, router, model: str, active: int):
    """Up to PEAK streams to `model` (`active` of them at first), its replicas' phases and
    its count watched, until the block ends."""
    streams = Streams([router.url], served_name=model)
    streams.set_active(active)
    phases, counts = Phases(bus, model), Counts(bus, model)
    stop = anyio.Event()
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(streams.run, http, PEAK, stop)
        tg.start_soon(phases.run, stop)
        tg.start_soon(counts.run, stop)
        try:
            yield streams, phases, counts
        finally:
            stop.set()


async def step(bus, router, work: Path, bindir: Path) -> None:
    print(f"\n== step: 1 -> {PEAK} concurrent streams ==")
    await serve(bus, work, "step", LOAD_S)
    await wait_for(lambda: _true(_backends(router, "step") == 1), 60, "step's first replica")
    base = [await engine_alone(bindir, work / "weights" / "step.gguf", LOAD_S) for _ in range(3)]
    async with loaded(bus, router, "step", 1) as (streams, phases, counts):
        await wait_for(lambda: _true(streams.completed >= 3), 30, "the first streams")
        before = set(streams.first_answer)
        failed_before = len(streams.failed)
        t0 = time.monotonic()
        streams.set_active(PEAK)

        async def all_answered():
            return len(set(streams.first_answer) - before) >= PEAK_REPLICAS - 1

        await wait_for(all_answered, 90, "every new replica answering")
        t_up = time.monotonic()
        await anyio.sleep(20)  # the steady part: two down windows at PEAK streams
        t_end = time.monotonic()
    new = sorted(t - t0 for r, t in streams.first_answer.items() if r not in before)
    failed = len(streams.failed) - failed_before
    engine = statistics.median(base)
    steady = counts.between(t_up, t_end)
    most = max(n for t, n in phases.holding if t >= t0)
    print(f"engine alone, start to first token: {engine:.2f} s (median of 3; load {LOAD_S:g} s)")
    print(
        f"first new replica answering: {new[0]:.2f} s after the step ({new[0] / engine:.1f}x the engine alone)"
    )
    print(
        f"all {len(new)} new replicas answering: {new[-1]:.2f} s ({new[-1] / engine:.1f}x the engine alone)"
    )
    print(f"requests failed during the step: {failed} of {streams.completed + failed}")
    if streams.failed[failed_before:]:
        print("  e.g.", streams.failed[failed_before:][:3])
    print(
        f"replicas held at most: {most} for {PEAK_REPLICAS} wanted (overshoot {most - PEAK_REPLICAS})"
    )
    print(f"changes of count over 20 s at steady load (2 down windows): {len(steady)}")
    print("changes of count, seconds from the step:")
    counts.show(t0)
    await _remove(bus, "step")


def day_load(t: float) -> int:
    """Streams wanted at `t` seconds into the compressed day: 2 at night, a sine-squared
    rise to PEAK at midday (t = 60) and back by t = 100."""
    if 20 <= t <= 100:
        return 2 + round((PEAK - 2) * math.sin(math.pi * (t - 20) / 80) ** 2)
    return 2


async def day(bus, router, work: Path) -> None:
    print(f"\n== day: a day-shaped load over {DAY_S:g} s, peak {PEAK} streams ==")
    await serve(bus, work, "day", LOAD_S)
    await wait_for(lambda: _true(_backends(router, "day") == 1), 60, "day's first replica")
    async with loaded(bus, router, "day", day_load(0)) as (streams, phases, counts):
        t0 = time.monotonic()
        while (t := time.monotonic() - t0) < DAY_S:
            streams.set_active(day_load(t))
            await anyio.sleep(0.5)  # the trace's resolution
    held = _integral([(t - t0, n) for t, n in phases.holding], DAY_S)
    fixed = PEAK_REPLICAS * DAY_S
    demand = sum(day_load(t / 10) for t in range(int(DAY_S * 10))) / 10 / POLICY["target_in_flight"]
    print(
        f"replica-seconds: autoscaled {held:.0f}, fixed fleet of {PEAK_REPLICAS} {fixed:.0f}: {held / fixed:.0%}"
    )
    print(
        f"  (the load itself asks for {demand:.0f} replica-seconds at target {POLICY['target_in_flight']:g}: {demand / fixed:.0%})"
    )
    print(f"requests failed: {len(streams.failed)} of {streams.completed + len(streams.failed)}")
    if streams.failed:
        print("  e.g.", streams.failed[:3])
    print(f"changes of count: {len(counts.changes) - 1}, seconds into the day:")
    counts.show(t0)
    await _remove(bus, "day")


def _integral(samples: list[tuple[float, int]], end: float) -> float:
    """Replica-seconds from (seconds, count) samples over [0, end], each count held until
    the next sample."""
    inside = [(t, n) for t, n in samples if 0 <= t <= end]
    total = 0.0
    for (t, n), (t2, _) in zip(inside, inside[1:] + [(end, 0)], strict=True):
        total += n * (t2 - t)
    return total


async def cold(bus, router, work: Path, bindir: Path) -> None:
    print(f"\n== cold: the first request to a model at zero (engine load {COLD_LOAD_S:g} s) ==")
    await serve(bus, work, "cold", COLD_LOAD_S, idle_unload_after=3)
    llmgw, alone = [], []
    async with aiohttp.ClientSession() as http:
        for _ in range(3):

            async def at_zero():
                s = await _scale(bus, "cold")
                return (
                    s is not None
                    and s.replicas == 0
                    and not await replicas_of(bus, "cold")
                    and "cold" in router.table.cold_names()
                )

            await wait_for(at_zero, 90, "cold scaled to zero")
            # the baseline first, on cores nothing else of the bench uses: the model is at
            # zero and its last replica drained (measured after the llmgw round instead, it
            # shared them with that replica idling out, and came out the slower)
            alone.append(await engine_alone(bindir, work / "weights" / "cold.gguf", COLD_LOAD_S))
            llmgw.append(await first_token(http, router.url, "cold", time.monotonic()))
    s = await _scale(bus, "cold")
    a, b = statistics.median(llmgw), statistics.median(alone)
    print(f"engine alone, start to first token: {b:.2f} s (median of 3: {_r(alone)})")
    print(
        f"through llmgw from zero, request to first token: {a:.2f} s (median of 3: {_r(llmgw)}); {a / b:.2f}x"
    )
    print(f"llmgw's overhead: {a - b:.2f} s; measured load time in scale.cold: {s.load_s:.2f} s")
    await _remove(bus, "cold")


def _r(xs: list[float]) -> list[float]:
    return [round(x, 2) for x in xs]


async def _true(value: bool) -> bool:
    return value


async def main(sections: list[str]) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="llmgw-bench-autoscale-") as tmp,
        free_port_run() as engine_ports,
    ):
        work = Path(tmp)
        server = EmbeddedNats(data_dir=work / "nats", port=free_port())
        server.start()
        agents = start_agents(server.url, work)
        bindir = work / "direct-bin"
        install_fake_engines(bindir)
        settings = NatsSettings(urls=(server.url,), name="bench", healthy_after=1.0)
        try:
            bus = await Bus.connect(settings, give_up_after=10)
            cbus = await Bus.connect(settings, give_up_after=10)
            async with anyio.create_task_group() as tg:
                await tg.start(Controller(cbus, controller_settings("bench", engine_ports)).run)

                async def nodes_ready():
                    got = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
                    return sum(e.value.phase == "ready" for e in got.values()) == len(NODES)

                await wait_for(nodes_ready, 30, "the agents' nodes ready")
                connect = lambda: Bus.connect(settings, give_up_after=None)  # noqa: E731
                async with running_router(connect=connect, settings=router_settings()) as router:
                    if "step" in sections:
                        await step(bus, router, work, bindir)
                    if "day" in sections:
                        await day(bus, router, work)
                    if "cold" in sections:
                        await cold(bus, router, work, bindir)
                tg.cancel_scope.cancel()
            await bus.close()
            await cbus.close()
        finally:
            stop_agents(agents)
            server.stop()


if __name__ == "__main__":
    chosen = sys.argv[1:] or ["step", "day", "cold"]
    unknown = set(chosen) - {"step", "day", "cold"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}: step, day, cold")
    t = time.monotonic()
    asyncio.run(main(chosen))
    print(f"\n(the run took {time.monotonic() - t:.0f} s)")
