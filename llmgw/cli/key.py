"""`llmgw key`: client API keys in `apikeys.<name>` (the operator their one writer): create
(the secret printed once, alone on the last line), ls, show, set, revoke, rotate.

The bucket holds each secret only as a salted SHA-256 (llmgw/gateway/credentials.py);
nobody can print a key's secret again, rotate it instead."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio
import click
import msgspec

from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.cli.common import json_option, nats_options, open_bus
from llmgw.cli.served import allow_unknown_option, check_models
from llmgw.errors import LlmgwError
from llmgw.gateway import credentials

T = TypeVar("T", bound=msgspec.Struct)

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
NONE = -1  # a limit option given as "none": remove that limit


class KeyCommandError(LlmgwError):
    """`llmgw key` / `llmgw team` cannot do this: a name taken or unknown, a team missing."""


def parse_duration(value: str, what: str) -> float:
    """Seconds from "30d", "12h", "90m", "45s", "2w"; "0" is none at all. A bare number is
    refused: `--expires 90` meant 90 days as often as the 90 seconds it was read as."""
    m = _DURATION.match(value.strip())
    if not m:
        raise click.BadParameter(f"{what} {value!r}: expected a number and s, m, h, d or w (30d)")
    number, unit = m.groups()
    if not unit and float(number) != 0:
        raise click.BadParameter(
            f"{what} {value!r}: a number needs its unit: {number}s, {number}m, {number}h, "
            f"{number}d or {number}w"
        )
    return float(number) * _UNITS[unit]


class LimitType(click.ParamType):
    """A limit: a whole number >= 1, or `none` to remove it (`set`)."""

    name = "N|none"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        if str(value).lower() == "none":
            return NONE
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number (or 'none')", param, ctx)
        if n < 1:
            self.fail(f"{n} must be at least 1; 'none' removes the limit", param, ctx)
        return n


LIMIT = LimitType()
LIMIT_FIELDS = ("rpm", "tpm", "tokens_per_day", "max_parallel")


def priority_option(what: str, none: str | None = None) -> Callable:
    """--priority critical|standard|sheddable (with `none`: 'none' clears it, and says what
    applies then)."""
    choices = [*records.PRIORITY_CLASSES, *(["none"] if none else [])]
    return click.option(
        "--priority",
        type=click.Choice(choices),
        default=None,
        help=f"{what}: who waits first when the fleet is full"
        + (f" ('none': {none})" if none else " [standard]"),
    )


def set_priority(value: str | None) -> records.PriorityClass | None:
    """A --priority as stored: 'none' clears it."""
    return None if value in (None, "none") else value  # type: ignore[return-value]


def limit_options(prefix: str = "", what: str = "") -> Callable:
    """--rpm, --tpm, --tokens-per-day, --max-parallel (with `prefix`: --model-rpm ...)."""
    helps = {
        "rpm": "requests per minute",
        "tpm": "tokens (prompt and completion) per minute",
        "tokens_per_day": "tokens per UTC day (429 insufficient_quota past it)",
        "max_parallel": "requests in flight",
    }

    def deco(fn):
        for field in reversed(LIMIT_FIELDS):
            flag = f"--{prefix}{field.replace('_', '-')}"
            fn = click.option(
                flag, f"{prefix.replace('-', '_')}{field}", type=LIMIT, help=helps[field] + what
            )(fn)
        return fn

    return deco


def apply_limits(limits: records.Limits, given: dict[str, int | None]) -> records.Limits:
    changes = {f: (None if v == NONE else v) for f, v in given.items() if v is not None}
    return msgspec.structs.replace(limits, **changes)


def describe_limits(limits: records.Limits) -> str:
    parts = [
        f"{name} {getattr(limits, f)}"
        for f, name in zip(LIMIT_FIELDS, ("rpm", "tpm", "tokens/day", "in flight"), strict=True)
        if getattr(limits, f) is not None
    ]
    return ", ".join(parts) or "none"


def split_models(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [m.strip() for m in value.split(",") if m.strip()]


def check_name(name: str, what: str) -> str:
    keys.check_token(name, f"{what} name")
    if name.startswith("_") or len(name) > 64:
        raise KeyCommandError(
            f"{what} name {name!r}: start it with a letter or digit, at most 64 characters"
        )
    return name


# written out whole: tests/test_commands_named.py checks every command a message names
_LISTED_BY = {"key": "`llmgw key ls`", "team": "`llmgw team ls`"}


async def change_record(
    bus: Bus,
    key: str,
    type_: type[T],
    change: Callable[[T], Awaitable[T] | T],
    noun: Literal["key", "team"],
    name: str,
) -> T:
    """Read, change and write back with compare-and-set (another operator's write in
    between is read again, never overwritten). `noun` is the command of its records."""
    what = f"{noun} {name!r}"
    for _ in range(10):
        entry = await bus.get(key, decoder(type_))
        if entry is None:
            raise KeyCommandError(f"{what} does not exist ({_LISTED_BY[noun]} lists them)")
        new = change(msgspec.structs.replace(entry.value))
        if not isinstance(new, msgspec.Struct):
            new = await new
        if await bus.update(key, new, entry.revision) is not None:
            return new
    raise KeyCommandError(f"{what} kept changing while being written: try again")


async def ensure_streams(bus: Bus) -> list[str]:
    """Make the gateway's streams that are missing, as many copies as the bucket; the
    names made."""
    from llmgw.bus.counters import StreamPlan
    from llmgw.bus.counters import ensure_streams as ensure

    configured = bus.bucket.replicas
    return await ensure(bus, StreamPlan(replicas=configured) if configured else None)


async def _streams_or_say(bus: Bus) -> None:
    """`llmgw key ls` makes the streams that are missing (the fix routers name when keys
    were written by hand), and only says so when it may not (not the operator)."""
    from llmgw.bus.errors import BusError

    try:
        made = await ensure_streams(bus)
    except BusError as e:
        click.echo(f"warning: the gateway's streams could not be checked or made: {e}", err=True)
        return
    if made:
        click.echo(
            f"made streams {', '.join(made)}: routers limit, meter and audit again", err=True
        )


def _state(k: records.ApiKey, now: float) -> str:
    if k.revoked_at is not None and now >= k.revoked_at:
        return "revoked"
    if k.expires_at is not None and now >= k.expires_at:
        return "expired"
    return "active"


def _class_of(k: records.ApiKey) -> str:
    return k.priority or "its team's (standard without one)"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if t else "never"


def key_summary(k: records.ApiKey, now: float) -> dict[str, object]:
    """What `key ls --json` / `key show --json` print: everything but the hashes."""
    return {
        "name": k.name,
        "team": k.team,
        "state": _state(k, now),
        "models": k.models,
        "limits": msgspec.to_builtins(k.limits),
        "model_limits": msgspec.to_builtins(k.model_limits),
        "created_at": k.created_at,
        "expires_at": k.expires_at,
        "revoked_at": k.revoked_at,
        "secrets": len(k.secrets),
        "secrets_in_grace_until": [s.valid_until for s in k.secrets if s.valid_until],
        "description": k.description,
        "priority": k.priority,
    }


# what a fleet with keys still shows to whoever reaches a router (docs/security.md)
SHOWN_TO_KEYS = (
    "with a key in the bucket, routers ask every client for one: the API, /v1/models and "
    "the fleet page's view of the fleet (`llmgw router --page-access public` opens it); "
    "/health and /metrics stay open (/metrics names models, replicas and their traffic, "
    "for Prometheus; `llmgw router --metrics keyed` asks a key of it)"
)


@click.group()
def key() -> None:
    """Client API keys (apikeys.<name>): once any exists, routers require one."""


@key.command("create")
@click.argument("name")
@click.option("--team", default=None, help="the team whose limits it shares (llmgw team create)")
@click.option(
    "--models",
    default=None,
    help="the served names (what clients ask for) it may use, comma-separated [all]",
)
@allow_unknown_option
@click.option(
    "--expires",
    default=None,
    help="valid for this long: 30d, 12h, 90m, 45s (a number needs its unit)",
)
@click.option("--description", default="", help="who it is for")
@priority_option("its requests' class (else its team's)")
@limit_options()
@limit_options("model-", " on each model")
@nats_options
def create(
    name,
    team,
    models,
    allow_unknown,
    expires,
    description,
    priority,
    nats: NatsSettings,
    bucket: BucketSettings,
    **lim,
) -> None:
    """Create key NAME and print its secret, once, alone on the last line."""
    check_name(name, "key")
    now = time.time()
    secret = credentials.new_secret(name)
    record = records.ApiKey(
        name=name,
        team=team,
        models=split_models(models) or [],
        limits=apply_limits(records.Limits(), {f: lim[f] for f in LIMIT_FIELDS}),
        model_limits=apply_limits(records.Limits(), {f: lim[f"model_{f}"] for f in LIMIT_FIELDS}),
        secrets=[credentials.hash_secret(secret, now)],
        created_at=now,
        expires_at=now + parse_duration(expires, "--expires") if expires else None,
        description=description,
        priority=set_priority(priority),
    )

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            await check_models(bus, record.models, allow_unknown=allow_unknown)
            if team is not None:
                check_name(team, "team")
                if await bus.get(keys.team(team), decoder(records.Team)) is None:
                    raise KeyCommandError(
                        f"team {team!r} does not exist: create it first with "
                        f"`llmgw team create {team}`"
                    )
            await ensure_streams(bus)
            if await bus.create(keys.apikey(name), record) is None:
                raise KeyCommandError(
                    f"key {name!r} exists: `llmgw key rotate {name}` gives it a new secret, "
                    f"or pick another name"
                )

    anyio.run(run)
    click.echo(
        f"key {name} created (team {team or 'none'}; models: {', '.join(record.models) or 'all'}; "
        f"limits: {describe_limits(record.limits)}; priority: {_class_of(record)}; "
        f"expires: {_when(record.expires_at)})"
    )
    click.echo(SHOWN_TO_KEYS)
    click.echo("its secret, shown only now (the bucket keeps a salted hash):")
    click.echo(secret)


async def _all_keys(bus: Bus) -> list[records.ApiKey]:
    found = await bus.list(keys.pattern(keys.APIKEYS), decoder(records.ApiKey))
    return sorted((e.value for e in found.values()), key=lambda k: k.name)


@key.command("ls")
@click.option("--team", default=None, help="only this team's keys")
@json_option
@nats_options
def ls(team, as_json: bool, nats: NatsSettings, bucket: BucketSettings) -> None:
    """List keys: team, state, models, limits."""

    async def run() -> list[records.ApiKey]:
        async with open_bus(nats, bucket) as bus:
            await _streams_or_say(bus)
            return await _all_keys(bus)

    now = time.time()
    found = [k for k in anyio.run(run) if team is None or k.team == team]
    if as_json:
        click.echo(json.dumps([key_summary(k, now) for k in found], indent=2))
        return
    if not found:
        click.echo("no keys: routers serve everyone (`llmgw key create NAME` to require keys)")
        return
    click.echo(f"{'NAME':20} {'TEAM':14} {'STATE':8} {'EXPIRES':21} {'MODELS':20} LIMITS")
    for k in found:
        click.echo(
            f"{k.name:20} {k.team or '-':14} {_state(k, now):8} {_when(k.expires_at):21} "
            f"{','.join(k.models) or 'all':20} {describe_limits(k.limits)}"
        )


@key.command("show")
@click.argument("name")
@json_option
@nats_options
def show(name, as_json: bool, nats: NatsSettings, bucket: BucketSettings) -> None:
    """One key: its team, models, limits, expiry, and its secrets in grace."""

    async def run() -> records.ApiKey:
        async with open_bus(nats, bucket) as bus:
            entry = await bus.get(keys.apikey(check_name(name, "key")), decoder(records.ApiKey))
            if entry is None:
                raise KeyCommandError(f"key {name!r} does not exist (`llmgw key ls`)")
            return entry.value

    k = anyio.run(run)
    summary = key_summary(k, time.time())
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"key {k.name}: {summary['state']}")
    click.echo(f"  team: {k.team or 'none'}")
    click.echo(f"  models: {', '.join(k.models) or 'all'}")
    click.echo(f"  limits: {describe_limits(k.limits)}")
    click.echo(f"  limits on each model: {describe_limits(k.model_limits)}")
    click.echo(f"  priority: {_class_of(k)}")
    click.echo(f"  created: {_when(k.created_at)}; expires: {_when(k.expires_at)}")
    if k.revoked_at:
        click.echo(f"  revoked: {_when(k.revoked_at)}")
    for s in k.secrets:
        if s.valid_until:
            click.echo(f"  an older secret works until {_when(s.valid_until)}")


@key.command("set")
@click.argument("name")
@click.option(
    "--models",
    default=None,
    help="the served names it may use, comma-separated ('' all)",
)
@allow_unknown_option
@click.option("--expires", default=None, help="valid for this long from now (30d, 12h), or 'never'")
@click.option("--team", default=None, help="move it to this team ('none': no team)")
@priority_option("its requests' class", none="its team's class")
@limit_options()
@limit_options("model-", " on each model")
@nats_options
def set_(
    name,
    models,
    allow_unknown,
    expires,
    team,
    priority,
    nats: NatsSettings,
    bucket: BucketSettings,
    **lim,
) -> None:
    """Change a key's models, expiry, team, class or limits (a limit 'none' removes it)."""
    check_name(name, "key")

    def change(k: records.ApiKey) -> records.ApiKey:
        if models is not None:
            k.models = split_models(models) or []
        if expires is not None:
            k.expires_at = (
                None if expires == "never" else time.time() + parse_duration(expires, "--expires")
            )
        if team is not None:
            k.team = None if team == "none" else check_name(team, "team")
        if priority is not None:
            k.priority = set_priority(priority)
        k.limits = apply_limits(k.limits, {f: lim[f] for f in LIMIT_FIELDS})
        k.model_limits = apply_limits(k.model_limits, {f: lim[f"model_{f}"] for f in LIMIT_FIELDS})
        return k

    async def run() -> records.ApiKey:
        async with open_bus(nats, bucket) as bus:
            await check_models(bus, split_models(models), allow_unknown=allow_unknown)
            return await change_record(bus, keys.apikey(name), records.ApiKey, change, "key", name)

    k = anyio.run(run)
    click.echo(
        f"key {k.name}: limits {describe_limits(k.limits)}; models {', '.join(k.models) or 'all'}"
        f"; priority {_class_of(k)}"
    )


@key.command("revoke")
@click.argument("name")
@nats_options
def revoke(name, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Refuse key NAME from now on, on every router (the record stays, for the audit trail)."""
    check_name(name, "key")

    def change(k: records.ApiKey) -> records.ApiKey:
        k.revoked_at = k.revoked_at or time.time()
        return k

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            await change_record(bus, keys.apikey(name), records.ApiKey, change, "key", name)

    anyio.run(run)
    click.echo(f"key {name} revoked: routers refuse it as soon as their watch delivers this")


@key.command("rotate")
@click.argument("name")
@click.option(
    "--grace",
    default="24h",
    show_default=True,
    help="how long the old secret keeps working: 24h, 30m (0 ends it now)",
)
@nats_options
def rotate(name, grace, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Give key NAME a new secret (printed alone on the last line); the old one works for --grace."""
    check_name(name, "key")
    now = time.time()
    until = now + parse_duration(grace, "--grace")
    secret = credentials.new_secret(name)

    def change(k: records.ApiKey) -> records.ApiKey:
        kept = [
            s
            if s.valid_until is not None and s.valid_until <= until
            else msgspec.structs.replace(s, valid_until=until)
            for s in k.secrets
            if s.valid_until is None or s.valid_until > now
        ]
        if len(kept) >= records.MAX_KEY_SECRETS:  # the oldest in grace goes first
            kept = kept[-(records.MAX_KEY_SECRETS - 1) :]
        k.secrets = [*kept, credentials.hash_secret(secret, now)]
        return k

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            await change_record(bus, keys.apikey(name), records.ApiKey, change, "key", name)

    anyio.run(run)
    click.echo(f"key {name} rotated; the old secret works until {_when(until)}")
    click.echo("its new secret, shown only now:")
    click.echo(secret)
