"""Which model a name on the command line means. Commands that place take a model's id
(`llmgw place qwen3-8b`); keys and teams name what clients ask for, its served name
(`--models Qwen/Qwen3-8B`). Each mistaken for the other is answered with the one meant."""

from __future__ import annotations

import click

from llmgw.bus import keys
from llmgw.bus.client import Bus
from llmgw.catalog import Adapter, Model, decode_adapter, decode_model
from llmgw.cli.common import did_you_mean
from llmgw.errors import LlmgwError

ALLOW_UNKNOWN = "--allow-unknown-models"


class UnknownModel(LlmgwError):
    """A name the catalog does not have in the role it was given in: a served name given for
    an id, an id for a served name, or a typo."""

    exit_code = 2


async def catalog_models(bus: Bus) -> list[Model]:
    """The catalog's models that read, by id."""
    listed = await bus.list(keys.pattern(keys.CATALOG), lambda b: decode_model(b))
    return sorted((e.value for e in listed.values()), key=lambda m: m.id)


def allow_unknown_option(fn):
    return click.option(
        "--allow-unknown-models",
        "allow_unknown",
        is_flag=True,
        help="take --models names no catalog entry serves yet: a model you are about to add "
        "(until one serves it, the name lets the key use nothing)",
    )(fn)


async def check_models(bus: Bus, names: list[str] | None, *, allow_unknown: bool) -> None:
    """`--models` of `llmgw key|team create|set`, checked against the catalog (its models
    and its LoRA adapters, each a model to clients)."""
    if names and not allow_unknown:
        adapters = await bus.list(keys.pattern(keys.ADAPTERS), lambda b: decode_adapter(b))
        check_served_names(
            names, await catalog_models(bus), "--models", [e.value for e in adapters.values()]
        )


def check_served_names(
    names: list[str], models: list[Model], option: str, adapters: list[Adapter] | None = None
) -> None:
    """Refuse the names in `names` no model of `models` (nor adapter) serves: a key given a
    model id, or a name with a typo, can use nothing (403 on the served name, 404 on the id)."""
    served = [m.served_name for m in models] + [a.served_name for a in adapters or []]
    for name in names:
        if name in served:
            continue
        by_id = next((m for m in models if m.id == name), None)
        if by_id is not None:
            raise UnknownModel(
                f"{option}: {name!r} is the id of a model; keys and teams name what clients "
                f"ask for, its served name: {by_id.served_name}"
            )
        raise UnknownModel(
            f"{option}: no model in the catalog serves {name!r}; "
            f"{did_you_mean(name, sorted(served), 'served names')}. A model not in the "
            f"catalog yet: add it (`llmgw catalog apply FILE.toml`) or give {ALLOW_UNKNOWN}"
        )


def unknown_model_id(given: str, models: list[Model]) -> UnknownModel:
    """What `llmgw place Qwen/Qwen3-8B` (a served name) or a typo of an id is told."""
    serving = [m.id for m in models if m.served_name == given]
    if serving:
        return UnknownModel(
            f"{given!r} is the served name of model {serving[0]!r} (what clients ask for); "
            f"commands take the model id: {serving[0]}"
        )
    return UnknownModel(
        f"model {given!r} is not in the catalog (or its entry is invalid); "
        f"{did_you_mean(given, [m.id for m in models], 'model ids')}. Add one with `llmgw "
        "catalog apply FILE.toml`; `llmgw catalog ls` lists what is there"
    )
