"""An engine on raw sockets, scripted by the test, for what a real engine rarely does on
purpose: answers framed wrong, bytes out of turn, a connection dropped after reading a
request. It runs in the test's event loop and records every request it read, with the
connection it came on, so a test can tell how often an engine really saw a request.

    async with RawEngine(script) as engine:       # script(request, engine) -> an Action
        ...engine.url, engine.requests...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httptools


@dataclass
class Seen:
    """A request the engine read whole."""

    connection: int  # which of the engine's connections it came on (0, 1, ...)
    number: int  # its place on that connection (0, 1, ...)
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes
    header_lines: list[tuple[bytes, bytes]] = field(default_factory=list)  # all, in order


@dataclass
class Action:
    """What the engine does with one request: write `reply` (bytes, or an async callable
    that writes itself), then close the connection if `close`."""

    reply: bytes | Callable[[asyncio.StreamWriter], Awaitable[None]] = b""
    close: bool = False
    after: bytes = b""  # written `after_delay` seconds after the reply: bytes out of turn
    after_delay: float = 0.05


Script = Callable[[Seen, "RawEngine"], Action]


def answer(body: bytes, status: int = 200, *, headers: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        headers,
        body,
    )


class _Reader:
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[tuple[bytes, bytes, dict[bytes, bytes], bytes, list]] = []
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._lines: list[tuple[bytes, bytes]] = []
        self._body = b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value
        self._lines.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append(
            (self.parser.get_method(), self._url, self._headers, self._body, self._lines)
        )
        self._url, self._headers, self._body, self._lines = b"", {}, b"", []


@dataclass
class RawEngine:
    script: Script
    host: str = "127.0.0.1"
    requests: list[Seen] = field(default_factory=list)
    connections: int = 0
    _server: asyncio.AbstractServer | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def endpoint(self) -> str:
        """host:port, as a shard record names its engine."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def posts(self) -> list[Seen]:
        """The requests it read, but for the router's health probes."""
        return [r for r in self.requests if r.method == b"POST"]

    async def __aenter__(self) -> RawEngine:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        conn, self.connections = self.connections, self.connections + 1
        parsed = _Reader()
        number = 0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                parsed.parser.feed_data(data)
                while parsed.done:
                    method, path, headers, body, lines = parsed.done.pop(0)
                    seen = Seen(conn, number, method, path, headers, body, lines)
                    number += 1
                    self.requests.append(seen)
                    action = self.script(seen, self)
                    if callable(action.reply):
                        await action.reply(writer)
                    else:
                        writer.write(action.reply)
                        await writer.drain()
                    if action.after:
                        await asyncio.sleep(action.after_delay)
                        writer.write(action.after)
                    if action.close:
                        return
        except (ConnectionError, httptools.HttpParserError, asyncio.CancelledError):
            return  # (a cancelled handler that returns keeps asyncio's streams quiet)
        finally:
            writer.close()
            self._tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
