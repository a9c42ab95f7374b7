"""`llmgw adapter add / ls / rm`: LoRA adapters served as models of their own, one per
`adapters.<id>` key (the operator their one writer). The files are observed on the nodes,
never fetched: `add` names where they are, and the controller loads each adapter on as
many of its base's replicas as its demand needs (docs/placement.md, "LoRA adapters")."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import click
import msgspec

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import BucketSettings, Bus, NatsSettings, decoder
from llmgw.cli.common import did_you_mean, json_option, nats_options, open_bus
from llmgw.cli.served import UnknownModel, catalog_models, unknown_model_id
from llmgw.errors import LlmgwError


class AdapterCommandError(LlmgwError):
    """`llmgw adapter` cannot do this: a name taken or unknown, a base that cannot take it."""

    exit_code = 2


@click.group()
def adapter() -> None:
    """LoRA adapters served as models (adapters.<id>)."""


async def catalog_adapters(bus: Bus) -> list[catalog.Adapter]:
    """The adapters that read, by id."""
    listed = await bus.list(keys.pattern(keys.ADAPTERS), lambda b: catalog.decode_adapter(b))
    return sorted((e.value for e in listed.values()), key=lambda a: a.id)


MAX_ADDED = 10_000  # names one `add` takes: a thousand fine-tunes of a base, and room


@adapter.command("add")
@click.argument("names", metavar="NAME...", nargs=-1, required=True)
@click.option("--base", required=True, help="the base model's id (as `llmgw catalog ls` lists)")
@click.option(
    "--path",
    "path",
    default=None,
    help="where its files are on the nodes: a PEFT directory (vLLM) or a .gguf LoRA file "
    "(llama-server); `{name}` stands for each NAME [default: the files a node reports by "
    "that name]",
)
@click.option(
    "--rank",
    type=click.IntRange(1, catalog.MAX_ADAPTER_RANK),
    default=None,
    help="its LoRA rank [default: as a node holding it, or the files here, say]",
)
@click.option(
    "--served-name",
    default=None,
    help="what clients send as `model`; `{name}` stands for each NAME [NAME]",
)
@nats_options
def add(
    names: tuple[str, ...],
    base: str,
    path: str | None,
    rank: int | None,
    served_name: str | None,
    nats: NatsSettings,
    bucket: BucketSettings,
) -> None:
    """Serve the LoRA adapter NAME (its files at PATH) on BASE, as model NAME; several
    at once: `llmgw adapter add ft-{0001..1000} --base qwen3-8b`."""
    names = tuple(dict.fromkeys(names))
    if len(names) > MAX_ADDED:
        raise AdapterCommandError(f"{len(names)} names; at most {MAX_ADDED} in one `add`")
    for option, value in (("--path", path), ("--served-name", served_name)):
        if len(names) > 1 and value is not None and "{name}" not in value:
            raise AdapterCommandError(
                f"{len(names)} names share one {option} {value!r}; put {{name}} in it where "
                "each name goes"
            )

    async def run() -> list[tuple[catalog.Adapter, list[str]]]:
        async with open_bus(nats, bucket) as bus:
            models = await catalog_models(bus)
            adapters = await catalog_adapters(bus)
            holdings = await _holdings(bus)
            wanted = [
                _adapter_record(name, base, path, rank, served_name, holdings) for name in names
            ]
            for record in wanted:
                _check_fits(record, models, adapters)
                adapters.append(record)  # a served name twice among the new ones is refused
            added = []
            for record in wanted:
                if await bus.create(keys.adapter(record.id), record) is None:
                    raise AdapterCommandError(
                        f"adapter {record.id!r} exists: `llmgw adapter rm {record.id}` first to "
                        "change it" + (f" ({len(added)} added before it)" if added else "")
                    )
                added.append((record, holdings.nodes_at(record.path)))
            return added

    for record, nodes in anyio.run(run):
        where = (
            f"held on {len(nodes)} node(s): {', '.join(nodes[:5])}"
            if nodes
            else f"no node reports adapter files at {record.path} yet: it serves once one does "
            "(`llmgw status` shows what each node holds)"
        )
        click.echo(
            f"adapter {record.id} added: {record.served_name!r} on {record.base}, rank "
            f"{record.rank}; {where}"
        )


def _adapter_record(
    name: str,
    base: str,
    path: str | None,
    rank: int | None,
    served_name: str | None,
    holdings: Holdings,
) -> catalog.Adapter:
    """NAME's catalog value: its path as given, else the one the nodes report by that name;
    its rank as given, else as a node holding it or the files here say."""
    if path is not None:
        where = path.replace("{name}", name)
    else:
        paths = sorted(holdings.named.get(name, ()))
        if len(paths) != 1:
            said = (
                f"nodes report adapter files named {name!r} at {', '.join(paths[:3])}"
                if paths
                else f"no node reports adapter files named {name!r}"
            )
            raise AdapterCommandError(f"{said}; say which with --path")
        where = paths[0]
    found = rank or holdings.rank_at(where) or _local_rank(where)
    if not found:
        raise AdapterCommandError(
            f"the rank of {where} is not known: no node reports adapter files there "
            "and they are not readable here; give it with --rank R"
        )
    shown = served_name.replace("{name}", name) if served_name is not None else name
    fields = {"id": name, "served_name": shown, "base": base}
    return catalog.check_adapter(fields | {"path": where, "rank": found})


def _check_fits(
    adapter: catalog.Adapter, models: list[catalog.Model], adapters: list[catalog.Adapter]
) -> None:
    """Refuse what could never serve: an unknown base, files its base's engines do not take,
    a rank over the room its vLLM profiles give, a served name that is already a model's."""
    base = next((m for m in models if m.id == adapter.base), None)
    if base is None:
        raise unknown_model_id(adapter.base, models)
    problem = catalog.adapter_problem(adapter, base)
    if problem is not None:
        raise AdapterCommandError(f"adapter {adapter.id}: {problem}")
    rooms = [p for p in base.profiles if p.engine == "vllm" and p.adapter_rank]
    if rooms and all(adapter.rank > (p.adapter_rank or 0) for p in rooms):
        most = max(p.adapter_rank or 0 for p in rooms)
        raise AdapterCommandError(
            f"adapter {adapter.id}: rank {adapter.rank} is over the adapter_rank {most} of "
            f"{base.id}'s vLLM profiles, which vLLM refuses to load; raise adapter_rank in "
            "the catalog (the replicas are replaced with the new room) or use a lower rank"
        )
    for m in models:
        if m.served_name == adapter.served_name:
            raise AdapterCommandError(
                f"{adapter.served_name!r} is the served name of model {m.id}: give the "
                "adapter another name (or --served-name)"
            )
    for other in adapters:
        if other.served_name == adapter.served_name and other.id != adapter.id:
            raise AdapterCommandError(
                f"{adapter.served_name!r} is the served name of adapter {other.id}"
            )


class Holdings:
    """The adapter files the nodes report holding complete, by path and by name (key)."""

    def __init__(self, inventories: list[records.NodeInventory]) -> None:
        self.at: dict[str, list[tuple[str, records.HeldAdapter]]] = {}
        self.named: dict[str, set[str]] = {}
        for inv in sorted(inventories, key=lambda i: i.node):
            for held in inv.weights.adapters:
                path = held.path.rstrip("/")
                self.at.setdefault(path, []).append((inv.node, held))
                # by its key (its folder's path under a weights directory: `loras/ft-01`)
                # and by its last part, which is the name an operator knows it by
                for name in {held.key, held.key.rsplit("/", 1)[-1]}:
                    self.named.setdefault(name, set()).add(path)

    def nodes_at(self, path: str) -> list[str]:
        return [node for node, _ in self.at.get(path.rstrip("/"), [])]

    def rank_at(self, path: str) -> int:
        return next((h.rank for _, h in self.at.get(path.rstrip("/"), []) if h.rank), 0)


async def _holdings(bus: Bus) -> Holdings:
    listed = await bus.list(keys.pattern(keys.NODES), decoder(records.NodeInventory))
    return Holdings([e.value for e in listed.values()])


def _local_rank(path: str) -> int:
    """A PEFT directory's rank as its adapter_config.json here says (0: not readable here)."""
    from llmgw.agent.discovery.weights.adapters import peft_config

    config = peft_config(Path(path))
    return config.rank if config is not None else 0


@adapter.command("ls")
@json_option
@nats_options
def ls(as_json: bool, nats: NatsSettings, bucket: BucketSettings) -> None:
    """List the adapters, their base and where each is loaded now."""

    async def run():
        async with open_bus(nats, bucket) as bus:
            adapters = await catalog_adapters(bus)
            shards = await bus.list(keys.pattern(keys.SHARDS), decoder(records.Shard))
            return adapters, [e.value for e in shards.values()]

    adapters, shards = anyio.run(run)
    loaded: dict[str, list[str]] = {}
    failed: dict[str, list[str]] = {}
    for s in sorted(shards, key=lambda s: s.rid):
        for aid in s.adapters:
            loaded.setdefault(aid, []).append(s.rid)
        for f in s.adapter_failures:
            failed.setdefault(f.adapter, []).append(f"{s.node}: {f.reason}")
    if as_json:
        out = [
            msgspec.to_builtins(a)
            | {"loaded": loaded.get(a.id, []), "failed": failed.get(a.id, [])}
            for a in adapters
        ]
        click.echo(json.dumps(out, indent=2))
        return
    if not adapters:
        click.echo("no adapters (`llmgw adapter add NAME --base MODEL --path DIR`)")
        return
    click.echo(f"{'ADAPTER':24} {'SERVED AS':28} {'BASE':16} {'RANK':>4}  {'LOADED':7} PATH")
    for a in adapters:
        on = loaded.get(a.id, [])
        click.echo(f"{a.id:24} {a.served_name:28} {a.base:16} {a.rank:>4}  {len(on):<7} {a.path}")
        for line in failed.get(a.id, [])[:3]:
            click.echo(f"  failed on {line}")


@adapter.command("rm")
@click.argument("name")
@nats_options
def rm(name: str, nats: NatsSettings, bucket: BucketSettings) -> None:
    """Stop serving adapter NAME (its id, or its served name): unloaded where it is, once
    the requests it has in flight are done."""

    async def run() -> str:
        async with open_bus(nats, bucket) as bus:
            adapters = await catalog_adapters(bus)
            found = next((a for a in adapters if a.id == name), None) or next(
                (a for a in adapters if a.served_name == name), None
            )
            if found is not None:
                aid = found.id
            elif keys.is_token(name) and await bus.get_raw(keys.adapter(name)) is not None:
                aid = name  # a value that does not read: removed all the same
            else:
                known = [a.id for a in adapters]
                raise UnknownModel(f"no adapter {name!r}; {did_you_mean(name, known, 'adapters')}")
            await bus.delete(keys.adapter(aid))
            return aid

    removed = anyio.run(run)
    click.echo(f"adapter {removed} removed: unloaded wherever it is loaded")
