"""Shared GPUs and MIG devices as a person sees them: per GPU, the replicas sharing it and
their allotments, other programs' memory and what is left (placement's rule,
llmgw.allotment.room), an engine over its allotment named; in the read model, `llmgw
status` (text and --json) and the fleet page's document. GPUs are recorded NVML answers."""

from __future__ import annotations

import time
from importlib import resources

import msgspec
import pytest
from aiohttp import web
from chromium import artifacts_dir, browser
from record_helpers import shard
from samples.nvml import H100_UUIDS, RecordedNvml
from test_discovery_gpus import Lookup

from llmgw.agent.discovery.gpus import discover_gpus
from llmgw.bus import records
from llmgw.bus.server import free_port
from llmgw.cli.status import render
from llmgw.controller.metrics import shared_gpus
from llmgw.controller.placement.nodes import SHARE_HEADROOM
from llmgw.fleetstate import build
from llmgw.fleetstate.decode import FleetRecords
from llmgw.router.fleet import encode_state, fleet_state
from llmgw.sim.bare import inventory
from llmgw.sim.nvml import H200_MEMORY_TOTAL, H200_NAME

GB = 1_000_000_000
NODE = "h200-01"
SHARED_GPU = H100_UUIDS[0]  # the recorded node's UUIDs, whatever the model
FOREIGN_PID = 4949
ENGINES = {7001: 3 * GB, 7002: 18 * GB, 7003: 25 * GB}  # the third outgrew its 20 GB


def _records(*, outgrown: bool = True, foreign_gb: float = 65) -> FleetRecords:
    """An H200 shared by three 20 GB replicas beside a 65 GB PyTorch process, and a card
    in MIG mode with two 1g.18gb devices, one running a fourth engine."""
    held = [(FOREIGN_PID, int(foreign_gb * GB)), *ENGINES.items()]
    nvml = RecordedNvml(
        count=2,
        name=H200_NAME,
        memory_total=H200_MEMORY_TOTAL,
        processes={0: held},
        mig={1: ["1g.18gb", "1g.18gb"]},
        mig_processes={(1, 1): [(7004, 6 * GB)]},
    )
    names = {FOREIGN_PID: "python3"} | dict.fromkeys([*ENGINES, 7004], "llama-server")
    inv = inventory(NODE, gpus=0)
    inv.gpus = discover_gpus(nvml, Lookup(names, own={*ENGINES, 7004}))
    mig = inv.gpus.devices[2]
    replicas, shards = {}, {}
    for i, pid in enumerate([*ENGINES, 7004], start=1):
        rid = f"r{i}"
        gpu = SHARED_GPU if pid in ENGINES else mig.uuid
        member = records.ReplicaMember(
            node=NODE, rank=0, gpus=[gpu], port=18000 + i, gpu_bytes=(20 if i < 4 else 10) * GB
        )
        replicas[rid] = records.Replica(
            model="small" if i < 4 else "tiny",
            rid=rid,
            profile="p",
            members=[member],
            phase="ready",
            endpoint=f"10.0.0.1:{18000 + i}",
        )
        used = ENGINES.get(pid, 6 * GB)
        shards[(NODE, rid)] = shard(
            NODE,
            rid,
            "ready",
            model=replicas[rid].model,
            since=0.0,
            pid=pid,
            gpu_used_bytes=used,
            gpu_allotted_bytes=member.gpu_bytes,
            gpu_outgrown=outgrown and pid == 7003,
        )
    return FleetRecords(nodes={NODE: inv}, replicas=replicas, shards=shards)


def test_a_gpu_shared_by_three_replicas_beside_another_program_says_what_is_left():
    view = build.fleet(_records(), now=100.0)
    gpu = view.nodes[NODE].gpus[0]

    assert gpu.uuid == SHARED_GPU and gpu.allocated is None
    assert [(a.model, a.replica, a.bytes, a.used_bytes, a.outgrown) for a in gpu.shared] == [
        ("small", "r1", 20 * GB, 3 * GB, False),
        ("small", "r2", 20 * GB, 18 * GB, False),
        ("small", "r3", 20 * GB, 25 * GB, True),
    ]
    assert gpu.foreign_bytes == 65 * GB
    # an engine that outgrew its allotment takes what it holds, as placement counts it
    assert gpu.allotted_bytes == 65 * GB
    assert gpu.left_bytes == H200_MEMORY_TOTAL - 65 * GB - 65 * GB - SHARE_HEADROOM
    assert view.nodes[NODE].gpus_free == 1  # the idle MIG device; a shared GPU is not free


def test_status_text_lists_the_replicas_on_a_shared_gpu_and_names_the_one_outgrown():
    text = render(build.fleet(_records(), now=100.0), now=100.0)
    lines = [line.strip() for line in text.splitlines()]

    left = (H200_MEMORY_TOTAL - 130 * GB - SHARE_HEADROOM) / GB
    assert (
        "GPU 0: in use 111.6 of 150.8 GB (llmgw 46.0, others 65.0, unaccounted 0.6); "
        f"shared by 3 replicas, 65.0 GB allotted, left {left:.1f} GB"
    ) in lines
    assert "small r1: 20.0 GB allotted, holds 3.0" in lines
    assert (
        "small r3: 20.0 GB allotted, holds 25.0; OUTGROWN its allotment by more than the "
        "margin (2.0 GB); not stopped"
    ) in lines
    # and under its model, on the shard's node
    assert (
        f"{NODE}: engine outgrew its GPU allotment: holds 25.0 GB, given 20.0 GB "
        "(margin 2.0 GB); not stopped"
    ) in lines


def test_status_text_names_no_engine_outgrown_when_none_is():
    text = render(build.fleet(_records(outgrown=False), now=100.0), now=100.0)
    assert "OUTGROWN" not in text and "outgrew" not in text


def test_a_mig_device_line_names_its_profile_and_parent():
    text = render(build.fleet(_records(), now=100.0), now=100.0)
    lines = [line.strip() for line in text.splitlines()]

    idle, busy = [line for line in lines if line.startswith("MIG 1g.18gb of GPU 1 ")]
    name = f"MIG 1g.18gb of GPU 1 (parent {H100_UUIDS[1]}, 1 slice): in use "
    assert idle.startswith(name) and "shared" not in idle
    assert busy.startswith(name)
    assert busy.endswith("; shared by 1 replica, 10.0 GB allotted, left 6.4 GB")
    assert lines[lines.index(busy) + 1] == "tiny r4: 10.0 GB allotted, holds 6.0"


def test_status_json_carries_the_sharing_per_gpu_and_the_mig_parent():
    view = build.fleet(_records(), now=100.0)
    doc = msgspec.json.decode(msgspec.json.encode(view))  # what `status --json` prints
    gpus = doc["nodes"][NODE]["gpus"]

    assert [a["replica"] for a in gpus[0]["shared"]] == ["r1", "r2", "r3"]
    assert gpus[0]["allotted_bytes"] == 65 * GB
    assert gpus[0]["left_bytes"] == H200_MEMORY_TOTAL - 130 * GB - SHARE_HEADROOM
    assert [a["outgrown"] for a in gpus[0]["shared"]] == [False, False, True]
    assert [(g["mig_profile"], g["parent_uuid"]) for g in gpus[1:]] == [
        ("1g.18gb", H100_UUIDS[1]),
        ("1g.18gb", H100_UUIDS[1]),
    ]
    shards = {r["rid"]: r["shards"][0] for m in doc["models"].values() for r in m["replicas"]}
    assert shards["r3"]["gpu_outgrown"] is True and shards["r3"]["gpu_used_bytes"] == 25 * GB


def test_the_pages_document_shows_every_replica_on_a_shared_gpu():
    state = msgspec.json.decode(encode_state(fleet_state(_records(), {}, 100.0, {})))
    (node,) = state["fabrics"][0]["nodes"]
    gpu = node["gpus"][0]

    assert [(a["model"], a["replica"], a["bytes"]) for a in gpu["shared"]] == [
        ("small", f"r{i}", 20 * GB) for i in (1, 2, 3)
    ]
    assert gpu["foreign_bytes"] == 65 * GB
    assert gpu["left_bytes"] == H200_MEMORY_TOTAL - 130 * GB - SHARE_HEADROOM
    assert [a["replica"] for a in gpu["shared"] if a["outgrown"]] == ["r3"]
    assert node["gpus"][1]["parent_uuid"] == H100_UUIDS[1]


def test_a_shared_gpu_whose_other_program_grew_says_how_far_over_it_is():
    # the PyTorch process grew from 65 to 95 GB under the three replicas: nothing is left,
    # and the line says by how much the GPU is over (placement then puts no more there)
    view = build.fleet(_records(foreign_gb=95), now=100.0)
    over = 65 * GB + 95 * GB + SHARE_HEADROOM - H200_MEMORY_TOTAL
    assert view.nodes[NODE].gpus[0].left_bytes == -over
    line = render(view, now=100.0).splitlines()
    assert any(
        x.strip().startswith("GPU 0: ")
        and x.endswith(
            f"shared by 3 replicas, 65.0 GB allotted, left none ({over / GB:.1f} GB over: "
            "others grew, or an engine outgrew its allotment)"
        )
        for x in line
    )


def test_a_shared_gpu_out_of_service_has_nothing_left_and_says_why():
    r = _records()
    r.ops[NODE] = records.NodeOps(node=NODE, gpus_out=[SHARED_GPU])
    gpu = build.fleet(r, now=100.0).nodes[NODE].gpus[0]
    assert gpu.left_bytes is None and len(gpu.shared) == 3
    text = render(build.fleet(r, now=100.0), now=100.0)
    assert "shared by 3 replicas, 65.0 GB allotted, left none; out of service" in text


def test_a_gpu_given_whole_has_nothing_left_to_share():
    r = _records()
    r.replicas["r1"] = msgspec.structs.replace(
        r.replicas["r1"],
        members=[records.ReplicaMember(node=NODE, rank=0, gpus=[SHARED_GPU], port=18001)],
    )
    del r.replicas["r2"], r.replicas["r3"]
    gpu = build.fleet(r, now=100.0).nodes[NODE].gpus[0]
    assert gpu.allocated is not None and gpu.allocated.whole and gpu.shared == []
    assert gpu.left_bytes is None


def test_the_controllers_metrics_carry_each_shared_gpus_parts_and_the_engines_outgrown():
    families = {f.name: f for f in shared_gpus(_records())}
    memory = {
        (s.labels["gpu"], s.labels["part"]): s.value
        for s in families["llmgw_controller_shared_gpu_bytes"].samples
        if s.labels["node"] == NODE
    }
    assert memory[(SHARED_GPU, "allotted")] == 65 * GB
    assert memory[(SHARED_GPU, "others")] == 65 * GB
    assert memory[(SHARED_GPU, "left")] == H200_MEMORY_TOTAL - 130 * GB - SHARE_HEADROOM
    assert memory[(SHARED_GPU, "total")] == H200_MEMORY_TOTAL
    replicas = {
        (s.labels["gpu"], s.labels["mig_profile"]): s.value
        for s in families["llmgw_controller_shared_gpu_replicas"].samples
    }
    # the idle MIG device and GPUs no shared replica is on are no series
    assert sorted(replicas.values()) == [1, 3] and replicas[(SHARED_GPU, "")] == 3
    assert [
        (s.labels["model"], s.value) for s in families["llmgw_controller_engines_outgrown"].samples
    ] == [
        ("small", 1),
        ("tiny", 0),
    ]


async def _page_server(state: bytes, port: int) -> web.AppRunner:
    """The page's own files, and a document to poll: the page as a router serves it, for a
    fleet written here rather than read from a bucket."""
    static = resources.files("llmgw.router") / "static"
    files = {
        "/": ("fleet.html", "text/html"),
        "/fleet/fleet.js": ("fleet.js", "text/javascript"),
        "/fleet/fleet.css": ("fleet.css", "text/css"),
    }

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/fleet/state":
            return web.Response(body=state, content_type="application/json")
        name, kind = files[request.path]
        return web.Response(body=(static / name).read_bytes(), content_type=kind)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.anyio
async def test_the_page_shows_the_replicas_on_a_shared_gpu_and_a_mig_devices_parent(tmp_path):
    router = {"source": "nats", "nats": "", "models": 2, "models_ready": 2, "poll_s": 60}
    state = encode_state(fleet_state(_records(), {}, time.time(), router))
    port = free_port()
    runner = await _page_server(state, port)
    try:
        async with browser(tmp_path) as open_tab, open_tab(f"http://127.0.0.1:{port}/") as tab:
            gpu = f"document.querySelector('[data-uuid=\"{SHARED_GPU}\"]')"
            text = await tab.until(f"{gpu} && {gpu}.textContent")
            left = (H200_MEMORY_TOTAL - 130 * GB - SHARE_HEADROOM) / GB
            assert f"shared by 3 replicas, 65.0 GB allotted, left {left:.1f} GB" in text
            assert "others 65.0 GB" in text and "python3 65.0 GB" in text
            shown = await tab.evaluate(
                f"[...{gpu}.querySelectorAll('[data-replica]')].map(e => e.textContent)"
            )
            assert shown[0] == "small r1: 20.0 GB allotted, holds 3.0 GB"
            assert len(shown) == 3 and "outgrew its allotment" in shown[2]
            assert await tab.evaluate(
                f"[...{gpu}.querySelectorAll('[data-outgrown]')].map(e => e.dataset.replica)"
            ) == ["r3"]
            # and under its model
            assert await tab.evaluate(
                "[...document.querySelectorAll('[data-role=outgrown]')].map(e => e.textContent)"
            ) == [
                f"{NODE}: engine outgrew its GPU allotment: holds 25.0 GB, given 20.0 GB; "
                "not stopped"
            ]
            migs = await tab.evaluate(
                "[...document.querySelectorAll('[data-role=mig]')].map(e => e.textContent)"
            )
            assert migs == [f"MIG 1g.18gb of GPU 1 (parent {H100_UUIDS[1]}, 1 slice) "] * 2
            await tab.screenshot(artifacts_dir() / "fleet-page-shared-gpu.png")
    finally:
        await runner.cleanup()
