"""NATS permissions for each llmgw identity, rendered as a nats-server `authorization` block.

Every key has exactly one writer (docs/architecture.md), so an identity may publish only the
`$KV` subjects of the keys it writes: a stolen node05 certificate can corrupt node05's own
records and nothing else. Reads cannot be narrowed this way (a watch's filter travels in the
consumer-create request body, not in its subject), so every identity may read the whole bucket.
Static nats-server config has no per-user templates, hence one generated block per node:

    llmgw pki nats-config      # a user per certificate of the fleet's CA (llmgw/cli/pki.py)
    python -m llmgw.bus.permissions node01 node02 > /etc/nats/llmgw-users.conf  # another CA
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from . import keys

DEFAULT_SUBJECT = "CN={name}"

Role = Literal["controller", "router", "operator", "node"]
# in the order a users block lists them
ROLES: tuple[Role, ...] = ("controller", "router", "operator", "node")


@dataclass(frozen=True)
class User:
    """One nats-server user of `verify_and_map`: a certificate subject and its role."""

    role: Role
    name: str  # the certificate's CN: the node id for a node
    subject: str  # the whole subject DN as nats-server writes it (RFC 2253): the user name


def _kv_read(bucket: str) -> list[str]:
    """What any bucket client publishes to read and watch (requests to the JetStream API)."""
    stream = f"KV_{bucket}"
    return [
        f"$JS.API.STREAM.INFO.{stream}",  # opening the bucket
        f"$JS.API.DIRECT.GET.{stream}.>",  # kv.get (direct get: buckets allow it by default)
        f"$JS.API.STREAM.MSG.GET.{stream}",  # kv.get on a bucket without direct get
        f"$JS.API.CONSUMER.CREATE.{stream}",  # kv.watch: an ordered push consumer
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",  # flow-control replies of a watch
        # account info, asked when the bucket stops answering: does this server's JetStream
        # still reach its cluster, or should the client move to another server?
        "$JS.API.INFO",
    ]


def _kv_write(bucket: str, *key_patterns: str) -> list[str]:
    # put, create, update, delete and TTL'd publishes of a key all go to $KV.<bucket>.<key>
    return [f"$KV.{bucket}.{k}" for k in key_patterns]


def node_permissions(node: str, bucket: str = keys.DEFAULT_BUCKET) -> dict[str, object]:
    """What the agent of `node` may do: write its own inventory, lease and shards, read the
    bucket, publish its own events, answer requests sent to it."""
    keys.check_token(node, "node id")
    keys.check_token(bucket, "bucket")
    return {
        "publish": {
            "allow": [
                *_kv_write(
                    bucket,
                    keys.node(node),
                    keys.lease(node),
                    keys.pattern(keys.SHARDS, node),  # shards.<node>.* : a rid is one token
                ),
                *_kv_read(bucket),
                f"{keys.EVENTS_ROOT}.*.{node}",  # its events carry its own id
            ]
        },
        "subscribe": {
            "allow": [
                f"_INBOX.{node}.>",  # the agent's inbox_prefix (agent/service.py)
                f"llmgw.agent.{node}.>",  # requests addressed to it (rescan)
            ]
        },
        # replies to requests it received, whatever the requester's inbox
        "allow_responses": True,
    }


def controller_permissions(bucket: str = keys.DEFAULT_BUCKET) -> dict[str, object]:
    """The controller writes health, fabrics, replicas, assignments, placements, rollouts and
    the leader lease, creates the bucket if missing, publishes events and asks agents; it
    reads all, the operator's ops.<node> included (which only the operator writes)."""
    keys.check_token(bucket, "bucket")
    written = [
        keys.HEALTH,
        keys.FABRICS,
        keys.REPLICAS,
        keys.ASSIGN,
        keys.PLACEMENT,
        keys.ROLLOUT,
        keys.SCALE,
    ]
    return {
        "publish": {
            "allow": [
                *_kv_write(bucket, *(keys.pattern(p) for p in written), keys.leader()),
                *_kv_read(bucket),
                # the first controller creates a missing bucket (create is idempotent for the
                # same config and refused for another); agents wait for it
                f"$JS.API.STREAM.CREATE.KV_{bucket}",
                # and lets it take atomic batches (Bus.allow_batches): its only edit of it
                f"$JS.API.STREAM.UPDATE.KV_{bucket}",
                f"{keys.EVENTS_ROOT}.>",
                "llmgw.agent.>",
            ]
        },
        # nats-py's default inbox is _INBOX.<random>: a controller that set
        # inbox_prefix="_INBOX.controller" could be narrowed to _INBOX.controller.>
        "subscribe": {"allow": ["_INBOX.>"]},
    }


def router_permissions(name: str, bucket: str = keys.DEFAULT_BUCKET) -> dict[str, object]:
    """A router reads the bucket (catalog, replicas, shards; its fleet page the rest) and
    writes its own load, `load.<its name>` (its certificate's CN is its router id)."""
    keys.check_token(name, "router id")
    keys.check_token(bucket, "bucket")
    return {
        "publish": {
            "allow": [
                *_kv_write(bucket, keys.load(name)),
                *_kv_read(bucket),
                *_gateway_writes(name),
            ]
        },
        "subscribe": {"allow": ["_INBOX.>"]},
    }


def _gateway_writes(name: str) -> list[str]:
    """What a router adds to the streams beside the bucket (docs/security.md): what it holds
    of each limit and what it metered, each on subjects that end in its own name (so no
    router can change what another holds or metered), and audit records. No purge, delete,
    edit or consumer on any of them (the trail and the counts are not its to erase), and
    nothing for a node."""
    limits, usage = keys.LIMITS_ROOT, keys.USAGE_ROOT
    return [
        # what it holds of a limit's window: <scope...>.<dimension>.<window>.<name>.<instance>
        f"{limits}.key.*.*.*.{name}.*",
        f"{limits}.team.*.*.*.{name}.*",
        f"{limits}.keymodel.*.*.*.*.{name}.*",
        f"{usage}.*.*.*.*.*.{name}",  # Nats-Incr usage counts: <hour...kind>.<name>
        f"{keys.AUDIT_ROOT}.>",  # one record per request
        # a usage count sent again reads the total back (a duplicate's ack carries none)
        f"$JS.API.DIRECT.GET.{keys.USAGE_STREAM}.>",
        # a claim reads every holder of a window in one batch
        f"$JS.API.DIRECT.GET.{keys.LIMITS_STREAM}",
    ]


def _render_value(value: object, indent: str) -> str:
    if isinstance(value, dict):
        inner = indent + "  "
        lines = [f"{inner}{k}: {_render_value(v, inner)}" for k, v in value.items()]
        return "{\n" + "\n".join(lines) + f"\n{indent}}}"
    if isinstance(value, list):
        inner = indent + "  "
        return (
            "[\n" + "\n".join(f"{inner}{_render_value(v, inner)}" for v in value) + f"\n{indent}]"
        )
    # Quoted: an unquoted $KV... would be read as a config variable reference.
    return json.dumps(value)


def _user(subject: str, comment: str, permissions: dict[str, object] | None) -> list[str]:
    out = [f"    # {comment}", f"    {{ user: {json.dumps(subject)}"]
    if permissions is not None:
        out.append(f"      permissions: {_render_value(permissions, '      ')}")
    out.append("    }")
    return out


def permissions_for(user: User, bucket: str = keys.DEFAULT_BUCKET) -> dict[str, object] | None:
    """The permissions block of `user`; None for an operator, who may do anything."""
    if user.role == "node":
        return node_permissions(user.name, bucket)
    if user.role == "controller":
        return controller_permissions(bucket)
    if user.role == "router":
        return router_permissions(user.name, bucket)
    if user.role == "operator":
        return None
    raise ValueError(f"role {user.role!r} of {user.subject!r} is none of {', '.join(ROLES)}")


_COMMENTS = {
    "controller": "controller: writes health, fabrics, replicas, assign, placement, rollout, "
    "scale, leader",
    "router": "router: reads, and writes its own load.<name>",
    "operator": "operator: everything (catalog, desired, ops are its own)",
}


def render_users(
    users: Iterable[User],
    bucket: str = keys.DEFAULT_BUCKET,
    *,
    generated_by: str = "python -m llmgw.bus.permissions",
) -> str:
    """The `authorization { users = [...] }` block for `tls { verify_and_map: true }`, one
    user per certificate subject, in the order given."""
    keys.check_token(bucket, "bucket")
    lines = [
        f"# generated by `{generated_by}` for bucket {bucket!r};",
        "# regenerate it when a node joins: static config has no per-user templates",
        "authorization {",
        "  users = [",
    ]
    for user in users:
        comment = _COMMENTS.get(
            user.role,
            f"node: writes nodes.{user.name}, leases.{user.name}, shards.{user.name}.*",
        )
        lines += _user(user.subject, comment, permissions_for(user, bucket))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def render_mtls_users(
    nodes: Iterable[str],
    bucket: str = keys.DEFAULT_BUCKET,
    *,
    subject: str = DEFAULT_SUBJECT,
    controllers: Sequence[str] = ("controller",),
    routers: Sequence[str] = ("router",),
    operators: Sequence[str] = ("operator",),
) -> str:
    """The users block for certificates whose subjects share one shape, `subject` with
    `{name}` replaced by each CN.

    nats-server compares the whole DN, so a certificate issued as `O=Example, CN=node05`
    needs subject="CN={name},O=Example". Operators get no permissions block: they may do
    anything (create the bucket, `llmgw catalog apply`, `llmgw place`).
    """
    if "{name}" not in subject:
        raise ValueError(f"subject {subject!r} must contain {{name}} (e.g. 'CN={{name}}')")
    named: list[tuple[Role, Iterable[str]]] = [
        ("controller", controllers),
        ("router", routers),
        ("operator", operators),
        ("node", nodes),
    ]
    return render_users(
        (User(role, n, subject.format(name=n)) for role, names in named for n in names), bucket
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.bus.permissions",
        description="Print the nats-server authorization block for mTLS (verify_and_map) "
        "with one user per node (see docs/security.md).",
    )
    parser.add_argument("nodes", nargs="+", help="node ids (each node certificate's CN)")
    parser.add_argument("--bucket", default=keys.DEFAULT_BUCKET)
    parser.add_argument(
        "--subject",
        default=DEFAULT_SUBJECT,
        help="certificate subject of each user, {name} replaced (default %(default)s)",
    )
    parser.add_argument("--controller", action="append", help="controller CN(s) (controller)")
    parser.add_argument("--router", action="append", help="router CN(s) (router)")
    parser.add_argument("--operator", action="append", help="operator CN(s) (operator)")
    args = parser.parse_args(argv)
    try:
        text = render_mtls_users(
            args.nodes,
            args.bucket,
            subject=args.subject,
            controllers=args.controller or ["controller"],
            routers=args.router or ["router"],
            operators=args.operator or ["operator"],
        )
    except ValueError as e:
        parser.error(str(e))
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
