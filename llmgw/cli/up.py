"""`llmgw up`: one machine, everything: embedded NATS, a controller, a router, an agent (or,
with --sim, a simulated fleet instead: docs/sim.md)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import anyio
import click
import msgspec

from llmgw.agent.config import AgentConfig, Paths, Weights, load_config
from llmgw.bus import keys
from llmgw.bus.client import BucketSettings, Bus, NatsSettings
from llmgw.cli.common import check_ports_free, freeze_startup, listen, run_fast
from llmgw.cli.router import FromSettings, default_listen, router_options, router_settings
from llmgw.cli.sim import sim_options
from llmgw.shutdown import drain_then_cancel_on_signal


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where NATS stores the bucket and the agent its state [default: the user data dir; "
    "with --sim, its sim/ folder, so a simulated fleet never mixes with this machine's]",
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
    callback=listen,
    cls=FromSettings,
    default=lambda: default_listen(),
    show_default=True,
    help="HOST:PORT of the OpenAI API",
)
@click.option("--no-router", is_flag=True, help="do not run a router")
@click.option(
    "--sim",
    "fleet_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="run the simulated fleet this file describes instead of a local agent (docs/sim.md)",
)
@sim_options
@router_options
def up(
    data_dir: Path | None,
    host: str,
    port: int,
    agent_config: Path | None,
    no_agent: bool,
    router_listen: tuple[str, int],
    no_router: bool,
    fleet_file: Path | None,
    connections: int,
    poll: float,
    **router_opts,
) -> None:
    """Run llmgw on this machine: embedded NATS, a controller, a router and a local agent
    (or, with --sim, a simulated fleet)."""
    import platformdirs

    from llmgw.bus.server import EmbeddedNats
    from llmgw.bus.storelock import StoreInUse, holder_of

    logging.getLogger("llmgw").setLevel(logging.INFO)
    sim = None
    if fleet_file is not None:
        from llmgw.sim.fleet import load_fleet

        load_fleet(fleet_file)  # a bad file is refused before NATS starts
        sim = (fleet_file, connections, poll)
    data_dir = data_dir or Path(platformdirs.user_data_dir("llmgw")) / ("sim" if sim else "")
    server = EmbeddedNats(data_dir=data_dir / "nats", host=host, port=port)
    # asked before the ports: a second `llmgw up` on this store is told so, whatever its ports
    holder = holder_of(server.data_dir)
    if holder is not None:
        raise StoreInUse(server.data_dir, holder)
    cfg = _up_agent_config(agent_config, server.url, data_dir)
    check_ports_free(
        _up_ports(
            host,
            port,
            None if no_router else router_listen,
            cfg if sim is None and not no_agent else None,
            agent_config,
        )
    )
    router = None if no_router else router_settings(router_listen, **router_opts)
    server.start()
    url = server.url
    try:
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
        click.echo("Ctrl-C stops everything (the router first lets its requests in flight finish).")
        run_fast(
            functools.partial(_run_up, cfg, no_agent, router, cmd, sim, data_dir, agent_config)
        )
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


def _up_ports(
    host: str,
    port: int,
    router: tuple[str, int] | None,
    agent: AgentConfig | None,
    agent_config: Path | None,
) -> list[tuple[str, tuple[str, int], str]]:
    """Every port `llmgw up` listens on, with the option that moves it (NATS's monitoring
    port is picked free)."""
    from llmgw.metrics_http import parse_listen

    ports = [("NATS", (host, port), "move it with --port PORT")]
    if router is not None:
        ports.append(
            (
                "the router (OpenAI API)",
                router,
                "move it with --router-listen HOST:PORT",
            )
        )
    if agent is not None and agent.metrics.listen:
        where = agent_config or "the agent config"
        ports.append(
            (
                "the agent's /metrics",
                parse_listen(agent.metrics.listen, "metrics.listen"),
                f'set metrics.listen in {where} ("" serves none)',
            )
        )
    return ports


def _up_agent_config(path: Path | None, url: str, data_dir: Path) -> AgentConfig:
    cfg = (
        load_config(path)
        if path
        else AgentConfig(
            weights=Weights(fetch_dir=str(data_dir / "weights")),
            paths=Paths(state_dir=str(data_dir / "agent")),
        )
    )
    return msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, urls=[url]))


async def _run_up(
    cfg: AgentConfig,
    no_agent: bool,
    router,
    cmd: str,
    sim,
    data_dir: Path,
    agent_config: Path | None,
) -> None:
    bus = await Bus.connect(
        NatsSettings(urls=tuple(cfg.nats.urls), name="llmgw controller"),
        BucketSettings(name=cfg.nats.bucket),
        give_up_after=10,
    )
    try:
        await _run_up_parts(cfg, no_agent, router, cmd, bus, sim, data_dir, agent_config)
    finally:
        with anyio.CancelScope(shield=True):
            await bus.close()


async def _run_up_parts(
    cfg: AgentConfig,
    no_agent: bool,
    router,
    cmd: str,
    bus: Bus,
    sim,
    data_dir: Path,
    agent_config: Path | None,
) -> None:
    from llmgw.controller.loop import Controller

    routers = []

    async def drain() -> None:
        # Ctrl-C lets the router's streams finish first, while the engines still serve
        for r in routers:
            await r.shutdown()

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain_then_cancel_on_signal, tg.cancel_scope, drain)
        await _make_streams(bus)
        await tg.start(Controller(bus).run)
        click.echo("controller running")
        agent = None
        if sim is not None:
            from llmgw.sim.simulator import Simulator

            fleet_file, connections, poll = sim
            simulator = Simulator(
                fleet_file,
                NatsSettings(urls=tuple(cfg.nats.urls), name="llmgw sim"),
                BucketSettings(name=cfg.nats.bucket),
                data_dir / "fleet",
                connections=connections,
                poll=poll,
            )
            await tg.start(simulator.run)
            click.echo(
                f"simulated fleet {fleet_file}: {len(simulator.nodes)} nodes (edit the file to "
                "change it live)"
            )
        elif not no_agent:
            from llmgw.agent.service import Agent

            where = str(agent_config) if agent_config else "the agent config"
            agent = await tg.start(Agent(cfg, config_path=where).run)
            click.echo("agent running")
            if agent.inventory is not None and not agent.inventory.engines:
                for line in _no_engine(cmd):
                    click.echo(line)
        if router is not None:
            from llmgw.router.service import Router

            r = Router(router)
            routers.append(r)
            settings = NatsSettings(urls=tuple(cfg.nats.urls), name="llmgw router")
            bucket = BucketSettings(name=cfg.nats.bucket)
            await tg.start(
                r.serve_bucket, lambda: Bus.connect(settings, bucket, give_up_after=None)
            )
            click.echo(f"router listening on {r.url}/v1 (OpenAI base URL; `model` = a served name)")
            if router.proxy.page:
                click.echo(f"fleet page: {r.url}/ (nodes, models, why replicas wait)")
        for line in await _earlier_run(bus, agent, cmd):
            click.echo(line)
        freeze_startup()
        await anyio.sleep_forever()


async def _make_streams(bus: Bus) -> None:
    """The gateway's streams (limits, usage, audit), made here as the operator does with
    `llmgw key|team|audit`: a key written by hand (`nats kv put apikeys.x ...`) then finds
    them. `llmgw up` is the operator of its own NATS; a router never makes them."""
    from llmgw.bus.counters import ensure_streams
    from llmgw.bus.errors import BusError

    try:
        made = await ensure_streams(bus)
    except BusError as e:  # an old nats-server, a stream made otherwise: keys work, limits wait
        click.echo(f"streams for API keys' limits, usage and audit not made: {e}", err=True)
        return
    if made:
        click.echo(f"made streams {', '.join(made)} (API keys' limits, usage and audit)")


def _no_engine(cmd: str) -> list[str]:
    """What a first run on a machine with no engine does next, rather than placing models
    that can never start."""
    return [
        "this machine has no engine (no llama-server or vllm on PATH or in the agent config), "
        "so no model can run here. Next:",
        f"  try the simulated fleet: {cmd} up --sim examples/fleet.toml (copy the file to edit "
        "it; docs/sim.md)",
        "  or get llama-server: put a llama.cpp release's llama-server on PATH, or build one "
        "with tools/build-llama-server.sh (it prints the binary's path: give it as "
        "node.llama_server in an --agent-config file; docs/llama-server-build.md), then start "
        f"{cmd} up again",
    ]


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
