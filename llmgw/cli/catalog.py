"""`llmgw catalog apply` and `llmgw catalog ls`: the catalog.<model> keys."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import click
import msgspec

from llmgw.bus import keys
from llmgw.bus.client import BucketSettings, NatsSettings
from llmgw.cli.common import json_option, nats_options, open_bus


@click.group()
def catalog() -> None:
    """The model catalog (catalog.<model> keys)."""


@catalog.command("apply")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@nats_options
def catalog_apply(path: Path, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Validate a TOML catalog and write it; an invalid catalog is refused whole."""
    from llmgw.catalog import decode_model, encode_model, load_catalog_toml

    models = load_catalog_toml(path)  # a CatalogError says it all: nothing is written

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
