"""llmgw-agent on simulated hardware, for tests and demos on machines without it.

The same agent as `llmgw-agent` (same config, options and exit codes), given a `Hardware`
and a weights scanner that answer for hardware this machine does not have:

    python -m llmgw.sim.agent --recorded-nvml count=2,node=gpu-a --config agent.toml
    python -m llmgw.sim.agent --hung-weights-dir /mnt/filer --config agent.toml

--recorded-nvml: GPU discovery asks a recorded 8x H100 node (llmgw.sim.nvml) through
the real discover_gpus code. --hung-weights-dir: a scan that reaches that directory blocks
forever, as one does on a hard-mounted NFS share whose server went away. Never run this on
a real node.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import click

from llmgw.agent.discovery.gpus import ProcessLookup, discover_gpus
from llmgw.agent.discovery.weights.scan import scan_weights
from llmgw.agent.discovery.xid import XidLog, watch_xids
from llmgw.agent.inventory import Hardware
from llmgw.agent.service import serve
from llmgw.agent.weights import WeightsScanner
from llmgw.bus import records
from llmgw.sim.nvml import from_spec


def recorded_gpus(spec: str) -> Callable[[ProcessLookup], records.Gpus]:
    from_spec(spec)  # refused at start when it does not parse

    def gpus(lookup: ProcessLookup) -> records.Gpus:
        return discover_gpus(from_spec(spec), lookup)

    return gpus


def recorded_xids(spec: str) -> Callable[[XidLog, threading.Event, Callable[[], None]], str]:
    """The Xid watch, told the recording's events (xid=GPU:XID) by the same code as NVML's."""

    def watch(log: XidLog, stop: threading.Event, on_unfit: Callable[[], None]) -> str:
        return watch_xids(from_spec(spec), log, stop, on_unfit)

    return watch


def hanging_scan(hung: set[str]) -> Callable[..., records.Weights]:
    """scan_weights, except that reaching a directory in `hung` never returns."""

    def scan(*args: object, on_dir: Callable[[Path], None] | None = None, **kw: object):
        def turn(directory: Path) -> None:
            if on_dir is not None:
                on_dir(directory)
            if str(directory) in hung:
                threading.Event().wait()

        return scan_weights(*args, on_dir=turn, **kw)  # type: ignore[arg-type]

    return scan


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None)
@click.option("--nats", "nats_urls", multiple=True, envvar="LLMGW_NATS")
@click.option("--log-level", default=os.environ.get("LLMGW_LOG_LEVEL", "INFO"))
@click.option(
    "--recorded-nvml",
    default=None,
    help="count=N,node=NAME,held=GPU:GB,ecc=GPU:N: GPUs from a recording",
)
@click.option(
    "--hung-weights-dir", multiple=True, help="a weights directory whose scan never returns"
)
def main(
    config_path: Path | None,
    nats_urls: tuple[str, ...],
    log_level: str,
    recorded_nvml: str | None,
    hung_weights_dir: tuple[str, ...],
) -> None:
    """Run the llmgw agent on simulated hardware."""
    hardware = (
        Hardware(gpus=recorded_gpus(recorded_nvml), xids=recorded_xids(recorded_nvml))
        if recorded_nvml
        else None
    )
    scanner = WeightsScanner(scan=hanging_scan(set(hung_weights_dir))) if hung_weights_dir else None
    serve(config_path, nats_urls, log_level, hardware=hardware, weights_scanner=scanner)


if __name__ == "__main__":
    main()
