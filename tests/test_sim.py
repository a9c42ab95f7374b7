"""The simulated fleet (llmgw/sim, docs/sim.md): real agents on simulated hardware, a real
nats-server, a real controller and router in this process, and the fleet file edited while
it runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anyio
import pytest
from click.testing import CliRunner
from router_helpers import router_settings, running_router
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.catalog import encode_model
from llmgw.cli.main import main
from llmgw.controller.loop import Controller
from llmgw.sim.fleet import FleetError, parse_fleet
from llmgw.sim.simulator import Simulator

pytestmark = pytest.mark.anyio

# 26 nodes: ten on ib-a reading a filer, ten on ib-b, one on ib-b holding a model on its
# own disk, five CPU-only nodes (the only ones with llama-server) with too little RAM for
# the CPU model
FLEET = """
[sim]
heartbeat = 0.2
load_seconds = 0.1
tokens = 6
token_rate = 500
first_token_seconds = 0

[shares.filer]
models = ["org/big"]

[[nodes]]
name = "a"
count = 10
gpus = { count = 8 }
ram_gb = 512
ib = [{ adapter = "mlx5_0", fabric = "ib-a" }]
engines = ["vllm"]
mounts = ["filer"]

[[nodes]]
name = "b"
count = 10
gpus = { count = 8 }
ram_gb = 512
ib = [{ adapter = "mlx5_0", fabric = "ib-b" }]
engines = ["vllm"]

[[nodes]]
name = "b-local"
gpus = { count = 2, name = "NVIDIA L40S", memory_gb = 48 }
ram_gb = 512
ib = [{ adapter = "mlx5_0", fabric = "ib-b" }]
engines = ["vllm"]
models = ["org/small"]

[[nodes]]
name = "cpu"
count = 4
ram_gb = 16
engines = ["llama-server"]
models = ["tiny.gguf"]

[[nodes]]
name = "cpu-x"
ram_gb = 16
engines = ["llama-server"]
models = ["tiny.gguf"]
"""


def _model(
    mid: str, engine: str, key: str, gpus: int, ram: float, gpu_gb: float = 0
) -> catalog.Model:
    return catalog.Model(
        id=mid,
        served_name=f"served/{mid}",
        profiles=[
            catalog.Profile(
                name="p",
                engine=engine,
                weights=catalog.WeightsRef(key=key),
                gpus_per_node=gpus,
                gpu_memory_gb=gpu_gb,
                host_ram_gb=ram,
            )
        ],
    )


MODELS = [
    _model("big", "vllm", "org/big", 8, 64, 80),
    _model("small", "vllm", "org/small", 1, 16, 40),
    _model("tiny", "llama-server", "tiny", 0, 24),
]


class Fleet:
    def __init__(self, path: Path, sim: Simulator, bus: Bus) -> None:
        self.path, self.sim, self.bus = path, sim, bus

    def edit(self, old: str, new: str) -> None:
        text = self.path.read_text()
        assert old in text
        # written whole: the simulator never reads half a file
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text.replace(old, new, 1))
        tmp.replace(self.path)

    async def place(self, model: str, replicas: int) -> None:
        await self.bus.put(keys.desired(model), records.Desired(model=model, replicas=replicas))

    async def replicas(self, model: str) -> list[records.Replica]:
        found = await self.bus.list(keys.pattern(keys.REPLICAS, model), decoder(records.Replica))
        return [e.value for e in found.values()]

    async def ready(self, model: str, n: int) -> list[records.Replica] | None:
        reps = await self.replicas(model)
        return reps if len([r for r in reps if r.phase == "ready"]) == n else None

    async def health(self, node: str) -> str | None:
        entry = await self.bus.get(keys.health(node), decoder(records.Health))
        return entry.value.phase if entry is not None else None


@contextlib.asynccontextmanager
async def running_fleet(tmp_path: Path, nats: NatsSettings) -> AsyncIterator[Fleet]:
    """The fleet above with a controller quick to judge liveness (unreachable after 1 s
    without a lease, lost after 2.5 s), its catalog applied, engines on ports found free."""
    from controller_helpers import quick_controller
    from port_helpers import free_port_run

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    sim = Simulator(path, nats, BucketSettings(), tmp_path / "sim", connections=2, poll=0.1)
    with free_port_run() as ports:
        settings = quick_controller(ports, unreachable_after=1, lost_after=2.5)
        async with await Bus.connect(nats, give_up_after=5) as bus:
            for m in MODELS:
                await bus.put(keys.catalog(m.id), encode_model(m))
            async with anyio.create_task_group() as tg:
                await tg.start(Controller(bus, settings).run)
                await tg.start(sim.run)
                fleet = Fleet(path, sim, bus)
                await until(lambda: _all_ready(fleet), timeout=30)
                try:
                    yield fleet
                finally:
                    tg.cancel_scope.cancel()


async def _all_ready(fleet: Fleet) -> bool:
    health = await fleet.bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
    return len([h for h in health.values() if h.value.phase == "ready"]) == 26


async def test_placement_lands_where_the_weights_are(tmp_path, nats_settings):
    async with running_fleet(tmp_path, nats_settings) as fleet:
        await fleet.place("big", 3)
        await fleet.place("small", 1)
        big = await until(lambda: fleet.ready("big", 3), timeout=30)
        small = await until(lambda: fleet.ready("small", 1), timeout=30)
    # the filer is seen from ib-a only; the small model is on b-local's own disk
    assert sorted(m.node[:2] for r in big for m in r.members) == ["a-", "a-", "a-"]
    assert [m.node for r in small for m in r.members] == ["b-local"]
    assert all("weights on a share the node sees (sim:filer)" in r.reason for r in big)
    assert "weights on node (local:b-local)" in small[0].reason


async def test_a_node_dying_live_turns_unreachable_then_lost(tmp_path, nats_settings):
    async with running_fleet(tmp_path, nats_settings) as fleet:
        fleet.edit('name = "cpu-x"', 'name = "cpu-x"\nstate = "dead"')
        await until(lambda: _phase_is(fleet, "cpu-x", "unreachable"), timeout=15)
        await until(lambda: _phase_is(fleet, "cpu-x", "lost"), timeout=15)
        assert await fleet.health("cpu-01") == "ready"
        # brought back: its lease moves again
        fleet.edit('state = "dead"', 'state = "up"')
        await until(lambda: _phase_is(fleet, "cpu-x", "ready"), timeout=15)


async def _phase_is(fleet: Fleet, node: str, phase: str) -> bool:
    return await fleet.health(node) == phase


async def test_ram_growing_live_makes_a_node_a_candidate(tmp_path, nats_settings):
    async with running_fleet(tmp_path, nats_settings) as fleet:
        await fleet.place("tiny", 1)

        async def refused() -> str | None:
            entry = await fleet.bus.get(keys.placement("tiny"), decoder(records.PlacementRecord))
            return entry.value.explanation if entry and entry.value.placed == 0 else None

        why = await until(refused, timeout=15)
        assert "RAM" in why, why
        assert await fleet.replicas("tiny") == []
        fleet.edit('name = "cpu-x"\nram_gb = 16', 'name = "cpu-x"\nram_gb = 64')
        placed = await until(lambda: fleet.ready("tiny", 1), timeout=20)
    assert [m.node for r in placed for m in r.members] == ["cpu-x"]


async def test_a_streamed_completion_through_the_router_reaches_a_simulated_engine(
    tmp_path, nats_settings
):
    async with running_fleet(tmp_path, nats_settings) as fleet:
        await fleet.place("small", 1)
        (replica,) = await until(lambda: fleet.ready("small", 1), timeout=30)
        # the engine listens on its node's own loopback address, at the assigned port
        address = fleet.sim.nodes["b-local"].address
        assert replica.endpoint == f"{address}:{replica.members[0].port}"
        assert address.startswith("127.") and address != "127.0.0.1"

        def connect() -> Bus:
            return Bus.connect(nats_settings, give_up_after=5)

        async with running_router(connect=connect, settings=router_settings()) as router:
            body = {
                "model": "served/small",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            chunks = await until(lambda: _stream(router.url, body), timeout=15)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(t for t in texts if t) == "tok0 tok1 tok2 tok3 tok4 tok5 "
    assert {c["model"] for c in chunks} == {"served/small"}


async def _stream(base: str, body: dict) -> list[dict] | None:
    """The chunks of a streamed chat completion; None while the router has no engine yet."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return None
            assert r.headers["Content-Type"].startswith("text/event-stream")
            chunks = []
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(json.loads(line[len(b"data: ") :]))
            return chunks


# --- bad fleet files ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('name = "b-local"', 'name = "b-local"\ngpu = 2'),
            "nodes[2] (name 'b-local'): unknown key 'gpu'; docs/sim.md lists every key",
        ),
        (
            ("ram_gb = 512\nib", 'ram_gb = "lots"\nib'),
            "nodes[0] (name 'a'): key 'ram_gb': expected `float`, got `str`",
        ),
        (
            ('mounts = ["filer"]', 'mounts = ["filr"]'),
            "nodes[0] (name 'a'): key 'mounts': 'filr' is no share of this file (filer); "
            "add [shares.filr] or fix the name",
        ),
        (
            ('name = "b-local"', 'name = "b-01"'),
            "nodes[2] (name 'b-01'): node 'b-01' is named twice",
        ),
        (
            ("gpus = { count = 2,", "gpus = { count = 9,"),
            "nodes[2] (name 'b-local'): key 'gpus.count': 9 is out of range 0..8",
        ),
        (
            ('models = ["org/small"]', 'models = ["../etc"]'),
            "nodes[2] (name 'b-local'): key 'models': '../etc' is not a model name",
        ),
        (
            ('engines = ["vllm"]\nmodels', 'engines = ["sglang"]\nmodels'),
            "nodes[2] (name 'b-local'): key 'engines[0]': 'sglang' is not allowed; use "
            "'llama-server' or 'vllm'",
        ),
        (("heartbeat = 0.2", "heartbeat = 0"), "key 'sim.heartbeat': 0 is out of range"),
        (('name = "cpu"', "cpus = 3"), "nodes[3] (name '?'): key 'name' is required"),
    ],
)
def test_bad_fleet_files_name_the_node_the_key_and_the_fix(change, message):
    old, new = change
    assert old in FLEET
    with pytest.raises(FleetError) as e:
        parse_fleet(FLEET.replace(old, new, 1), Path("fleet.toml"))
    assert str(e.value).startswith("fleet.toml: ")
    assert message in str(e.value), str(e.value)


def test_a_fleet_file_lists_every_problem_at_once_each_naming_the_node_and_the_key():
    """One error per run made an edit of a fleet file take as many runs as it had errors."""
    text = FLEET.replace("heartbeat = 0.2", "heartbeat = 0\nbeat = 1", 1)
    text = text.replace("ram_gb = 512\nib", 'ram_gb = "lots"\nib', 1)  # nodes[0]
    text = text.replace('mounts = ["filer"]', 'mounts = ["filr"]', 1)  # nodes[0] too
    text = text.replace('engines = ["vllm"]\nmodels', 'engines = ["sglang"]\nmodels', 1)
    text = text.replace('name = "cpu"', "cpus = 3", 1)
    with pytest.raises(FleetError) as e:
        parse_fleet(text, Path("fleet.toml"))
    lines = str(e.value).splitlines()
    assert lines[0] == "fleet.toml: fleet file refused (6 error(s)):"
    assert sorted(line.strip() for line in lines[1:]) == sorted(
        [
            "unknown key 'sim.beat'; docs/sim.md lists every key",
            "key 'sim.heartbeat': 0 is out of range 0.05..3600",
            "nodes[0] (name 'a'): key 'ram_gb': expected `float`, got `str`",
            "nodes[0] (name 'a'): key 'mounts': 'filr' is no share of this file (filer); "
            "add [shares.filr] or fix the name",
            "nodes[2] (name 'b-local'): key 'engines[0]': 'sglang' is not allowed; use "
            "'llama-server' or 'vllm'",
            "nodes[3] (name '?'): key 'name' is required; docs/sim.md shows an example",
        ]
    )


def test_llmgw_sim_refuses_a_file_that_is_not_utf8_text_or_not_a_regular_file(tmp_path):
    """A Latin-1 file died with a UnicodeDecodeError traceback; a FIFO would hang the
    command and /dev/zero grow it until it died."""
    latin1 = tmp_path / "fleet.toml"
    latin1.write_bytes(b'[[nodes]]\nname = "caf\xe9"\n')
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for path, said in (
        (latin1, f"{latin1}: not UTF-8 text (byte 0xe9 at line 2, column 12); save it as UTF-8"),
        (fifo, f"{fifo}: not a regular file; give the path of a FLEET.toml file"),
        (Path("/dev/zero"), "/dev/zero: not a regular file; give the path of a FLEET.toml file"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "llmgw.cli", "sim", str(path), "--nats", "nats://127.0.0.1:1"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 1
        assert out.stderr.splitlines() == [f"Error: {said}"]


def test_the_fleet_file_expands_groups_and_the_example_parses():
    from up_sim import FLEET as EXAMPLE

    fleet = parse_fleet(FLEET)
    assert len(fleet.nodes) == 26
    assert list(fleet.nodes)[:2] == ["a-01", "a-02"] and "a-10" in fleet.nodes
    assert len(parse_fleet(EXAMPLE.read_text(), EXAMPLE).nodes) == 12
    # the reader's copy may have more or fewer nodes, as the README invites
    example = Path(__file__).parents[1] / "examples" / "fleet.toml"
    assert parse_fleet(example.read_text(), example).nodes


def test_llmgw_sim_refuses_a_bad_file_before_connecting(tmp_path):
    bad = tmp_path / "fleet.toml"
    bad.write_text(FLEET.replace('mounts = ["filer"]', 'mounts = ["filr"]'))
    result = CliRunner().invoke(main, ["sim", str(bad), "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 1
    assert "'filr' is no share of this file" in result.output
    missing = CliRunner().invoke(main, ["up", "--sim", str(tmp_path / "none.toml")])
    assert missing.exit_code == 1
    assert "no such fleet file; examples/fleet.toml is one to start from" in missing.output


# --- the README's quick start, through the commands ---------------------------------------


@pytest.mark.slow
def test_the_quick_start_places_by_fabric_and_streams_through_the_router(tmp_path):
    import urllib.request

    from up_sim import FLEET, up_sim

    with up_sim(FLEET, tmp_path) as up:
        run = up.run
        run("catalog", "apply", "examples/sim-catalog.toml")
        assert "placed on h100-b-04" in run("place", "qwen3-8b", "--replicas", "1", "--wait")
        status = run("status")
        assert "weights per fabric" in status and "shared sim:filer-a" in status
        assert "seen by 4 nodes (h100-a-01, h100-a-02, h100-a-03, h100-a-04)" in status
        body = json.dumps(
            {"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "hi"}],
             "stream": True, "max_tokens": 3}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            f"{up.http_url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            lines = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        deltas = [json.loads(x[6:])["choices"][0]["delta"].get("content") for x in lines[:-1]]
        assert "".join(d for d in deltas if d) == "tok0 tok1 tok2 "
