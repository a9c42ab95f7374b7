"""An answer the router gives itself, without an engine: a step of the handler that cannot
go on returns one, and the handler answers it in one place (router/proxy.py).

Its fields are data: the status, the OpenAI error `code`, the metric's error `kind`, and the
headers the client needs (`retry-after`, or a rate limiter's `x-ratelimit-*`); the body is
rendered from them when it is sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def error_body(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    type: str | None = None,
    extra: tuple[tuple[str, object], ...] = (),
) -> bytes:
    """OpenAI's error shape, which its client libraries read; `type` by the status unless
    given, `extra` more fields of the error (a gateway's allowed models)."""
    kind = type or ("invalid_request_error" if status < 500 else "server_error")
    if type is None and status == 401:
        kind = "authentication_error"
    error = {"message": message, "type": kind, "param": param, "code": code, **dict(extra)}
    return json.dumps({"error": error}).encode()


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str
    code: str | None = None
    # llmgw_router_errors{kind}; None counts the status only
    kind: str | None = None
    param: str | None = None
    model: str = ""  # the catalog id, for the metric's labels ("" before one is known)
    replica: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    type: str | None = None  # OpenAI's error type; None: by the status
    extra: tuple[tuple[str, object], ...] = ()  # more fields of the error object

    @property
    def retry_after(self) -> int | None:
        for name, value in self.headers:
            if name == b"retry-after":
                return int(value)
        return None

    def body(self) -> bytes:
        return error_body(
            self.status,
            self.message,
            code=self.code,
            param=self.param,
            type=self.type,
            extra=self.extra,
        )


def retry_after(seconds: int) -> tuple[tuple[bytes, bytes], ...]:
    return ((b"retry-after", str(seconds).encode()),)
