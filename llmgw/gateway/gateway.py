"""Gateway: the one object a router's request handler calls.

    identity = gateway.table.authenticate(authorization)       # or a Refusal (401)
    admitted = gateway.request(identity, model, tokens, client, stream)
    if isinstance(admitted, Pending): admitted = await admitted.resume()   # a claim, rarely
    if isinstance(admitted, Refusal):
        answer(admitted.status, admitted.headers(), admitted.body())
    ...send upstream, with admitted.headers() on the answer...
    for each stream chunk: if not admitted.progress_now(completion_tokens_so_far): end it
    admitted.finish(status=..., usage=Usage(...), replica=..., ttft=...)   # once, always

(`await gateway.admit(authorization=..., model=..., max_tokens=...)` does the first three
for a caller that may wait.)

`finish` hands back what was reserved and not used, meters the engine's usage, and queues
the audit record; `Gateway.flush` (run by the router's loop, `Gateway.run`) sends the
meter's counts, the audit records and what the limiter owes. Nothing on the request path
waits for NATS except a claim, once per share.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from llmgw.bus.records import AuditRecord
from llmgw.errors import LlmgwError

from .limiter import FREE, Claim, Claims, Held, Limiter, LimitSettings
from .metering import Meter
from .outbox import Counter, Outbox
from .refusals import Refusal
from .table import SERVE_KNOWN_FOR, Identity, KeyTable
from .usage import Usage

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024  # reserved for a request that does not say max_tokens
CHARS_PER_TOKEN = 4  # a prompt's tokens estimated from its characters, when not counted
# a key's records in one audit message (JSON lines, a few hundred bytes each): a flush
# sends one message per key, not one per request
AUDIT_BATCH = 1000


class Streams(Counter, Claims, Protocol):
    """The streams beside the bucket that a router adds to: the usage counters (`add`) and
    the limits (`claim`, `hold`): llmgw/bus/counters.py's Counters."""


class AuditSink(Protocol):
    async def append(self, batch: Sequence[tuple[str, Sequence[AuditRecord]]]) -> None:
        """Store each (message id, records of one key) as one message, or raise; a retry
        with the same ids and records stores none twice (llmgw/bus/counters.py,
        AuditTrail)."""
        ...


def reserve_tokens(
    *, prompt_chars: int = 0, prompt_tokens: int | None = None, max_tokens: int | None = None
) -> int:
    """What a request reserves: its prompt's tokens (counted, or estimated from its
    characters) and the most it may generate."""
    prompt = (
        prompt_tokens if prompt_tokens is not None else math.ceil(prompt_chars / CHARS_PER_TOKEN)
    )
    return prompt + (
        max_tokens if max_tokens is not None and max_tokens >= 0 else DEFAULT_MAX_TOKENS
    )


@dataclass(frozen=True)
class GatewaySettings:
    limits: LimitSettings = field(default_factory=LimitSettings)
    serve_known_for: float = SERVE_KNOWN_FOR
    audit_queue: int = 100_000  # records waiting for NATS; past it the oldest are counted, dropped
    flush_every: float = 0.2


class Admission:
    """One admitted request, carried until it is `finish`ed (once, however it ended)."""

    __slots__ = ("gateway", "identity", "held", "model", "client", "stream", "started", "finished")

    def __init__(
        self,
        gateway: Gateway,
        identity: Identity | None,
        held: Held | None,
        model: str,
        client: str,
        stream: bool,
        started: float,
    ) -> None:
        self.gateway = gateway
        self.identity = identity
        self.held = held  # None: no limit applies
        self.model = model
        self.client = client
        self.stream = stream
        self.started = started
        self.finished = False

    def headers(self) -> dict[str, str]:
        """x-ratelimit-* for a limited key, on every answer."""
        rate = self.held.rate() if self.held is not None else None
        return rate.headers() if rate is not None else {}

    def header_pairs(self) -> tuple[tuple[bytes, bytes], ...]:
        """`headers()` as an answer's head carries them."""
        return self.held.header_pairs() if self.held is not None else ()

    def progress_now(self, completion_tokens: int) -> bool:
        """`progress` for a relay that cannot await: charged from the shares held, or all
        the same (added to the counters in the background); False once a limit is passed."""
        if self.held is None:
            return True
        return self.held.progress_now(completion_tokens)

    def finish(
        self,
        *,
        status: int,
        usage: Usage | None,
        replica: str | None = None,
        ttft: float | None = None,
        estimate: Usage | None = None,
        refused: str | None = None,
    ) -> None:
        """Once per admitted request, however it ended. `usage` None: the engine said none;
        then an error answer (4xx, 5xx) generated nothing and its reservation is handed back,
        and any other keeps its reservation as charged and is metered by `estimate`.
        `refused`: the router answered it itself after admitting it, and why (its audit
        record's reason). A fleet without keys meters and audits nothing (as before keys),
        and counts tokens for /metrics only."""
        if self.finished:
            return
        self.finished = True
        g = self.gateway
        if self.held is not None:
            used = usage.total if usage is not None else (0 if status >= 400 else None)
            self.held.settle(used)
        identity = self.identity
        u = usage or estimate or _NONE
        team = identity.team_name if identity is not None else None
        tally = g.tokens.get((team or "", self.model))
        if tally is None:
            tally = g.tokens[team or "", self.model] = [0, 0, 0]
        tally[0] += u.prompt
        tally[1] += u.completion
        tally[2] += u.cached
        if identity is None:
            return
        key = identity.name
        g.meter.add(team, key, self.model, u.prompt, u.completion, u.cached, self.started)
        g.audit(
            AuditRecord(
                time=self.started,
                key=key,
                team=team,
                model=self.model,
                replica=replica,
                router=g.router,
                status=status,
                stream=self.stream,
                prompt_tokens=u.prompt,
                completion_tokens=u.completion,
                cached_tokens=u.cached,
                ttft_s=ttft,
                duration_s=max(0.0, g.clock() - self.started),
                client=self.client,
                refused=refused,
            )
        )


_NONE = Usage()


class Pending:
    """An admission waiting for a claim on the counters (`Gateway.request`): `resume` gives
    its Admission or Refusal. It holds nothing while it waits, so a client that leaves
    meanwhile (its task cancelled) takes nothing with it."""

    __slots__ = ("gateway", "claim", "identity", "model", "client", "stream")

    def __init__(
        self,
        gateway: Gateway,
        claim: Claim,
        identity: Identity,
        model: str,
        client: str,
        stream: bool,
    ) -> None:
        self.gateway, self.claim, self.identity = gateway, claim, identity
        self.model, self.client, self.stream = model, client, stream

    async def resume(self) -> Admission | Refusal:
        held = await self.claim.resume()
        g = self.gateway
        return g._outcome(held, self.identity, self.model, self.client, self.stream, g.clock())


class Gateway:
    def __init__(
        self,
        router: str,
        counter: Streams,
        audit_sink: AuditSink | None = None,
        settings: GatewaySettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or GatewaySettings()
        self.clock = clock
        self.counter = counter
        self.audit_sink = audit_sink
        self.table = KeyTable(clock=clock, serve_known_for=self.settings.serve_known_for)
        self.limiter = Limiter(counter, self.settings.limits, clock=clock, router=router)
        self.meter = Meter(router)
        self.router = router
        # tokens per (team, model) since start, for /metrics and the fleet page: team names
        # come from the bucket, models from the router's table, never from a client
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self._audit: deque[AuditRecord] = deque()
        # audit messages made and not yet stored are sent again as they are (the same ids);
        # the records that arrive meanwhile wait for the next ones
        self._audit_out = Outbox(router, self._audit_messages, len)
        self.audit_dropped = 0
        self._failed = False

    @property
    def router(self) -> str:
        """Its router id: named in its audit records, and its limits' holder subjects."""
        return self.limiter.router

    @router.setter
    def router(self, router: str) -> None:
        self.limiter.router = self.meter.router = router

    @property
    def enabled(self) -> bool:
        """Keys are required: the bucket holds at least one."""
        return self.table.enabled

    def apply(self, key: str, value: object) -> None:
        """An update of the router's watch of `apikeys.*` / `teams.*`."""
        self.table.apply(key, value)

    def request(
        self,
        identity: Identity | None,
        model: str,
        tokens: int,
        client: str = "",
        stream: bool = False,
    ) -> Admission | Refusal | Pending:
        """The one admission call: authorize `identity` (from `table.authenticate`; None when
        the bucket holds no key) for `model` and charge its limits `tokens` (its prompt and
        the most it may generate: `reserve_tokens`). An Admission to carry through the
        request, the Refusal to answer, or a Pending when a claim on the counters is due
        first (`await pending.resume()`: rare, the shares are topped up ahead)."""
        now = self.clock()
        if identity is None:
            return Admission(self, None, None, model, client, stream, now)
        if not identity.may_use(model):
            refusal = self.table.authorize(identity, model)
            assert refusal is not None
            self._refused(refusal, identity, model, client, stream, now)
            return refusal
        if not identity.limited:
            return Admission(self, identity, None, model, client, stream, now)
        held = self.limiter.admit(identity, model, tokens)
        if isinstance(held, Claim):
            return Pending(self, held, identity, model, client, stream)
        return self._outcome(held, identity, model, client, stream, now)

    async def admit(
        self,
        *,
        authorization: str | None,
        model: str,
        prompt_chars: int = 0,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        client: str = "",
        stream: bool = False,
    ) -> Admission | Refusal:
        """Authenticate `authorization`, then `request`, waiting for its claim if one is
        due: for a caller that holds the header and may wait (the router's gate calls
        `request` itself, on its request path)."""
        identity = self.table.authenticate(authorization) if self.table.enabled else None
        if isinstance(identity, Refusal):
            self._refused(identity, None, model, client, stream, self.clock())
            return identity
        tokens = reserve_tokens(
            prompt_chars=prompt_chars, prompt_tokens=prompt_tokens, max_tokens=max_tokens
        )
        admitted = self.request(identity, model, tokens, client, stream)
        return await admitted.resume() if isinstance(admitted, Pending) else admitted

    def _outcome(
        self,
        held: Held | Refusal,
        identity: Identity,
        model: str,
        client: str,
        stream: bool,
        now: float,
    ) -> Admission | Refusal:
        if isinstance(held, Refusal):
            self._refused(held, identity, model, client, stream, now)
            return held
        return Admission(self, identity, None if held is FREE else held, model, client, stream, now)

    def models(self, authorization: str | None, names: Iterable[str]) -> list[str] | Refusal:
        """`GET /v1/models`: the models the caller's key may use."""
        if not self.table.enabled:
            return list(names)
        identity = self.table.authenticate(authorization)
        if isinstance(identity, Refusal):
            return identity
        return self.table.visible(identity, names)

    def refused(self, refusal: Refusal, *, client: str = "", model: str = "") -> None:
        """A request its handler refused before `admit` (a 401 when it authenticated the
        caller itself): audited like the refusals `admit` makes."""
        self._refused(refusal, None, model, client, False, self.clock())

    def _refused(
        self,
        refusal: Refusal,
        identity: Identity | None,
        model: str,
        client: str,
        stream: bool,
        now: float,
    ) -> None:
        self.audit(
            AuditRecord(
                time=now,
                key=identity.name if identity else None,
                team=identity.team_name if identity else None,
                model=model,
                router=self.router,
                status=refusal.status,
                stream=stream,
                client=client,
                refused=refusal.code,
            )
        )

    # --- what is sent in the background ------------------------------------------------

    def audit(self, record: AuditRecord) -> None:
        """Queue a request's record; past `audit_queue` waiting, the oldest not yet in a
        message being sent is dropped, and counted."""
        if self.audit_waiting() >= self.settings.audit_queue:
            self.audit_dropped += 1
            if not self._audit:
                return  # all that waits is in messages being sent: this one goes
            self._audit.popleft()
        self._audit.append(record)

    def audit_waiting(self) -> int:
        return len(self._audit) + self._audit_out.sending_size

    async def flush(self) -> None:
        """Send what waits: the limiter's debts, the meter's counts, the audit records."""
        await self.limiter.flush()
        if not await self.meter.flush(self.counter):
            self._failing("usage counts not stored")
        if self.audit_sink is None:
            self._audit.clear()
            return
        try:
            await self._audit_out.flush(self.audit_sink.append)
        except (LlmgwError, TimeoutError, OSError) as e:
            self._failing(f"audit records not stored ({e})")
            return
        self._failed = False

    def _audit_messages(self) -> list[list[AuditRecord]]:
        """What waits, as messages: each key's records in the order they came, AUDIT_BATCH
        at most in one."""
        by_key: dict[str | None, list[AuditRecord]] = {}
        waiting = self._audit
        while waiting:
            record = waiting.popleft()
            recs = by_key.get(record.key)
            if recs is None:
                recs = by_key[record.key] = []
            recs.append(record)
        return [
            recs[i : i + AUDIT_BATCH]
            for recs in by_key.values()
            for i in range(0, len(recs), AUDIT_BATCH)
        ]

    def _failing(self, what: str) -> None:
        if not self._failed:  # said once per outage, not every 0.2 s
            self._failed = True
            log.warning(
                "%s; %d waiting, kept until NATS takes them (the streams are made by "
                "`llmgw key|team|audit`)",
                what,
                self.audit_waiting(),
            )

    async def run(self) -> None:
        """Flush every `flush_every` seconds and top up low shares as they run low, until
        cancelled (the router's task group owns it); one last flush on the way out is the
        caller's `flush()`."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.limiter.prefetch)
            while True:
                await anyio.sleep(self.settings.flush_every)
                try:
                    await self.flush()
                except Exception:  # noqa: BLE001 - a bug here must not stop metering
                    log.exception("gateway flush failed")
