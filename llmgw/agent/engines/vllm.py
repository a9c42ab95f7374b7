"""vLLM: argv, environment, readiness and in-flight requests, single and multi-node.

Multi-node runs without Ray: every node starts `vllm serve` with the same model and
parallel sizes; rank 0 (`--node-rank 0`) serves the API, the others join it through
`--master-addr` and run `--headless` (no HTTP server at all).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from llmgw.agent.cores import core_list
from llmgw.agent.engines.base import (
    EngineCommand,
    EngineGauges,
    Flag,
    FlagTable,
    LaunchSpec,
    Probe,
    base_url,
    cuda_env,
    read_gauges,
    requests_at_engine,
)
from llmgw.catalog import hf_repo

MANAGED = FlagTable(
    [
        Flag(("--model",)),
        Flag(("--host",)),
        Flag(("--port",)),
        Flag(("--served-model-name",)),
        Flag(("-tp", "--tensor-parallel-size")),
        Flag(("-pp", "--pipeline-parallel-size")),
        Flag(("--download-dir",)),
        Flag(("-n", "--nnodes")),
        Flag(("-r", "--node-rank")),
        Flag(("--master-addr",)),
        Flag(("--master-port",)),
        Flag(("--headless",), takes_value=False),
        Flag(("--max-model-len",)),
        Flag(("--max-num-seqs",)),
        Flag(("--api-key",)),
        Flag(("--distributed-executor-backend",)),  # this adapter runs without Ray
        Flag(("--kv-cache-memory-bytes",)),  # a CPU engine's, from its host_ram_gb
    ],
    underscores_are_dashes=True,
)

KNOWN = FlagTable(
    [
        *MANAGED.flags,
        Flag(("-dp", "--data-parallel-size")),
        Flag(("-q", "--quantization")),
        Flag(("-O", "--optimization-level")),  # -O3 as well: vLLM reads a glued level
        Flag(("-cc", "--compilation-config")),  # was -O before vLLM 0.11
        Flag(("--device-memory-utilization", "--gpu-memory-utilization")),
        Flag(("--max-num-batched-tokens",)),
        Flag(("--dtype",)),
        Flag(("--kv-cache-dtype",)),
        Flag(("--enforce-eager",), takes_value=False),
        Flag(("--trust-remote-code",), takes_value=False),
        Flag(("--enable-prefix-caching",), takes_value=False),
        Flag(("--middleware",), repeatable=True),
    ],
    underscores_are_dashes=True,
    glued=("-O",),
)

MANAGED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "VLLM_API_KEY",
        "VLLM_HOST_IP",
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "NCCL_IB_GID_INDEX",
        # a CPU engine's: its platform, cores and (the legacy spelling of) its KV budget
        "VLLM_TARGET_DEVICE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_CPU_KVCACHE_SPACE",
    }
)

# Head sizes vLLM's CPU attention kernel takes (vllm/v1/attention/backends/cpu_attn.py,
# 0.32): a model with another is refused only at its first request, which kills the server.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def tensor_parallel(spec: LaunchSpec) -> int:
    """Default: the GPUs of one node (the fast NVLink domain); at least 1."""
    return spec.tensor_parallel or max(1, len(spec.gpu_uuids))


def pipeline_parallel(spec: LaunchSpec) -> int:
    """Default: one stage per node, so only activations cross the slower fabric."""
    return spec.pipeline_parallel or spec.nodes


def memory_utilization(spec: LaunchSpec) -> str | None:
    """A shared engine's --gpu-memory-utilization: its allotment as a fraction of the whole
    card, which is how vLLM reads it (the budget of this instance, CUDA context included),
    rounded down so that the engine never takes more than it was given."""
    if not (spec.gpu_shared and spec.gpu_memory_gb and spec.gpu_total_bytes):
        return None
    thousandths = int(spec.gpu_memory_gb * 1e9 * 1000 // spec.gpu_total_bytes)
    return f"{min(thousandths, 1000) / 1000:.3f}"


def cpu_env(spec: LaunchSpec) -> dict[str, str]:
    """A CPU engine's platform and cores. VLLM_TARGET_DEVICE=cpu is vLLM's authoritative
    choice of platform (it would probe for GPUs otherwise); by default vLLM pins every
    engine's threads to core 0, so an engine without cores of its own is not pinned."""
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": core_list(spec.cpu_cores) if spec.cpu_cores else "nobind",
    }


class VllmAdapter:
    name = "vllm"
    managed = MANAGED
    known = KNOWN
    managed_env = MANAGED_ENV

    def command(self, spec: LaunchSpec) -> EngineCommand:
        source = spec.download_source or ""
        model = spec.weights_path or hf_repo(source) or source
        argv = [spec.binary, "serve", model]
        if not spec.headless:
            argv += ["--host", spec.host, "--port", str(spec.port)]
            argv += ["--served-model-name", spec.served_name]
        argv += ["--tensor-parallel-size", str(tensor_parallel(spec))]
        argv += ["--pipeline-parallel-size", str(pipeline_parallel(spec))]
        if spec.fetch_dir:
            argv += ["--download-dir", spec.fetch_dir]
        if spec.context:
            argv += ["--max-model-len", str(spec.context)]
        if spec.parallel:
            # the profile's concurrency: llama-server's slots, vLLM's running sequences
            argv += ["--max-num-seqs", str(spec.parallel)]
        share = memory_utilization(spec)
        if share is not None:
            argv += ["--gpu-memory-utilization", share]
        if not spec.gpu_uuids and spec.kv_cache_bytes:
            # without a KV size vLLM on a CPU reserves 92% of the node's RAM
            argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
        if spec.nodes > 1:
            argv += ["--nnodes", str(spec.nodes), "--node-rank", str(spec.rank)]
            argv += ["--master-addr", spec.master_addr]
            if spec.master_port:
                argv += ["--master-port", str(spec.master_port)]
            if spec.headless:
                argv += ["--headless"]
        argv += list(spec.extra_args)

        env = dict(spec.env)
        env.update(cuda_env(spec))
        if not spec.gpu_uuids:
            env.update(cpu_env(spec))
        if spec.api_key and not spec.headless:
            env["VLLM_API_KEY"] = spec.api_key
        if spec.ib_hcas:
            # only this fabric's adapters: NCCL would otherwise try every HCA on the node
            env["NCCL_IB_HCA"] = ",".join(spec.ib_hcas)
        if spec.ib_gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(spec.ib_gid_index)
        if spec.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = spec.socket_ifname
            env["GLOO_SOCKET_IFNAME"] = spec.socket_ifname
        if spec.nodes > 1 and spec.host_ip:
            env["VLLM_HOST_IP"] = spec.host_ip
        return EngineCommand(argv=argv, env=env, base_url=None if spec.headless else base_url(spec))

    def probe_paths(self, spec: LaunchSpec) -> list[str]:
        # headless ranks have no HTTP: alive is all they can show
        return [] if spec.headless else ["/health", "/v1/models"]

    def readiness(self, spec: LaunchSpec, answers: Mapping[str, tuple[int, bytes]]) -> Probe:
        if spec.headless:
            return Probe(True, f"headless rank {spec.rank}: process alive")
        # vLLM does not listen at all while loading
        if "/health" not in answers:
            return Probe(False, "not listening yet (vLLM opens its port after loading)")
        status, _ = answers["/health"]
        if status != 200:
            return Probe(False, f"/health answered {status}")
        if "/v1/models" not in answers:
            return Probe(False, "/v1/models not answered yet")
        status, body = answers["/v1/models"]
        if status != 200:
            return Probe(False, f"/v1/models answered {status}")
        try:
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError):
            return Probe(False, "/v1/models answered something that is not a model list")
        if spec.served_name not in ids:
            return Probe(False, f"/v1/models lists {ids}, not {spec.served_name!r}")
        return Probe(True, "ready")

    def in_flight_paths(self, spec: LaunchSpec) -> list[str]:
        return [] if spec.headless else ["/metrics"]

    def in_flight(self, path: str, status: int, body: bytes) -> int | None:
        if status != 200:
            return None
        text = body.decode("utf-8", "replace")
        return requests_at_engine(text, "vllm:num_requests_running", "vllm:num_requests_waiting")

    def gauges(self, metrics: str) -> EngineGauges | None:
        # vLLM's KV cache gauge is a fraction despite its name; renamed in 0.10
        return read_gauges(
            metrics,
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        )

    def check(self, spec: LaunchSpec) -> list[str]:
        reasons = []
        if not (spec.weights_path or spec.download_source):
            return reasons  # validation reports the missing weights once, for every engine
        if spec.nodes > 1 and not spec.master_addr:
            reasons.append(
                f"multi-node vLLM ({spec.nodes} nodes) needs the rank-0 node's address "
                "(master_addr) in the assignment"
            )
        if spec.gpu_shared and any(
            self.known.key(t) == "--gpu-memory-utilization" for t in spec.extra_args
        ):
            reasons.append(
                "a vLLM sharing its GPU is given --gpu-memory-utilization from its allotment "
                "(gpu_memory_gb); remove it from extra_args"
            )
        if not 0 <= spec.rank < max(1, spec.nodes):
            reasons.append(
                f"rank {spec.rank} is outside 0..{spec.nodes - 1} for {spec.nodes} nodes"
            )
        return reasons
