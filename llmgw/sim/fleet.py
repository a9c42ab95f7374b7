"""FLEET.toml: the simulated fleet, node by node or in groups with a count.

    [sim]
    heartbeat = 5                       # seconds between leases
    token_rate = 50                     # tokens per second each engine streams

    [shares.filer-a]                    # a shared filer: whoever mounts it holds its models
    models = ["Qwen/Qwen3-8B"]
    adapters = [{ name = "ft", count = 1000 }]  # LoRA adapters ft-0001 .. ft-1000 (PEFT)

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
agent's weights scan reads them. LoRA adapters (`adapters`, on a share or a node) are PEFT
directories, or GGUF LoRA files for a name ending in `.gguf`, in the folder `loras/` of
where they are held, each named as the scan reports it (`ft-0001`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from llmgw.bus.keys import InvalidId, check_token
from llmgw.errors import LlmgwError
from llmgw.files import NotRegularFile, NotUtf8, TooLarge, read_bounded, utf8_text

EngineName = Literal["llama-server", "vllm"]
MAX_GPUS = 8  # a recorded node's PCI layout (llmgw.sim.nvml)
MAX_NODES = 100_000


class FleetError(LlmgwError, ValueError):
    """The fleet file cannot be used; the message names the file, the node, the key and the fix."""

    @classmethod
    def listing(cls, path: Path, errors: list[str]) -> FleetError:
        return cls(
            f"{path}: fleet file refused ({len(errors)} error(s)):\n  " + "\n  ".join(errors)
        )


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


class LoraFiles(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """LoRA adapters' files: `name`, or `count` of them named `<name>-0001` ..; a PEFT
    directory each (vLLM's), or a GGUF LoRA file for a name ending in `.gguf` (llama-server's)."""

    name: str
    count: int | None = None
    rank: int = 8

    def files(self) -> list[str]:
        """Their names in the folder `loras/`."""
        stem, ext = (self.name[:-5], ".gguf") if self.name.endswith(".gguf") else (self.name, "")
        if self.count is None:
            return [f"{stem}{ext}"]
        width = max(2, len(str(self.count)))
        return [f"{stem}-{n:0{width}d}{ext}" for n in range(1, self.count + 1)]


class Share(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    models: list[str] = []
    adapters: list[LoraFiles] = []


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
    adapters: list[LoraFiles] = []  # LoRA adapters held on the node's own disk
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
    adapters: tuple[LoraFiles, ...]
    labels: dict[str, str]
    taints: tuple[str, ...]
    state: Literal["up", "dead"]


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    sim: Sim
    shares: dict[str, Share]
    nodes: dict[str, NodeSpec]  # by name, in file order


MAX_FILE_BYTES = 16 << 20  # a fleet of 100,000 nodes in groups is a few kilobytes

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")


def read_fleet_bytes(path: Path) -> bytes:
    """The fleet file's bytes: a regular file of at most MAX_FILE_BYTES (a FIFO would hang
    the command, a link to /dev/zero grow it until it dies)."""
    try:
        return read_bounded(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        raise FleetError(
            f"{path}: no such fleet file; examples/fleet.toml is one to start from"
        ) from None
    except NotRegularFile:
        raise FleetError(
            f"{path}: not a regular file; give the path of a FLEET.toml file"
        ) from None
    except TooLarge:
        raise FleetError(
            f"{path}: over {MAX_FILE_BYTES >> 20} MiB, too big for a fleet file; describe "
            "alike nodes as one [[nodes]] group with a count"
        ) from None
    except OSError as e:
        raise FleetError(f"{path}: cannot read it: {e.strerror or e}") from None


def load_fleet(path: Path) -> Fleet:
    return parse_fleet_bytes(read_fleet_bytes(path), path)


def parse_fleet_bytes(data: bytes, path: Path = Path("<fleet>")) -> Fleet:
    """The fleet the file's bytes describe; TOML is UTF-8, and bytes that are not are named
    where they are, not a UnicodeDecodeError traceback."""
    try:
        text = utf8_text(data, path)
    except NotUtf8 as e:
        raise FleetError(str(e)) from None
    return parse_fleet(text, path)


def parse_fleet(text: str, path: Path = Path("<fleet>")) -> Fleet:
    """The fleet `text` describes; FleetError listing every problem at once (fixing them one
    run at a time is how an edit eats an hour), each naming the node, the key and the fix."""
    try:
        data = msgspec.toml.decode(text.encode())
    except msgspec.DecodeError as e:
        raise FleetError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(data, dict):  # pragma: no cover - TOML's top level is a table
        raise FleetError(f"{path}: not a TOML table")
    errors: list[str] = []
    sim, shares, groups = _typed(data, errors)
    fleet = _check(sim, shares, groups, errors)
    if errors:
        raise FleetError.listing(path, errors)
    return fleet


def _typed(data: dict, errors: list[str]) -> tuple[Sim, dict[str, Share], list[tuple[int, Node]]]:
    """The file's tables as typed values, each part on its own: what does not convert is in
    `errors`, and the rest is still checked (a share that does not convert is kept empty, so
    that nodes mounting it are not also told it does not exist)."""
    known = {f.encode_name for f in msgspec.structs.fields(FleetFile)}
    for key in data:
        if key not in known:
            errors.append(f"unknown key {key!r}; docs/sim.md lists every key")
    sim = _convert(data.get("sim", {}), Sim, "", "sim", errors) or Sim()
    shares: dict[str, Share] = {}
    raw_shares = data.get("shares", {})
    if isinstance(raw_shares, dict):
        for name, held in raw_shares.items():
            shares[name] = _convert(held, Share, "", f"shares.{name}", errors) or Share()
    else:
        _convert(raw_shares, dict[str, Share], "", "shares", errors)
    groups: list[tuple[int, Node]] = []
    raw_nodes = data.get("nodes", [])
    if isinstance(raw_nodes, list):
        for i, raw in enumerate(raw_nodes):
            name = raw.get("name", "?") if isinstance(raw, dict) else "?"
            group = _convert(raw, Node, f"nodes[{i}] (name {str(name)!r}):", "", errors)
            if group is not None:
                groups.append((i, group))
    else:
        _convert(raw_nodes, list[Node], "", "nodes", errors)
    return sim, shares, groups


def _convert(value: Any, type_: Any, prefix: str, key: str, errors: list[str]) -> Any:
    """`value` as `type_`; where it does not convert, every problem goes to `errors` and
    what did convert is kept (a table is checked key by key, where msgspec stops at the
    first), so the checks after this one still see the rest. None where nothing is left.
    `prefix` names the [[nodes]] entry ("nodes[0] (name 'a'):"), `key` the dotted key."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as e:
        if (
            isinstance(type_, type)
            and issubclass(type_, msgspec.Struct)
            and isinstance(value, dict)
        ):
            return _convert_fields(value, type_, prefix, key, errors)
        errors.append(_explain(prefix, key, e))
        return None


def _convert_fields(value: dict, type_: type, prefix: str, key: str, errors: list[str]) -> Any:
    fields = {f.encode_name: f for f in msgspec.structs.fields(type_)}
    converted = {}
    for name, item in value.items():
        path = f"{key}.{name}" if key else name
        if name not in fields:
            errors.append(_say(prefix, f"unknown key {path!r}; docs/sim.md lists every key"))
            continue
        got = _convert(item, fields[name].type, prefix, path, errors)
        if got is not None or item is None:
            converted[fields[name].name] = got
    for f in fields.values():
        if f.required and f.encode_name not in value:
            path = f"{key}.{f.encode_name}" if key else f.encode_name
            errors.append(_say(prefix, f"key {path!r} is required; docs/sim.md shows an example"))
    try:
        return type_(**converted)  # the keys that did not convert keep their defaults
    except TypeError:  # a required key is missing or did not convert
        return None


def _say(prefix: str, text: str) -> str:
    return f"{prefix} {text}" if prefix else text


def _explain(prefix: str, key: str, err: msgspec.ValidationError) -> str:
    """One msgspec error as "nodes[0] (name 'a'): key 'ram_gb': expected `float`, got `str`"."""
    m = _AT.match(str(err))
    msg, at = (m.group("msg"), m.group("path") or "") if m else (str(err), "")
    msg = msg.replace("Expected", "expected")
    key = f"{key}{at}".lstrip(".")  # at: "", "[0]" or ".fabric" within the value
    enum = re.match(r"Invalid enum value (.+)$", msg)
    if enum:
        allowed = " or ".join(repr(v) for v in _CHOICES.get(re.sub(r"\[\d+\]", "", key), ()))
        msg = f"{enum.group(1)} is not allowed; use {allowed}" if allowed else msg
    return _say(prefix, f"key {key!r}: {msg}" if key else msg)


_CHOICES = {
    "engines": ("llama-server", "vllm"),
    "state": ("up", "dead"),
    "ib.state": ("up", "down"),
}


def _check(
    s: Sim, shares: dict[str, Share], groups: list[tuple[int, Node]], errors: list[str]
) -> Fleet:
    for key, value, low, high in (
        ("heartbeat", s.heartbeat, 0.05, 3600),
        ("tokens", s.tokens, 1, 1_000_000),
        ("token_rate", s.token_rate, 0.01, 1_000_000),
        ("first_token_seconds", s.first_token_seconds, 0, 3600),
        ("load_seconds", s.load_seconds, 0, 3600),
        ("gpu_probe", s.gpu_probe, 0.05, 86400),
    ):
        if not low <= value <= high:
            errors.append(f"key 'sim.{key}': {value:g} is out of range {low:g}..{high:g}")
    for share, held in shares.items():
        with _collect(errors):
            _token("", f"shares.{share}", share, "share name")
        for model in held.models:
            with _collect(errors):
                _model("", f"shares.{share}.models", model)
        with _collect(errors):
            _lora_files("", f"shares.{share}.adapters", held.adapters)
    nodes: dict[str, NodeSpec] = {}
    for i, group in groups:
        where = f"nodes[{i}] (name {group.name!r}):"
        with _collect(errors):
            for spec in _expand(group, where, shares):
                if spec.name in nodes:
                    raise FleetError(
                        f"{where} node {spec.name!r} is named twice; node names must be unique "
                        "(a group with a count is named <name>-01, <name>-02, ...)"
                    )
                nodes[spec.name] = spec
    if len(nodes) > MAX_NODES:
        errors.append(f"{len(nodes)} nodes; at most {MAX_NODES} in one fleet file")
    return Fleet(sim=s, shares=dict(shares), nodes=nodes)


@contextlib.contextmanager
def _collect(errors: list[str]) -> Iterator[None]:
    """The first problem of one node group (or share) joins the list; the others are
    still checked."""
    try:
        yield
    except FleetError as e:
        errors.append(str(e))


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
    _lora_files(where, "adapters", group.adapters)
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
            adapters=tuple(group.adapters),
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
        raise FleetError(_say(_colon(where), f"key {key!r}: {e}")) from None


_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _model(where: Path | str, key: str, model: str) -> None:
    if model.split("/", 1)[0] == LORA_DIR and "/" in model:
        raise FleetError(
            _say(
                _colon(where),
                f"key {key!r}: {model!r}: {LORA_DIR}/ holds the LoRA adapters' "
                "files (key `adapters`); give the model another organisation",
            )
        )
    if not _MODEL.match(model) or ".." in model or len(model) > 200:
        raise FleetError(
            _say(
                _colon(where),
                f"key {key!r}: {model!r} is not a model name; use `name`, `org/name` (a "
                "safetensors directory) or `name.gguf` (a GGUF file): letters, digits and ._- "
                "only",
            )
        )


LORA_DIR = "loras"  # where a share or a node holds its adapters' files
MAX_ADAPTERS = 100_000  # adapters' files one share or node holds


def _lora_files(where: str, key: str, groups: list[LoraFiles]) -> None:
    from llmgw.catalog import MAX_ADAPTER_RANK

    seen: set[str] = set()
    for g in groups:
        if g.count is not None and not 1 <= g.count <= MAX_ADAPTERS:
            raise FleetError(
                _say(where, f"key {key!r}: count {g.count} is out of range 1..{MAX_ADAPTERS}")
            )
        if not 1 <= g.rank <= MAX_ADAPTER_RANK:
            raise FleetError(
                _say(where, f"key {key!r}: rank {g.rank} is out of range 1..{MAX_ADAPTER_RANK}")
            )
        if "/" in g.name or not _MODEL.match(g.name) or len(g.name) > 100:
            raise FleetError(
                _say(
                    where,
                    f"key {key!r}: {g.name!r} is not an adapter name; use `name` (PEFT "
                    "directories) or `name.gguf` (GGUF LoRA files): letters, digits and ._- only",
                )
            )
        files = g.files()
        if seen & set(files) or len(seen) + len(files) > MAX_ADAPTERS:
            raise FleetError(
                _say(where, f"key {key!r}: {g.name!r} names files named before, or too many")
            )
        seen.update(files)


def _colon(where: Path | str) -> str:
    return f"{where}:" if isinstance(where, Path) else where


def model_key(model: str) -> str:
    """The key the agent's weights scan reports for a model named in the file."""
    return model.removesuffix(".gguf").rsplit("/", 1)[-1] if model.endswith(".gguf") else model
