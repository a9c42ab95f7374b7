"""`llmgw router`, and the router options `llmgw up` shares with it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import resource
from pathlib import Path

import anyio
import click

from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import (
    check_ports_free,
    freeze_startup,
    listen,
    nats_options,
    option_group,
    run_fast,
)
from llmgw.shutdown import drain_then_cancel_on_signal

_MB = 1024 * 1024


class FromSettings(click.Option):
    """An option whose default is read from the router's settings classes when it is needed
    (and shown in --help), so the two cannot differ; the router's modules are imported only
    by the commands that run it or show its help."""

    def get_default(self, ctx: click.Context, call: bool = True):
        return super().get_default(ctx, call=True)


def _defaults():
    from llmgw.router.service import RouterSettings

    return RouterSettings()


def _limits():
    return _defaults().limits


def default_listen() -> str:
    d = _defaults()
    return f"{d.host}:{d.port}"


def _setting(flag: str, default, help: str, *, type=None, dest: str | None = None):
    """An option whose default is `default()`, read from the router's settings (FromSettings)."""
    decls = (flag,) if dest is None else (flag, dest)
    return click.option(
        *decls, type=type, cls=FromSettings, default=default, show_default=True, help=help
    )


def _wait_text(waits: tuple[float, ...]) -> str:
    from llmgw.bus.records import PRIORITY_CLASSES

    return ",".join(f"{c}={w:g}" for c, w in zip(PRIORITY_CLASSES, waits, strict=True))


class QueueWait(click.ParamType):
    """`critical=60,standard=30,sheddable=10`: seconds per class (classes left out keep
    their default)."""

    name = "CLASS=SECONDS,..."

    def convert(self, value, param, ctx):
        from llmgw.bus.records import PRIORITY_CLASSES

        if isinstance(value, tuple):
            return value
        waits = list(_defaults().flow.max_wait)
        for part in str(value).split(","):
            name, eq, seconds = part.strip().partition("=")
            if not eq or name.strip() not in PRIORITY_CLASSES:
                self.fail(
                    f"{part.strip()!r}: expected CLASS=SECONDS with CLASS one of "
                    f"{', '.join(PRIORITY_CLASSES)} (critical=60,sheddable=5)",
                    param,
                    ctx,
                )
            try:
                wait = float(seconds)
            except ValueError:
                wait = -1.0
            if not wait >= 0:
                self.fail(f"{part.strip()!r}: the seconds must be a number >= 0", param, ctx)
            waits[PRIORITY_CLASSES.index(name.strip())] = wait
        return tuple(waits)


# What `llmgw router` and `llmgw up` share about the router: each setting's flag, its
# default (read from the settings classes), its help and its type.
router_options = option_group(
    click.option(
        "--engine-api-key-file",
        envvar="LLMGW_ENGINE_API_KEY_FILE",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="file holding the API key engines were started with (the agents' "
        "engines.api_key_file); sent to engines, never to clients",
    ),
    click.option(
        "--api-keys-file",
        envvar="LLMGW_ROUTER_API_KEYS_FILE",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="client API keys, one per line; requests without one get 401 [default: no keys needed]",
    ),
    _setting(
        "--max-body-mb",
        lambda: _limits().max_body / _MB,
        "largest request body; larger ones get 413",
        type=click.FloatRange(min=0.001),
    ),
    _setting(
        "--affinity-load-factor",
        lambda: _defaults().balancer.affinity_load_factor,
        "a conversation stays on its replica while that replica carries at most this times "
        "the average load; 0 turns prefix affinity off",
        type=click.FloatRange(min=0.0),
    ),
    _setting(
        "--session-header",
        lambda: _defaults().proxy.session_header,
        "request header naming a session, kept on one replica like a conversation",
    ),
    _setting(
        "--replica-header/--no-replica-header",
        lambda: _defaults().proxy.replica_header,
        "say in x-llmgw-replica which replica (or static URL) served each answer",
    ),
    _setting(
        "--metrics",
        lambda: _defaults().proxy.metrics,
        "/metrics on the API port: open to all (for Prometheus), only with a client key "
        "(--api-keys-file), or not served",
        type=click.Choice(["public", "keyed", "off"]),
        dest="metrics_access",
    ),
    _setting(
        "--page/--no-page",
        lambda: _defaults().proxy.page,
        "the fleet page at / (nodes, models, why replicas wait; read-only): it shows node "
        "addresses and engine endpoints to whoever reaches the router",
        dest="fleet_page",
    ),
    _setting(
        "--page-access",
        lambda: _defaults().proxy.page_access,
        "who the fleet page shows the fleet to: once any client key exists, only a client "
        "with one (the page asks for it), or anyone who reaches the router",
        type=click.Choice(["keyed", "public"]),
    ),
    _setting(
        "--engine-timeout",
        lambda: _defaults().upstream.read_timeout,
        "seconds an engine may stay silent in a request (before its first byte, and between "
        "two): a long prefill in a queue takes minutes",
        type=click.FloatRange(min=0.001),
    ),
    _setting(
        "--shutdown-grace",
        lambda: _defaults().shutdown_grace,
        "seconds requests in flight get to finish after SIGTERM or Ctrl-C; what is still "
        "running then is cut (a second signal cuts at once)",
        type=click.FloatRange(min=0.0),
    ),
    _setting(
        "--max-connections",
        lambda: _limits().max_connections,
        "client connections held at once; past it the oldest idle one is closed, or a new "
        "one gets 503 (by default fewer where the open-file limit holds fewer)",
        type=click.IntRange(min=1),
    ),
    _setting(
        "--hold-max",
        lambda: _defaults().hold.max_held,
        "requests held per cold model (autoscaled, no replica ready) while a replica starts; "
        "one more gets 429",
        type=click.IntRange(min=0),
    ),
    _setting(
        "--hold-timeout",
        lambda: _defaults().hold.max_wait,
        "seconds a request is held for a cold model at most; then 503 with Retry-After (a "
        "client may ask for less with x-llmgw-max-wait)",
        type=click.FloatRange(min=0.0),
    ),
    _setting(
        "--keys-offline-for",
        lambda: _defaults().gateway.serve_known_for,
        "seconds a router cut off from NATS keeps serving the API keys it knows (it cannot "
        "hear of a revocation meanwhile); past them every keyed request gets 503",
        type=click.FloatRange(min=0.0),
    ),
    _setting(
        "--limits-offline",
        lambda: _defaults().gateway.limits.offline,
        "when the shared limit counters cannot be reached: keep admitting limited keys from "
        "the shares this router holds (never past them), or answer them 503",
        type=click.Choice(["serve", "refuse"]),
    ),
    _setting(
        "--limits-offline-for",
        lambda: _defaults().gateway.limits.serve_offline_for,
        "with --limits-offline serve: seconds without the counters before limited keys get 503",
        type=click.FloatRange(min=0.0),
    ),
    _setting(
        "--limit-share",
        lambda: _defaults().gateway.limits.share,
        "fraction of a limit a router claims at a time from the shared counters: what one "
        "router may hold unspent (docs/router.md states the bound)",
        type=click.FloatRange(min=0.0001, max=1.0),
    ),
    click.option(
        "--queue/--no-queue",
        "queue",
        default=True,
        show_default=True,
        help="hold requests in the router's own queue, by class and fair share, while their "
        "model's engines are full (their slots known from the profile or the engine); off: "
        "every request goes straight to an engine",
    ),
    _setting(
        "--queue-wait",
        lambda: _wait_text(_defaults().flow.max_wait),
        "the longest each class waits in the router's queue (seconds, CLASS=S,...: any "
        "left out keep theirs); past it sheddable gets 429, the others 503",
        type=QueueWait(),
    ),
    _setting(
        "--queue-max",
        lambda: _defaults().flow.max_queued,
        "requests waiting per model at this router; one more makes the newest of a lower "
        "class give way, or is refused",
        type=click.IntRange(min=1),
    ),
    click.option(
        "--router-id",
        envvar="LLMGW_ROUTER_ID",
        default="",
        help="the key this router writes its load in, load.<id> (a token; with mTLS, its "
        "certificate's CN) [default: <hostname>-<port>]",
    ),
)


def _given(param: str) -> bool:
    """Whether the operator set `param` (on the command line or in its environment variable),
    rather than leaving the default."""
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source(param) if ctx is not None else None
    return source in (
        click.core.ParameterSource.COMMANDLINE,
        click.core.ParameterSource.ENVIRONMENT,
    )


def router_settings(
    listen: tuple[str, int],
    engine_api_key_file: Path | None,
    api_keys_file: Path | None,
    max_body_mb: float,
    affinity_load_factor: float,
    session_header: str,
    shutdown_grace: float,
    max_connections: int,
    replica_header: bool,
    metrics_access: str,
    fleet_page: bool,
    page_access: str,
    engine_timeout: float,
    hold_max: int,
    hold_timeout: float,
    router_id: str,
    keys_offline_for: float,
    limits_offline: str,
    limits_offline_for: float,
    limit_share: float,
    queue: bool = True,
    queue_wait: tuple[float, float, float] | None = None,
    queue_max: int | None = None,
):
    from llmgw.bus.keys import check_token
    from llmgw.gateway.gateway import GatewaySettings
    from llmgw.gateway.limiter import LimitSettings
    from llmgw.keyfiles import read_key, read_keys
    from llmgw.router.balancer import BalancerSettings
    from llmgw.router.flow import FlowSettings
    from llmgw.router.hold import HoldSettings
    from llmgw.router.proxy import ProxySettings
    from llmgw.router.server import HttpLimits
    from llmgw.router.service import RouterSettings
    from llmgw.router.upstream import UpstreamSettings

    engine_key = read_key(engine_api_key_file, "engine API key") if engine_api_key_file else None
    client_keys = (
        frozenset(read_keys(api_keys_file, "client API keys")) if api_keys_file else frozenset()
    )
    return RouterSettings(
        host=listen[0],
        port=listen[1],
        limits=HttpLimits(
            max_body=int(max_body_mb * 1024 * 1024),
            max_connections=fit_fd_limit(max_connections, explicit=_given("max_connections")),
        ),
        shutdown_grace=shutdown_grace,
        hold=HoldSettings(max_held=hold_max, max_wait=hold_timeout),
        flow=FlowSettings(
            enabled=queue,
            max_wait=queue_wait or FlowSettings().max_wait,
            max_queued=queue_max or FlowSettings().max_queued,
        ),
        router_id=check_token(router_id, "--router-id") if router_id else "",
        upstream=UpstreamSettings(read_timeout=engine_timeout),
        balancer=BalancerSettings(affinity_load_factor=affinity_load_factor),
        proxy=ProxySettings(
            engine_api_key=engine_key,
            client_api_keys=client_keys,
            session_header=session_header,
            replica_header=replica_header,
            metrics=metrics_access,
            page=fleet_page,
            page_access=page_access,
        ),
        gateway=GatewaySettings(
            serve_known_for=keys_offline_for,
            limits=LimitSettings(
                share=limit_share,
                offline=limits_offline,  # type: ignore[arg-type] (click's Choice)
                serve_offline_for=limits_offline_for,
            ),
        ),
    )


@click.command()
@nats_options
@click.option(
    "--catalog",
    "catalog_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="router-only run: serve the models with `endpoints` in this catalog file, no NATS",
)
@click.option(
    "--listen",
    callback=listen,
    cls=FromSettings,
    default=lambda: default_listen(),
    show_default=True,
    help="HOST:PORT the OpenAI API listens on (0.0.0.0:8080 for every interface)",
)
@router_options
def router(
    nats: NatsSettings,
    bucket: BucketSettings,
    catalog_path: Path | None,
    listen: tuple[str, int],
    **options,
) -> None:
    """Serve the OpenAI API in front of the fleet's ready engines.

    With --nats (or $LLMGW_NATS), the engines come from the bucket and the table follows it;
    with --catalog FILE, from the models' `endpoints` in that file, without NATS.
    """
    from llmgw.catalog import load_catalog_toml
    from llmgw.router.service import Router

    ctx = click.get_current_context()
    if catalog_path is not None and ctx.get_parameter_source("nats_urls") == (
        click.core.ParameterSource.COMMANDLINE
    ):
        raise click.UsageError(
            "--catalog runs the router without NATS; drop --nats, or drop --catalog to serve "
            "the bucket's models"
        )
    check_ports_free([("the router (OpenAI API)", listen, "move it with --listen HOST:PORT")])
    settings = router_settings(listen, **options)
    if catalog_path is None and nats.tls_cert:
        settings = dataclasses.replace(settings, router_id=_id_of_certificate(settings, nats))
    logging.getLogger("llmgw").setLevel(logging.INFO)
    r = Router(settings)
    if catalog_path is not None:
        models = load_catalog_toml(catalog_path)
        if not any(m.endpoints for m in models):
            raise click.ClickException(
                f"{catalog_path} has no model with `endpoints`: a router-only run serves "
                "static endpoints (placed models need --nats)"
            )
        serve = functools.partial(r.serve_static, models)
    else:
        serve = functools.partial(
            r.serve_bucket, lambda: Bus.connect(nats, bucket, give_up_after=None)
        )

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_then_cancel_on_signal, tg.cancel_scope, r.shutdown)
            await tg.start(serve)
            freeze_startup()
            click.echo(f"router listening on {r.url}/v1 ({r.source})")
            if settings.proxy.page:
                click.echo(f"fleet page: {r.url}/")

    run_fast(run)


def _id_of_certificate(settings, nats: NatsSettings) -> str:
    """With a client certificate, the router id is its CN: nats-server lets a router write
    only the subjects named after it (its load, what it holds of each limit, its usage
    counts), so any other id would have every such write refused."""
    from llmgw.pki import PkiError, common_name

    try:
        cn = common_name(nats.tls_cert)
    except PkiError as e:
        raise click.ClickException(str(e)) from None
    if cn is None:
        return settings.router_id
    if settings.router_id and settings.router_id != cn:
        raise click.ClickException(
            f"--router-id {settings.router_id} is not the CN of the router's certificate "
            f"({cn}, {nats.tls_cert}): nats-server would refuse every write it makes under "
            f"that id; drop --router-id (the CN is used) or issue a certificate for "
            f"{settings.router_id} (`llmgw pki issue --router {settings.router_id}`)"
        )
    return cn


# file descriptors a router keeps beside its client connections: NATS, listening sockets,
# health probes, logs
_FD_RESERVE = 256
_NOFILE_CEILING = 1 << 20  # the kernel's usual nr_open


def fit_fd_limit(max_connections: int, *, explicit: bool = True) -> int:
    """Raise this process's soft limit on open files to the hard one, say what it got, and
    hold at most as many client connections as fit beside an engine connection each and a
    reserve (NATS, probes, logs). A default fits the machine it runs on: it is sized to the
    limit quietly; only an operator's `explicit` count that cannot be met is warned about,
    with how to allow more. Without this, a router under 1,024 idle connections served
    nobody, and its own engine connections and probes failed with "Too many open files"."""
    log = logging.getLogger(__name__)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, _NOFILE_CEILING)
    raised_from = None
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            raised_from, soft = soft, target
        except (ValueError, OSError) as e:
            log.warning("router: cannot raise the open-file limit from %d: %s", soft, e)
    fits = max(1, (soft - _FD_RESERVE) // 2)
    held = min(fits, max_connections)
    log.info(
        "router: open-file limit %d%s: holds %d client connections",
        soft,
        f" (raised from {raised_from})" if raised_from is not None else "",
        held,
    )
    if explicit and fits < max_connections:
        log.warning(
            "router: the open-file limit (%d) holds %d client connections, not the %d asked "
            "for with --max-connections; raise its hard limit (ulimit -Hn, or LimitNOFILE= in "
            "the systemd unit)",
            soft,
            fits,
            max_connections,
        )
    return held
