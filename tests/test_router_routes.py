"""Every OpenAI-style route the engines serve, through the real router to fake engines that
serve them as llama-server and vLLM do: JSON bodies and multipart forms (audio, the model
in a form field, the file passed through unchanged), streams, the official `openai`
client's Responses and transcription calls, and an engine's own 404 for a route it does
not serve."""

from __future__ import annotations

import hashlib
import json

import aiohttp
import anyio
import openai
import pytest
from router_helpers import SERVED, running_router, static_model

pytestmark = pytest.mark.anyio

AUDIO = bytes(range(256)) * 400  # 100 KiB "recording", every byte value in it


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with http.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


LLAMA_ROUTES = [
    ("/v1/rerank", {"query": "red apple", "documents": ["a red apple", "blue sky"]}),
    ("/rerank", {"query": "red apple", "documents": ["blue sky", "a red apple"], "top_n": 1}),
    ("/tokenize", {"content": "hello world"}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": "):\n    pass"}),
]


@pytest.mark.parametrize(("path", "body"), LLAMA_ROUTES, ids=[p for p, _ in LLAMA_ROUTES])
async def test_llama_server_routes_are_proxied_with_the_engines_own_answer(engines, path, body):
    engine = engines.start()
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        got = await _post(http, f"{r.url}{path}", {"model": SERVED, **body})
        direct = await _post(http, f"{engine.url}{path}", {"model": SERVED, **body})
    status, headers, answer = got
    assert status == 200, answer
    assert headers["x-llmgw-replica"] == engine.url
    assert answer == direct[2]  # what the engine says, unchanged


VLLM_ROUTES = [
    ("/v1/rerank", {"query": "red apple", "documents": ["a red apple", "blue sky"]}),
    ("/v2/rerank", {"query": "red apple", "documents": ["blue sky", "a red apple"]}),
    ("/v1/score", {"text_1": "red apple", "text_2": ["a red apple", "blue sky"]}),
    ("/score", {"text_1": "red apple", "text_2": "apple"}),
    ("/pooling", {"input": ["one", "two"]}),
    ("/classify", {"input": "a fine day"}),
    ("/tokenize", {"prompt": "hello world"}),
    ("/detokenize", {"tokens": [5, 6]}),
    ("/v1/responses", {"input": "Say hi", "instructions": "Be brief."}),
]


@pytest.mark.parametrize(("path", "body"), VLLM_ROUTES, ids=[p for p, _ in VLLM_ROUTES])
async def test_vllm_routes_are_proxied_with_the_engines_own_answer(engines, path, body):
    engine = engines.start(kind="vllm")
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        status, headers, answer = await _post(http, f"{r.url}{path}", {"model": SERVED, **body})
    assert status == 200, answer
    assert headers["x-llmgw-replica"] == engine.url
    kind = {"/v1/responses": "response"}.get(path)
    if kind:
        assert answer["object"] == kind and answer["output"][0]["content"][0]["text"]
    else:
        assert (
            answer.get("results")
            or answer.get("data")
            or "tokens" in answer
            or answer.get("prompt")
        ), answer


def _form(fields: dict[str, str], file: bytes, boundary: str = "llmgw-test-boundary") -> bytes:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n".encode()
        + file
        + b"\r\n"
    )
    return b"".join(parts) + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
async def test_audio_forms_are_routed_by_their_model_field_and_the_file_arrives_unchanged(
    engines, path
):
    engine = engines.start(kind="vllm")
    other = engines.start(kind="vllm", served="other-model")
    models = [static_model(engine), static_model(other, model_id="other", served="other-model")]
    async with running_router(models) as r, aiohttp.ClientSession() as http:
        # the file first, the model after it: the field is found wherever it is
        body = _form({"language": "en"}, AUDIO)[: -len(b"--llmgw-test-boundary--\r\n")]
        body += b'--llmgw-test-boundary\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
        body += b"other-model\r\n--llmgw-test-boundary--\r\n"
        headers = {"content-type": "multipart/form-data; boundary=llmgw-test-boundary"}
        async with http.post(f"{r.url}{path}", data=body, headers=headers) as resp:
            answer = await resp.json()
            assert resp.status == 200, answer
            assert resp.headers["x-llmgw-replica"] == other.url
            assert resp.headers["x-fake-file-sha256"] == hashlib.sha256(AUDIO).hexdigest()
        assert answer["text"].startswith("tok0 ")
        # a form with no model field: the router's 400, naming what to add
        async with http.post(
            f"{r.url}{path}", data=_form({"language": "en"}, AUDIO)[:-2] + b"\r\n", headers=headers
        ) as resp:
            assert resp.status == 400
            assert "no `model` field" in (await resp.json())["error"]["message"]
        # one whose boundary never comes: the router's 400 too, not the engine's
        async with http.post(f"{r.url}{path}", data=b"just bytes", headers=headers) as resp:
            assert resp.status == 400
            assert "multipart" in (await resp.json())["error"]["message"]


async def test_the_official_client_transcribes_and_calls_the_responses_api_through_the_router(
    engines,
):
    engine = engines.start({"FAKE_ENGINE_TOKENS": "5"}, kind="vllm")
    async with running_router([static_model(engine)]) as r:
        client = openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
        try:
            heard = await client.audio.transcriptions.create(
                model=SERVED, file=("a.wav", AUDIO, "audio/wav")
            )
            assert heard.text == "tok0 tok1 tok2 tok3 tok4 "
            done = await client.responses.create(model=SERVED, input="Say hi")
            assert done.output_text == "tok0 tok1 tok2 tok3 tok4 "
            assert done.usage is not None and done.usage.output_tokens == 5
            stream = await client.responses.create(model=SERVED, input="Say hi", stream=True)
            kinds, deltas = [], []
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert "".join(deltas) == "tok0 tok1 tok2 tok3 tok4 "
        finally:
            await client.close()


async def test_infill_streams_through_the_router_chunk_by_chunk(engines):
    engine = engines.start({"FAKE_ENGINE_TOKENS": "6"})
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        body = {"model": SERVED, "input_prefix": "def f(", "input_suffix": ")", "stream": True}
        async with http.post(f"{r.url}/infill", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-accel-buffering"] == "no"
            pieces = [
                json.loads(line[6:])["content"]
                async for line in resp.content
                if line.startswith(b"data: ")
            ]
    assert "".join(pieces) == "".join(f"tok{i} " for i in range(6))


async def test_a_route_the_engine_does_not_serve_gets_the_engines_own_404(engines):
    engine = engines.start()  # llama-server: no Responses API, no audio
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        status, headers, answer = await _post(
            http, f"{r.url}/v1/responses", {"model": SERVED, "input": "hi"}
        )
        assert status == 404
        assert headers["x-llmgw-replica"] == engine.url  # the engine's answer, not the router's
        assert answer == {
            "error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}
        }
        # a name no model has is the router's 404, on the new routes as on chat
        status, _, answer = await _post(
            http, f"{r.url}/v1/rerank", {"model": "nope", "query": "q", "documents": []}
        )
        assert status == 404 and answer["error"]["code"] == "model_not_found"


async def test_the_new_routes_hold_for_a_cold_model_as_chat_does(tmp_path, bus, nats_settings):
    """An autoscaled model with no replica: a rerank or an audio form that does not wait
    gets chat's 503 model_cold (and asks for a replica); one that waits is held."""
    from autoscale_fleet import autoscaled_model, serve_auto

    from llmgw.bus.client import Bus

    await serve_auto(bus, autoscaled_model(tmp_path / "weights"))
    connect = lambda: Bus.connect(nats_settings, give_up_after=None)  # noqa: E731
    async with running_router(connect=connect) as r, aiohttp.ClientSession() as http:
        while not r.table.synced or r.table.cold_names() != [SERVED]:
            await anyio.sleep(0.05)
        no_wait = {"x-llmgw-max-wait": "0"}
        async with http.post(
            f"{r.url}/v1/rerank",
            json={"model": SERVED, "query": "q", "documents": ["d"]},
            headers=no_wait,
        ) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "model_cold"
        form = {"content-type": "multipart/form-data; boundary=llmgw-test-boundary"}
        async with http.post(
            f"{r.url}/v1/audio/transcriptions",
            data=_form({"model": SERVED}, AUDIO),
            headers={**form, "x-llmgw-max-wait": "0.3"},
        ) as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "model_cold" and "held 0.3 s" in error["message"]
