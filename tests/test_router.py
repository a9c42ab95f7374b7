"""The router in front of real (fake) engine processes: streaming, the official client,
disconnects, balancing, prefix affinity, ejection, keys, errors and metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anyio
import openai
import pytest
from raw_engine import Action, RawEngine, answer
from router_helpers import (
    SERVED,
    chat_body,
    router_settings,
    running_router,
    static_model,
)
from serving import sse_events
from waiting import until

from llmgw import catalog
from llmgw.router.balancer import BalancerSettings
from llmgw.router.proxy import ProxySettings
from llmgw.router.server import HttpLimits
from llmgw.router.upstream import UpstreamSettings

pytestmark = pytest.mark.anyio


def _raw_model(engine: RawEngine) -> catalog.Model:
    return catalog.Model(id="tiny", served_name=SERVED, endpoints=[engine.url])


SLOW = {"FAKE_ENGINE_TOKENS": "2000", "FAKE_ENGINE_TOKEN_RATE": "50"}  # 40 s of tokens


async def test_stream_arrives_in_order_and_before_the_engine_finishes(engines):
    engine = engines.start({"FAKE_ENGINE_TOKENS": "40", "FAKE_ENGINE_TOKEN_RATE": "20"})
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        async with http.post(f"{r.url}/v1/chat/completions", json=chat_body(stream=True)) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            texts = []
            async for data in sse_events(resp):
                if data == "[DONE]":
                    break
                delta = json.loads(data)["choices"][0]["delta"].get("content")
                if delta:
                    if not texts:
                        # relayed as it comes: the engine is still generating the other 39
                        assert engine.in_flight() == 1
                    texts.append(delta)
    assert texts == [f"tok{i} " for i in range(40)]


async def test_official_openai_client_works_unchanged(engines):
    engine = engines.start()
    async with running_router([static_model(engine)]) as r:
        client = openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == [SERVED]
            done = await client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert done.choices[0].message.content == "tok0 tok1 tok2 "
            assert done.usage.prompt_tokens > 0
            stream = await client.chat.completions.create(
                model=SERVED, messages=[{"role": "user", "content": "hi"}], stream=True
            )
            pieces = [c.choices[0].delta.content async for c in stream if c.choices]
            assert "".join(p for p in pieces if p) == "".join(f"tok{i} " for i in range(8))
            text = await client.completions.create(model=SERVED, prompt="once upon", max_tokens=2)
            assert text.choices[0].text == "tok0 tok1 "
            emb = await client.embeddings.create(model=SERVED, input=["a", "bb"])
            assert len(emb.data) == 2
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "hi"}]
                )
        finally:
            await client.close()


async def test_client_disconnect_cancels_the_engine_request(engines):
    engine = engines.start(SLOW)
    async with running_router([static_model(engine)]) as r:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(f"{r.url}/v1/chat/completions", json=chat_body(stream=True))
            await resp.content.readany()  # the stream has begun
            assert engine.in_flight() == 1
            resp.close()  # the client goes away 40 s before the answer would end
        await until(lambda: _true(engine.in_flight() == 0), timeout=5)


async def _true(value: bool) -> bool:
    return value


async def test_least_in_flight_spreads_concurrent_requests(engines):
    a, b = engines.start(SLOW), engines.start(SLOW)
    no_affinity = router_settings(balancer=BalancerSettings(affinity_load_factor=0))
    async with (
        running_router([static_model(a, b)], settings=no_affinity) as r,
        aiohttp.ClientSession() as http,
    ):
        streams = []
        for _ in range(4):
            resp = await http.post(f"{r.url}/v1/chat/completions", json=chat_body(stream=True))
            await resp.content.readany()
            streams.append(resp)
        assert (a.in_flight(), b.in_flight()) == (2, 2)
        for s in streams:
            s.close()


async def _replica_of(http, url: str, body: dict, headers=None) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-llmgw-replica"]


def _turns(n: int) -> list[list[dict]]:
    """A conversation growing turn by turn."""
    messages = [{"role": "system", "content": "You are terse."}]
    out = []
    for i in range(n):
        messages = [*messages, {"role": "user", "content": f"question {i}"}]
        out.append(list(messages))
        messages = [*messages, {"role": "assistant", "content": f"answer {i}"}]
    return out


async def test_a_conversation_stays_on_one_replica_and_two_routers_agree(engines):
    fleet = [engines.start() for _ in range(3)]
    model = static_model(*fleet)
    async with (
        running_router([model]) as r1,
        running_router([model]) as r2,
        aiohttp.ClientSession() as http,
    ):
        for conversation in range(6):
            opening = [{"role": "user", "content": f"conversation {conversation}"}]
            seen = set()
            for turn, messages in enumerate(_turns(4)):
                body = chat_body(messages=opening + messages)
                router = (r1, r2)[turn % 2]  # alternate routers that never talk
                seen.add(await _replica_of(http, router.url, body))
            assert len(seen) == 1, f"conversation {conversation} moved: {seen}"
        # a session header and the `user` field keep a client's requests together too
        for key in ("alice", "bob"):
            by_header = {
                await _replica_of(http, r1.url, chat_body(f"q{i}"), headers={"x-session-id": key})
                for i in range(4)
            }
            by_user = {
                await _replica_of(http, r2.url, chat_body(f"q{i}", user=key)) for i in range(4)
            }
            assert len(by_header) == 1 and len(by_user) == 1


async def test_a_busy_conversation_spills_to_the_next_replica(engines):
    fleet = [engines.start(SLOW) for _ in range(3)]
    async with (
        running_router([static_model(*fleet)]) as r,
        aiohttp.ClientSession() as http,
    ):
        streams, where = [], []
        for _ in range(3):  # the same conversation three times at once
            resp = await http.post(f"{r.url}/v1/chat/completions", json=chat_body(stream=True))
            await resp.content.readany()
            streams.append(resp)
            where.append(resp.headers["x-llmgw-replica"])
        # bounded load (1.25x the average): the first replica takes two, the next one one
        assert where[0] == where[2] != where[1]
        for s in streams:
            s.close()


async def test_a_killed_engine_is_ejected_and_unsent_requests_go_elsewhere(engines):
    alive, dead = engines.start(), engines.start()
    settings = router_settings(
        balancer=BalancerSettings(affinity_load_factor=0, eject_after=3, eject_base=60),
        probe_interval=3600,  # only requests find it dead here
    )
    async with (
        running_router([static_model(alive, dead)], settings=settings) as r,
        aiohttp.ClientSession() as http,
    ):
        dead.kill()
        served = [await _replica_of(http, r.url, chat_body(f"q{i}")) for i in range(40)]
        assert set(served) == {alive.url}  # every request answered, none lost
        metrics = await _metrics(http, r.url)
        assert metrics[f'llmgw_router_ejections_total{{model="tiny",replica="{dead.url}"}}'] == 1
        # three connection failures, each retried on the live engine; none after the ejection
        assert (
            metrics[
                f'llmgw_router_errors_total{{kind="connect",model="tiny",replica="{dead.url}"}}'
            ]
            == 3
        )
        assert metrics['llmgw_router_retries_total{model="tiny"}'] == 3


async def test_an_engine_failing_its_health_check_gets_no_requests(engines):
    healthy, sick = engines.start(), engines.start()
    async with (
        running_router([static_model(healthy, sick)]) as r,
        aiohttp.ClientSession() as http,
    ):
        sick.process.send_signal(19)  # SIGSTOP: connections open, nothing answers
        try:
            backend = next(b for b in r.table.backends() if b.id == sick.url)
            await until(lambda: _true(not backend.probe_ok), timeout=10)
            served = {await _replica_of(http, r.url, chat_body(f"q{i}")) for i in range(10)}
            assert served == {healthy.url}
        finally:
            sick.process.send_signal(18)  # SIGCONT
        await until(lambda: _true(backend.probe_ok), timeout=10)


async def _metrics(http, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/plain")
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_count_requests_errors_in_flight_and_time_to_first_byte(engines):
    engine = engines.start()
    async with running_router([static_model(engine)]) as r, aiohttp.ClientSession() as http:
        for _ in range(3):
            await _replica_of(http, r.url, chat_body())
        async with http.post(f"{r.url}/v1/chat/completions", json={"model": "nope"}) as resp:
            assert resp.status == 404
        m = await _metrics(http, r.url)
    rep = f'model="tiny",replica="{engine.url}"'
    assert m[f'llmgw_router_requests_total{{code="200",{rep}}}'] == 3
    assert m['llmgw_router_requests_total{code="404",model="",replica=""}'] == 1
    assert m['llmgw_router_errors_total{kind="unknown_model",model="",replica=""}'] == 1
    assert m[f"llmgw_router_in_flight{{{rep}}}"] == 0
    assert m[f"llmgw_router_time_to_first_byte_seconds_count{{{rep}}}"] == 3
    assert m['llmgw_router_endpoints{model="tiny"}'] == 1


async def test_errors_are_openai_shaped_and_say_what_to_do(engines):
    engine = engines.start()
    small = router_settings(limits=HttpLimits(max_body=2048))
    async with (
        running_router([static_model(engine)], settings=small) as r,
        aiohttp.ClientSession() as http,
    ):
        url = f"{r.url}/v1/chat/completions"
        async with http.post(url, json={**chat_body(), "model": "gpt-9"}) as resp:
            assert resp.status == 404
            err = (await resp.json())["error"]
            assert err["code"] == "model_not_found" and SERVED in err["message"]
        for bad in (b"{not json", b"[1, 2]", b'{"messages": []}', b'{"model": 7}', b""):
            async with http.post(
                url, data=bad, headers={"content-type": "application/json"}
            ) as resp:
                assert resp.status == 400, bad
                assert (await resp.json())["error"]["type"] == "invalid_request_error"
        big = chat_body("x" * 4096)
        async with http.post(url, json=big) as resp:
            assert resp.status == 413
            assert "2048" in (await resp.json())["error"]["message"]
        async with http.get(url) as resp:
            assert resp.status == 405
        async with http.get(f"{r.url}/v2/anything") as resp:
            assert resp.status == 404


async def test_a_static_endpoints_own_key_is_sent_to_it_and_client_keys_are_checked(
    engines, tmp_path
):
    engine = engines.start({}, "--api-key", "engine-secret")
    key_file = tmp_path / "vendor.key"
    key_file.write_text("engine-secret\n")
    key_file.chmod(0o600)
    keyed_model = catalog.Model(
        id="tiny", served_name=SERVED, endpoints=[engine.url], api_key_file=str(key_file)
    )
    async with aiohttp.ClientSession() as http:
        fleet_key_only = router_settings(proxy=ProxySettings(engine_api_key="engine-secret"))
        async with running_router([static_model(engine)], settings=fleet_key_only) as r:
            async with http.post(f"{r.url}/v1/chat/completions", json=chat_body()) as resp:
                # the fleet's key goes to the fleet's engines, never to a static endpoint:
                # the engine's 401, passed through as it is
                assert resp.status == 401
                assert (await resp.json())["error"]["message"] == "Invalid API Key"
        keyed = router_settings(
            proxy=ProxySettings(
                engine_api_key="fleet-secret", client_api_keys=frozenset({"client-1"})
            )
        )
        async with running_router([keyed_model], settings=keyed) as r:
            url = f"{r.url}/v1/chat/completions"
            async with http.post(url, json=chat_body()) as resp:
                assert resp.status == 401  # the router's: this client has no key
                assert (await resp.json())["error"]["type"] == "authentication_error"
            bad = {"Authorization": "Bearer engine-secret"}  # the engine's key is not a client's
            async with http.post(url, json=chat_body(), headers=bad) as resp:
                assert resp.status == 401
            good = {"Authorization": "Bearer client-1"}
            async with http.post(url, json=chat_body(), headers=good) as resp:
                assert resp.status == 200
            async with http.get(f"{r.url}/v1/models", headers=good) as resp:
                assert resp.status == 200
            async with http.get(f"{r.url}/health") as resp:
                assert resp.status == 200  # health needs no key


async def test_a_client_that_pauses_reading_holds_back_the_engine_and_gets_the_whole_stream():
    """While a client does not read, the router stops reading from the engine (back-pressure
    on both hops): the engine's own count of what it sent stops growing, far short of the
    whole stream (a router that buffered the answer would let it all out), and nothing is
    lost when the client reads again."""
    events, event = 40_000, b"data: " + b"x" * 1000 + b"\n\n"  # 40 MB: more than any buffer
    sent = 0

    async def stream(writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(events):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()  # as an engine's server does: it waits for its socket
            sent += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    def script(seen, engine) -> Action:
        return Action(stream) if seen.method == b"POST" else Action(answer(b"{}"))  # /health

    async with RawEngine(script) as engine, running_router([_raw_model(engine)]) as r:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(stream=True)
            ) as resp:
                await anyio.sleep(1)  # not reading: socket buffers fill, both hops pause
                paused_at = sent
                await anyio.sleep(0.5)
                assert sent == paused_at < events / 2  # the engine is held back
                body = await resp.read()
    assert body.count(b"data: ") == events and sent == events


async def test_an_engine_closing_its_kept_alive_connection_costs_the_client_nothing(engines):
    """llama-server closes its connection after every streamed answer, though its headers
    promise keep-alive; here it closes 0.2 s later. A connection that carried a stream
    settles before it carries another request (1 s here), so the engine's close is seen
    first, and then no connection is kept after a stream to it: no request meets that
    close, every one is answered."""
    engine = engines.start({"FAKE_ENGINE_CLOSE_AFTER_STREAM": "0.2"})
    settings = router_settings(upstream=UpstreamSettings(stream_settle=1.0))
    async with (
        running_router([static_model(engine)], settings=settings) as r,
        aiohttp.ClientSession() as http,
    ):
        for i in range(3):
            async with http.post(
                f"{r.url}/v1/chat/completions", json=chat_body(f"s{i}", stream=True)
            ) as resp:
                assert resp.status == 200
                assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
            async with http.post(f"{r.url}/v1/chat/completions", json=chat_body(f"q{i}")) as resp:
                assert resp.status == 200, await resp.text()
        m = await _metrics(http, r.url)
    assert m[f'llmgw_router_requests_total{{code="200",model="tiny",replica="{engine.url}"}}'] == 6
    assert not any(k.startswith("llmgw_router_errors_total") for k in m)


_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    b"b\r\ndata: tok\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
)


async def _stream_through(http: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with http.post(f"{url}/v1/chat/completions", json=chat_body(stream=True)) as resp:
        return resp.status, await resp.read()


async def test_a_connection_that_carried_a_stream_carries_the_next_once_it_settled():
    """An engine that keeps its connections after streams (vLLM's uvicorn does): once a
    connection stayed open its settling time after a stream, the next request goes on it
    instead of a new one; one sent before that takes a connection of its own."""
    async with (
        RawEngine(lambda seen, engine: Action(_STREAM)) as engine,
        running_router(
            [_raw_model(engine)],
            settings=router_settings(upstream=UpstreamSettings(stream_settle=0.1)),
        ) as r,
        aiohttp.ClientSession() as http,
    ):
        assert await _stream_through(http, r.url) == (200, b"data: tok\n\ndata: [DONE]\n\n")
        assert (await _stream_through(http, r.url))[0] == 200  # at once: not settled yet
        await anyio.sleep(0.3)
        assert (await _stream_through(http, r.url))[0] == 200
    first, second, third = engine.posts()
    assert second.connection != first.connection
    assert third.connection in (first.connection, second.connection)
    assert third.number == 1  # the second request that connection carried


async def test_an_engine_seen_closing_after_a_stream_never_gets_a_request_on_one():
    """An engine that closed a connection right after a stream (llama-server's way) is
    remembered: later streams' connections are not kept, even one that outlives its settling
    time (here the engine holds it 1 s, reading nothing, then closes it: a request sent on it
    would be lost, and could not be sent again). Every stream is answered, each on a
    connection of its own."""

    async def late_close(writer: asyncio.StreamWriter) -> None:
        writer.write(_STREAM)
        await writer.drain()
        await asyncio.sleep(1.0)  # reads nothing meanwhile, then closes

    def script(seen, engine) -> Action:
        if seen.method != b"POST":
            return Action(answer(b"{}"))  # /health
        if not engine.posts()[:-1]:
            return Action(_STREAM, close=True)  # the first stream: closed at once
        return Action(late_close, close=True)

    async with (
        RawEngine(script) as engine,
        running_router(
            [_raw_model(engine)],
            settings=router_settings(upstream=UpstreamSettings(stream_settle=0.1)),
        ) as r,
        aiohttp.ClientSession() as http,
    ):
        statuses = []
        for _ in range(3):
            statuses.append((await _stream_through(http, r.url))[0])
            await anyio.sleep(0.3)  # past the settling time
        m = await _metrics(http, r.url)
    assert statuses == [200, 200, 200]
    posts = engine.posts()
    assert len({p.connection for p in posts}) == 3 and all(p.number == 0 for p in posts)
    assert not any(k.startswith("llmgw_router_errors_total") for k in m)


async def test_an_engine_that_closes_after_streams_has_the_next_connection_opened_ahead():
    """After a stream to an engine that closes its connection after every stream
    (llama-server), the router opens the connection the next request will take at once,
    off that request's time to first token: a connection on which nothing was sent yet
    is open at the engine, and the next stream goes on it."""

    def script(seen, engine) -> Action:
        return Action(_STREAM, close=True) if seen.method == b"POST" else Action(answer(b"{}"))

    async def unused() -> set[int]:
        return set(range(engine.connections)) - {s.connection for s in engine.requests}

    async with (
        RawEngine(script) as engine,
        running_router([_raw_model(engine)], settings=router_settings(probe_interval=3600)) as r,
        aiohttp.ClientSession() as http,
    ):
        assert (await _stream_through(http, r.url))[0] == 200
        ahead = await until(unused)
        assert await _stream_through(http, r.url) == (200, b"data: tok\n\ndata: [DONE]\n\n")
    first, second = engine.posts()
    assert second.connection in ahead and second.connection != first.connection
