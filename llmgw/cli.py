"""The `llmgw` command: up, status, agent, controller, place, catalog.

Every command that talks to NATS takes --nats (repeatable; $LLMGW_NATS), the TLS files
and --bucket; read-only commands take --json.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import click
import msgspec

from llmgw import __version__
from llmgw.agent.config import (
    DEFAULT_CONFIG_PATH,
    AgentConfig,
    ConfigError,
    Paths,
    Weights,
    load_config,
    parse_config,
    render_config,
    write_config,
)  # the config alone: plain msgspec
from llmgw.bus import keys
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, NatsUnreachable
from llmgw.controller.liveness import LOST_AFTER_S, UNREACHABLE_AFTER_S
from llmgw.errors import LlmgwError, stated
from llmgw.logs import setup_logging
from llmgw.shutdown import cancel_on_signal

# The agent's stack (psutil, NVML, aiohttp) is imported only by the commands that run an agent.

log = logging.getLogger("llmgw.cli")


# --- common options ---------------------------------------------------------------------


def nats_options(fn):
    @click.option(
        "--nats",
        "nats_urls",
        multiple=True,
        envvar="LLMGW_NATS",
        show_envvar=True,
        help="NATS URL (repeatable) [default: nats://127.0.0.1:4222]",
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
        urls = tuple(u for item in nats_urls for u in item.split()) or ("nats://127.0.0.1:4222",)
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


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="print JSON instead of text")(fn)


@contextlib.asynccontextmanager
async def open_bus(nats: NatsSettings, bucket: BucketSettings) -> AsyncIterator[Bus]:
    """The bus for one command, closed when it is done; an unreachable NATS says what to check."""
    try:
        bus = await Bus.connect(nats, bucket, give_up_after=5)
    except NatsUnreachable as e:
        raise click.ClickException(
            f"{e}; is llmgw up (or your NATS cluster) running? set --nats or LLMGW_NATS"
        ) from None
    async with bus:
        yield bus


class _Commands(click.Group):
    """Errors llmgw states for a person become messages (exit 1); any other exception is a
    bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except BaseException as e:
            problem = stated(e)
            if problem is None:
                raise
            raise click.ClickException(str(problem)) from None


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__)
@click.option(
    "--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "WARNING"), show_default=True
)
def main(log_level: str) -> None:
    """llmgw: LLM engines on a GPU fleet behind one OpenAI-compatible endpoint."""
    setup_logging(log_level)


# --- router options (llmgw router, llmgw up) ------------------------------------------


def _listen(ctx, param, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r}: expected HOST:PORT, e.g. 0.0.0.0:8080")
    return host.strip("[]") or "0.0.0.0", int(port)


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
    from llmgw.router.balancer import BalancerSettings
    from llmgw.router.http import HttpLimits
    from llmgw.router.proxy import ProxySettings
    from llmgw.router.service import RouterSettings
    from llmgw.secrets import read_key, read_keys

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


# --- llmgw up ---------------------------------------------------------------------------


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where NATS stores the bucket and the agent its state [default: the user data dir]",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="address NATS listens on")
@click.option("--port", default=4222, show_default=True, help="port NATS listens on")
@click.option(
    "--agent-config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="agent config for the local agent (its NATS URLs are replaced by the embedded server)",
)
@click.option("--no-agent", is_flag=True, help="do not run a local agent")
@click.option(
    "--router-listen",
    "router_listen",
    callback=_listen,
    default="127.0.0.1:8080",
    show_default=True,
    help="HOST:PORT of the OpenAI API",
)
@click.option("--no-router", is_flag=True, help="do not run a router")
@router_options
def up(
    data_dir: Path | None,
    host: str,
    port: int,
    agent_config: Path | None,
    no_agent: bool,
    router_listen: tuple[str, int],
    no_router: bool,
    **router_opts,
) -> None:
    """Run llmgw on this machine: embedded NATS, a controller, a router and a local agent."""
    import platformdirs

    from llmgw.bus.server import EmbeddedNats, NatsServerError

    logging.getLogger("llmgw").setLevel(logging.INFO)
    data_dir = data_dir or Path(platformdirs.user_data_dir("llmgw"))
    try:
        router = None if no_router else router_settings(router_listen, **router_opts)
    except LlmgwError as e:
        raise click.ClickException(str(e)) from None
    server = EmbeddedNats(data_dir=data_dir / "nats", host=host, port=port)
    try:
        server.start()
    except NatsServerError as e:
        raise click.ClickException(str(e)) from None
    url = server.url
    try:
        cfg = _up_agent_config(agent_config, url, data_dir)
        cmd = _this_command()
        click.echo(f"NATS listening on {url}")
        click.echo(
            f"store {data_dir}: the catalog, the replicas asked for and the agent's state persist "
            f"there across runs (`{cmd} place MODEL --replicas 0` removes replicas; an empty "
            "--data-dir starts from nothing)"
        )
        click.echo(f"  export LLMGW_NATS={url}; {cmd} status")
        click.echo(
            f"  nats --server {url} kv ls {keys.DEFAULT_BUCKET}; nats --server {url} kv watch {keys.DEFAULT_BUCKET}"
        )
        click.echo("Ctrl-C stops everything.")
        _run_fast(functools.partial(_run_up, cfg, no_agent, router, cmd))
    finally:
        server.stop()
        click.echo("stopped")


def _this_command() -> str:
    """How to run llmgw again from any shell, venv activated or not."""
    import shutil
    import sys

    argv0 = Path(sys.argv[0])
    if argv0.name == "llmgw" and argv0.exists():
        path = str(argv0.resolve())
        return "llmgw" if shutil.which("llmgw") == path else path
    return f"{sys.executable} -m llmgw.cli"


def _up_agent_config(path: Path | None, url: str, data_dir: Path) -> AgentConfig:
    try:
        cfg = (
            load_config(path)
            if path
            else AgentConfig(
                weights=Weights(fetch_dir=str(data_dir / "weights")),
                paths=Paths(state_dir=str(data_dir / "agent")),
            )
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    return msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, urls=[url]))


async def _run_up(cfg: AgentConfig, no_agent: bool, router, cmd: str) -> None:
    bus = await Bus.connect(
        NatsSettings(urls=tuple(cfg.nats.urls), name="llmgw controller"),
        BucketSettings(name=cfg.nats.bucket),
        give_up_after=10,
    )
    try:
        await _run_up_parts(cfg, no_agent, router, cmd, bus)
    finally:
        with anyio.CancelScope(shield=True):
            await bus.close()


async def _run_up_parts(cfg: AgentConfig, no_agent: bool, router, cmd: str, bus: Bus) -> None:
    from llmgw.controller.loop import Controller

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        await tg.start(Controller(bus).run)
        click.echo("controller running")
        agent = None
        if not no_agent:
            from llmgw.agent.service import Agent

            agent = await tg.start(Agent(cfg).run)
            click.echo("agent running")
        if router is not None:
            from llmgw.router.service import Router

            r = Router(router)
            settings = NatsSettings(urls=tuple(cfg.nats.urls), name="llmgw router")
            bucket = BucketSettings(name=cfg.nats.bucket)
            await tg.start(
                r.serve_bucket, lambda: Bus.connect(settings, bucket, give_up_after=None)
            )
            click.echo(f"router listening on {r.url}/v1 (OpenAI base URL; `model` = a served name)")
        for line in await _earlier_run(bus, agent, cmd):
            click.echo(line)
        await anyio.sleep_forever()


async def _earlier_run(bus: Bus, agent, cmd: str) -> list[str]:
    """What a restarted `llmgw up` brings back from its store, and what this machine lacks
    for it: yesterday's model relaunching and failing must not be a mystery."""
    from llmgw.bus import records
    from llmgw.bus.client import decoder
    from llmgw.catalog import decode_model

    desired = await bus.list(keys.pattern(keys.DESIRED), decoder(records.Desired))
    wanted = sorted(
        (e.value for e in desired.values() if e.value.replicas > 0), key=lambda d: d.model
    )
    if not wanted:
        return []
    lines = [
        "replicas asked for in an earlier run, placed again now: "
        + ", ".join(f"{d.model} x{d.replicas}" for d in wanted)
    ]
    if agent is None or agent.inventory is None:
        return lines
    have = {e.name for e in agent.inventory.engines}
    models = await bus.list(keys.pattern(keys.CATALOG), lambda b: decode_model(b))
    by_id = {e.value.id: e.value for e in models.values()}
    for d in wanted:
        model = by_id.get(d.model)
        if model is None or model.endpoints:
            continue
        engines = sorted({p.engine for p in model.profiles})
        if not set(engines) & have:
            lines.append(
                f"  {d.model} needs {' or '.join(engines)}, which this machine does not have "
                f"(not on PATH or in the agent config): install it, or `{cmd} place {d.model} "
                "--replicas 0`"
            )
    return lines


# --- llmgw status -----------------------------------------------------------------------


@main.command()
@nats_options
@json_option
def status(nats: NatsSettings, bucket: BucketSettings, as_json: bool) -> None:
    """What the fleet has: nodes, their hardware, engines, weights and heartbeats."""
    from llmgw.status import gather, render

    async def run() -> dict[str, Any]:
        async with open_bus(nats, bucket) as bus:
            return await gather(bus)

    view = anyio.run(run)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True))
    else:
        click.echo(render(view, now=time.time()))


# --- llmgw controller, place, catalog -----------------------------------------------------


@main.command()
@nats_options
@click.option("--id", "controller_id", default=None, help="controller id (default: hostname-pid)")
@click.option(
    "--unreachable-after",
    type=click.FloatRange(min=0, min_open=True),
    default=UNREACHABLE_AFTER_S,
    show_default=True,
    help="seconds without a heartbeat before a node is unreachable",
)
@click.option(
    "--lost-after",
    type=click.FloatRange(min=0, min_open=True),
    default=LOST_AFTER_S,
    show_default=True,
    help="seconds without a heartbeat before a node is lost and its replicas move",
)
def controller(
    nats: NatsSettings, bucket: BucketSettings, controller_id, unreachable_after, lost_after
) -> None:
    """Run a controller (several may run; one leads)."""
    from llmgw.controller.loop import Controller, ControllerSettings

    logging.getLogger("llmgw").setLevel(logging.INFO)
    settings = ControllerSettings(unreachable_after=unreachable_after, lost_after=lost_after)
    if controller_id:
        settings = ControllerSettings(
            controller_id=controller_id, unreachable_after=unreachable_after, lost_after=lost_after
        )

    async def run() -> None:
        # a service: it waits for NATS (and JetStream) like for any outage, saying so
        async with await Bus.connect(nats, bucket) as bus:
            await _until_signalled(Controller(bus, settings).run)

    anyio.run(run)


async def _until_signalled(*runners) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        for run in runners:
            tg.start_soon(run)


@main.command()
@click.argument("model")
@click.option(
    "--replicas",
    type=click.IntRange(min=0),
    required=True,
    help="how many replicas (0 removes them)",
)
@click.option("--profile", default=None, help="catalog profile (default: the first that fits)")
@click.option(
    "--wait",
    is_flag=True,
    help="follow until every replica is ready or the controller explains why not",
)
@click.option(
    "--dry-run", is_flag=True, help="compute the plan from the current bucket; write nothing"
)
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="seconds --wait follows for"
)
@nats_options
def place(
    model, replicas, profile, wait, dry_run, timeout, nats: NatsSettings, bucket: BucketSettings
) -> None:
    """Ask for N replicas of MODEL, then show where they go and why."""
    from llmgw.placing import dry_run_plan, follow_placement, write_desired

    async def run() -> int:
        async with open_bus(nats, bucket) as bus:
            if dry_run:
                for line in await dry_run_plan(bus, model, replicas, profile):
                    click.echo(line)
                return 0
            written_at = await write_desired(bus, model, replicas, profile)
            click.echo(
                f"desired.{model}: {replicas} replica(s)"
                + (f", profile {profile}" if profile else "")
            )
            return await follow_placement(
                bus, model, written_at, wait=wait, timeout=timeout, echo=click.echo
            )

    raise SystemExit(anyio.run(run))


@main.group()
def catalog() -> None:
    """The model catalog (catalog.<model> keys)."""


@catalog.command("apply")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@nats_options
def catalog_apply(path: Path, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Validate a TOML catalog and write it; an invalid catalog is refused whole."""
    from llmgw.catalog import CatalogError, decode_model, encode_model, load_catalog_toml

    try:
        models = load_catalog_toml(path)
    except CatalogError as e:
        raise click.ClickException(
            f"catalog refused, nothing written ({len(e.errors)} error(s)):\n  "
            + "\n  ".join(e.errors)
        ) from None

    async def run() -> None:
        async with open_bus(nats, bucket) as bus:
            for m in models:
                key = keys.catalog(m.id)
                old = await bus.get(key, lambda b, i=m.id: decode_model(b, i))
                if old is not None and old.value == m:
                    click.echo(f"{key}: unchanged")
                    continue
                await bus.put(key, encode_model(m))
                click.echo(f"{key}: {'updated' if old else 'created'}")

    anyio.run(run)


@catalog.command("ls")
@nats_options
@json_option
def catalog_ls(nats: NatsSettings, bucket: BucketSettings, as_json: bool) -> None:
    """List the models in the catalog."""
    from llmgw.catalog import decode_model

    async def run():
        async with open_bus(nats, bucket) as bus:
            entries = await bus.list(keys.pattern(keys.CATALOG), lambda b: decode_model(b))
            return [e.value for e in entries.values()]

    models = anyio.run(run)
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(models), indent=2))
        return
    for m in sorted(models, key=lambda m: m.id):
        if m.endpoints:
            click.echo(f"{m.id}  ({m.served_name})  static endpoints: {', '.join(m.endpoints)}")
            continue
        profiles = "; ".join(
            f"{p.name}: {p.engine}, "
            + (f"{p.nodes}x{p.gpus_per_node} GPU" if p.gpus_per_node else "CPU")
            + (f" >= {p.gpu_memory_gb:g} GB" if p.gpu_memory_gb else "")
            for p in m.profiles
        )
        click.echo(f"{m.id}  ({m.served_name})  {profiles}")


# --- llmgw router -----------------------------------------------------------------------


@main.command()
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
    callback=_listen,
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
    from llmgw.catalog import CatalogError, load_catalog_toml
    from llmgw.router.service import Router

    ctx = click.get_current_context()
    if catalog_path is not None and ctx.get_parameter_source("nats_urls") == (
        click.core.ParameterSource.COMMANDLINE
    ):
        raise click.UsageError(
            "--catalog runs the router without NATS; drop --nats, or drop --catalog to serve "
            "the bucket's models"
        )
    try:
        settings = router_settings(listen, **options)
    except LlmgwError as e:
        raise click.ClickException(str(e)) from None
    logging.getLogger("llmgw").setLevel(logging.INFO)
    r = Router(settings)
    if catalog_path is not None:
        try:
            models = load_catalog_toml(catalog_path)
        except CatalogError as e:
            raise click.ClickException(
                f"catalog refused ({len(e.errors)} error(s)):\n  " + "\n  ".join(e.errors)
            ) from None
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

    _run_fast(run)


def _run_fast(fn) -> None:
    """anyio.run on uvloop when it is installed (the router's throughput doubles; measured in
    docs/performance.md)."""
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    anyio.run(fn, backend_options=options)


# --- llmgw agent ------------------------------------------------------------------------


@main.group()
def agent() -> None:
    """Onboard and run the node agent."""


def _fabric_pair(ctx, param, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        adapter, sep, fabric = v.partition("=")
        if not sep or not adapter or not fabric:
            raise click.BadParameter(f"{v!r}: expected ADAPTER=FABRIC, e.g. mlx5_0=ib-a")
        out[adapter] = fabric
    return out


def _shared_pair(ctx, param, values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        directory, sep, identity = v.partition("=")
        if not sep or not directory or not identity:
            raise click.BadParameter(f"{v!r}: expected DIR=IDENTITY, e.g. /mnt/models=srp-image-01")
        out[directory] = identity
    return out


@agent.command("init")
@click.option("--nats", "nats_urls", multiple=True, required=True, help="NATS URL (repeatable)")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_CONFIG_PATH,
    show_default=True,
    help="where to write the config",
)
@click.option("--tls-ca", help="CA file")
@click.option("--tls-cert", help="this node's certificate (CN = node id)")
@click.option("--tls-key", help="this node's key")
@click.option("--bucket", default=None, help="KV bucket, if not llmgw")
@click.option("--node-id", default=None, help="override the node id (default: short hostname)")
@click.option("--address", default=None, help="override the address (default: route to NATS)")
@click.option("--ram-gb", type=float, default=None, help="override RAM total, GiB")
@click.option("--no-gpus", is_flag=True, help="report no GPUs without asking NVML")
@click.option("--llama-server", default=None, help="path to llama-server (default: found)")
@click.option("--vllm", default=None, help="path to the vllm script (default: found)")
@click.option(
    "--fabric", "fabrics", multiple=True, callback=_fabric_pair, help="ADAPTER=FABRIC, repeatable"
)
@click.option(
    "--weights-dir",
    "weights_dirs",
    multiple=True,
    help="directory to look for weights in, repeatable",
)
@click.option(
    "--fetch-dir",
    default=None,
    help="where engines download weights (default /var/lib/llmgw-weights)",
)
@click.option(
    "--shared",
    "shared",
    multiple=True,
    callback=_shared_pair,
    help="DIR=IDENTITY: declare a weights directory shared storage (an exported image)",
)
@click.option(
    "--heartbeat", type=float, default=None, help="heartbeat interval, seconds (default 5)"
)
@click.option(
    "--engine-api-key-file",
    default=None,
    help="file holding the key engines are started with (routers get the same file)",
)
@click.option("--force", is_flag=True, help="overwrite an existing config")
def agent_init(
    nats_urls,
    config_path: Path,
    tls_ca,
    tls_cert,
    tls_key,
    bucket,
    node_id,
    address,
    ram_gb,
    no_gpus,
    llama_server,
    vllm,
    fabrics,
    weights_dirs,
    fetch_dir,
    shared,
    heartbeat,
    engine_api_key_file,
    force,
) -> None:
    """Write the agent config holding only what is given here (onboarding)."""
    if config_path.exists() and not force:
        raise click.ClickException(f"{config_path} exists; pass --force to overwrite it")
    raw: dict[str, Any] = {"nats": {"urls": list(nats_urls)}}
    for k, v in (
        ("tls_ca", tls_ca),
        ("tls_cert", tls_cert),
        ("tls_key", tls_key),
        ("bucket", bucket),
    ):
        if v:
            raw["nats"][k] = v
    node = {
        k: v
        for k, v in (
            ("id", node_id),
            ("address", address),
            ("ram_total_gb", ram_gb),
            ("llama_server", llama_server),
            ("vllm", vllm),
        )
        if v is not None
    }
    if no_gpus:
        node["gpus"] = False
    if node:
        raw["node"] = node
    if fabrics:
        raw["fabrics"] = fabrics
    weights = {
        k: v
        for k, v in (("dirs", list(weights_dirs)), ("fetch_dir", fetch_dir), ("shared", shared))
        if v
    }
    if weights:
        raw["weights"] = weights
    if heartbeat:
        raw["intervals"] = {"heartbeat": heartbeat}
    if engine_api_key_file:
        raw["engines"] = {"api_key_file": engine_api_key_file}
    import tomli_w

    try:  # validated by the same code that reads it, before anything is written
        cfg = parse_config(tomli_w.dumps(raw), config_path)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    try:
        write_config(cfg, config_path)
    except OSError as e:
        raise click.ClickException(
            f"cannot write {config_path}: {e.strerror}; pass --config PATH"
        ) from None
    click.echo(f"wrote {config_path}:\n")
    click.echo(render_config(cfg))


@agent.command("run")
@click.option(
    "--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), default=None
)
@click.option("--nats", "nats_urls", multiple=True, envvar="LLMGW_NATS")
def agent_run(config_path: Path | None, nats_urls: tuple[str, ...]) -> None:
    """Run the agent in the foreground (what the llmgw-agent service runs)."""
    from llmgw.agent.service import main as agent_main

    args = (["--config", str(config_path)] if config_path else []) + [
        a for u in nats_urls for a in ("--nats", u)
    ]
    agent_main.main(args=args, standalone_mode=True)


def _register_pki() -> None:
    from llmgw.pki_cli import pki

    main.add_command(pki)


_register_pki()  # `llmgw pki`: a CA, certificates and the NATS users file (docs/security.md)

if __name__ == "__main__":
    main()
