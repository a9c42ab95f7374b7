"""Seeing the fleet: the router's page in a real browser, and every component's /metrics.

One fleet for all of it (`fleet`): NATS, a controller, a router, an agent on recorded
hardware running a real (fake) engine, and simulated nodes (llmgw.sim.bare) on two
fabrics, one of them with names written to break a page that takes them as markup. A node
"killed" is a SimNode whose heartbeats stop.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import anyio
import msgspec
import pytest
from chromium import artifacts_dir, browser
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import router_settings, running_router
from serving import cpu_model, serve
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines, Intervals, Metrics
from llmgw.agent.discovery.gpus import discover_gpus
from llmgw.agent.inventory import Hardware
from llmgw.agent.service import Agent
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.controller.loop import Controller, ControllerSettings
from llmgw.gateway import credentials
from llmgw.router.service import Router
from llmgw.sim.bare import SimNode, inventory
from llmgw.sim.fake_engine import write_fake_gguf
from llmgw.sim.nvml import FOREIGN_PID, RecordedNvml

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# outside input as a hostile writer would have it: markup in every free-text field
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "fleet-page.png"


@dataclass
class Fleet:
    bus: Bus
    router: Router
    controller: Controller
    agent: Agent
    sims: dict[str, SimNode]
    models: list[str]

    @property
    def nodes(self) -> list[str]:
        return sorted([*self.sims, self.agent.node])


def _big_model() -> catalog.Model:
    """A model no node can hold (16 GPUs a node): its replica waits, and says why."""
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": "llama-405b",
                    "served_name": "llama-405b-instruct",
                    "profiles": [
                        {
                            "name": "tp16",
                            "engine": "vllm",
                            "weights": {"key": "meta-llama/Llama-3.1-405B-Instruct"},
                            "gpus_per_node": 16,
                            "host_ram_gb": 64,
                        }
                    ],
                }
            ]
        }
    )[0]


def _hostile_model() -> catalog.Model:
    return catalog.validate_models(
        {
            "models": [
                {
                    "id": "hostile",
                    "served_name": HOSTILE,
                    "profiles": [
                        {
                            "name": "p",
                            "engine": "vllm",
                            "weights": {"source": "hf://org/hostile"},
                            "gpus_per_node": 4,
                        }
                    ],
                }
            ]
        }
    )[0]


@pytest.fixture
async def fleet(nats_server, nats_settings, bus, bins, tmp_path) -> AsyncIterator[Fleet]:
    """The whole fleet in this event loop. (`llmgw up --sim` replaces the sims here.)"""
    from agent_helpers import agent_config, host_dirs

    controller = Controller(
        await Bus.connect(nats_settings, give_up_after=5),
        ControllerSettings(
            unreachable_after=1.0,
            lost_after=600,
            leader_ttl=1,
            tick=0.05,
            resync=0.5,
            metrics_listen=("127.0.0.1", 0),
        ),
    )
    # the agent: 2 recorded H100s, another team's job on GPU 1, the fake llama-server
    nvml = RecordedNvml(count=2, node="gpu-a", processes={1: [(FOREIGN_PID + 1, 3 * 10**9)]})
    dirs = host_dirs(tmp_path / "host")
    cfg = agent_config(
        nats_server.url, dirs, id="gpu-a", gpus=True, llama_server=str(bins["llama-server"])
    )
    cfg = msgspec.structs.replace(
        cfg,
        engines=Engines(listen_host="127.0.0.1", poll_interval=0.1, stop_grace=3),
        intervals=Intervals(heartbeat=0.2, engine_probe=60, gpu_probe=0.2, port_probe=60),
        metrics=Metrics(listen="127.0.0.1:0"),
    )
    agent = Agent(cfg, hardware=Hardware(gpus=lambda lookup: discover_gpus(nvml, lookup)))
    # simulated nodes: two on fabric ib-a sharing a filer that holds the big model, one on
    # no fabric
    on_filer = dict(fabric="ib-a", held=[("meta-llama/Llama-3.1-405B-Instruct", "nfs:filer01:/m")])
    invs = [
        inventory("sim-1", gpus=8, engines=("vllm",), **on_filer),
        inventory("sim-2", gpus=8, engines=("vllm",), **on_filer),
        inventory("sim-3", gpus=4, engines=("vllm",)),
    ]
    sims = {inv.node: SimNode(bus, inv, heartbeat=0.2) for inv in invs}
    gguf = write_fake_gguf(tmp_path / "weights" / "tiny.gguf")
    tiny = cpu_model(str(gguf), gpus_per_node=1)
    router = Router(router_settings())
    async with anyio.create_task_group() as tg:
        await tg.start(controller.run)
        await tg.start(agent.run)
        for s in sims.values():
            await s.register()
            tg.start_soon(s.run)
        await serve(bus, tiny, 1)
        await serve(bus, _big_model(), 1)
        await tg.start(router.serve_bucket, lambda: Bus.connect(nats_settings, give_up_after=5))
        yield Fleet(bus, router, controller, agent, sims, ["llama-405b", "tiny"])
        tg.cancel_scope.cancel()
    await controller.bus.close()


async def _write_hostile(fleet: Fleet) -> None:
    """A node whose hostname and GPU names are markup, and a model whose served name is."""
    sim = fleet.sims["sim-3"]
    sim.inv = msgspec.structs.replace(
        sim.inv,
        hostname=HOSTILE,
        gpus=msgspec.structs.replace(
            sim.inv.gpus,
            devices=[msgspec.structs.replace(g, name=HOSTILE) for g in sim.inv.gpus.devices],
        ),
    )
    await sim.register()
    await serve(fleet.bus, _hostile_model(), 0)


async def _chat(router: Router, served: str = "tiny-chat") -> int:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{router.url}/v1/chat/completions",
            json={"model": served, "messages": [{"role": "user", "content": "hi"}]},
        ) as r:
            await r.read()
            return r.status


async def _served(fleet: Fleet) -> bool:
    return fleet.router.table.route("tiny-chat") is not None and bool(
        fleet.router.table.route("tiny-chat").backends
    )


async def _explained(fleet: Fleet) -> records.PlacementRecord | None:
    e = await fleet.bus.get(keys.placement("llama-405b"), decoder(records.PlacementRecord))
    return e.value if e and e.value.explanation else None


async def test_the_page_shows_every_node_and_model_and_a_killed_node_turns_unreachable(
    fleet, tmp_path
):
    await until(lambda: _served(fleet), timeout=30)
    assert await _chat(fleet.router) == 200  # a time to first token to show
    explained = await until(lambda: _explained(fleet))
    async with browser(tmp_path) as open_tab, open_tab(fleet.router.url + "/") as tab:
        nodes_js = "[...document.querySelectorAll('[data-node]')].map(e => e.dataset.node).sort()"
        shown = await tab.until(
            f"(() => {{ const n = {nodes_js}; return n.length === 4 && n; }})()"
        )
        assert shown == fleet.nodes
        models = await tab.evaluate(
            "[...document.querySelectorAll('[data-model]')].map(e => e.dataset.model).sort()"
        )
        assert models == fleet.models
        # the waiting replica says why, with the controller's counts
        why = await tab.evaluate(
            "document.querySelector('[data-model=\"llama-405b\"] [data-role=why]').textContent"
        )
        assert explained.explanation in why and "0/" in why
        # the ready replica with its endpoint, and this router's figures
        tiny = await tab.until(
            "(() => { const t = document.querySelector('[data-model=\"tiny\"]').textContent;"
            " return t.includes('1/1 ready') && t.includes('p50') && t; })()"
        )
        assert "127.0.0.1:" in tiny
        # GPU memory: allocated beside in use, llmgw's and another's
        gpu = await tab.evaluate(
            'document.querySelector(\'[data-node="gpu-a"] [data-gpu="1"]\').textContent'
        )
        assert "others 3.0 GB" in gpu
        # the parts add up to what is in use: what no listed process holds is named
        assert re.search(r"in use ([\d.]+) GB \(llmgw [\d.]+ GB, others 3.0 GB, unaccounted", gpu)
        assert "allocated" in await tab.evaluate(
            "document.querySelector('[data-node=\"gpu-a\"]').textContent"
        )
        # what the fabric holds
        assert await tab.evaluate(
            'document.querySelector(\'[data-fabric="ib-a"] '
            '[data-holds="meta-llama/Llama-3.1-405B-Instruct"]\') !== null'
        )
        shot = await tab.screenshot(artifacts_dir() / "fleet-page.png")
        if os.environ.get("LLMGW_UPDATE_SCREENSHOT") == "1":  # the README's, on request
            shutil.copyfile(shot, SCREENSHOT)

        # markup in the bucket (a hostname, a GPU name, a served name) is text on the page
        await _write_hostile(fleet)
        await tab.until(
            "[...document.querySelectorAll('[data-model]')].some(e => e.dataset.model === 'hostile')"
        )
        await tab.until(f"document.body.textContent.split({HOSTILE!r}).length > 3")
        assert await tab.evaluate("window.__pwned === undefined")
        assert await tab.evaluate("document.querySelectorAll('img, main script').length") == 0

        await tab.until("document.querySelector('[data-node=\"sim-2\"]').dataset.phase === 'ready'")
        rendered = await tab.evaluate("Number(document.body.dataset.rendered)")
        fleet.sims["sim-2"].alive = False  # killed
        phase = await tab.until(
            "(() => { const p = document.querySelector('[data-node=\"sim-2\"]').dataset.phase;"
            " return p !== 'ready' && p; })()",
            timeout=30,
        )
        assert phase == "unreachable"
        # the same document, redrawn: never reloaded
        assert await tab.evaluate("Number(document.body.dataset.rendered)") > rendered
        assert await tab.evaluate("performance.getEntriesByType('navigation').length") == 1
        assert (
            await tab.evaluate("document.querySelector('[data-node=\"sim-1\"]').dataset.phase")
            == "ready"
        )
        await tab.screenshot(artifacts_dir() / "fleet-page-node-unreachable.png")


@pytest.fixture
async def bare_router(nats_settings) -> AsyncIterator[Router]:
    """A router over the bucket, and nothing else: what the page shows is written by hand."""
    async with running_router(connect=lambda: Bus.connect(nats_settings, give_up_after=5)) as r:
        yield r


async def test_gpus_that_read_alike_are_one_row_and_one_that_differs_breaks_the_run(
    bus, bare_router, tmp_path
):
    """13 simulated nodes made a page 4,720 px tall, a line per idle GPU; `llmgw status`
    already drew a run of alike GPUs as one line."""
    inv = inventory("n8", gpus=8)
    devices = list(inv.gpus.devices)
    devices[3] = msgspec.structs.replace(devices[3], memory_used_bytes=5 * 10**9)
    await SimNode(
        bus, msgspec.structs.replace(inv, gpus=msgspec.structs.replace(inv.gpus, devices=devices))
    ).register()
    async with browser(tmp_path) as open_tab, open_tab(bare_router.url + "/") as tab:
        rows = await tab.until(
            "(() => { const r = [...document.querySelectorAll('[data-node=\"n8\"] .gpu')];"
            " return r.length && r.map(e => e.dataset.gpus || e.dataset.gpu); })()"
        )
        assert rows == ["0-2", "3", "4-7"]
        text = await tab.evaluate(
            'document.querySelector(\'[data-node="n8"] [data-gpus="4-7"]\').textContent'
        )
        assert text.startswith("GPU 4-7 free") and text.endswith(" each"), text


async def test_a_replica_waiting_before_launch_says_what_for_and_is_not_shown_failed(
    bus, bare_router, tmp_path
):
    await SimNode(bus, inventory("n1", gpus=1)).register()
    await serve(bus, _big_model(), 1)
    member = records.ReplicaMember(node="n1", rank=0, gpus=["GPU-n1-00"], port=18000)
    replica = records.Replica(
        model="llama-405b", rid="r1", profile="tp16", members=[member], phase="starting"
    )
    await bus.put(keys.replica("llama-405b", "r1"), replica)
    why = "waiting: GPU GPU-n1-00 has 10.0 GB free, less than the 40 GB this replica is given"
    shard = records.Shard(
        node="n1", rid="r1", model="llama-405b", generation=1, phase="validating", since=1.0,
        reason=why,
    )  # fmt: skip
    await bus.put(keys.shard("n1", "r1"), shard)
    async with browser(tmp_path) as open_tab, open_tab(bare_router.url + "/") as tab:
        waiting = await tab.until(
            '(() => { const w = document.querySelector(\'[data-replica="r1"] '
            "[data-role=waiting]'); return w && w.textContent; })()"
        )
        assert waiting == f"n1: {why}"
        assert await tab.evaluate(
            "document.querySelector('[data-replica=\"r1\"] [data-role=failure]') === null"
        )


async def test_once_a_key_exists_the_page_asks_for_one_and_shows_the_fleet_only_with_it(
    bus, bare_router, tmp_path
):
    await SimNode(bus, inventory("n1", gpus=1)).register()
    async with browser(tmp_path) as open_tab, open_tab(bare_router.url + "/") as tab:
        await tab.until("document.querySelector('[data-node=\"n1\"]') !== null")
        secret = credentials.new_secret("alice")
        record = records.ApiKey(name="alice", secrets=[credentials.hash_secret(secret)])
        await bus.put(keys.apikey("alice"), record)
        await tab.until("!document.getElementById('key-form').hidden")
        # what it showed before is gone with the access
        assert await tab.evaluate("document.querySelector('[data-node]') === null")
        assert await tab.evaluate("document.getElementById('status').dataset.state") == "locked"

        give = "document.getElementById('key').value = {!r}; document.getElementById('key-form').requestSubmit()"
        await tab.evaluate(give.format(secret[:-1] + ("0" if secret[-1] != "0" else "1")))
        why = await tab.until(
            "!document.getElementById('key-form').hidden && document.getElementById('key-why').textContent"
        )
        assert "llmgw key create" in why  # the router's own 401, said on the page
        await tab.evaluate(give.format(secret))
        await tab.until("document.querySelector('[data-node=\"n1\"]') !== null")
        assert await tab.evaluate("document.getElementById('key-form').hidden")
        assert await tab.evaluate("sessionStorage.getItem('llmgw-fleet-key')") == secret


DOCUMENTED = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()


async def _scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics parsed by prometheus_client: sample name -> labels -> value. Every family
    it carries is one docs/metrics.md documents."""
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = await r.text()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        assert f"`{family.name}" in DOCUMENTED, f"{family.name} is not in docs/metrics.md"
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_controller_and_agent_metrics_parse_and_carry_the_documented_series(fleet):
    await until(lambda: _served(fleet), timeout=30)
    await until(lambda: _explained(fleet))

    async def controller_metrics():
        m = await _scrape(f"http://127.0.0.1:{fleet.controller.metrics_port}/metrics")
        ready = m["llmgw_controller_nodes"].get((("phase", "ready"),))
        serving = m["llmgw_controller_replicas"].get((("phase", "ready"),))
        return m if ready == 4 and serving == 1 else None

    m = await until(controller_metrics)
    assert m["llmgw_controller_leading"][()] == 1
    assert m["llmgw_controller_nodes"][(("phase", "lost"),)] == 0
    assert m["llmgw_controller_replicas"][(("phase", "failed"),)] == 0
    assert m["llmgw_controller_placement_passes_total"][()] >= 1
    assert m["llmgw_controller_placement_pass_seconds_count"][()] >= 1
    assert m["llmgw_controller_unplaced_replicas"] == {
        (("model", "llama-405b"), ("reason", "gpus")): 1
    }
    assert m["llmgw_controller_refused_nodes"][(("model", "llama-405b"), ("reason", "gpus"))] >= 3

    async def agent_metrics():
        m = await _scrape(f"http://127.0.0.1:{fleet.agent.metrics_port}/metrics")
        scanned = m.get("llmgw_agent_weights_scan_seconds_count", {}).get((), 0)
        return m if scanned >= 1 else None

    m = await until(agent_metrics)
    assert m["llmgw_agent_node"] == {(("node", "gpu-a"),): 1}
    assert m["llmgw_agent_engines"][(("phase", "ready"),)] == 1
    assert m["llmgw_agent_engines"][(("phase", "failed"),)] == 0
    ((labels, restarts),) = m["llmgw_agent_engine_restarts"].items()
    assert dict(labels)["model"] == "tiny" and restarts == 0
    assert m["llmgw_agent_weights_scan_running_seconds"][()] >= 0

    # the router's, on its API port, parse the same way
    assert await _chat(fleet.router) == 200
    m = await _scrape(f"{fleet.router.url}/metrics")
    assert sum(m["llmgw_router_requests_total"].values()) >= 1


async def test_the_page_of_an_up_sim_fleet_follows_a_node_killed_in_the_fleet_file(tmp_path):
    """`llmgw up --sim` as a newcomer runs it: the page shows every node and model the
    bucket holds, and a node killed by editing the fleet file turns unreachable on the
    page, without a reload."""
    import json
    import tomllib

    from up_sim import FLEET, ROOT, up_sim

    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(FLEET.read_text())
    # every model of the catalog the bucket holds, placed or not
    catalog_file = tomllib.loads((ROOT / "examples" / "sim-catalog.toml").read_text())
    models = sorted(m["id"] for m in catalog_file["models"])
    # starting and stopping it block this event loop, which has nothing else to run then;
    # the CLI runs in a worker thread
    with up_sim(fleet_file, tmp_path, "--poll", "0.2") as up:
        await anyio.to_thread.run_sync(up.run, "catalog", "apply", "examples/sim-catalog.toml")
        await anyio.to_thread.run_sync(up.run, "place", "qwen3-8b", "--replicas", "1", "--wait")
        view = json.loads(await anyio.to_thread.run_sync(up.run, "status", "--json"))
        nodes = sorted(view["nodes"])
        assert len(nodes) == 12 and "qwen3-8b" in models and len(models) > 1
        async with browser(tmp_path) as open_tab, open_tab(up.http_url + "/") as tab:
            nodes_js = "[...document.querySelectorAll('[data-node]')].map(e => e.dataset.node)"
            shown = await tab.until(
                f"(() => {{ const n = {nodes_js}.sort(); return n.length === {len(nodes)} && n; }})()"
            )
            assert shown == nodes
            shown_models = await tab.evaluate(
                "[...document.querySelectorAll('[data-model]')].map(e => e.dataset.model).sort()"
            )
            assert shown_models == models
            assert "1/1 ready" in await tab.evaluate(
                "document.querySelector('[data-model=\"qwen3-8b\"]').textContent"
            )
            await tab.screenshot(artifacts_dir() / "fleet-page-sim.png")

            cpu_02 = "document.querySelector('[data-node=\"cpu-02\"]').dataset.phase"
            assert await tab.until(f"{cpu_02} === 'ready'")
            rendered = await tab.evaluate("Number(document.body.dataset.rendered)")
            text = fleet_file.read_text()
            fleet_file.write_text(
                text.replace('name = "cpu-02"\n', 'name = "cpu-02"\nstate = "dead"\n')
            )
            # three missed heartbeats (15 s) before the controller says unreachable
            phase = await tab.until(
                f"(() => {{ const p = {cpu_02}; return p !== 'ready' && p; }})()", timeout=60
            )
            assert phase == "unreachable"
            assert await tab.evaluate("Number(document.body.dataset.rendered)") > rendered
            assert await tab.evaluate("performance.getEntriesByType('navigation').length") == 1
            await tab.screenshot(artifacts_dir() / "fleet-page-sim-node-killed.png")
