"""The streams beside the bucket that sharing the fleet between teams needs: two counter
streams (limit windows, usage) and the audit trail. Typed access over a Bus's connection.

Counter streams (nats-server >= 2.12, ADR-49, `allow_msg_counter`): a publish with header
`Nats-Incr: +N` adds N to its subject's running total, atomically on the stream (on a
cluster, its leader), and the publish's answer carries the new total
(`{"stream":..., "seq":..., "val":"12"}`); the subject's last message holds it too
(`{"val":"12"}`). nats-py 2.16 has no helper for it: a request with the header is one.

The operator creates the streams (`ensure_streams`, from `llmgw up` as it starts and from
`llmgw key|team|audit`); routers
only add and append (llmgw/bus/permissions.py), and nobody but the operator may purge or
delete: the audit stream denies both even to it, until it edits the stream.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamConfig

from . import claims, classify, keys, records
from .client import Bus
from .errors import BusError, BusUnavailable, StreamMissing, Unanswered
from .watcher import last_sequence

log = logging.getLogger(__name__)

LIMITS_MAX_AGE = 2 * 86_400.0  # a window is a minute or a day: two days keep every live one
USAGE_RETENTION = 400 * 86_400.0
AUDIT_RETENTION = 90 * 86_400.0
_TIMEOUT = 2.0
MAX_RECORD = 64 * 1024  # an audit record is a few hundred bytes: bigger is not one
# one audit message, as sent: well under nats-server's default max_payload (1 MiB)
AUDIT_MESSAGE_BYTES = 256 * 1024
MAX_AUDIT_MESSAGE = 8 << 20  # as read: bigger is skipped unread (max_payload can be raised)


@dataclass(frozen=True)
class StreamPlan:
    """What `ensure_streams` makes."""

    replicas: int = 1
    usage_retention: float = USAGE_RETENTION
    audit_retention: float = AUDIT_RETENTION


def stream_configs(plan: StreamPlan) -> list[StreamConfig]:
    return [
        StreamConfig(
            name=keys.LIMITS_STREAM,
            description="llmgw: what each router holds claimed of each limit, per window",
            subjects=[f"{keys.LIMITS_ROOT}.>"],
            allow_direct=True,  # a claim reads every holder of a window in one batch get
            max_msgs_per_subject=1,  # a holder's value is its last message
            max_age=LIMITS_MAX_AGE,
            num_replicas=plan.replicas,
        ),
        StreamConfig(
            name=keys.USAGE_STREAM,
            description="llmgw: tokens and requests per hour, team, key and model (counters)",
            subjects=[f"{keys.USAGE_ROOT}.>"],
            allow_msg_counter=True,
            allow_direct=True,
            max_msgs_per_subject=1,
            max_age=plan.usage_retention,
            duplicate_window=120.0,  # a batch sent again within it is counted once
            num_replicas=plan.replicas,
        ),
        StreamConfig(
            name=keys.AUDIT_STREAM,
            description="llmgw: one record per request (no prompt or completion text)",
            subjects=[f"{keys.AUDIT_ROOT}.>"],
            max_age=plan.audit_retention,
            deny_delete=True,
            deny_purge=True,
            duplicate_window=120.0,
            num_replicas=plan.replicas,
        ),
    ]


async def ensure_streams(bus: Bus, plan: StreamPlan | None = None) -> list[str]:
    """Create the streams that are missing (the operator's); the names made. Without a
    `plan`, with as many copies as the bucket has: a cluster's bucket of 3 copies gets
    streams of 3, so losing one server loses no limit, usage or audit record either. One
    that exists is left as it is: its retention is changed with `llmgw audit --retention`."""
    if plan is None:
        bucket = f"KV_{bus.bucket.name}"
        info = await classify.answer(bus.js.stream_info(bucket), f"stream {bucket}")
        plan = StreamPlan(replicas=info.config.num_replicas or 1)
    made = []
    for config in stream_configs(plan):
        try:
            info = await classify.answer(bus.js.stream_info(config.name), f"stream {config.name}")
        except BusError as e:
            if not _not_found(e):
                raise
        else:
            if config.name == keys.LIMITS_STREAM and info.config.allow_msg_counter:
                # the limits as one counter a window, before each router held its own
                # subject: it holds only live windows, so it is made anew (what is claimed
                # in this minute starts again from 0 once, as routers are upgraded)
                log.warning(
                    "replacing stream %s (one counter a window) with holders per router",
                    config.name,
                )
                await classify.answer(
                    bus.js.delete_stream(config.name), f"delete stream {config.name}"
                )
            else:
                _check_existing(config, info.config)
                continue
        version = bus.nc.connected_server_version
        if config.allow_msg_counter and (version.major, version.minor) < (2, 12):
            raise BusError(
                f"nats-server {version} has no counter streams (allow_msg_counter, 2.12 and "
                "later): upgrade it to use limits and usage metering"
            )
        await classify.answer(bus.js.add_stream(config), f"create stream {config.name}")
        made.append(config.name)
    return made


def _check_existing(wanted: StreamConfig, found: StreamConfig) -> None:
    """A stream of that name made otherwise (by hand, by another tool) must still be one
    llmgw can use: counters where counters are wanted, the same subjects."""
    problems = []
    if bool(wanted.allow_msg_counter) != bool(found.allow_msg_counter):
        problems.append(
            "it is not a counter stream (allow_msg_counter)"
            if wanted.allow_msg_counter
            else "it is a counter stream (allow_msg_counter)"
        )
    if sorted(found.subjects or []) != sorted(wanted.subjects or []):
        problems.append(f"its subjects are {found.subjects}, not {wanted.subjects}")
    if problems:
        raise BusError(
            f"stream {wanted.name} exists but {'; '.join(problems)}: remove it with "
            f"`nats stream rm {wanted.name}` (what it counted is lost) and run the command again"
        )


def _not_found(e: BusError) -> bool:
    cause = e.__cause__ or e.__context__
    return isinstance(cause, nats.js.errors.NotFoundError) or "not found" in str(e).lower()


async def set_audit_retention(bus: Bus, seconds: float) -> None:
    info = await classify.answer(bus.js.stream_info(keys.AUDIT_STREAM), "audit stream")
    config = info.config
    config.max_age = seconds
    await classify.answer(bus.js.update_stream(config), "set the audit stream's retention")


def stream_of(subject: str) -> str:
    """The counter stream that takes `subject`."""
    if subject.startswith(keys.USAGE_ROOT + "."):
        return keys.USAGE_STREAM
    if subject.startswith(keys.LIMITS_ROOT + "."):
        return keys.LIMITS_STREAM
    raise ValueError(f"{subject} is on none of llmgw's counter streams")


class Counters:
    """The counter streams' subjects (limits and usage): add to one (`add`), read one
    (`total`) or many (`totals`)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        """Add `delta` to `subject`'s total and return the new total. With `msg_id`, a second
        add with the same id (a retry) within the duplicate window is not counted again."""
        if not self.bus.connected:
            # nats-py would hold the publish while it reconnects and send it after: an add
            # whose caller gave up on it (a claim timed out, a give-back to be sent again)
            # would then count once more than the caller knows
            raise BusUnavailable(f"add to {subject}", Unanswered.NOT_CONNECTED)
        headers = {"Nats-Incr": f"{delta:+d}"}
        if msg_id is not None:
            headers["Nats-Msg-Id"] = msg_id
        try:
            answer = await classify.answer(self._request(subject, headers), f"add to {subject}")
        except BusUnavailable as e:
            if e.why is Unanswered.NO_RESPONDERS:  # connected, and no stream takes the subject
                raise StreamMissing(f"add to {subject}", stream_of(subject)) from None
            raise
        if answer.get("duplicate"):
            return await self.total(subject)
        return int(answer["val"])

    async def _request(self, subject: str, headers: dict[str, str]) -> dict:
        msg = await self.bus.nc.request(subject, b"", timeout=_TIMEOUT, headers=headers)
        answer = json.loads(msg.data)
        if isinstance(answer, dict) and answer.get("error"):
            raise nats.js.errors.APIError.from_error(answer["error"])
        if not isinstance(answer, dict):
            raise BusError(f"add to {subject}: the answer {msg.data[:80]!r} is not a counter's")
        return answer

    async def claim(
        self, window_subject: str, holder: str, mine: int, asked: int, limit: int
    ) -> tuple[int, int]:
        """A claim on a limit's window for `holder` (llmgw/bus/claims.py): what it got, and
        the window's total."""
        return await claims.claim(self.bus, window_subject, holder, mine, asked, limit)

    async def hold(self, window_subject: str, holder: str, units: int) -> None:
        """What `holder` holds of a limit's window, written (llmgw/bus/claims.py)."""
        await claims.hold(self.bus, window_subject, holder, units)

    async def held(self, window_subject: str) -> int:
        """What every router holds of a limit's window."""
        return await claims.total(self.bus, window_subject)

    async def total(self, subject: str) -> int:
        """`subject`'s total now (0 if it has none)."""
        try:
            msg = await classify.answer(
                self.bus.nc.request(
                    f"$JS.API.DIRECT.GET.{stream_of(subject)}.{subject}", b"", timeout=_TIMEOUT
                ),
                f"read {subject}",
            )
        except nats.errors.NoRespondersError:
            return 0
        if msg.headers and msg.headers.get("Status") == "404":
            return 0
        return _value(msg.data)

    async def totals(self, filter_subject: str) -> dict[str, int]:
        """Every subject matching `filter_subject` and its total (its last message's)."""
        out: dict[str, int] = {}
        stream = stream_of(filter_subject)
        async for subject, data in _last_per_subject(self.bus, stream, filter_subject):
            out[subject] = _value(data)
        return out


def _value(data: bytes) -> int:
    try:
        return int(json.loads(data)["val"])
    except (ValueError, KeyError, TypeError):
        return 0


async def _last_per_subject(
    bus: Bus, stream: str, filter_subject: str
) -> AsyncIterator[tuple[str, bytes]]:
    config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    async for msg in _replay(bus, stream, filter_subject, config, follow=False):
        yield msg.subject, msg.data


async def _replay(
    bus: Bus, stream: str, filter_subject: str, config: ConsumerConfig, *, follow: bool
) -> AsyncIterator[object]:
    """Messages of `stream` on `filter_subject` from where `config` says, until caught up
    (or forever, with `follow`), through an ordered consumer that is gone when done. Caught
    up: the last sequence the stream's leader stores there is received (llmgw.bus.watcher
    says why a delivery's "nothing pending" is not enough)."""
    sub = await classify.answer(
        bus.js.subscribe(filter_subject, stream=stream, ordered_consumer=True, config=config),
        f"read stream {stream}",
    )
    try:
        info = await classify.answer(sub.consumer_info(), f"read stream {stream}")
        target = await classify.answer(
            last_sequence(bus.nc, stream, filter_subject), f"read stream {stream}"
        )
        # Nothing delivered yet: the consumer's place is just before where it starts, and
        # nothing comes when that is past the target. (Delivered: read those first.)
        received = 0 if info.delivered.consumer_seq else info.delivered.stream_seq
        while follow or received < target:
            try:
                msg = await sub.next_msg(timeout=_TIMEOUT if not follow else 3600)
            except nats.errors.TimeoutError:
                if follow:
                    continue
                break
            received = max(received, msg.metadata.sequence.stream)
            yield msg
    finally:
        try:
            await asyncio.wait_for(sub.unsubscribe(), 1.0)
        except Exception:  # noqa: BLE001 - the consumer goes away with its subscription
            pass


class AuditTrail:
    """The audit stream: routers append (`append`), the operator reads (`read`).

    A message holds the records of one key (its subject, `llmgw.audit.<key>`, so a reader
    filters by key), one JSON record a line: a router sends what a flush found in one
    message per key, not a message per request (nats-server stores one message a flush
    instead of one a request). A message written before batching holds one record, which
    is one line as well: both read the same."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def append(self, batch: Sequence[tuple[str, Sequence[records.AuditRecord]]]) -> None:
        """Store each (message id, records of one key) as one message (or a few, past
        AUDIT_MESSAGE_BYTES), all acknowledged, or raise. A retry with the same ids and
        records stores none twice (the stream's duplicate window, `Nats-Msg-Id`)."""
        acks = []
        for msg_id, recs in batch:
            for i, payload in enumerate(audit_messages(recs)):
                acks.append(
                    self.bus.js.publish(
                        audit_subject(recs[0].key),
                        payload,
                        headers={"Nats-Msg-Id": msg_id if i == 0 else f"{msg_id}.{i}"},
                        timeout=_TIMEOUT,
                    )
                )
        try:
            await classify.answer(asyncio.gather(*acks), "append to the audit trail")
        except BusUnavailable as e:
            if e.why is Unanswered.NO_RESPONDERS:  # connected, and no stream takes it
                raise StreamMissing("append to the audit trail", keys.AUDIT_STREAM) from None
            raise

    async def read(
        self, *, since: float, key: str | None = None, follow: bool = False
    ) -> AsyncIterator[records.AuditRecord]:
        """The records stored since `since` (when stored: within a flush of the request's
        end), one per request, in the order stored; with `follow`, then those to come."""
        start = dt.datetime.fromtimestamp(since, dt.UTC).isoformat()
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
        subject = f"{keys.AUDIT_ROOT}.{keys.check_token(key, 'key name') if key else '>'}"
        async for msg in _replay(self.bus, keys.AUDIT_STREAM, subject, config, follow=follow):
            found, bad = read_audit_message(msg.data)  # type: ignore[attr-defined]
            if bad:
                log.warning(
                    "skipping %d audit record(s) of message %s that do not decode: %s",
                    bad.count,
                    msg.metadata.sequence.stream,  # type: ignore[attr-defined]
                    bad.first,
                )
            for record in found:
                yield record


def audit_subject(key: str | None) -> str:
    return f"{keys.AUDIT_ROOT}.{key or keys.NO_NAME}"


def audit_messages(recs: Sequence[records.AuditRecord]) -> list[bytes]:
    """Records of one key as audit messages: JSON lines, each message at most
    AUDIT_MESSAGE_BYTES (a record is a few hundred bytes); the same records give the same
    messages, so a retry sends what it sent before."""
    if not recs:
        raise ValueError("an audit message holds at least one record")
    key = recs[0].key
    out: list[bytes] = []
    lines: list[bytes] = []
    size = 0
    for r in recs:
        if r.key != key:
            raise ValueError(f"an audit message holds one key's records, not {key} and {r.key}")
        line = records.encode(r)
        if lines and size + len(line) + 1 > AUDIT_MESSAGE_BYTES:
            out.append(b"\n".join(lines))
            lines, size = [], 0
        lines.append(line)
        size += len(line) + 1
    out.append(b"\n".join(lines))
    return out


@dataclass(frozen=True)
class Undecoded:
    """Lines of an audit message that are no record: how many, and the first one's error."""

    count: int
    first: str


def read_audit_message(data: bytes) -> tuple[list[records.AuditRecord], Undecoded | None]:
    """The records of one audit message (JSON lines; one line: a message from before
    batching), and what did not decode. Bounded: a message past MAX_AUDIT_MESSAGE or a
    line past MAX_RECORD is not decoded."""
    if len(data) > MAX_AUDIT_MESSAGE:
        return [], Undecoded(1, f"{len(data)} bytes, more than {MAX_AUDIT_MESSAGE}")
    found: list[records.AuditRecord] = []
    bad, first = 0, ""
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            if len(line) > MAX_RECORD:
                raise ValueError(f"a line of {len(line)} bytes, more than {MAX_RECORD}")
            found.append(records.decode(line, records.AuditRecord))
        except (ValueError, TypeError) as e:
            bad += 1
            first = first or str(e)
    return found, (Undecoded(bad, first) if bad else None)
