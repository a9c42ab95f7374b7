"""The router's HTTP/1.1 server on raw sockets: a conformance suite written for our server
from the cases uvicorn's and h11's suites cover. Framing (204/304/HEAD, declared lengths),
100-continue, Upgrade and CONNECT, limits on request lines, heads, single headers and
pipelined bodies, the framings request smuggling uses, HTTP/1.0 keep-alive, pipelining,
idle and send timeouts, a connection cap, and a graceful shutdown."""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest

from llmgw.router.server import HttpLimits, Request, Response, serve

pytestmark = pytest.mark.anyio


def _error(status: int, message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class App:
    """Answers with the method, path and body. Other paths:
    /stream: three chunks; /slow: two chunks 0.3 s apart; /hang: waits until released
    (or cancelled, which it records); /boom: a bug; /conn-error: a ConnectionError with the
    client still there; /204, /304: no content; /short: declares 10 bytes, writes 5;
    /long: declares 3 bytes, writes 6; /endless: streams until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.seen: list[bytes] = []

    async def __call__(self, req: Request, resp: Response) -> None:
        self.seen.append(req.path)
        path = req.path
        if path == b"/stream":
            await resp.start(200, [(b"content-type", b"text/plain")], None)
            for part in (b"one ", b"two ", b"three"):
                await resp.write(part)
            await resp.end()
        elif path == b"/slow":
            await resp.start(200, [(b"content-type", b"text/plain")], None)
            resp.flush()
            await resp.write(b"first ")
            await asyncio.sleep(0.3)
            await resp.write(b"second")
            await resp.end()
        elif path in (b"/hang", b"/endless"):
            self.started.set()
            try:
                if path == b"/hang":
                    await self.release.wait()
                    await resp.send(200, b"released", content_type=b"text/plain")
                    return
                await resp.start(200, [(b"content-type", b"text/plain")], None)
                while True:
                    await resp.write(b"x" * 65536)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        elif path == b"/boom":
            raise RuntimeError("a bug")
        elif path == b"/conn-error":
            raise ConnectionResetError("an upstream's error that escaped")
        elif path in (b"/204", b"/304"):
            await resp.start(int(path[1:]), [(b"x-a", b"1")], None)
            await resp.write(b"must not be sent")
            await resp.end()
        elif path == b"/short":
            await resp.start(200, [], 10)
            await resp.write(b"12345")
            await resp.end()
        elif path == b"/long":
            await resp.start(200, [], 3)
            await resp.write(b"abcdef")
            await resp.end()
        else:
            await resp.send(
                200, b"%s %s %s" % (req.method, req.path, req.body), content_type=b"text/plain"
            )


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.complete = False


class Answers:
    """Splits what a connection receives into answers, as a client's parser would."""

    def __init__(self) -> None:
        self.items: list[Answer] = []
        self.parser = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.items.append(Answer())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.items[-1].headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.items[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.items[-1].body += body

    def on_message_complete(self) -> None:
        self.items[-1].complete = True


async def _server(app=None, **limits):
    server = await serve(
        app or App(), "127.0.0.1", 0, limits=HttpLimits(**limits), error_body=_error
    )
    return server, server.sockets[0].getsockname()[1]


async def _exchange(port: int, data: bytes) -> bytes:
    """Send `data`, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def _answers(port: int, data: bytes) -> list[Answer]:
    parsed = Answers()
    parsed.feed(await _exchange(port, data))
    return parsed.items


async def _read_answers(reader: asyncio.StreamReader, n: int, parsed: Answers) -> None:
    while sum(a.complete for a in parsed.items) < n:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, f"closed after {len(parsed.items)} answers"
        parsed.feed(data)


def _get(path: bytes, *extra: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: x\r\n%s\r\n" % (path, b"".join(e + b"\r\n" for e in extra))


# --- keep-alive, pipelining, framing of the answers ------------------------------------------


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    server, port = await _server()
    try:
        data = (
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
            b"POST /b HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\nde\r\n0\r\n\r\n"
            + _get(b"/c", b"connection: close")
        )
        answers = await _answers(port, data)
        assert [a.body for a in answers] == [b"POST /a abc", b"POST /b de", b"GET /c "]
    finally:
        server.close()


async def test_streamed_answers_are_chunked_for_http11_and_close_delimited_for_http10():
    server, port = await _server()
    try:
        out = await _exchange(port, _get(b"/stream", b"connection: close"))
        assert b"transfer-encoding: chunked" in out
        assert out.endswith(b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n")
        out = await _exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
        assert b"transfer-encoding" not in out and b"connection: close" in out
        assert out.endswith(b"\r\n\r\none two three")
    finally:
        server.close()


@pytest.mark.parametrize("status", [204, 304])
async def test_no_content_and_not_modified_answers_have_no_body_and_no_chunking(status):
    """A 204 or 304 relayed with chunked framing put a `0\\r\\n\\r\\n` on the wire that the
    client read as the start of the next answer."""
    server, port = await _server()
    try:
        out = await _exchange(port, _get(b"/%d" % status) + _get(b"/next", b"connection: close"))
        first, rest = out.split(b"\r\n\r\n", 1)
        assert first.startswith(b"HTTP/1.1 %d " % status)
        assert b"transfer-encoding" not in first and b"content-length" not in first
        assert rest.startswith(b"HTTP/1.1 200 "), rest[:40]  # nothing between the two
        assert rest.endswith(b"GET /next ")
    finally:
        server.close()


async def test_head_answers_say_the_length_and_send_no_body():
    server, port = await _server()
    try:
        out = await _exchange(
            port,
            b"HEAD /a HTTP/1.1\r\nhost: x\r\n\r\n" + _get(b"/stream", b"connection: close"),
        )
        head, rest = out.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: 8" in head  # "HEAD /a "
        assert rest.startswith(b"HTTP/1.1 200 ")  # no body in between
        stream_head, stream_rest = out.split(b"\r\n\r\n")[1:3]
        assert stream_rest.startswith(b"4\r\none ")
        out = await _exchange(
            port, b"HEAD /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        head, body = out.split(b"\r\n\r\n", 1)
        assert b"transfer-encoding" not in head and body == b""
    finally:
        server.close()


async def test_an_answer_shorter_than_its_length_closes_the_connection():
    """The client learns the answer is incomplete: it ends before its length, with the
    connection (a kept-alive connection would leave it waiting for 5 more bytes)."""
    server, port = await _server()
    try:
        out = await _exchange(port, _get(b"/short") + _get(b"/never"))
        assert out.endswith(b"\r\n\r\n12345")  # then closed: /never is not answered
    finally:
        server.close()


async def test_an_answer_longer_than_its_length_is_counted_and_never_passes_for_complete():
    """A handler's bug: cut to its length, the answer would look whole to the client. It
    ends short instead, with the connection (the next request is not answered on it), and
    the server counts it for the router's metric."""
    told = []
    server = await serve(
        App(),
        "127.0.0.1",
        0,
        limits=HttpLimits(),
        error_body=_error,
        on_overrun=lambda: told.append(1),
    )
    port = server.sockets[0].getsockname()[1]
    try:
        answers = await _answers(port, _get(b"/long") + _get(b"/next"))
        assert [(a.status, a.complete) for a in answers] == [(200, False)]
        assert answers[0].headers[b"content-length"] == b"3"
        assert (server.overruns, told) == (1, [1])
    finally:
        server.close()


# --- 100-continue -------------------------------------------------------------------------------


async def test_expect_100_continue_is_answered_then_the_body_read():
    server, port = await _server()
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


async def test_an_expectation_other_than_100_continue_gets_417():
    server, port = await _server()
    try:
        out = await _exchange(
            port, b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 200-ok\r\n\r\nhi"
        )
        assert out.startswith(b"HTTP/1.1 417 ") and b"100-continue" in out
    finally:
        server.close()


async def test_a_body_over_the_limit_gets_413_and_no_100_continue():
    server, port = await _server(max_body=100)
    try:
        out = await _exchange(
            port,
            b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\nexpect: 100-continue\r\n\r\n",
        )
        assert out.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in out
    finally:
        server.close()


async def test_a_pipelined_100_continue_waits_for_the_answer_before_it():
    """Written from the parser callback, the 100 landed inside the previous request's
    streamed answer; it belongs to its own request's turn."""
    server, port = await _server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            _get(b"/slow")
            + b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
        )
        received = b""
        while b"100 Continue" not in received:
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data
            received += data
        # the whole streamed answer came first, then the 100
        slow, after = received.split(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert slow.endswith(b"0\r\n\r\n") and b"second" in slow and after == b""
        writer.write(b"ok")
        parsed = Answers()
        await _read_answers(reader, 1, parsed)
        assert parsed.items[0].body == b"POST /b ok"
        writer.close()
    finally:
        server.close()


# --- Upgrade and CONNECT ----------------------------------------------------------------------


async def test_an_h2c_upgrade_is_ignored_and_the_request_answered_over_http11():
    """What `curl --http2` sends on http://: it got its 200 and then an unsolicited 501."""
    server, port = await _server()
    try:
        h2c = _get(
            b"/a",
            b"connection: Upgrade, HTTP2-Settings",
            b"upgrade: h2c",
            b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA",
        )
        answers = await _answers(port, h2c + _get(b"/b", b"connection: close"))
        assert [(a.status, a.body) for a in answers] == [(200, b"GET /a "), (200, b"GET /b ")]
        ws = _get(b"/ws", b"connection: upgrade", b"upgrade: websocket", b"connection: close")
        answers = await _answers(port, ws)
        assert [(a.status, a.body) for a in answers] == [(200, b"GET /ws ")]
    finally:
        server.close()


async def test_connect_is_answered_and_the_connection_closed():
    server, port = await _server()
    try:
        out = await _exchange(port, b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n\x16\x03\x01tls")
        assert out.startswith(b"HTTP/1.1 200 ") and b"connection: close" in out
        assert out.count(b"HTTP/1.1") == 1  # the tunnel's bytes are not read as a request
    finally:
        server.close()


# --- limits ----------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_refused_before_it_is_read():
    server, port = await _server(max_body=100)
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


async def test_oversized_heads_and_garbage_are_refused_and_the_connection_closed():
    server, port = await _server(max_head=1024, max_headers=5)
    try:
        big = _get(b"/a", b"x-big: " + b"y" * 2048)
        assert (await _exchange(port, big)).startswith(b"HTTP/1.1 431 ")
        many = _get(b"/a", *(b"h%d: v" % i for i in range(10)))
        assert (await _exchange(port, many)).startswith(b"HTTP/1.1 431 ")
        long_target = b"GET /" + b"a" * 2048 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
        assert (await _exchange(port, long_target)).startswith(b"HTTP/1.1 414 ")
        assert (await _exchange(port, b"\x16\x03\x01 not http\r\n\r\n")).startswith(
            b"HTTP/1.1 400 "
        )
    finally:
        server.close()


async def test_a_header_that_never_ends_is_refused_once_it_passes_the_limit():
    """httptools holds a header value until it is complete before calling back: one
    connection sent 297 MiB of a single header and the router grew by 300 MB. The raw bytes
    of a head are counted as they arrive; the 431 comes without the header ever ending."""
    server, port = await _server(max_head=64 * 1024)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\nx-endless: ")
        for _ in range(2):
            writer.write(b"a" * 48 * 1024)  # 96 KiB, never a line end
            await writer.drain()
            await asyncio.sleep(0.05)  # arriving in pieces, as a slow sender's would
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 431 ")
        writer.close()
    finally:
        server.close()


@pytest.mark.parametrize(
    "request_bytes",
    [
        # CL.CL: two lengths
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        # CL.TE: a length beside chunking
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n",
        # TE.TE: chunking twice, once obfuscated
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ntransfer-encoding: x\r\n\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding : chunked\r\n\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: xchunked\r\n\r\n0\r\n\r\n",
        # obs-fold
        b"GET /a HTTP/1.1\r\nhost: x\r\nx-a: one\r\n two\r\n\r\n",
        # bad chunk sizes
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n-1\r\nab\r\n0\r\n\r\n",
        b"POST /a HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffffff\r\nab\r\n",
        # signed or spaced lengths, bare LF, NUL in a value
        b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: +3\r\n\r\nabc",
        b"GET /a HTTP/1.1\nhost: x\n\n",
        b"GET /a HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\n\r\n",
    ],
    ids=[
        "two-lengths",
        "length-and-chunked",
        "chunked-twice",
        "space-before-colon",
        "xchunked",
        "obs-fold",
        "chunk-size-zz",
        "chunk-size-negative",
        "chunk-size-overflow",
        "length-signed",
        "bare-lf",
        "nul-in-value",
    ],
)
async def test_framings_request_smuggling_uses_are_refused(request_bytes):
    app = App()
    server, port = await _server(app)
    try:
        out = await _exchange(port, request_bytes)
        assert out.startswith(b"HTTP/1.1 400 "), out[:80]
        assert b"connection: close" in out and out.count(b"HTTP/1.1 ") == 1
        assert app.seen == []  # no handler ran: nothing went further
    finally:
        server.close()


async def test_pipelined_bodies_are_bounded_in_bytes():
    """One connection could buffer 17 x 16 MiB of pipelined bodies behind a busy answer:
    past max_pipelined_bytes the server stops reading, so the client's writes stall."""
    app = App()
    server, port = await _server(app, max_pipelined_bytes=1 << 20)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get(b"/hang"))
        await asyncio.wait_for(app.started.wait(), 5)
        body = b"x" * (1 << 20)
        post = b"POST /p HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        for _ in range(40):  # 40 MiB: more than every socket buffer on the way holds
            writer.write(post)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(writer.drain(), 1.5)
        app.release.set()
        parsed = Answers()  # read while writing: every body comes back in its answer
        await asyncio.gather(writer.drain(), _read_answers(reader, 41, parsed))
        assert parsed.items[0].body == b"released"
        assert all(a.body.startswith(b"POST /p xxx") for a in parsed.items[1:])
        writer.close()
    finally:
        server.close()


async def test_a_full_server_closes_its_oldest_idle_connection_then_refuses_with_503():
    app = App()
    server, port = await _server(app, max_connections=2)
    try:
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(_get(b"/one"))
        await _read_answers(r1, 1, Answers())  # idle, kept alive
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(_get(b"/hang"))
        await asyncio.wait_for(app.started.wait(), 5)  # busy
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        w3.write(_get(b"/three"))
        parsed = Answers()
        await _read_answers(r3, 1, parsed)
        assert parsed.items[0].body == b"GET /three "
        assert await asyncio.wait_for(r1.read(), 5) == b""  # the idle one made room
        # now both held connections are in use (one hangs, one is mid-request): refused
        w3.write(b"GET /four HTTP/1.1\r\n")  # an unfinished request: not idle
        await asyncio.sleep(0.1)
        r4, w4 = await asyncio.open_connection("127.0.0.1", port)
        out = await asyncio.wait_for(r4.read(), 5)
        assert out.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in out
        assert server.refused == 1
        app.release.set()
        await _read_answers(r2, 1, Answers())
        for w in (w1, w2, w3, w4):
            w.close()
    finally:
        server.close()


# --- HTTP/1.0 ----------------------------------------------------------------------------------


async def test_http10_keep_alive_is_answered_in_kind_and_kept():
    server, port = await _server()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        parsed = Answers()
        writer.write(b"GET /a HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        await _read_answers(reader, 1, parsed)
        assert parsed.items[0].headers.get(b"connection") == b"keep-alive"
        writer.write(b"GET /b HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        await _read_answers(reader, 2, parsed)
        assert parsed.items[1].body == b"GET /b "
        writer.close()
        out = await _exchange(port, b"GET /c HTTP/1.0\r\n\r\n")  # no keep-alive: closed after
        assert b"connection: close" in out and out.endswith(b"GET /c ")
    finally:
        server.close()


# --- timeouts, handler failures, clients that leave ---------------------------------------------


async def test_a_silent_client_is_closed_after_the_idle_timeout():
    server, port = await _server(idle_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get(b"/a"))
        await _read_answers(reader, 1, Answers())  # then silent, keeping the connection
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        writer.close()
    finally:
        server.close()


async def test_a_head_that_does_not_arrive_in_time_closes_the_connection():
    """A slow head (slowloris) is not idle, so a full server could not take its connection
    back: it must be whole within head_timeout of its first byte, however long keep-alive is."""
    server, port = await _server(idle_timeout=60, head_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = asyncio.get_running_loop().time()
        writer.write(b"GET /a HTTP/1.1\r\n")
        await writer.drain()
        writer.write(b"host: x\r\n")  # a byte now and then, never the end
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert asyncio.get_running_loop().time() - started < 5
        writer.close()
    finally:
        server.close()


async def test_a_client_that_stops_reading_is_closed_after_the_send_timeout():
    """A client that never reads, and never closes, held its engine slot forever."""
    app = App()
    server, port = await _server(app, send_timeout=0.5)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get(b"/endless"))  # then reads nothing
        await asyncio.wait_for(app.started.wait(), 5)
        await asyncio.wait_for(app.cancelled.wait(), 10)
        writer.close()
    finally:
        server.close()


async def test_a_client_that_leaves_cancels_its_handler():
    app = App()
    server, port = await _server(app)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get(b"/hang"))
        await asyncio.wait_for(app.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
    finally:
        server.close()


@pytest.mark.parametrize("path", [b"/boom", b"/conn-error"])
async def test_a_handler_failure_answers_500_and_the_server_keeps_serving(path):
    """A ConnectionError raised while the client is still there is a bug like any other:
    it used to leave the connection open and mute."""
    server, port = await _server()
    try:
        out = await _exchange(port, _get(path, b"connection: close"))
        assert out.startswith(b"HTTP/1.1 500 ")
        out = await _exchange(port, _get(b"/ok", b"connection: close"))
        assert out.startswith(b"HTTP/1.1 200 ")
    finally:
        server.close()


# --- shutting down -------------------------------------------------------------------------------


async def test_shutdown_closes_idle_connections_lets_answers_finish_and_refuses_new_ones():
    app = App()
    server, port = await _server(app)
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    idle_w.write(_get(b"/a"))
    await _read_answers(idle_r, 1, Answers())
    busy_r, busy_w = await asyncio.open_connection("127.0.0.1", port)
    busy_w.write(_get(b"/hang"))
    await asyncio.wait_for(app.started.wait(), 5)
    stream_r, stream_w = await asyncio.open_connection("127.0.0.1", port)
    stream_w.write(_get(b"/slow"))
    assert (await asyncio.wait_for(stream_r.readuntil(b"first "), 5)).startswith(b"HTTP/1.1 200")

    shutdown = asyncio.ensure_future(server.shutdown(grace=10))
    assert await asyncio.wait_for(idle_r.read(), 5) == b""  # idle: closed at once
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)  # no longer accepting
    rest = await asyncio.wait_for(stream_r.read(), 5)  # the stream ends whole, then closes
    assert rest.endswith(b"6\r\nsecond\r\n0\r\n\r\n")
    assert not shutdown.done()
    app.release.set()  # the hanging answer, not begun when the shutdown came, says close
    out = await asyncio.wait_for(busy_r.read(), 5)
    assert out.startswith(b"HTTP/1.1 200 ") and b"connection: close" in out
    assert await asyncio.wait_for(shutdown, 5) == 0
    for w in (idle_w, busy_w, stream_w):
        w.close()


async def test_shutdown_cuts_what_is_still_running_when_the_grace_is_over():
    app = App()
    server, port = await _server(app)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_get(b"/hang"))
    await asyncio.wait_for(app.started.wait(), 5)
    assert await asyncio.wait_for(server.shutdown(grace=0.3), 5) == 1
    assert app.cancelled.is_set()  # its handler was cancelled, and had finished, by then
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_pipelined_head_that_stalls_behind_an_answer_still_times_out():
    app = App()
    server, port = await _server(app, idle_timeout=60, head_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_get(b"/slow") + b"GET /b HTTP/1.1\r\n")  # the second head never ends
        out = await asyncio.wait_for(reader.read(), 5)
        assert out.endswith(b"6\r\nsecond\r\n0\r\n\r\n")  # the first answered, then closed
        writer.close()
    finally:
        server.close()
