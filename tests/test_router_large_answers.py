"""Answers of several hundred KB through the router, past its buffer mark (256 KiB, where
reading from the engine pauses until the client takes what is held): chat, embeddings and
rerank from a real (fake) engine process, on reused and on fresh engine connections, with
and without keys, whole and streamed, to a client that reads at once, one that reads
slowly, and one that never reads. An embeddings batch is this size: the most common large
answer there is.

The router runs on uvloop here, as `llmgw router` does (cli/common.run_fast): uvloop reads
a socket several times over before any task runs, so an answer can pile up past the mark
before the relay starts. That is when it stalled: about 1 whole answer in 3 of ~400 KB sat
unread in the router until --engine-timeout, then went to the client as a 502 blaming the
engine, which had sent everything at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable

import aiohttp
import anyio
import pytest
from raw_engine import Action, RawEngine, Seen, answer
from router_helpers import SERVED, metric_by, router_settings, running_router, static_model
from test_router_gateway import _connect, _key, _place, _served
from test_router_server import Answers
from waiting import until

from llmgw import catalog
from llmgw.bus.client import Bus, NatsSettings
from llmgw.router.server import HttpLimits
from llmgw.router.upstream import UpstreamSettings

pytestmark = pytest.mark.anyio

MARK = UpstreamSettings().buffer_high
# short, so that a stalled answer shows as the 502 it was; a hang is bounded by HANG
ENGINE_TIMEOUT = 3.0
HANG = 30.0
ROUNDS = 6  # of each kind of answer: it stalled about one time in three
# the fake engine: as many tokens as a request asks for, generated at once, and embeddings
# of a real model's size (1,024 dimensions: ~10 KB each as JSON)
ENGINE_ENV = {
    "FAKE_ENGINE_TOKENS": "100000",
    "FAKE_ENGINE_TOKEN_RATE": "1e9",
    "FAKE_ENGINE_EMBEDDING_SIZE": "1024",
}


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"use_uvloop": True})  # the router's own loop (see the docstring)


# --- the answers: (path, request, count) each ~400 KB from the fake engine -----------------


def _chat(tokens: int) -> tuple[str, dict, Callable[[dict], int], int]:
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}]}
    return (
        "/v1/chat/completions",
        {**body, "max_tokens": tokens},
        lambda a: len(a["choices"][0]["message"]["content"].split()),
        tokens,
    )


def _embeddings(n: int) -> tuple[str, dict, Callable[[dict], int], int]:
    inputs = [f"passage {i}" for i in range(n)]
    return "/v1/embeddings", {"model": SERVED, "input": inputs}, lambda a: len(a["data"]), n


def _rerank(n: int) -> tuple[str, dict, Callable[[dict], int], int]:
    documents = [f"document {i}" for i in range(n)]
    return (
        "/v1/rerank",
        {"model": SERVED, "query": "which document", "documents": documents},
        lambda a: len(a["results"]),
        n,
    )


LARGE = {"chat": _chat(45_000), "embeddings": _embeddings(40), "rerank": _rerank(10_000)}


async def _whole(
    url: str, kind: str, *, fresh: bool = False, headers: dict[str, str] | None = None
) -> int:
    """One large answer of `kind`, read whole and checked; its size. `fresh`: on a client
    connection of its own (else the session's kept-alive one)."""
    path, body, count, want = LARGE[kind]
    connector = aiohttp.TCPConnector(force_close=fresh)
    with anyio.fail_after(HANG):
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.post(url + path, json=body, headers=headers) as resp,
        ):
            data = await resp.read()
    assert resp.status == 200, data[:300]
    assert count(json.loads(data)) == want
    return len(data)


async def _all_kinds_whole(url: str, headers: dict[str, str] | None = None) -> None:
    """Every kind, ROUNDS times one after another (one engine connection, reused) and then
    ROUNDS at once (new connections, from the client and to the engine), each whole and
    past the mark."""
    for kind in LARGE:
        for _ in range(ROUNDS):
            assert await _whole(url, kind, headers=headers) > MARK
        sizes = await asyncio.gather(
            *(_whole(url, kind, fresh=True, headers=headers) for _ in range(ROUNDS))
        )
        assert min(sizes) > MARK


async def _errors(url: str) -> dict[str, float]:
    """llmgw_router_errors_total by kind."""
    return await metric_by(url, "llmgw_router_errors_total", "kind")


def _settings():
    return router_settings(upstream=UpstreamSettings(read_timeout=ENGINE_TIMEOUT))


# --- whole answers, no keys and keys ----------------------------------------------------------


async def test_whole_answers_past_the_buffer_mark_arrive_whole_on_reused_and_fresh_connections(
    engines,
):
    """Chat, embeddings and rerank of ~400 KB, each kind six times on one engine connection
    and six at once on new ones: every answer whole, none a 502, nothing counted against
    the engine (it was: 1 in 3, after --engine-timeout)."""
    engine = engines.start(ENGINE_ENV)
    async with running_router([static_model(engine)], settings=_settings()) as r:
        await _all_kinds_whole(r.url)
        assert await _errors(r.url) == {}


@contextlib.asynccontextmanager
async def _keyed_router(nats_settings: NatsSettings, engine, bus: Bus) -> AsyncIterator:
    await _place(bus, engine)
    async with running_router(connect=_connect(nats_settings), settings=_settings()) as r:
        await until(lambda: _served(r), timeout=10)
        yield r


async def test_with_keys_whole_answers_past_the_buffer_mark_arrive_whole(
    engines, nats_settings, bus
):
    """The same through a router whose answers a key's ticket reads on the way (metered)."""
    engine = engines.start(ENGINE_ENV)
    secret = await _key(bus, "big-batches")
    async with _keyed_router(nats_settings, engine, bus) as r:
        auth = {"authorization": f"Bearer {secret}"}
        await until(lambda: _keys_required(r.url))
        await _all_kinds_whole(r.url, auth)
        assert await _errors(r.url) == {"unauthorized": 1}  # (the wait for the key above)


async def _keys_required(url: str) -> bool:
    """The router has read the key: a client without one is refused (until then, served)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as resp:
        return resp.status == 401


# --- an engine that closes its connection after each answer, and streams -----------------------


def _sse(n: int) -> bytes:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
    events = [event % (b"tok%d " % i + b"x" * 100) for i in range(n)] + [b"data: [DONE]\n\n"]
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


STREAM_EVENTS = 8_000  # ~1.2 MB
WHOLE = json.dumps({"data": ["x" * 100] * 10_000}).encode()  # ~1 MB


def _bursting(close: bool, whole: bytes = WHOLE):
    """An engine that writes each answer in one go, a stream as much as a whole one (a fast
    engine, or one that finished before its client asked), and closes the connection after
    each if `close`; its whole answer is `whole`."""
    head = b"connection: close\r\n" if close else b""

    def script(seen: Seen, engine: RawEngine) -> Action:
        if seen.method != b"POST":
            return Action(answer(b'{"status": "ok"}'))  # the router's health probe
        if json.loads(seen.body).get("stream"):
            reply = (
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n%s"
                b"transfer-encoding: chunked\r\n\r\n%s" % (head, _sse(STREAM_EVENTS))
            )
        else:
            reply = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%s"
                b"content-length: %d\r\n\r\n%s" % (head, len(whole), whole)
            )
        return Action(reply, close=close)

    return script


@pytest.mark.parametrize("close", [False, True], ids=["kept-alive", "closed-after-each"])
async def test_answers_written_at_once_past_the_mark_arrive_whole_streamed_or_not(close):
    """Whole answers and streams of ~1 MB that reach the router at once, on connections
    the engine keeps and on a new connection each: every one whole."""
    async with RawEngine(_bursting(close)) as engine:
        model = catalog.Model(id="tiny", served_name=SERVED, endpoints=[engine.url])
        # a connection that carried a stream carries the next request at once (not after
        # stream_settle): each answer on the connection the one before it left
        upstream = UpstreamSettings(read_timeout=ENGINE_TIMEOUT, stream_settle=0)
        async with running_router([model], settings=router_settings(upstream=upstream)) as r:
            async with aiohttp.ClientSession() as http:
                for stream in [False, True] * ROUNDS:
                    body = {"model": SERVED, "messages": [], "stream": stream}
                    with anyio.fail_after(HANG):
                        async with http.post(f"{r.url}/v1/chat/completions", json=body) as resp:
                            data = await resp.read()
                    assert resp.status == 200, data[:300]
                    if stream:
                        assert data.count(b"data: ") == STREAM_EVENTS + 1
                        assert data.endswith(b"data: [DONE]\n\n")
                    else:
                        assert data == WHOLE
            assert await _errors(r.url) == {}
        assert len(engine.posts()) == 2 * ROUNDS


# --- a client that reads slowly, and one that never reads ------------------------------------

# embeddings of ~8 MB: more than the kernel holds between the router and its client (the
# router's send buffer grows to 4 MiB on Linux), so a client's pace reaches the router
BIGGER_THAN_SOCKET_BUFFERS = 800


async def _raw_client(
    url: str, path: str, body: dict
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection with a small receive buffer (64 KiB, so the router's socket to it
    fills early; smaller, loopback TCP crawls), the request sent on it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=65536)
    data = json.dumps(body).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )
    return reader, writer


async def test_a_client_that_reads_slowly_gets_every_byte_and_the_engine_connection_serves_on(
    engines,
):
    """Answers of ~8 MB read 64 KiB a millisecond: the router's socket to the client fills,
    and reading from the engine pauses and resumes again and again. Both answers whole,
    the second on the engine connection the first left."""
    engine = engines.start(ENGINE_ENV)
    path, body, count, want = _embeddings(BIGGER_THAN_SOCKET_BUFFERS)
    async with running_router([static_model(engine)], settings=_settings()) as r:
        for _ in range(2):
            reader, writer = await _raw_client(r.url, path, body)
            answers = Answers()
            try:
                with anyio.fail_after(HANG):
                    while not (answers.items and answers.items[0].complete):
                        data = await reader.read(65536)
                        assert data, "the router closed the connection before the answer's end"
                        answers.feed(data)
                        await asyncio.sleep(0.001)
            finally:
                writer.close()
            answer = answers.items[0]
            assert answer.status == 200, answer.body[:300]
            assert count(json.loads(answer.body)) == want
            assert len(answer.body) > 4 * MARK
        assert await _errors(r.url) == {}
        assert r.proxy.pool.opened == 1  # (the probes have a pool of their own)


async def test_a_client_that_never_reads_is_closed_at_the_send_timeout_and_counted_as_its_own():
    """A client that takes none of an ~8 MB answer holds the engine back only until the
    send timeout, even with an engine timeout shorter than that (the engine is held back,
    not silent): its connection is closed and counted as the client's, the engine is not
    failed or ejected, and the next client is served whole. (An engine on raw sockets: its
    answer is there at once, so no silence of its own can be mistaken for the router's.)"""
    huge = json.dumps({"data": ["x" * 100] * 80_000}).encode()
    async with RawEngine(_bursting(close=False, whole=huge)) as engine:
        model = catalog.Model(id="tiny", served_name=SERVED, endpoints=[engine.url])
        settings = router_settings(
            upstream=UpstreamSettings(read_timeout=0.5), limits=HttpLimits(send_timeout=2.0)
        )
        async with running_router([model], settings=settings) as r:
            reader, writer = await _raw_client(r.url, "/v1/chat/completions", {"model": SERVED})
            try:
                errors = await until(lambda: _errors(r.url), timeout=HANG)
                assert errors == {"client_disconnect": 1}
                answers = Answers()
                with contextlib.suppress(ConnectionError):
                    while data := await reader.read(65536):
                        answers.feed(data)
                # cut: what it had not taken is gone
                assert not (answers.items and answers.items[0].complete)
            finally:
                writer.close()
            async with aiohttp.ClientSession() as http:
                body = {"model": SERVED}
                async with http.post(f"{r.url}/v1/chat/completions", json=body) as resp:
                    assert await resp.read() == huge
                async with http.get(f"{r.url}/metrics") as resp:
                    assert "llmgw_router_ejections_total{" not in await resp.text()
            assert await _errors(r.url) == {"client_disconnect": 1}
