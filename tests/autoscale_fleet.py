"""A fleet to autoscale, for tests/test_autoscale_e2e.py and bench/autoscale.py: agent
processes on recorded hosts (one loopback address each) running the fake engine, an
autoscaled model of it, streaming clients that keep every failure, and a watch of the
replicas' phases."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import anyio
from controller_helpers import quick_controller
from router_helpers import SERVED, chat_body

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.loop import ControllerSettings
from llmgw.sim.fake_engine import write_fake_gguf


def controller_settings(name: str, ports: tuple[int, int]) -> ControllerSettings:
    """A quick controller placing engines on `ports` (the test's engine_ports)."""
    return quick_controller(ports, controller_id=name, load_stale_after=2)


def autoscaled_model(
    weights_dir: Path,
    *,
    id: str = "tiny",
    served_name: str = SERVED,
    env: dict[str, str] | None = None,
    **autoscale,
) -> catalog.Model:
    """The fake engine as llama-server on CPU, with an autoscale policy (short windows;
    `autoscale` overrides them). Its streams are 20 tokens at 40 a second unless `env`
    says otherwise."""
    gguf = str(write_fake_gguf(weights_dir / f"{id}.gguf"))
    policy = {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_in_flight": 1,
        "scale_up_after": 1,
        "scale_down_after": 2,
        **autoscale,
    }
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": id,
                    "served_name": served_name,
                    "autoscale": policy,
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama-server",
                            "weights": {"path": gguf},
                            "gpus_per_node": 0,
                            "host_ram_gb": 1,
                            "env": {
                                "FAKE_ENGINE_TOKENS": "20",
                                "FAKE_ENGINE_TOKEN_RATE": "40",
                                **(env or {}),
                            },
                        }
                    ],
                }
            ]
        }
    )[0]


async def serve_auto(bus: Bus, model: catalog.Model) -> None:
    """`llmgw catalog apply`, then `llmgw place MODEL --auto`."""
    await bus.put(keys.catalog(model.id), catalog.encode_model(model))
    await bus.put(
        keys.desired(model.id),
        records.Desired(model=model.id, replicas=0, auto=True, updated_at=1.0),
    )


async def replicas_of(bus: Bus, model: str = "tiny") -> list[records.Replica]:
    got = await bus.list(keys.pattern(keys.REPLICAS, model), decoder(records.Replica))
    return sorted((e.value for e in got.values()), key=lambda r: r.rid)


class Phases:
    """Every phase each replica of a model was seen in, the most replicas counted at once,
    and (when, replicas holding an engine) at every look."""

    def __init__(self, bus: Bus, model: str = "tiny") -> None:
        self.bus = bus
        self.model = model
        self.seen: dict[str, list[str]] = {}
        self.most_counted = 0
        self.holding: list[tuple[float, int]] = []

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            reps = await replicas_of(self.bus, self.model)
            for r in reps:
                phases = self.seen.setdefault(r.rid, [])
                if not phases or phases[-1] != r.phase:
                    phases.append(r.phase)
            counted = sum(r.phase in records.REPLICA_COUNTED for r in reps)
            self.most_counted = max(self.most_counted, counted)
            holding = sum(r.phase in records.REPLICA_HOLDS_GPUS_AND_PORTS for r in reps)
            self.holding.append((time.monotonic(), holding))
            await anyio.sleep(0.02)  # a sampling period, not a wait for a condition


class Streams:
    """Clients streaming one request after the other through `urls`, every failure kept.
    `run(http, workers, stop)` starts `workers` of them; only the first `active` stream at a
    time (all, unless changed while they run: a load that moves)."""

    def __init__(self, urls: list[str], served_name: str = SERVED) -> None:
        self.urls = urls
        self.served_name = served_name
        self.completed = 0
        self.failed: list[str] = []
        self.replicas: set[str] = set()
        self.first_answer: dict[str, float] = {}  # replica -> when it first answered
        self.active: int | None = None
        self._moved = anyio.Event()

    def set_active(self, n: int) -> None:
        self.active = n
        self._moved.set()
        self._moved = anyio.Event()

    async def run(self, http: aiohttp.ClientSession, workers: int, stop: anyio.Event) -> None:
        async def worker(i: int) -> None:
            url = self.urls[i % len(self.urls)]
            n = 0
            while not stop.is_set():
                if self.active is not None and i >= self.active:
                    moved = self._moved
                    with anyio.move_on_after(0.5):  # and look at `stop` again
                        await moved.wait()
                    continue
                n += 1
                body = chat_body(f"w{i} {n}", stream=True, model=self.served_name)
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    replica = resp.headers.get("x-llmgw-replica", "")
                    if resp.status == 200:
                        self.first_answer.setdefault(replica, time.monotonic())
                    data = await resp.read()
                    if resp.status != 200 or not data.rstrip().endswith(b"data: [DONE]"):
                        self.failed.append(f"{resp.status} {data[-120:]!r}")
                    else:
                        self.completed += 1
                        self.replicas.add(replica)

        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(worker, i)
