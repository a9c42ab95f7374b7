"""Metering and audit: usage counted exactly once per request in the usage counters (also
across a cut-off link), `llmgw usage`, the audit stream and `llmgw audit`, and no secret in
any of them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import anyio
import pytest
from links import ProxyLink

from llmgw.bus import keys, records
from llmgw.bus.client import Bus, BusError, NatsSettings
from llmgw.bus.counters import AuditTrail, Counters, ensure_streams
from llmgw.bus.errors import StreamMissing
from llmgw.bus.server import EmbeddedNats
from llmgw.gateway import credentials, usage
from llmgw.gateway.gateway import Admission, Gateway
from llmgw.gateway.metering import KINDS, Meter, parse_usage_subject
from llmgw.gateway.refusals import Refusal

pytestmark = pytest.mark.anyio


def llmgw(*args: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmgw.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"LLMGW_NATS": url, "PATH": "/usr/bin:/bin"},
    )


def _gateway(bus: Bus, name: str, *values: object) -> Gateway:
    g = Gateway(name, Counters(bus), AuditTrail(bus))
    for v in values:
        if isinstance(v, records.ApiKey):
            g.apply(keys.apikey(v.name), v)
    return g


async def _usage_totals(bus: Bus) -> dict[tuple[str | None, str, str], int]:
    """(key, model, kind) -> total, summed over hours and teams."""
    out: dict[tuple[str | None, str, str], int] = {}
    for subject, value in (await Counters(bus).totals(f"{keys.USAGE_ROOT}.>")).items():
        row = parse_usage_subject(subject, value)
        assert row is not None, subject
        out[row.key, row.model, row.kind] = out.get((row.key, row.model, row.kind), 0) + value
    return out


async def test_usage_is_metered_exactly_once_across_two_routers_and_a_cut_off_link(
    bus: Bus, nats_server: EmbeddedNats, nats_settings: NatsSettings
) -> None:
    await ensure_streams(bus)
    secrets = {n: credentials.new_secret(n) for n in ("alice", "bob")}
    known = [
        records.ApiKey(name=n, team="ml", secrets=[credentials.hash_secret(s, 0)])
        for n, s in secrets.items()
    ]
    link = ProxyLink(nats_server.port)
    await link.start()
    other = await Bus.connect(
        NatsSettings(urls=(link.url,), name="cut", healthy_after=1.0), give_up_after=5
    )
    routers = [_gateway(bus, "a", *known), _gateway(other, "b", *known)]
    rng = random.Random(7)
    expected: dict[tuple[str | None, str, str], int] = {}
    models = ["tiny", "big model/v2"]  # a served name that is not a subject token

    async def request(i: int) -> None:
        name = rng.choice(list(secrets))
        model = rng.choice(models)
        g = routers[i % 2]
        admitted = await g.admit(authorization=f"Bearer {secrets[name]}", model=model)
        assert isinstance(admitted, Admission)
        u = usage.Usage(rng.randint(1, 500), rng.randint(0, 300), rng.choice([0, 0, 64]))
        await anyio.sleep(0)
        admitted.finish(status=200, usage=u, replica="r1", ttft=0.01)
        for kind, n in zip(KINDS, (1, u.prompt, u.completion, u.cached), strict=True):
            if n:
                expected[name, model, kind] = expected.get((name, model, kind), 0) + n

    try:
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(request, i)
        await routers[0].flush()
        await link.cut()  # b's counts wait while it is away
        with anyio.fail_after(10):
            while other.connected:
                await anyio.sleep(0.05)
        assert routers[1].meter.pending() > 0
        with anyio.fail_after(5):
            await routers[1].meter.flush(Counters(other))  # fails: nothing counted twice later
        await link.heal()
        with anyio.fail_after(10):
            while not await routers[1].meter.flush(Counters(other)):
                await anyio.sleep(0.1)
        assert await _usage_totals(bus) == expected

        out = llmgw("usage", "--json", "--by", "hour", "--key", "alice", url=nats_server.url)
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert {r["key"] for r in rows} == {"alice"} and {r["team"] for r in rows} == {"ml"}
        assert {r["model"] for r in rows} <= set(models)
        assert sum(r["completion"] for r in rows) == sum(
            v for (k, _, kind), v in expected.items() if k == "alice" and kind == "completion"
        )
    finally:
        await other.close()


async def test_an_increment_sent_again_with_its_message_id_is_counted_once(bus: Bus) -> None:
    await ensure_streams(bus)
    counters = Counters(bus)
    subject = f"{keys.USAGE_ROOT}.2026010100._.k.m.prompt"
    assert await counters.add(subject, 5, "id-1") == 5
    assert await counters.add(subject, 5, "id-1") == 5  # a retry of a lost answer
    assert await counters.add(subject, 2, "id-2") == 7
    assert await counters.total(subject) == 7


async def test_the_audit_trail_holds_one_record_per_request_and_no_text_or_secret(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    await ensure_streams(bus)
    secret = credentials.new_secret("alice")
    key = records.ApiKey(
        name="alice", team="ml", models=["tiny"], secrets=[credentials.hash_secret(secret, 0)]
    )
    g = _gateway(bus, "router-1", key)
    ok = await g.admit(
        authorization=f"Bearer {secret}", model="tiny", client="10.0.0.7", stream=True
    )
    assert isinstance(ok, Admission)
    ok.finish(status=200, usage=usage.Usage(12, 34, 5), replica="tiny-r1", ttft=0.05)
    denied = await g.admit(authorization=f"Bearer {secret}", model="big", client="10.0.0.7")
    assert isinstance(denied, Refusal) and denied.status == 403
    anonymous = await g.admit(authorization="Bearer wrong", model="tiny", client="10.0.0.8")
    assert isinstance(anonymous, Refusal) and anonymous.status == 401
    await g.flush()
    assert g.audit_waiting() == 0
    assert g.tokens == {("ml", "tiny"): [12, 34, 5]}  # for /metrics: only what ran

    found = [r async for r in AuditTrail(bus).read(since=time.time() - 60)]
    assert [(r.key, r.model, r.status) for r in found] == [
        ("alice", "tiny", 200),
        ("alice", "big", 403),
        (None, "tiny", 401),
    ]
    first = found[0]
    assert (first.team, first.replica, first.router, first.client) == (
        "ml",
        "tiny-r1",
        "router-1",
        "10.0.0.7",
    )
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (12, 34, 5)
    assert first.ttft_s == 0.05 and first.stream and first.duration_s >= 0
    assert found[1].refused == "model_not_allowed"

    kept = llmgw("audit", "--retention", "30d", url=nats_server.url)
    assert kept.returncode == 0, kept.stderr
    info = await bus.js.stream_info(keys.AUDIT_STREAM)
    assert info.config.max_age == 30 * 86400

    out = llmgw("audit", "--key", "alice", "--since", "1h", url=nats_server.url)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(x["model"], x["status"]) for x in lines] == [("tiny", 200), ("big", 403)]

    store = nats_server.data_dir / "jetstream"
    stored = b"".join(p.read_bytes() for p in store.rglob("*") if p.is_file())
    assert secret.encode() not in stored and secret[-64:].encode() not in stored
    # the trail cannot be purged, even by an identity allowed everything, until edited
    with pytest.raises(BusError, match="purge"):
        from llmgw.bus import classify

        await classify.answer(bus.js.purge_stream(keys.AUDIT_STREAM), "purge")


def test_two_long_names_sharing_their_first_100_bytes_count_apart() -> None:
    """A served name is one subject token of the limit and usage counters: names past the
    bound the catalog keeps (from elsewhere) must not share one."""
    meter = Meter("r")
    first, second = "org/" + "m" * 96 + "/a", "org/" + "m" * 96 + "/b"
    for model in (first, second, "é" * 50, "x/" * 50):
        meter.add(None, "k", model, 1, 2, 0, 0.0)
    subjects = sorted(meter.subjects())
    assert len(subjects) == 4 * 3  # requests, prompt, completion of each model
    models = {parse_usage_subject(s, 1).model for s in subjects}  # type: ignore[union-attr]
    assert models == {"org/" + "m" * 96 + "…", "é" * 50, "x/" * 50}  # the long two read alike...
    tokens = {keys.name_token(m) for m in (first, second)}
    assert len(tokens) == 2 and all(keys.is_token(t) for t in tokens)  # ...and count apart


def test_a_stream_asks_for_usage_and_the_usage_chunk_is_told_apart() -> None:
    body: dict[str, object] = {"stream": True, "stream_options": {"x": 1}}
    assert usage.ask_for_usage(body) is False
    assert body["stream_options"] == {"x": 1, "include_usage": True}
    asked: dict[str, object] = {"stream": True, "stream_options": {"include_usage": True}}
    assert usage.ask_for_usage(asked) is True
    not_streamed: dict[str, object] = {"stream": False}
    usage.ask_for_usage(not_streamed)
    assert "stream_options" not in not_streamed
    chunk = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,'
    chunk += b'"prompt_tokens_details":{"cached_tokens":2}}}'
    assert usage.is_usage_only_chunk(chunk)
    assert usage.of_json(chunk) == usage.Usage(3, 4, 2)
    assert not usage.is_usage_only_chunk(b'{"choices":[{"delta":{"content":"hi"}}]}')
    assert usage.of_json(b"not json") is None


async def test_audit_follow_prints_records_as_they_come(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    await ensure_streams(bus)
    follow = subprocess.Popen(
        [sys.executable, "-m", "llmgw.cli", "audit", "--follow", "--since", "1m"],
        stdout=subprocess.PIPE,
        text=True,
        env={"LLMGW_NATS": nats_server.url, "PATH": "/usr/bin:/bin"},
    )
    try:
        await anyio.sleep(2)  # most likely following by now (were it not, --since finds it)
        record = records.AuditRecord(time=time.time(), key="k", model="m", status=429)
        await AuditTrail(bus).append([("one", [record])])
        with anyio.fail_after(20):
            line = await anyio.to_thread.run_sync(follow.stdout.readline)  # type: ignore[union-attr]
        assert json.loads(line)["status"] == 429
    finally:
        follow.terminate()
        follow.wait(5)


async def test_a_stream_of_that_name_that_is_no_counter_is_refused_naming_the_fix(bus: Bus) -> None:
    from nats.js.api import StreamConfig

    await bus.js.add_stream(StreamConfig(name=keys.USAGE_STREAM, subjects=["llmgw.usage.>"]))
    with pytest.raises(BusError, match="not a counter stream.*nats stream rm LLMGW_USAGE"):
        await ensure_streams(bus)


async def test_a_limits_stream_of_one_counter_a_window_is_made_anew_as_holders_per_router(
    bus: Bus,
) -> None:
    from nats.js.api import StreamConfig

    old = StreamConfig(
        name=keys.LIMITS_STREAM,
        subjects=["llmgw.limits.>"],
        allow_msg_counter=True,
        allow_direct=True,
    )
    await bus.js.add_stream(old)
    await ensure_streams(bus)
    info = await bus.js.stream_info(keys.LIMITS_STREAM)
    assert not info.config.allow_msg_counter and info.config.max_msgs_per_subject == 1


async def test_a_fleet_without_keys_meters_and_audits_nothing(bus: Bus) -> None:
    g = _gateway(bus, "r")
    admitted = await g.admit(authorization=None, model="tiny")
    assert isinstance(admitted, Admission) and admitted.headers() == {}
    admitted.finish(status=200, usage=usage.Usage(3, 4))
    assert g.meter.pending() == 0 and g.audit_waiting() == 0
    assert g.tokens == {("", "tiny"): [3, 4, 0]}  # /metrics still counts them


async def test_counting_with_no_counter_stream_says_which_stream_and_who_makes_it(bus: Bus) -> None:
    with pytest.raises(BusError, match="stream LLMGW_USAGE does not exist.*llmgw key ls") as e:
        await Counters(bus).add(f"{keys.USAGE_ROOT}.2026010100._.k.m.prompt", 1)
    assert isinstance(e.value, StreamMissing) and e.value.stream == keys.USAGE_STREAM
