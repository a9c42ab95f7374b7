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
- What a request reserves: its prompt's tokens, estimated from its body's size, and the
  most its answers may generate as the engines read its body (router/generation.py): its
  cap, else what the engine may generate, the model's context (UNKNOWN_CONTEXT where the
  catalog does not say it). A stream that does not say is charged as it goes and ended at
  a limit, so it reserves DEFAULT_MAX_TOKENS.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llmgw.gateway import refusals, usage
from llmgw.gateway.gateway import (
    CHARS_PER_TOKEN,
    DEFAULT_MAX_TOKENS,
    Admission,
    Gateway,
    Pending,
)
from llmgw.gateway.relay import NATIVE_KEY, USAGE_KEY, GatewayTicket
from llmgw.gateway.table import Identity
from llmgw.priority import EVERYONE, Standing
from llmgw.router.gate import Later, Ticket
from llmgw.router.refusal import Refusal
from llmgw.router.request import Parsed
from llmgw.router.server import Request

# the routes whose streams carry an OpenAI usage chunk when asked for one
_USAGE_ROUTES = frozenset((b"/v1/chat/completions", b"/v1/completions"))
# llama-server's own routes: their events carry its counts, not `usage`
_NATIVE_ROUTES = frozenset((b"/infill",))
# what one answer of a model may generate when the catalog does not say its context: set
# `context` in its profiles for a bound of its own
UNKNOWN_CONTEXT = 32768
_KINDS = {401: "unauthorized", 403: "forbidden", 429: "rate_limited", 503: "limits_unavailable"}


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
    """router/gate.py's Gate over a Gateway. Who sent a request is its key's Identity (None:
    the bucket holds no key)."""

    def __init__(
        self, gateway: Gateway, context: Callable[[str], int | None] = lambda model: None
    ) -> None:
        self.gateway = gateway
        self.context = context  # a model's context by its catalog (router/table.py)

    def authenticate(self, req: Request) -> Identity | Refusal | None:
        g = self.gateway
        table = g.table
        if not table.enabled:
            return None
        header = req.header(b"authorization")
        if header is None:
            api_key = req.header(b"x-api-key")  # Anthropic's clients send their key so
            header = None if api_key is None else b"Bearer " + api_key
        found = table.authenticate_header(header, g.clock())
        if isinstance(found, refusals.Refusal):
            g.refused(found, client=req.client)
            return refusal(found)
        return found

    def admit(
        self, identity: object, parsed: Parsed, model: str, req: Request
    ) -> Ticket | Refusal | Later | None:
        g = self.gateway
        if identity is None:
            if not g.table.enabled:
                return None  # no keys: nothing to check or meter
            # the first key arrived since this request was authenticated: it needs one now
            identity = self.authenticate(req)
            if identity is None or isinstance(identity, Refusal):
                return identity
        assert isinstance(identity, Identity)
        prompt, generated = self._reservation(parsed, model)
        tokens = prompt + generated
        # the served name the request routed by: one the table knows, never a client's
        # invention (an unknown model is answered 404 before the gate is asked)
        admitted = g.request(identity, parsed.model, tokens, req.client, parsed.stream)
        if isinstance(admitted, Pending):
            return Later(self._resume(admitted, parsed, model, req, prompt))
        return self._ticket(admitted, parsed, model, req, prompt)

    async def _resume(
        self, pending: Pending, parsed: Parsed, model: str, req: Request, prompt_estimate: int
    ) -> Ticket | Refusal | None:
        return self._ticket(await pending.resume(), parsed, model, req, prompt_estimate)

    def _reservation(self, parsed: Parsed, model: str) -> tuple[int, int]:
        """What a request reserves: its prompt's tokens, estimated from its size, and the
        most its answers may generate (the module's docstring)."""
        prompt = -(-parsed.prompt_bytes // CHARS_PER_TOKEN)
        if not parsed.generates:
            return prompt, 0
        context = self.context(model) or UNKNOWN_CONTEXT
        if parsed.max_tokens is not None:
            one = min(parsed.max_tokens, context)
        else:
            one = context if parsed.most else min(DEFAULT_MAX_TOKENS, context)
        return prompt, parsed.answers * one

    def _ticket(
        self,
        admitted: Admission | refusals.Refusal,
        parsed: Parsed,
        model: str,
        req: Request,
        prompt_estimate: int,
    ) -> Ticket | Refusal | None:
        if isinstance(admitted, refusals.Refusal):
            return refusal(admitted, model)
        if admitted.identity is None:
            return None  # the last key was deleted meanwhile: as a fleet without keys
        strip = False
        if parsed.stream and not parsed.usage_asked and req.path in _USAGE_ROUTES:
            body = _asking_for_usage(req.body)
            if body is not None:
                req.body = body
                strip = True
        return GatewayTicket(
            admitted,
            stream=parsed.stream,
            prompt_estimate=prompt_estimate,
            strip=strip,
            generates=parsed.generates,
            usage_key=NATIVE_KEY if req.path in _NATIVE_ROUTES else USAGE_KEY,
        )

    def models(self, identity: object, names: list[str]) -> list[str]:
        if not isinstance(identity, Identity):
            return names
        return [n for n in names if identity.may_use(n)]

    def standing(self, identity: object) -> Standing:
        return identity.standing if isinstance(identity, Identity) else EVERYONE

    def team_weight(self, team: str) -> int:
        """A team's weight in the fleet's split of engines (1: no such team)."""
        record = self.gateway.table.team(team) if team else None
        return record.weight if record is not None else 1

    def served_tokens(self, team: str, served: str) -> int:
        """Tokens served to `team` on `served` since this router started (the engines' own
        usage, as the gateway tallies it): its fair share's counter (router/queue.py)."""
        tally = self.gateway.tokens.get((team, served))
        return tally[0] + tally[1] if tally is not None else 0


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
