"""What every engine adapter shares: the launch spec, the command it becomes, and flag tables.

An adapter is pure: it turns a `LaunchSpec` into argv and environment and says how
readiness and in-flight requests are read. It touches no files and no network, so
the exact argv is tested without an engine; the supervisor runs it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from prometheus_client.parser import text_string_to_metric_families

EngineName = Literal["llama-server", "vllm"]


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """Everything needed to start one engine process for one shard of a replica.

    Built in one place from the catalog profile, the `Assignment` record and the node
    inventory. `weights_path` wins over `download_source` when both are set: the lead
    sets the path when the node already holds the model, the source otherwise.
    """

    served_name: str  # the model id clients send; /v1/models lists it
    engine: EngineName
    binary: str  # the engine executable (EngineInstall.path from discovery)
    port: int
    host: str = "0.0.0.0"
    weights_path: str | None = None  # llama-server: the .gguf (first split); vllm: the model dir
    download_source: str | None = (
        None  # HF repo id ("org/name", llama-server also "org/name:Q4_K_M")
    )
    fetch_dir: str | None = None  # where downloads land (the node's fetch dir, always scanned)
    gpu_uuids: tuple[str, ...] = ()  # empty = CPU only (GPUs hidden from the engine)
    gpu_memory_gb: float | None = None  # per GPU the profile needs (decimal GB, as sold)
    # share_gpus: gpu_memory_gb is all this engine is given of its one GPU, whose memory is
    # gpu_total_bytes (the adapters hold the engine to it: docs/engines.md)
    gpu_shared: bool = False
    gpu_total_bytes: int = 0
    context: int | None = None
    parallel: int | None = None  # concurrent requests: llama-server -np, vLLM --max-num-seqs
    # a CPU engine's own: the profile's host_ram_gb (its whole RAM budget), the KV cache it
    # leaves after the weights (set by validation: validate.fit_cpu_memory), and the cores
    # it is pinned to (empty: not pinned)
    host_ram_bytes: int = 0
    kv_cache_bytes: int | None = None
    cpu_cores: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    api_key: str | None = None  # passed through the environment, never argv (ps shows argv)
    # multi-node (vllm only)
    nodes: int = 1
    rank: int = 0
    master_addr: str = ""
    master_port: int | None = None
    tensor_parallel: int | None = None  # default: GPUs per node
    pipeline_parallel: int | None = None  # default: nodes
    ib_hcas: tuple[str, ...] = ()  # adapters of the replica's fabric on this node
    socket_ifname: str | None = None  # interface for NCCL/Gloo bootstrap, when known
    ib_gid_index: int | None = None  # RoCE only
    host_ip: str | None = None  # this node's address on the replica's network (VLLM_HOST_IP)

    @property
    def headless(self) -> bool:
        """Ranks above 0 of a multi-node vLLM run no API server."""
        return self.engine == "vllm" and self.nodes > 1 and self.rank > 0


@dataclass(frozen=True, kw_only=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the agent's environment (spec.env included)
    base_url: str | None  # where readiness and in-flight are read; None = no HTTP (headless)


@dataclass(frozen=True)
class Flag:
    """One engine option: all its spellings, and the environment variable that sets it too."""

    names: tuple[str, ...]
    takes_value: bool = True
    env: str | None = None
    repeatable: bool = False


class FlagTable:
    """Spellings of an engine's options, so `-c 4096` and `--ctx-size=8192` are one flag."""

    def __init__(
        self,
        flags: Iterable[Flag],
        *,
        underscores_are_dashes: bool = False,
        glued: tuple[str, ...] = (),
    ) -> None:
        self.flags = tuple(flags)
        self._underscores = underscores_are_dashes
        self._glued = glued  # short flags whose value may follow without a space (-O3)
        self._by_name = {name: f for f in self.flags for name in f.names}

    def canonical(self, token: str) -> str:
        name = token.split("=", 1)[0]
        if self._underscores and name.startswith("--"):
            # vLLM's parser accepts --max_model_len for --max-model-len
            name = "--" + name[2:].replace("_", "-")
        return next((g for g in self._glued if name.startswith(g) and name != g), name)

    def lookup(self, token: str) -> Flag | None:
        return self._by_name.get(self.canonical(token))

    def key(self, token: str) -> str:
        """One name per option: the first spelling in the table, else the token itself."""
        flag = self.lookup(token)
        return flag.names[-1] if flag else self.canonical(token)


_NUMBER = re.compile(r"^-\d+(\.\d+)?$")


def flag_tokens(args: Sequence[str]) -> list[str]:
    """The tokens of `args` that are options (values such as `-1` are not)."""
    return [a for a in args if a.startswith("-") and a != "-" and not _NUMBER.match(a)]


@dataclass(frozen=True)
class Probe:
    ready: bool
    detail: str  # what a person reads while waiting: "loading model (503)", "connection refused"


class EngineAdapter(Protocol):
    """One per engine. Pure: no files, no network (the supervisor does the I/O)."""

    name: EngineName
    managed: FlagTable  # flags the adapter sets itself; extra args must not repeat them
    known: FlagTable  # managed plus common unmanaged flags, for duplicate detection
    managed_env: frozenset[str]  # environment variables the adapter sets or that alias its flags

    def command(self, spec: LaunchSpec) -> EngineCommand: ...

    def probe_paths(self, spec: LaunchSpec) -> list[str]:
        """Paths to GET, in order, to decide readiness (see `readiness`)."""
        ...

    def readiness(self, spec: LaunchSpec, answers: Mapping[str, tuple[int, bytes]]) -> Probe:
        """Decide from the answers (status, body) to `probe_paths` gathered so far."""
        ...

    def in_flight_paths(self, spec: LaunchSpec) -> list[str]:
        """Paths to GET, in order, until one tells the requests in flight."""
        ...

    def in_flight(self, path: str, status: int, body: bytes) -> int | None:
        """Requests being served or queued; None when this answer can't tell."""
        ...

    def gauges(self, metrics: str) -> EngineGauges | None:
        """The engine's own load from its /metrics text; None when it reports none."""
        ...

    def check(self, spec: LaunchSpec) -> list[str]:
        """Engine-specific refusals that need no node facts (validation adds the rest)."""
        ...


@dataclass(frozen=True)
class EngineGauges:
    """What an engine says of its own load (records.EngineLoad without whose it is)."""

    running: int | None
    waiting: int | None
    kv_cache: float | None  # fraction in use, 0..1
    prefix_hits: float | None = None  # fraction of looked-up prompt tokens found cached


def read_gauges(
    text: str,
    running: str,
    waiting: str,
    kv_cache: tuple[str, ...],
    prefix: tuple[str, str] | None = None,
) -> EngineGauges | None:
    """An engine's load gauges from its Prometheus text, by the names its adapter gives (the
    KV cache's first name found: vLLM renamed it; `prefix`: the counters of prompt tokens
    found in its prefix cache and looked up); None when it reports none."""
    busy, queued = metric_sum(text, running), metric_sum(text, waiting)
    kv = next((v for v in (metric_sum(text, n) for n in kv_cache) if v is not None), None)
    if busy is None and queued is None and kv is None:
        return None
    hits = None
    if prefix is not None:
        found, asked = metric_sum(text, prefix[0]), metric_sum(text, prefix[1])
        if found is not None and asked is not None:
            hits = min(1.0, max(0.0, found / asked)) if asked > 0 else 0.0
    return EngineGauges(
        running=None if busy is None else max(0, int(busy)),
        waiting=None if queued is None else max(0, int(queued)),
        kv_cache=None if kv is None else min(1.0, max(0.0, kv)),
        prefix_hits=hits,
    )


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def probe_host(host: str) -> str:
    """The address to reach a server bound to `host` from this node."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def base_url(spec: LaunchSpec) -> str:
    return f"http://{probe_host(spec.host)}:{spec.port}"


def cuda_env(spec: LaunchSpec) -> dict[str, str]:
    """GPUs by UUID: NVML's PCI order is not CUDA's default order, UUIDs name one card either way.

    No GPUs assigned means none visible: a CUDA build with -ngl 0 still opens a context
    (and allocates) on GPU 0, which belongs to another shard.
    """
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(spec.gpu_uuids),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def metric_sum(text: str, name: str) -> float | None:
    """Sum of every sample of metric `name` (all label sets), through prometheus_client's
    parser; None when absent, or when the text does not parse (a malformed answer says
    nothing we can count on). The caller bounds the text (supervisor.MAX_ENGINE_ANSWER)."""
    total: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    total = sample.value if total is None else total + sample.value
    except ValueError:
        return None
    return total


def requests_at_engine(text: str, running: str, waiting: str) -> int | None:
    """Requests an engine holds, running and queued, from its Prometheus text; None when it
    does not report `running` (the adapters name their engine's two gauges)."""
    busy = metric_sum(text, running)
    if busy is None:
        return None
    return int(busy + (metric_sum(text, waiting) or 0.0))
