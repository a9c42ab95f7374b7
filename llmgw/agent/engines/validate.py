"""Refuse a launch the engine would refuse, before starting it.

An engine refuses a bad profile only after minutes of loading, and says so in a log
nobody reads. Each check here takes microseconds to a millisecond and returns problems
a person can act on; an empty list means launch. A problem says whether it clears by
itself (transient: wait and check again) or stays until the profile or the node changes.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from llmgw.agent.discovery.weights.formats import (
    check_gguf,
    check_gguf_split,
    gguf_metadata,
    gguf_part_names,
    gguf_split,
)
from llmgw.agent.engines import adapter_for, vllm_cpu
from llmgw.agent.engines.base import EngineAdapter, LaunchSpec, flag_tokens
from llmgw.agent.engines.vllm import pipeline_parallel, tensor_parallel
from llmgw.agent.files import NotRegularFile, open_regular
from llmgw.bus.records import PORT_IN_USE, EngineInstall, Gpu
from llmgw.catalog import hf_repo

GB = 1_000_000_000  # decimal, as cards are sold: an "80 GB" H100 reports 79.6 GiB


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a launch would fail. `transient`: it clears by itself (a port still held
    by an engine that is being stopped), so the launch is tried again; otherwise it stays
    until a new assignment or catalog entry."""

    reason: str
    transient: bool = False
    # a constant key the controller acts on when it is all that is wrong (Shard.refused):
    # records.PORT_IN_USE, and the controller gives the replica another port
    refused: str = ""

    def __str__(self) -> str:
        return self.reason


def _refuse(*reasons: str) -> list[Problem]:
    return [Problem(r) for r in reasons]


@dataclass(frozen=True)
class NodeFacts:
    """What discovery found on this node (from its NodeInventory)."""

    gpus: Sequence[Gpu] = ()
    engines: Sequence[EngineInstall] = ()


def validate_launch(spec: LaunchSpec, node: NodeFacts) -> list[Problem]:
    """Every reason this launch would fail; empty = go."""
    adapter = adapter_for(spec.engine)
    problems: list[Problem] = []
    for check in CHECKS:
        problems += check(spec, node, adapter)
    problems += _refuse(*adapter.check(spec))
    return problems


def prepare_launch(spec: LaunchSpec, node: NodeFacts) -> tuple[LaunchSpec, list[Problem]]:
    """`validate_launch`, then, for an engine sharing its GPU, the spec held to its
    allotment (`fit_allotment`), and for vLLM on a CPU its KV cache sized from its RAM
    budget (`vllm_cpu.fit_cpu_memory`): what the caller launches, or why it does not."""
    problems = validate_launch(spec, node)
    if problems:
        return spec, problems
    if spec.engine == "vllm" and not spec.gpu_uuids:
        config = vllm_cpu.read_config(spec.weights_path) if spec.weights_path else None
        spec, reasons = vllm_cpu.fit_cpu_memory(spec, config)
        return spec, _refuse(*reasons)
    if not spec.gpu_shared:
        return spec, problems
    return fit_allotment(spec, node)


Check = Callable[[LaunchSpec, NodeFacts, EngineAdapter], list[Problem]]


def check_binary(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    path = spec.binary if os.sep in spec.binary else shutil.which(spec.binary)
    if not path or not os.path.isfile(path):
        return _refuse(
            f"{spec.engine} binary {spec.binary} not found on this node; install it "
            "(discovery looks on PATH and where release archives unpack) or fix the engine path"
        )
    if not os.access(path, os.X_OK):
        return _refuse(f"{spec.engine} binary {path} is not executable; chmod +x it")
    install = next((e for e in node.engines if e.name == spec.engine), None)
    if install is None:
        return _refuse(
            f"{spec.engine} was not found by discovery on this node, so its version is unknown"
        )
    if not install.version:
        return _refuse(
            f"{spec.engine} at {install.path} did not report a version; run "
            f"`{install.path} --version` to see why (a missing shared library is the usual cause)"
        )
    return []


def check_weights(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    if spec.weights_path is None:
        if spec.download_source:
            return _check_fetch_dir(spec)
        return _refuse(
            f"profile for {spec.served_name} names neither a weights path on this node nor "
            "a download source; give the model's weights key or a Hugging Face repo"
        )
    path = spec.weights_path
    if spec.engine == "llama-server":
        if os.path.isdir(path):
            return _refuse(
                f"weights {path} is a directory; llama-server needs the .gguf file "
                "(the first one, -00001-of-N, for split models)"
            )
        if not os.path.exists(path):
            return _refuse(
                f"weights file {path} does not exist on this node; check the path or fetch it"
            )
        try:
            # a FIFO named as weights would block a plain open() and the replica with it
            with open_regular(path) as f:
                magic = f.read(4)
        except NotRegularFile as e:
            return _refuse(f"weights file {path} {e.strerror}; point the profile at the .gguf file")
        except OSError as e:
            return _refuse(
                f"weights file {path} cannot be read: {e.strerror}; check its permissions"
            )
        if magic != b"GGUF":
            return _refuse(f"weights file {path} is not a GGUF file (starts with {magic!r})")
        return _gguf_complete(path)
    # vllm: a model directory (config.json + weights) or a single .gguf
    if os.path.isfile(path) and path.endswith(".gguf"):
        return []
    if not os.path.isdir(path):
        return _refuse(
            f"weights directory {path} does not exist on this node; check the path or fetch it"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        return _refuse(
            f"weights directory {path} has no config.json; vLLM needs a Hugging Face model dir"
        )
    return []


def _gguf_complete(path: str) -> list[Problem]:
    """Headers and sizes only (milliseconds): a half-finished download is refused here, not
    by the engine after it has read gigabytes. The same rule the weights scan uses."""
    file = Path(path)
    split = gguf_split(file.name)
    if split is not None:
        check = check_gguf_split(file.parent, split, os.listdir(file.parent))
    else:
        check = check_gguf(file)
    if check.complete:
        return []
    return _refuse(
        f"weights file {path} is not complete ({check.why}); a download still running, or cut short?"
    )


def _check_fetch_dir(spec: LaunchSpec) -> list[Problem]:
    source = spec.download_source or ""
    if spec.engine == "vllm" and (hf_repo(source) is None or ":" in source.removeprefix("hf://")):
        return _refuse(
            f"download source {source!r} is not a Hugging Face repo (hf://org/name); "
            "vLLM downloads from the Hub only"
        )
    if not spec.fetch_dir:
        return []  # the engine's own cache
    d = spec.fetch_dir
    while not os.path.exists(d):  # the engine creates missing parents, if it may write there
        d = os.path.dirname(d) or "."
    if not os.access(d, os.W_OK | os.X_OK):
        return _refuse(
            f"fetch dir {spec.fetch_dir} is not writable by the agent; downloads would fail"
        )
    return []


def check_gpus(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    reasons: list[str] = []
    by_uuid = {g.uuid: g for g in node.gpus}
    seen: set[str] = set()
    for uuid in spec.gpu_uuids:
        if uuid in seen:
            reasons.append(f"GPU {uuid} is assigned twice")
            continue
        seen.add(uuid)
        gpu = by_uuid.get(uuid)
        if gpu is None:
            have = ", ".join(by_uuid) or "none"
            reasons.append(f"GPU {uuid} is not on this node (it has: {have})")
        elif spec.gpu_memory_gb and gpu.memory_total_bytes < spec.gpu_memory_gb * GB:
            reasons.append(
                f"GPU {uuid} ({gpu.name}) has {gpu.memory_total_bytes / GB:.1f} GB, the profile "
                f"needs {spec.gpu_memory_gb:g} GB per GPU"
            )
    return _refuse(*reasons)


def check_parallelism(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    if spec.engine != "vllm":
        return []
    tp, pp = tensor_parallel(spec), pipeline_parallel(spec)
    dp = _int_value(spec.extra_args, adapter, "--data-parallel-size") or 1
    if tp < 1 or pp < 1 or spec.nodes < 1:
        return _refuse(
            f"tensor_parallel {tp}, pipeline_parallel {pp}, nodes {spec.nodes} must be >= 1"
        )
    world = tp * pp * dp
    if not spec.gpu_uuids:
        # a CPU engine is one rank on its cores (before, every CPU vLLM was refused here as
        # needing one GPU): vLLM's CPU tensor parallel across sockets is not what llmgw runs
        if world > 1:
            return _refuse(
                f"tensor_parallel {tp} x pipeline_parallel {pp} x data_parallel {dp} = {world} "
                "ranks on a CPU node: llmgw runs a CPU vLLM as one rank; remove the parallel "
                "sizes, or give the profile GPUs"
            )
        return []
    if world % spec.nodes:
        return _refuse(
            f"tensor_parallel {tp} x pipeline_parallel {pp} x data_parallel {dp} = {world} GPUs "
            f"does not divide over {spec.nodes} nodes"
        )
    per_node = world // spec.nodes
    if per_node > len(spec.gpu_uuids):
        return _refuse(
            f"tensor_parallel {tp} x pipeline_parallel {pp}"
            + (f" x data_parallel {dp}" if dp > 1 else "")
            + f" over {spec.nodes} node(s) needs {per_node} GPUs on this node, "
            f"{len(spec.gpu_uuids)} assigned"
        )
    return []


def check_build(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    """What this node's vLLM build cannot run: GPUs for a CPU build, a CPU profile for a GPU
    build, a head size the CPU attention kernel refuses (docs/engines.md)."""
    install = next((e for e in node.engines if e.name == spec.engine), None)
    if spec.engine != "vllm" or install is None:
        return []  # check_binary says why there is none
    reasons = vllm_cpu.build_problems(spec, install)
    if (
        not reasons
        and not spec.gpu_uuids
        and spec.weights_path
        and os.path.isdir(spec.weights_path)
    ):
        reasons = vllm_cpu.head_problems(spec, vllm_cpu.read_config(spec.weights_path))
    return _refuse(*reasons)


def check_extra_args(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    reasons: list[str] = []
    seen: dict[str, str] = {}
    for token in flag_tokens(spec.extra_args):
        if adapter.managed.lookup(token):
            reasons.append(
                f"extra arg {token} clashes with {adapter.managed.key(token)}, which llmgw "
                "sets from the profile and assignment; remove it from extra_args"
            )
            continue
        flag = adapter.known.lookup(token)
        if flag is not None and flag.repeatable:
            continue
        key = adapter.known.key(token)
        if key in seen:
            reasons.append(f"extra arg {token} repeats {seen[key]}; keep one")
        else:
            seen[key] = token
    for name in spec.env:
        if name in adapter.managed_env:
            reasons.append(
                f"env {name} clashes with what llmgw sets for {spec.engine}; remove it from "
                "the profile's env"
            )
    return _refuse(*reasons)


def bind_error(host: str, port: int) -> OSError | None:
    """Why an engine could not bind `host:port` now (None: it could)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # the engines set SO_REUSEADDR too, so a port in TIME_WAIT is free for them
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def check_port(spec: LaunchSpec, node: NodeFacts, adapter: EngineAdapter) -> list[Problem]:
    if spec.headless:
        return []
    if not 0 < spec.port < 65536:
        return _refuse(f"port {spec.port} is not a usable TCP port")
    e = bind_error(spec.host, spec.port)
    if e is None:
        return []
    if e.errno == errno.EADDRINUSE:
        # an engine of a removed replica may still be stopping: this clears by itself;
        # another program that took the port after placement does not, and the controller
        # moves the replica to another port
        return [
            Problem(
                f"port {spec.port} on {spec.host} is in use by another process; "
                "a leftover engine? (see `ss -ltnp`)",
                transient=True,
                refused=PORT_IN_USE,
            )
        ]
    return _refuse(f"cannot bind {spec.host}:{spec.port}: {e.strerror}")


CHECKS: tuple[Check, ...] = (
    check_binary,
    check_weights,
    check_gpus,
    check_parallelism,
    check_build,
    check_extra_args,
    check_port,
)


def _int_value(args: Sequence[str], adapter: EngineAdapter, key: str) -> int | None:
    for i, token in enumerate(args):
        if adapter.known.key(token) != key:
            continue
        value = (
            token.split("=", 1)[1] if "=" in token else (args[i + 1] if i + 1 < len(args) else "")
        )
        try:
            return int(value)
        except ValueError:
            return None
    return None


# --- a shared GPU: the engine held to its allotment (docs/engines.md) ---------------------

# What a shared llama-server needs beside its weights and KV cache: the CUDA context (about
# 0.5 GB) and the compute buffers at the default micro-batch of 512 (a few hundred MB for
# 7-8B models). Kept out of the allotment before the context is sized.
LLAMA_OVERHEAD = GB
CONTEXT_STEP = 256  # a fitted context is a multiple of this
_GGUF_SHAPE = (
    ".block_count",
    ".context_length",
    ".embedding_length",
    ".attention.head_count",
    ".attention.head_count_kv",
    ".attention.key_length",
    ".attention.value_length",
)


def fit_allotment(spec: LaunchSpec, node: NodeFacts) -> tuple[LaunchSpec, list[Problem]]:
    """Refused while the GPU's free memory (NVML's, as the inventory last said) is short of
    the allotment: vLLM would refuse to start ("Free memory on device ... is less than
    desired GPU memory utilization"), llama-server would fail to allocate. It clears when
    the other program or a replica stopping frees memory, so it is tried again. Then per
    engine: vLLM's --gpu-memory-utilization is the adapter's (from the spec); llama-server's
    context is sized to what the allotment leaves after its weights."""
    allotted = int((spec.gpu_memory_gb or 0) * GB)
    by_uuid = {g.uuid: g for g in node.gpus}
    gpu = by_uuid.get(spec.gpu_uuids[0]) if spec.gpu_uuids else None
    if gpu is not None and gpu.memory_used_bytes is not None:
        free = gpu.memory_total_bytes - gpu.memory_used_bytes
        if free < allotted:
            return spec, [
                Problem(
                    f"GPU {gpu.uuid} has {free / GB:.1f} GB free, less than the "
                    f"{allotted / GB:g} GB this replica is given (gpu_memory_gb): the engine "
                    "would not start; tried again as memory frees",
                    transient=True,
                )
            ]
    if spec.engine != "llama-server" or not spec.weights_path:
        return spec, []  # a download's size is not known before it: the engine sizes itself
    return _fit_llama_server(spec, allotted)


def _fit_llama_server(spec: LaunchSpec, allotted: int) -> tuple[LaunchSpec, list[Problem]]:
    path = spec.weights_path
    assert path is not None
    try:
        weights = _gguf_bytes(path)
        with open_regular(path, buffering=0) as f:
            meta = gguf_metadata(f, os.fstat(f.fileno()).st_size, _wanted_shape)
    except (OSError, ValueError) as e:
        return spec, _refuse(f"weights file {path} cannot be read for its shape: {e}")
    room = allotted - weights - LLAMA_OVERHEAD
    if room <= 0:
        return spec, _refuse(
            f"weights {path} are {weights / GB:.1f} GB; with {LLAMA_OVERHEAD / GB:g} GB for "
            f"the CUDA context and compute buffers that is more than the {allotted / GB:g} GB "
            "this replica is given: raise gpu_memory_gb or use a smaller quantisation"
        )
    per_token = kv_bytes_per_token(meta)
    if per_token is None:
        return spec, []  # an architecture without the usual keys: the profile's context as is
    fits = room // per_token // CONTEXT_STEP * CONTEXT_STEP
    if spec.context:
        if spec.context * per_token > room:
            return spec, _refuse(
                f"context {spec.context} takes {spec.context * per_token / GB:.1f} GB of KV "
                f"cache; the {allotted / GB:g} GB given leave {room / GB:.1f} GB after the "
                f"weights and buffers: lower context to {fits} or raise gpu_memory_gb"
            )
        return spec, []
    trained = _number(meta, ".context_length")
    context = min(fits, trained) if trained else fits
    least = CONTEXT_STEP * (spec.parallel or 1)
    if context < least:
        return spec, _refuse(
            f"the {allotted / GB:g} GB given leave room for {fits} tokens of context after "
            f"the weights, less than {least}: raise gpu_memory_gb"
        )
    return replace(spec, context=context), []


def kv_bytes_per_token(meta: dict[str, object]) -> int | None:
    """Bytes of f16 KV cache one token takes: layers x KV heads x (key + value width) x 2."""
    layers, kv_heads = _number(meta, ".block_count"), _number(meta, ".attention.head_count_kv")
    heads, width = _number(meta, ".attention.head_count"), _number(meta, ".embedding_length")
    kv_heads = kv_heads or heads
    if not (layers and kv_heads and heads and width):
        return None
    key = _number(meta, ".attention.key_length") or width // heads
    value = _number(meta, ".attention.value_length") or width // heads
    return layers * kv_heads * (key + value) * 2


def _wanted_shape(key: str) -> bool:
    return key == "general.architecture" or key.endswith(_GGUF_SHAPE)


def _number(meta: dict[str, object], suffix: str) -> int:
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}{suffix}")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _gguf_bytes(path: str) -> int:
    """The weights' size on disk: every part of a split model."""
    file = Path(path)
    split = gguf_split(file.name)
    if split is None:
        return file.stat().st_size
    return sum((file.parent / name).stat().st_size for name in gguf_part_names(split))
