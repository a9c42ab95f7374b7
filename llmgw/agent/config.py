"""The agent's config file: what is written still wins.

One TOML file (default /etc/llmgw/agent.toml). It holds the NATS URLs and TLS files, the
same on every node, plus only the overrides given at onboarding: anything discovery finds
can be overridden, and an override always beats discovery (the inventory lists which values
came from here in `from_config`). Unknown keys and wrong types are refused with the file,
the key and what was expected, so a typo never silently turns into "use discovery"; every
number is checked against the range it may take (`RANGES`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from llmgw import labels
from llmgw.bus.records import ENGINE_PORTS, HEARTBEAT_S
from llmgw.errors import LlmgwError
from llmgw.files import NotRegularFile, NotUtf8, TooLarge, read_bounded, utf8_text

DEFAULT_CONFIG_PATH = Path(os.environ.get("LLMGW_AGENT_CONFIG", "/etc/llmgw/agent.toml"))
DEFAULT_FETCH_DIR = "/var/lib/llmgw-weights"
DEFAULT_STATE_DIR = "/var/lib/llmgw"


class ConfigError(LlmgwError, ValueError):
    """The agent config cannot be used; the message names the file, the key and the fix."""


class Nats(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    urls: list[str] = []
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    bucket: str = "llmgw"
    # copies a NATS cluster keeps of the bucket: 3 on a 3-server cluster. Only checked: an
    # agent never makes the bucket (it waits for a controller to), so never decides this
    bucket_replicas: int | None = None


class Node(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Overrides of discovery. Leave out whatever discovery gets right."""

    id: str | None = None
    address: str | None = None
    ram_total_gb: float | None = None
    gpus: bool = True  # false: report no GPUs without asking NVML
    llama_server: str | None = None
    vllm: str | None = None
    # reported in the inventory for profiles' node_selector and tolerations (llmgw/labels.py)
    labels: dict[str, str] = {}
    taints: list[str] = []


class Weights(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    dirs: list[str] = []
    fetch_dir: str = DEFAULT_FETCH_DIR
    # directory -> store identity, for shared storage that looks local (an SRP/NVMe-oF image)
    shared: dict[str, str] = {}
    scan_interval: float = 300.0
    scan_timeout: float = 60.0


class Intervals(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    heartbeat: float = HEARTBEAT_S
    engine_probe: float = 60.0
    # GPUs read (memory used, processes, error counters): a process taking memory or a
    # GPU turning bad is written at once, memory used moving less than 1 GB within
    # gpu_report
    gpu_probe: float = 10.0
    gpu_report: float = 60.0
    port_probe: float = 10.0  # listeners on the engine port range; written when they change


class Engines(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """How assigned engines are run and supervised (docs/engines.md)."""

    listen_host: str = "0.0.0.0"  # engines must be reachable from the routers
    readiness_timeout: float = 1800.0  # vLLM loads take minutes (10+ seen for a 70B)
    drain_timeout: float = 300.0
    stop_grace: float = 10.0  # SIGTERM, then SIGKILL after this
    backoff_base: float = 1.0  # restart delays after a crash: base, 2x, 4x ... up to the cap
    backoff_cap: float = 60.0
    # failed starts in a row (exits before serving a minute) before the agent gives up on
    # an engine; the controller then places the replica elsewhere
    max_failed_starts: int = 5
    # under systemd, each engine in a scope of its own, so that the agent's unit can be
    # stopped or restarted without killing it: auto (when run by systemd), always, never
    own_scope: Literal["auto", "always", "never"] = "auto"
    # what an exiting agent does with its engines: keep-on-restart (a systemd restart
    # leaves them serving for the next agent; a stop, Ctrl-C or a plain SIGTERM stops
    # them), keep (always leave them), stop (always stop them)
    on_agent_exit: Literal["keep-on-restart", "keep", "stop"] = "keep-on-restart"
    poll_interval: float = 1.0
    # a file holding the key engines are started with (llama-server's and vLLM's API key);
    # routers are given the same file. Never in the bucket: every identity can read that.
    api_key_file: str | None = None
    # the ports the controller gives engines (its port_range): listeners of other programs
    # on them are reported, so placement never gives one out
    port_low: int = ENGINE_PORTS[0]
    port_high: int = ENGINE_PORTS[1]


class Paths(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Where the host is read from (like node_exporter's --path.procfs) and where state lives."""

    procfs: str = "/proc"
    sysfs: str = "/sys"
    state_dir: str = DEFAULT_STATE_DIR
    llama_search_dirs: list[str] | None = None  # None: discovery's documented default list


class Metrics(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    # HOST:PORT of GET /metrics (llmgw/metrics_http.py), e.g. "0.0.0.0:9464"; "": not served
    listen: str = ""


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    nats: Nats = msgspec.field(default_factory=Nats)
    node: Node = msgspec.field(default_factory=Node)
    # adapter name (mlx5_0) -> fabric name (ib-a): cannot be discovered, OpenSM's default
    # subnet prefix is the same on every fabric
    fabrics: dict[str, str] = {}
    weights: Weights = msgspec.field(default_factory=Weights)
    intervals: Intervals = msgspec.field(default_factory=Intervals)
    engines: Engines = msgspec.field(default_factory=Engines)
    paths: Paths = msgspec.field(default_factory=Paths)
    metrics: Metrics = msgspec.field(default_factory=Metrics)

    def overrides(self) -> list[str]:
        """Dotted names of the inventory values that come from this file, not discovery."""
        out = [
            f"node.{name}"
            for name in ("id", "address", "ram_total_gb", "llama_server", "vllm")
            if getattr(self.node, name) is not None
        ]
        if not self.node.gpus:
            out.append("node.gpus")
        out += [f"node.{name}" for name in ("labels", "taints") if getattr(self.node, name)]
        if self.fabrics:
            out.append("fabrics")
        if self.weights.dirs:
            out.append("weights.dirs")
        if self.weights.shared:
            out.append("weights.shared")
        return sorted(out)


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")


def _explain(path: Path, err: Exception) -> ConfigError:
    m = _AT.match(str(err))
    msg, where = (m.group("msg"), (m.group("path") or "").lstrip(".")) if m else (str(err), "")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if unknown:
        key = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
        return ConfigError(f"{path}: unknown key {key!r}; docs/agent.md lists every key")
    if where:
        return ConfigError(f"{path}: key {where!r}: {msg.replace('Expected', 'expected')}")
    return ConfigError(f"{path}: {msg}")


def parse_config(text: str, path: Path = Path("<config>")) -> AgentConfig:
    try:
        cfg = msgspec.toml.decode(text.encode(), type=AgentConfig)
    except msgspec.ValidationError as e:
        raise _explain(path, e) from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    _check(cfg, path)
    return cfg


DAY = 86_400.0


@dataclass(frozen=True)
class Range:
    """Where a number may lie: above `low` (or at it, when `low_ok`), at most `high`."""

    low: float
    high: float
    unit: str
    low_ok: bool = False

    def holds(self, value: float) -> bool:
        above = value >= self.low if self.low_ok else value > self.low
        return math.isfinite(value) and above and value <= self.high

    def __str__(self) -> str:
        return f"{self.low:g} {'<=' if self.low_ok else '<'} value <= {self.high:g} {self.unit}"


# every number of the config; a test checks that none is left out
RANGES: dict[str, Range] = {
    "nats.bucket_replicas": Range(1, 5, "copies", low_ok=True),  # JetStream's own limit
    "node.ram_total_gb": Range(0, 1 << 20, "GiB"),
    "weights.scan_interval": Range(0, DAY, "seconds"),
    "weights.scan_timeout": Range(0, DAY, "seconds"),
    "intervals.heartbeat": Range(0, 3600, "seconds"),
    "intervals.engine_probe": Range(0, DAY, "seconds"),
    "intervals.gpu_probe": Range(0, DAY, "seconds"),
    "intervals.gpu_report": Range(0, DAY, "seconds"),
    "intervals.port_probe": Range(0, DAY, "seconds"),
    "engines.readiness_timeout": Range(0, 7 * DAY, "seconds"),
    "engines.drain_timeout": Range(0, DAY, "seconds", low_ok=True),
    "engines.stop_grace": Range(0, 3600, "seconds", low_ok=True),
    "engines.backoff_base": Range(0, 3600, "seconds"),
    "engines.backoff_cap": Range(0, DAY, "seconds"),
    "engines.max_failed_starts": Range(0, 1000, "starts"),
    "engines.poll_interval": Range(0, 3600, "seconds"),
    "engines.port_low": Range(1, 65535, "port", low_ok=True),
    "engines.port_high": Range(1, 65535, "port", low_ok=True),
}


def _number(cfg: AgentConfig, dotted: str) -> float | None:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _check(cfg: AgentConfig, path: Path) -> None:
    from llmgw.bus.keys import InvalidId, check_token

    if cfg.node.id is not None:
        try:
            check_token(cfg.node.id, "node.id")
        except InvalidId as e:
            raise ConfigError(f"{path}: key 'node.id': {e}") from None
    problems = [
        f"key 'node.labels.{k}': {p}"
        for k, v in cfg.node.labels.items()
        if (p := labels.key_problem(k) or labels.value_problem(v))
    ] + [f"key 'node.taints': {p}" for t in cfg.node.taints if (p := labels.key_problem(t))]
    if len(cfg.node.labels) > labels.MAX_LABELS or len(cfg.node.taints) > labels.MAX_TAINTS:
        problems.append(
            f"at most {labels.MAX_LABELS} node.labels and {labels.MAX_TAINTS} node.taints"
        )
    if problems:
        raise ConfigError(f"{path}: {problems[0]}")
    for name, allowed in RANGES.items():
        value = _number(cfg, name)
        if value is not None and not allowed.holds(value):
            raise ConfigError(
                f"{path}: key {name!r}: {value:g} is out of range; allowed: {allowed}"
            )
    if cfg.engines.backoff_cap < cfg.engines.backoff_base:
        raise ConfigError(
            f"{path}: key 'engines.backoff_cap': {cfg.engines.backoff_cap:g} is below "
            f"engines.backoff_base {cfg.engines.backoff_base:g}; the cap must be at least the base"
        )
    if cfg.engines.port_high < cfg.engines.port_low:
        raise ConfigError(
            f"{path}: key 'engines.port_high': {cfg.engines.port_high} is below "
            f"engines.port_low {cfg.engines.port_low}; the range is port_low..port_high"
        )
    for adapter, fabric in cfg.fabrics.items():
        try:
            check_token(fabric, f"fabric of adapter {adapter}")
        except InvalidId as e:
            raise ConfigError(f"{path}: key 'fabrics.{adapter}': {e}") from None
    from llmgw.agent.discovery.weights.mounts import check_declared_identity

    for directory, identity in cfg.weights.shared.items():
        try:
            check_declared_identity(identity, f"weights.shared.{directory!r}")
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    if cfg.metrics.listen:
        from llmgw.metrics_http import MetricsListenError, parse_listen

        try:
            parse_listen(cfg.metrics.listen, "key 'metrics.listen':")
        except MetricsListenError as e:
            raise ConfigError(f"{path}: {e}") from None
    for url in cfg.nats.urls:
        if not re.match(r"^(nats|tls|ws|wss)://", url):
            raise ConfigError(
                f"{path}: key 'nats.urls': {url!r} is not a NATS URL (nats://host:4222)"
            )


# an agent config holds a few overrides: a kilobyte or two
MAX_CONFIG_BYTES = 1 << 20


def load_config(path: Path | None = None, *, missing_ok: bool = False) -> AgentConfig:
    """The config at `path`, read as a state file is: a regular file (a FIFO would hang the
    agent before it registers, a link to /dev/zero grow it until it dies) of at most
    MAX_CONFIG_BYTES, UTF-8 as TOML is."""
    path = path or DEFAULT_CONFIG_PATH
    init = "`llmgw agent init --nats nats://HOST:4222`"
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        if missing_ok:
            return AgentConfig()
        raise ConfigError(f"{path}: no agent config; write one with {init}") from None
    except NotRegularFile as e:
        raise ConfigError(
            f"{path}: {e.strerror}; give the agent's TOML config file (--config or "
            f"LLMGW_AGENT_CONFIG), or write one with {init}"
        ) from None
    except TooLarge:
        raise ConfigError(
            f"{path}: over {MAX_CONFIG_BYTES >> 20} MiB, more than an agent config ever holds "
            f"(a few overrides); give the agent's TOML config file, or write one with {init}"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"{path}: cannot read it ({e.strerror or e}); make it readable by the user the "
            f"agent runs as (uid {os.getuid()})"
        ) from None
    try:
        text = utf8_text(data, path)
    except NotUtf8 as e:
        raise ConfigError(str(e)) from None
    return parse_config(text, path)


def render_config(cfg: AgentConfig) -> str:
    """TOML holding only what differs from the defaults: what onboarding was given."""
    header = "# llmgw agent config: only overrides of discovery belong here (docs/agent.md lists every key)\n"
    import tomli_w

    data = {k: v for k, v in msgspec.to_builtins(cfg).items() if v != {}}
    return header + tomli_w.dumps(data)


def write_config(cfg: AgentConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(render_config(cfg))
    tmp.replace(path)
