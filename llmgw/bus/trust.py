"""A record's owner is its key, never its value: every reader checks one against the other.

NATS permissions protect keys, not values: node05 may write only `nodes.node05`,
`leases.node05` and `shards.node05.*`, but it chooses every byte it writes there. So a
value that names another owner than its key (node05 writing `"node": "node06"` into its own
`nodes.node05`) is a spoof attempt: it is rejected here, naming the key, and readers log it
and read it as any value that does not read (llmgw/bus/unreadable.py: absent, for what an
agent writes). Numbers are checked against their ranges for the same reason:
a writer's claim is trusted no further than its key.

`check(key, value)` is what the bus applies to every typed read (get, list, watch);
`decode_for_key(key, data)` is for readers that take raw bytes (the controller's view).
Imports no nats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec

from llmgw import labels
from llmgw.errors import LlmgwError

from . import keys, records

# `llmgw place` refuses more; a bigger number in the bucket is a typo or an attack
MAX_REPLICAS = 10_000
MAX_PORT = 65_535
MAX_PID = 4_194_304  # the kernel's PID_MAX_LIMIT
MAX_PROCESS_NAME = 64  # /proc/<pid>/comm holds 15 characters


def RAW(data: bytes) -> bytes:  # noqa: N802 - a constant, compared by identity
    """The decoder of a watch whose reader decodes the bytes itself (the one decoder layer,
    llmgw/fleetstate/decode.py): values as stored, and one over the size limit as
    `Oversized`, for that layer to refuse as it refuses any value that does not read."""
    return data


class Oversized:
    """A value over the size limit, as a raw watch (`Bus.watch(..., RAW)`) hands it on: its
    size, none of its bytes. The one decoder layer (llmgw/fleetstate/decode.py) reads it as
    a value that does not read, so each family does what it does for one (keeps the last
    good value, refuses the key, cordons the node, ...) instead of taking the key as absent."""

    __slots__ = ("size", "limit")

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit

    def __len__(self) -> int:
        return self.size

    def why(self) -> str:
        return (
            f"its value is {self.size:,} bytes, over the limit of {self.limit:,} (values are "
            "state, not data; remove it with `nats kv del` and fix its writer)"
        )


class RecordRejected(LlmgwError, ValueError):
    """A value that decodes but must not be believed: out of range, or not agreeing with its
    key. A ValueError, so readers that skip undecodable values skip these too."""

    def __init__(self, key: str, problems: list[str]) -> None:
        self.key = key
        self.problems = problems
        super().__init__(self._message())

    def _message(self) -> str:
        return (
            f"{self.key}: {'; '.join(self.problems)}; fix its writer, or remove it with "
            f"`nats kv del <bucket> {self.key}`"
        )


class SpoofedRecord(RecordRejected):
    """The value names another owner than its key: someone writing their own key to pass
    as someone else (only the key is protected by NATS permissions)."""

    def _message(self) -> str:
        return (
            f"{self.key}: rejected as a spoof attempt: {'; '.join(self.problems)} (a record's "
            f"owner is its key, and only that owner may write it); see who wrote it with "
            f"`nats kv history <bucket> {self.key}`"
        )


# a field's name: "seq", or (where, name) for one inside a part ("gpus.devices[3]", "index"),
# joined only when a problem is said: a fleet's inventories pass thousands of checks
_Field = str | tuple[str, str]


def _said(field: _Field) -> str:
    return field if isinstance(field, str) else f"{field[0]}.{field[1]}"


class _Problems:
    """The problems found in one value: those about ownership, and the rest."""

    __slots__ = ("ids", "spoofs", "others")

    def __init__(self, ids: tuple[str, ...]) -> None:
        self.ids = ids
        self.spoofs: list[str] = []
        self.others: list[str] = []

    def owner(self, field: str, said: object, key_id: str) -> None:
        if said != key_id:
            self.spoofs.append(f"its {field} is {said!r} but the key says {key_id!r}")

    def at_least(self, field: _Field, value: float | None, low: float) -> None:
        if value is not None and value < low:
            self.others.append(f"{_said(field)} {value!r} is below {low!r}")

    def within(self, field: _Field, value: float | None, low: float, high: float) -> None:
        if value is not None and not low <= value <= high:
            self.others.append(f"{_said(field)} {value!r} is outside {low!r}..{high!r}")

    def at_most(self, field: _Field, count: int, high: int, unit: str = "entries") -> None:
        if count > high:
            self.others.append(f"{_said(field)} has {count} {unit}, more than {high}")

    def token(self, field: _Field, value: str | None) -> None:
        if value is not None and not keys.is_token(value):
            self.others.append(f"{_said(field)} {value!r} is not an id (letters, digits, '-', '_')")

    def raise_if_any(self, key: str) -> None:
        if self.spoofs:
            raise SpoofedRecord(key, self.spoofs + self.others)
        if self.others:
            raise RecordRejected(key, self.others)


# --- one check per key family: `p.ids` are the key's ids -----------------------------------


def _memory(p: _Problems, where: str, m: records.Memory) -> None:
    if m.total_bytes >= 0 and m.available_bytes >= 0:
        return  # every heartbeat carries one: no messages built for a good one
    p.at_least((where, "total_bytes"), m.total_bytes, 0)
    p.at_least((where, "available_bytes"), m.available_bytes, 0)


def _store(p: _Problems, where: str, store: records.Store, node: str) -> None:
    # a local copy is on the writer's own disk: "local:node06" in node05's inventory is a lie
    if store.kind == "local" and store.identity != f"local:{node}":
        p.spoofs.append(f"{where}.identity is {store.identity!r}, a local store of another node")


def _node(p: _Problems, inv: records.NodeInventory) -> None:
    node = p.ids[0]
    p.owner("node", inv.node, node)
    p.at_least("started_at", inv.started_at, 0)
    p.at_least("cpu.count", inv.cpu.count, 0)
    _memory(p, "memory", inv.memory)
    for i, g in enumerate(inv.gpus.devices):
        _gpu(p, f"gpus.devices[{i}]", g)
    _one_card_once(p, inv.gpus.devices)
    _ports_taken(p, inv.ports)
    for i, m in enumerate(inv.weights.models):
        p.at_least(f"weights.models[{i}].bytes", m.bytes, 0)
        p.at_least(f"weights.models[{i}].files", m.files, 0)
        _store(p, f"weights.models[{i}].store", m.store, node)
    for i, d in enumerate(inv.weights.dirs):
        if d.store is not None:
            _store(p, f"weights.dirs[{i}].store", d.store, node)
    _labels(p, "labels", inv.labels)
    _taints(p, "taints", inv.taints)


def _one_card_once(p: _Problems, devices: list[records.Gpu]) -> None:
    """Each card offered once: a UUID listed twice, or a MIG device beside its own parent
    (a GPU in MIG mode is not listed: CUDA cannot run on it), let placement give one card
    twice (two exclusive replicas on it, 100 GB allotted on an 85.5 GB card)."""
    uuids = {g.uuid for g in devices}
    if len(uuids) != len(devices):
        seen: set[str] = set()
        for i, g in enumerate(devices):
            if g.uuid in seen:
                p.others.append(f"gpus.devices[{i}].uuid {g.uuid!r} is listed twice")
            seen.add(g.uuid)
    for i, g in enumerate(devices):
        if g.parent_uuid and g.parent_uuid in uuids:
            p.others.append(
                f"gpus.devices[{i}] is MIG device {g.uuid!r} of GPU {g.parent_uuid!r}, which "
                "is listed too (a GPU in MIG mode is not a GPU of its own)"
            )


def _labels(p: _Problems, where: str, given: dict[str, str]) -> None:
    if len(given) > labels.MAX_LABELS:
        p.others.append(f"{where} has {len(given)} labels; at most {labels.MAX_LABELS}")
        return
    for key, value in given.items():
        problem = labels.key_problem(key) or labels.value_problem(value)
        if problem:
            p.others.append(f"{where}.{key}: {problem}")


def _taints(p: _Problems, where: str, given: list[str]) -> None:
    if len(given) > labels.MAX_TAINTS:
        p.others.append(f"{where} has {len(given)} taints; at most {labels.MAX_TAINTS}")
        return
    for i, name in enumerate(given):
        problem = labels.key_problem(name)
        if problem:
            p.others.append(f"{where}[{i}]: {problem}")


def _gpu(p: _Problems, where: str, g: records.Gpu) -> None:
    if (
        # the GPU of nearly every inventory, in one test: 8 a node, 80,000 in the replay of a
        # 10,000-node bucket, where the checks below were a quarter of its time. It must
        # test everything below that can fail (test_bus checks each field)
        not g.processes
        and g.index >= 0
        and g.memory_total_bytes >= 0
        and (g.memory_used_bytes is None or g.memory_used_bytes >= 0)
        and g.processes_unlisted >= 0
        and g.unlisted_foreign_bytes >= 0
        and (g.errors.ecc_uncorrected_volatile is None or g.errors.ecc_uncorrected_volatile >= 0)
        and g.mig_slices >= 0
    ):
        return
    p.at_least((where, "index"), g.index, 0)
    p.at_least((where, "memory_total_bytes"), g.memory_total_bytes, 0)
    p.at_least((where, "memory_used_bytes"), g.memory_used_bytes, 0)
    p.at_least((where, "processes_unlisted"), g.processes_unlisted, 0)
    p.at_least((where, "unlisted_foreign_bytes"), g.unlisted_foreign_bytes, 0)
    p.at_least((where, "mig_slices"), g.mig_slices, 0)
    p.at_most((where, "processes"), len(g.processes), records.MAX_GPU_PROCESSES)
    for j, proc in enumerate(g.processes[: records.MAX_GPU_PROCESSES]):
        p.within(f"{where}.processes[{j}].pid", proc.pid, 1, MAX_PID)
        p.at_least(f"{where}.processes[{j}].used_bytes", proc.used_bytes, 0)
        p.within(f"{where}.processes[{j}].engine", proc.engine, 1, MAX_PID)
        p.at_most(f"{where}.processes[{j}].name", len(proc.name), MAX_PROCESS_NAME, "characters")
    p.at_least((where, "errors.ecc_uncorrected_volatile"), g.errors.ecc_uncorrected_volatile, 0)


def _ports_taken(p: _Problems, ports: records.PortsTaken) -> None:
    p.within("ports.low", ports.low, 0, MAX_PORT)
    p.within("ports.high", ports.high, ports.low, MAX_PORT)
    p.at_least("ports.unlisted", ports.unlisted, 0)
    p.at_most("ports.ports", len(ports.ports), records.MAX_PORTS_TAKEN)
    outside = [n for n in ports.ports[: records.MAX_PORTS_TAKEN] if not 1 <= n <= MAX_PORT]
    if outside:
        p.others.append(f"ports.ports {outside[:3]} are not TCP ports")


def _lease(p: _Problems, lease: records.Lease) -> None:
    p.owner("node", lease.node, p.ids[0])
    p.at_least("seq", lease.seq, 0)
    _memory(p, "memory", lease.memory)
    p.at_most("engines", len(lease.engines), records.MAX_LEASE_ENGINES)
    for e in lease.engines[: records.MAX_LEASE_ENGINES]:
        p.token("engines[].rid", e.rid)
        p.within(f"engines[{e.rid}].running", e.running, 0, 1_000_000)
        p.within(f"engines[{e.rid}].waiting", e.waiting, 0, 1_000_000)
        p.within(f"engines[{e.rid}].kv_cache", e.kv_cache, 0.0, 1.0)
        p.within(f"engines[{e.rid}].prefix_hits", e.prefix_hits, 0.0, 1.0)


def _health(p: _Problems, h: records.Health) -> None:
    p.owner("node", h.node, p.ids[0])
    p.at_least("last_seq", h.last_seq, 0)


def _desired(p: _Problems, d: records.Desired) -> None:
    p.owner("model", d.model, p.ids[0])
    p.within("replicas", d.replicas, 0, MAX_REPLICAS)


def _fabric(p: _Problems, f: records.FabricHoldings) -> None:
    p.owner("fabric", f.fabric, p.ids[0])
    for n in f.nodes:
        p.token("nodes[]", n)


def _replica(p: _Problems, r: records.Replica) -> None:
    p.owner("model", r.model, p.ids[0])
    p.owner("rid", r.rid, p.ids[1])
    if not r.members:
        p.others.append("members is empty: a replica has at least one member")
    ranks = sorted(m.rank for m in r.members)
    if ranks != list(range(len(r.members))):
        p.others.append(f"member ranks {ranks} are not 0..{len(r.members) - 1}, each once")
    for i, m in enumerate(r.members):
        p.token(f"members[{i}].node", m.node)
        p.within(f"members[{i}].port", m.port, 0, MAX_PORT)
        p.at_least(f"members[{i}].gpu_bytes", m.gpu_bytes, 0)


def _assignment(p: _Problems, a: records.Assignment) -> None:
    # the node is the key's: an assignment names no node, so it cannot claim another
    p.owner("rid", a.rid, p.ids[1])
    p.token("model", a.model)
    p.at_least("generation", a.generation, 0)
    p.within("nodes", a.nodes, 1, MAX_REPLICAS)
    p.within("rank", a.rank, 0, max(a.nodes - 1, 0))
    p.within("port", a.port, 0, MAX_PORT)


def _shard(p: _Problems, s: records.Shard) -> None:
    p.owner("node", s.node, p.ids[0])
    p.owner("rid", s.rid, p.ids[1])
    p.token("model", s.model)
    p.at_least("generation", s.generation, 0)
    p.at_least("restarts", s.restarts, 0)
    p.within("port", s.port, 0, MAX_PORT)
    if s.pid is not None:
        p.at_least("pid", s.pid, 1)
    p.at_least("gpu_used_bytes", s.gpu_used_bytes, 0)
    p.at_least("gpu_allotted_bytes", s.gpu_allotted_bytes, 0)


def _placement(p: _Problems, rec: records.PlacementRecord) -> None:
    p.owner("model", rec.model, p.ids[0])
    p.within("desired", rec.desired, 0, MAX_REPLICAS)
    p.within("placed", rec.placed, 0, MAX_REPLICAS)


def _ops(p: _Problems, o: records.NodeOps) -> None:
    p.owner("node", o.node, p.ids[0])
    _taints(p, "taints", o.taints)
    if len(o.gpus_out) > 1024:
        p.others.append(f"gpus_out lists {len(o.gpus_out)} GPUs; a node has far fewer")


def _rollout(p: _Problems, r: records.Rollout) -> None:
    p.owner("model", r.model, p.ids[0])
    for name in ("desired", "updated", "ready", "old", "surge", "max_unavailable"):
        p.within(name, getattr(r, name), 0, MAX_REPLICAS)


def _scale(p: _Problems, sc: records.Scale) -> None:
    p.owner("model", sc.model, p.ids[0])
    for name in ("replicas", "wanted"):
        p.within(name, getattr(sc, name), 0, MAX_REPLICAS)
    for name in ("in_flight", "waiting", "routers"):
        p.at_least(name, getattr(sc, name), 0)


def _load(p: _Problems, load: records.RouterLoad) -> None:
    p.owner("router", load.router, p.ids[0])
    p.at_least("seq", load.seq, 0)
    p.at_most("models", len(load.models), records.MAX_LOAD_MODELS)
    for model, m in list(load.models.items())[: records.MAX_LOAD_MODELS]:
        p.token("models", model)
        for name in ("in_flight", "waiting", "requests"):
            p.at_least(f"models.{model}.{name}", getattr(m, name), 0)


def _leader(p: _Problems, lead: records.Leader) -> None:
    # the one key without an owner in its name: any controller may hold it
    if not lead.holder:
        p.others.append("holder is empty")


def _catalog(p: _Problems, model: Any) -> None:
    # decoded and checked by llmgw.catalog (which the bus does not import); the id rule is
    # the one every family shares
    p.owner("id", getattr(model, "id", None), p.ids[0])


def _limits(p: _Problems, where: str, limits: records.Limits) -> None:
    for name in ("rpm", "tpm", "tokens_per_day", "max_parallel"):
        p.at_least(f"{where}.{name}", getattr(limits, name), 0)


def _apikey(p: _Problems, k: records.ApiKey) -> None:
    p.owner("name", k.name, p.ids[0])
    p.token("team", k.team)
    p.at_most("models", len(k.models), records.MAX_KEY_MODELS)
    p.at_most("secrets", len(k.secrets), records.MAX_KEY_SECRETS)
    _limits(p, "limits", k.limits)
    _limits(p, "model_limits", k.model_limits)


def _team(p: _Problems, t: records.Team) -> None:
    p.owner("team", t.team, p.ids[0])
    p.at_most("models", len(t.models), records.MAX_KEY_MODELS)
    _limits(p, "limits", t.limits)


_Check = Callable[[_Problems, Any], None]

# key family -> (the Struct its values decode to, its check); catalog's type lives in catalog
FAMILIES: dict[str, tuple[type[msgspec.Struct] | None, _Check]] = {
    keys.CATALOG: (None, _catalog),
    keys.DESIRED: (records.Desired, _desired),
    keys.NODES: (records.NodeInventory, _node),
    keys.LEASES: (records.Lease, _lease),
    keys.HEALTH: (records.Health, _health),
    keys.FABRICS: (records.FabricHoldings, _fabric),
    keys.REPLICAS: (records.Replica, _replica),
    keys.ASSIGN: (records.Assignment, _assignment),
    keys.SHARDS: (records.Shard, _shard),
    keys.PLACEMENT: (records.PlacementRecord, _placement),
    keys.LEADER: (records.Leader, _leader),
    keys.OPS: (records.NodeOps, _ops),
    keys.ROLLOUT: (records.Rollout, _rollout),
    keys.SCALE: (records.Scale, _scale),
    keys.LOAD: (records.RouterLoad, _load),
    keys.APIKEYS: (records.ApiKey, _apikey),
    keys.TEAMS: (records.Team, _team),
}


def _parsed(key: str | keys.Key) -> keys.Key | None:
    if isinstance(key, keys.Key):
        return key
    # the gateway's families are parsed apart (bus/keys.py), and checked here all the same
    return keys.parse(key) or keys.parse_gateway(key)


def _name(key: str | keys.Key) -> str:
    # the key as text, for messages only: never built for a value that passes
    return ".".join((key.prefix, *key.ids)) if isinstance(key, keys.Key) else key


def check(key: str | keys.Key, value: object) -> None:
    """Raise RecordRejected (SpoofedRecord when it names another owner) unless `value` may be
    believed at `key`. Values of keys that are not llmgw's, and raw bytes, are not checked."""
    parsed = _parsed(key)
    if parsed is None or not isinstance(value, msgspec.Struct):
        return
    type_, rule = FAMILIES[parsed.prefix]
    if type_ is not None and not isinstance(value, type_):
        raise RecordRejected(
            _name(key), [f"read as {type(value).__name__}, but the key holds a {type_.__name__}"]
        )
    _judge(parsed, rule, value)


def _judge(key: keys.Key, rule: _Check, value: object) -> None:
    problems = _Problems(key.ids)
    rule(problems, value)
    if problems.spoofs or problems.others:
        problems.raise_if_any(_name(key))


# one decoder per record type: msgspec.json.decode(data, type=T) looks T up on every call
_DECODERS = {
    prefix: msgspec.json.Decoder(type_) for prefix, (type_, _) in FAMILIES.items() if type_
}


def decode_for_key(key: str | keys.Key, data: bytes) -> msgspec.Struct:
    """Decode `data` as the record its key holds, and check it (`check`). Raises msgspec's
    errors for a value that does not decode, RecordRejected for one that must not be
    believed. Catalog values are decoded by `llmgw.catalog.decode_model`. The controller's
    view decodes every heartbeat of the fleet through here (thousands a second): nothing
    is built for messages unless the value fails."""
    parsed = _parsed(key)
    if parsed is None:
        raise RecordRejected(_name(key), ["not an llmgw key"])
    decoder = _DECODERS.get(parsed.prefix)
    if decoder is None:
        raise TypeError(f"{_name(key)}: decode catalog values with llmgw.catalog.decode_model")
    value = decoder.decode(data)
    _judge(parsed, FAMILIES[parsed.prefix][1], value)
    return value


class SkippedValues:
    """Values skipped because they do not decode or are not believed: the first few keys
    are said, once each (a key at one revision), and the rest only counted. One per
    reader: a Bus, the controller's view, the router's table.
    `llmgw status` printed 1,334 warnings when 2,000 garbage keys were present, and a
    watch replaying the bucket after every reconnect said them all again."""

    NAMED = 20  # keys said by name per process; past them, counted
    REMEMBERED = 10_000  # keys remembered as said (a key said again at a new revision)

    def __init__(self) -> None:
        self._said: dict[str, int] = {}
        self.count = 0  # values skipped, said or not
        self.keys: set[str] = set()  # keys skipped (up to REMEMBERED of them)

    def skipped(self, logger: logging.Logger, key: str, revision: int, why: str) -> None:
        self.count += 1
        if len(self.keys) < self.REMEMBERED:
            self.keys.add(key)
        if self._said.get(key) == revision:
            return  # said already
        if key not in self._said and len(self._said) >= self.NAMED:
            if len(self._said) == self.NAMED:
                self._said[""] = 0  # said once: that the rest go unnamed
                logger.warning(
                    "more values in the bucket are skipped than the %d named above: they "
                    "are counted, not named (`llmgw status` says how many)",
                    self.NAMED,
                )
            logger.debug("skipping %s (revision %d): %s", key, revision, why)
            return
        self._said[key] = revision
        logger.warning(
            "skipping %s (revision %d): %s; fix it or remove it with `nats kv del <bucket> %s`",
            key,
            revision,
            why,
            key,
        )
