"""`llmgw router`, and the router options `llmgw up` shares with it."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import anyio
import click

from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import listen, nats_options, run_fast
from llmgw.shutdown import cancel_on_signal


def router_options(fn):
    """What `llmgw router` and `llmgw up` share about the router."""
    options = [
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
        click.option(
            "--max-body-mb",
            type=click.FloatRange(min=0.001),
            default=16.0,
            show_default=True,
            help="largest request body; larger ones get 413",
        ),
        click.option(
            "--affinity-load-factor",
            type=click.FloatRange(min=0.0),
            default=1.25,
            show_default=True,
            help="a conversation stays on its replica while that replica carries at most this "
            "times the average load; 0 turns prefix affinity off",
        ),
        click.option(
            "--session-header",
            default="x-session-id",
            show_default=True,
            help="request header naming a session, kept on one replica like a conversation",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def router_settings(
    listen: tuple[str, int],
    engine_api_key_file: Path | None,
    api_keys_file: Path | None,
    max_body_mb: float,
    affinity_load_factor: float,
    session_header: str,
):
    from llmgw.keyfiles import read_key, read_keys
    from llmgw.router.balancer import BalancerSettings
    from llmgw.router.proxy import ProxySettings
    from llmgw.router.server import HttpLimits
    from llmgw.router.service import RouterSettings

    engine_key = read_key(engine_api_key_file, "engine API key") if engine_api_key_file else None
    client_keys = (
        frozenset(read_keys(api_keys_file, "client API keys")) if api_keys_file else frozenset()
    )
    return RouterSettings(
        host=listen[0],
        port=listen[1],
        limits=HttpLimits(max_body=int(max_body_mb * 1024 * 1024)),
        balancer=BalancerSettings(affinity_load_factor=affinity_load_factor),
        proxy=ProxySettings(
            engine_api_key=engine_key,
            client_api_keys=client_keys,
            session_header=session_header,
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
    default="127.0.0.1:8080",
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
    settings = router_settings(listen, **options)
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
            tg.start_soon(cancel_on_signal, tg.cancel_scope)
            await tg.start(serve)
            click.echo(f"router listening on {r.url}/v1 ({r.source})")

    run_fast(run)
