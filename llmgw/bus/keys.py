"""Every bucket key and NATS subject llmgw uses, built and parsed here and nowhere else.

Ids inside keys (`<node>`, `<model>`, `<fabric>`, `<rid>`) are single NATS tokens:
letters, digits, `-` and `_`. A `.` would split a key into more tokens than its
pattern watches (`nodes.*` does not see `nodes.a.b`), so ids are checked on the way in.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache

from llmgw.errors import LlmgwError

DEFAULT_BUCKET = "llmgw"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

# key prefix -> number of id tokens after it
CATALOG = "catalog"
DESIRED = "desired"
NODES = "nodes"
LEASES = "leases"
HEALTH = "health"
FABRICS = "fabrics"
REPLICAS = "replicas"
ASSIGN = "assign"
SHARDS = "shards"
PLACEMENT = "placement"
LEADER = "leader"
OPS = "ops"
ROLLOUT = "rollout"
SCALE = "scale"
LOAD = "load"
APIKEYS = "apikeys"
TEAMS = "teams"

_ARITY = {
    CATALOG: 1,
    DESIRED: 1,
    NODES: 1,
    LEASES: 1,
    HEALTH: 1,
    FABRICS: 1,
    REPLICAS: 2,
    ASSIGN: 2,
    SHARDS: 2,
    PLACEMENT: 1,
    LEADER: 0,
    OPS: 1,
    ROLLOUT: 1,
    SCALE: 1,
    LOAD: 1,
}
# The gateway's families (client keys and teams, the operator's, read by routers alone) are
# parsed apart: readers that watch the whole bucket (the controller's view) hold a table for
# every family of _ARITY, and must see these as keys that are not theirs, never fail on them.
_GATEWAY_ARITY = {
    APIKEYS: 1,
    TEAMS: 1,
}


class InvalidId(LlmgwError, ValueError):
    """An id that cannot be a single NATS token."""


def is_token(value: str) -> bool:
    return bool(_TOKEN.match(value))


def check_token(value: str, what: str = "id") -> str:
    """Return `value` if it is a single NATS token, else raise InvalidId naming the fix."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise InvalidId(
            f"{what} {value!r} is not a valid id: use only letters, digits, '-' and '_' "
            "(it becomes one token of a NATS subject)"
        )
    return value


def sanitize_token(value: str) -> str:
    """Turn free text (a hostname, a file name) into a token: other characters become '-'."""
    out = re.sub(r"[^A-Za-z0-9_-]", "-", value).strip("-")
    return out or "unnamed"


def _key(prefix: str, *ids: str) -> str:
    for i in ids:
        check_token(i, f"{prefix} id")
    return ".".join((prefix, *ids))


def catalog(model: str) -> str:
    return _key(CATALOG, model)


def desired(model: str) -> str:
    return _key(DESIRED, model)


def node(node_id: str) -> str:
    return _key(NODES, node_id)


def lease(node_id: str) -> str:
    return _key(LEASES, node_id)


def health(node_id: str) -> str:
    return _key(HEALTH, node_id)


def fabric(name: str) -> str:
    return _key(FABRICS, name)


def replica(model: str, rid: str) -> str:
    return _key(REPLICAS, model, rid)


def assign(node_id: str, rid: str) -> str:
    return _key(ASSIGN, node_id, rid)


def shard(node_id: str, rid: str) -> str:
    return _key(SHARDS, node_id, rid)


def placement(model: str) -> str:
    return _key(PLACEMENT, model)


def leader() -> str:
    return LEADER


def ops(node_id: str) -> str:
    """The operator's intent about a node (cordon, drain, GPUs out of service, taints)."""
    return _key(OPS, node_id)


def rollout(model: str) -> str:
    """A model's rollout: the revision it runs, where a replacement stands, and what ran before."""
    return _key(ROLLOUT, model)


def scale(model: str) -> str:
    """The autoscaler's count for a model (`desired.<model>` says auto) and why: the leader's."""
    return _key(SCALE, model)


def load(router_id: str) -> str:
    """One router's load per model (in flight, held for a replica, TTFT): that router's own."""
    return _key(LOAD, router_id)


def apikey(name: str) -> str:
    """A client API key: its salted secret hashes, team, models and limits (the operator's).
    The key's name is also the id its secret carries (`llmgw-<name>-<hex>`), so a router
    finds the record from the secret without scanning."""
    return _key(APIKEYS, name)


def team(name: str) -> str:
    """A team: the limits and models its keys share (the operator's)."""
    return _key(TEAMS, name)


def pattern(prefix: str, *ids: str) -> str:
    """Watch pattern for a key family: pattern('assign', 'node05') -> 'assign.node05.*'."""
    arity = _ARITY[prefix] if prefix in _ARITY else _GATEWAY_ARITY[prefix]
    if arity == 0:
        return prefix
    for i in ids:
        check_token(i, f"{prefix} id")
    rest = arity - len(ids)
    if rest < 0:
        raise ValueError(f"{prefix} keys have {arity} id(s), got {len(ids)}")
    return ".".join((prefix, *ids, *(["*"] * rest)))


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed bucket key: its family and its ids."""

    prefix: str
    ids: tuple[str, ...]


@lru_cache(maxsize=1 << 17)  # a fleet's keys come back at every heartbeat: parsed once each
def parse(key: str) -> Key | None:
    """Parse a bucket key; None for a key that is not one of llmgw's (logged by callers).
    Remembered for the last 131,072 keys (a Key is immutable); a flood of new keys only
    pushes the oldest out."""
    parts = key.split(".")
    prefix, ids = parts[0], tuple(parts[1:])
    arity = _ARITY.get(prefix)
    if arity is None or len(ids) != arity or not all(_TOKEN.match(i) for i in ids):
        return None
    return Key(prefix, ids)


def parse_gateway(key: str) -> Key | None:
    """Parse a key of the gateway's families (`apikeys.<name>`, `teams.<team>`); None for
    any other key. `parse` answers None for these (see _GATEWAY_ARITY)."""
    prefix, _, rest = key.partition(".")
    if prefix not in _GATEWAY_ARITY or not rest or "." in rest or not _TOKEN.match(rest):
        return None
    return Key(prefix, (rest,))


# --- subjects (core NATS) ---------------------------------------------------

# JetStream streams beside the bucket, for sharing the fleet between teams
# (docs/security.md): limit windows and usage are atomic counters (allow_msg_counter,
# nats-server >= 2.12) that routers alone add to; the audit trail is a stream routers alone
# append to. The operator creates them (`llmgw key`, `llmgw team`, `llmgw audit`).
LIMITS_STREAM = "LLMGW_LIMITS"
LIMITS_ROOT = "llmgw.limits"  # llmgw.limits.<scope...>.<dimension>.<window>
USAGE_STREAM = "LLMGW_USAGE"
USAGE_ROOT = "llmgw.usage"  # llmgw.usage.<hour>.<team>.<key>.<model>.<kind>
AUDIT_STREAM = "LLMGW_AUDIT"
AUDIT_ROOT = "llmgw.audit"  # llmgw.audit.<key>: one record per request
NO_NAME = "_"  # a subject token for "none" (no team, no key): not a valid key or team name


# a served name's UTF-8 bytes at most (catalog.py): each is one subject token of limits and
# usage, twice as long in hex
MAX_NAME_BYTES = 100


def name_token(value: str) -> str:
    """A free-text name (a model's served name) as one subject token: itself when it is a
    token, else `x` and its UTF-8 in hex. Two names never share a token: one longer than
    MAX_NAME_BYTES (the catalog refuses them; a name from elsewhere may be) keeps its first
    bytes in hex and a digest of the whole after a `-`."""
    if _TOKEN.match(value) and not value.startswith("x") and value != NO_NAME:
        return value
    data = value.encode()
    if len(data) <= MAX_NAME_BYTES:
        return "x" + data.hex()
    return f"x{data[:MAX_NAME_BYTES].hex()}-{hashlib.sha256(data).hexdigest()[:32]}"


def token_name(token: str) -> str:
    """The name `name_token` made `token` from (a long one's first bytes and `…`)."""
    if token.startswith("x"):
        hexed, cut, _ = token[1:].partition("-")
        try:
            return bytes.fromhex(hexed).decode("utf-8", "replace") + ("…" if cut else "")
        except ValueError:
            return token
    return token


EVENTS_ROOT = "llmgw.events"


def event_subject(kind: str, subject_id: str) -> str:
    """`llmgw.events.<kind>.<id>`; `nats sub 'llmgw.events.>'` is a live log of the fleet."""
    check_token(kind, "event kind")
    return f"{EVENTS_ROOT}.{kind}.{check_token(subject_id, 'event subject id')}"


def agent_subject(node_id: str, verb: str) -> str:
    """`llmgw.agent.<node>.<verb>`: request/reply to one agent (rescan, probe, tail). Serve
    it with `Bus.serve`, which acts only on requests (llmgw.bus.requests)."""
    return f"llmgw.agent.{check_token(node_id, 'node id')}.{check_token(verb, 'verb')}"
