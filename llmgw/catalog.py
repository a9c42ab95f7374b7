"""The model catalog: what can be run, with which engine, on how much hardware.

Every validation rule for a model lives here, and nowhere else. A catalog is read from
TOML by the operator (`load_catalog_toml`) and stored one model per `catalog.<model>`
key as JSON; the controller and the router decode it again with `decode_model`, which
applies the very same rules, because anyone can `nats kv put` a value by hand.

An invalid catalog is refused whole, with every error listed (model id, field path,
what was expected): fixing errors one run at a time is how a catalog edit eats an hour.
Unknown fields are errors too: a misspelled `host_ram_gb` read as "no RAM needed" would
quietly place a model where it cannot load.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect
from msgspec import Meta

from llmgw import labels
from llmgw.bus import records
from llmgw.bus.keys import MAX_NAME_BYTES, is_token
from llmgw.bus.trust import MAX_REPLICAS
from llmgw.errors import LlmgwError
from llmgw.files import NotUtf8, TooLarge, read_bounded, utf8_text

Engine = Literal["llama-server", "vllm"]
ENGINES: tuple[str, ...] = ("llama-server", "vllm")

# Engines that can spread one replica over several nodes (pipeline parallel across nodes).
MULTI_NODE_ENGINES: frozenset[str] = frozenset({"vllm"})

# llmgw assigns these itself (the port comes from placement); a second value in
# extra_args would make the engine listen where nobody looks for it.
RESERVED_ARGS: tuple[str, ...] = ("--host", "--port")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


# JSON integers can be any length; engines read theirs (context, parallel) as 32-bit
_MAX_INT = 2**31 - 1
# requests a router may hold for one model: each is an open connection and a task
MAX_HELD = 100_000

# The bounds of every number live on the Struct's fields (msgspec.Meta): the Struct is the
# one description of a record, and the checker below reads its bounds from there. `expected`
# in a Meta's extra is the wording of the error when the bare bound would read poorly.
Count = Annotated[int, Meta(ge=0, le=_MAX_INT)]
Positive = Annotated[int, Meta(ge=1, le=_MAX_INT)]
Replicas = Annotated[int, Meta(ge=1, le=MAX_REPLICAS)]
Size = Annotated[float, Meta(ge=0)]  # GB, seconds, a rate: finite and never negative

# a value read from the bucket is refused by its reader, which writes nothing anyway
_VALUE_REFUSED = "catalog value refused"


class CatalogError(LlmgwError, ValueError):
    """A catalog (or one catalog value) that was refused; `errors` lists every problem.
    Its message is what the CLI prints: a catalog is refused whole, so nothing is written."""

    def __init__(
        self, errors: list[str], refused: str = "catalog refused, nothing written"
    ) -> None:
        self.errors = list(errors)
        super().__init__(f"{refused} ({len(self.errors)} error(s)):\n  " + "\n  ".join(self.errors))


class WeightsRef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one of: `key` (as the agent reports held models: HF repo id "org/name", a
    directory name or a GGUF file stem), `path` (a file or directory on the node), or
    `source` (fetched by the engine into the node's fetch directory: "hf://org/name",
    "hf://org/name:Q4_K_M" for llama-server, or an http(s) URL for llama-server)."""

    key: str | None = None
    path: str | None = None
    source: str | None = None

    def held_key(self) -> str:
        """The key under which an agent would report these weights once on disk."""
        if self.key is not None:
            return self.key
        if self.source is not None:
            if self.source.startswith("hf://"):
                return self.source[len("hf://") :].split(":", 1)[0]
            return _stem(self.source.rstrip("/").rsplit("/", 1)[-1])
        assert self.path is not None
        return _stem(self.path.rstrip("/").rsplit("/", 1)[-1])


def _stem(name: str) -> str:
    # "model-Q4_K_M-00001-of-00003.gguf" and "model-Q4_K_M.gguf" are both "model-Q4_K_M"
    if name.endswith(".gguf"):
        name = re.sub(r"-\d{5}-of-\d{5}$", "", name[: -len(".gguf")])
    return name


class Profile(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One way to run a model. Sizes are per node; `*_gb` are 10^9 bytes (an "80GB" card
    reports about 85.5e9 bytes, so `gpu_memory_gb = 80` fits it)."""

    name: str
    engine: Engine
    weights: WeightsRef
    gpus_per_node: Count  # 0 = CPU only
    gpu_memory_gb: Size = 0.0  # per GPU
    host_ram_gb: Size = 0.0  # per node
    nodes: Positive = 1  # > 1: vLLM, tensor parallel inside a node, pipeline parallel across
    context: Positive | None = None
    parallel: Positive | None = None
    # a CPU profile's engine pinned to this many cores of its own (vLLM; unset: its threads
    # are not pinned, never all on core 0 as vLLM does by default: docs/engines.md)
    cpu_cores: Positive | None = None
    extra_args: list[str] = []
    env: dict[str, str] = {}
    # where it may run (llmgw.labels): every label asked for ("!v": not v), every taint tolerated
    node_selector: dict[str, str] = {}
    tolerations: list[str] = []
    # Replicas placed by GPU memory beside others on one GPU (docs/placement.md, "Sharing a
    # GPU"): each is given `gpu_memory_gb` of it. One GPU per replica, on one node.
    share_gpus: bool = False
    # only GPUs of this model: a MIG profile ("1g.18gb") or a GPU's name ("H100-80GB-HBM3",
    # as its gpu.model label reads); a node selector alone says which nodes, not which GPUs
    gpu_model: str | None = None


# What reaches the engine (the agent's launch_spec reads these, and the model's served
# name): a change to any of them is a new revision of the profile, rolled out by replacing
# replicas one at a time. The others decide only where a new replica may go and apply to
# replicas placed from then on; a name is not content (the replicas of a renamed profile are
# replaced because desired.<model> or the catalog no longer asks for that name).
LAUNCH_FIELDS = (
    "engine",
    "weights",
    "gpus_per_node",
    "gpu_memory_gb",
    "nodes",
    "context",
    "parallel",
    "cpu_cores",
    "extra_args",
    "env",
    "share_gpus",
)
PLACEMENT_FIELDS = ("name", "host_ram_gb", "node_selector", "tolerations", "gpu_model")


class Autoscale(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """How a model's replica count follows its load once `llmgw place MODEL --auto` asks
    for it (docs/placement.md, "Autoscaling"). Times are seconds."""

    min_replicas: Replicas = 1  # the floor while the model is used
    max_replicas: Replicas  # never more, whatever the load
    # requests in flight per replica it aims at
    target_in_flight: Annotated[float, Meta(gt=0)] = 2.0
    ttft_target_ms: Size = 0.0  # optional: a slower first token asks for one more (0: off)
    scale_up_after: Size = 10.0  # the load must ask for more for this long (the stable window)
    scale_down_after: Size = 300.0  # and for fewer for this long before one drains
    idle_unload_after: Size = 0.0  # no request for this long: scaled to 0 (0: never)
    # the engines' own saturation, where they report it (their /metrics, through the
    # heartbeat) asks for one more replica: requests queued in the engines per replica
    # above this (llm-d's 5; 0: off), or the fullest engine's KV cache above this fraction
    # (0.8; 0: off)
    engine_queue_per_replica: Size = 5.0
    kv_cache_full: Annotated[
        float, Meta(ge=0, le=1, extra={"expected": "a fraction 0..1 (0: off)"})
    ] = 0.8
    # requests a router holds for this model while it has no ready replica, and for how
    # long each (0: the router's --hold-max / --hold-timeout)
    hold_max: Annotated[int, Meta(ge=0, le=MAX_HELD)] = 0
    hold_timeout: Size = 0.0


class Model(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model clients ask for by `served_name`; run from `profiles` by the controller,
    or served from fixed `endpoints` (router-only runs). Never both."""

    id: str
    served_name: str
    profiles: list[Profile] = []
    endpoints: list[str] = []
    # with endpoints: the file holding the key those endpoints take (read by the router);
    # the fleet's engine key is sent only to the fleet's own engines
    api_key_file: str | None = None
    # a rollout (docs/placement.md): new replicas started beyond the desired count at once,
    # and ready replicas that may be missing meanwhile (both 0 could do neither)
    surge: Annotated[int, Meta(ge=0, le=MAX_REPLICAS)] = 1
    max_unavailable: Annotated[int, Meta(ge=0, le=MAX_REPLICAS)] = 0
    autoscale: Autoscale | None = None  # a policy `llmgw place --auto` switches on

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)


# launch fields added after fleets ran, with their defaults: a profile that leaves one at its
# default keeps the fingerprint it had before, so upgrading llmgw rolls nothing out
_ADDED_LATER = {"share_gpus": False, "cpu_cores": None}


def launch_hash(model: Model, profile: Profile) -> str:
    """The fingerprint of what an engine of `profile` is launched with (LAUNCH_FIELDS and the
    served name): replicas carry the one they were placed with, and a different one in the
    catalog makes them replicas to replace."""
    content = {"served_name": model.served_name}
    content.update({f: msgspec.to_builtins(getattr(profile, f)) for f in LAUNCH_FIELDS})
    for name, default in _ADDED_LATER.items():
        if content[name] == default:  # the fingerprint of a profile without it is as it was
            del content[name]
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    return digest[:12]


# --- the checks: every one appends to the list of errors instead of stopping ------------

_MISSING: Any = object()

_MODEL_FIELDS = tuple(Model.__struct_fields__)
# Limits on one model, stated and checked here (`llmgw catalog apply`) before anything else
# looks at the lists, so that what the controller writes about a model stays small: its
# placement record holds a line per profile and reason (docs/placement.md).
MAX_PROFILES = 64
MAX_ENDPOINTS = 256
_PROFILE_FIELDS = tuple(Profile.__struct_fields__)
_WEIGHTS_FIELDS = tuple(WeightsRef.__struct_fields__)


class _Checker:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def expected(self, where: str, path: str, expected: str, got: Any) -> None:
        got_text = "nothing (missing)" if got is _MISSING else _show(got)
        self.errors.append(f"{where}, {path}: expected {expected}, got {got_text}")

    def problem(self, where: str, path: str, text: str) -> None:
        self.errors.append(f"{where}, {path}: {text}")

    def unknown_fields(self, where: str, path: str, raw: Mapping[str, Any], known: tuple) -> None:
        for name in raw:
            if name in known:
                continue
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(known)})"
            self.problem(where, f"{path}{name}", f"unknown field{hint}")

    def field(self, where: str, path: str, raw: Mapping[str, Any], struct: type, name: str) -> Any:
        """`raw[name]` checked against the bounds the Struct declares for that field (its
        default when missing); None, with the error listed, when refused."""
        field = _fields(struct)[name]
        value = raw.get(name, _MISSING)
        if value is _MISSING and not field.required:
            return field.default
        kind, extra = field.type, {}
        if isinstance(kind, msgspec.inspect.UnionType):  # `X | None`: None only as default
            kind = next(t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType))
        if isinstance(kind, msgspec.inspect.Metadata):
            kind, extra = kind.type, kind.extra or {}
        if isinstance(kind, msgspec.inspect.IntType):
            return self.integer(where, path, value, kind.ge, kind.le, extra.get("expected"))
        if isinstance(kind, msgspec.inspect.FloatType):
            return self.number(where, path, value, kind, extra.get("expected"))
        raise TypeError(f"{struct.__name__}.{name}: no bounds to check")  # a bug, not input

    def integer(
        self, where, path, value, minimum: int, maximum: int | None, wording: str | None
    ) -> int | None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.expected(where, path, wording or f"an integer >= {minimum}", value)
            return None
        maximum = _MAX_INT if maximum is None else maximum
        if value > maximum:
            self.expected(where, path, wording or f"an integer <= {maximum}", value)
            return None
        return value

    def number(
        self, where, path, value, bounds: msgspec.inspect.FloatType, wording: str | None
    ) -> float | None:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        try:
            number = float(value) if ok else math.nan  # a JSON integer can be any length
        except OverflowError:
            number = math.inf
        if bounds.gt is not None:
            low, below = f"a number > {bounds.gt:g}", not number > bounds.gt
        else:
            low, below = f"a number >= {bounds.ge or 0:g}", not number >= (bounds.ge or 0)
        if not math.isfinite(number) or below:
            self.expected(where, path, wording or low, value)
            return None
        if bounds.le is not None and number > bounds.le:
            self.expected(where, path, wording or f"a number <= {bounds.le:g}", value)
            return None
        return number

    def text(self, where, path, value, *, default=_MISSING) -> str | None:
        if value is _MISSING and default is not _MISSING:
            return default
        if not isinstance(value, str) or not value.strip():
            self.expected(where, path, "a non-empty string", value)
            return None
        return value


@functools.cache
def _fields(struct: type) -> dict[str, msgspec.inspect.Field]:
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return {f.name: f for f in info.fields}


_SHOWN = 120  # characters of a refused value quoted in its error: enough to recognise it


def _show(value: Any) -> str:
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):  # not JSON (a TOML date), or an integer too long to print
        try:
            text = repr(value)
        except ValueError:
            text = f"an integer of {value.bit_length()} bits"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def validate_models(raw: Mapping[str, Any]) -> list[Model]:
    """Validate a parsed catalog `{"models": [{...}, ...]}`; raise CatalogError with every
    error, or return the models in file order."""
    check = _Checker()
    if not isinstance(raw, Mapping):
        raise CatalogError([f"catalog: expected a table with a 'models' list, got {_show(raw)}"])
    check.unknown_fields("catalog", "", raw, ("models",))
    entries = raw.get("models", _MISSING)
    if not isinstance(entries, list):
        check.expected("catalog", "models", "a list of model tables ([[models]])", entries)
        raise CatalogError(check.errors)
    models: list[Model] = []
    for i, entry in enumerate(entries):
        model = _check_model(check, entry, f"models[{i}]")
        if model is not None:
            models.append(model)
    _check_unique(check, entries)
    if check.errors:
        raise CatalogError(check.errors)
    return models


def _check_unique(check: _Checker, entries: list) -> None:
    """Ids and served names across every entry, valid or not: a clash is an error to list
    even when one of the two models has others."""
    seen_ids: dict[str, int] = {}
    seen_names: dict[str, tuple[Any, str]] = {}  # served name -> (id, where)
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            continue
        mid = entry.get("id")
        if isinstance(mid, str):
            if mid in seen_ids:
                check.problem(
                    f"model '{mid}'",
                    "id",
                    f"defined twice (models[{seen_ids[mid]}] and models[{i}])",
                )
            seen_ids.setdefault(mid, i)
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            continue
        served, mid, where = _served_name(entry), entry.get("id"), _where(entry, f"models[{i}]")
        if served is None:
            continue
        other = seen_names.setdefault(served, (mid, where))
        if other[1] != where and not (isinstance(mid, str) and mid == other[0]):
            # the router could not tell which of the two a request means (a repeated id is
            # reported as such)
            check.problem(
                where, "served_name", f"{served!r} is already the served name of {other[1]}"
            )


def _served_name(raw: Mapping[str, Any]) -> str | None:
    """The name clients would send, when the entry gives one that is a name at all."""
    served = raw.get("served_name", _MISSING)
    if served is _MISSING:
        served = raw.get("id")
    return served if isinstance(served, str) and served.strip() else None


def _where(raw: Mapping[str, Any], fallback: str) -> str:
    mid = raw.get("id", _MISSING)
    return f"model '{mid}'" if isinstance(mid, str) and mid else f"{fallback} (no id)"


def decode_model(data: bytes, model_id: str | None = None) -> Model:
    """Decode a `catalog.<model>` value and validate it with the catalog's rules.
    `model_id`, when given, is the id from the key, which the value must repeat."""
    try:
        raw = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        where = f"catalog.{model_id}" if model_id else "catalog value"
        raise CatalogError([f"{where}: not JSON ({exc})"], _VALUE_REFUSED) from None
    check = _Checker()
    model = _check_model(check, raw, f"catalog.{model_id}" if model_id else "catalog value")
    if model is not None and model_id is not None and model.id != model_id:
        check.problem(f"model '{model.id}'", "id", f"stored under key catalog.{model_id}")
    if check.errors or model is None:
        raise CatalogError(check.errors, _VALUE_REFUSED)
    return model


def encode_model(model: Model) -> bytes:
    """The `catalog.<model>` value."""
    return records.encode(model)


# a catalog of a thousand models is a megabyte or two
MAX_CATALOG_BYTES = 64 << 20


def load_catalog_toml(path: str | Path) -> list[Model]:
    """Read and validate a TOML catalog (format: docs/placement.md, examples/catalog.toml):
    a regular file (a FIFO would hang the command, a link to /dev/zero grow it until it
    dies) of at most MAX_CATALOG_BYTES, UTF-8 as TOML is."""
    path = Path(path)
    try:
        data = read_bounded(path, MAX_CATALOG_BYTES)
    except TooLarge:
        raise CatalogError(
            [f"{path}: over {MAX_CATALOG_BYTES >> 20} MiB, more than a catalog ever holds"]
        ) from None
    except OSError as exc:
        raise CatalogError([f"{path}: cannot read the catalog ({exc.strerror or exc})"]) from None
    try:
        raw = tomllib.loads(utf8_text(data, path))
    except NotUtf8 as exc:
        raise CatalogError([str(exc)]) from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError([f"{path}: not valid TOML ({exc})"]) from None
    try:
        return validate_models(raw)
    except CatalogError as exc:
        raise CatalogError([f"{path}: {e}" for e in exc.errors]) from None


def _check_model(check: _Checker, raw: Any, fallback: str) -> Model | None:
    if not isinstance(raw, Mapping):
        check.problem(fallback, "", f"expected a table (a model), got {_show(raw)}")
        return None
    mid = raw.get("id", _MISSING)
    where = _where(raw, fallback)
    before = len(check.errors)
    check.unknown_fields(where, "", raw, _MODEL_FIELDS)
    if not (isinstance(mid, str) and is_token(mid)):
        check.expected(where, "id", "a single token of letters, digits, '-' and '_'", mid)
    served = check.text(where, "served_name", raw.get("served_name", _MISSING), default=None)
    name = served if served is not None else mid if isinstance(mid, str) else ""
    if len(name.encode()) > MAX_NAME_BYTES:
        # each served name is one subject token of limits and usage (bus/keys.name_token)
        check.problem(
            where,
            "served_name" if served is not None else "id",
            f"{name[:40]!r}... is {len(name.encode())} bytes long; a served name is at most "
            f"{MAX_NAME_BYTES} bytes (UTF-8): set a shorter served_name",
        )

    profiles_raw = raw.get("profiles", _MISSING)
    endpoints_raw = raw.get("endpoints", _MISSING)
    profiles: list[Profile] = []
    endpoints: list[str] = []
    if profiles_raw is _MISSING and endpoints_raw is _MISSING:
        check.problem(
            where, "profiles", "a model needs profiles (to be placed) or endpoints (router-only)"
        )
    elif profiles_raw is not _MISSING and endpoints_raw is not _MISSING:
        check.problem(where, "endpoints", "a model has either profiles or endpoints, not both")
    if profiles_raw is not _MISSING:
        if not isinstance(profiles_raw, list) or not profiles_raw:
            check.expected(where, "profiles", "a non-empty list of profiles", profiles_raw)
        elif len(profiles_raw) > MAX_PROFILES:
            # the size first: nothing else is read of a list this long
            check.problem(
                where,
                "profiles",
                f"{len(profiles_raw)} profiles; a model has at most {MAX_PROFILES} (each is "
                "a way to run it, and placement explains every one)",
            )
        else:
            seen: set[str] = set()
            for i, p in enumerate(profiles_raw):
                profile = _check_profile(check, where, f"profiles[{i}]", p)
                if profile is not None:
                    profiles.append(profile)
                name = p.get("name") if isinstance(p, Mapping) else None
                if isinstance(name, str):
                    if name in seen:
                        check.problem(
                            where, f"profiles[{i}].name", f"profile {name!r} defined twice"
                        )
                    seen.add(name)
    if endpoints_raw is not _MISSING:
        endpoints = _check_endpoints(check, where, endpoints_raw)
    key_file = raw.get("api_key_file", _MISSING)
    if key_file is not _MISSING:
        key_file = check.text(where, "api_key_file", key_file)
        if key_file is not None and endpoints_raw is _MISSING:
            check.problem(
                where,
                "api_key_file",
                "only a model with endpoints takes a key file (placed engines take the "
                "fleet's key: the agents' engines.api_key_file)",
            )
    else:
        key_file = None
    surge, unavailable = _check_rollout(check, where, raw, endpoints_raw is not _MISSING)
    autoscale = None
    if "autoscale" in raw:
        if endpoints_raw is not _MISSING:
            check.problem(where, "autoscale", "only a model with profiles is scaled; remove it")
        else:
            autoscale = _check_autoscale(check, where, raw["autoscale"])

    if len(check.errors) > before:
        return None
    return Model(
        id=mid,
        served_name=served or mid,
        profiles=profiles,
        endpoints=endpoints,
        api_key_file=key_file,
        surge=surge,
        max_unavailable=unavailable,
        autoscale=autoscale,
    )


_AUTOSCALE_FIELDS = tuple(Autoscale.__struct_fields__)


def _check_autoscale(check: _Checker, where: str, raw: Any) -> Autoscale | None:
    if not isinstance(raw, Mapping):
        check.expected(where, "autoscale", "a table (min_replicas, max_replicas, ...)", raw)
        return None
    before = len(check.errors)
    check.unknown_fields(where, "autoscale.", raw, _AUTOSCALE_FIELDS)
    lo = raw.get("min_replicas", _MISSING)
    if lo == 0 and not isinstance(lo, bool):
        check.problem(
            where,
            "autoscale.min_replicas",
            "0 is not a floor: min_replicas is at least 1 while the model is used; scale to "
            "zero is idle_unload_after (seconds without a request)",
        )
        lo = None
    else:
        lo = check.field(where, "autoscale.min_replicas", raw, Autoscale, "min_replicas")
    values = {
        name: check.field(where, f"autoscale.{name}", raw, Autoscale, name)
        for name in _AUTOSCALE_FIELDS
        if name != "min_replicas"
    }
    hi = values["max_replicas"]
    if lo is not None and hi is not None and lo > hi:
        check.problem(
            where, "autoscale.min_replicas", f"min_replicas {lo} is above max_replicas {hi}"
        )
    if len(check.errors) > before:
        return None
    return Autoscale(min_replicas=lo, **values)


def _check_rollout(
    check: _Checker, where: str, raw: Mapping[str, Any], static: bool
) -> tuple[int, int]:
    given = [f for f in ("surge", "max_unavailable") if f in raw]
    if static and given:
        check.problem(where, given[0], "only a model with profiles is rolled out; remove it")
    surge = check.field(where, "surge", raw, Model, "surge")
    unavailable = check.field(where, "max_unavailable", raw, Model, "max_unavailable")
    if surge == 0 and unavailable == 0:
        check.problem(
            where,
            "surge",
            "surge and max_unavailable are both 0: a rollout could neither start a new "
            "replica before an old one drains nor drain one first; set surge = 1",
        )
    return surge or 0, unavailable or 0


def _check_endpoints(check: _Checker, where: str, raw: Any) -> list[str]:
    if not isinstance(raw, list) or not raw:
        check.expected(
            where, "endpoints", 'a non-empty list of base URLs ("http://host:port")', raw
        )
        return []
    if len(raw) > MAX_ENDPOINTS:
        check.problem(
            where, "endpoints", f"{len(raw)} endpoints; a model has at most {MAX_ENDPOINTS}"
        )
        return []
    out: list[str] = []
    for i, url in enumerate(raw):
        path = f"endpoints[{i}]"
        if not isinstance(url, str):
            check.expected(where, path, 'a base URL like "http://host:port"', url)
            continue
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            parts = None
        if "@" in url.split("?", 1)[0].split("#", 1)[0].partition("://")[2].split("/", 1)[0]:
            # userinfo; never quoted back, the value holds a password
            check.problem(
                where,
                path,
                "credentials in an endpoint URL are never sent (and would show wherever the "
                "endpoint is named); remove them, and put the endpoints' key in a file named "
                "by the model's api_key_file",
            )
            continue
        if (
            parts is None
            or parts.scheme not in ("http", "https")
            or not parts.hostname
            or parts.query
            or parts.fragment
        ):
            check.expected(where, path, 'a base URL like "http://host:port"', url)
            continue
        if url in out:
            check.problem(where, path, f"{url!r} listed twice")
        out.append(url)
    return out


def _check_profile(check: _Checker, where: str, path: str, raw: Any) -> Profile | None:
    if not isinstance(raw, Mapping):
        check.expected(where, path, "a table (a profile)", raw)
        return None
    before = len(check.errors)
    check.unknown_fields(where, f"{path}.", raw, _PROFILE_FIELDS)
    name = raw.get("name", _MISSING)
    if not (isinstance(name, str) and is_token(name)):
        check.expected(
            where, f"{path}.name", "a single token of letters, digits, '-' and '_'", name
        )
    engine = raw.get("engine", _MISSING)
    if engine not in ENGINES:
        check.expected(where, f"{path}.engine", " or ".join(repr(e) for e in ENGINES), engine)
        engine = None
    weights = _check_weights(check, where, f"{path}.weights", raw.get("weights", _MISSING), engine)
    bounded = {
        f: check.field(where, f"{path}.{f}", raw, Profile, f)
        for f in (
            "gpus_per_node",
            "gpu_memory_gb",
            "host_ram_gb",
            "nodes",
            "context",
            "parallel",
            "cpu_cores",
        )
    }
    gpus, gpu_mem, nodes = bounded["gpus_per_node"], bounded["gpu_memory_gb"], bounded["nodes"]
    extra_args = _check_args(check, where, f"{path}.extra_args", raw.get("extra_args", []))
    env = _check_env(check, where, f"{path}.env", raw.get("env", {}))
    selector = _check_selector(check, where, f"{path}.node_selector", raw.get("node_selector", {}))
    tolerations = _check_tolerations(
        check, where, f"{path}.tolerations", raw.get("tolerations", [])
    )

    if nodes is not None and nodes > 1 and engine is not None:
        if engine not in MULTI_NODE_ENGINES:
            check.problem(
                where,
                f"{path}.nodes",
                f"{engine} runs on one node; use nodes = 1 or engine = 'vllm' for multi-node",
            )
        elif gpus == 0:
            check.problem(where, f"{path}.nodes", "a multi-node replica needs gpus_per_node >= 1")
    if gpus == 0 and gpu_mem:
        check.problem(
            where, f"{path}.gpu_memory_gb", "set on a CPU profile (gpus_per_node = 0); remove it"
        )
    if gpus and bounded["cpu_cores"]:
        check.problem(where, f"{path}.cpu_cores", "set on a GPU profile; remove it")
    elif bounded["cpu_cores"] and engine == "llama-server":
        check.problem(
            where,
            f"{path}.cpu_cores",
            "pins a vLLM engine; give llama-server its threads and cores in extra_args "
            "(-t, --cpu-range)",
        )
    share = raw.get("share_gpus", False)
    if not isinstance(share, bool):
        check.expected(where, f"{path}.share_gpus", "true or false", share)
        share = False
    if share:
        _check_sharing(check, where, f"{path}.share_gpus", gpus, gpu_mem, nodes)
    gpu_model = raw.get("gpu_model", None)
    if gpu_model is not None:
        gpu_model = check.text(where, f"{path}.gpu_model", gpu_model)
        if gpus == 0:
            check.problem(where, f"{path}.gpu_model", "set on a CPU profile; remove it")
    if len(check.errors) > before:
        return None
    return Profile(
        name=name,
        engine=engine,
        weights=weights,
        **bounded,
        extra_args=extra_args,
        env=env,
        node_selector=selector,
        tolerations=tolerations,
        share_gpus=share,
        gpu_model=gpu_model,
    )


def _check_sharing(
    check: _Checker, where: str, path: str, gpus: int | None, gpu_mem: float | None, nodes
) -> None:
    """A shared replica is one engine on part of one GPU: placement gives it `gpu_memory_gb`
    of a GPU. Tensor and pipeline parallel engines take their GPUs whole (NCCL peers,
    each rank sized to the card), so those stay exclusive."""
    if gpus == 0:
        check.problem(where, path, "a CPU profile (gpus_per_node = 0) has no GPU to share")
    elif gpus is not None and gpus > 1:
        check.problem(
            where,
            path,
            f"a replica on {gpus} GPUs has them to itself (tensor parallel); only "
            "gpus_per_node = 1 shares a GPU: remove share_gpus or set gpus_per_node = 1",
        )
    if nodes is not None and nodes > 1:
        check.problem(
            where,
            path,
            "a multi-node replica has its GPUs to itself; remove share_gpus or set nodes = 1",
        )
    if gpus and not gpu_mem:
        check.problem(
            where,
            path,
            "needs gpu_memory_gb: the GPU memory each replica is given, which placement "
            "counts against each GPU's (e.g. gpu_memory_gb = 20)",
        )


def _check_weights(
    check: _Checker, where: str, path: str, raw: Any, engine: str | None
) -> WeightsRef | None:
    one_of = (
        'a table with exactly one of key = "org/name", path = "/abs/path", source = "hf://org/name"'
    )
    if not isinstance(raw, Mapping):
        check.expected(where, path, one_of, raw)
        return None
    before = len(check.errors)
    check.unknown_fields(where, f"{path}.", raw, _WEIGHTS_FIELDS)
    given = [f for f in _WEIGHTS_FIELDS if f in raw]
    if len(given) != 1:
        check.expected(where, path, one_of, dict(raw))
        return None
    field = given[0]
    value = raw[field]
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        check.expected(
            where, f"{path}.{field}", "a non-empty string without surrounding spaces", value
        )
        return None
    if field == "key" and (value.startswith("/") or "://" in value):
        check.expected(
            where,
            f"{path}.key",
            "a model key (use path = for a path, source = for a download)",
            value,
        )
    elif field == "path" and not value.startswith("/"):
        check.expected(where, f"{path}.path", "an absolute path on the node", value)
    elif field == "source":
        _check_source(check, where, f"{path}.source", value, engine)
    if len(check.errors) > before:
        return None
    return WeightsRef(**{field: value})


def _check_source(check: _Checker, where: str, path: str, value: str, engine: str | None) -> None:
    if value.startswith("hf://"):
        rest = value[len("hf://") :]
        repo, _, tag = rest.partition(":")
        if not _HF_REPO.match(repo) or ":" in tag or (_ and not tag):
            check.expected(
                where, path, '"hf://org/name" (llama-server: "hf://org/name:QUANT")', value
            )
        elif tag and engine == "vllm":
            # vLLM downloads a whole repository; a quantisation tag is llama-server's -hf syntax
            check.problem(
                where,
                path,
                f"{value!r}: a ':{tag}' tag is for llama-server; vllm takes hf://org/name",
            )
        return
    if value.startswith(("http://", "https://")):
        if engine == "vllm":
            check.problem(where, path, f"{value!r}: vllm fetches from hf://org/name, not a URL")
        elif not urlsplit(value).hostname:
            check.expected(where, path, "a URL with a host", value)
        return
    check.expected(
        where,
        path,
        '"hf://org/name", "hf://org/name:QUANT" or an http(s) URL (llama-server)',
        value,
    )


def hf_repo(source: str) -> str | None:
    """ "org/name[:QUANT]" from "hf://org/name[:QUANT]" or a bare id; None for anything else.
    The one rule for what an engine fetches by itself: an agent gives it such a repo id
    (a weights key it does not hold, a source), and placement knows that a node need not
    hold such a key (controller/placement/weights.py `must_hold`)."""
    repo = source.removeprefix("hf://")
    parts = repo.split(":", 1)[0].split("/")
    if len(parts) != 2 or not all(parts) or repo.startswith((".", "/", "~")) or "://" in repo:
        return None
    return repo


def _check_args(check: _Checker, where: str, path: str, raw: Any) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
        check.expected(where, path, "a list of strings", raw)
        return []
    for i, arg in enumerate(raw):
        if arg.split("=", 1)[0] in RESERVED_ARGS:
            check.problem(
                where,
                f"{path}[{i}]",
                f"{arg!r} is set by llmgw (placement picks the port); remove it",
            )
    return list(raw)


def _check_env(check: _Checker, where: str, path: str, raw: Any) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        check.expected(where, path, 'a table of NAME = "value" strings', raw)
        return {}
    for name, value in raw.items():
        if not _ENV_NAME.match(str(name)):
            check.expected(where, f"{path}.{name}", "an environment variable name", name)
        if not isinstance(value, str):
            check.expected(where, f"{path}.{name}", "a string (quote numbers)", value)
    return dict(raw)


def _check_selector(check: _Checker, where: str, path: str, raw: Any) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        check.expected(where, path, 'a table of label = "value" (or "!value")', raw)
        return {}
    if len(raw) > labels.MAX_LABELS:
        check.problem(where, path, f"{len(raw)} labels; at most {labels.MAX_LABELS}")
        return {}
    for key, value in raw.items():
        problem = labels.key_problem(key) or labels.value_problem(value, negation=True)
        if problem:
            check.problem(where, f"{path}.{key}", problem)
    return dict(raw)


def _check_tolerations(check: _Checker, where: str, path: str, raw: Any) -> list[str]:
    if not isinstance(raw, list):
        check.expected(where, path, "a list of taint names", raw)
        return []
    if len(raw) > labels.MAX_TAINTS:
        check.problem(where, path, f"{len(raw)} tolerations; at most {labels.MAX_TAINTS}")
        return []
    for i, name in enumerate(raw):
        problem = labels.key_problem(name)
        if problem:
            check.problem(where, f"{path}[{i}]", problem.replace("label name", "taint name"))
    return list(raw)


# What reading a bucket value by hand-written rules can raise: a reader catches these, logs
# the key and skips the value (anyone can `nats kv put` anything).
UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError, CatalogError, ValueError)
