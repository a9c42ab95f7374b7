"""A loopback TCP proxy between one client and nats-server, to break that client's link
alone: cut() closes its connections and refuses new ones (a reset, a reconnect follows);
stall() stops forwarding but keeps everything open (a partition: no reset, nothing
delivered, so no reconnect). Everyone else talks to the server directly, untouched."""

from __future__ import annotations

import asyncio

from llmgw.bus.server import free_port


class ProxyLink:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None
        self._streams: list[asyncio.StreamWriter] = []
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in self._streams:
            w.close()
        self._streams.clear()

    def stall(self) -> None:
        self._flowing.clear()

    async def heal(self) -> None:
        if self._server is None:
            await self.start()
        self._flowing.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._streams += [writer, up_w]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await self._flowing.wait()
                    data = await src.read(65536)
                    if not data:
                        break
                    await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
