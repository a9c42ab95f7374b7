"""Who may send a request, and what it is charged: the handler's one slot for keys, limits
and metering (router/proxy.py calls it; nothing else on the request path knows of keys).

The moments of a request, each a call:
1. `authenticate(req)`: before the body is read for routing. An identity, or a Refusal
   (401) that is answered at once.
2. `admit(identity, parsed, model, req)`: once the model is known and before an engine is
   picked (so a refused request never takes an engine's slot, nor waits for a cold model).
   A `Ticket` (what the request reserved: the metering of one request), None when there is
   nothing to meter, or a Refusal (403, 429 with its headers).
   `admit` may return `Later` instead: a wait (a claim on counters shared between
   routers), which the handler awaits for the same three outcomes.
3. `standing(identity)`: where its requests stand when the engines are full (its class,
   team and weight), for the router's queue (router/flow.py).
4. The ticket is told the replica answering (`answering`, which gives the headers to add
   to the answer: x-ratelimit-*), each chunk of the answer as it is relayed (`chunk`,
   which gives the bytes to relay: the same, or less when the gate asked the engine for
   more than the client did), and is `settle`d once when the request is over, however it
   ended (an answer, an engine's failure, the client leaving, a refusal after admission).

The gate here is the router's own: a fixed list of client keys (`--api-keys-file`), no
limits. The gateway's (router/keygate.py: keys from the bucket, limits, metering, audit)
implements the same calls.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from llmgw.priority import EVERYONE, Standing
from llmgw.router.refusal import Refusal
from llmgw.router.request import Parsed
from llmgw.router.server import Request


class Ticket(Protocol):
    # chunk() may give back other bytes than it was given: the answer is then sent chunked
    rewrites: bool

    def answering(self, replica: str) -> tuple[tuple[bytes, bytes], ...]:
        """The replica that answers (or "" for a refusal after admission); the headers to
        add to the answer's head."""
        ...

    def chunk(self, data: bytes, last: bool) -> bytes | None:
        """A piece of the answer, as it comes from the engine (`last`: the answer ends with
        it); what to relay of it, or None to end the answer here (a limit refuses a stream
        more tokens). Called from the engine connection's callback: it must not block."""
        ...

    def settle(self, status: int, outcome: str, refused: str | None = None) -> None:
        """The request is over, called once however it ended: `status` the answer's
        (0 when it ended before its answer was complete: the client left), `outcome`
        "ok", or the error kind that ended it (llmgw_router_errors' kinds), and `refused`
        the router's reason when it answered the request itself after admitting it (its
        error code: the queue's `queue_timeout`, a cold model's `model_cold`...)."""


class Later:
    """An admission that must wait (router/keygate.py: a claim on shared counters)."""

    __slots__ = ("wait",)

    def __init__(self, wait: Awaitable[Ticket | Refusal | None]) -> None:
        self.wait = wait


class Gate(Protocol):
    def authenticate(self, req: Request) -> object | Refusal: ...

    def admit(
        self, identity: object, parsed: Parsed, model: str, req: Request
    ) -> Ticket | Refusal | Later | None: ...

    def models(self, identity: object, names: list[str]) -> list[str]:
        """Of the names `GET /v1/models` lists, those this identity may use."""
        ...

    def standing(self, identity: object) -> Standing:
        """Where this identity's requests stand when the fleet is full: its class, team
        and weight (llmgw/priority.py)."""
        ...


class KeyListGate:
    """Clients need one of a fixed set of keys, as `Authorization: Bearer KEY`; with no
    keys configured, every client may. Nothing is metered."""

    def __init__(self, keys: frozenset[str] = frozenset()) -> None:
        self._accepted = {b"Bearer " + k.encode() for k in keys}

    @property
    def keyed(self) -> bool:
        return bool(self._accepted)

    def authenticate(self, req: Request) -> object | Refusal:
        if self._accepted and req.header(b"authorization") not in self._accepted:
            return Refusal(401, "missing or unknown API key", kind="unauthorized")
        return None

    def admit(
        self, identity: object, parsed: Parsed, model: str, req: Request
    ) -> Ticket | Refusal | None:
        return None

    def models(self, identity: object, names: list[str]) -> list[str]:
        return names

    def standing(self, identity: object) -> Standing:
        return EVERYONE
