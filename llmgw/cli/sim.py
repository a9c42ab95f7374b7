"""`llmgw sim FLEET.toml`: a simulated fleet (docs/sim.md) on an existing NATS."""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
from pathlib import Path

import click

from llmgw.bus.client import BucketSettings, NatsSettings
from llmgw.cli.common import nats_options, option_group, run_fast, until_signalled

# what `llmgw sim` and `llmgw up --sim` share
sim_options = option_group(
    click.option(
        "--connections",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="NATS connections the simulated nodes share, round robin (0: one per node, as a "
        "real fleet has)",
    ),
    click.option(
        "--poll",
        type=click.FloatRange(min=0.05),
        default=1.0,
        show_default=True,
        help="seconds between looks at the fleet file for changes",
    ),
)


def _part(ctx, param, value: str | None):
    if value is None:
        return None
    from llmgw.sim.simulator import Part

    index, sep, count = value.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or not 0 <= int(index) < int(count):
        raise click.BadParameter(f"{value!r}: expected K/N with 0 <= K < N, e.g. 0/4")
    return Part(int(index), int(count))


@click.command()
@click.argument("fleet_file", type=click.Path(dir_okay=False, path_type=Path))
@nats_options
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where the simulated nodes' disks go, cleared at start [default: the user data dir]",
)
@sim_options
@click.option(
    "--processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="spread the nodes over this many processes (each with its own connections)",
)
@click.option("--part", callback=_part, default=None, hidden=True, help="K/N: one of --processes")
def sim(
    fleet_file: Path,
    nats: NatsSettings,
    bucket: BucketSettings,
    data_dir: Path | None,
    connections: int,
    poll: float,
    processes: int,
    part,
) -> None:
    """Run the simulated nodes FLEET_FILE describes against a running NATS: real agents
    on simulated hardware, serving simulated engines; edits to the file apply live."""
    import platformdirs

    from llmgw.sim.fleet import load_fleet
    from llmgw.sim.simulator import Part

    logging.getLogger("llmgw").setLevel(logging.INFO)
    load_fleet(fleet_file)  # a bad file is refused here, before anything starts
    data_dir = data_dir or Path(platformdirs.user_data_dir("llmgw")) / "sim-fleet"
    if processes > 1 and part is None:
        _run_processes(processes, data_dir)
        return
    part = part or Part()
    root = data_dir / f"part-{part.index}" if part.count > 1 else data_dir
    simulate = functools.partial(_simulate, fleet_file, nats, bucket, root, connections, part, poll)
    run_fast(functools.partial(until_signalled, simulate))


async def _simulate(fleet_file, nats, bucket, root, connections, part, poll) -> None:
    import anyio

    from llmgw.sim.simulator import Simulator

    simulator = Simulator(
        fleet_file, nats, bucket, root, connections=connections, part=part, poll=poll
    )
    async with anyio.create_task_group() as tg:
        await tg.start(simulator.run)
        click.echo(
            f"simulated fleet {fleet_file}: {len(simulator.nodes)} nodes; edit the file to "
            "change it live"
        )


def _run_processes(processes: int, data_dir: Path) -> None:
    """The same command once per part, until Ctrl-C or one of them ends."""
    argv = [sys.executable, "-m", "llmgw.cli", *sys.argv[1:]]
    i = argv.index("--processes") if "--processes" in argv else None
    if i is not None:
        del argv[i : i + 2]
    else:
        argv = [a for a in argv if not a.startswith("--processes=")]
    children = [
        subprocess.Popen([*argv, "--part", f"{k}/{processes}", "--data-dir", str(data_dir)])
        for k in range(processes)
    ]
    try:
        children[0].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for child in children:
            child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
