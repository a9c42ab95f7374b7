"""The gateway at the router, through real routers fed by a real nats-server and real (fake)
engines: keys, per-model access, limits with OpenAI's answers, metering equal to the
engines' own usage (streams included, also one cut short), the audit trail, revocation on
every router, and no secret anywhere it could be read."""

from __future__ import annotations

import contextlib
import json
import time

import aiohttp
import anyio
import openai
import pytest
from multidict import CIMultiDict
from real_llama import llama_server_binary, start_llama_server, tiny_gguf, tiny_server_argv
from router_helpers import (
    SERVED,
    TINY_CPU_MODEL,
    chat_body,
    router_settings,
    running_router,
)
from waiting import until

from llmgw import catalog
from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import AuditTrail, Counters, ensure_streams
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.gateway import credentials
from llmgw.gateway.metering import parse_usage_subject
from llmgw.router.proxy import ProxySettings

pytestmark = pytest.mark.anyio

MODEL = TINY_CPU_MODEL


async def _place(bus: Bus, engine) -> None:
    replica = records.Replica(
        model="tiny",
        rid="r1",
        profile="cpu",
        members=[records.ReplicaMember(node="n1", rank=0, port=engine.port)],
        phase="ready",
        endpoint=engine.endpoint,
    )
    await bus.put(keys.catalog("tiny"), catalog.encode_model(MODEL))
    await bus.put(keys.replica("tiny", "r1"), replica)
    await bus.put(
        keys.shard("n1", "r1"),
        records.Shard(
            node="n1",
            rid="r1",
            model="tiny",
            generation=1,
            phase="ready",
            since=time.time(),
            endpoint=engine.endpoint,
            served_name=SERVED,
        ),
    )


async def _key(bus: Bus, name: str, **fields: object) -> str:
    """A key in the bucket as `llmgw key create` writes it; its secret."""
    secret = credentials.new_secret(name)
    record = records.ApiKey(name=name, secrets=[credentials.hash_secret(secret)], **fields)
    await bus.put(keys.apikey(name), record)
    return secret


def _connect(nats_settings: NatsSettings):
    return lambda: Bus.connect(nats_settings, give_up_after=None)


@contextlib.asynccontextmanager
async def _router(nats_settings: NatsSettings, engine, bus: Bus):
    await _place(bus, engine)
    async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
        await until(lambda: _served(r), timeout=10)
        yield r


async def _served(r) -> bool:
    return bool(r.table.served_names())


def _auth(secret: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"} if secret else {}


async def _post(r, body: dict, secret: str | None = None) -> tuple[int, CIMultiDict, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{r.url}/v1/chat/completions", json=body, headers=_auth(secret)
        ) as resp:
            return resp.status, resp.headers.copy(), json.loads(await resp.read())


async def _stream(r, body: dict, secret: str | None) -> bytes:
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{r.url}/v1/chat/completions", json=body, headers=_auth(secret)
        ) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()


async def _status(r, secret: str | None) -> int:
    return (await _post(r, chat_body(), secret))[0]


async def _usage(bus: Bus) -> dict[tuple[str | None, str, str], int]:
    """The usage stream's counters: (key, model, kind) -> total."""
    out: dict[tuple[str | None, str, str], int] = {}
    for subject, value in (await Counters(bus).totals(f"{keys.USAGE_ROOT}.>")).items():
        row = parse_usage_subject(subject, value)
        assert row is not None, subject
        out[row.key, row.model, row.kind] = out.get((row.key, row.model, row.kind), 0) + value
    return out


async def test_without_keys_every_client_is_served_and_once_one_exists_a_valid_key_is_needed(
    bus: Bus, nats_settings: NatsSettings, engines, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_streams(bus)
    async with _router(nats_settings, engines.start(), bus) as r:
        assert await _status(r, None) == 200
        assert r.gateway is not None and not r.gateway.enabled
        await until(lambda: _async(any("no API keys in the bucket" in m for m in caplog.messages)))
        secret = await _key(bus, "alice")
        await until(lambda: _is(_status(r, None), 401), timeout=2)
        status, headers, body = await _post(r, chat_body(), None)
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
        assert "llmgw key create" in body["error"]["message"]
        assert await _status(r, secret) == 200
        assert await _status(r, secret[:-1] + ("0" if secret[-1] != "0" else "1")) == 401
        # x-api-key is taken as well as a bearer token
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(), headers={"x-api-key": secret}
            ) as resp:
                assert resp.status == 200
            async with http.get(f"{r.url}/v1/models") as resp:
                assert resp.status == 401

        async def refused_audited() -> bool:
            async with contextlib.aclosing(AuditTrail(bus).read(since=time.time() - 60)) as it:
                async for rec in it:
                    if [rec.status, rec.refused, rec.key] == [401, "invalid_api_key", None]:
                        return rec.client.startswith("127.0.0.1:")
            return False

        await until(refused_audited, timeout=5)


async def test_a_model_outside_the_key_s_list_is_403_with_the_list_and_models_shows_only_its_own(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    async with _router(nats_settings, engines.start(), bus) as r:
        mine = await _key(bus, "alice", models=[SERVED])
        other = await _key(bus, "bob", models=["big-chat", "code"])
        await until(lambda: _is(_status(r, mine), 200), timeout=2)
        status, _, body = await _post(r, chat_body(), other)
        assert status == 403
        assert body["error"]["code"] == "model_not_allowed"
        assert body["error"]["allowed_models"] == ["big-chat", "code"]
        assert "big-chat, code" in body["error"]["message"]
        # a name no model serves is 404 naming only the models the key may use
        for secret, named in ((mine, f"models: {SERVED}"), (other, "models: none you may use")):
            status, _, body = await _post(r, chat_body(model="nope"), secret)
            assert status == 404 and body["error"]["message"].endswith(named), body
        async with aiohttp.ClientSession() as http:
            for secret, listed in ((mine, [SERVED]), (other, [])):
                async with http.get(f"{r.url}/v1/models", headers=_auth(secret)) as resp:
                    assert resp.status == 200
                    data = (await resp.json())["data"]
                    assert [m["id"] for m in data] == listed


async def _get(r, path: str, secret: str | None = None) -> int:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{r.url}{path}", headers=_auth(secret)) as resp:
            await resp.read()
            return resp.status


async def test_once_a_key_exists_the_fleet_document_needs_one_and_metrics_stay_open(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    """A fleet locked with keys is not shown to whoever reaches the router: the page's
    document (every node's address, every engine's endpoint) needs a key, unless the router
    is told `--page-access public`. /metrics stays open, for Prometheus (`--metrics keyed`
    closes it)."""
    public = router_settings(proxy=ProxySettings(page_access="public"))
    engine = engines.start()
    async with (
        _router(nats_settings, engine, bus) as r,
        running_router(connect=_connect(nats_settings), settings=public) as open_page,
    ):
        assert await _get(r, "/fleet/state") == 200  # no key yet: open, as every route
        secret = await _key(bus, "alice")
        await until(lambda: _is(_get(r, "/fleet/state"), 401), timeout=2)
        assert await _get(r, "/fleet/state", secret) == 200
        assert await _get(r, "/") == 200  # the page's own files: no fleet data in them
        assert await _get(r, "/metrics") == 200
        await until(lambda: _is(_status(open_page, None), 401), timeout=2)  # it has the key
        assert await _get(open_page, "/fleet/state") == 200


async def test_over_its_rpm_a_key_gets_429_with_retry_after_and_every_answer_has_ratelimit_headers(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    async with _router(nats_settings, engines.start(), bus) as r:
        limited = await _key(bus, "alice", limits=records.Limits(rpm=3, tpm=100_000))
        free = await _key(bus, "bob")
        await until(lambda: _is(_status(r, free), 200), timeout=2)
        await _clear_of_a_minute_s_end()
        remaining = []
        for _ in range(3):
            status, headers, _ = await _post(r, chat_body(), limited)
            assert status == 200
            assert headers["x-ratelimit-limit-requests"] == "3"
            remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        status, headers, body = await _post(r, chat_body(), limited)
        assert status == 429
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(headers["retry-after"]) <= 60
        assert headers["x-ratelimit-remaining-requests"] == "0"
        # the 429 of one limit carries the other kind's too, as every answer to the key does
        assert headers["x-ratelimit-limit-tokens"] == "100000"
        assert 0 < int(headers["x-ratelimit-remaining-tokens"]) < 100_000
        # a stream's answer carries them too; a key with no limit gets none
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(stream=True), headers=_auth(free)
            ) as resp:
                assert resp.status == 200
                assert not [h for h in resp.headers if h.lower().startswith("x-ratelimit")]


async def test_metering_equals_the_engine_s_usage_streamed_or_not_and_a_cut_stream_pays_its_tokens(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    engine = engines.start({"FAKE_ENGINE_TOKENS": "30", "FAKE_ENGINE_TOKEN_RATE": "200"})
    async with _router(nats_settings, engine, bus) as r:
        secret = await _key(bus, "alice", team="ml")
        await bus.put(keys.team("ml"), records.Team(team="ml"))
        # the router has read both (a request before it would be served as by a fleet
        # without keys, and metered as nobody's)
        assert r.gateway is not None
        table = r.gateway.table
        await until(lambda: _async(table.key("alice") and table.team("ml")), timeout=2)
        await until(lambda: _is(_status(r, secret), 200), timeout=2)
        await until(lambda: _usage(bus), timeout=5)  # that first request, metered
        await until(lambda: _async(not r.gateway.meter.pending()), timeout=5)
        before = await _usage(bus)

        whole = await _post(r, chat_body("one two three"), secret)
        engine_said = whole[2]["usage"]
        # a stream whose client did not ask for usage: the router asks, and strips it
        plain = await _stream(r, chat_body("one two three", stream=True), secret)
        assert b'"usage"' not in plain and plain.rstrip().endswith(b"data: [DONE]")
        # one that asked gets its usage chunk
        asked = await _stream(
            r,
            chat_body("one two three", stream=True, stream_options={"include_usage": True}),
            secret,
        )
        usage_chunks = [
            json.loads(line[5:])
            for line in asked.split(b"\n")
            if line.startswith(b"data: {") and b'"usage"' in line
        ]
        assert [u["usage"]["completion_tokens"] for u in usage_chunks] == [30]
        assert usage_chunks[0]["choices"] == []
        prompt = engine_said["prompt_tokens"]

        async def metered(requests: int) -> dict | None:
            # read once this router has sent all it counted (each kind is its own counter)
            assert r.gateway is not None
            if r.gateway.meter.pending():
                return None
            now = await _usage(bus)
            got = {
                kind: now.get(("alice", SERVED, kind), 0) - before.get(("alice", SERVED, kind), 0)
                for kind in ("requests", "prompt", "completion")
            }
            return got if got["requests"] == requests else None

        # three whole answers: the engine's own counts, exactly
        got = await until(lambda: metered(3), timeout=5)
        assert got == {"requests": 3, "prompt": 3 * prompt, "completion": 3 * 30}

        # a stream the client leaves after a few tokens: charged what was generated (counted
        # event by event as relayed: the role chunk and the tokens; the prompt estimated)
        seen = 0
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions",
                json=chat_body("one two three", stream=True),
                headers=_auth(secret),
            ) as resp:
                async for line in resp.content:
                    if b'"content": "tok' in line:
                        seen += 1
                        if seen == 5:
                            break
        got = await until(lambda: metered(4), timeout=5)
        assert 3 * 30 + 5 <= got["completion"] < 4 * 30
        assert got["prompt"] > 3 * prompt
        assert r.gateway is not None
        tally = r.gateway.tokens["ml", SERVED]
        assert tally[0] >= 4 * prompt
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{r.url}/metrics") as resp:
                text = await resp.text()
        line = f'llmgw_router_tokens_total{{kind="completion",model="{SERVED}",team="ml"}}'
        assert any(x.startswith(line) for x in text.splitlines()), text[-2000:]

        # the audit trail: one record per request, with who, what, where and how much
        async def audited() -> list[records.AuditRecord] | None:
            out = []
            async with contextlib.aclosing(AuditTrail(bus).read(since=time.time() - 60)) as it:
                async for rec in it:
                    out.append(rec)
            return out if len(out) >= 5 else None

        trail = await until(audited, timeout=5)
        whole_rec = [t for t in trail if not t.stream][-1]
        assert whole_rec.key == "alice" and whole_rec.team == "ml" and whole_rec.status == 200
        assert whole_rec.prompt_tokens == prompt and whole_rec.replica == "r1"
        assert whole_rec.client.startswith("127.0.0.1:")
        assert whole_rec.ttft_s is not None and whole_rec.duration_s >= whole_rec.ttft_s


async def test_the_openai_client_gets_its_usual_exceptions_with_their_messages(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    async with _router(nats_settings, engines.start(), bus) as r:
        ok = await _key(bus, "alice", limits=records.Limits(rpm=1))
        other = await _key(bus, "bob", models=["code"])
        await until(lambda: _is(_status(r, other), 403), timeout=2)

        await _clear_of_a_minute_s_end()
        messages = [{"role": "user", "content": "hi"}]
        wrong = "llmgw-alice-" + "0" * 64
        async with contextlib.AsyncExitStack() as stack:
            clients = {
                name: await stack.enter_async_context(
                    openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key=secret, max_retries=0)
                )
                for name, secret in (("wrong", wrong), ("other", other), ("ok", ok))
            }
            with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
                await clients["wrong"].chat.completions.create(model=SERVED, messages=messages)
            with pytest.raises(openai.PermissionDeniedError, match="may use: code"):
                await clients["other"].chat.completions.create(model=SERVED, messages=messages)
            answer = await clients["ok"].chat.completions.create(model=SERVED, messages=messages)
            assert answer.usage is not None and answer.usage.completion_tokens > 0
            with pytest.raises(openai.RateLimitError, match="rate limit reached for key alice"):
                await clients["ok"].chat.completions.create(model=SERVED, messages=messages)


async def test_a_revoked_key_fails_within_a_second_on_two_routers_and_no_secret_is_stored_or_logged(
    bus: Bus,
    nats_server: EmbeddedNats,
    nats_settings: NatsSettings,
    engines,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await ensure_streams(bus)
    engine = engines.start()
    async with _router(nats_settings, engine, bus) as a, _router(nats_settings, engine, bus) as b:
        secret = await _key(bus, "alice", team="ml", limits=records.Limits(rpm=1000))
        await bus.put(keys.team("ml"), records.Team(team="ml"))
        for r in (a, b):
            await until(lambda r=r: _is(_status(r, secret), 200), timeout=2)
        await _stream(a, chat_body(stream=True), secret)
        entry = await bus.get(keys.apikey("alice"), lambda d: records.decode(d, records.ApiKey))
        assert entry is not None
        entry.value.revoked_at = time.time()
        await bus.put(keys.apikey("alice"), entry.value)
        start = time.monotonic()
        for r in (a, b):
            await until(lambda r=r: _is(_status(r, secret), 401), timeout=2)
        assert time.monotonic() - start < 1.0
        status, _, body = await _post(a, chat_body(), secret)
        assert "revoked" in body["error"]["message"]
        await anyio.sleep(0.5)  # the routers' flush of usage and audit
    stored = "\n".join(
        p.read_bytes().decode("latin-1")
        for p in (nats_server.data_dir / "jetstream").rglob("*")
        if p.is_file()
    )
    assert "alice" in stored  # the records are there...
    random_part = secret.rsplit("-", 1)[1]
    assert random_part not in stored  # ...and no secret in any bucket value or stream message
    logged = [r for r in caplog.records if random_part in r.getMessage()]
    assert caplog.records and not logged


async def _clear_of_a_minute_s_end(needs: float = 10.0) -> None:
    """Limits count per minute of the clock: a test that fills one must not straddle two
    (`needs`: the seconds it runs in one)."""
    if time.time() % 60 > 60 - needs:
        await anyio.sleep(60 - time.time() % 60 + 0.1)


async def _async(value: object) -> object:
    return value


async def _is(status, want: int) -> bool:
    return await status == want


async def test_a_stream_running_past_its_token_limit_is_charged_as_it_goes_and_ended(
    bus: Bus, nats_settings: NatsSettings, engines
) -> None:
    await ensure_streams(bus)
    # no max_tokens: 1,024 reserved, and the engine generates 3,000
    engine = engines.start({"FAKE_ENGINE_TOKENS": "3000", "FAKE_ENGINE_TOKEN_RATE": "5000"})
    async with _router(nats_settings, engine, bus) as r:
        secret = await _key(bus, "alice", limits=records.Limits(tpm=1500))
        await until(lambda: _is(_status(r, None), 401), timeout=2)
        tokens = 0
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions",
                json=chat_body(stream=True),
                headers=_auth(secret),
            ) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    async for line in resp.content:
                        tokens += b'"content": "tok' in line
        # ended once past the limit, not after the 3,000 tokens the engine would have sent
        assert 1000 < tokens < 1600
        status, headers, body = await _post(r, chat_body(), secret)
        assert status == 429 and headers["x-ratelimit-remaining-tokens"] == "0"


def _predicted(server) -> int:
    """llama-server's own count of the tokens it generated (its /metrics)."""
    status, body = server.get("/metrics")
    assert status == 200, body
    for line in body.decode().splitlines():
        if line.startswith("llamacpp:tokens_predicted_total"):
            return int(float(line.split()[-1]))
    raise AssertionError(f"no tokens_predicted_total in {body[:300]!r}")


async def test_metering_through_the_router_equals_a_real_llama_server_s_own_count(
    bus: Bus, nats_settings: NatsSettings, tmp_path
) -> None:
    binary = llama_server_binary()
    port = free_port()
    argv = tiny_server_argv(binary, tiny_gguf(tmp_path), port, "--alias", "tiny", "--metrics")
    server = start_llama_server(argv, tmp_path / "llama-server.log", port)
    try:
        server.wait_ready()
        await ensure_streams(bus)
        model = catalog.Model(id="tiny", served_name="tiny", endpoints=[server.base_url])
        await bus.put(keys.catalog("tiny"), catalog.encode_model(model))
        async with running_router(connect=_connect(nats_settings), settings=router_settings()) as r:
            secret = await _key(bus, "alice")
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "count to ten"}],
                "max_tokens": 12,
                "ignore_eos": True,
            }

            async def answered() -> bool:
                return (await _post(r, body, secret))[0] == 200

            await until(answered, timeout=10)
            await until(lambda: _async(not r.gateway.meter.pending()), timeout=5)
            before, predicted = await _usage(bus), _predicted(server)
            plain = await _stream(r, {**body, "stream": True}, secret)
            events = [line for line in plain.split(b"\n") if line.startswith(b"data: {")]
            assert events and not any(b'"choices":[]' in e for e in events)
            assert b'"usage"' not in plain.split(b"\n")[-1]
            status, _, whole = await _post(r, body, secret)
            assert status == 200

            async def metered() -> int | None:
                if r.gateway.meter.pending():
                    return None
                now = await _usage(bus)
                n = now.get(("alice", "tiny", "requests"), 0)
                if n - before.get(("alice", "tiny", "requests"), 0) != 2:
                    return None
                return (
                    now[("alice", "tiny", "completion")] - before[("alice", "tiny", "completion")]
                )

            completion = await until(metered, timeout=5)
            assert (
                completion
                == _predicted(server) - predicted
                == 12 + whole["usage"]["completion_tokens"]
            )
    finally:
        server.stop()
