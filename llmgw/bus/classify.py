"""What nats-py raised or reported, read by its type and JetStream's error code.

The one module that decides what a nats-py error means: a request's failure becomes a
BusError (llmgw.bus.errors) for the caller to decide by type; a connection's trouble is a
`Problem` to log and act on. Where nats-py gives only text, the text is read here and only
here, with the version and the reason at each place (tests/test_tls.py and tests/test_bus.py
feed it a real nats-server's answers).
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Awaitable
from dataclasses import dataclass
from enum import Enum, auto
from typing import TypeVar

import nats.errors
import nats.js.errors

from .errors import (
    Absent,
    BusError,
    BusRefused,
    BusUnavailable,
    ConditionBusy,
    NotABucket,
    Unanswered,
    WrongRevision,
)

T = TypeVar("T")

# nats-server's JetStream error codes (JSErrCode, server/errors.json) that llmgw acts on
WRONG_LAST_SEQUENCE = 10071  # compared, and the subject is at another revision
# not compared: another conditional write on the subject is in flight on a cluster's
# stream leader, which lets one at a time through; it decides nothing
WRONG_LAST_SEQUENCE_BUSY = 10164
REPLICAS_NEED_A_CLUSTER = 10074  # "replicas > 1 not supported in non-clustered mode"
# atomic batch publishes (nats-server >= 2.12): refused as a whole, nothing stored
ATOMIC_DISABLED = 10174  # "atomic publish is disabled": the stream does not allow them
ATOMIC_TOO_LARGE = 10199  # "atomic publish batch is too large: N" (the server's limit)

# no connection to send on, or it went while the request waited
_NOT_CONNECTED = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,  # UnexpectedEOF too
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoServersError,
    ConnectionError,
)


def describe(e: BaseException) -> str:
    return str(e) or type(e).__name__


async def answer(request: Awaitable[T], doing: str) -> T:
    """What the request returns; what nats-py raises instead becomes its BusError
    (`failure`), anything else surfaces as itself."""
    try:
        return await request
    except Exception as e:
        bus_failure = failure(e, doing)
        if bus_failure is None:
            raise
        raise bus_failure from e


def failure(e: BaseException, doing: str) -> BusError | None:
    """The BusError for what nats-py raised while `doing` (named in its message); None when
    `e` is no failure of the bus (an invalid key, a bug): it surfaces as itself."""
    if isinstance(e, nats.js.errors.KeyNotFoundError):  # a deletion's entry has its revision
        return Absent(doing, (e.entry.revision or 0) if e.entry is not None else 0)
    if isinstance(e, nats.js.errors.NotFoundError):  # BucketNotFoundError among them
        return Absent(doing)
    if isinstance(e, nats.js.errors.BadBucketError):
        return NotABucket(doing)
    if isinstance(e, nats.js.errors.KeyWrongLastSequenceError):
        # nats-py 2.16's KeyValue.update/create raise this for 10071 and 10164 alike and
        # drop the code: only the description is left
        return WrongRevision(doing, e.description, revision_in(e.description), None)
    if isinstance(e, nats.js.errors.ServiceUnavailableError):
        return BusUnavailable(doing, Unanswered.JETSTREAM_UNAVAILABLE, e.description or "")
    if isinstance(e, nats.js.errors.APIError):
        if e.err_code == WRONG_LAST_SEQUENCE:
            return WrongRevision(doing, e.description, revision_in(e.description), e.err_code)
        if e.err_code == WRONG_LAST_SEQUENCE_BUSY:
            return ConditionBusy(doing, e.description)
        return BusRefused(doing, e.code, e.err_code, e.description)
    if isinstance(e, nats.js.errors.NoStreamResponseError):  # a publish nothing stored
        return BusUnavailable(doing, Unanswered.NO_RESPONDERS, "no stream answers")
    if isinstance(e, nats.errors.TimeoutError):
        return BusUnavailable(doing, Unanswered.TIMEOUT, describe(e))
    if isinstance(e, nats.errors.NoRespondersError):
        return BusUnavailable(doing, Unanswered.NO_RESPONDERS)
    if isinstance(e, _NOT_CONNECTED):
        return BusUnavailable(doing, Unanswered.NOT_CONNECTED, describe(e))
    return None


def revision_in(description: str | None) -> int | None:
    """N in JetStream's "wrong last sequence: N". nats-server (2.15) says the subject's
    revision only in the description of error 10071, and nats-py (2.16) keeps no field for
    it: the number is read from the text."""
    _, _, tail = (description or "").rpartition(":")
    return int(tail) if tail.strip().isdigit() else None


# --- a connection's trouble (error_cb, first connect) ---------------------------------------


class Problem(Enum):
    AUTHORIZATION = auto()  # the server refused this identity
    TLS = auto()  # the TLS handshake failed
    DENIED = auto()  # permissions refused a subject; the connection stays up
    DROPPED = auto()  # the connection was reset or closed under the client
    OTHER = auto()


@dataclass(frozen=True)
class Denial:
    """A subject the server's permissions refused this client."""

    action: str  # "publish", "subscription"
    subject: str  # in lower case: nats-py lowercases the server's whole message
    text: str  # what nats-py reported, for the operator

    @property
    def jetstream(self) -> bool:
        """A JetStream API request, which a refusal leaves without an answer."""
        return self.subject.startswith("$js.")

    @property
    def creates_stream(self) -> bool:
        return self.subject.startswith("$js.api.stream.create.")


# nats-server: -ERR 'Permissions Violation for Publish to "<subject>"' (also "for Subscription
# to", "for Publish with Reply of")
_DENIAL = re.compile(r'nats: permissions violation for (\w+)[^"]* "([^"]*)"')


def denial(e: BaseException) -> Denial | None:
    """The subject a permissions refusal names. nats-py 2.16 (Client._process_err) hands the
    server's -ERR line to error_cb as a bare nats.errors.Error carrying the line lowercased
    by its parser: no type of its own and no field for the subject, so the text is read."""
    if not isinstance(e, nats.errors.Error):
        return None
    m = _DENIAL.match(str(e))
    return Denial(m.group(1), m.group(2), str(e)) if m else None


def _authorization_violation(e: BaseException) -> bool:
    # nats-py 2.16 raises AuthorizationError only for an -ERR that arrives once connected;
    # one in answer to CONNECT (Client._process_connect_init, marked FIXME there) is a bare
    # nats.errors.Error("nats: 'Authorization Violation'"): only its text says so
    return type(e) is nats.errors.Error and "authorization violation" in str(e).lower()


def problem(e: BaseException) -> Problem:
    if isinstance(e, nats.errors.AuthorizationError) or _authorization_violation(e):
        return Problem.AUTHORIZATION
    if isinstance(e, ssl.SSLError):
        return Problem.TLS
    if denial(e) is not None:
        return Problem.DENIED
    # a reset, a broken pipe, asyncio's "Connection lost", nats-py's unexpected EOF
    if isinstance(e, ConnectionError | nats.errors.StaleConnectionError):
        return Problem.DROPPED
    return Problem.OTHER


def nobody_listening(e: BaseException) -> bool:
    """No server listens at the address (the OS refused the TCP connection): an answer at
    once, where a timeout may be a server on its way up or a network in trouble."""
    return isinstance(e, ConnectionRefusedError)


def refusal(e: BaseException) -> bool:
    """The server (or its TLS) refused this client: what a later "connection lost" must not
    hide when the first connect gives up."""
    return problem(e) in (Problem.AUTHORIZATION, Problem.TLS)
