"""The router's HTTP/1.1 server on raw sockets: framing, limits, keep-alive, pipelining,
100-continue, streaming and a client that leaves."""

from __future__ import annotations

import asyncio
import json

import pytest

from llmgw.router.server import HttpLimits, Request, Response, serve

pytestmark = pytest.mark.anyio


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class Echo:
    """Answers with the method, path and body; `/stream` streams three chunks; `/hang` waits
    until cancelled and records that it was."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def __call__(self, req: Request, resp: Response) -> None:
        if req.path == b"/stream":
            await resp.start(200, [(b"content-type", b"text/plain")], None)
            for part in (b"one ", b"two ", b"three"):
                await resp.write(part)
            await resp.end()
            return
        if req.path == b"/hang":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if req.path == b"/boom":
            raise RuntimeError("a bug")
        body = b"%s %s %s" % (req.method, req.path, req.body)
        await resp.send(200, body, content_type=b"text/plain")


async def _server(handler, **limits):
    server = await serve(handler, "127.0.0.1", 0, limits=HttpLimits(**limits), error_body=_error)
    port = server.sockets[0].getsockname()[1]
    return server, port


async def _exchange(port: int, data: bytes, *, until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        if until_close:
            return await asyncio.wait_for(reader.read(), 10)
        return await asyncio.wait_for(reader.read(65536), 10)
    finally:
        writer.close()


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    server, port = await _server(Echo())
    try:
        data = (
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
            b"POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
            b"GET /c HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        out = await _exchange(port, data)
        bodies = [part.split(b"\r\n\r\n", 1)[1][:20] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
        assert [b.split(b"HTTP")[0] for b in bodies] == [b"POST /a abc", b"POST /b de", b"GET /c "]
        assert out.count(b"HTTP/1.1 200") == 3
    finally:
        server.close()


async def test_streamed_answers_are_chunked_for_http11_and_close_delimited_for_http10():
    server, port = await _server(Echo())
    try:
        out = await _exchange(port, b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert b"transfer-encoding: chunked" in out
        assert out.endswith(b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n")
        out = await _exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        assert b"transfer-encoding" not in out and b"connection: close" in out
        assert out.endswith(b"\r\n\r\none two three")
    finally:
        server.close()


async def test_a_body_over_the_limit_is_refused_before_it_is_read():
    server, port = await _server(Echo(), max_body=100)
    try:
        # the client announces 10 MB and sends none of it: refused at once from the header
        out = await _exchange(
            port, b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 10000000\r\n\r\n"
        )
        assert out.startswith(b"HTTP/1.1 413 ") and b"over the limit of 100" in out
        chunked = b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        chunked += b"80\r\n" + b"x" * 128 + b"\r\n"
        out = await _exchange(port, chunked)
        assert out.startswith(b"HTTP/1.1 413 ")
    finally:
        server.close()


async def test_expect_100_continue_is_answered_then_the_body_read():
    server, port = await _server(Echo())
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
        )
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == (
            b"HTTP/1.1 100 Continue\r\n\r\n"
        )
        writer.write(b"hi")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert await reader.readexactly(len(b"POST /a hi")) == b"POST /a hi"
        writer.close()
    finally:
        server.close()


async def test_oversized_heads_and_garbage_are_refused_and_the_connection_closed():
    server, port = await _server(Echo(), max_head=1024, max_headers=5)
    try:
        big = b"GET /a HTTP/1.1\r\nhost: x\r\nx-big: " + b"y" * 2048 + b"\r\n\r\n"
        assert (await _exchange(port, big)).startswith(b"HTTP/1.1 431 ")
        many = b"GET /a HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(10)) + b"\r\n"
        assert (await _exchange(port, many)).startswith(b"HTTP/1.1 431 ")
        assert (await _exchange(port, b"\x16\x03\x01 not http\r\n\r\n")).startswith(
            b"HTTP/1.1 400 "
        )
    finally:
        server.close()


async def test_a_silent_client_is_closed_after_the_idle_timeout():
    server, port = await _server(Echo(), idle_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\n")  # never finishes its head
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
    finally:
        server.close()


async def test_a_client_that_leaves_cancels_its_handler():
    echo = Echo()
    server, port = await _server(echo)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hang HTTP/1.1\r\nhost: x\r\n\r\n")
        await asyncio.wait_for(echo.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(echo.cancelled.wait(), 5)
    finally:
        server.close()


async def test_a_handler_bug_answers_500_and_the_server_keeps_serving():
    server, port = await _server(Echo())
    try:
        out = await _exchange(port, b"GET /boom HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500 ")
        out = await _exchange(port, b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200 ")
    finally:
        server.close()
