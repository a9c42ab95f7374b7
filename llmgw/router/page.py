"""The fleet page: `GET /` (the page), `/fleet/*` (its script and style) and
`/fleet/state` (the document it polls), read-only.

The files are package data (llmgw/router/static/), read once: no CDN, no build step, works
offline. The page polls `/fleet/state` every POLL_S seconds and redraws; its script sets
every string from the bucket as text (node names, model names and explanations are outside
input), and the Content-Security-Policy allows no inline script or style, so a value that
slipped into markup would still not run.

Reached only for paths the proxy does not route (llmgw/router/proxy.py asks it last), so
it costs the OpenAI routes nothing; its bucket reads run only while a page is open
(llmgw/router/fleet.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import anyio

from llmgw.fleetstate.decode import FleetRecords
from llmgw.router.fleet import FleetWatch, HistogramWindow, encode_state, fleet_state
from llmgw.router.fleet import local_load as router_load
from llmgw.router.server import Request, Response
from llmgw.router.table import EndpointTable

POLL_S = 2.0  # the page's poll interval (the script reads it from the document)
# the first request of an idle router waits this long for the bucket to be read
FIRST_READ_WAIT_S = 5.0
# a document built less than this ago is sent again: any number of open pages cost one build
REBUILD_AFTER_S = 0.5

_FILES = {
    b"/": ("fleet.html", b"text/html; charset=utf-8"),
    b"/fleet": ("fleet.html", b"text/html; charset=utf-8"),
    b"/fleet/fleet.js": ("fleet.js", b"text/javascript; charset=utf-8"),
    b"/fleet/fleet.css": ("fleet.css", b"text/css; charset=utf-8"),
}
STATE_PATH = b"/fleet/state"
_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
)


def _read(name: str) -> bytes:
    return (resources.files("llmgw.router") / "static" / name).read_bytes()


class FleetPage:
    def __init__(
        self,
        table: EndpointTable,
        ttfb_histogram,
        router_info: Callable[[], dict[str, Any]],
        watch: FleetWatch | None = None,
        waiting: Callable[[], dict[str, int]] = dict,
        queue_wait=None,
        queued: Callable[[], dict[tuple[str, str, str], int]] = dict,
    ) -> None:
        self.table = table
        self.watch = watch or FleetWatch()
        self._router_info = router_info
        self._waiting = waiting  # requests held per model, waiting for a replica
        self._ttfb = HistogramWindow(ttfb_histogram)
        # the router's queue: who waits now, and how long they waited (by model, class, team)
        self._queued = queued
        self._waits = (
            HistogramWindow(queue_wait, group=lambda s: (s["model"], s["class"], s["team"]))
            if queue_wait is not None
            else None
        )
        self._files = {path: (_read(name), kind) for path, (name, kind) in _FILES.items()}
        self._built: tuple[float, bytes] | None = None
        self._building = anyio.Lock()

    def serves(self, path: bytes) -> bool:
        return path in self._files or path == STATE_PATH

    @staticmethod
    def holds_data(path: bytes) -> bool:
        """Whether the answer at `path` tells of the fleet (the page's own files do not)."""
        return path == STATE_PATH

    async def handle(self, req: Request, resp: Response) -> None:
        if req.path == STATE_PATH:
            body, kind = await self.state(), b"application/json"
        else:
            body, kind = self._files[req.path]
        await resp.send(200, body, content_type=kind, headers=_HEADERS)

    async def state(self) -> bytes:
        info = self._router_info()
        # a router-only run (a catalog file) has no bucket to read: its table is all
        synced = info.get("source") != "nats" or await self.watch.wanted(FIRST_READ_WAIT_S)
        async with self._building:
            now = time.monotonic()
            if self._built is not None and now - self._built[0] < REBUILD_AFTER_S:
                return self._built[1]
            records = self._records()
            load = router_load(
                list(self.table.backends()),
                self._ttfb.sample(now),
                self._waiting(),
                self._queued(),
                self._waits.sample(now) if self._waits is not None else None,
            )
            info = {**info, "fleet_read": synced, "poll_s": POLL_S}
            body = await anyio.to_thread.run_sync(
                lambda: encode_state(fleet_state(records, load, time.time(), info))
            )
            self._built = (now, body)
            return body

    def _records(self) -> FleetRecords:
        """Shallow copies, taken on the event loop: the watches and the table change the
        dicts, never the records in them, so a worker thread can read the copies."""
        w, t = self.watch.records, self.table.records
        return FleetRecords(
            nodes=dict(w.nodes),
            leases=dict(w.leases),
            ops=dict(w.ops),
            fabrics=dict(w.fabrics),
            loads=dict(w.loads),
            catalog=dict(t.catalog),
            desired=dict(t.desired),
            health=dict(t.health),
            replicas=dict(t.replicas),
            shards=dict(t.shards),
            placements=dict(t.placements),
            scales=dict(t.scales),
            unreadable={**t.unreadable, **w.unreadable},
        )
