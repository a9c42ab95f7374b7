"""Asking each engine's own /health in the background.

The bucket says what the agents last saw; the engine may have died since, or its node may
be cut off from NATS while still serving. An engine whose /health fails
takes no new requests until it answers below 500 again (llama-server answers 503 while
loading; vLLM 503 after its engine died; a static endpoint without /health answers 404). Failed requests eject an engine faster (balancer.py); this is what
brings a quiet one back, or takes away one no request has tried yet.
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.router.table import Backend, EndpointTable
from llmgw.router.upstream import ConnectFailed, UpstreamFailed, UpstreamPool

log = logging.getLogger(__name__)


class HealthProber:
    def __init__(
        self,
        table: EndpointTable,
        pool: UpstreamPool,
        *,
        interval: float = 5.0,
        timeout: float = 2.0,
    ) -> None:
        self.table = table
        self.pool = pool
        self.interval = interval
        self.timeout = timeout

    async def run(self) -> None:
        # An engine is taken as healthy when it appears (its agent saw it ready; a static
        # one proves otherwise on its first request, which is then retried elsewhere).
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - a bug here must not stop the router serving
                log.exception("router: health probes failed")

    async def probe_all(self) -> None:
        backends = [b for b in self.table.backends() if b.routable]
        if backends:
            await asyncio.gather(*(self.probe(b) for b in backends))

    async def probe(self, b: Backend) -> bool:
        ok, why = await self._ask(b)
        if ok != b.probe_ok:
            if ok:
                log.info("router: %s (%s) answers its health check again", b.id, b.address)
            else:
                log.warning("router: %s (%s) fails its health check: %s", b.id, b.address, why)
        b.probe_ok = ok
        return ok

    async def _ask(self, b: Backend) -> tuple[bool, str]:
        try:
            status, _ = await get(self.pool, b, b"/health", self.timeout, limit=0)
        except TimeoutError:
            return False, f"no answer within {self.timeout:g} s"
        except (ConnectFailed, UpstreamFailed) as e:
            return False, str(e)
        # 404: an OpenAI-compatible server without /health, up all the same
        return status < 500, f"/health answered {status}"


async def get(
    pool: UpstreamPool, b: Backend, path: bytes, timeout: float, limit: int
) -> tuple[int, bytes]:
    """GET `path` of an engine, its status and the first `limit` bytes of its body (the
    rest read and dropped); TimeoutError, ConnectFailed or UpstreamFailed when it fails."""
    request = b"GET %s%s HTTP/1.1\r\nhost: %s\r\n%s\r\n" % (
        b.path_prefix.encode(),
        path,
        b.host_header,
        b.auth,
    )
    conn = None
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            conn = await pool.send(b.host, b.port, request, tls=b.tls)
            status, _ = await conn.response_head()
            async for chunk in conn.body():
                if len(body) < limit:
                    body += chunk[: limit - len(body)]
    finally:
        if conn is not None:
            if conn.complete:
                pool.release(conn)
            else:
                conn.abort()
    return status, bytes(body)
