"""`llmgw agent init` (onboarding: a config holding only what is given) and `llmgw agent run`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from llmgw.agent.config import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_FETCH_DIR,
    parse_config,
    render_config,
    write_config,
)  # the config alone: plain msgspec
from llmgw.bus.records import HEARTBEAT_S
from llmgw.metrics_http import AGENT_PORT


@click.group()
def agent() -> None:
    """Onboard and run the node agent."""


def _pairs(shape: str, example: str):
    """A callback reading repeated KEY=VALUE options into a dict; `shape` names the two
    ("ADAPTER=FABRIC") in the error, with `example`."""

    def read(ctx, param, values: tuple[str, ...]) -> dict[str, str]:
        out = {}
        for v in values:
            key, sep, value = v.partition("=")
            if not sep or not key or not value:
                raise click.BadParameter(f"{v!r}: expected {shape}, e.g. {example}")
            out[key] = value
        return out

    return read


_fabric_pair = _pairs("ADAPTER=FABRIC", "mlx5_0=ib-a")
_shared_pair = _pairs("DIR=IDENTITY", "/mnt/models=srp-image-01")


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
    help=f"where engines download weights (default {DEFAULT_FETCH_DIR})",
)
@click.option(
    "--shared",
    "shared",
    multiple=True,
    callback=_shared_pair,
    help="DIR=IDENTITY: declare a weights directory shared storage (an exported image)",
)
@click.option(
    "--heartbeat",
    type=float,
    default=None,
    help=f"heartbeat interval, seconds (default {HEARTBEAT_S:g})",
)
@click.option(
    "--engine-api-key-file",
    default=None,
    help="file holding the key engines are started with (routers get the same file)",
)
@click.option(
    "--metrics-listen",
    default=f"0.0.0.0:{AGENT_PORT}",
    show_default=True,
    help='HOST:PORT of the agent\'s GET /metrics, for Prometheus ("": none)',
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
    metrics_listen,
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
    if metrics_listen:
        raw["metrics"] = {"listen": metrics_listen}
    import tomli_w

    # validated by the same code that reads it, before anything is written
    cfg = parse_config(tomli_w.dumps(raw), config_path)
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
