"""Limiter: every limit that applies to a request, spent from shares this router claims on
the counter stream that all routers add to (budget.py says how a share works).

Admitting a request spends from the shares this router holds: no NATS round trip, except
the one claim in every `share` units. A claim is one atomic increment on the counter
(`Counter.add`: a JetStream publish with `Nats-Incr`, llmgw/bus/counters.py).

When the counters cannot be reached, the operator chooses (`offline`):
- "serve" (the default): keep admitting from the shares already held, for at most
  `serve_offline_for` seconds; past them, or once the shares are spent, answer 503.
  Nothing admitted is ever beyond what the counter granted, so a cut-off router cannot
  make the fleet pass a limit: it only stops sooner.
- "refuse": answer 503 to every limited request until the counters answer again.
"""

from __future__ import annotations

import asyncio
import itertools
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


class Counter(Protocol):
    """The counter stream, as the limiter needs it (llmgw/bus/counters.py)."""

    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        """Add `delta` to `subject`'s total; the new total. Raises on failure."""
        ...


@dataclass(frozen=True)
class LimitSettings:
    share: float = 0.005  # of a limit, claimed at a time: routers x share may go unused
    offline: Offline = "serve"
    serve_offline_for: float = 300.0
    claim_timeout: float = 0.5  # a claim not answered by then: the counters are away
    retry_claims_after: float = 1.0  # while away, claim again this often, not per request


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a microsecond
class _Need:
    budget: Budget
    units: int
    scope: str  # "key k1", "team t", "key k1 on model m": for messages


class Plan:
    """The budgets of one key on one model, and what the request path reads of them, made
    once per (key, model) until the key's or team's record changes."""

    __slots__ = ("key", "team", "budgets", "charged", "requests", "tokens", "cap_units")

    def __init__(self, key: object, team: object, budgets: list[tuple[Budget, str]]) -> None:
        self.key, self.team = key, team  # the records it was made from
        self.budgets = budgets  # each budget, and the scope its refusal names
        self.charged = [(b, scope) for b, scope in budgets if b.tokens]  # tokens, as used
        # for the x-ratelimit-* headers: the request and token limits per minute
        self.requests = [b for b, _ in budgets if b.dimension is Dimension.REQUESTS]
        self.tokens = [b for b, _ in budgets if b.dimension is Dimension.TOKENS]
        # the most tokens, and requests, that fit in one window of every budget
        self.cap_units = (
            min((b.limit for b, _ in budgets if b.tokens), default=None),
            min((b.limit for b, _ in budgets if not b.tokens), default=None),
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
        plan = self.plan
        if plan is None or not (plan.requests or plan.tokens):
            return None
        return _rate(plan.requests, plan.tokens, self.at)

    def header_pairs(self) -> tuple[tuple[bytes, bytes], ...]:
        """`rate()` as the headers of an answer, rendered straight to bytes (on every
        answer to a limited key)."""
        plan = self.plan
        if plan is None or not (plan.requests or plan.tokens):
            return ()
        r, r_left = _tightest(plan.requests)
        t, t_left = _tightest(plan.tokens)
        at = self.at
        return refusals.rate_header_pairs(
            r.limit if r else None,
            r_left,
            r.reset_in(at) if r else 0.0,
            t.limit if t else None,
            t_left,
            t.reset_in(at) if t else 0.0,
        )

    def progress_now(self, used: int) -> bool:
        """`progress` without waiting (a relay that cannot await): what passes the
        reservation is spent from the shares held, or charged all the same (added to the
        counter in the background). False once a limit is known to be passed: end the
        stream."""
        extra = used - self.tokens - self.charged
        if extra <= 0 or self.plan is None or not self.plan.charged:
            return True
        self.charged += extra
        within = True
        for b, _ in self.plan.charged:
            b.roll(self.limiter.clock())
            if b.try_spend(extra):
                continue
            beyond = b.force(extra)
            if beyond:
                self.limiter.owe(b.window_subject(), beyond)
                b.total += beyond
                within = within and b.total <= b.limit
        return within

    async def progress(self, used: int) -> bool:
        """A stream has used `used` tokens so far: charge what passes the reservation as it
        comes. False when the limits refuse more (the router ends the stream)."""
        extra = used - self.tokens - self.charged
        if extra <= 0 or self.plan is None or not self.plan.charged:
            return True
        needs = [_Need(b, extra, scope) for b, scope in self.plan.charged]
        refused = await self.limiter._take(self.plan, needs, self.limiter.clock())
        if refused is not None:
            return False
        self.charged += extra
        return True

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
                beyond = budget.force(diff)
                if beyond:
                    self.limiter.owe(budget.window_subject(), beyond)


# what `admit_now` gives a request that no limit applies to: one for all of them, holding
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
        counter: Counter,
        settings: LimitSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counter = counter
        self.settings = settings or LimitSettings()
        self.clock = clock
        self._budgets: dict[str, Budget] = {}
        self._plans: dict[tuple[str, str], Plan] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._owed: dict[str, int] = {}  # counter subject -> units to add when it answers
        # owed adds sent and not known stored: sent again as they are, with the same message
        # id, so an add whose answer was lost is counted once (the stream's duplicate window)
        self._owed_sending: dict[str, tuple[int, str]] = {}
        self._ids = itertools.count()
        self._id_prefix = f"limits.{os.getpid()}.{os.urandom(4).hex()}"
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
            self._locks[subject] = asyncio.Lock()
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
            if (not b.dimension.carries or b.spent == 0) and not self._locks[subject].locked():
                if b.granted and b.dimension.carries:
                    self.owe(b.window_subject(), -b.granted)
                del self._budgets[subject]
                del self._locks[subject]

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

    def admit_now(self, identity: Identity, model: str, tokens: int) -> Held | Refusal | None:
        """`admit` without waiting: from the shares held, or refused by what this router
        knows (the fleet has claimed a limit whole, the counters away too long); None when a
        claim is due first (then `await admit(...)`). A share running low is topped up in
        the background (`prefetch`), so the request path rarely waits."""
        plan = self._plan(identity, model)
        if not plan.budgets:
            return FREE  # nothing limits it
        now = self.clock()
        cap_tokens, cap_requests = plan.cap_units
        if (cap_tokens is not None and tokens > cap_tokens) or (
            cap_requests is not None and cap_requests < 1
        ):
            for b, scope in plan.budgets:
                units = tokens if b.tokens else 1
                if units > b.limit:
                    b.roll(now)
                    return self._refusal(plan, _Need(b, units, scope), now, never_fits=True)
        if self.offline_since is not None:
            for b, _ in plan.budgets:
                b.roll(now)
            if self._offline_too_long(now):
                return refusals.limits_unavailable(
                    f"not answering for {now - (self.offline_since or now):.0f} s"
                )
            if self.settings.offline == "refuse":
                return None  # the async path asks the counters, once a second
        taken = []
        low = False
        for b, scope in plan.budgets:  # the request path: plain tuples, no objects per limit
            units = tokens if b.tokens else 1
            spent = b.spend_now(units, now)
            if spent is SHORT:
                for held, window, n in taken:
                    held.give_back(n, window)
                if not b.carries and b.total >= b.limit:
                    return self._refusal(plan, _Need(b, units, scope), now)  # all claimed
                return None
            taken.append((b, b.window, units))
            if spent is SPENT_LOW:
                low = True
        if low:
            self._running_low(plan)
        return Held(self, taken, tokens, plan, now)

    async def admit(self, identity: Identity, model: str, tokens: int) -> Held | Refusal:
        """Spend one request and `tokens` (the prompt and the most it may generate) from
        every limit of `identity` on `model`, or say which limit refuses it."""
        now_held = self.admit_now(identity, model, tokens)
        if now_held is FREE:
            return Held(self, [], tokens, None, self.clock())
        if now_held is not None:
            return now_held
        now = self.clock()
        plan = self._plan(identity, model)
        needs = [_Need(b, tokens if b.tokens else 1, scope) for b, scope in plan.budgets]
        refused = await self._take(plan, needs, now)
        if refused is not None:
            return refused
        self._running_low(plan)
        return Held(self, [(n.budget, n.budget.window, n.units) for n in needs], tokens, plan, now)

    def _running_low(self, plan: Plan) -> None:
        """Have `prefetch` top up the shares of `plan` that run low (in flight excepted:
        its idle places are kept a share ahead at each flush, budget.surplus)."""
        for b, _ in plan.budgets:
            if b.running_low():
                self._low.add(b.subject)
        if self._low:
            self._wake.set()

    async def prefetch(self) -> None:
        """Top up the shares running low, as `_held` finds them, until cancelled (the
        gateway's `run` owns it)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            low, self._low = self._low, set()
            for subject in low:
                b = self._budgets.get(subject)
                if b is not None and self.offline_since is None:
                    await self._claim(_Need(b, b.granted - b.spent + 1, ""), spend=False)

    async def _take(self, plan: Plan, needs: list[_Need], now: float) -> Refusal | None:
        """Spend every need, claiming shares for those this router holds too little of; all
        or nothing."""
        for n in needs:
            n.budget.roll(now)
        if self._offline_too_long(now):
            return refusals.limits_unavailable(
                f"not answering for {now - (self.offline_since or now):.0f} s"
            )
        if self.offline_since is not None and self.settings.offline == "refuse":
            if not await self._answering(needs[0].budget, now):
                return refusals.limits_unavailable(self.offline_why)
        spent: list[_Need] = []
        short = []
        for n in needs:
            (spent if n.budget.try_spend(n.units) else short).append(n)
        if short:
            results = await asyncio.gather(*(self._claim(n) for n in short))
            spent += [n for n, ok in zip(short, results, strict=True) if ok]
            if None in results:  # the counters are away
                self._undo(spent)
                return refusals.limits_unavailable(self.offline_why)
            if False in results:
                self._undo(spent)
                return self._refusal(plan, short[results.index(False)], now)
        return None

    def _undo(self, spent: list[_Need]) -> None:
        for n in spent:
            n.budget.give_back(n.units, n.budget.window)

    async def _claim(self, n: _Need, *, spend: bool = True) -> bool | None:
        """Claim a share of `n`'s budget and spend `n` from it: True when spent, False when
        the limit refuses, None when the counters cannot be reached. One claim at a time per
        budget: the requests waiting behind it spend from what it brought. Without `spend`,
        only make sure `n` could be spent (a top-up ahead of need)."""
        b = n.budget
        async with self._locks[b.subject]:
            if b.spent + n.units <= b.granted:
                return b.try_spend(n.units) if spend else True
            now = self.clock()
            if self.offline_since is not None and now - self._last_attempt < (
                self.settings.retry_claims_after
            ):
                return None
            if (
                not b.dimension.carries  # places in flight come back; minutes never do
                and b.total >= b.limit
                and b.window == int(now // b.dimension.window_s)
            ):
                return False  # the fleet has claimed it all: no need to ask again
            self._last_attempt = now
            subject, asked = b.window_subject(), b.to_claim(n.units)
            try:
                total = await asyncio.wait_for(
                    self.counter.add(subject, asked), self.settings.claim_timeout
                )
            except (LlmgwError, TimeoutError, OSError) as e:
                self._went_offline(now, e)
                return None
            self._back_online()
            back = b.claimed(asked, total)
            if back:
                try:
                    await asyncio.wait_for(
                        self.counter.add(subject, -back), self.settings.claim_timeout
                    )
                except (LlmgwError, TimeoutError, OSError):
                    self.owe(subject, -back)
            return b.try_spend(n.units) if spend else b.spent + n.units <= b.granted

    async def _answering(self, b: Budget, now: float) -> bool:
        """While away, in "refuse": ask the counter (adding 0) once per retry interval."""
        if now - self._last_attempt < self.settings.retry_claims_after:
            return False
        self._last_attempt = now
        try:
            await asyncio.wait_for(
                self.counter.add(b.window_subject(), 0), self.settings.claim_timeout
            )
        except (LlmgwError, TimeoutError, OSError):
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

    def _refusal(self, plan: Plan, n: _Need, now: float, never_fits: bool = False) -> Refusal:
        b = n.budget
        # the key's tightest request and token limits, as on every answer to it (was: only
        # the refusing limit's kind, so a 429 for rpm carried no -tokens headers)
        rate = _rate(plan.requests, plan.tokens, now)
        retry = max(0.001, b.reset_in(now)) if b.window >= 0 else float(b.dimension.window_s)
        if never_fits:
            return Refusal(
                429,
                "tokens",
                "rate_limit_exceeded",
                f"this request needs {n.units} tokens (its prompt and max_tokens) but {n.scope} "
                f"may use {b.limit} per {'day' if b.dimension is Dimension.DAY else 'minute'}; "
                "lower max_tokens",
                retry_after=None,
                rate=rate,
            )
        if b.dimension is Dimension.DAY:
            return refusals.out_of_quota(n.scope, b.limit, retry, rate)
        if b.dimension is Dimension.PARALLEL:
            return refusals.rate_limited(n.scope, "requests_in_flight", b.limit, 1.0, rate)
        what = "requests" if b.dimension is Dimension.REQUESTS else "tokens"
        return refusals.rate_limited(n.scope, what, b.limit, retry, rate)

    # --- units owed to the counter -----------------------------------------------------

    def owing(self) -> int:
        """Owed adds not yet known stored (waiting, or sent and unanswered)."""
        return len(self._owed) + len(self._owed_sending)

    def owe(self, subject: str, units: int) -> None:
        self._owed[subject] = self._owed.get(subject, 0) + units

    async def flush(self) -> None:
        """Hand back places in flight no longer held, and add what is owed (tokens used past
        reservations, give-backs that failed). The gateway's loop runs it often."""
        now = self.clock()
        for b in self._budgets.values():
            if b.dimension.carries:
                b.roll(now)
                surplus = b.surplus()
                if surplus:
                    self.owe(b.window_subject(), -surplus)
        for subject in list(self._owed):
            if subject not in self._owed_sending:  # else its earlier add must be stored first
                units = self._owed.pop(subject)
                if units:
                    self._owed_sending[subject] = (units, f"{self._id_prefix}.{next(self._ids)}")
        for subject, (units, msg_id) in list(self._owed_sending.items()):
            try:
                await asyncio.wait_for(
                    self.counter.add(subject, units, msg_id), self.settings.claim_timeout
                )
            except (LlmgwError, TimeoutError, OSError):
                return  # next time, with the same id
            del self._owed_sending[subject]
