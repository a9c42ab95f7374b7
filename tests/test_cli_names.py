"""Names at the CLI that name nothing: a node id no inventory names, a served name given for
a model id, a typo of either. Each is refused before anything is written, saying what was
probably meant. The real `llmgw` command against a real nats-server."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import pytest

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, decoder
from llmgw.catalog import encode_model, validate_models
from llmgw.sim.bare import inventory

pytestmark = pytest.mark.anyio

LLMGW = [sys.executable, "-m", "llmgw.cli"]


async def _llmgw(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMGW_NATS": url}
    return await anyio.to_thread.run_sync(
        lambda: subprocess.run([*LLMGW, *args], capture_output=True, text=True, env=env, timeout=60)
    )


async def _ops(bus: Bus, node: str) -> records.NodeOps | None:
    entry = await bus.get(keys.ops(node), decoder(records.NodeOps))
    return entry.value if entry else None


@pytest.mark.parametrize(
    "verb",
    [["cordon"], ["cordon", "--gpu", "0"], ["uncordon"], ["taint", "x"], ["untaint", "x"]],
)
async def test_a_node_verb_refuses_a_node_no_inventory_names_unless_forced(bus, nats_server, verb):
    url = nats_server.url
    for node in ("h100-a-01", "h100-a-02", "cpu-01"):
        await bus.put(keys.node(node), inventory(node, gpus=1))
    out = await _llmgw(url, "node", verb[0], "h100-a-1", *verb[1:])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    said = " ".join(out.stderr.split())
    assert "no node 'h100-a-1' has reported to this bucket, so nothing was written" in said
    assert "did you mean 'h100-a-01'? known nodes: cpu-01, h100-a-01, h100-a-02" in said
    assert f"`llmgw node {verb[0]} h100-a-1 --force`" in said
    assert await _ops(bus, "h100-a-1") is None

    if verb in (["cordon"], ["taint", "x"]):  # a node yet to join, named on purpose
        out = await _llmgw(url, "node", verb[0], "h100-a-1", *verb[1:], "--force")
        assert out.returncode == 0, out.stderr
        assert "(no inventory: its agent has not reported)" in out.stdout
        assert await _ops(bus, "h100-a-1") is not None


async def test_drain_refuses_a_node_no_inventory_names_and_an_ops_record_makes_it_known(
    bus, nats_server
):
    url = nats_server.url
    await bus.put(keys.node("gpu-01"), inventory("gpu-01", gpus=1))
    out = await _llmgw(url, "node", "drain", "gpu-02")
    assert out.returncode == 2
    said = " ".join(out.stderr.split())
    assert "did you mean 'gpu-01'? known nodes: gpu-01" in said
    assert "`llmgw node cordon gpu-02 --force` (a node yet to join has nothing to drain)" in said
    assert await _ops(bus, "gpu-02") is None
    # cordoned before it joined: known by its ops record, uncordoned without --force
    assert (await _llmgw(url, "node", "cordon", "gpu-02", "--force")).returncode == 0
    out = await _llmgw(url, "node", "uncordon", "gpu-02")
    assert out.returncode == 0, out.stderr
    assert await _ops(bus, "gpu-02") is None


def _model(mid: str, served: str) -> bytes:
    raw = {
        "id": mid,
        "served_name": served,
        "profiles": [
            {
                "name": "cpu",
                "engine": "llama-server",
                "weights": {"path": "/m/x.gguf"},
                "gpus_per_node": 0,
                "host_ram_gb": 1,
            }
        ],
    }
    return encode_model(validate_models({"models": [raw]})[0])


async def catalog_entries(bus: Bus, *served: tuple[str, str]) -> None:
    """Catalog entries (id, served name), for the names keys and teams are given."""
    for mid, name in served:
        await bus.put(keys.catalog(mid), _model(mid, name))


async def test_place_given_a_served_name_or_a_typo_says_which_model_id_was_meant(bus, nats_server):
    url = nats_server.url
    await bus.put(keys.catalog("qwen3-8b"), _model("qwen3-8b", "Qwen/Qwen3-8B"))
    await bus.put(keys.catalog("phi3-mini"), _model("phi3-mini", "phi3"))
    out = await _llmgw(url, "place", "Qwen/Qwen3-8B", "--replicas", "1")
    assert out.returncode == 2, out.stderr
    said = " ".join(out.stderr.split())
    assert "'Qwen/Qwen3-8B' is the served name of model 'qwen3-8b'" in said
    assert "not a valid id" not in said
    out = await _llmgw(url, "place", "qwen3-8", "--replicas", "1", "--dry-run")
    assert out.returncode == 2
    said = " ".join(out.stderr.split())
    assert "model 'qwen3-8' is not in the catalog" in said
    assert "did you mean 'qwen3-8b'? known model ids: phi3-mini, qwen3-8b" in said
    assert not await bus.list(keys.pattern(keys.DESIRED), decoder(records.Desired))


async def test_rollout_status_of_a_model_that_does_not_exist_says_so(bus, nats_server):
    url = nats_server.url
    await bus.put(keys.catalog("qwen3-8b"), _model("qwen3-8b", "Qwen/Qwen3-8B"))
    out = await _llmgw(url, "rollout", "status", "qwen3-8")
    assert out.returncode == 2
    said = " ".join(out.stderr.split())
    assert "model 'qwen3-8' is not in the catalog" in said and "did you mean 'qwen3-8b'?" in said
    assert "llmgw place" not in said
    # one that exists and was never placed is told to be placed
    out = await _llmgw(url, "rollout", "status", "qwen3-8b")
    assert out.returncode == 1
    assert "no rollout recorded for 'qwen3-8b'" in out.stderr and "llmgw place" in out.stderr
    out = await _llmgw(url, "rollout", "status", "Qwen/Qwen3-8B")
    assert "is the served name of model 'qwen3-8b'" in " ".join(out.stderr.split())


async def test_models_of_keys_and_teams_are_served_names_the_catalog_has(nats_server, bus):
    """A key given a model id, or a name no model serves, could use nothing (403 on the
    served name, 404 on the id): refused, saying the name meant."""
    url = nats_server.url
    await catalog_entries(bus, ("qwen3-8b", "Qwen/Qwen3-8B"), ("phi3-mini", "microsoft/Phi-3-mini"))
    by_id = await _llmgw(url, "key", "create", "alice", "--models", "qwen3-8b")
    assert by_id.returncode == 2, by_id.stderr
    assert "'qwen3-8b' is the id of a model" in by_id.stderr
    assert "its served name: Qwen/Qwen3-8B" in by_id.stderr
    typo = await _llmgw(url, "team", "create", "ml", "--models", "Qwen/Qwen3-8")
    assert typo.returncode == 2, typo.stderr
    assert "did you mean 'Qwen/Qwen3-8B'?" in typo.stderr
    assert "known served names: Qwen/Qwen3-8B, microsoft/Phi-3-mini" in typo.stderr
    assert "--allow-unknown-models" in typo.stderr
    assert await bus.get(keys.apikey("alice"), lambda b: b) is None
    assert await bus.get(keys.team("ml"), lambda b: b) is None

    made = await _llmgw(url, "key", "create", "alice", "--models", "Qwen/Qwen3-8B")
    assert made.returncode == 0, made.stderr
    unknown = await _llmgw(url, "key", "set", "alice", "--models", "llama-8b")
    assert unknown.returncode == 2 and "no model in the catalog serves 'llama-8b'" in unknown.stderr
    assert (await _llmgw(url, "team", "create", "ml")).returncode == 0
    by_id = await _llmgw(url, "team", "set", "ml", "--models", "phi3-mini")
    assert by_id.returncode == 2 and "served name: microsoft/Phi-3-mini" in by_id.stderr
    later = await _llmgw(
        url, "key", "set", "alice", "--models", "llama-8b", "--allow-unknown-models"
    )
    assert later.returncode == 0, later.stderr
    k = await bus.get(keys.apikey("alice"), lambda b: records.decode(b, records.ApiKey))
    assert k is not None and k.value.models == ["llama-8b"]
