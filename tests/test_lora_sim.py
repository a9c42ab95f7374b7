"""LoRA adapters in the simulated fleet and at `llmgw adapter add`: a fleet file's share holds
adapters' files the real agents' scans report; `llmgw adapter add` takes many names at once,
each found by the name the nodes report; a controller places them on the simulated vLLM and
a router serves each by its name. And the command's refusals, and the file's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import anyio
import pytest
from lora_fleet import gpu_base, served
from router_helpers import router_settings, running_router
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.controller.loop import Controller
from llmgw.sim.fleet import FleetError, parse_fleet
from llmgw.sim.simulator import Simulator

pytestmark = pytest.mark.anyio

FLEET = """
[sim]
heartbeat = 0.5
load_seconds = 0.2

[shares.filer]
models = ["org/base"]
adapters = [{ name = "ft", count = 12 }, { name = "big", rank = 64 }]

[[nodes]]
name = "g"
count = 2
gpus = { count = 1 }
ram_gb = 64
engines = ["vllm"]
mounts = ["filer"]
"""

BASE = gpu_base(slots=8, rank=16)


def llmgw(nats: NatsSettings, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["LLMGW_NATS"] = nats.urls[0]
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args], capture_output=True, text=True, env=env
    )


async def _adapters_held(bus: Bus) -> int:
    nodes = await bus.list(keys.pattern(keys.NODES), decoder(records.NodeInventory))
    return sum(len(e.value.weights.adapters) for e in nodes.values())


async def test_a_simulated_share_s_adapters_are_added_by_name_at_once_and_served(
    tmp_path, nats_settings
):
    from controller_helpers import quick_controller
    from port_helpers import free_port_run

    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    sim = Simulator(path, nats_settings, BucketSettings(), tmp_path / "sim", poll=0.1)
    with free_port_run() as ports:
        async with await Bus.connect(nats_settings, give_up_after=5) as bus:
            await bus.put(keys.catalog("base"), catalog.encode_model(BASE))
            await bus.put(keys.desired("base"), records.Desired(model="base", replicas=2))
            async with anyio.create_task_group() as tg:
                await tg.start(Controller(bus, quick_controller(ports)).run)
                await tg.start(sim.run)
                # each of the two nodes mounting the share reports its 13 adapters
                await until(lambda: _is(_adapters_held(bus), 26), timeout=30)
                names = [f"ft-{n:02d}" for n in range(1, 13)]
                done = await anyio.to_thread.run_sync(
                    lambda: llmgw(nats_settings, "adapter", "add", *names, "--base", "base")
                )
                assert done.returncode == 0, done.stderr
                assert done.stdout.count("added") == 12
                assert "ft-12 added: 'ft-12' on base, rank 8; held on 2 node(s)" in done.stdout
                listed = await bus.list(keys.pattern(keys.ADAPTERS), catalog.decode_adapter)
                paths = {e.value.id: e.value.path for e in listed.values()}
                assert paths["ft-03"] == str(
                    tmp_path / "sim" / "shares" / "filer" / "loras" / "ft-03"
                )

                def connect() -> Bus:
                    return Bus.connect(nats_settings, give_up_after=5)

                async with running_router(connect=connect, settings=router_settings()) as r:
                    await until(served(r, "ft-07"), timeout=30)
                    body = {"model": "ft-07", "messages": [{"role": "user", "content": "hi"}]}
                    async with aiohttp.ClientSession() as http:
                        async with http.post(f"{r.url}/v1/chat/completions", json=body) as resp:
                            assert resp.status == 200, await resp.text()
                            assert (await resp.json())["model"] == "ft-07"
                tg.cancel_scope.cancel()


async def test_adding_adapters_says_what_is_missing_and_writes_nothing_then(
    bus, nats_settings, tmp_path
):
    await bus.put(keys.catalog("base"), catalog.encode_model(BASE))
    for args, says in (
        (["a", "b", "--path", "/w/x"], "2 names share one --path '/w/x'; put {name} in it"),
        (["a", "b", "--served-name", "x"], "2 names share one --served-name 'x'"),
        (["nowhere"], "no node reports adapter files named 'nowhere'; say which with --path"),
        (["c", "--path", "/w/c"], "the rank of /w/c is not known"),
    ):
        done = await anyio.to_thread.run_sync(
            lambda args=args: llmgw(nats_settings, "adapter", "add", *args, "--base", "base")
        )
        assert done.returncode == 2 and says in done.stderr, done.stderr
    # several at once, {name} in the path and the served name
    done = await anyio.to_thread.run_sync(
        lambda: llmgw(
            nats_settings,
            "adapter",
            "add",
            "p",
            "q",
            "--base",
            "base",
            "--rank",
            "8",
            "--path",
            "/w/{name}",
            "--served-name",
            "acme/{name}",
        )  # fmt: skip
    )
    assert done.returncode == 0, done.stderr
    listed = await bus.list(keys.pattern(keys.ADAPTERS), catalog.decode_adapter)
    assert {(e.value.served_name, e.value.path) for e in listed.values()} == {
        ("acme/p", "/w/p"),
        ("acme/q", "/w/q"),
    }
    done = await anyio.to_thread.run_sync(lambda: llmgw(nats_settings, "adapter", "ls", "--json"))
    assert [a["id"] for a in json.loads(done.stdout)] == ["p", "q"]


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ('[{ name = "a/b" }]', "'a/b' is not an adapter name"),
        ('[{ name = "a", count = 0 }]', "count 0 is out of range"),
        ('[{ name = "a", rank = 1000 }]', "rank 1000 is out of range 1..512"),
        ('[{ name = "a", count = 2 }, { name = "a-01" }]', "'a-01' names files named before"),
    ],
)
def test_bad_adapters_in_a_fleet_file_name_the_share_and_the_fix(adapters, message):
    with pytest.raises(FleetError) as e:
        parse_fleet(f"[shares.s]\nadapters = {adapters}\n")
    assert "key 'shares.s.adapters'" in str(e.value) and message in str(e.value), str(e.value)


def test_a_model_may_not_hide_in_the_adapters_folder():
    with pytest.raises(FleetError, match="loras/ holds the LoRA adapters' files"):
        parse_fleet('[[nodes]]\nname = "n"\nmodels = ["loras/x"]\n')


async def _is(value, want) -> bool:
    return await value == want


def test_the_lora_examples_parse_and_their_base_takes_the_adapters():
    from llmgw.sim.fleet import load_fleet

    root = Path(__file__).resolve().parents[1] / "examples"
    fleet = load_fleet(root / "lora-fleet.toml")
    (files,) = fleet.shares["filer"].adapters
    assert len(files.files()) == 1000 and files.files()[-1] == "qwen-ft-1000"
    (base,) = catalog.load_catalog_toml(root / "lora-catalog.toml")
    assert fleet.shares["filer"].models == [base.profiles[0].weights.key]
    assert base.profiles[0].adapter_slots * 4 >= 1000  # every adapter has a place


@pytest.mark.slow
def test_the_readme_s_thousand_adapters_on_the_simulated_fleet_are_served_by_name(tmp_path):
    """README, "Fine-tunes: LoRA adapters": `llmgw up --sim examples/lora-fleet.toml`, its
    base placed, a thousand adapters added in one command, one asked for by name."""
    import time

    from up_sim import ROOT, up_sim

    with up_sim(ROOT / "examples" / "lora-fleet.toml", tmp_path) as up:
        up.run("catalog", "apply", "examples/lora-catalog.toml")
        up.run("place", "qwen3-8b", "--replicas", "4", "--wait")
        names = [f"qwen-ft-{n:04d}" for n in range(1, 1001)]
        deadline = time.monotonic() + 60
        while True:  # until every node's scan has reported the adapters' files
            done = subprocess.run(
                [sys.executable, "-m", "llmgw.cli", "adapter", "add", *names, "--base", "qwen3-8b"],
                capture_output=True, text=True, env=up.env, timeout=120, cwd=ROOT,
            )  # fmt: skip
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count(" added: ") == 1000
        assert up.chat("qwen-ft-0042")["model"] == "qwen-ft-0042"
        assert "qwen-ft-0042" in up.run("adapter", "ls")
