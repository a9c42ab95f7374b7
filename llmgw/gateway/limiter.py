"""Limiter: every limit that applies to a request, spent from shares this router claims on
the counter stream that all routers add to (budget.py says how a share works).

One admission call, `admit`, answers at once from the shares held: a `Held` (the request
holds what it took), a `Refusal`, or a `Claim` when a claim is due first. `Claim.resume`
is the same step again after each claim, until it admits or refuses. Nothing is ever spent
while a claim is awaited: a request whose client leaves while it waits (its task cancelled)
holds nothing, and the claim itself runs to its end in a task of its own, so what the
counter granted is kept for the next requests, never lost with the one that asked.

A claim is one atomic increment on the counter (`Counter.add`: a JetStream publish with
`Nats-Incr`, llmgw/bus/counters.py); one at a time per budget, and the requests waiting on
it spend from what it brought.

When the counters cannot be reached, the operator chooses (`offline`):
- "serve" (the default): keep admitting from the shares already held, for at most
  `serve_offline_for` seconds; past them, or once the shares are spent, answer 503.
  Nothing admitted is ever beyond what the counter granted, so a cut-off router cannot
  make the fleet pass a limit: it only stops sooner.
- "refuse": answer 503 to every limited request until the counters answer again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from llmgw.bus import keys
from llmgw.bus.errors import StreamMissing
from llmgw.errors import LlmgwError

from . import refusals
from .budget import SHORT, SPENT_LOW, Budget, Dimension
from .refusals import RateHeaders, Refusal
from .table import Identity

log = logging.getLogger(__name__)

Offline = Literal["serve", "refuse"]
# budgets one router keeps (a key on each model is one each): past it, all but those holding
# places in flight are forgotten, so model names a client makes up cannot grow it
MAX_BUDGETS = 100_000
_ERRORS = (LlmgwError, TimeoutError, OSError)  # a counter that did not answer


class Claims(Protocol):
    """The limits stream, as the limiter needs it (llmgw/bus/claims.py): each router holds
    what it claimed of a window on a subject of its own."""

    async def claim(
        self, window_subject: str, holder: str, mine: int, asked: int, limit: int
    ) -> tuple[int, int]:
        """`holder` holds `mine` and asks `asked` more under `limit`: what it got, and the
        window's total after it. Raises when the stream cannot be reached."""
        ...

    async def hold(self, window_subject: str, holder: str, units: int) -> None:
        """Write what `holder` holds of the window. Raises on failure."""
        ...


@dataclass(frozen=True)
class LimitSettings:
    share: float = 0.005  # of a limit, claimed at a time: routers x share may go unused
    offline: Offline = "serve"
    serve_offline_for: float = 600.0  # as long as known keys (gateway/table.py)
    claim_timeout: float = 0.5  # a claim not answered by then: the counters are away
    retry_claims_after: float = 1.0  # while away, claim again this often, not per request


class Plan:
    """The budgets of one key on one model, and what the request path reads of them, made
    once per (key, model) until the key's or team's record changes."""

    __slots__ = ("key", "team", "budgets", "charged", "requests", "tokens", "cap_units")

    def __init__(self, key: object, team: object, budgets: list[tuple[Budget, str]]) -> None:
        self.key, self.team = key, team  # the records it was made from
        self.budgets = budgets  # each budget, and the scope its refusal names
        self.charged = [b for b, _ in budgets if b.tokens]  # tokens, as used
        # for the x-ratelimit-* headers: the request and token limits per minute
        self.requests = [b for b, _ in budgets if b.dimension is Dimension.REQUESTS]
        self.tokens = [b for b, _ in budgets if b.dimension is Dimension.TOKENS]
        # the most tokens, and requests, that fit in one window of every budget
        self.cap_units = (
            min((b.limit for b, _ in budgets if b.tokens), default=None),
            min((b.limit for b, _ in budgets if not b.tokens), default=None),
        )

    def rate(self, now: float) -> RateHeaders | None:
        """The x-ratelimit-* figures of its tightest limits, as of `now`."""
        return _rate(self.requests, self.tokens, now)

    def header_pairs(self, at: float) -> tuple[tuple[bytes, bytes], ...]:
        """`rate()` as the headers of an answer, rendered straight to bytes (on every answer
        to a limited key, and on its refusals)."""
        if not (self.requests or self.tokens):
            return ()
        r, r_left = _tightest(self.requests)
        t, t_left = _tightest(self.tokens)
        return refusals.rate_header_pairs(
            r.limit if r else None,
            r_left,
            r.reset_in(at) if r else 0.0,
            t.limit if t else None,
            t_left,
            t.reset_in(at) if t else 0.0,
        )


class Held:
    """What one admitted request holds: hand it back with `settle` (once)."""

    __slots__ = ("limiter", "taken", "tokens", "plan", "at", "charged", "settled")

    def __init__(
        self,
        limiter: Limiter,
        taken: list[tuple[Budget, int, int]],  # budget, window, units: as admitted
        tokens: int,  # tokens reserved
        plan: Plan | None,  # its limits (None: none)
        at: float,  # when admitted
    ) -> None:
        self.limiter = limiter
        self.taken = taken
        self.tokens = tokens
        self.plan = plan
        self.at = at
        self.charged = 0  # tokens charged past the reservation (a stream running long)
        self.settled = False

    def rate(self) -> RateHeaders | None:
        """The x-ratelimit-* figures of this request's tightest limits, as of now."""
        return None if self.plan is None else self.plan.rate(self.at)

    def header_pairs(self) -> tuple[tuple[bytes, bytes], ...]:
        return () if self.plan is None else self.plan.header_pairs(self.at)

    def progress_now(self, used: int) -> bool:
        """A stream has used `used` tokens so far: what passes the reservation is spent from
        the shares held, or charged all the same (added to the counter in the background:
        the relay that calls this cannot wait: it never does). False once a limit is known to be passed:
        the router ends the stream."""
        extra = used - self.tokens - self.charged
        if extra <= 0 or self.plan is None or not self.plan.charged:
            return True
        self.charged += extra
        within = True
        for b in self.plan.charged:
            b.roll(self.limiter.clock())
            if b.try_spend(extra):
                continue
            beyond = b.force(extra)  # held past what was claimed: written at the next flush
            if beyond:
                b.total += beyond
                within = within and b.total <= b.limit
        return within

    def settle(self, used_tokens: int | None) -> None:
        """The request is over: give back what it reserved and did not use (its usage in
        `used_tokens`; None: unknown, the reservation stands), charge what it used past it,
        and free its place in flight."""
        if self.settled:
            return
        self.settled = True
        diff = 0 if used_tokens is None else used_tokens - self.tokens - self.charged
        for budget, window, units in self.taken:
            if budget.carries:
                # give_back(units, window), inline: every request in flight comes here
                budget.spent = max(0, budget.spent - units)
            elif not budget.tokens or not diff:
                continue
            elif diff < 0:
                budget.give_back(-diff, window)  # to the window it was reserved in
            else:
                budget.roll(self.limiter.clock())
                budget.force(diff)  # held past what was claimed: written at the next flush


class Claim:
    """An admission that waits for a claim: `await resume()` for the Held or the Refusal.
    It holds nothing while it waits."""

    __slots__ = ("limiter", "plan", "tokens")

    def __init__(self, limiter: Limiter, plan: Plan, tokens: int) -> None:
        self.limiter, self.plan, self.tokens = limiter, plan, tokens

    async def resume(self) -> Held | Refusal:
        lim = self.limiter
        while True:
            now = lim.clock()
            if lim.offline_since is not None and lim.settings.offline == "refuse":
                if not await lim._answering(self.plan.budgets[0][0], now):
                    return refusals.limits_unavailable(lim.offline_why)
            step = lim._step(self.plan, self.tokens, now)
            if not isinstance(step, list):
                return step
            # a claim for each budget short of room, all at once; each runs to its end in
            # its own task (shielded), whatever becomes of this request meanwhile
            results = await asyncio.gather(*(lim._claim_for(b, units) for b, units, _ in step))
            if None in results:  # the counters are away
                return refusals.limits_unavailable(lim.offline_why)
            if False in results:
                b, units, scope = step[results.index(False)]
                return lim._refusal(self.plan, b, units, scope, lim.clock())
            # each claim brought room: take it (others may have been quicker: then again)


# what `admit` gives a request that no limit applies to: one for all of them, holding
# nothing (its settle and progress have nothing to do)
FREE = Held(None, [], 0, None, 0.0)  # type: ignore[arg-type]


def _tightest(budgets: list[Budget]) -> tuple[Budget | None, int]:
    """The budget with the least left of those, and what is left of it (`remaining()`,
    inline: read for every answer to a limited key)."""
    best, least = None, 0
    for b in budgets:
        left = b.limit - b.total + b.granted - b.spent
        if left < 0:
            left = 0
        if best is None or left < least:
            best, least = b, left
    return best, least


def _rate(requests: list[Budget], tokens: list[Budget], now: float) -> RateHeaders | None:
    """The tightest request limit and token limit of those."""
    r, r_left = _tightest(requests)
    t, t_left = _tightest(tokens)
    if r is None and t is None:
        return None
    return RateHeaders(
        limit_requests=r.limit if r else None,
        remaining_requests=r_left if r else None,
        reset_requests=r.reset_in(now) if r else None,
        limit_tokens=t.limit if t else None,
        remaining_tokens=t_left if t else None,
        reset_tokens=t.reset_in(now) if t else None,
    )


class Limiter:
    def __init__(
        self,
        counter: Claims,
        settings: LimitSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        router: str = "router",
    ) -> None:
        self.counter = counter
        self.router = router  # its holder token: <router>.<instance>
        self._instance = f"{os.getpid()}{os.urandom(3).hex()}"
        self.settings = settings or LimitSettings()
        self.clock = clock
        self._budgets: dict[str, Budget] = {}
        self._plans: dict[tuple[str, str], Plan] = {}
        self._claims: dict[str, asyncio.Task[bool | None]] = {}  # one per budget at a time
        self._low: set[str] = set()  # budgets whose share runs low: topped up by prefetch
        self._wake = asyncio.Event()
        self.offline_since: float | None = None
        self.offline_why = "they did not answer"  # said in the 503 while they are away
        self._last_attempt = 0.0

    # --- which limits apply ------------------------------------------------------------

    def _budget(self, subject: str, dimension: Dimension, limit: int) -> Budget:
        b = self._budgets.get(subject)
        if b is None:
            if len(self._budgets) >= MAX_BUDGETS:
                self._forget_idle()
            b = self._budgets[subject] = Budget.new(subject, dimension, limit, self.settings.share)
        else:
            b.relimit(limit, self.settings.share)
        return b

    def _forget_idle(self) -> None:
        """Drop every budget but the places in flight still held: the counters keep what was
        claimed, so a forgotten budget only loses its unspent share (safe: less is
        admitted, never more), and a new one claims again."""
        now = self.clock()
        self._plans.clear()
        for subject, b in list(self._budgets.items()):
            b.roll(now)
            claiming = self._claims.get(subject)
            if (not b.carries or b.spent == 0) and (claiming is None or claiming.done()):
                if b.unstored() or (b.carries and (b.granted or b.granted_next)):
                    continue  # written (its places handed back) at the next flush first
                del self._budgets[subject]
                self._claims.pop(subject, None)

    def _plan(self, identity: Identity, model: str) -> Plan:
        """The budgets of `identity` on `model` and the scope each says in a refusal;
        remembered until its key's or team's record changes."""
        cached = self._plans.get((identity.name, model))
        if cached is not None and cached.key is identity.key and cached.team is identity.team:
            return cached
        scopes = [(f"key {identity.name}", f"key.{identity.name}", identity.key.limits)]
        if identity.team is not None:
            t = identity.team
            scopes.append((f"team {t.team}", f"team.{t.team}", t.limits))
        scopes.append(
            (
                f"key {identity.name} on model {model}",
                f"keymodel.{identity.name}.{keys.name_token(model)}",
                identity.key.model_limits,
            )
        )
        budgets = []
        for scope, path, limits in scopes:
            for dimension, limit in (
                (Dimension.REQUESTS, limits.rpm),
                (Dimension.TOKENS, limits.tpm),
                (Dimension.DAY, limits.tokens_per_day),
                (Dimension.PARALLEL, limits.max_parallel),
            ):
                if limit is not None:
                    subject = f"{keys.LIMITS_ROOT}.{path}.{dimension.value}"
                    budgets.append((self._budget(subject, dimension, limit), scope))
        if len(self._plans) >= MAX_BUDGETS:
            self._plans.clear()
        plan = self._plans[identity.name, model] = Plan(identity.key, identity.team, budgets)
        return plan

    # --- admitting ---------------------------------------------------------------------

    def admit(self, identity: Identity, model: str, tokens: int) -> Held | Refusal | Claim:
        """Spend one request and `tokens` (the prompt and the most it may generate) from
        every limit of `identity` on `model`, from the shares held: a Held, a Refusal, or a
        Claim when one is due first (then `await claim.resume()`). A share running
        low is topped up in the background (`prefetch`), so a request rarely waits."""
        plan = self._plan(identity, model)
        if not plan.budgets:
            return FREE  # nothing limits it
        now = self.clock()
        if self.offline_since is not None and self.settings.offline == "refuse":
            return Claim(self, plan, tokens)  # it asks the counters, once a second
        step = self._step(plan, tokens, now)
        return Claim(self, plan, tokens) if isinstance(step, list) else step

    def _step(
        self, plan: Plan, tokens: int, now: float
    ) -> Held | Refusal | list[tuple[Budget, int, str]]:
        """One try from the shares held, all or nothing: a Held, a Refusal, or the budgets
        short of room (budget, units, scope), for which a claim is due. Spends nothing
        unless it admits."""
        cap_tokens, cap_requests = plan.cap_units
        if (cap_tokens is not None and tokens > cap_tokens) or (
            cap_requests is not None and cap_requests < 1
        ):
            for b, scope in plan.budgets:
                units = tokens if b.tokens else 1
                if units > b.limit:
                    b.roll(now)
                    return self._refusal(plan, b, units, scope, now, never_fits=True)
        if self._offline_too_long(now):
            for b, _ in plan.budgets:
                b.roll(now)
            return refusals.limits_unavailable(
                f"not answering for {now - (self.offline_since or now):.0f} s"
            )
        taken = []
        short = None
        low = False
        for b, scope in plan.budgets:  # the request path: plain tuples, no objects per limit
            units = tokens if b.tokens else 1
            spent = b.spend_now(units, now)
            if spent is SHORT:
                if b.all_claimed(now):
                    self._undo(taken)
                    return self._refusal(plan, b, units, scope, now)
                short = short or []
                short.append((b, units, scope))
                continue
            taken.append((b, b.window, units))
            if spent is SPENT_LOW:
                low = True
        if short is not None:
            self._undo(taken)
            return short
        if low:
            self._running_low(plan)
        return Held(self, taken, tokens, plan, now)

    @staticmethod
    def _undo(taken: list[tuple[Budget, int, int]]) -> None:
        for b, window, units in taken:
            b.give_back(units, window)

    def _running_low(self, plan: Plan) -> None:
        """Have `prefetch` top up the shares of `plan` that run low (in flight excepted:
        its idle places are kept a share ahead at each flush, budget.surplus)."""
        for b, _ in plan.budgets:
            if b.running_low():
                self._low.add(b.subject)
        if self._low:
            self._wake.set()

    async def prefetch(self) -> None:
        """Top up the shares running low, as `_running_low` finds them, until cancelled
        (the gateway's `run` owns it)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            low, self._low = self._low, set()
            for subject in low:
                b = self._budgets.get(subject)
                if b is not None and self.offline_since is None:
                    await self._claim_for(b, b.granted - b.spent + 1)

    async def _claim_for(self, b: Budget, units: int) -> bool | None:
        """Room for `units` on `b`: True when it is there, False when the limit refuses,
        None when the counters cannot be reached. One claim at a time per budget, each in a
        task of its own (shielded: what the counter grants is kept whoever asked, even if
        they left); a claim made for another request is waited out, then looked at again."""
        while True:
            task = self._claims.get(b.subject)
            if task is None or task.done():
                task = self._claims[b.subject] = asyncio.ensure_future(self._claim(b, units))
                return await asyncio.shield(task)
            if await asyncio.shield(task) is None:
                return None
            if b.room() >= units:
                return True

    async def _claim(self, b: Budget, units: int) -> bool | None:
        """Claim on `b`'s counter what `units` need, a share ahead (in flight: on this window
        and the next): True when the room is there now, False when the limit refuses,
        None when the counters cannot be reached."""
        now = self.clock()
        b.roll(now)
        if b.room() >= units:
            return True
        if self.offline_since is not None and now - self._last_attempt < (
            self.settings.retry_claims_after
        ):
            return None
        if b.all_claimed(now):
            return False  # the fleet has claimed it all: no need to ask again
        self._last_attempt = now
        window = b.window
        asked = b.to_claim(units) if b.spent + units > b.granted else 0
        if asked and not await self._add_claim(b, window, asked):
            return None
        # in flight: the next window covers what this one holds
        ahead = b.next_to_claim()
        if ahead and not await self._add_claim(b, window + 1, ahead):
            return None
        return b.room() >= units

    @property
    def holder(self) -> str:
        return f"{self.router}.{self._instance}"

    async def _add_claim(self, b: Budget, window: int, asked: int) -> bool:
        """Claim `asked` more on `b`'s window `window` and keep what fits; False when the
        stream did not answer."""
        mine = b.granted if window == b.window else b.granted_next
        try:
            got, total = await asyncio.wait_for(
                self.counter.claim(f"{b.subject}.{window}", self.holder, mine, asked, b.limit),
                self.settings.claim_timeout,
            )
        except _ERRORS as e:
            self._went_offline(self.clock(), e)
            return False
        self._back_online()
        b.claimed(window, got, total, mine + got)
        return True

    async def _answering(self, b: Budget, now: float) -> bool:
        """While away, in "refuse": ask the counter (adding 0) once per retry interval."""
        if now - self._last_attempt < self.settings.retry_claims_after:
            return False
        self._last_attempt = now
        b.roll(now)
        try:
            await asyncio.wait_for(
                self.counter.hold(b.window_subject(), self.holder, b.granted),
                self.settings.claim_timeout,
            )
        except _ERRORS:
            return False
        self._back_online()
        return True

    def _went_offline(self, now: float, e: BaseException) -> None:
        if self.offline_since is None:
            self.offline_since = now
            # a stream that does not exist is named, with its fix, to the client too
            self.offline_why = e.detail if isinstance(e, StreamMissing) else "they did not answer"
            log.warning(
                "rate-limit counters not answering (%s): %s",
                e or type(e).__name__,
                "serving on the shares held"
                if self.settings.offline == "serve"
                else "refusing limited requests (503)",
            )

    def _back_online(self) -> None:
        if self.offline_since is not None:
            log.warning("rate-limit counters answer again")
            self.offline_since = None

    def _offline_too_long(self, now: float) -> bool:
        return (
            self.offline_since is not None
            and now - self.offline_since > self.settings.serve_offline_for
        )

    def cut_off(self, now: float | None = None) -> None:
        """The shell lost NATS: act as if a claim had failed now."""
        if self.offline_since is None:
            self._went_offline(self.clock() if now is None else now, ConnectionError("cut off"))

    def reconnected(self) -> None:
        """The shell has NATS again: claim at the next need."""
        self._back_online()
        self._last_attempt = 0.0

    # --- what it says ------------------------------------------------------------------

    def _refusal(
        self, plan: Plan, b: Budget, units: int, scope: str, now: float, never_fits: bool = False
    ) -> Refusal:
        # the key's tightest request and token limits, as on every answer to it
        rate = plan.rate(now)
        retry = max(0.001, b.reset_in(now)) if b.window >= 0 else float(b.dimension.window_s)
        if never_fits:
            return Refusal(
                429,
                "tokens",
                "rate_limit_exceeded",
                f"this request needs {units} tokens (its prompt and max_tokens) but {scope} "
                f"may use {b.limit} per {'day' if b.dimension is Dimension.DAY else 'minute'}; "
                "lower max_tokens",
                retry_after=None,
                rate=rate,
            )
        if b.dimension is Dimension.DAY:
            return refusals.out_of_quota(scope, b.limit, retry, rate)
        if b.dimension is Dimension.PARALLEL:
            return refusals.rate_limited(scope, "requests_in_flight", b.limit, 1.0, rate)
        what = "requests" if b.dimension is Dimension.REQUESTS else "tokens"
        return refusals.rate_limited(scope, what, b.limit, retry, rate)

    # --- what is sent in the background ------------------------------------------------

    def owing(self) -> int:
        """Budgets whose subjects do not say yet what this router holds (tokens used past a
        reservation, places handed back): written at the next flush."""
        return sum(1 for b in self._budgets.values() if b.unstored())

    async def flush(self) -> None:
        """Keep places in flight claimed on the next window (`carry`), hand back those no
        longer held, and write what this router holds where its subjects lag (tokens used
        past reservations). The gateway's loop runs it often."""
        now = self.clock()
        writes = []
        for b in self._budgets.values():
            claiming = self._claims.get(b.subject)
            if claiming is not None and not claiming.done():
                continue  # the claim writes what it holds; what it misses, the next flush
            if b.carries:
                b.roll(now)
                b.hand_back()
                if b.carry_due() and self.offline_since is None:
                    writes.append(self._claim_for(b, 0))
                    continue
            for ahead, units in b.unstored():
                writes.append(self._store(b, ahead, units))
        if writes:
            await asyncio.gather(*writes)

    async def _store(self, b: Budget, ahead: int, units: int) -> None:
        window = b.window + ahead
        try:
            await asyncio.wait_for(
                self.counter.hold(f"{b.subject}.{window}", self.holder, units),
                self.settings.claim_timeout,
            )
        except _ERRORS:
            return  # the next flush writes it again: a holder's value is what it holds
        if 0 <= window - b.window <= 1:  # (a window may have ended meanwhile)
            b.stored_as(window - b.window, units)
