"""`GET /metrics` for the controller and the agent: one prometheus_client registry, served
by a small aiohttp listener in the component's own event loop.

The router serves its /metrics from its own HTTP server (llmgw/router/proxy.py); the
controller and the agent have no HTTP server of their own, so each gets this one when
configured (`llmgw controller --metrics-listen`, the agent's `metrics.listen`). Off unless
given an address: a fleet's nodes open no port nobody asked for, and the documented ports
(9464 the agent, 9465 the controller) go in the systemd units (deploy/).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable

import anyio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

AGENT_PORT = 9464
CONTROLLER_PORT = 9465
# seconds between tries of a metrics address another program holds
METRICS_RETRY_S = 30.0


class MetricsListenError(LlmgwError, ValueError):
    """A metrics address that does not parse, or cannot be listened on."""


class MetricsPortUnavailable(MetricsListenError):
    """An address that parses but cannot be listened on: another program holds it
    (`in_use`), or it is no address of this host."""

    def __init__(self, message: str, *, host: str, port: int, in_use: bool, reason: str) -> None:
        super().__init__(message)
        self.host, self.port, self.in_use, self.reason = host, port, in_use, reason


def parse_listen(value: str, what: str) -> tuple[str, int]:
    """ "HOST:PORT" (IPv6 in brackets) as (host, port); `what` names the setting in errors."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise MetricsListenError(
            f"{what} {value!r}: expected HOST:PORT, e.g. 0.0.0.0:{AGENT_PORT} (empty: no /metrics)"
        )
    return host.strip("[]") or "0.0.0.0", int(port)


async def serve_metrics(
    registry: CollectorRegistry,
    listen: tuple[str, int],
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `registry` at http://HOST:PORT/metrics until cancelled; reports the port bound
    (PORT 0 picks a free one)."""
    from aiohttp import web  # only when asked for: a fifth of a second of every start

    content_type = CONTENT_TYPE_LATEST.split(";")[0]

    async def metrics(_: web.Request) -> web.Response:
        # collecting reads the component's in-memory view: cheap, and only when scraped
        return web.Response(
            body=generate_latest(registry), content_type=content_type, charset="utf-8"
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    host, port = listen
    site = web.TCPSite(runner, host, port)
    try:
        try:
            await site.start()
        except OSError as e:
            raise MetricsPortUnavailable(
                f"cannot serve /metrics on {host}:{port}: {e.strerror or e}; choose another "
                "address, or none",
                host=host,
                port=port,
                in_use=e.errno == errno.EADDRINUSE,
                reason=e.strerror or str(e),
            ) from None
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("metrics at http://%s:%d/metrics", host, bound)
        task_status.started(bound)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()


def port_problem(e: MetricsPortUnavailable, fix: str) -> str:
    """One line for an address that cannot be listened on: which, why, and `fix` (the
    setting that moves it)."""
    where = f"[{e.host}]:{e.port}" if ":" in e.host else f"{e.host}:{e.port}"
    what = "is in use by another program" if e.in_use else f"cannot be listened on ({e.reason})"
    return f"metrics port {where} {what}; {fix}"


class MetricsEndpoint:
    """/metrics for a component whose job is elsewhere (the agent's is running engines, the
    controller's placement): an address another program holds must never take it out of
    service (the agent exited right after registering, the controller at start). It is
    said loudly, in the log and through `on_change` (the agent's nodes.<id> metrics_error,
    which `llmgw status` shows), and tried again every METRICS_RETRY_S until it is free.
    `port` is the one bound while served, `error` the line while not."""

    def __init__(
        self,
        registry: CollectorRegistry,
        listen: tuple[str, int],
        *,
        fix: str,
        who: str,
        on_change: Callable[[str | None], Awaitable[None]] | None = None,
    ) -> None:
        self.registry, self.listen, self.fix, self.who = registry, listen, fix, who
        self.on_change = on_change
        self.port: int | None = None
        self.error: str | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED):
        """Serve until cancelled; started at once, whether the address was free or not."""
        started = False
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    self.port = await tg.start(serve_metrics, self.registry, self.listen)
                except MetricsPortUnavailable as e:
                    problem = port_problem(e, self.fix)
                    if self.error != problem:
                        log.error("%s (%s serves on without /metrics)", problem, self.who)
                    await self._set(problem)
                    if not started:
                        started = True
                        task_status.started()
                    await anyio.sleep(METRICS_RETRY_S)
                    continue
                if self.error is not None:
                    log.info("metrics: %s:%d is free again; /metrics served", *self.listen)
                await self._set(None)
                if not started:
                    task_status.started()
                return  # serve_metrics runs until cancelled

    async def _set(self, problem: str | None) -> None:
        if self.error == problem:
            return
        self.error = problem
        if self.on_change is not None:
            await self.on_change(problem)
