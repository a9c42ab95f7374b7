"""The bus against a real nats-server: bucket, typed reads, watches, reconnect, backoff."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter

import anyio
import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from denying import nats_denying
from links import ProxyLink
from nats.js.api import KeyValueConfig
from waiting import until

from llmgw.bus import classify, keys, records, requests, trust
from llmgw.bus.backoff import Backoff
from llmgw.bus.client import (
    MAX_VALUE_BYTES,
    BucketSettings,
    Bus,
    BusError,
    BusUnavailable,
    Fence,
    FencedOff,
    NatsSettings,
    NatsUnreachable,
    Synced,
    Update,
    Write,
    decoder,
)
from llmgw.bus.errors import Unanswered, ValueTooLarge, WrongRevision
from llmgw.bus.server import EmbeddedNats, free_port
from llmgw.errors import LlmgwError
from llmgw.sim.bare import inventory

pytestmark = pytest.mark.anyio


def _lease(node: str, seq: int) -> records.Lease:
    return records.Lease(
        node=node,
        seq=seq,
        time=1.0,
        started_at=1.0,
        memory=records.Memory(total_bytes=10, available_bytes=5),
    )


async def test_value_is_compact_ascii_json_readable_by_the_nats_cli(bus: Bus) -> None:
    await bus.put(keys.lease("node05"), _lease("node05", 1))
    raw, _ = await bus.get_raw("leases.node05")
    assert raw.startswith(b'{"node":"node05","seq":1')
    assert raw.isascii() and b"\n" not in raw


async def test_garbage_value_is_logged_and_skipped_not_fatal(bus: Bus, caplog) -> None:
    await bus.put("leases.good", _lease("good", 1))
    await bus.put("leases.bad", b"this is not json")
    await bus.put("leases.wrongtype", b'{"node":"x","seq":"one"}')
    got = await bus.list(keys.pattern(keys.LEASES), decoder(records.Lease))
    assert list(got) == ["leases.good"]
    assert await bus.get("leases.bad", decoder(records.Lease)) is None
    assert bus.skipped.keys == {"leases.bad", "leases.wrongtype"}
    # kept on the log: how to fix it is said there, to whoever runs the component
    assert "skipping leases.bad" in caplog.text and "nats kv del" in caplog.text


async def test_watch_replays_then_syncs_then_follows_live_changes(bus: Bus) -> None:
    await bus.put("leases.a", _lease("a", 1))
    seen: list[object] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            async for item in bus.watch("leases.*", decoder(records.Lease)):
                seen.append(item)
                if isinstance(item, Update) and item.value is None:
                    tg.cancel_scope.cancel()

        tg.start_soon(consume)
        await _until(lambda: any(isinstance(s, Synced) for s in seen))
        await bus.put("leases.b", _lease("b", 7))
        await bus.delete("leases.a")
    assert isinstance(seen[0], Update) and seen[0].key == "leases.a"
    assert isinstance(seen[1], Synced)
    assert seen[2].key == "leases.b" and seen[2].value.seq == 7
    assert seen[3].key == "leases.a" and seen[3].value is None


async def test_existing_bucket_with_other_replicas_is_refused_not_recreated(nats_settings) -> None:
    first = await Bus.connect(nats_settings, BucketSettings(), give_up_after=5)
    await first.put("leases.keep", _lease("keep", 1))
    await first.close()
    with pytest.raises(BusError, match=r"replicas=1 \(configured 3\).*does not recreate"):
        await Bus.connect(nats_settings, BucketSettings(replicas=3), give_up_after=5)
    again = await Bus.connect(nats_settings, BucketSettings(), give_up_after=5)
    assert (await again.get("leases.keep", decoder(records.Lease))).value.seq == 1
    await again.close()


async def test_cas_update_refuses_a_stale_revision(bus: Bus) -> None:
    rev = await bus.create("leader", records.Leader(holder="a", since=1, renewed_at=1))
    assert await bus.create("leader", records.Leader(holder="b", since=1, renewed_at=1)) is None
    assert await bus.update("leader", records.Leader(holder="a", since=1, renewed_at=2), last=rev)
    assert (
        await bus.update("leader", records.Leader(holder="b", since=1, renewed_at=2), last=rev)
        is None
    )


async def test_a_fenced_write_lands_only_while_the_fence_key_is_at_its_revision(bus: Bus) -> None:
    held = await bus.put("leader", records.Leader(holder="a", since=1, renewed_at=1))
    fence = Fence("leader", held)
    assert await bus.put(keys.health("n1"), _health("n1"), fence=fence)
    assert await bus.delete(keys.health("n1"), fence=fence)
    moved = await bus.update("leader", records.Leader(holder="b", since=2, renewed_at=2), last=held)
    with pytest.raises(FencedOff) as refused:
        await bus.put(keys.health("n2"), _health("n2"), fence=fence)
    assert refused.value.now_at == moved and refused.value.fence == fence
    assert str(refused.value) == (
        f"write to health.n2 refused: leader is at revision {moved}, not {held} as fenced"
    )
    await bus.put(keys.health("n3"), _health("n3"))
    with pytest.raises(FencedOff):
        await bus.delete(keys.health("n3"), fence=fence)
    assert await bus.get_raw(keys.health("n2")) is None  # neither refused write landed
    assert await bus.get_raw(keys.health("n3")) is not None
    assert await bus.put(keys.health("n2"), _health("n2"), fence=Fence("leader", moved))


async def _stream_config(bus: Bus) -> dict:
    msg = await bus.connection.nc.request("$JS.API.STREAM.INFO.KV_llmgw", b"", timeout=5)
    return json.loads(msg.data)["config"]


async def test_many_fenced_writes_go_in_atomic_batches_stored_whole_or_not_at_all(
    bus: Bus,
) -> None:
    before = await _stream_config(bus)
    assert not before.get("allow_atomic")
    assert bus.batches is not True  # not until asked for
    assert await bus.allow_batches() is True
    after = await _stream_config(bus)
    # only allow_atomic changed: history, value cap, subjects, direct get stay as they were
    # (the server's own metadata says the stream now needs its API level 2: nats-server 2.12)
    assert after.pop("metadata")["_nats.req.level"] == "2"
    before.pop("metadata")
    assert after == {**before, "allow_atomic": True}
    held = await bus.put("leader", records.Leader(holder="a", since=1, renewed_at=1))
    await bus.put(keys.health("gone"), _health("gone"))
    writes = [Write(keys.health(f"n{i}"), _health(f"n{i}")) for i in range(2_500)]
    writes.append(Write(keys.health("gone"), None))
    sent = _count_publishes(bus)
    await bus.write_all(writes, fence=Fence("leader", held))
    assert len(sent) <= 3 * 3  # three batches of at most 1,000: one ack each, not 2,501
    stored = await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))
    assert sorted(stored) == sorted(keys.health(f"n{i}") for i in range(2_500))

    moved = await bus.update("leader", records.Leader(holder="b", since=2, renewed_at=2), last=held)
    late = [Write(keys.health(f"late{i}"), _health(f"late{i}")) for i in range(10)]
    late.append(Write(keys.health("n1"), None))
    with pytest.raises(FencedOff) as refused:
        await bus.write_all(late, fence=Fence("leader", held))
    assert refused.value.now_at == moved
    # nothing of the refused batch: neither its puts nor its deletion
    assert await bus.get_raw(keys.health("late9")) is None
    assert await bus.get_raw(keys.health("n1")) is not None
    # a value over the cap is refused before anything is sent
    with pytest.raises(ValueTooLarge, match="health.big"):
        await bus.write_all(
            [
                Write(keys.health("first"), _health("first")),
                Write(keys.health("big"), b"x" * (MAX_VALUE_BYTES + 1)),
            ],
            fence=Fence("leader", moved),
        )
    assert await bus.get_raw(keys.health("first")) is None


def _count_publishes(bus: Bus) -> list[str]:
    """Requests made through the connection from now on (a batch's commit is one)."""
    nc = bus.connection.nc
    made: list[str] = []
    request = nc.request

    async def counting(subject, *args, **kwargs):
        made.append(subject)
        return await request(subject, *args, **kwargs)

    nc.request = counting
    return made


async def test_batches_shrink_to_the_servers_limit_and_fall_back_when_the_stream_refuses(
    bus: Bus,
) -> None:
    assert await bus.allow_batches() is True
    held = await bus.put("leader", records.Leader(holder="a", since=1, renewed_at=1))
    fence = Fence("leader", held)
    bus._batch_max = 1_500  # over nats-server's default limit (1,000): it says so, 10199
    await bus.write_all(
        [Write(keys.health(f"a{i}"), _health(f"a{i}")) for i in range(1_200)], fence=fence
    )
    assert bus._batch_max == 1_000
    assert len(await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))) == 1_200
    # an operator turns atomic batches off on the stream: writes go one at a time, said
    config = await _stream_config(bus)
    config["allow_atomic"] = False
    await bus.connection.nc.request(
        "$JS.API.STREAM.UPDATE.KV_llmgw", json.dumps(config).encode(), timeout=5
    )
    await bus.write_all(
        [Write(keys.health(f"b{i}"), _health(f"b{i}")) for i in range(30)], fence=fence
    )
    assert "atomic publish is disabled" in str(bus.batches)
    assert len(await bus.list(keys.pattern(keys.HEALTH), decoder(records.Health))) == 1_230
    with pytest.raises(FencedOff):  # one at a time, still fenced
        await bus.write_all(
            [Write(keys.health("c"), _health("c"))], fence=Fence("leader", held + 99)
        )


async def test_a_write_at_a_stale_revision_reads_as_wrong_revision_at_the_servers_revision(
    bus: Bus,
) -> None:
    # what nats-server 2.15 answers, as nats-py 2.16 raises it: a publish with an expected
    # revision raises APIError 10071, KeyValue.update its own type without the code; the
    # revision the key is at is only in the description ("wrong last sequence: N")
    first = await bus.put("k", b"1")
    now_at = await bus.put("k", b"2")
    answers = []
    for stale in (
        bus.js.publish("$KV.llmgw.k", b"3", headers={"Nats-Expected-Last-Subject-Sequence": "1"}),
        bus.kv.update("k", b"3", last=first),
    ):
        with pytest.raises(nats.errors.Error) as raised:
            await stale
        answers.append(classify.failure(raised.value, "write k"))
    assert [(type(a), a.now_at, a.err_code) for a in answers] == [
        (WrongRevision, now_at, classify.WRONG_LAST_SEQUENCE),
        (WrongRevision, now_at, None),
    ]
    assert (
        await bus.update("k", records.Leader(holder="a", since=1, renewed_at=1), last=first) is None
    )
    assert await bus.delete("k", last=first) is False


async def test_unanswered_requests_and_a_closed_connection_read_as_bus_unavailable(
    bus: Bus, nats_settings
) -> None:
    silent = await bus.nc.subscribe("llmgw.test.silent", cb=_ignore)  # hears, never answers
    with pytest.raises(BusUnavailable) as timed_out:
        await bus.request("llmgw.test.silent", timeout=0.2)
    with pytest.raises(BusUnavailable) as nobody:
        await bus.request("llmgw.test.nobody", timeout=1)
    await silent.unsubscribe()
    closed = await Bus.connect(nats_settings, give_up_after=5)
    await closed.close()
    with pytest.raises(BusUnavailable) as not_connected:
        await closed.put("k", b"after close")
    assert [e.value.why for e in (timed_out, nobody, not_connected)] == [
        Unanswered.TIMEOUT,
        Unanswered.NO_RESPONDERS,
        Unanswered.NOT_CONNECTED,
    ]
    assert str(not_connected.value) == "put k: not connected to NATS (nats: connection closed)"
    assert isinstance(not_connected.value.__cause__, nats.errors.ConnectionClosedError)


async def _ignore(msg) -> None:
    pass


async def test_an_invalid_key_is_a_bug_of_the_caller_not_a_bus_failure(bus: Bus) -> None:
    # keys come from llmgw.bus.keys, which validates ids: a key nats-py refuses is a bug, and
    # surfaces as one rather than as a BusError a caller would retry
    with pytest.raises(nats.js.errors.InvalidKeyError):
        await bus.put("no spaces allowed", b"1")


async def test_a_dropped_connection_reads_as_dropped(nats_server) -> None:
    link = ProxyLink(nats_server.port)
    await link.start()
    seen: list[Exception] = []

    async def on_error(e: Exception) -> None:
        seen.append(e)

    nc = await nats.connect(link.url, error_cb=on_error, max_reconnect_attempts=0)
    try:
        await link.cut()
        await until(lambda: _true(bool(seen)), timeout=10)
    finally:
        await nc.close()
    assert classify.problem(seen[0]) is classify.Problem.DROPPED, repr(seen[0])
    assert not classify.refusal(seen[0])


async def _true(value: bool) -> bool:
    return value


def _health(node: str) -> records.Health:
    return records.Health(node=node, phase="ready", since=1.0)


async def test_deleted_at_names_the_deletion_a_compare_and_set_recreates_the_key_at(bus) -> None:
    assert await bus.deleted_at("leader") == 0  # never existed
    stale = await bus.put("leader", records.Leader(holder="a", since=1, renewed_at=1))
    rev = await bus.put("leader", records.Leader(holder="a", since=1, renewed_at=2))
    assert await bus.deleted_at("leader") is None  # holds a value
    assert await bus.delete("leader", last=stale) is False  # refused, not raised
    assert await bus.delete("leader", last=rev)
    deleted = await bus.deleted_at("leader")
    assert deleted and deleted > rev
    again = records.Leader(holder="b", since=2, renewed_at=2)
    assert await bus.update("leader", again, last=deleted)


async def test_more_than_one_copy_asked_of_a_single_server_is_refused_saying_so(
    nats_settings,
) -> None:
    with pytest.raises(BusError, match=r"replicas=3: NATS at nats://127\.0\.0\.1:\d+ is a single"):
        await Bus.connect(nats_settings, BucketSettings(replicas=3), give_up_after=5)


async def test_a_stream_of_the_buckets_name_that_is_no_kv_bucket_is_named(
    bus: Bus, nats_settings
) -> None:
    await bus.js.add_stream(name="KV_other", subjects=["other.>"])  # not KV's config
    with pytest.raises(BusError, match="stream KV_other exists but is not a KV bucket"):
        await Bus.connect(nats_settings, BucketSettings(name="other"), give_up_after=5)


async def test_a_server_without_jetstream_is_named_not_waited_for(tmp_path) -> None:
    import subprocess

    from llmgw.bus.server import find_nats_server

    port = free_port()
    proc = subprocess.Popen(
        [str(find_nats_server()), "-a", "127.0.0.1", "-p", str(port)],  # no -js
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        settings = NatsSettings(urls=(f"nats://127.0.0.1:{port}",), backoff_base=0.05)
        with pytest.raises(BusError, match="has no JetStream, which llmgw's bucket needs"):
            # no give_up_after: a server without JetStream must not be waited on forever
            with anyio.fail_after(20):
                await Bus.connect(settings)
    finally:
        proc.terminate()
        proc.wait()


async def test_a_bucket_this_identity_may_not_create_is_said_at_once_not_waited_for(
    tmp_path,
) -> None:
    with nats_denying(tmp_path, "$JS.API.STREAM.CREATE.>", user="node") as url:
        settings = NatsSettings(urls=(url,), connect_timeout=0.5)
        with pytest.raises(BusError, match="does not exist and this identity may not create it"):
            with anyio.fail_after(20):  # no give_up_after: a refusal must not be waited on
                await Bus.connect(settings)


@pytest.mark.parametrize("replicas", [0, 6])
def test_the_agent_configs_bucket_replicas_is_one_to_five(replicas) -> None:
    from llmgw.agent.config import ConfigError, parse_config

    assert parse_config("[nats]\nbucket_replicas = 3\n").nats.bucket_replicas == 3
    with pytest.raises(ConfigError, match="'nats.bucket_replicas'.*1 <= value <= 5 copies"):
        parse_config(f"[nats]\nbucket_replicas = {replicas}\n")


async def test_watch_resumes_and_syncs_again_after_a_server_restart(tmp_path) -> None:
    port = free_port()
    server = EmbeddedNats(data_dir=tmp_path / "n", port=port)
    server.start()
    settings = NatsSettings(urls=(server.url,), backoff_base=0.05, backoff_cap=0.2)
    watcher_bus = await Bus.connect(settings, give_up_after=5)
    writer = await Bus.connect(settings, give_up_after=5)
    await writer.put("leases.a", _lease("a", 1))
    state: dict[str, int] = {}
    syncs = 0
    try:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                nonlocal syncs
                async for item in watcher_bus.watch("leases.*", decoder(records.Lease)):
                    if isinstance(item, Synced):
                        syncs += 1
                    elif item.value is None:
                        state.pop(item.key, None)
                    else:
                        state[item.key] = item.value.seq

            tg.start_soon(consume)
            await _until(lambda: syncs == 1)
            before = writer.reconnects
            server.stop()
            server.start()
            await _until(lambda: writer.reconnects > before and writer.connected, timeout=10)
            await writer.put("leases.a", _lease("a", 2))
            await _until(lambda: state == {"leases.a": 2} and syncs == 2, timeout=10)
            tg.cancel_scope.cancel()
    finally:
        await watcher_bus.close()
        await writer.close()
        server.stop()


async def test_a_key_that_vanished_while_the_watcher_was_cut_off_is_reported_deleted(
    nats_server, bus
) -> None:
    # only the watcher's link goes down: the writer changes the bucket meanwhile, and the
    # key it removes leaves no trace (no delete marker), so only the replay's absence tells
    link = ProxyLink(nats_server.port)
    await link.start()
    watcher_bus = await Bus.connect(
        NatsSettings(urls=(link.url,), backoff_base=0.05, backoff_cap=0.2), give_up_after=5
    )
    await bus.put("leases.a", _lease("a", 1))
    await bus.put("leases.b", _lease("b", 1))
    seen: list[Update[records.Lease] | Synced] = []
    try:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                async for item in watcher_bus.watch("leases.*", decoder(records.Lease)):
                    seen.append(item)

            tg.start_soon(consume)
            await _until(lambda: sum(isinstance(i, Synced) for i in seen) == 1)
            await link.cut()
            await _until(lambda: not watcher_bus.connected)
            await bus.js.purge_stream("KV_llmgw", subject="$KV.llmgw.leases.a")
            await bus.put("leases.b", _lease("b", 2))
            await link.heal()
            await _until(lambda: sum(isinstance(i, Synced) for i in seen) == 2, timeout=15)
            tg.cancel_scope.cancel()
    finally:
        await watcher_bus.close()
        await link.cut()
    after_cut = seen[seen.index(Synced()) + 1 :]
    # the vanished key is reported by the replay's end (revision 0: there is no message)
    assert Update("leases.a", None, 0) in after_cut
    assert after_cut.index(Update("leases.a", None, 0)) < after_cut.index(Synced())
    # a view, not a log: the old watch may pass on the new value before the new one replays it
    assert {i.value.seq for i in after_cut if isinstance(i, Update) and i.key == "leases.b"} == {2}


async def test_first_connect_gives_up_with_a_clear_error_when_asked() -> None:
    from llmgw.bus.client import NatsSettings

    settings = NatsSettings(
        urls=(f"nats://127.0.0.1:{free_port()}",), backoff_base=0.05, backoff_cap=0.1
    )
    # its own type: the one BusError where "is NATS running?" is the right hint
    with pytest.raises(NatsUnreachable, match="cannot connect to NATS at nats://127.0.0.1"):
        await Bus.connect(settings, give_up_after=0.5)


async def test_a_link_that_stops_answering_pings_is_left_for_another_url(nats_server) -> None:
    # a frozen server or a silent link: no reset, nothing delivered; 2 unanswered PINGs
    # and the client moves to the next URL it knows instead of waiting on it for ever
    links = {}
    for _ in range(2):
        link = ProxyLink(nats_server.port)
        await link.start()
        links[link.port] = link
    urls = tuple(link.url for link in links.values())
    settings = NatsSettings(urls=urls, name="t", ping_interval=0.3, backoff_base=0.05)
    async with Bus.open(settings, give_up_after=5) as moving:
        await moving.put("k", b"1")
        first = moving.nc.connected_url.port
        links[first].stall()  # the one it is on (nats-py shuffles the URLs)

        async def moved() -> bool:
            return moving.reconnects >= 1

        await until(moved, timeout=10)
        assert moving.nc.connected_url.port != first
        assert (await moving.get_raw("k"))[0] == b"1"
    for link in links.values():
        await link.cut()


async def test_a_pong_that_comes_after_round_trip_gave_up_does_not_break_the_connection(
    nats_server,
) -> None:
    # nats-py's own flush(timeout) leaves its cancelled PONG future queued; the late PONG
    # stops its read loop, and the connection delivers nothing more until it is dropped
    link = ProxyLink(nats_server.port)
    await link.start()
    settings = NatsSettings(urls=(link.url,), name="t", ping_interval=60)
    async with Bus.open(settings, give_up_after=5) as slow:
        link.stall()
        with pytest.raises(BusUnavailable):
            await slow.round_trip(timeout=0.3)
        await link.heal()  # the PONG arrives now, after round_trip stopped waiting for it
        assert await slow.round_trip(timeout=2) < 2
        await slow.put("k", b"after")
        assert (await slow.get_raw("k"))[0] == b"after"
        assert slow.reconnects == 0
    await link.cut()


async def test_requests_unanswered_while_the_server_still_reaches_jetstream_move_nothing(
    nats_server,
) -> None:
    # what every client sees while the bucket's stream elects a leader: its requests go
    # unanswered on every server. Asked, the server's JetStream answers: nobody moves (a
    # client that moved then could land on the one server that is really cut off)
    links = [ProxyLink(nats_server.port) for _ in range(2)]
    for link in links:
        await link.start()
    settings = NatsSettings(urls=tuple(link.url for link in links), name="t")

    async def unanswered() -> None:
        raise nats.errors.TimeoutError

    async with Bus.open(settings, give_up_after=5) as client:
        for _ in range(3):
            with pytest.raises(BusUnavailable):
                await client._js(unanswered(), "a request nobody answers")
        await client.connection._moving
        await anyio.sleep(0.5)
        assert client.reconnects == 0 and not client.connection.avoid  # no server left
    for link in links:
        await link.cut()


def test_backoff_grows_with_jitter_and_is_reset_only_explicitly() -> None:
    rng = random.Random(1)
    fleet = [Backoff(base=1.0, cap=8.0, rng=rng) for _ in range(400)]
    rounds = [[b.next_delay() for b in fleet] for _ in range(6)]
    ceilings = [1, 2, 4, 8, 8, 8]
    for delays, ceiling in zip(rounds, ceilings, strict=True):
        assert all(0 <= d <= ceiling for d in delays)
        # spread over the whole [0, ceiling]: a fleet that lost its server together does not
        # come back together (a quarter of it in one tenth of the window was the lockstep)
        tenths = Counter(int(d / ceiling * 10) for d in delays)
        assert max(tenths.values()) < len(fleet) / 5
    means = [sum(delays) / len(delays) for delays in rounds]
    assert means[3] > 2 * means[0]  # the seed's bug: it never grew
    b = fleet[0]
    b.reset()
    assert b.next_delay() <= 1.0


async def test_reconnect_delays_grow_while_the_server_stays_down(tmp_path, caplog) -> None:
    server = EmbeddedNats(data_dir=tmp_path / "n", port=free_port())
    # healthy_after leaves time to see the count before it is reset
    settings = NatsSettings(
        urls=(server.url,),
        backoff_base=0.05,
        backoff_cap=10,
        healthy_after=2.0,
        connect_timeout=0.3,  # each first-connect attempt lasts about this long
    )
    async with anyio.create_task_group() as tg:
        # the first connect fails until the server exists: its failures count up the backoff
        connected: list[Bus] = []

        async def first_connect() -> None:
            connected.append(await Bus.connect(settings))

        tg.start_soon(first_connect)
        # the Bus does not exist yet, so no state to read: the attempts are counted from
        # the log of failed connects (kept: it is what says them before there is a Bus)
        await _until(lambda: caplog.text.count("cannot connect to NATS") >= 3, timeout=15)
        server.start()
        await _until(lambda: bool(connected), timeout=10)
    b = connected[0]
    try:
        assert b.backoff.attempt >= 3  # the first connect's failures were counted...
        await _until(lambda: b.backoff.attempt == 0, timeout=10)  # ...and reset once healthy
        server.kill()
        counts: list[int] = []

        def grown() -> bool:
            counts.append(b.backoff.attempt)
            return b.backoff.attempt >= 6

        await _until(grown, timeout=15)
        # failed attempts never reset it: it only counted up while the server was away
        assert counts == sorted(counts) and counts[-1] >= 6
        server.start()
        await _until(lambda: b.connected, timeout=20)
        await _until(lambda: b.backoff.attempt == 0, timeout=10)
    finally:
        await b.close()
        server.stop()


async def _until(cond, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.02)


def test_log_level_fixture_is_active(caplog) -> None:
    logging.getLogger("llmgw.x").info("hello")
    assert "hello" in caplog.text


# --- caught up means caught up ---------------------------------------------------------------


async def test_synced_comes_only_after_every_stored_value_even_large_ones(bus: Bus) -> None:
    # nats-py's own marker came before a 900 KB value in a few runs out of twenty
    await bus.put("catalog.big", b'"' + b"x" * 900_000 + b'"')
    await bus.put("nodes.n1", b'"' + b"y" * 300_000 + b'"')
    for run in range(300):
        got = await bus.list(">", lambda b: b)
        assert set(got) == {"catalog.big", "nodes.n1"}, f"run {run}: synced with {set(got)}"
    items = [i async for i in bus.watch(">", lambda b: len(b), until_synced=True)]
    assert isinstance(items[-1], Synced) and len(items) == 3


async def test_a_list_taken_while_keys_are_rewritten_leaves_none_out(bus: Bus, second_bus) -> None:
    # the server says "nothing pending" between removing a rewritten key's old message and
    # storing its new one: a listing that took that for caught up missed the key in 1% of
    # lists (status and `place --wait` list keys while the controller rewrites them)
    for i in range(10):
        await bus.put(f"replicas.m.r{i}", b"{}")
    hot = [f"replicas.m.hot{i}" for i in range(4)]
    wanted = {*(f"replicas.m.r{i}" for i in range(10)), *hot}
    short: list[tuple[int, set[str]]] = []
    async with anyio.create_task_group() as tg:

        async def rewrite(key: str) -> None:
            n = 0
            while True:
                n += 1
                await second_bus.put(key, str(n).encode())

        for key in hot:
            tg.start_soon(rewrite, key)
        for run in range(600):
            got = set(await bus.list("replicas.>", lambda b: b))
            if got != wanted:
                short.append((run, wanted - got))
        tg.cancel_scope.cancel()
    assert not short, f"{len(short)} of 600 lists left keys out: {short[:5]}"


async def test_an_empty_pattern_syncs_at_once_and_then_follows(bus: Bus) -> None:
    seen: list[object] = []
    async with anyio.create_task_group() as tg:

        async def consume() -> None:
            async for item in bus.watch("health.*", decoder(records.Health)):
                seen.append(item)

        tg.start_soon(consume)
        await _until(lambda: seen == [Synced()])
        await bus.put("health.n1", records.Health(node="n1", phase="ready", since=1.0))
        await _until(lambda: len(seen) == 2)
        tg.cancel_scope.cancel()
    assert isinstance(seen[1], Update) and seen[1].key == "health.n1"


# --- value sizes ---------------------------------------------------------------------------


async def test_a_value_over_the_limit_is_refused_on_write_naming_key_and_sizes(bus: Bus) -> None:
    with pytest.raises(ValueTooLarge, match=r"not writing nodes\.n1: its value is 1,100,002 bytes"):
        await bus.put("nodes.n1", b'"' + b"x" * 1_100_000 + b'"')
    assert await bus.get_raw("nodes.n1") is None


async def test_a_value_over_the_limit_is_skipped_on_read(nats_settings, caplog) -> None:
    # a bucket made by another tool, with no value limit of its own
    async with Bus.open(nats_settings, give_up_after=5) as writer:
        kv = await writer.js.create_key_value(KeyValueConfig(bucket="wide"))
        await kv.put("nodes.n1", b'"' + b"x" * (MAX_VALUE_BYTES + 10) + b'"')
        await kv.put("nodes.n2", b'"small"')
    async with Bus.open(nats_settings, BucketSettings(name="wide"), give_up_after=5) as reader:
        assert reader.max_value_bytes == MAX_VALUE_BYTES
        assert await reader.get_raw("nodes.n1") is None
        assert set(await reader.list("nodes.*", lambda b: b)) == {"nodes.n2"}
    # kept on the log: why it was left out is said only there (no reader holds it)
    assert "skipping nodes.n1" in caplog.text and "over the limit of 1,000,000" in caplog.text


# --- a record's owner is its key --------------------------------------------------------------


async def test_a_node_lying_about_another_node_is_rejected_as_a_spoof_attempt(bus: Bus) -> None:
    from llmgw.cli.status import gather
    from llmgw.controller.view import View

    # what node05 may write (its own key) claiming to be node06 with 8 GPUs and a model
    lie = inventory("node06", gpus=8, held=[("llama", "local:node06")], looked=True)
    await bus.put("nodes.node05", lie)
    await bus.put("desired.tiny", b'{"model": "other", "replicas": -5}')
    await bus.put("nodes.node07", inventory("node07"))

    view = await gather(bus)
    assert set(view.nodes) == {"node07"}
    assert "tiny" not in view.models and [u.key for u in view.unreadable] == [
        "desired.tiny",
        "nodes.node05",
    ]
    assert list(view.fabrics) == ["node-node07"]

    controller_view = View()
    for key, entry in (await bus.list(">", lambda b: b)).items():
        controller_view.apply(key, entry.value, entry.revision)
    assert set(controller_view.nodes) == {"node07"} and controller_view.desired == {}

    said = {u.key: u.why for u in view.unreadable}  # what `llmgw status` says of them
    assert "nodes.node05: rejected as a spoof attempt" in said["nodes.node05"]
    assert "its node is 'node06' but the key says 'node05'" in said["nodes.node05"]
    assert "desired.tiny: rejected as a spoof attempt" in said["desired.tiny"]
    assert "replicas -5 is outside 0..10000" in said["desired.tiny"]


def _assignment(rid: str, **kw: object) -> records.Assignment:
    fields: dict[str, object] = dict(model="m1", rid=rid, profile="p", action="run", generation=1)
    return records.Assignment(**{**fields, **kw})  # type: ignore[arg-type]


def _shard(node: str, rid: str) -> records.Shard:
    return records.Shard(node=node, rid=rid, model="m1", generation=1, phase="ready", since=1.0)


def _replica(model: str, rid: str, *ranks: int) -> records.Replica:
    members = [records.ReplicaMember(node=f"n{r}", rank=r) for r in ranks or (0,)]
    return records.Replica(model=model, rid=rid, profile="p", members=members)


class _Catalog(msgspec.Struct):
    id: str  # the one field the bus checks; llmgw.catalog checks the rest


# every key family: a value that names another owner than its key
SPOOFS = [
    ("nodes.node05", inventory("node06")),
    ("leases.node05", _lease("node06", 1)),
    ("health.node05", records.Health(node="node06", phase="ready", since=1.0)),
    ("shards.node05.r1", _shard("node06", "r1")),
    ("shards.node05.r1", _shard("node05", "r2")),
    ("assign.node05.r1", _assignment("r2")),
    ("replicas.m1.r1", _replica("m2", "r1")),
    ("replicas.m1.r1", _replica("m1", "r2")),
    ("desired.m1", records.Desired(model="m2", replicas=1)),
    ("placement.m1", records.PlacementRecord(model="m2", desired=1, placed=0)),
    ("fabrics.ib-a", records.FabricHoldings(fabric="ib-b", nodes=["n1"])),
    ("catalog.m1", _Catalog(id="m2")),
    ("ops.node05", records.NodeOps(node="node06", state="cordoned")),
    ("rollout.m1", records.Rollout(model="m2", phase="complete", current=records.Revision())),
    (
        "nodes.node05",
        msgspec.structs.replace(
            inventory("node05"),
            weights=records.Weights(
                models=[
                    records.HeldModel(
                        key="k",
                        format="gguf",
                        path="/m",
                        bytes=1,
                        files=1,
                        store=records.Store(kind="local", identity="local:node06"),
                    )
                ]
            ),
        ),
    ),
]


@pytest.mark.parametrize(
    ("key", "value"), SPOOFS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SPOOFS)]
)
async def test_every_record_type_is_read_against_its_key(bus: Bus, key, value) -> None:
    await bus.put(key, records.encode(value))
    got = await bus.get(key, decoder(type(value)))
    if key.startswith("ops."):  # the one rule for what does not read: a node cordoned
        assert got is not None and got.value.node == "node05" and got.value.unschedulable
    else:
        assert got is None
    assert bus.skipped.keys == {key}
    with pytest.raises(trust.SpoofedRecord, match=f"{key}: rejected as a spoof attempt"):
        trust.check(key, value)


def _gpu_holders(node: str, procs: list[records.GpuProcess], ecc: int = 0) -> records.NodeInventory:
    inv = inventory(node, gpus=1)
    gpu = msgspec.structs.replace(
        inv.gpus.devices[0],
        processes=procs,
        errors=records.GpuErrors(ecc_uncorrected_volatile=ecc),
    )
    return msgspec.structs.replace(inv, gpus=msgspec.structs.replace(inv.gpus, devices=[gpu]))


def _ports(node: str, ports: list[int]) -> records.NodeInventory:
    taken = records.PortsTaken(low=1, high=65535, ports=ports)
    return msgspec.structs.replace(inventory(node), ports=taken)


OUT_OF_RANGE = [
    ("desired.m1", records.Desired(model="m1", replicas=-5), "replicas -5"),
    ("desired.m1", records.Desired(model="m1", replicas=10**9), "replicas 1000000000"),
    ("leases.n1", _lease("n1", -1), "seq -1"),
    ("assign.n1.r1", _assignment("r1", rank=2, nodes=2), "rank 2 is outside 0..1"),
    ("assign.n1.r1", _assignment("r1", port=70000), "port 70000"),
    ("assign.n1.r1", _assignment("r1", model="a.b"), "model 'a.b' is not an id"),
    ("replicas.m1.r1", _replica("m1", "r1", 0, 0), "ranks [0, 0]"),
    ("placement.m1", records.PlacementRecord(model="m1", desired=-1, placed=0), "desired -1"),
    ("leader", records.Leader(holder="", since=1.0, renewed_at=1.0), "holder is empty"),
    (
        "nodes.n1",
        _gpu_holders("n1", [records.GpuProcess(pid=1 + i) for i in range(17)]),
        "17 entries, more than 16",
    ),
    ("nodes.n1", _gpu_holders("n1", [records.GpuProcess(pid=0)]), "pid 0 is outside 1..4194304"),
    ("nodes.n1", _gpu_holders("n1", [records.GpuProcess(pid=9, name="x" * 65)]), "65 characters"),
    ("nodes.n1", _gpu_holders("n1", [records.GpuProcess(pid=9, used_bytes=-1)]), "used_bytes -1"),
    ("nodes.n1", _gpu_holders("n1", [records.GpuProcess(pid=9, engine=0)]), "engine 0 is outside"),
    (
        "shards.n1.r1",
        msgspec.structs.replace(_shard("n1", "r1"), gpu_used_bytes=-1),
        "gpu_used_bytes -1",
    ),
    ("nodes.n1", _gpu_holders("n1", [], ecc=-2), "ecc_uncorrected_volatile -2"),
    ("nodes.n1", _ports("n1", [70000]), "[70000] are not TCP ports"),
    ("nodes.n1", _ports("n1", list(range(1, 1026))), "1025 entries, more than 1024"),
    ("shards.n1.r1", msgspec.structs.replace(_shard("n1", "r1"), port=-1), "port -1"),
    (
        "nodes.n1",
        msgspec.structs.replace(inventory("n1"), labels={"rack id": "r1"}),
        "labels.rack id: 'rack id' is not a label name",
    ),
    ("ops.n1", records.NodeOps(node="n1", taints=["gpu flaky"]), "'gpu flaky' is not a label"),
]


@pytest.mark.parametrize(("key", "value", "why"), OUT_OF_RANGE)
def test_values_are_checked_against_their_ranges(key, value, why) -> None:
    with pytest.raises(trust.RecordRejected, match=r"^" + key.replace(".", r"\.")) as e:
        trust.check(key, value)
    assert why in str(e.value) and not isinstance(e.value, trust.SpoofedRecord)
    # readers of raw bytes (the controller's view) get the same answer
    with pytest.raises(trust.RecordRejected):
        trust.decode_for_key(key, records.encode(value))


@pytest.mark.parametrize(
    "field",
    [
        "index",
        "memory_total_bytes",
        "memory_used_bytes",
        "processes_unlisted",
        "unlisted_foreign_bytes",
        "errors.ecc_uncorrected_volatile",
        "mig_slices",
    ],
)
def test_every_gpu_count_below_zero_is_refused_with_or_without_processes(field) -> None:
    # a GPU without processes is checked in one quick test first: it must miss nothing
    for processes in ([], [records.GpuProcess(pid=9)]):
        inv = _gpu_holders("n1", processes)
        gpu = inv.gpus.devices[0]
        if field.startswith("errors."):
            gpu = msgspec.structs.replace(
                gpu, errors=msgspec.structs.replace(gpu.errors, **{field[7:]: -1})
            )
        else:
            gpu = msgspec.structs.replace(gpu, **{field: -1})
        bad = msgspec.structs.replace(inv, gpus=msgspec.structs.replace(inv.gpus, devices=[gpu]))
        with pytest.raises(
            trust.RecordRejected, match=rf"gpus\.devices\[0\]\.{field} -1 is below 0"
        ):
            trust.decode_for_key("nodes.n1", records.encode(bad))


def test_values_that_agree_with_their_keys_pass() -> None:
    trust.check("nodes.node05", inventory("node05"))
    trust.check("replicas.m1.r1", _replica("m1", "r1", 1, 0))
    trust.check("assign.n1.r1", _assignment("r1", rank=1, nodes=2, port=8000))
    trust.check("not.an.llmgw.key.at.all", inventory("x"))  # not ours: not checked
    got = trust.decode_for_key("shards.node05.r1", records.encode(_shard("node05", "r1")))
    assert isinstance(got, records.Shard)


def test_a_record_read_as_another_type_is_rejected() -> None:
    with pytest.raises(
        trust.RecordRejected, match="read as Lease, but the key holds a NodeInventory"
    ):
        trust.check("nodes.n1", _lease("n1", 1))


# --- requests ----------------------------------------------------------------------------------

SERVED = "llmgw.agent.node06.rescan"


def test_a_request_published_on_the_subject_with_an_inbox_reply_is_a_request() -> None:
    assert requests.forged(SERVED, SERVED, "_INBOX.abc.1", None) is None


@pytest.mark.parametrize(
    ("subject", "reply", "headers", "why"),
    [
        # a consumer aimed at the subject delivers stored messages under their own subject
        (
            "$KV.llmgw.catalog.x",
            "$JS.ACK.KV_llmgw.edN5g7W5.1.1.1.1796241512220935076.1",
            None,
            "nats consumer rm KV_llmgw edN5g7W5",
        ),
        # ... or, for a stream whose subject it is, under this very subject
        (SERVED, "$JS.ACK.S.c1.1.5.5.179624151.0", None, "consumer c1 of stream S"),
        (SERVED, "", {"Status": "100", "Description": "Idle Heartbeat"}, "status message"),
        (SERVED, "", None, "no reply subject"),  # an API response sent to a forged reply
        (SERVED, "$JS.FC.KV_llmgw.x.y", None, "server message"),
    ],
)
def test_what_the_server_sends_on_someones_behalf_is_not_a_request(
    subject, reply, headers, why
) -> None:
    said = requests.forged(SERVED, subject, reply, headers)
    assert said is not None and why in said


# --- settings that can never work ---------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:4222", "nats//127.0.0.1:4222", "nats://127.0.0.1:port", "nats://:4222"],
)
async def test_a_url_that_is_not_nats_is_refused_at_once_naming_it(url) -> None:
    with anyio.fail_after(5), pytest.raises(BusError) as e:
        await Bus.connect(NatsSettings(urls=(url,)))  # no give_up_after: it would retry forever
    assert repr(url) in str(e.value) and "nats://HOST:4222" in str(e.value)
    assert isinstance(e.value, LlmgwError)


@pytest.mark.parametrize(
    "url", ["nats://h:4222", "tls://h:4222", "ws://h:80", "wss://h", "h:4222", "h"]
)
def test_nats_urls_pass(url) -> None:
    NatsSettings(urls=(url,)).check_urls()


def test_websocket_and_plain_urls_do_not_mix() -> None:
    with pytest.raises(BusError, match="mix websocket"):
        NatsSettings(urls=("nats://a:4222", "ws://b:80")).check_urls()


# --- the Bus as a context manager ---------------------------------------------------------------


async def test_bus_closes_when_its_block_ends(nats_settings) -> None:
    async with Bus.open(nats_settings, give_up_after=5) as bus:
        await bus.put("leases.a", _lease("a", 1))
    assert bus.nc.is_closed
    async with await Bus.connect(nats_settings, give_up_after=5) as again:
        assert (await again.get("leases.a", decoder(records.Lease))).value.seq == 1
    assert again.nc.is_closed
    with pytest.raises(RuntimeError, match="boom"):
        async with Bus.open(nats_settings, give_up_after=5) as failing:
            raise RuntimeError("boom")
    assert failing.nc.is_closed


# --- no consumer left behind ------------------------------------------------------------------------


async def test_reading_the_bucket_leaves_no_consumer_behind(bus: Bus) -> None:
    from llmgw.cli.status import gather

    await bus.put("nodes.n1", inventory("n1"))
    await gather(bus)  # `llmgw status`: one list per key family
    info = await bus.js.stream_info("KV_llmgw")
    assert info.state.consumer_count >= 1  # they did exist

    async def none_left() -> bool:
        return (await bus.js.stream_info("KV_llmgw")).state.consumer_count == 0

    await until(none_left, timeout=20)


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.KV_llmgw.abc123XYZ.1.12345.678.1733300000000000000.42",
        "$JS.ACK.hub.ACCHASH.KV_llmgw.abc123XYZ.3.12345.678.1733300000000000000.0.RANDOM",
        "$JS.ACK._.ACCHASH.KV_llmgw.abc123XYZ.3.9.8.1733300000000000000.7",
    ],
)
def test_a_deliverys_sequences_read_from_its_reply_subject_agree_with_nats_py(reply) -> None:
    from nats.aio.msg import Msg

    from llmgw.bus.watcher import delivery

    meta = Msg(None, reply=reply).metadata
    assert delivery(reply) == (meta.sequence.stream, meta.sequence.consumer, meta.num_pending)


@pytest.mark.parametrize("reply", ["", "_INBOX.abc", "$JS.ACK.a.b.c", "$JS.ACK.s.c.1.x.2.3.4"])
def test_a_reply_subject_that_is_no_delivery_is_refused(reply) -> None:
    from llmgw.bus.watcher import delivery

    with pytest.raises(ValueError):
        delivery(reply)


def test_a_second_server_on_a_store_is_refused_before_it_writes_a_byte(nats_server) -> None:
    import os

    from llmgw.bus.storelock import StoreInUse

    conf = nats_server.config_path.read_bytes()
    second = EmbeddedNats(data_dir=nats_server.data_dir, port=free_port())
    with pytest.raises(StoreInUse, match=f"is in use by pid {os.getpid()}"):
        second.start()
    assert nats_server.config_path.read_bytes() == conf
    nats_server.stop()  # its lock goes with it: the store may be served again
    second.start()
    second.stop()
