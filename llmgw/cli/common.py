"""What every `llmgw` command shares: the NATS options, opening the bus for one command,
how errors stated for a person become messages, and running until a signal."""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
from collections.abc import AsyncIterator

import anyio
import click

from llmgw.bus import keys
from llmgw.bus.client import DEFAULT_NATS_URL, BucketSettings, Bus, NatsSettings, NatsUnreachable
from llmgw.errors import stated
from llmgw.shutdown import cancel_on_signal


class StatedErrors(click.Group):
    """A group of commands under which an error llmgw states for a person (an LlmgwError)
    becomes the command's message (exit 1); any other exception is a bug and keeps its
    traceback. `llmgw` itself, and `llmgw pki` when run on its own."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BaseException as e:
            problem = stated(e)
            if problem is None:
                raise
            refused = click.ClickException(str(problem))
            # 2, as click's own usage errors, where what was given names nothing there is
            refused.exit_code = getattr(problem, "exit_code", 1)
            raise refused from None


def nats_options(fn):
    @click.option(
        "--nats",
        "nats_urls",
        multiple=True,
        envvar="LLMGW_NATS",
        show_envvar=True,
        help=f"NATS URL (repeatable) [default: {DEFAULT_NATS_URL}]",
    )
    @click.option(
        "--tls-ca", envvar="LLMGW_TLS_CA", type=click.Path(dir_okay=False), help="CA file"
    )
    @click.option(
        "--tls-cert",
        envvar="LLMGW_TLS_CERT",
        type=click.Path(dir_okay=False),
        help="client certificate",
    )
    @click.option(
        "--tls-key", envvar="LLMGW_TLS_KEY", type=click.Path(dir_okay=False), help="client key"
    )
    @click.option(
        "--bucket",
        envvar="LLMGW_BUCKET",
        default=keys.DEFAULT_BUCKET,
        show_default=True,
        help="the KV bucket",
    )
    @click.option(
        "--bucket-replicas",
        envvar="LLMGW_BUCKET_REPLICAS",
        type=click.IntRange(1, 5),
        default=None,
        help="copies of the bucket a NATS cluster keeps (3 on a 3-server cluster); checked "
        "against an existing bucket [default: 1 when creating it, else as it is]",
    )
    @functools.wraps(fn)
    def wrapper(*args, nats_urls, tls_ca, tls_cert, tls_key, bucket, bucket_replicas, **kwargs):
        urls = tuple(u for item in nats_urls for u in item.split()) or (DEFAULT_NATS_URL,)
        settings = NatsSettings(
            urls=urls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            name=f"llmgw {fn.__name__}",
        )
        buckets = BucketSettings(name=bucket, replicas=bucket_replicas)
        return fn(*args, nats=settings, bucket=buckets, **kwargs)

    return wrapper


def option_group(*options):
    """One decorator for `options` (click.option decorators), given in --help order: what
    several commands share (`llmgw router` and `llmgw up`, say)."""

    def apply(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="print JSON instead of text")(fn)


@contextlib.asynccontextmanager
async def open_bus(nats: NatsSettings, bucket: BucketSettings) -> AsyncIterator[Bus]:
    """The bus for one command, closed when it is done; an unreachable NATS says what to
    check, at once when nothing listens there."""
    try:
        bus = await Bus.connect(nats, bucket, give_up_after=5, wait_for_server=False)
    except NatsUnreachable as e:
        raise click.ClickException(
            f"{e}; is llmgw up (or your NATS cluster) running? set --nats or LLMGW_NATS"
        ) from None
    async with bus:
        yield bus


def listen(ctx, param, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r}: expected HOST:PORT, e.g. 0.0.0.0:8080")
    return host.strip("[]") or "0.0.0.0", int(port)


async def until_signalled(*runners) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        for run in runners:
            tg.start_soon(run)


def run_fast(fn) -> None:
    """anyio.run on uvloop when it is installed (the router's throughput doubles; measured in
    docs/performance.md)."""
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    anyio.run(fn, backend_options=options)


def freeze_startup() -> None:
    """What start-up made (modules, settings: ~45,000 objects) lives as long as the
    process: kept out of the collector's full passes, which otherwise walk it all again
    every few seconds under load, the event loop stalled meanwhile (a router's pauses went
    from 57 ms to 13 ms: docs/performance.md). Called once everything has started."""
    gc.collect()
    gc.freeze()


class PortTaken(click.ClickException):
    """A port a command is about to listen on is taken: one line naming it and the option
    that moves it, before anything starts (a half-started `llmgw up` leaves NATS, a
    controller and an agent behind a traceback)."""

    exit_code = 2


def check_ports_free(wanted: list[tuple[str, tuple[str, int], str]]) -> None:
    """Refuse, before anything starts, the ports in `wanted` that another program listens on
    or that two of them ask for alike: (what listens, (host, port), how to move it). Port 0
    (the kernel picks one) is never taken."""
    import socket

    problems = []
    seen: list[tuple[str, str, int]] = []
    for what, (host, port), move in wanted:
        if port == 0:
            continue
        same = next((w for w, h, p in seen if p == port and _overlap(h, host)), None)
        if same is not None:
            problems.append(f"{what} and {same} both ask for port {port}: {move}")
            continue
        seen.append((what, host, port))
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except OSError as e:
            problems.append(f"{what}: cannot resolve host {host!r} ({e}): {move}")
            continue
        with socket.socket(family, kind, proto) as s:
            # as the servers bind: a port left in TIME_WAIT by an earlier run is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                from llmgw.holders import port_holder  # psutil: only when a port is taken

                why = (
                    f"is in use by {port_holder(port) or 'another program'}"
                    if e.errno == errno.EADDRINUSE
                    else (f"cannot be listened on ({e.strerror or e})")
                )
                problems.append(f"{what} {_hostport(host, port)} {why}: {move}")
    if problems:
        raise PortTaken("\n".join(problems))


def _overlap(a: str, b: str) -> bool:
    return a == b or bool({a, b} & {"", "0.0.0.0", "::"})


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def did_you_mean(given: str, known: list[str], what: str, *, shown: int = 20) -> str:
    """ "did you mean 'n1'? known nodes: n1, n2" for an error about a name that names
    nothing; the list is cut short where a fleet has thousands."""
    import difflib

    close = difflib.get_close_matches(given, known, n=1, cutoff=0.6)
    names = ", ".join(known[:shown]) + (
        f", and {len(known) - shown} more" if len(known) > shown else ""
    )
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known {what}: {names or 'none'}"
