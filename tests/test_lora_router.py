"""LoRA adapters at the router, through a real router fed by a real nats-server and fake
engines (the records written as the controller and agents write them): an adapter is a
model by its own name, in /v1/models with its parent, sent only where it is loaded; on
llama-server the router applies it per request and the client sees its name in the answer;
a key may be given an adapter and not its base, and usage counts the adapter by its name."""

from __future__ import annotations

import json
import time

import aiohttp
import pytest
from router_helpers import SERVED, TINY_CPU_MODEL, chat_body, router_settings, running_router
from test_gateway_audit import _trail
from test_router_gateway import _key, _usage
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import ensure_streams
from llmgw.router.adapters import NameSwap, with_lora
from llmgw.sim.tiny_lora import write_gguf_lora

pytestmark = pytest.mark.anyio


def _adapter(aid: str, path: str) -> catalog.Adapter:
    return catalog.Adapter(id=aid, served_name=f"acme/{aid}", base="tiny", path=path, rank=4)


async def _place(bus: Bus, engine, adapters: list[str], failures=()) -> None:
    """tiny (llama-server) on one replica whose engine serves `adapters`, in that order."""
    await bus.put(keys.catalog("tiny"), catalog.encode_model(TINY_CPU_MODEL))
    replica = records.Replica(
        model="tiny",
        rid="r1",
        profile="cpu",
        members=[records.ReplicaMember(node="n1", rank=0, port=engine.port)],
        phase="ready",
        endpoint=engine.endpoint,
    )
    await bus.put(keys.replica("tiny", "r1"), replica)
    shard = records.Shard(
        node="n1",
        rid="r1",
        model="tiny",
        generation=1,
        phase="ready",
        since=time.time(),
        endpoint=engine.endpoint,
        served_name=SERVED,
        adapters=adapters,
        adapter_failures=list(failures),
    )
    await bus.put(keys.shard("n1", "r1"), shard)


def _connect(nats_settings: NatsSettings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


async def _post(url: str, body: dict, secret: str | None = None) -> tuple[int, bytes]:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            return r.status, await r.read()


@pytest.fixture
def lora_files(tmp_path):
    return [str(write_gguf_lora(tmp_path / f"{n}.gguf", arch="fake")) for n in ("a", "b")]


@pytest.fixture
def llama(engines, lora_files):
    """A fake llama-server started with two adapters, none applied."""
    args = [arg for f in lora_files for arg in ("--lora", f)]
    return engines.start(None, *args, "--lora-init-without-apply")


async def test_an_adapter_is_served_by_name_on_llama_server_with_its_name_in_the_answer(
    bus, nats_settings, llama, lora_files
):
    await _place(bus, llama, ["a", "b"])
    for aid, path in zip("ab", lora_files, strict=True):
        await bus.put(keys.adapter(aid), catalog.encode_model(_adapter(aid, path)))
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(lambda: _served(r, "acme/b"), timeout=10)
        status, body = await _post(r.url, chat_body(model="acme/b"))
        answer = json.loads(body)
        assert status == 200, body
        assert answer["model"] == "acme/b"  # llama-server answers with its base's alias
        assert answer["choices"][0]["message"]["content"].startswith("lora1-tok0")
        status, body = await _post(r.url, chat_body(model="acme/a", stream=True))
        events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e[6:7] == "{"]
        assert status == 200 and {e["model"] for e in events} == {"acme/a"}
        assert "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
        ).startswith("lora0-tok0")
        # the base serves as it did: no adapter applied
        status, body = await _post(r.url, chat_body())
        assert json.loads(body)["choices"][0]["message"]["content"].startswith("tok0")
        async with aiohttp.ClientSession() as http, http.get(f"{r.url}/v1/models") as resp:
            listed = {m["id"]: m.get("parent") for m in (await resp.json())["data"]}
        assert listed == {SERVED: None, "acme/a": SERVED, "acme/b": SERVED}


async def test_a_body_naming_lora_itself_is_refused_for_a_model_with_adapters(
    bus, nats_settings, llama, lora_files
):
    """A key given the base alone must not reach its adapters by number."""
    await _place(bus, llama, ["a", "b"])
    await bus.put(keys.adapter("a"), catalog.encode_model(_adapter("a", lora_files[0])))
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(lambda: _async(r.table.route("acme/a") is not None), timeout=10)
        for model in (SERVED, "acme/a"):
            status, body = await _post(r.url, chat_body(model=model, lora=[{"id": 1, "scale": 1}]))
            error = json.loads(body)["error"]
            assert (status, error["code"], error["param"]) == (400, "lora_not_allowed", "lora")


@pytest.mark.parametrize("given_to", ["key", "team"])
async def test_a_key_given_an_adapter_alone_is_refused_its_base_and_usage_and_audit_name_it(
    bus, nats_settings, llama, lora_files, given_to
):
    await ensure_streams(bus)
    await _place(bus, llama, ["a", "b"])
    await bus.put(keys.adapter("a"), catalog.encode_model(_adapter("a", lora_files[0])))
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        if given_to == "team":
            await bus.put(keys.team("ml"), records.Team(team="ml", models=["acme/a"]))
            secret = await _key(bus, "team-a", team="ml")
        else:
            secret = await _key(bus, "team-a", models=["acme/a"])

        async def adapter_served():
            return (await _post(r.url, chat_body(model="acme/a"), secret))[0] == 200

        await until(adapter_served, timeout=10)
        status, body = await _post(r.url, chat_body(), secret)
        assert status == 403, body
        assert json.loads(body)["error"]["allowed_models"] == ["acme/a"]
        async with aiohttp.ClientSession() as http:
            headers = {"authorization": f"Bearer {secret}"}
            async with http.get(f"{r.url}/v1/models", headers=headers) as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["acme/a"]

        async def counted():
            usage = await _usage(bus)
            return usage.get(("team-a", "acme/a", "requests"), 0) >= 1 and usage

        usage = await until(counted, timeout=10)
        assert not any(model == SERVED for (_, model, _) in usage)

        async def audited():
            trail = await _trail(bus)
            return trail if any(t.status == 403 for t in trail) else None

        trail = await until(audited, timeout=10)
        served = [t for t in trail if t.status == 200]
        assert served and {(t.key, t.model, t.replica) for t in served} == {
            ("team-a", "acme/a", "r1")
        }
        assert [(t.model, t.refused) for t in trail if t.status == 403] == [
            (SERVED, "model_not_allowed")
        ]


async def test_an_adapter_every_engine_refused_is_answered_at_once_with_the_engine_s_words(
    bus, nats_settings, llama, lora_files
):
    refused = records.AdapterFailure(adapter="c", reason="LoRA rank 64 is greater than 16.")
    await _place(bus, llama, ["a", "b"], failures=[refused])
    await bus.put(keys.adapter("c"), catalog.encode_model(_adapter("c", "/w/c.gguf")))
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(lambda: _async(r.table.route("acme/c") is not None), timeout=10)
        status, body = await _post(r.url, chat_body(model="acme/c"))
        assert status == 503
        assert (
            "the engine on n1 would not load it: LoRA rank 64 is greater than 16."
            in json.loads(body)["error"]["message"]
        )
        assert (await _post(r.url, chat_body()))[0] == 200  # its base serves on


def test_a_lora_field_goes_first_in_the_body_and_the_rest_is_kept():
    assert with_lora(b' {"model":"x"}', 3, 1.0) == b' {"lora":[{"id":3,"scale":1.0}],"model":"x"}'
    assert json.loads(with_lora(b'{ "a": 1 ,"b":[2]}', 0, 1.0)) == {
        "lora": [{"id": 0, "scale": 1.0}],
        "a": 1,
        "b": [2],
    }


def test_the_base_s_name_is_swapped_even_when_cut_between_two_pieces():
    swap = NameSwap("tiny-chat", "acme/a")
    answer = b'data: {"id":"x","model":"tiny-chat","choices":[]}\n\n' * 2
    for cut in range(1, len(answer)):
        swap = NameSwap("tiny-chat", "acme/a")
        out = swap(answer[:cut], False) + swap(answer[cut:], True)
        assert out == answer.replace(b'"tiny-chat"', b'"acme/a"'), cut
    # an event that ends a piece is never held back for the next one
    swap = NameSwap("tiny-chat", "acme/a")
    assert swap(b'data: {"model": "tiny-chat"}\n\n', False) == b'data: {"model": "acme/a"}\n\n'


async def _async(value):
    return value


async def _served(router, name: str) -> bool:
    route = router.table.route(name)
    return route is not None and bool(route.backends)
