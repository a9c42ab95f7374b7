"""Every route that generates or embeds tokens, metered through real routers (fed by a real
nats-server) exactly as the engines count themselves (their own /metrics: what they read
and generated), for every framing of `stream` and answers over 1 MiB; and bodies that make
an engine generate more than the router reads from them held to a key's limit.

The engines are the fake llama-server and vLLM (llmgw/sim/fake_engine.py), which read a
body's caps, counts and `stream` as the real ones do (llmgw/sim/engine_params.py) and
answer each route with its usage in the real engine's names."""

from __future__ import annotations

import json

import aiohttp
import pytest
from router_helpers import router_settings, running_router
from test_router_gateway import _auth, _clear_of_a_minute_s_end, _connect, _key, _usage
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import ensure_streams

pytestmark = pytest.mark.anyio

BIG = 200_000  # tokens of an answer no request caps: over 1 MiB of JSON
MESSAGES = [{"role": "user", "content": "count the apples in the basket"}]


def _engine_count(engine, kind: str) -> dict[str, int]:
    """The engine's own count of prompt tokens read and tokens generated."""
    names = {
        "llama-server": ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
        "vllm": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    }[kind]
    status, body = engine.get("/metrics")
    assert status == 200, body
    values = {}
    for line in body.decode().splitlines():
        for kind_, name in zip(("prompt", "completion"), names, strict=True):
            if line.startswith(name):
                values[kind_] = int(float(line.split()[-1]))
    return values


async def _model(bus: Bus, model_id: str, engine) -> None:
    model = catalog.Model(id=model_id, served_name=model_id, endpoints=[engine.url])
    await bus.put(keys.catalog(model_id), catalog.encode_model(model))


async def _send(http, r, path: str, body: dict, secret: str) -> tuple[int, bytes]:
    async with http.post(f"{r.url}{path}", json=body, headers=_auth(secret)) as resp:
        return resp.status, await resp.read()


# (model, route, body): every route that generates or embeds, each framing of `stream`
LLAMA = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "stream": False}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "stream": None}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n_predict": 30, "max_tokens": 5}),
    ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 20, "stream": True}),
    ("/v1/completions", {"prompt": ["once", "upon a time"], "max_tokens": 20}),
    ("/v1/embeddings", {"input": ["one two three", "four"]}),
    ("/v1/rerank", {"query": "red apple", "documents": ["a red apple", "a blue sky"]}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 20}),
    ("/infill", {"input_prefix": "def g(", "input_suffix": "):", "n_predict": 20, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES}),  # BIG tokens: over 1 MiB
]
VLLM = [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 20}),
    ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 20}),
    ("/v1/responses", {"input": "say hi", "max_output_tokens": 20, "stream": True}),
    ("/v1/responses", {"input": "say hi", "max_output_tokens": 20}),
    ("/v1/embeddings", {"input": "one two three four five"}),
    ("/v1/rerank", {"query": "red apple", "documents": ["a red apple", "a blue sky"]}),
    ("/v1/score", {"text_1": "red apple", "text_2": ["a red apple", "a blue sky"]}),
    ("/pooling", {"input": ["one", "two"]}),
    ("/classify", {"input": "a fine day"}),
    ("/v1/responses", {"input": "say more"}),  # BIG tokens: over 1 MiB
]


async def test_every_route_is_metered_as_the_engine_counts_itself_in_every_framing(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    env = {"FAKE_ENGINE_TOKENS": str(BIG), "FAKE_ENGINE_TOKEN_RATE": "5000000"}
    engine = {
        "llama-server": engines.start(env, served="tiny-l"),
        "vllm": engines.start(env, served="tiny-v", kind="vllm"),
    }
    model = {"llama-server": "tiny-l", "vllm": "tiny-v"}
    for kind, e in engine.items():
        await _model(bus, model[kind], e)
    secret = await _key(bus, "alice")
    async with (
        running_router(connect=_connect(nats_settings), settings=router_settings()) as r,
        aiohttp.ClientSession() as http,
    ):
        ready = {"model": "tiny-l", "messages": MESSAGES, "max_tokens": 1}
        await until(lambda: _ok(_send(http, r, "/v1/chat/completions", ready, secret)), 10)
        await until(lambda: _flushed(r), timeout=5)
        before = {k: _engine_count(e, k) for k, e in engine.items()}
        metered_before = await _usage(bus)
        for kind, requests in (("llama-server", LLAMA), ("vllm", VLLM)):
            for path, body in requests:
                status, answer = await _send(http, r, path, {"model": model[kind], **body}, secret)
                assert status == 200, (kind, path, body, answer[:300])

        await until(lambda: _flushed(r), timeout=5)
        metered = await _usage(bus)
        for kind, e in engine.items():
            counted = _engine_count(e, kind)
            said = {k: counted[k] - before[kind][k] for k in counted}
            got = {
                k: metered.get(("alice", model[kind], k), 0)
                - metered_before.get(("alice", model[kind], k), 0)
                for k in ("prompt", "completion")
            }
            assert said["completion"] > BIG  # its big answer was generated...
            assert got == said, (kind, got, said)  # ...and every token is metered, none twice

        # a `stream` an engine would read its own way is the client's 400, before an engine
        for odd in ("yes", 1, "true", [True]):
            body = {"model": "tiny-v", "messages": MESSAGES, "max_tokens": 5, "stream": odd}
            status, answer = await _send(http, r, "/v1/chat/completions", body, secret)
            assert status == 400 and b"`stream` must be true or false" in answer, answer


async def _ok(sent) -> bool:
    return (await sent)[0] == 200


async def _flushed(r) -> bool:
    return r.gateway is not None and not r.gateway.meter.pending()


# bodies that made an engine generate more than the router read from them (issue 36)
HOSTILE = [
    {"max_tokens": 5, "max_completion_tokens": "3000"},  # vLLM reads the string
    {"max_tokens": 5, "max_completion_tokens": 3000.0},
    {"max_tokens": 5, "n_predict": 3000},  # llama-server reads n_predict first
    {"max_tokens": 2000, "n": 8},  # 8 answers
    {"max_tokens": -1},  # llama-server: until the context is full
]


@pytest.mark.parametrize("kind", ["vllm", "llama-server"])
async def test_bodies_read_otherwise_by_an_engine_stay_within_the_key_s_tokens_a_minute(
    bus: Bus, nats_settings: NatsSettings, engines, kind: str
) -> None:
    await ensure_streams(bus)
    engine = engines.start({"FAKE_ENGINE_TOKENS": "3000"}, served="tiny", kind=kind)
    await _model(bus, "tiny", engine)
    secret = await _key(bus, "alice", limits=records.Limits(tpm=10_000))
    async with (
        running_router(connect=_connect(nats_settings), settings=router_settings()) as r,
        aiohttp.ClientSession() as http,
    ):
        ready = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
        await until(lambda: _ok(_send(http, r, "/v1/chat/completions", ready, secret)), 10)
        await _clear_of_a_minute_s_end(needs=20)  # the burst inside one minute's window
        before = _engine_count(engine, kind)["completion"]
        refused = []
        for body in HOSTILE * 3:
            full = {"model": "tiny", "messages": MESSAGES, **body}
            status, answer = await _send(http, r, "/v1/chat/completions", full, secret)
            if status == 429:
                refused.append(json.loads(answer)["error"]["message"])
        generated = _engine_count(engine, kind)["completion"] - before
        # the key's minute holds: what the engines generated is within its 10,000 (before,
        # each reserved 5 or 2,000 tokens and generated 3,000 or 16,000)
        assert generated <= 10_000, (generated, refused)
        assert any("lower max_tokens" in m for m in refused), refused
