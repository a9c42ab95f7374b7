"""What the gateway answers when it says no, in OpenAI's shapes, which clients already handle:
the official SDKs raise AuthenticationError (401), PermissionDeniedError (403) and
RateLimitError (429) from these, and honour `retry-after`.

A Refusal is data (status, type, code, numbers); its body and headers are rendered when
sent. `RateHeaders` are the `x-ratelimit-*` headers every answer to a limited key carries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1s`, `6m0s`, `1h2m3s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    if s < 60:
        return f"{s}s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


@dataclass(frozen=True, slots=True)
class RateHeaders:
    """The tightest request limit and the tightest token limit that apply to a request, and
    what is left of each: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None  # seconds until the window ends
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None

    def headers(self) -> dict[str, str]:
        return {
            k.decode(): v.decode()
            for k, v in rate_header_pairs(
                self.limit_requests,
                self.remaining_requests or 0,
                self.reset_requests or 0.0,
                self.limit_tokens,
                self.remaining_tokens or 0,
                self.reset_tokens or 0.0,
            )
        }


_REQUESTS = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
_TOKENS = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)
_RESETS: dict[int, bytes] = {}  # whole seconds -> `duration` of them: a minute's worth, mostly


def rate_header_pairs(
    limit_requests: int | None,
    remaining_requests: int,
    reset_requests: float,
    limit_tokens: int | None,
    remaining_tokens: int,
    reset_tokens: float,
) -> tuple[tuple[bytes, bytes], ...]:
    """The x-ratelimit-* headers as an answer's head carries them (on every answer to a
    limited key: rendered straight to bytes); a limit None: not shown."""
    out: tuple[tuple[bytes, bytes], ...] = ()
    if limit_requests is not None:
        limit, left, reset = _REQUESTS
        out = (
            (limit, b"%d" % limit_requests),
            (left, b"%d" % max(0, remaining_requests)),
            (reset, _reset(reset_requests)),
        )
    if limit_tokens is not None:
        limit, left, reset = _TOKENS
        out += (
            (limit, b"%d" % limit_tokens),
            (left, b"%d" % max(0, remaining_tokens)),
            (reset, _reset(reset_tokens)),
        )
    return out


def _reset(seconds: float) -> bytes:
    if seconds < 1:
        return duration(seconds).encode()
    whole = math.ceil(seconds)
    found = _RESETS.get(whole)
    if found is None:
        found = duration(whole).encode()
        if len(_RESETS) < 100_000:
            _RESETS[whole] = found
    return found


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer instead of the engine's: `status`, OpenAI's error `type` and `code`, a
    message naming the fix, and the headers to send (retry-after, x-ratelimit-*)."""

    status: int
    type: str
    code: str
    message: str
    retry_after: float | None = None
    rate: RateHeaders | None = None
    param: str | None = None
    extra: dict[str, object] = field(default_factory=dict)  # more error fields (allowed models)

    def body(self) -> bytes:
        error: dict[str, object] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
            **self.extra,
        }
        return json.dumps({"error": error}).encode()

    def headers(self) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.rate is not None:
            out.update(self.rate.headers())
        if self.retry_after is not None:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after)))
        if self.status == 401:
            out["www-authenticate"] = 'Bearer realm="llmgw"'
        return out


def unauthenticated(why: str) -> Refusal:
    return Refusal(
        401,
        "invalid_request_error",
        "invalid_api_key",
        f"{why}; send `Authorization: Bearer <key>` with a key from `llmgw key create`",
    )


def not_allowed(model: str, allowed: list[str]) -> Refusal:
    listed = ", ".join(allowed) if allowed else "none"
    return Refusal(
        403,
        "invalid_request_error",
        "model_not_allowed",
        f"this key may not use model {model!r}; it may use: {listed}",
        param="model",
        extra={"allowed_models": list(allowed)},
    )


def team_unreadable(key: str, team: str) -> Refusal:
    """A key of a team whose record does not read and was never read good here: its limits
    and models are unknown, so nothing is granted (llmgw/gateway/table.py)."""
    return Refusal(
        403,
        "invalid_request_error",
        "team_unreadable",
        f"API key {key} belongs to team {team}, whose record in the bucket does not read, so "
        f"nothing is granted to its keys (the operator fixes it: `llmgw team show {team}`)",
    )


def rate_limited(
    scope: str, what: str, limit: int, retry_after: float, rate: RateHeaders | None
) -> Refusal:
    """Over a per-minute limit (requests, tokens, or in flight): try again shortly."""
    return Refusal(
        429,
        what,
        "rate_limit_exceeded",
        f"rate limit reached for {scope}: {limit} {what} "
        f"{'in flight' if what == 'requests_in_flight' else 'per minute'}; "
        f"try again in {duration(retry_after)}",
        retry_after=retry_after,
        rate=rate,
    )


def out_of_quota(scope: str, limit: int, retry_after: float, rate: RateHeaders | None) -> Refusal:
    """Over the tokens of the day: no retry helps before the day ends."""
    return Refusal(
        429,
        "insufficient_quota",
        "insufficient_quota",
        f"{scope} has used its quota of {limit} tokens for today (UTC); it renews in "
        f"{duration(retry_after)}, or raise it with `llmgw key|team set --tokens-per-day`",
        retry_after=retry_after,
        rate=rate,
    )


def limits_unavailable(why: str) -> Refusal:
    """The counters shared between routers cannot be reached and the operator chose to refuse
    rather than serve on local shares (`--limits-offline refuse`)."""
    return Refusal(
        503,
        "server_error",
        "limits_unavailable",
        f"the rate-limit counters cannot be reached ({why}); try again shortly",
        retry_after=1.0,
    )
