"""The gateway at the router: keys from the bucket, per-model access, limits, metering and
the audit trail (llmgw/gateway), in the handler's one slot for them (router/gate.py).

- A fleet whose bucket holds no key serves every client as before, and nothing is metered
  (the request path is then what it was without a gateway).
- Once it holds one, a request needs `Authorization: Bearer <secret>` (or `x-api-key`):
  401 without a valid one, 403 naming the models allowed for a model outside its list,
  429 with `retry-after` past a limit; every answer to a limited key carries the
  `x-ratelimit-*` headers. Keys name models by their served names (what clients send,
  what /v1/models lists), and limits and usage count by those.
- A stream is charged as its tokens arrive. The engine is asked for its usage
  (`stream_options.include_usage`) when the client did not ask, and that usage chunk is
  taken back out of what this client receives; a stream cut short is charged what it
  generated.
"""

from __future__ import annotations

import json
import math

from llmgw.gateway import refusals, usage
from llmgw.gateway.gateway import Admission, Gateway
from llmgw.gateway.relay import MAX_LINE, GatewayTicket
from llmgw.gateway.table import Identity
from llmgw.router.gate import Later, Ticket
from llmgw.router.refusal import Refusal
from llmgw.router.request import Parsed
from llmgw.router.server import Request

# the routes whose streams carry an OpenAI usage chunk when asked for one
_USAGE_ROUTES = frozenset((b"/v1/chat/completions", b"/v1/completions"))
_KINDS = {401: "unauthorized", 403: "forbidden", 429: "rate_limited", 503: "limits_unavailable"}


class Caller:
    """Who sent a request, as `authenticate` found: the key's identity (None: the bucket
    holds no key), and what `admit` needs of the request."""

    __slots__ = ("identity", "authorization", "request")

    def __init__(self, identity: Identity | None, authorization: str | None, request: Request):
        self.identity = identity
        self.authorization = authorization
        self.request = request


def _authorization(req: Request) -> str | None:
    value = req.header(b"authorization")
    if value is None:
        api_key = req.header(b"x-api-key")  # Anthropic's clients send their key so
        return None if api_key is None else "Bearer " + api_key.decode("latin-1")
    return value.decode("latin-1")


def refusal(r: refusals.Refusal, model: str = "") -> Refusal:
    """The gateway's refusal as the router answers it (its body and headers unchanged)."""
    return Refusal(
        r.status,
        r.message,
        code=r.code,
        kind=_KINDS.get(r.status, "refused"),
        param=r.param,
        model=model,
        headers=tuple(
            (k.encode(), v.encode()) for k, v in r.headers().items() if k != "content-type"
        ),
        type=r.type,
        extra=tuple(r.extra.items()),
    )


class GatewayGate:
    """router/gate.py's Gate over a Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def authenticate(self, req: Request) -> Caller | Refusal:
        g = self.gateway
        if not g.enabled:
            return Caller(None, None, req)
        authorization = _authorization(req)
        identity = g.table.authenticate(authorization)
        if isinstance(identity, refusals.Refusal):
            g.refused(identity, client=req.client)
            return refusal(identity)
        return Caller(identity, authorization, req)

    def admit(
        self, identity: object, parsed: Parsed, model: str
    ) -> Ticket | Refusal | Later | None:
        caller = identity
        assert isinstance(caller, Caller)
        g = self.gateway
        if caller.identity is None and not g.enabled:
            return None  # no keys: nothing to check or meter
        # the served name the request routed by: one the table knows, never a client's
        # invention (an unknown model is answered 404 before the gate is asked)
        args = {
            "authorization": caller.authorization,
            "model": parsed.model,
            "prompt_chars": parsed.prompt_bytes,
            "max_tokens": parsed.max_tokens,
            "client": caller.request.client,
            "stream": parsed.stream,
            "identity": caller.identity,
        }
        admitted = g.admit_now(**args)
        if admitted is None:
            return Later(self._admit_later(args, caller, parsed, model))
        return self._ticket(admitted, caller, parsed, model)

    async def _admit_later(
        self, args: dict, caller: Caller, parsed: Parsed, model: str
    ) -> Ticket | Refusal | None:
        return self._ticket(await self.gateway.admit(**args), caller, parsed, model)

    def _ticket(
        self, admitted: Admission | refusals.Refusal, caller: Caller, parsed: Parsed, model: str
    ) -> Ticket | Refusal | None:
        if isinstance(admitted, refusals.Refusal):
            return refusal(admitted, model)
        if admitted.identity is None:
            return None  # the last key was deleted meanwhile: as a fleet without keys
        req = caller.request
        strip = False
        if parsed.stream and not parsed.usage_asked and req.path in _USAGE_ROUTES:
            body = _asking_for_usage(req.body)
            if body is not None:
                req.body = body
                strip = True
        return MeteredTicket(
            admitted,
            stream=parsed.stream,
            prompt_estimate=math.ceil(parsed.prompt_bytes / 4),
            strip=strip,
        )

    def models(self, identity: object, names: list[str]) -> list[str]:
        caller = identity
        if not isinstance(caller, Caller) or caller.identity is None:
            return names
        who = caller.identity
        return [n for n in names if who.may_use(n)]


def _asking_for_usage(body: bytes) -> bytes | None:
    """The body with `stream_options.include_usage` set; None if it cannot be changed."""
    if b'"stream_options"' not in body:
        # the common case, without decoding the body: a key put first in the object
        start = body.find(b"{")
        if start < 0:
            return None
        return body[: start + 1] + b'"stream_options":{"include_usage":true},' + body[start + 1 :]
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    usage.ask_for_usage(doc)
    return json.dumps(doc).encode()


class MeteredTicket(GatewayTicket):
    """An admitted request as the relay sees it: its usage read as it passes (the gateway's
    GatewayTicket), its x-ratelimit-* headers, and, when the router asked for a usage chunk
    the client did not, that chunk taken out of the stream."""

    __slots__ = ("rewrites", "_pending")

    def __init__(
        self, admission: Admission, *, stream: bool, prompt_estimate: int, strip: bool
    ) -> None:
        super().__init__(admission, stream=stream, prompt_estimate=prompt_estimate)
        self.rewrites = strip
        self._pending = b""  # an event begun and not ended, held while stripping

    def answering(self, replica: str) -> tuple[tuple[bytes, bytes], ...]:
        self.replica = replica or None
        return self.admission.header_pairs()

    def chunk(self, data: bytes) -> bytes | None:
        relayed = super().chunk(data)
        if relayed is None:
            return None  # past a token limit: the stream ends here
        return self._strip(relayed) if self.rewrites else relayed

    def _strip(self, data: bytes) -> bytes:
        """`data` without the usage-only event; an event cut across chunks is held until it
        ends (at most MAX_LINE bytes: past that it is passed on, unread)."""
        data = self._pending + data if self._pending else data
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_LINE:
                self._pending = b""
                return data
            self._pending = data
            return b""
        done, self._pending = data[: end + 2], data[end + 2 :]
        if b'"usage"' not in done:
            return done
        return b"".join(e + b"\n\n" for e in done[:-2].split(b"\n\n") if not _usage_only(e))


def _usage_only(event: bytes) -> bool:
    if b'"usage"' not in event:
        return False
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return usage.is_usage_only_chunk(line[5:].strip())
    return False
