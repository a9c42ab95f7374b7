"""Adapters: the exact argv and environment each profile becomes, readiness and in-flight
parsing, and validation refusals. Argv is also run through the fake engine, which
refuses unknown flags as the real ones do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from llmgw.agent.engines import LaunchSpec, adapter_for
from llmgw.agent.engines.validate import NodeFacts, Problem, validate_launch
from llmgw.bus.records import EngineInstall, Gpu
from llmgw.sim.fake_engine import free_port, write_fake_gguf

UUIDS = [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(8)]


def refusals(spec: LaunchSpec, node: NodeFacts) -> list[str]:
    """What validation says, as a person reads it."""
    return [p.reason for p in validate_launch(spec, node)]


def gpus(n: int = 8, gb: float = 80) -> list[Gpu]:
    return [
        Gpu(
            index=i,
            name="NVIDIA H100 80GB HBM3",
            uuid=UUIDS[i],
            memory_total_bytes=int(gb * 1.0695e9),  # what NVML reports for an "80 GB" card
            pci_bus_id=f"00000000:{i:02x}:00.0",
            compute_capability="9.0",
        )
        for i in range(n)
    ]


@pytest.fixture
def node(bins: dict[str, Path]) -> NodeFacts:
    return NodeFacts(
        gpus=gpus(),
        engines=[
            EngineInstall(name="llama-server", path=str(bins["llama-server"]), version="9439"),
            EngineInstall(name="vllm", path=str(bins["vllm"]), version="0.11.2"),
        ],
    )


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_fake_gguf(tmp_path / "models" / "qwen3-8b-q4_k_m.gguf")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models" / "Llama-3.3-70B-Instruct"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def llama_spec(binary: str, gguf: Path, **kw) -> LaunchSpec:
    base = dict(
        served_name="qwen3-8b",
        engine="llama-server",
        binary=binary,
        port=free_port(),
        host="127.0.0.1",
        weights_path=str(gguf),
        fetch_dir="/var/lib/llmgw-weights",
        gpu_uuids=(UUIDS[3],),
        gpu_memory_gb=24,
        context=16384,
        parallel=4,
    )
    base.update(kw)
    return LaunchSpec(**base)


def vllm_spec(binary: str, model_dir: Path, **kw) -> LaunchSpec:
    base = dict(
        served_name="llama-3.3-70b",
        engine="vllm",
        binary=binary,
        port=free_port(),
        host="127.0.0.1",
        weights_path=str(model_dir),
        fetch_dir="/var/lib/llmgw-weights",
        gpu_uuids=tuple(UUIDS),
        gpu_memory_gb=80,
        context=32768,
    )
    base.update(kw)
    return LaunchSpec(**base)


# --- argv and environment ----------------------------------------------------------------


def test_llama_single_gpu_argv_offloads_every_layer_to_the_assigned_gpu_by_uuid():
    spec = llama_spec("/opt/llama/llama-server", Path("/w/q.gguf"), port=9100, host="0.0.0.0")
    spec = replace(spec, extra_args=("-fa", "on"), env={"OMP_NUM_THREADS": "8"})
    cmd = adapter_for("llama-server").command(spec)
    assert cmd.argv == [
        "/opt/llama/llama-server",
        "-m", "/w/q.gguf",
        "--host", "0.0.0.0", "--port", "9100",
        "-ngl", "999",
        "-c", "16384", "-np", "4",
        "--alias", "qwen3-8b", "--metrics",
        "-fa", "on",
    ]  # fmt: skip
    assert cmd.env == {
        "OMP_NUM_THREADS": "8",
        "CUDA_VISIBLE_DEVICES": UUIDS[3],
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "LLAMA_CACHE": "/var/lib/llmgw-weights",
    }
    assert cmd.base_url == "http://127.0.0.1:9100"


def test_llama_cpu_profile_hides_every_gpu_and_offloads_nothing():
    spec = llama_spec("llama-server", Path("/w/q.gguf"), gpu_uuids=(), port=9101, fetch_dir=None)
    cmd = adapter_for("llama-server").command(spec)
    assert cmd.argv[cmd.argv.index("-ngl") + 1] == "0"
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == ""
    assert "LLAMA_CACHE" not in cmd.env


def test_llama_download_source_uses_hf_and_lands_in_the_fetch_dir():
    spec = llama_spec(
        "llama-server", Path("/x"), weights_path=None, download_source="Qwen/Qwen3-8B-GGUF:Q4_K_M"
    )
    cmd = adapter_for("llama-server").command(spec)
    assert cmd.argv[1:3] == ["-hf", "Qwen/Qwen3-8B-GGUF:Q4_K_M"]
    assert "-m" not in cmd.argv
    assert cmd.env["LLAMA_CACHE"] == "/var/lib/llmgw-weights"


def test_catalog_source_forms_become_the_engines_download_flags():
    def argv(engine: str, source: str) -> list[str]:
        make = llama_spec if engine == "llama-server" else vllm_spec
        spec = make(engine, Path("/x"), weights_path=None, download_source=source)
        return adapter_for(engine).command(spec).argv

    assert argv("llama-server", "hf://Qwen/Qwen3-8B-GGUF:Q4_K_M")[1:3] == [
        "-hf",
        "Qwen/Qwen3-8B-GGUF:Q4_K_M",
    ]
    url = "https://example.org/models/tiny.gguf"
    assert argv("llama-server", url)[1:3] == ["-mu", url]
    assert argv("vllm", "hf://Qwen/Qwen3-8B")[1:3] == ["serve", "Qwen/Qwen3-8B"]


def test_download_sources_an_engine_cannot_fetch_are_refused(bins, node):
    vllm_url = vllm_spec(
        str(bins["vllm"]), Path("/x"), weights_path=None, download_source="https://x.org/m.gguf"
    )
    assert "vLLM downloads from the Hub only" in refusals(vllm_url, node)[0]
    llama_bad = llama_spec(
        str(bins["llama-server"]), Path("/x"), weights_path=None, download_source="s3://b/m.gguf"
    )
    assert "neither hf://org/name[:QUANT] nor an http(s) URL" in refusals(llama_bad, node)[0]


def test_api_key_travels_in_the_environment_not_in_argv():
    for spec in (
        llama_spec("llama-server", Path("/w/q.gguf"), api_key="s3cret"),
        vllm_spec("vllm", Path("/w/m"), api_key="s3cret"),
    ):
        cmd = adapter_for(spec.engine).command(spec)
        assert "s3cret" not in " ".join(cmd.argv)
        assert "s3cret" in cmd.env.values()


def test_vllm_tp8_argv_defaults_tensor_parallel_to_the_gpus_of_the_node():
    spec = vllm_spec("/opt/vllm/bin/vllm", Path("/w/Llama-3.3-70B"), port=8000, host="0.0.0.0")
    cmd = adapter_for("vllm").command(spec)
    assert cmd.argv == [
        "/opt/vllm/bin/vllm", "serve", "/w/Llama-3.3-70B",
        "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "llama-3.3-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
        "--download-dir", "/var/lib/llmgw-weights",
        "--max-model-len", "32768",
    ]  # fmt: skip
    assert cmd.env == {"CUDA_VISIBLE_DEVICES": ",".join(UUIDS), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_vllm_parallel_bounds_concurrent_sequences():
    cmd = adapter_for("vllm").command(vllm_spec("vllm", Path("/w/m"), parallel=64))
    assert cmd.argv[cmd.argv.index("--max-num-seqs") + 1] == "64"


def test_vllm_two_nodes_rank0_serves_and_rank1_joins_headless_over_the_fabric():
    common = dict(
        nodes=2,
        master_addr="10.0.0.5",
        ib_hcas=("mlx5_0", "mlx5_1"),
        socket_ifname="ib0",
        host_ip="10.0.0.5",
        download_source="meta-llama/Llama-3.1-405B-Instruct",
        weights_path=None,
        port=8000,
        host="0.0.0.0",
    )
    rank0 = adapter_for("vllm").command(vllm_spec("vllm", Path("/x"), rank=0, **common))
    assert rank0.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-405B-Instruct",
        "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "llama-3.3-70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--download-dir", "/var/lib/llmgw-weights",
        "--max-model-len", "32768",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5",
    ]  # fmt: skip
    assert rank0.env == {
        "CUDA_VISIBLE_DEVICES": ",".join(UUIDS),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
        "VLLM_HOST_IP": "10.0.0.5",
    }
    rank1_spec = vllm_spec("vllm", Path("/x"), rank=1, **{**common, "host_ip": "10.0.0.6"})
    rank1 = adapter_for("vllm").command(rank1_spec)
    assert rank1.argv == [
        "vllm", "serve", "meta-llama/Llama-3.1-405B-Instruct",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
        "--download-dir", "/var/lib/llmgw-weights",
        "--max-model-len", "32768",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.5",
        "--headless",
    ]  # fmt: skip
    assert rank1.env["VLLM_HOST_IP"] == "10.0.0.6"
    assert rank1.base_url is None  # no HTTP on headless ranks


# --- readiness and in-flight parsing (the answers real engines give) ---------------------


def test_llama_is_loading_while_health_answers_503_and_ready_on_200():
    a = adapter_for("llama-server")
    spec = llama_spec("llama-server", Path("/w/q.gguf"))
    loading = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
    assert a.readiness(spec, {}).ready is False
    probe = a.readiness(spec, {"/health": (503, loading)})
    assert probe.ready is False and "Loading model" in probe.detail
    assert a.readiness(spec, {"/health": (200, b'{"status":"loading model"}')}).ready is False
    assert a.readiness(spec, {"/health": (200, b'{"status":"ok"}')}).ready is True


def test_vllm_is_ready_only_when_models_lists_the_served_name():
    a = adapter_for("vllm")
    spec = vllm_spec("vllm", Path("/w/m"))
    other = json.dumps({"data": [{"id": "/w/m"}]}).encode()
    ours = json.dumps({"data": [{"id": "llama-3.3-70b"}]}).encode()
    assert a.readiness(spec, {"/health": (200, b"")}).ready is False
    probe = a.readiness(spec, {"/health": (200, b""), "/v1/models": (200, other)})
    assert probe.ready is False and "llama-3.3-70b" in probe.detail
    assert a.readiness(spec, {"/health": (200, b""), "/v1/models": (200, ours)}).ready is True
    headless = replace(spec, nodes=2, rank=1, master_addr="10.0.0.5")
    assert a.probe_paths(headless) == [] and a.readiness(headless, {}).ready is True


def test_in_flight_counts_running_and_queued_requests_across_label_sets():
    vllm_metrics = (
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running_total{engine="0"} 99\n'
    )
    assert adapter_for("vllm").in_flight("/metrics", 200, vllm_metrics) == 6
    llama = adapter_for("llama-server")
    assert llama.in_flight("/metrics", 200, b"llamacpp:requests_processing 1\n") == 1
    slots = json.dumps([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])
    assert llama.in_flight("/slots", 200, slots.encode()) == 1
    assert llama.in_flight("/metrics", 501, b"{}") is None


def test_an_engines_own_load_is_read_by_the_names_each_engine_uses():
    from llmgw.agent.engines.base import EngineGauges

    vllm = adapter_for("vllm")
    new = (
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.91\n'
    )
    assert vllm.gauges(new) == EngineGauges(running=4, waiting=7, kv_cache=0.91)
    # before 0.10 the KV cache gauge had another name (still a fraction)
    old = new.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert vllm.gauges(old) == EngineGauges(running=4, waiting=7, kv_cache=0.91)
    llama = adapter_for("llama-server")
    text = (
        "llamacpp:requests_processing 2\n"
        "llamacpp:requests_deferred 5\n"
        "llamacpp:kv_cache_usage_ratio 0.25\n"
    )
    assert llama.gauges(text) == EngineGauges(running=2, waiting=5, kv_cache=0.25)
    # an older build without the KV gauge; an answer that is not Prometheus text
    assert llama.gauges("llamacpp:requests_processing 1\n") == EngineGauges(1, None, None)
    assert llama.gauges("<html>not metrics</html>") is None


# --- validation ----------------------------------------------------------------------------


def test_valid_profiles_pass_validation(bins, node, gguf, model_dir):
    assert refusals(llama_spec(str(bins["llama-server"]), gguf), node) == []
    assert refusals(llama_spec(str(bins["llama-server"]), gguf, gpu_uuids=()), node) == []
    assert refusals(vllm_spec(str(bins["vllm"]), model_dir), node) == []
    two_nodes = vllm_spec(str(bins["vllm"]), model_dir, nodes=2, rank=1, master_addr="10.0.0.5")
    assert refusals(two_nodes, node) == []


def test_missing_model_file_is_refused_naming_the_path(bins, node, tmp_path):
    missing = tmp_path / "nope.gguf"
    reasons = refusals(llama_spec(str(bins["llama-server"]), missing), node)
    assert reasons == [
        f"weights file {missing} does not exist on this node; check the path or fetch it"
    ]


def test_gguf_directory_and_non_gguf_file_are_refused(bins, node, tmp_path, model_dir):
    reasons = refusals(llama_spec(str(bins["llama-server"]), model_dir), node)
    assert "is a directory" in reasons[0]
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"<html>rate limited</html>")
    assert "not a GGUF file" in refusals(llama_spec(str(bins["llama-server"]), bogus), node)[0]


@pytest.mark.parametrize(
    "extra, clash",
    [
        (("--port", "9000"), "--port"),
        (("--port=9000",), "--port"),
        (("-m", "/other.gguf"), "--model"),
        (("--alias", "x"), "--alias"),
        (("-ngl", "10"), "--n-gpu-layers"),
        (("--n-gpu-layers", "10"), "--n-gpu-layers"),
        (("-c", "8192"), "--ctx-size"),
    ],
)
def test_llama_extra_arg_clashing_with_a_managed_flag_is_refused(bins, node, gguf, extra, clash):
    spec = llama_spec(str(bins["llama-server"]), gguf, extra_args=extra)
    reasons = refusals(spec, node)
    assert len(reasons) == 1 and f"clashes with {clash}" in reasons[0], reasons


@pytest.mark.parametrize("extra", [("-tp", "4"), ("--tensor_parallel_size", "4"), ("--host=::",)])
def test_vllm_extra_arg_clashing_in_any_spelling_is_refused(bins, node, model_dir, extra):
    reasons = refusals(vllm_spec(str(bins["vllm"]), model_dir, extra_args=extra), node)
    assert len(reasons) == 1 and "clashes with" in reasons[0], reasons


def test_duplicated_flag_is_refused_even_through_an_alias(bins, node, gguf):
    spec = llama_spec(
        str(bins["llama-server"]), gguf, extra_args=("-fa", "on", "--flash-attn", "off")
    )
    assert refusals(spec, node) == ["extra arg --flash-attn repeats -fa; keep one"]
    repeatable = ("--override-kv", "a=int:1", "--override-kv", "b=int:-2", "-t", "-1")
    assert refusals(llama_spec(str(bins["llama-server"]), gguf, extra_args=repeatable), node) == []


def test_profile_env_setting_a_managed_variable_is_refused(bins, node, gguf):
    spec = llama_spec(
        str(bins["llama-server"]), gguf, env={"LLAMA_ARG_PORT": "1", "CUDA_VISIBLE_DEVICES": "0"}
    )
    reasons = refusals(spec, node)
    assert [r.split()[1] for r in reasons] == ["LLAMA_ARG_PORT", "CUDA_VISIBLE_DEVICES"]


def test_tensor_parallel_larger_than_assigned_gpus_is_refused(bins, node, model_dir):
    spec = vllm_spec(str(bins["vllm"]), model_dir, gpu_uuids=tuple(UUIDS[:4]), tensor_parallel=8)
    assert refusals(spec, node) == [
        "tensor_parallel 8 x pipeline_parallel 1 over 1 node(s) needs 8 GPUs on this node, 4 assigned"
    ]
    dp = vllm_spec(str(bins["vllm"]), model_dir, tensor_parallel=4, extra_args=("-dp", "4"))
    assert "needs 16 GPUs" in refusals(dp, node)[0]


def test_gpu_with_too_little_memory_or_not_on_the_node_is_refused(bins, model_dir):
    facts = NodeFacts(
        gpus=gpus(8, gb=40),
        engines=[EngineInstall(name="vllm", path=str(bins["vllm"]), version="0.11.2")],
    )
    spec = vllm_spec(
        str(bins["vllm"]), model_dir, gpu_uuids=(UUIDS[0], "GPU-missing"), tensor_parallel=2
    )
    reasons = refusals(spec, facts)
    assert (
        reasons[0]
        == f"GPU {UUIDS[0]} (NVIDIA H100 80GB HBM3) has 42.8 GB, the profile needs 80 GB per GPU"
    )
    assert reasons[1].startswith("GPU GPU-missing is not on this node")


def test_an_80gb_card_satisfies_an_80gb_profile(bins, node, model_dir):
    # NVML reports 79.6 GiB for an "80 GB" H100: GB here are the decimal ones on the box
    assert refusals(vllm_spec(str(bins["vllm"]), model_dir, gpu_memory_gb=80), node) == []


def test_port_in_use_is_refused(bins, node, gguf):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        reasons = refusals(llama_spec(str(bins["llama-server"]), gguf, port=port), node)
    assert reasons == [
        f"port {port} on 127.0.0.1 is in use by another process; a leftover engine? (see `ss -ltnp`)"
    ]


def test_port_in_use_is_the_one_problem_that_clears_by_itself(bins, node, gguf, tmp_path):
    # the agent retries a launch only when every problem is transient
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        held = validate_launch(llama_spec(str(bins["llama-server"]), gguf, port=port), node)
        missing = tmp_path / "nope.gguf"
        both = validate_launch(llama_spec(str(bins["llama-server"]), missing, port=port), node)
    assert [p.transient for p in held] == [True]
    assert [p.transient for p in both] == [False, True]
    assert isinstance(held[0], Problem) and str(held[0]) == held[0].reason
    # and the one the controller answers, by moving the replica to another port
    assert [p.refused for p in both] == ["", "port-in-use"]


def test_missing_binary_and_unknown_version_are_refused(bins, node, gguf, tmp_path):
    gone = tmp_path / "nowhere" / "llama-server"
    assert "not found on this node" in refusals(llama_spec(str(gone), gguf), node)[0]
    no_version = NodeFacts(
        gpus=node.gpus,
        engines=[EngineInstall(name="llama-server", path=str(bins["llama-server"]), version="")],
    )
    reasons = refusals(llama_spec(str(bins["llama-server"]), gguf), no_version)
    assert reasons == [
        f"llama-server at {bins['llama-server']} did not report a version; run "
        f"`{bins['llama-server']} --version` to see why (a missing shared library is the usual cause)"
    ]


def test_profile_without_weights_or_source_and_multinode_llama_are_refused(bins, node):
    spec = llama_spec(str(bins["llama-server"]), Path("/x"), weights_path=None, nodes=2)
    reasons = refusals(spec, node)
    assert "names neither a weights path" in reasons[0]
    assert "llama-server runs on one node" in reasons[1]


# --- the argv is what the engine accepts -------------------------------------------------


def _run_until_recorded(cmd, tmp_path: Path, extra_env: dict[str, str] | None = None) -> dict:
    record = tmp_path / f"record-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
    env = {**os.environ, **cmd.env, "FAKE_ENGINE_RECORD": str(record), **(extra_env or {})}
    proc = subprocess.Popen(cmd.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        import time

        deadline = time.monotonic() + 20
        while not record.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert record.exists(), (
            proc.stdout.read().decode() if proc.poll() is not None else "no record"
        )
        return json.loads(record.read_text())
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def test_engines_accept_the_adapters_argv_and_see_its_environment(bins, gguf, model_dir, tmp_path):
    llama = adapter_for("llama-server").command(llama_spec(str(bins["llama-server"]), gguf))
    seen = _run_until_recorded(llama, tmp_path)
    assert seen["args"] == llama.argv[1:]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == UUIDS[3]
    assert seen["served_name"] == "qwen3-8b"

    rank1 = vllm_spec(
        str(bins["vllm"]), model_dir, nodes=2, rank=1, master_addr="127.0.0.1", ib_hcas=("mlx5_0",)
    )
    cmd = adapter_for("vllm").command(rank1)
    seen = _run_until_recorded(cmd, tmp_path)
    assert seen["env"]["NCCL_IB_HCA"] == "mlx5_0"


def test_llama_download_lands_in_the_fetch_dir(bins, tmp_path):
    fetch = tmp_path / "fetch"
    spec = llama_spec(
        str(bins["llama-server"]),
        Path("/x"),
        weights_path=None,
        download_source="Qwen/Qwen3-8B-GGUF:Q8_0",
        fetch_dir=str(fetch),
    )
    _run_until_recorded(adapter_for("llama-server").command(spec), tmp_path)
    assert [p.name for p in fetch.iterdir()] == ["Qwen_Qwen3-8B-GGUF_Q8_0.gguf"]


def test_in_flight_of_an_answer_that_is_not_prometheus_text_is_unknown():
    assert adapter_for("vllm").in_flight("/metrics", 200, b"vllm:num_requests_running {{\n") is None
    assert adapter_for("vllm").in_flight("/metrics", 200, b"<html>not metrics</html>\n") is None


# --- a shared GPU: each engine held to its allotment ------------------------------------

H200_BYTES = 150_754_820_096  # 143,771 MiB


def test_a_shared_vllm_is_given_its_allotment_as_a_fraction_of_the_whole_card():
    spec = vllm_spec(
        "/opt/vllm/bin/vllm",
        Path("/m"),
        gpu_uuids=("MIG-00010000-aaaa-5bbb-8ccc-000000000000",),
        gpu_memory_gb=20,
        gpu_shared=True,
        gpu_total_bytes=H200_BYTES,
    )
    argv = adapter_for("vllm").command(spec).argv
    # 20e9 / 150.75e9 = 0.1327: rounded down, never more than it was given
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.132"
    assert adapter_for("vllm").command(spec).env["CUDA_VISIBLE_DEVICES"] == spec.gpu_uuids[0]
    exclusive = replace(spec, gpu_shared=False)
    assert "--gpu-memory-utilization" not in adapter_for("vllm").command(exclusive).argv
    mine = replace(spec, extra_args=("--gpu-memory-utilization", "0.9"))
    assert adapter_for("vllm").check(mine) == [
        "a vLLM sharing its GPU is given --gpu-memory-utilization from its allotment "
        "(gpu_memory_gb); remove it from extra_args"
    ]
    assert adapter_for("vllm").check(replace(mine, gpu_shared=False)) == []


def _shared_gpu(used_gb: float) -> NodeFacts:
    gpu = replace_gpu(gpus(1, 141)[0], memory_used_bytes=int(used_gb * 1e9))
    return NodeFacts(gpus=[gpu])


def replace_gpu(gpu: Gpu, **fields) -> Gpu:
    import msgspec

    return msgspec.structs.replace(gpu, **fields)


def test_a_shared_engine_waits_while_the_gpus_free_memory_is_short_of_its_allotment(model_dir):
    from llmgw.agent.engines.validate import fit_allotment

    spec = vllm_spec("vllm", model_dir, gpu_uuids=(UUIDS[0],), gpu_memory_gb=20, gpu_shared=True)
    _, problems = fit_allotment(spec, _shared_gpu(used_gb=135))  # 150.8 - 135 = 15.8 GB free
    assert [(p.reason, p.transient) for p in problems] == [
        (
            f"GPU {UUIDS[0]} has 15.8 GB free, less than the 20 GB this replica is given "
            "(gpu_memory_gb): the engine would not start; tried again as memory frees",
            True,
        )
    ]
    assert fit_allotment(spec, _shared_gpu(used_gb=100)) == (spec, [])


def _shaped_gguf(path: Path, *, context: int = 4096, layers: int = 32) -> Path:
    """A GGUF header of an 8B-like shape (KV: 32 layers x 8 heads x (128 + 128) x 2 bytes
    = 128 KiB a token) and one small tensor: its file is its size on disk."""
    import gguf as gguf_lib
    import numpy as np

    writer = gguf_lib.GGUFWriter(path, "llama")
    writer.add_context_length(context)
    writer.add_embedding_length(4096)
    writer.add_block_count(layers)
    writer.add_head_count(32)
    writer.add_head_count_kv(8)
    writer.add_tensor("token_embd.weight", np.zeros((64, 64), dtype=np.float16))
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_shared_llama_server_gets_the_context_its_allotment_leaves(tmp_path):
    from llmgw.agent.engines.validate import CONTEXT_STEP, LLAMA_OVERHEAD, fit_allotment

    model = _shaped_gguf(tmp_path / "m.gguf", context=32768)
    size = model.stat().st_size
    per_token = 32 * 8 * (128 + 128) * 2
    spec = llama_spec("llama-server", model, gpu_memory_gb=2, gpu_shared=True, context=None)
    fitted, problems = fit_allotment(spec, NodeFacts(gpus=gpus(8, 141)))
    room = 2 * 10**9 - size - LLAMA_OVERHEAD
    assert problems == []
    assert fitted.context == room // per_token // CONTEXT_STEP * CONTEXT_STEP == 7424
    assert "-c" in (argv := adapter_for("llama-server").command(fitted).argv)
    assert argv[argv.index("-c") + 1] == "7424"
    # never more than the model was trained for
    small = _shaped_gguf(tmp_path / "s.gguf", context=2048)
    fitted, _ = fit_allotment(replace(spec, weights_path=str(small)), NodeFacts(gpus=gpus()))
    assert fitted.context == 2048
    # a context asked for that does not fit is refused, saying what would
    _, problems = fit_allotment(replace(spec, context=16384), NodeFacts(gpus=gpus()))
    assert [p.reason for p in problems] == [
        "context 16384 takes 2.1 GB of KV cache; the 2 GB given leave 1.0 GB after the "
        "weights and buffers: lower context to 7424 or raise gpu_memory_gb"
    ]


def test_a_shared_llama_server_whose_weights_alone_exceed_its_allotment_is_refused(tmp_path):
    from llmgw.agent.engines.validate import fit_allotment

    model = _shaped_gguf(tmp_path / "m.gguf")
    with model.open("ab") as f:
        f.truncate(1_500_000_000)  # 1.5 GB of weights, sparse
    spec = llama_spec("llama-server", model, gpu_memory_gb=2, gpu_shared=True, context=None)
    _, problems = fit_allotment(spec, NodeFacts(gpus=gpus()))
    assert [(p.reason, p.transient) for p in problems] == [
        (
            f"weights {model} are 1.5 GB; with 1 GB for the CUDA context and compute buffers "
            "that is more than the 2 GB this replica is given: raise gpu_memory_gb or use a "
            "smaller quantisation",
            False,
        )
    ]


def test_a_new_shared_engine_does_not_wait_for_one_stopping_on_the_same_gpu(model_dir):
    from llmgw.agent.shards import _overlaps

    a = vllm_spec("vllm", model_dir, gpu_uuids=(UUIDS[0],), port=18001, gpu_shared=True)
    b = replace(a, port=18002)
    assert not _overlaps(a, b)  # each has its allotment of GPU 0
    assert _overlaps(a, replace(b, gpu_shared=False))  # an exclusive one has it whole
    assert _overlaps(a, replace(b, port=18001))  # a port is never shared


def test_vllms_prefix_cache_hits_are_read_from_its_metrics():
    from llmgw.agent.engines.vllm import VllmAdapter

    label = '{engine="0",model_name="tiny"}'
    text = (
        f"vllm:num_requests_running{label} 1.0\n"
        f"vllm:num_requests_waiting{label} 2.0\n"
        f"vllm:kv_cache_usage_perc{label} 0.25\n"
        f"vllm:prefix_cache_queries_total{label} 1833.0\n"
        f"vllm:prefix_cache_hits_total{label} 1792.0\n"
    )
    g = VllmAdapter().gauges(text)
    assert (g.running, g.waiting, g.kv_cache) == (1, 2, 0.25)
    assert g.prefix_hits == pytest.approx(1792 / 1833)
    no_lookups = text.replace("1833.0", "0.0").replace("1792.0", "0.0")
    assert VllmAdapter().gauges(no_lookups).prefix_hits == 0.0
