"""The router between a client and an engine that misbehaves at the edges of HTTP: answers
without a body or framed wrong, bytes out of turn, a connection dropped after the engine
read the request, an IPv6 address, and request smuggling aimed through the router."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from raw_engine import Action, RawEngine, Seen, answer
from router_helpers import chat_body, running_router
from test_router_server import Answers, _read_answers

from llmgw import catalog

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _model(*engines: RawEngine) -> catalog.Model:
    return catalog.Model(id="tiny", served_name="tiny-chat", endpoints=[e.url for e in engines])


def _post(body: dict | bytes, *extra: bytes) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (
            CHAT.encode(),
            len(data),
            b"".join(e + b"\r\n" for e in extra),
            data,
        )
    )


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _client_answers(router_url: str, data: bytes, n: int) -> list:
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    parsed = Answers()
    try:
        await _read_answers(reader, n, parsed)
    finally:
        writer.close()
    return parsed.items


def _echo(seen: Seen, engine: RawEngine) -> Action:
    return Action(answer(seen.body))


async def test_an_engines_no_content_answer_has_no_body_and_the_next_answer_reads_right():
    """A 204 with no length was relayed chunked, with a `0\\r\\n\\r\\n` the client then read as
    the start of the next answer."""

    def script(seen: Seen, engine: RawEngine) -> Action:
        if b"first" in seen.body:
            return Action(b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n")
        return _echo(seen, engine)

    async with RawEngine(script) as engine, running_router([_model(engine)]) as r:
        answers = await _client_answers(
            r.url, _post(chat_body("first")) + _post(chat_body("second")), 2
        )
    assert [a.status for a in answers] == [204, 200]
    assert b"transfer-encoding" not in answers[0].headers and answers[0].body == b""
    assert b"second" in answers[1].body


async def test_the_engine_gets_only_the_headers_worth_passing_on_each_value_of_a_repeated_one():
    """An SDK sends a dozen headers and more: the engine gets the few worth passing on
    (content type, accept, request id, trace context), every value of one given twice in
    its order, never the client's key; a body without a content type is said to be JSON."""
    async with RawEngine(_echo) as engine, running_router([_model(engine)]) as r:
        sdk = (
            b"authorization: Bearer sk-client",
            b"Accept: application/json",
            b"x-stainless-lang: python",
            b"traceparent: 00-abc-def-01",
            b"user-agent: OpenAI/Python 2.3.0",
        )
        repeated = (b"accept: text/event-stream", b"accept: application/json", b"x-request-id: r2")
        body = json.dumps(chat_body("three")).encode()
        bare = b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n%s" % (
            CHAT.encode(),
            len(body),
            body,
        )
        data = _post(chat_body("one"), *sdk) + _post(chat_body("two"), *repeated) + bare
        answers = await _client_answers(r.url, data, 3)
        assert [a.status for a in answers] == [200, 200, 200]
        one, two, three = engine.posts()
    passed = {b"content-type", b"accept", b"x-request-id", b"traceparent", b"tracestate"}
    hop = {b"host", b"content-length"}

    def sent(seen: Seen) -> list[tuple[bytes, bytes]]:
        return [(n, v) for n, v in seen.header_lines if n not in hop]

    assert sorted(sent(one)) == sorted(
        [
            (b"content-type", b"application/json"),
            (b"accept", b"application/json"),
            (b"traceparent", b"00-abc-def-01"),
        ]
    )
    assert [(n, v) for n, v in sent(two) if n == b"accept"] == [
        (b"accept", b"text/event-stream"),
        (b"accept", b"application/json"),
    ]
    assert {n for n, _ in sent(two)} <= passed and (b"x-request-id", b"r2") in sent(two)
    assert sent(three) == [(b"content-type", b"application/json")]


async def test_an_answer_longer_than_its_length_reaches_the_client_cut_and_is_not_reused():
    def script(seen: Seen, engine: RawEngine) -> Action:
        if b"first" in seen.body:
            return Action(
                b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\n"
                b"content-length: 5\r\n\r\nforge"
            )
        return _echo(seen, engine)

    async with RawEngine(script) as engine, running_router([_model(engine)]) as r:
        answers = await _client_answers(
            r.url, _post(chat_body("first")) + _post(chat_body("second")), 2
        )
        assert answers[0].body == b"hello" and b"second" in answers[1].body
        first, second = engine.posts()
        assert first.connection != second.connection  # a new one for the second


async def test_bytes_an_engine_sends_on_an_idle_connection_close_it():
    """An idle connection's unasked-for bytes were read as the next request's answer."""

    def script(seen: Seen, engine: RawEngine) -> Action:
        return Action(
            answer(seen.body),
            after=b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n{forged",
        )

    async with RawEngine(script) as engine, running_router([_model(engine)]) as r:
        async with aiohttp.ClientSession() as http:
            for n in (1, 2):
                async with http.post(f"{r.url}{CHAT}", json=chat_body(f"q{n}")) as resp:
                    assert b'"q%d"' % n in await resp.read()
                await asyncio.sleep(0.2)  # the forged answer arrives while the connection idles
        first, second = engine.posts()
        assert first.connection != second.connection


async def test_an_answer_shorter_than_its_length_ends_the_clients_answer_early():
    async def short(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()

    async with RawEngine(lambda seen, e: Action(short, close=True)) as engine:
        async with running_router([_model(engine)]) as r, aiohttp.ClientSession() as http:
            async with http.post(f"{r.url}{CHAT}", json=chat_body()) as resp:
                assert resp.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.read()


async def test_a_request_the_engine_read_and_then_dropped_is_never_sent_again():
    """The proxy used to send a request again when a kept-alive connection closed with no
    byte back; but the engine may have read it (here it did, and would generate twice).
    Two engines: the request reaches one of them, once, and the client gets a clear 502."""

    def script(seen: Seen, engine: RawEngine) -> Action:
        if seen.number == 0:
            return _echo(seen, engine)  # keep-alive: the router reuses this connection
        return Action(close=True)  # read it whole, then drop the connection

    async with RawEngine(script) as a, RawEngine(script) as b:
        async with running_router([_model(a, b)]) as r, aiohttp.ClientSession() as http:
            conversation = chat_body("same conversation")  # same affinity: the same engine
            async with http.post(f"{r.url}{CHAT}", json=conversation) as resp:
                assert resp.status == 200
            async with http.post(f"{r.url}{CHAT}", json=conversation) as resp:
                status, error = resp.status, (await resp.json())["error"]
            m = await _metrics(r.url)
    seen = a.posts() + b.posts()
    assert len(seen) == 2, [(s.connection, s.number) for s in seen]
    assert seen[1].connection == seen[0].connection and seen[1].number == 1
    assert status == 502 and error["code"] == "engine_failed"
    assert "may have read the request, so it is not sent again" in error["message"]
    kind = [k for k in m if k.startswith("llmgw_router_errors_total") and "closed_before" in k]
    assert len(kind) == 1 and m[kind[0]] == 1
    assert not any(k.startswith("llmgw_router_retries_total{") and v for k, v in m.items())


async def test_an_ipv6_engine_gets_its_address_in_brackets_in_the_host_header():
    try:
        engine_cm = RawEngine(_echo, host="::1")
        engine = await engine_cm.__aenter__()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        async with running_router([_model(engine)]) as r, aiohttp.ClientSession() as http:
            async with http.post(f"{r.url}{CHAT}", json=chat_body()) as resp:
                assert resp.status == 200, await resp.text()
        assert engine.requests[0].headers[b"host"] == b"[::1]:%d" % engine.port
    finally:
        await engine_cm.__aexit__(None, None, None)


@pytest.mark.parametrize(
    "attack",
    [
        # CL.TE: the router reads a length, a chunked reader would see a second request
        b"content-length: 200\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        # TE.CL: the reverse
        b"transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
        # TE.TE: chunking said twice, once in a form some servers ignore
        b"transfer-encoding: chunked\r\ntransfer-encoding: identity\r\n\r\n0\r\n\r\n",
    ],
    ids=["CL.TE", "TE.CL", "TE.TE"],
)
async def test_request_smuggling_through_the_router_is_refused(attack):
    smuggled = _post(chat_body("smuggled"))
    async with RawEngine(_echo) as engine, running_router([_model(engine)]) as r:
        data = b"POST %s HTTP/1.1\r\nhost: r\r\n%s%s" % (CHAT.encode(), attack, smuggled)
        answers = await _client_answers(r.url, data, 1)
        assert answers[0].status == 400
        # nothing of it reached the engine (which the router asks only its slots meanwhile)
        assert engine.posts() == []
        async with aiohttp.ClientSession() as http:  # and the router serves on
            async with http.post(f"{r.url}{CHAT}", json=chat_body()) as resp:
                assert resp.status == 200
        assert len(engine.posts()) == 1 and b"smuggled" not in engine.posts()[0].body
