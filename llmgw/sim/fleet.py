"""FLEET.toml: the simulated fleet, node by node or in groups with a count.

    [sim]
    heartbeat = 5                       # seconds between leases
    token_rate = 50                     # tokens per second each engine streams

    [shares.filer-a]                    # a shared filer: whoever mounts it holds its models
    models = ["Qwen/Qwen3-8B"]

    [[nodes]]
    name = "a"                          # with count: a-01 .. a-08
    count = 8
    gpus = { count = 8, name = "NVIDIA H100 80GB HBM3", memory_gb = 80 }
    ram_gb = 2048
    ib = [{ adapter = "mlx5_0", fabric = "ib-a" }]
    engines = ["vllm", "llama-server"]
    mounts = ["filer-a"]
    models = ["phi3-mini.gguf"]         # held on the node's own disk
    state = "up"                        # "dead": stops renewing its lease

Every key is checked, and an error names the file, the node and the key with what was
expected (docs/sim.md lists every key). Model names ending in `.gguf` are GGUF files (their
key is the file stem); others are safetensors directories (`org/name` or `name`), as the
agent's weights scan reads them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from llmgw.bus.keys import InvalidId, check_token
from llmgw.errors import LlmgwError

EngineName = Literal["llama-server", "vllm"]
MAX_GPUS = 8  # a recorded node's PCI layout (llmgw.sim.nvml)
MAX_NODES = 100_000


class FleetError(LlmgwError, ValueError):
    """The fleet file cannot be used; the message names the file, the node, the key and the fix."""


class Sim(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How every simulated node and engine behaves."""

    heartbeat: float = 5.0  # seconds between lease renewals (the agents' intervals.heartbeat)
    tokens: int = 32  # tokens per completion (a request's max_tokens lowers it)
    token_rate: float = 50.0  # tokens per second streamed
    first_token_seconds: float = 0.05  # time before the first token
    load_seconds: float = 1.0  # time an engine takes to "load" before it is ready
    gpu_probe: float = 10.0  # seconds between GPU probes (engines' memory), as an agent's


class Gpus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    count: int = 0
    name: str = "NVIDIA H100 80GB HBM3"
    memory_gb: float = 85.52  # decimal GB, as NVML reports an "80GB" H100: 85.52e9 bytes
    # GPU index -> the MIG devices the operator made of it (H200 profiles: "1g.18gb",
    # "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"), as `nvidia-smi mig` would
    mig: dict[str, list[str]] = {}


class Adapter(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    adapter: str  # mlx5_0
    fabric: str | None = None  # None: the adapter is there, its fabric not configured
    state: Literal["up", "down"] = "up"


class Share(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    models: list[str] = []


class Node(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One node, or `count` alike named `<name>-01`, `<name>-02`, ..."""

    name: str
    count: int | None = None
    gpus: Gpus = msgspec.field(default_factory=Gpus)
    ram_gb: float = 64.0  # GiB of RAM, as /proc/meminfo counts it
    cpus: int = 32
    ib: list[Adapter] = []
    engines: list[EngineName] = msgspec.field(default_factory=lambda: ["llama-server", "vllm"])
    mounts: list[str] = []  # names of [shares.*]
    models: list[str] = []  # held on the node's own disk
    labels: dict[str, str] = {}
    taints: list[str] = []
    state: Literal["up", "dead"] = "up"


class FleetFile(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    sim: Sim = msgspec.field(default_factory=Sim)
    shares: dict[str, Share] = {}
    nodes: list[Node] = []


class NodeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One simulated node as the file describes it now, groups expanded."""

    name: str
    gpus: Gpus
    ram_gb: float
    cpus: int
    ib: tuple[Adapter, ...]
    engines: tuple[EngineName, ...]
    mounts: tuple[str, ...]
    models: tuple[str, ...]
    labels: dict[str, str]
    taints: tuple[str, ...]
    state: Literal["up", "dead"]


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    sim: Sim
    shares: dict[str, Share]
    nodes: dict[str, NodeSpec]  # by name, in file order


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_NODE_AT = re.compile(r"^\.nodes\[(\d+)\]\.?(.*)$")


def parse_fleet(text: str, path: Path = Path("<fleet>")) -> Fleet:
    """The fleet `text` describes; FleetError naming what is wrong and how to fix it."""
    try:
        raw = msgspec.toml.decode(text.encode(), type=FleetFile)
    except msgspec.ValidationError as e:
        raise _explain(path, e, _names(text)) from None
    except msgspec.DecodeError as e:
        raise FleetError(f"{path}: not valid TOML: {e}") from None
    return _check(raw, path)


def load_fleet(path: Path) -> Fleet:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FleetError(
            f"{path}: no such fleet file; examples/fleet.toml is one to start from"
        ) from None
    except OSError as e:
        raise FleetError(f"{path}: cannot read it: {e.strerror}") from None
    return parse_fleet(text, path)


def _names(text: str) -> list[str]:
    """The node names in file order, read leniently, to say which node an error is in."""
    try:
        data = msgspec.toml.decode(text.encode())
        return [str(n.get("name", "?")) if isinstance(n, dict) else "?" for n in data["nodes"]]
    except Exception:  # noqa: BLE001 - only for the message
        return []


def _explain(path: Path, err: msgspec.ValidationError, names: list[str]) -> FleetError:
    m = _AT.match(str(err))
    msg, where = (m.group("msg"), m.group("path") or "") if m else (str(err), "")
    msg = msg.replace("Expected", "expected")
    node = _NODE_AT.match(where)
    prefix = f"{path}:"
    if node:
        i = int(node.group(1))
        name = names[i] if i < len(names) else "?"
        prefix, where = f"{path}: nodes[{i}] (name {name!r}):", node.group(2)
    else:
        where = where.lstrip(".")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return FleetError(f"{prefix} unknown key {key!r}; docs/sim.md lists every key")
    missing = re.match(r"Object missing required field `([^`]+)`", msg)
    if missing:
        key = f"{where}.{missing.group(1)}" if where else missing.group(1)
        return FleetError(f"{prefix} key {key!r} is required; docs/sim.md shows an example")
    enum = re.match(r"Invalid enum value (.+)$", msg)
    if enum:
        field = re.sub(r"\[\d+\]", "", where)
        allowed = " or ".join(repr(v) for v in _CHOICES.get(field, ()))
        msg = f"{enum.group(1)} is not allowed; use {allowed}" if allowed else msg
    if where:
        return FleetError(f"{prefix} key {where!r}: {msg}")
    return FleetError(f"{prefix} {msg}")


_CHOICES = {
    "engines": ("llama-server", "vllm"),
    "state": ("up", "dead"),
    "ib.state": ("up", "down"),
}


def _check(raw: FleetFile, path: Path) -> Fleet:
    s = raw.sim
    for key, value, low, high in (
        ("heartbeat", s.heartbeat, 0.05, 3600),
        ("tokens", s.tokens, 1, 1_000_000),
        ("token_rate", s.token_rate, 0.01, 1_000_000),
        ("first_token_seconds", s.first_token_seconds, 0, 3600),
        ("load_seconds", s.load_seconds, 0, 3600),
        ("gpu_probe", s.gpu_probe, 0.05, 86400),
    ):
        if not low <= value <= high:
            raise FleetError(
                f"{path}: key 'sim.{key}': {value:g} is out of range {low:g}..{high:g}"
            )
    for share, held in raw.shares.items():
        _token(path, f"shares.{share}", share, "share name")
        for model in held.models:
            _model(path, f"shares.{share}.models", model)
    nodes: dict[str, NodeSpec] = {}
    for i, group in enumerate(raw.nodes):
        where = f"{path}: nodes[{i}] (name {group.name!r}):"
        for spec in _expand(group, where, raw.shares):
            if spec.name in nodes:
                raise FleetError(
                    f"{where} node {spec.name!r} is named twice; node names must be unique "
                    "(a group with a count is named <name>-01, <name>-02, ...)"
                )
            nodes[spec.name] = spec
    if len(nodes) > MAX_NODES:
        raise FleetError(f"{path}: {len(nodes)} nodes; at most {MAX_NODES} in one fleet file")
    return Fleet(sim=s, shares=dict(raw.shares), nodes=nodes)


def _check_mig(where: str, g: Gpus) -> None:
    from llmgw.sim.nvml import H200_MIG  # the profiles a simulated card offers

    for index, profiles in g.mig.items():
        if not (index.isdigit() and int(index) < g.count):
            raise FleetError(
                f"{where} key 'gpus.mig.{index}': not the index of one of its {g.count} GPUs"
            )
        slices = 0
        for p in profiles:
            if p not in H200_MIG:
                raise FleetError(
                    f"{where} key 'gpus.mig.{index}': {p!r} is not a MIG profile of the "
                    f"simulated H200 ({', '.join(H200_MIG)})"
                )
            slices += H200_MIG[p][1]
        if slices > 7 or len(profiles) > 7:
            raise FleetError(
                f"{where} key 'gpus.mig.{index}': {slices} slices; a card has 7 "
                "(nvidia-smi would refuse this layout)"
            )


def _expand(group: Node, where: str, shares: dict[str, Share]) -> list[NodeSpec]:
    if group.count is not None and not 1 <= group.count <= MAX_NODES:
        raise FleetError(f"{where} key 'count': {group.count} is out of range 1..{MAX_NODES}")
    _token(where, "name", group.name, "node name")
    g = group.gpus
    if not 0 <= g.count <= MAX_GPUS:
        raise FleetError(
            f"{where} key 'gpus.count': {g.count} is out of range 0..{MAX_GPUS} (the recorded "
            "node's PCI layout has 8 slots)"
        )
    if not 0 < g.memory_gb <= 10_000:
        raise FleetError(f"{where} key 'gpus.memory_gb': {g.memory_gb:g} is out of range 0..10000")
    _check_mig(where, g)
    if not 0 < group.ram_gb <= 1 << 20:
        raise FleetError(f"{where} key 'ram_gb': {group.ram_gb:g} is out of range 0..1048576 GiB")
    if not 1 <= group.cpus <= 100_000:
        raise FleetError(f"{where} key 'cpus': {group.cpus} is out of range 1..100000")
    adapters = [a.adapter for a in group.ib]
    for a in group.ib:
        _token(where, "ib.adapter", a.adapter, "adapter name")
        if a.fabric is not None:
            _token(where, "ib.fabric", a.fabric, "fabric name")
    if len(set(adapters)) != len(adapters):
        raise FleetError(f"{where} key 'ib': adapter names repeat ({adapters}); name each once")
    for share in group.mounts:
        if share not in shares:
            known = ", ".join(sorted(shares)) or "none defined"
            raise FleetError(
                f"{where} key 'mounts': {share!r} is no share of this file ({known}); "
                f"add [shares.{share}] or fix the name"
            )
    for model in group.models:
        _model(where, "models", model)
    from llmgw import labels

    for k, v in group.labels.items():
        problem = labels.key_problem(k) or labels.value_problem(v)
        if problem:
            raise FleetError(f"{where} key 'labels.{k}': {problem}")
    for t in group.taints:
        problem = labels.key_problem(t)
        if problem:
            raise FleetError(f"{where} key 'taints': {problem}")
    if group.count is None:
        names = [group.name]
    else:
        width = max(2, len(str(group.count)))
        names = [f"{group.name}-{n:0{width}d}" for n in range(1, group.count + 1)]
    return [
        NodeSpec(
            name=name,
            gpus=g,
            ram_gb=group.ram_gb,
            cpus=group.cpus,
            ib=tuple(group.ib),
            engines=tuple(dict.fromkeys(group.engines)),
            mounts=tuple(group.mounts),
            models=tuple(group.models),
            labels=dict(group.labels),
            taints=tuple(group.taints),
            state=group.state,
        )
        for name in names
    ]


def _token(where: Path | str, key: str, value: str, what: str) -> None:
    try:
        check_token(value, what)
    except InvalidId as e:
        raise FleetError(f"{_colon(where)} key {key!r}: {e}") from None


_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _model(where: Path | str, key: str, model: str) -> None:
    if not _MODEL.match(model) or ".." in model or len(model) > 200:
        raise FleetError(
            f"{_colon(where)} key {key!r}: {model!r} is not a model name; use `name`, "
            "`org/name` (a safetensors directory) or `name.gguf` (a GGUF file): letters, "
            "digits and ._- only"
        )


def _colon(where: Path | str) -> str:
    return f"{where}:" if isinstance(where, Path) else where


def model_key(model: str) -> str:
    """The key the agent's weights scan reports for a model named in the file."""
    return model.removesuffix(".gguf").rsplit("/", 1)[-1] if model.endswith(".gguf") else model
