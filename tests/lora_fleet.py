"""A fleet with LoRA adapters, for tests/test_lora_e2e.py, tests/test_real_vllm_lora.py and
bench/adapters.py: an agent process whose weights directories hold the adapters' files, a
base model of the fake (or real) engine, and adapters written as `llmgw adapter add` does."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anyio
import msgspec
from agent_helpers import FakeEngineAgent, agent_config, host_dirs, start_agent
from router_helpers import StreamingLoad
from waiting import until

from llmgw import catalog
from llmgw.agent.config import Engines, Weights
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.sim.fake_engine import install_fake_engines


def lora_agent(
    url: str,
    root: Path,
    weights: list[Path],
    *,
    node: str = "node1",
    address: str = "127.0.0.1",
    vllm_cpu: bool = False,
    bin_dir: Path | None = None,
) -> FakeEngineAgent:
    """An agent process looking for weights (and adapters) in `weights`, the fake engines on
    its PATH (or what `bin_dir` holds: a real vLLM), quick supervision."""
    dirs = host_dirs(root)
    if bin_dir is None:
        install_fake_engines(dirs["bin"], vllm_cpu=vllm_cpu)
    engines = Engines(
        listen_host=address,
        poll_interval=0.1,
        backoff_base=0.2,
        backoff_cap=2,
        stop_grace=5,
        drain_timeout=30,
    )
    cfg = agent_config(url, dirs, id=node, address=address)
    cfg = msgspec.structs.replace(
        cfg,
        engines=engines,
        weights=Weights(
            dirs=[str(w) for w in weights], fetch_dir=str(dirs["fetch"]), scan_interval=0.3
        ),
    )
    path = [bin_dir or dirs["bin"], Path("/usr/bin"), Path("/bin")]
    log = root / "agent.log"
    proc = start_agent(cfg, root / "agent.toml", path, log)
    return FakeEngineAgent(proc, cfg, dirs, path, log)


def gpu_base(slots: int, rank: int) -> catalog.Model:
    """Model `base` ("org/base") on one GPU of vLLM with room for `slots` adapters of
    `rank`: the simulated fleet's (tests/test_lora_sim.py, bench/adapters.py)."""
    profile = {
        "name": "gpu",
        "engine": "vllm",
        "weights": {"key": "org/base"},
        "gpus_per_node": 1,
        "gpu_memory_gb": 40,
        "host_ram_gb": 16,
        "adapter_slots": slots,
        "adapter_rank": rank,
    }
    entry = {"id": "base", "served_name": "org/base", "profiles": [profile]}
    return catalog.validate_models({"models": [entry]})[0]


def adapter(aid: str, path: Path | str, *, base: str = "tiny", rank: int = 8) -> catalog.Adapter:
    return catalog.check_adapter(
        {"id": aid, "served_name": f"acme/{aid}", "base": base, "path": str(path), "rank": rank}
    )


async def add_adapter(bus: Bus, a: catalog.Adapter) -> None:
    """What `llmgw adapter add` writes."""
    await bus.put(keys.adapter(a.id), catalog.encode_model(a))


async def shards_of(bus: Bus, model: str = "tiny") -> list[records.Shard]:
    got = await bus.list(keys.pattern(keys.SHARDS), decoder(records.Shard))
    return sorted((e.value for e in got.values() if e.value.model == model), key=lambda s: s.rid)


def served(router, name: str):
    """A check for `until`: the router has an engine for `name`."""

    async def check():
        route = router.table.route(name)
        return route is not None and bool(route.backends)

    return check


async def add_while_streaming(bus: Bus, router, new: catalog.Adapter, loads: list[StreamingLoad]):
    """Add `new` to a llama-server base while each of `loads` streams (two clients each), until
    it is served and every replica there was before is replaced (its launch changed)."""
    before = {s.rid for s in await shards_of(bus)}

    async def replaced():
        rids = {s.rid for s in await shards_of(bus)}
        return rids and not rids & before

    stop_load = anyio.Event()
    async with aiohttp.ClientSession() as http, anyio.create_task_group() as tg:
        for load in loads:
            tg.start_soon(load.run, http, 2, stop_load)
        await add_adapter(bus, new)
        await until(served(router, new.served_name), timeout=60)
        await until(replaced, timeout=60)
        stop_load.set()
