"""The audit trail in batches: a router sends a flush's records as one message per key (JSON
lines), and `AuditTrail.read` / `llmgw audit` still give one record per request: all of
them across a router's stop, none twice after a retried flush, messages from before
batching too, a garbled message skipped, and a bounded queue while NATS is away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import pytest
from router_helpers import chat_body, fake_engines, router_settings, running_router
from test_router_gateway import _connect, _key, _place, _served
from waiting import until

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, NatsSettings
from llmgw.bus.counters import (
    AUDIT_MESSAGE_BYTES,
    AuditTrail,
    Counters,
    audit_messages,
    ensure_streams,
    read_audit_message,
)
from llmgw.gateway import credentials
from llmgw.gateway.gateway import AUDIT_BATCH, Admission, Gateway, GatewaySettings
from llmgw.gateway.usage import Usage

pytestmark = pytest.mark.anyio


async def _trail(bus: Bus, **kw: object) -> list[records.AuditRecord]:
    async with contextlib.aclosing(AuditTrail(bus).read(since=time.time() - 600, **kw)) as it:
        return [r async for r in it]


async def _stored_messages(bus: Bus) -> int:
    return (await bus.js.stream_info(keys.AUDIT_STREAM)).state.messages


def _record(key: str | None, n: int) -> records.AuditRecord:
    return records.AuditRecord(time=1000.0 + n, key=key, model="m", status=200, prompt_tokens=n)


async def test_a_router_stores_a_flush_of_requests_as_one_message_per_key_and_all_on_stop(
    bus: Bus, nats_settings: NatsSettings, tmp_path
) -> None:
    await ensure_streams(bus)
    alice, bob = await _key(bus, "alice"), await _key(bus, "bob")
    # no flush while it runs: what reaches the trail is what the stop sends
    settings = router_settings(gateway=GatewaySettings(flush_every=3600))
    with fake_engines(tmp_path) as fleet:
        await _place(bus, fleet.start())
        async with running_router(connect=_connect(nats_settings), settings=settings) as r:
            await until(lambda: _served(r), timeout=10)
            async with aiohttp.ClientSession() as http:

                async def post(secret: str) -> int:
                    async with http.post(
                        f"{r.url}/v1/chat/completions",
                        json=chat_body(),
                        headers={"authorization": f"Bearer {secret}"},
                    ) as resp:
                        await resp.read()
                        return resp.status

                statuses = await asyncio.gather(
                    *(post(alice) for _ in range(30)), *(post(bob) for _ in range(20)), post("no")
                )
            assert statuses.count(200) == 50 and statuses.count(401) == 1
            assert r.gateway is not None and r.gateway.audit_waiting() == 51
    trail = await _trail(bus)
    assert len(trail) == 51
    assert [r.key for r in trail].count("alice") == 30 and [r.key for r in trail].count("bob") == 20
    assert {(r.key, r.status) for r in trail} == {("alice", 200), ("bob", 200), (None, 401)}
    assert await _stored_messages(bus) == 3  # alice's, bob's, the unknown key's
    assert [r.key for r in await _trail(bus, key="bob")] == ["bob"] * 20


class _LostAnswers:
    """A sink whose first append is stored but answered with a failure (an ack lost)."""

    def __init__(self, trail: AuditTrail) -> None:
        self.trail = trail
        self.calls = 0

    async def append(self, batch) -> None:
        self.calls += 1
        await self.trail.append(batch)
        if self.calls == 1:
            raise TimeoutError("the acknowledgement was lost")


async def test_a_flush_sent_again_after_a_lost_answer_stores_no_record_twice(bus: Bus) -> None:
    await ensure_streams(bus)
    secret = credentials.new_secret("alice")
    key = records.ApiKey(name="alice", secrets=[credentials.hash_secret(secret, 0)])
    sink = _LostAnswers(AuditTrail(bus))
    g = Gateway("r1", Counters(bus), sink)
    g.apply(keys.apikey("alice"), key)
    for _ in range(AUDIT_BATCH + 5):  # two messages for alice
        a = await g.admit(authorization=f"Bearer {secret}", model="m")
        assert isinstance(a, Admission)
        a.finish(status=200, usage=Usage(1, 2))
    await g.flush()
    assert g.audit_waiting() == AUDIT_BATCH + 5  # not acknowledged: kept
    late = await g.admit(authorization=f"Bearer {secret}", model="m")
    assert isinstance(late, Admission)
    late.finish(status=200, usage=Usage(1, 2))
    await g.flush()  # the same messages again, deduplicated; the late record waits
    assert g.audit_waiting() == 1
    await g.flush()
    assert g.audit_waiting() == 0 and sink.calls == 3
    assert len(await _trail(bus)) == AUDIT_BATCH + 6
    assert await _stored_messages(bus) == 3


async def test_records_written_one_a_message_before_batching_are_still_read(bus: Bus) -> None:
    await ensure_streams(bus)
    old = records.AuditRecord(time=time.time(), key="alice", model="m", status=200)
    await bus.js.publish(f"{keys.AUDIT_ROOT}.alice", records.encode(old))
    await AuditTrail(bus).append([("b1", [_record("alice", 1), _record("alice", 2)])])
    assert [r.prompt_tokens for r in await _trail(bus, key="alice")] == [0, 1, 2]


async def test_a_garbled_audit_message_is_skipped_with_a_warning_and_reading_goes_on(
    bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_streams(bus)
    await bus.js.publish(f"{keys.AUDIT_ROOT}.alice", b"\x00 not json at all")
    half = records.encode(_record("alice", 1)) + b'\n{"time": "yesterday"}\n{"tru'
    await bus.js.publish(f"{keys.AUDIT_ROOT}.alice", half)
    await AuditTrail(bus).append([("b1", [_record("alice", 2)])])
    with caplog.at_level(logging.WARNING, logger="llmgw.bus.counters"):
        assert [r.prompt_tokens for r in await _trail(bus)] == [1, 2]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2 and "skipping 2 audit record(s)" in skipped[1]


def test_audit_messages_split_past_their_size_and_read_back_whole() -> None:
    recs = [_record("alice", n) for n in range(3000)]
    recs = [records.AuditRecord(**{**_asdict(r), "client": "x" * 200}) for r in recs]
    messages = audit_messages(recs)
    assert len(messages) > 1 and all(len(m) <= AUDIT_MESSAGE_BYTES for m in messages)
    assert audit_messages(recs) == messages  # a retry sends the same bytes
    back = [r for m in messages for r in read_audit_message(m)[0]]
    assert back == recs
    with pytest.raises(ValueError, match="one key's records"):
        audit_messages([_record("alice", 1), _record("bob", 2)])


def test_reading_an_audit_message_is_bounded() -> None:
    line = records.encode(_record("alice", 1))
    found, bad = read_audit_message(line + b"\n" + b'{"time":1,"client":"' + b"x" * 70_000 + b'"}')
    assert [r.prompt_tokens for r in found] == [1]
    assert bad is not None and bad.count == 1 and "more than" in bad.first
    found, bad = read_audit_message(line * 200_000)
    assert found == [] and bad is not None and "bytes" in bad.first


class _NoCounter:
    async def add(self, subject: str, delta: int, msg_id: str | None = None) -> int:
        raise AssertionError("nothing here is limited or metered")


class _Away:
    async def append(self, batch) -> None:
        raise TimeoutError("NATS is away")


async def test_records_waiting_for_nats_are_bounded_dropping_the_oldest() -> None:
    g = Gateway("r1", _NoCounter(), _Away(), GatewaySettings(audit_queue=10))
    for n in range(6):
        g.audit(_record("alice", n))
    await g.flush()  # six in messages being sent, kept as they are
    for n in range(6, 25):
        g.audit(_record("alice", n))
    assert g.audit_waiting() == 10 and g.audit_dropped == 15
    stored: list[records.AuditRecord] = []

    class _Back:
        async def append(self, batch) -> None:
            stored.extend(r for _, recs in batch for r in recs)

    g.audit_sink = _Back()
    await g.flush()
    await g.flush()
    assert [r.prompt_tokens for r in stored] == [*range(6), *range(21, 25)]


def _asdict(r: records.AuditRecord) -> dict:
    return {f: getattr(r, f) for f in r.__struct_fields__}
