"""Requests held for a cold model: an autoscaled model with no ready replica (scaled to
zero, or its first replica still loading).

Such a request is not refused: the router counts it as waiting in its load (which asks
the leader for a replica at once, router/load.py) and holds it until the endpoint table
shows a replica that takes requests, then sends it like any other (a stream starts when
the engine's does). The table is fed by the router's watch of the bucket, and a held
request looks at the table again at every change of it, so none is lost between "the
replica is ready" and "the router knows": it is sent on the change that makes it known.

Bounded per model: at most `max_held` requests (one more gets 429: the router's queue is
full), each for at most `max_wait` seconds (the model's `autoscale.hold_max` and
`hold_timeout` where its catalog entry sets them, else the router's settings), or less when the client says so with the
`x-llmgw-max-wait: SECONDS` header (0: do not wait). A request that cannot wait gets 503
with `Retry-After` from the model's last measured load time (`scale.<model>.load_s`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.router.load import LoadCounter
from llmgw.router.refusal import Refusal, retry_after
from llmgw.router.table import Backend, EndpointTable, Route

MAX_WAIT_HEADER = b"x-llmgw-max-wait"
# Retry-After for a model whose load time was never measured
UNMEASURED_LOAD_S = 30.0
# Retry-After for a request held when the router shuts down: another router takes it now
SHUTDOWN_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class HoldSettings:
    max_held: int = 256  # requests held per model; one more gets 429
    max_wait: float = 300.0  # seconds a request is held at most; then 503


class Holds:
    """The one place that decides whether a request that found no engine may wait for a
    cold model, and for how long (`patience`), and that holds it (`hold`)."""

    def __init__(self, table: EndpointTable, load: LoadCounter, settings: HoldSettings) -> None:
        self.table = table
        self.load = load
        self.settings = settings
        self.held: dict[str, int] = {}  # model -> requests held now
        self.stopping = False  # the router shuts down: nothing waits any more
        self._changed = asyncio.Event()

    def changed(self) -> None:
        """The table changed: every held request looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def stop(self) -> None:
        """The router is shutting down: every held request is answered now (503, retry)
        instead of waiting out the grace for a replica and getting a bare EOF. None of
        them reached an engine, so none is lost by it."""
        self.stopping = True
        self.changed()

    def retry_after(self, model: str) -> int:
        load_s = self.table.load_seconds(model) or UNMEASURED_LOAD_S
        return max(1, math.ceil(load_s))

    def patience(
        self, served_name: str, model: str, max_wait_header: bytes | None
    ) -> float | Refusal | None:
        """How long a request for `model` that found no engine may wait for one (seconds);
        a Refusal when it may not; None when the model is not autoscaled (no replica comes
        by itself: the caller refuses at once). A request refused here still asks the
        leader for a replica (its load says one waits)."""
        if not self.table.autoscaled(model):
            return None
        if self.stopping:
            return self._shutting_down(served_name, model)
        own_max, own_wait = self.table.hold_bounds(model)
        max_held = own_max or self.settings.max_held
        wait = own_wait or self.settings.max_wait
        asked = client_wait(max_wait_header)
        if asked is not None:
            wait = min(wait, asked)
        if wait <= 0:
            self.load.asked(model)
            return self._cannot_wait(
                model, served_name, f"the client does not wait ({MAX_WAIT_HEADER.decode()})"
            )
        if self.held.get(model, 0) >= max_held:
            self.load.asked(model)
            after = self.retry_after(model)
            return Refusal(
                429,
                f"model {served_name!r} is cold and the router already holds "
                f"{max_held} requests for it (its hold queue is full); retry after {after} s",
                code="hold_queue_full",
                kind="no_replica",
                model=model,
                headers=retry_after(after),
            )
        return wait

    async def hold(
        self,
        served_name: str,
        model: str,
        max_wait_header: bytes | None,
        pick: Callable[[Route], Backend | None],
    ) -> tuple[Route, Backend] | Refusal | None:
        """Hold until `pick` finds a backend for `served_name`; a Refusal when the request
        may not wait, or waited its time; None when the model is not one to wait for."""
        wait = self.patience(served_name, model, max_wait_header)
        if wait is None or isinstance(wait, Refusal):
            return wait
        self.held[model] = self.held.get(model, 0) + 1
        self.load.held(model)
        deadline = time.monotonic() + wait
        try:
            while True:
                changed = self._changed
                if self.stopping:
                    return self._shutting_down(served_name, model)
                route = self.table.route(served_name)
                backend = pick(route) if route is not None else None
                if route is not None and backend is not None:
                    return route, backend
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f"held {wait:g} s without a replica becoming ready"
                    return self._cannot_wait(model, served_name, why)
                try:
                    # a backend ejected or not yet probed comes back without a table change
                    await asyncio.wait_for(changed.wait(), timeout=min(left, 0.5))
                except TimeoutError:
                    pass
        finally:
            self.held[model] -= 1
            if not self.held[model]:
                del self.held[model]
            self.load.released(model)

    def _shutting_down(self, served_name: str, model: str) -> Refusal:
        return Refusal(
            503,
            f"this router is shutting down and model {served_name!r} has no replica ready; "
            "the request never reached an engine: send it again (another router, or this "
            "one once restarted, takes it)",
            code="router_shutting_down",
            kind="no_replica",
            model=model,
            headers=retry_after(SHUTDOWN_RETRY_AFTER_S),
        )

    def _cannot_wait(self, model: str, served_name: str, why: str) -> Refusal:
        after = self.retry_after(model)
        measured = self.table.load_seconds(model)
        load = (
            f"its last replica took {measured:.1f} s to load"
            if measured
            else "its load time is not measured yet"
        )
        return Refusal(
            503,
            f"model {served_name!r} is cold (no replica ready): a replica is being started and "
            f"{load}; {why}; retry after {after} s",
            code="model_cold",
            kind="no_replica",
            model=model,
            headers=retry_after(after),
        )


def client_wait(header: bytes | None) -> float | None:
    """The client's `x-llmgw-max-wait` in seconds; None when absent or not a number."""
    if header is None:
        return None
    try:
        value = float(header.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None
