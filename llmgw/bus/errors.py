"""What a Bus call reports when it fails: one root, `BusError` (an `LlmgwError`).

Callers decide by type, never by a message's words: `BusUnavailable` is transient (retry
it; a write's outcome is unknown), `BusRefused` is JetStream's answer to that request,
`FencedOff` means the writer lost what its fence stood for. The types are made from what
nats-py raised by `llmgw.bus.classify`, the one place that reads nats-py's errors. Imports
no nats.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from llmgw.errors import LlmgwError

if TYPE_CHECKING:
    from .client import Fence


class BusError(LlmgwError):
    """A NATS problem stated for the operator (what failed and what to do)."""


class ValueTooLarge(LlmgwError, ValueError):
    """A value over the bucket's limit, refused before it is sent. Not a BusError: NATS is
    fine; the record is wrong (a writer's bug, or an operator's value), and retrying sends
    the same bytes again. A controller logs it as a bug and never doubts its link for it."""


class BusSettingsError(BusError):
    """A setting or file of the connection that cannot work (a URL that is not a NATS URL,
    a TLS file missing, unreadable, encrypted, or a key that is not the certificate's):
    retrying sends the same settings again, so an agent exits 78 (EX_CONFIG) for it."""


class NatsUnreachable(BusError):
    """No server answered (or all refused) for as long as the caller would wait: the one
    BusError where "is NATS running? is --nats right?" is the useful hint."""


class JetStreamNotReady(BusError):
    """JetStream gave no answer, or said it is not available yet: a cluster still electing
    its leader or short of a majority of its servers. A wait, like any outage."""

    def __init__(self, url: str, detail: str, hint: str = "") -> None:
        self.url, self.detail = url, detail
        super().__init__(f"JetStream not ready on {url} ({detail})" + (f"; {hint}" if hint else ""))


class BucketNotMade(BusError):
    """The bucket does not exist and this component does not make it (an agent): how the
    bucket is replicated is the controller's or the operator's choice. A wait."""

    def __init__(self, bucket: str, url: str) -> None:
        self.bucket, self.url = bucket, url
        super().__init__(
            f"bucket {bucket} does not exist on {url} yet, and an agent never makes it: a "
            "controller (`llmgw controller`, or `llmgw up`) makes it with the fleet's "
            "--bucket-replicas"
        )


class Unanswered(Enum):
    """Why a request got no answer."""

    TIMEOUT = "no answer in time"
    NO_RESPONDERS = "nothing answers it (no responders)"
    JETSTREAM_UNAVAILABLE = "JetStream is unavailable (503)"
    NOT_CONNECTED = "not connected to NATS"


class BusUnavailable(BusError):
    """A request got no answer, or there was no connection to send it on. Transient: the
    caller retries. The outcome of a write is unknown: it may still have been stored."""

    def __init__(self, doing: str, why: Unanswered, detail: str = "") -> None:
        self.doing, self.why, self.detail = doing, why, detail
        super().__init__(f"{doing}: {why.value}" + (f" ({detail})" if detail else ""))

    @property
    def jetstream_silent(self) -> bool:
        """The server is there but its JetStream did not answer (what a server cut off from
        the rest of its cluster looks like), as opposed to no connection at all."""
        return self.why is not Unanswered.NOT_CONNECTED


class StreamMissing(BusUnavailable):
    """Connected, and no stream takes the subject: the stream was never made (or was
    removed). Only the operator makes the gateway's streams (`llmgw up`, `llmgw key ls`);
    a router cannot, and under mTLS may not."""

    def __init__(self, doing: str, stream: str) -> None:
        self.stream = stream
        super().__init__(
            doing,
            Unanswered.NO_RESPONDERS,
            f"stream {stream} does not exist: the operator makes it with `llmgw key ls` "
            "(or `llmgw up`, which makes the streams as it starts)",
        )


class BusRefused(BusError):
    """JetStream answered the request with an error: `code` (HTTP-like status), `err_code`
    (nats-server's JSErrCode), `description` (its words)."""

    def __init__(
        self, doing: str, code: int | None, err_code: int | None, description: str | None
    ) -> None:
        self.doing, self.code, self.err_code = doing, code, err_code
        self.description = description or ""
        super().__init__(
            f"{doing}: JetStream refused it ({self.description or 'no description'}; "
            f"code {code}, error {err_code})"
        )


class Absent(BusRefused):
    """What the request named is not there: a key (deleted, purged or never written), a
    bucket, a stream. `revision` is that of the key's deletion, 0 when it has none."""

    def __init__(self, doing: str, revision: int = 0) -> None:
        super().__init__(doing, 404, None, "not found")
        self.revision = revision


class NotABucket(BusRefused):
    """The bucket's stream exists but is no KV bucket (made by another tool, or for
    something else)."""

    def __init__(self, doing: str) -> None:
        super().__init__(doing, None, None, "the stream is not a KV bucket")


class WrongRevision(BusRefused):
    """A conditional write found its key (or its fence key) at another revision: `now_at`,
    when the server said which."""

    def __init__(
        self, doing: str, description: str | None, now_at: int | None, err_code: int | None
    ) -> None:
        super().__init__(doing, 400, err_code, description)
        self.now_at = now_at


class ConditionBusy(BusRefused):
    """A cluster's stream leader refused a conditional write without comparing, another one
    on the subject being in flight: it decides nothing, and the write may be tried again."""

    def __init__(self, doing: str, description: str | None) -> None:
        super().__init__(doing, 400, 10164, description)


class FencedOff(BusError):
    """The server refused a fenced write: the fence key has moved on from the revision the
    writer held. Not an operator's problem: the writer lost what the fence stood for."""

    def __init__(self, key: str, fence: Fence, now_at: int | None) -> None:
        self.key, self.fence, self.now_at = key, fence, now_at
        at = f"revision {now_at}" if now_at is not None else "another revision"
        super().__init__(
            f"write to {key} refused: {fence.key} is at {at}, not {fence.revision} as fenced"
        )
